"""The report users act on: a graph break's reason (Dynamo's explanation, the user's frame and
code line, the graph-break code) in report() str and dict, in the compile statistics and in
the structured-trace artifact; str(report()) readable at 120 columns with the full text in
to_dict()."""
import json

import torch

import convlower
from convlower.observe import breaks
from convlower.observe.records import CompileRecord, ConvRecord
from convlower.observe.report import Report

OPTS = {"select": "always", "rules": ["patchify_mm"]}


def _conv():
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, 8, 4, stride=4)


def _break_in(fn, x):
    """Compile ``fn`` with convlower: the report and its one graph break."""
    torch.compile(fn, backend="convlower", options=OPTS)(x)
    rep = convlower.report()
    gbs = [b for c in rep.compiles for b in c.graph_breaks]
    assert len(gbs) == 1, rep.compiles
    assert rep.lowered("forward"), str(rep)  # the conv before the break was lowered
    return rep, gbs[0]


def _line(marker: str) -> int:
    return next(i for i, ln in enumerate(open(__file__), 1) if marker in ln and "#" in ln)


def _check_common(rep, b, marker, source):
    line = _line(marker)
    assert b["location"] == f"{__file__}:{line}"
    assert b["frame"].startswith(f"{__file__}:{line} in ")
    assert b["source"] == source
    text = str(rep)
    assert "graph breaks (1):" in text and source in text and b["code"] in text
    assert all(len(ln) <= 120 for ln in text.splitlines()), text
    d = rep.to_dict()
    (gb,) = [g for c in d["compiles"] for g in c["graph_breaks"]]
    assert gb == b and json.dumps(d)
    summary = [c.summary for c in rep.compiles if c.graph_breaks][0]
    assert b["code"] in summary and b["type"] in summary  # the statistics' one-liner


def test_break_reason_print():
    m = _conv()

    def f(x):
        y = m(x)
        print("convlower test")  # PRINT_BREAK
        return y.relu()

    rep, b = _break_in(f, torch.randn(2, 3, 8, 8))
    assert b["code"] == "GB0059"
    assert b["type"] == "Failed to trace builtin operator"
    assert "`print`" in b["explanation"] and b["reason"].startswith(b["type"])
    assert b["hints"] and "print" in b["hints"][0]
    _check_common(rep, b, "PRINT_BREAK", 'print("convlower test")  # PRINT_BREAK')


def test_break_reason_unsupported_builtin():
    m = _conv()

    def f(x):
        y = m(x)
        bytearray(3)  # BUILTIN_BREAK
        return y.relu()

    rep, b = _break_in(f, torch.randn(2, 3, 8, 8))
    assert b["code"] == "GB0059" and "`bytearray`" in b["explanation"]
    _check_common(rep, b, "BUILTIN_BREAK", "bytearray(3)  # BUILTIN_BREAK")


def test_break_reason_data_dependent_branch():
    m = _conv()

    def f(x):
        y = m(x)
        if y.sum() > 0:  # BRANCH_BREAK
            return y + 1
        return y - 1

    rep, b = _break_in(f, torch.randn(2, 3, 8, 8))
    assert b["code"] == "GB0170" and b["type"] == "Data-dependent branching"
    assert "data-dependent branching" in b["explanation"]
    assert any("torch.cond" in h for h in b["hints"])
    _check_common(rep, b, "BRANCH_BREAK", "if y.sum() > 0:  # BRANCH_BREAK")


def test_break_artifact_in_structured_trace(monkeypatch):
    """The tlparse artifact (convlower_compile_stats) carries the parsed break."""
    import convlower.torch_internals as ti

    seen = []
    monkeypatch.setattr(ti, "trace_artifact", lambda name, payload, cid=None:
                        seen.append((name, payload)))
    m = _conv()

    def f(x):
        y = m(x)
        print("convlower test")
        return y.relu()

    _break_in(f, torch.randn(2, 3, 8, 8))
    gbs = [g for name, p in seen if name == "convlower_compile_stats" for g in p["graph_breaks"]]
    assert gbs and gbs[0]["code"] == "GB0059" and gbs[0]["source"] == 'print("convlower test")'


def test_parse_keeps_unknown_shapes():
    b = breaks.parse("Graph break in user code at /x.py:3\nGraph Break Reason: something new\n"
                     "  Hint: try this\n")
    assert b["location"] == "/x.py:3" and b["reason"] == "something new" and b["code"] is None
    assert breaks.parse("an unrelated debug line") is None
    assert "something new" in breaks.describe(b)


def test_report_readable_at_120_columns():
    call = {"input": ["s33", "3", "s69", "s87"], "weight": ["16", "3", "4", "4"],
            "stride": [4, 4], "padding": [0, 0], "dtype": "float32"}
    guards = [f"emission: Eq(s87*s69*{i}, ((s87//4))*((s87//((s87//4))))) " + "x" * 150
              for i in range(9)]
    convs = [ConvRecord("graph0", "forward", "convolution", call, rule="patchify_mm",
                        how="forced", guards=guards),
             ConvRecord("graph0", "backward", "?", {}, from_cache=True,
                        reason="from cache, details unavailable: " + "y" * 200)]
    summary = "convlower compile 0/0 forward f: " + "z " * 200
    comp = CompileRecord("0/0", "forward", "f", ["graph0"], [], None, 1.0, {}, {}, {}, [],
                         None, None, summary=summary)
    rep = Report({"convolutions": convs, "snake": [], "compiles": [comp]})
    text = str(rep)
    assert all(len(ln) <= 120 for ln in text.splitlines()), text
    assert "9: see below" in text and "... and 3 more" in text and "cache" in text
    assert rep.to_dict()["convolutions"][0]["guards"] == guards  # full text
