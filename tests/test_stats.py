"""Compile statistics: graph breaks with locations, recompiles with reasons, phase times,
rewrites, the report / log / structured-trace outputs, and the ``fallback`` option.

Cache hit counters across processes are checked in test_warmup.py (subprocesses)."""
import json
import logging

import pytest
import torch

import convlower
from convlower.observe import stats
from convlower.backend.conv_pass import ConvLowerPass


class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 2, 2)

    def forward(self, x):
        y = self.conv(x)
        print("graph break here")  # BREAK_LINE
        return y.relu()


BREAK_LINE = next(i for i, line in enumerate(open(__file__), 1) if "# BREAK_LINE" in line
                  and "print" in line)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def break_run():
    """One compile with a graph break, then a shape change (recompiles); shared by the tests
    below because every compile costs seconds on CI."""
    torch._dynamo.reset()
    convlower.reset_report()
    # a graph served from Inductor's cache runs no pass: force real compiles
    caches_off = torch._inductor.config.patch(force_disable_caches=True)
    caches_off.__enter__()
    log, trace = _Capture(), _Capture()
    logger = logging.getLogger("convlower")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)
    trace_log = logging.getLogger("torch.__trace")
    trace_log.addHandler(trace)
    try:
        m = Breaks()
        f = torch.compile(m, backend="convlower", dynamic=False, options={"select": "always"})
        with torch.no_grad():
            x1, x2 = torch.randn(1, 4, 8, 8), torch.randn(2, 4, 8, 8)
            torch.testing.assert_close(f(x1), m(x1))
            torch.testing.assert_close(f(x2), m(x2))
        rep = convlower.report()
    finally:
        logger.removeHandler(log)
        logger.setLevel(old_level)
        trace_log.removeHandler(trace)
        caches_off.__exit__(None, None, None)
    torch._dynamo.reset()
    return rep, log.records, trace.records


def test_graph_break_reported_with_location(break_run):
    rep, _, _ = break_run
    breaks = [b for c in rep.compiles for b in c["graph_breaks"]]
    assert breaks, rep.compiles
    assert any(b["location"] == f"{__file__}:{BREAK_LINE}" for b in breaks), breaks
    assert all("print" in b["reason"] for b in breaks), breaks


def test_recompile_reported_with_reason(break_run):
    rep, _, _ = break_run
    reasons = [c["recompile_reason"] for c in rep.compiles if c["recompile_reason"]]
    assert reasons, rep.compiles
    assert any("size mismatch" in r and "expected 1, actual 2" in r for r in reasons), reasons


def test_graphs_and_rewrites_counted(break_run):
    rep, _, _ = break_run
    # two frames (before / after the break) x two shapes, one graph each
    fw = [c for c in rep.compiles if c["phase"] == "forward"]
    assert len(fw) == 4
    assert all(len(c["graphs"]) == 1 for c in fw)
    assert len({c["graphs"][0] for c in fw}) == 4
    with_conv = [c for c in fw if c["rewrites"]]
    assert len(with_conv) == 2  # the conv sits in the first frame only
    assert all(c["rewrites"] == {"patchify_mm": 1} for c in with_conv)
    assert stats.totals(rep.compiles)["rewrites"] == {"patchify_mm": 2}


def test_phase_times_present_and_sum_to_total(break_run):
    rep, _, _ = break_run
    for c in rep.compiles:
        p = c["phases_s"]
        assert set(p) == set(stats.PHASES)
        assert all(v >= 0 for v in p.values()), p
        assert c["total_s"] > 0
        assert sum(p.values()) == pytest.approx(c["total_s"], abs=2e-3), c
        assert p["codegen"] > 0 or c["cache"]["fx_graph_hit"]  # Inductor generated code
    # the pass that lowered a conv took measurable time, and only inside its compile
    assert all(c["phases_s"]["convlower"] > 0 for c in rep.compiles if c["rewrites"])


def test_measuring_compiles_count_once(cache, monkeypatch):
    """Measuring compiles candidates inside convlower's pass: their seconds belong to the
    convlower phase only, not again to Inductor / code generation (phases sum to the total)."""
    from convlower import selection
    from convlower.selection import measure

    monkeypatch.setattr(measure, "MIN_CONV_S", 0.0)  # measure this small conv all the same
    compiled = []

    def timer(label, fn, budget_s):  # real compiles, stubbed times: the original wins
        compiled.append(fn.compiled())
        return 1.0 if label == "aten" else 2.0

    selection.set_timer(timer, compiles=True)
    f = torch.compile(torch.nn.Conv2d(4, 8, 2, 2), backend="convlower", dynamic=False,
                      options={"select": "exhaustive"})
    with torch.no_grad():
        f(torch.randn(1, 4, 8, 8))
    assert compiled and all(compiled)  # the candidates really were compiled by Inductor
    (c,) = convlower.report().compiles
    p = c["phases_s"]
    assert sum(p.values()) == pytest.approx(c["total_s"], abs=2e-3), c
    assert p["aot_autograd"] > 0 and p["inductor"] > 0, p


def test_report_str_and_json(break_run):
    rep, _, _ = break_run
    text = str(rep)
    assert text.count("convlower compile ") == len(rep.compiles)
    assert "1 graph break at " in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert len(d["compiles"]) == len(rep.compiles)


def test_logged_summary_at_info_detail_at_debug(break_run):
    rep, records, _ = break_run
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG
             and "compile statistics" in r.getMessage()]
    assert sum(m.startswith("convlower compile ") for m in info) == len(rep.compiles)
    assert all("\n" not in m for m in info)
    assert len(debug) == len(rep.compiles) and '"phases_s"' in debug[0]


def test_structured_trace_artifact(break_run):
    rep, _, trace = break_run
    ours = [r for r in trace if r.metadata.get("artifact", {}).get("name") == stats.ARTIFACT]
    assert len(ours) == len(rep.compiles)
    payload = json.loads(ours[0].payload)
    assert payload["compile_id"] == rep.compiles[0]["compile_id"]
    assert "frame_id" in ours[0].metadata  # tlparse files it under its compile


def test_backward_gets_its_own_record():
    m = torch.nn.Conv2d(4, 8, 2, 2)
    f = torch.compile(m, backend="convlower", options={"select": "always"})
    f(torch.randn(1, 4, 8, 8)).sum().backward()
    compiles = convlower.report().compiles
    assert [c["phase"] for c in compiles] == ["forward", "backward"]
    fw, bw = compiles
    assert bw["compile_id"] == fw["compile_id"] and bw["frame"] == fw["frame"]
    assert bw["rewrites"] == {"patchify_mm": 1} and bw["phases_s"]["dynamo"] == 0


class _Boom(RuntimeError):
    pass


def _failing_pass(monkeypatch):
    run = ConvLowerPass._run

    def broken(self, graph):
        run(self, graph)  # lowers the conv, then something downstream fails
        raise _Boom("simulated failure after the rewrite")

    monkeypatch.setattr(ConvLowerPass, "_run", broken)


def test_failed_compile_names_graph_and_rule(monkeypatch):
    _failing_pass(monkeypatch)
    f = torch.compile(torch.nn.Conv2d(4, 8, 2, 2), backend="convlower", options={"select": "always"})
    with torch.no_grad(), pytest.raises(Exception) as info:
        f(torch.randn(1, 4, 8, 8))
    msg = str(info.value)
    assert "CompileError" in msg and "convlower failed to compile graph" in msg
    assert "patchify_mm (forward convolution)" in msg and "_Boom" in msg
    assert "fallback" in msg


def test_fallback_inductor_warns_and_compiles(monkeypatch, caplog):
    _failing_pass(monkeypatch)
    m = torch.nn.Conv2d(4, 8, 2, 2)
    f = torch.compile(m, backend="convlower", options={"select": "always", "fallback": "inductor"})
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="convlower"):
        torch.testing.assert_close(f(x), m(x))
    assert any("plain Inductor" in r.getMessage() and "patchify_mm" in r.getMessage()
               for r in caplog.records)
