"""`convlower spike`: one end-to-end spike on a tiny model, plus the parts that need no compile."""
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from convlower.tools import zoo
from convlower.__main__ import main
from convlower.tools.amortize import amortize
from convlower.tools.spike import SpikeConfig, SpikeError, recommend, resolve
from convlower.tools.spike_runner import Runner, compile_counts, errors

FACTORIES = textwrap.dedent('''
    import torch

    def tiny():
        torch.manual_seed(0)
        return torch.nn.Conv3d(4, 8, 2, stride=2), (torch.randn(1, 4, 4, 8, 8),)

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("shape mismatch in layer 3\\nsecond line")

    def broken():
        return Broken(), (torch.randn(2),)

    def raises():
        raise ValueError("no weights here")

    def wrong():
        return torch.nn.Linear(2, 2)

    NOT_A_FUNCTION = 3
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "spike_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("spike_factories", None)
    return "spike_factories"


def test_spike_end_to_end(factories, tmp_path, capsys):
    out_json, out_png = tmp_path / "spike.json", tmp_path / "spike.png"
    rc = main(["spike", f"{factories}:tiny", "--runs", "4", "--warmup", "1", "--quiet",
               "--json", str(out_json), "--plot", str(out_png)])
    stdout = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out_json.read_text())
    assert res["source"] == "factory" and res["factory"] == f"{factories}:tiny"
    assert (res["dtype"], res["device"], res["runs"], res["warmup"]) == ("float32", "cpu", 4, 1)
    assert res["steady_state_compiles"] == 0
    b = res["backends"]
    assert set(b) == {"eager", "inductor", "convlower", "convlower-regions"}
    assert len(b["eager"]["steps_s"]) == 4 and b["eager"]["step_median_s"] > 0
    for name in ("inductor", "convlower"):
        r = b[name]
        assert r["error"] is None
        for key in ("cold_first_call_s", "warm_first_call_s", "cold_compile_s", "warm_compile_s",
                    "step_median_s", "step_iqr_s", "speedup", "break_even_calls",
                    "break_even_calls_warm", "graph_breaks", "recompiles", "graphs",
                    "lowered_by_rule", "convolutions", "max_abs_err", "max_rel_err", "verdict",
                    "verdict_code", "reason"):
            assert key in r, (name, key)
        assert len(r["steps_s"]) == 4 and min(r["steps_s"]) > 0
        assert r["cold_first_call_s"] > r["step_median_s"]  # a compile happened
        assert r["cold_compile_s"] == pytest.approx(r["cold_first_call_s"] - r["step_median_s"])
        assert (r["graph_breaks"], r["recompiles"], r["graphs"]) == (0, 0, 1)
        # cache counts under the names of convlower.observe.stats
        assert set(r["cache"]) == set(r["warm_cache"]) == {
            "fx_graph_hit", "fx_graph_miss", "fx_graph_bypass",
            "aot_autograd_hit", "aot_autograd_miss", "aot_autograd_bypass"}
        assert r["max_rel_err"] < 1e-4
        # the verdict is the one the numbers give
        again = amortize(b["eager"]["step_median_s"], r["step_median_s"], r["cold_compile_s"],
                         spread_s=r["step_iqr_s"])
        assert (r["verdict"], r["break_even_calls"]) == (again.verdict, again.break_even_calls)
        assert r["speedup"] == pytest.approx(b["eager"]["step_median_s"] / r["step_median_s"] - 1)
        if r["break_even_calls"] is not None:
            saved = b["eager"]["step_median_s"] - r["step_median_s"]
            n = r["break_even_calls"]  # the first call count at which compiling has paid off
            assert n * saved >= r["cold_compile_s"] * (1 - 1e-9) and (n - 1) * saved < r["cold_compile_s"]
    # kernel == stride: convlower lowers it (patchify_mm) or records why not; Inductor lowers nothing
    convs = b["convlower"]["convolutions"]
    assert convs and convs[0]["input"] == "1x4x4x8x8" and convs[0]["kernel"] == "2x2x2"
    assert sum(b["convlower"]["lowered_by_rule"].values()) == sum(1 for c in convs if c["rule"])
    assert b["inductor"]["lowered_by_rule"] == {}
    assert res["recommendation"]["backend"] in ("eager", "inductor", "convlower", "convlower-regions")
    assert b["convlower-regions"]["regions"]["parts"] == 0  # one conv: no repeated block
    assert res["recommendation"]["session"]["plan"] in ("eager",) + tuple(b)
    # the PNG is a real image
    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and res["plot"] == str(out_png)
    import matplotlib.image

    assert matplotlib.image.imread(str(out_png)).shape[:2] == (450, 700)
    for text in ("cold compile", "break-even (cold)", "recommendation:", f"plot: {out_png}",
                 f"json: {out_json}", "convolutions seen by convlower"):
        assert text in stdout


def test_zoo_name_resolves_to_its_documented_config():
    model, inputs, desc = resolve("mochi-downsample", "tiny")
    assert isinstance(model, torch.nn.Conv3d) and inputs[0].shape == (1, 8, 4, 8, 8)
    assert desc["config"] == {"in_channels": 8, "out_channels": 16, "input": [1, 8, 4, 8, 8]}


@pytest.mark.parametrize("model, message", [
    ("resnet50", "unknown model 'resnet50': use a zoo name (qwen2.5-vl-patch-embed"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("{mod}:missing", "has no function 'missing'"),
    ("{mod}:NOT_A_FUNCTION", "has no function 'NOT_A_FUNCTION'"),
    ("{mod}:raises", "raised ValueError: no weights here"),
    ("{mod}:wrong", "must return (model, example_inputs)"),
    ("{mod}:broken", "fails in eager mode: RuntimeError: shape mismatch in layer 3"),
    (":f", "bad factory ':f'"),
])
def test_errors_are_one_clear_line(factories, capsys, model, message):
    assert main(["spike", model.format(mod=factories), "--quiet", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("convlower spike: error: ") and message in err


@pytest.mark.parametrize("options, message", [
    ("{not json", "--options is not valid JSON"),
    ("[1, 2]", "--options must be a JSON object"),
    ('{"rulez": 1}', "unknown convlower option 'rulez'"),
])
def test_bad_options_are_one_clear_line(factories, capsys, options, message):
    assert main(["spike", f"{factories}:tiny", "--options", options, "--quiet", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_missing_output_folder_is_refused_before_running(capsys, tmp_path):
    assert main(["spike", "--json", str(tmp_path / "nope" / "x.json"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_python_dash_m_lists_the_zoo():
    # the module entry point, in a fresh interpreter; no compile
    out = subprocess.run([sys.executable, "-m", "convlower", "spike", "--list"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in zoo.names():
        assert name in out.stdout
    assert f"{zoo.DEFAULT} (default)" in out.stdout


def test_default_model_is_the_zoo_default():
    from convlower.__main__ import _parser

    args = _parser().parse_args(["spike"])
    assert args.model == zoo.DEFAULT and args.size == "small"


def test_backward_step_collects_output_and_gradients():
    conv = torch.nn.Conv2d(2, 3, 2, stride=2)
    run = Runner(conv, (torch.randn(1, 2, 4, 4),), SpikeConfig(backward=True))
    vals = run.values("eager")
    assert [v.shape for v in vals] == [(1, 3, 2, 2), (3, 2, 2, 2), (3,)]  # output, weight, bias grads
    again = run.values("eager")  # grads are reset between steps, not accumulated
    assert all(torch.equal(a, b) for a, b in zip(vals, again))


def test_backward_without_parameters_differentiates_the_inputs():
    run = Runner(torch.nn.ReLU(), (torch.randn(5),), SpikeConfig(backward=True))
    assert len(run.values("eager")) == 2  # output and the input's gradient


def test_errors_measure_the_worst_tensor():
    ref = [torch.tensor([1.0, -4.0]), torch.tensor([10.0])]
    assert errors([torch.tensor([1.0, -4.5]), torch.tensor([10.0])], ref) == (0.5, 0.125)
    assert errors([torch.tensor([1.0])], ref) == (math.inf, math.inf)
    assert errors([torch.zeros(3)], [torch.zeros(2)]) == (math.inf, math.inf)


def test_compile_counts_count_graph_breaks_and_recompiles():
    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    with compile_counts() as w:
        g = torch.compile(f, backend="eager", dynamic=False)
        g(torch.ones(2))
        g(torch.ones(2, dtype=torch.float64))  # a dtype guard fails: recompile
    assert w["graph_breaks"] >= 1 and w["graph_break_reasons"]
    assert w["recompiles"] >= 1 and w["graphs"] >= 2 and w["frames_compiled"] >= 2
    torch._dynamo.reset()


def _result(backend, code, step, speedup=0.5, n=10):
    return {"backend": backend, "verdict_code": code, "verdict": code, "step_median_s": step,
            "speedup": speedup, "break_even_calls": n, "break_even_calls_warm": n}


def test_recommendation_prefers_session_load_then_the_faster_step():
    rec = recommend({"inductor": _result("inductor", "long_sessions", 1.0),
                     "convlower": _result("convlower", "session_load", 2.0)})
    assert rec["backend"] == "convlower"
    rec = recommend({"inductor": _result("inductor", "session_load", 1.0),
                     "convlower": _result("convlower", "session_load", 2.0)})
    assert rec["backend"] == "inductor"
    rec = recommend({"inductor": _result("inductor", "dont", 1.0),
                     "convlower": {"backend": "convlower", "verdict_code": "failed"}})
    assert rec["backend"] == "eager" and "stay eager" in rec["text"]


def test_plan_for_a_session_is_the_least_total_time():
    from convlower.tools.spike_report import plan_for_session

    res = {"eager": {"step_median_s": 1.0},
           "inductor": {"cold_compile_s": 60.0, "warm_compile_s": 7.0, "step_median_s": 0.88},
           "convlower": {"error": "failed"},
           "convlower-regions": {"cold_compile_s": 20.0, "warm_compile_s": 2.0, "step_median_s": 0.9}}
    assert plan_for_session(res, 10)["plan"] == "eager"          # 10 s eager vs 29 s
    short = plan_for_session(res, 300)                              # 300 vs 290 vs 284 s
    assert short["plan"] == "convlower-regions"
    assert short["totals_s"]["inductor"]["cold"] == pytest.approx(60 + 0.88 * 300)
    assert "convlower" not in short["totals_s"]                      # a failed plan is no answer
    assert plan_for_session(res, 10_000)["plan"] == "inductor"       # the faster step wins long
    assert "session of 300 calls" in recommend(res, 300)["text"]


def test_spike_error_on_bad_settings():
    from convlower.tools.spike import run_spike

    with pytest.raises(SpikeError, match="runs >= 1"):
        run_spike(SpikeConfig(model="mochi-downsample", size="tiny", runs=0, progress=False))
    with pytest.raises(SpikeError, match="unknown dtype"):
        run_spike(SpikeConfig(model="mochi-downsample", size="tiny", dtype="float8", progress=False))


def test_short_reason_names_only_whole_rejections():
    from convlower.lowerings import RULES
    from convlower.tools.spike_report import _short_reason

    every = "; ".join(f"{name}: groups == 1 is false" for name in RULES)
    assert _short_reason(every).startswith("no rule applies")
    measured = "measured: kept the original (best rule x takes 1.7x; a rule must be >= 5% faster) (cached)"
    assert _short_reason(measured) == measured.removesuffix(" (cached)")


def test_the_report_says_which_measured_calls_were_the_screens_clear_wins():
    from convlower.tools.spike_report import settling_lines

    assert settling_lines(None) == []
    one = {"conv": "forward conv x[1]", "rule": None, "changed": True, "why": "measured",
           "clear_win": True}
    lines = settling_lines({"settled": [one, dict(one, changed=False, clear_win=False)],
                            "seconds": 2.0, "left_open": 3})
    assert "1 (and 1 of the screen's clear wins) in 2.0 s, 1 changed, 3 left open" in lines[0]
    assert lines[1:] == ["    forward conv x[1]: original (measured)"]
