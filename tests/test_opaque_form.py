"""The opaque form of a lowering (convlower/decompositions/opaque_form.py): the rule's own
decomposition inside one custom op.  Same values and gradients as eager, the original's
strides, no generated kernel, chosen by the screen where compiling cannot clearly gain and by
measurement where it is within the margin of the best."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import convlower
from convlower.lowerings import RULES
from convlower import selection
from convlower.selection import auto, measure, screen
from convlower.selection.cache import CACHE, decision_key
from test_selection_cost import RULES3, mochi_site, screened  # noqa: F401  (fixture)

ops = torch.ops.convlower
P3 = ([2, 2, 2], [0, 0, 0], [1, 1, 1], False, [0, 0, 0], 1)
P2 = ([4, 4], [0, 0], [1, 1], False, [0, 0], 1)
CASES = [("patchify_mm", (2, 3, 4, 8, 8), (5, 3, 2, 2, 2), P3),
         ("time_fold_conv2d", (2, 3, 4, 8, 8), (5, 3, 2, 2, 2), P3),
         ("time_unfold_conv2d", (2, 3, 4, 8, 8), (5, 3, 2, 2, 2), P3),
         ("time_sum_conv2d", (2, 3, 4, 8, 8), (5, 3, 2, 2, 2), P3),
         ("patchify_mm", (2, 3, 8, 8), (6, 3, 4, 4), P2),
         ("patch_linear", (2, 3, 4, 4), (6, 3, 4, 4), P2)]


def _inputs(xs, ws, layout=None, batch=None):
    x = torch.randn(*((batch,) + xs[1:] if batch is not None else xs), dtype=torch.float64)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    return x, torch.randn(*ws, dtype=torch.float64), torch.randn(ws[0], dtype=torch.float64)


@pytest.mark.parametrize("rule,xs,ws,params", CASES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_each_rules_opaque_form_equals_the_original_forward_and_backward(rule, xs, ws, params,
                                                                       channels_last):
    for layout, batch in ((None, None), ("cl", None), (None, 0)):
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}[len(xs)] if layout else None
        x, w, b = _inputs(xs, ws, fmt, batch)
        ref = torch.ops.aten.convolution(x, w, b, *params)
        out = ops.lowered_conv(x, w, b, rule, "", channels_last, *params)
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(ref)
        mask = [True, True, True]
        want = torch.ops.aten.convolution_backward(g, x, w, [ws[0]], *params, mask)
        got = ops.lowered_conv_backward(g, x, w, rule, "", channels_last, True, *params, mask)
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r)
        # Inductor plans around the fake kernels' strides: the real ones must give the same.
        with FakeTensorMode() as mode:
            fx, fw, fb, fg = (mode.from_tensor(t) for t in (x, w, b, g))
            fake_out = ops.lowered_conv(fx, fw, fb, rule, "", channels_last, *params)
            fake_grads = ops.lowered_conv_backward(fg, fx, fw, rule, "", channels_last, True,
                                                   *params, mask)
        assert [t.stride() for t in (out, *got)] == [t.stride() for t in (fake_out, *fake_grads)]


def test_the_ops_pass_torchs_consistency_checks():
    x, w, b = _inputs((2, 3, 4, 8, 8), (5, 3, 2, 2, 2))
    torch.library.opcheck(ops.lowered_conv.default,
                          (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(),
                           "time_fold_conv2d", "", True, *P3))
    g = torch.randn(2, 5, 2, 4, 4, dtype=torch.float64)
    torch.library.opcheck(ops.lowered_conv_backward.default,
                          (g, x.detach(), w.detach(), "time_sum_conv2d", "", False, True, *P3,
                           [True, False, True]))


def test_the_backward_differentiates_inside_the_op_under_a_dispatch_mode():
    """The op's own autograd wrapper runs it below autograd; a profiler's or FLOP counter's
    dispatch mode on top must not break the gradient (torch.func.vjp did)."""
    x, w, _ = _inputs((2, 3, 4, 8, 8), (5, 3, 2, 2, 2))
    g = torch.randn(2, 5, 2, 4, 4, dtype=torch.float64)
    want = torch.ops.aten.convolution_backward(g, x, w, None, *P3, [True, True, False])[:2]
    with FlopCounterMode(display=False), torch.no_grad():
        got = ops.lowered_conv_backward(g, x, w, "time_fold_conv2d", "", False, False, *P3,
                                        [True, True, False])
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def _compiled(model, x, times, screened):
    screened(times)
    torch._dynamo.reset()
    convlower.reset_report()
    out, codes = run_and_get_code(torch.compile(model, backend="convlower"), x)
    return out, "".join(codes).count("cpp_fused"), convlower.report().convolutions


@pytest.mark.parametrize("kernels_alone,opaque", [(0.95, True), (0.5, False)])
def test_a_gemm_bound_winner_runs_opaque_and_generates_no_kernel(screened, kernels_alone,
                                                                opaque):
    """Kernels alone 0.95x the eager run: compiling cannot clearly gain, the opaque form runs
    and Inductor generates nothing; 0.5x: fusion clearly gains, the traced form is compiled."""
    model = torch.nn.Conv3d(4, 8, 2, 2)
    x = torch.randn(1, 4, 4, 6, 6)
    with torch.no_grad():
        out, kernels, (rec,) = _compiled(model, x, {
            "aten": 1e-2, "time_fold_conv2d": 5e-3,
            "time_fold_conv2d:kernels": 5e-3 * kernels_alone}, screened)
        torch.testing.assert_close(out, model(x))
    assert (rec.rule, rec.opaque) == ("time_fold_conv2d", opaque)
    assert (kernels == 0) == opaque
    assert ("opaque form" in str(convlower.report())) == opaque


def test_training_through_the_opaque_form_matches_eager(screened):
    screened({"aten": 1e-2, "time_sum_conv2d": 5e-3, "time_sum_conv2d:kernels": 5e-3})
    model = torch.nn.Conv3d(4, 8, (3, 2, 2), (1, 2, 2), (1, 0, 0))
    x = torch.randn(2, 4, 5, 6, 6, requires_grad=True)
    f = torch.compile(model, backend="convlower", options={"rules": ["time_sum_conv2d"]})
    out = f(x)
    out.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
    recs = convlower.report().convolutions
    assert {(c.phase, c.rule, c.opaque) for c in recs} == {
        ("forward", "time_sum_conv2d", True), ("backward", "time_sum_conv2d", True)}


def test_a_compiled_gain_under_the_screens_clear_win_is_a_close_call(screened):
    """Kernels alone 0.9x the eager run: opaque now (compiles nothing), and noted for a
    warm-up, which measures both forms."""
    screened({"aten": 1e-2, "patchify_mm": 2e-2, "time_fold_conv2d": 5e-3,
              "time_fold_conv2d:kernels": 4.5e-3, "time_sum_conv2d": 9e-3})
    d = auto.decide(mochi_site(), RULES3, None, measure_close=False)
    assert (d.rule, d.opaque, d.label) == (RULES["time_fold_conv2d"], True,
                                           "time_fold_conv2d:opaque")
    assert "opaque form" in d.why and "warm-up" in d.why


@pytest.mark.parametrize("times,label", [
    ({"time_fold_conv2d": 0.50, "time_fold_conv2d:opaque": 0.52, "patchify_mm": 0.7,
      "patchify_mm:opaque": 0.7}, "time_fold_conv2d:opaque"),
    # another rule's opaque form within the margin of the best counts too
    ({"time_fold_conv2d": 0.50, "time_fold_conv2d:opaque": 0.62, "patchify_mm": 0.6,
      "patchify_mm:opaque": 0.51}, "patchify_mm:opaque"),
    # beyond the margin the traced form is worth its kernels
    ({"time_fold_conv2d": 0.50, "time_fold_conv2d:opaque": 0.6, "patchify_mm": 0.7,
      "patchify_mm:opaque": 0.7}, "time_fold_conv2d")])
def test_measurement_takes_an_opaque_form_within_the_margin_of_the_best(cache, times, label):
    selection.set_timer(lambda name, fn, budget: dict(times, aten=1.0).get(name, 0.9))
    site = mochi_site()
    d = measure.decide(site, RULES3[:2])
    assert d.label == label and d.how == "measurement"
    stored = CACHE.lookup(decision_key(site, RULES3[:2], None, measure.METHOD))
    assert stored["opaque"] == label.endswith(":opaque")
    again = measure.decide(site, RULES3[:2])  # read back from the cache, form included
    assert (again.how, again.label) == ("cache", label)


def test_a_decision_stored_before_the_opaque_form_existed_is_the_traced_form(cache):
    site = mochi_site()
    CACHE.store(decision_key(site, RULES3, None, measure.METHOD),
                {"rule": "time_fold_conv2d", "why": "measured", "timings": {}})
    d = auto.decide(site, RULES3, None, measure_close=False)
    assert (d.how, d.label) == ("cache", "time_fold_conv2d")


def test_rules_that_are_custom_ops_already_have_no_second_opaque_form():
    from convlower.decompositions import emission
    from convlower.lowerings.site import site_of_call
    from convlower.lowerings.rule import ConvCall

    call = ConvCall.from_args([torch.randn(1, 2, 3, 4, 4), torch.randn(3, 2, 1, 1, 1), None,
                               (1, 1, 1), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    with pytest.raises(ValueError, match="no opaque form"):
        emission.build(site_of_call(call), RULES["channels_last_conv"], opaque=True)


def test_a_seed_keeps_the_form_it_was_measured_in(cache, tmp_path):
    from convlower.selection import seeds

    site = mochi_site()
    key = decision_key(site, RULES3, None, measure.METHOD)
    entries = {key: {"rule": "time_fold_conv2d", "opaque": True, "why": "measured"}}
    table = tmp_path / "seeds.json"
    assert seeds.export(entries, measure.METHOD, str(table), "test") == 1
    prev = seeds.set_seed_file(str(table))
    try:
        d = auto.decide(site, RULES3, None, measure_close=False)
    finally:
        seeds.set_seed_file(prev)
    assert (d.how, d.label) == ("cache", "time_fold_conv2d:opaque") and "seed" in d.why


@pytest.mark.parametrize("traced,deferred", [(0.50, True), (0.40, False)])
def test_a_seeds_traced_choice_without_a_clear_win_waits_for_the_warm_up(cache, tmp_path,
                                                                        traced, deferred):
    """Kernels cost a cold compile seconds: a seed's traced choice within WIN (0.85x) of the
    fastest opaque form measured with it runs that opaque form first; the warm-up then takes
    the seed's choice without measuring, and the next compile runs it."""
    from convlower.selection import close_calls, seeds

    site = mochi_site()
    key = decision_key(site, RULES3, None, measure.METHOD)
    times = {"aten": 1.0, "time_fold_conv2d": traced, "time_fold_conv2d:opaque": 0.6,
             "patchify_mm:opaque": 0.55}
    table = tmp_path / "seeds.json"
    seeds.export({key: {"rule": "time_fold_conv2d", "why": "measured", "timings": times}},
                 measure.METHOD, str(table), "test")
    selection.set_timer(lambda *a: pytest.fail("the warm-up measured a seeded call"))
    prev = seeds.set_seed_file(str(table))
    try:
        first = auto.decide(site, RULES3, None, measure_close=False)
        settled, left, _ = close_calls.settle()
        after = auto.decide(site, RULES3, None, measure_close=False)
    finally:
        seeds.set_seed_file(prev)
    assert first.label == ("patchify_mm:opaque" if deferred else "time_fold_conv2d")
    assert [(s.rule, s.changed) for s in settled] == ([("time_fold_conv2d", True)]
                                                       if deferred else [])
    assert left == 0 and after.label == "time_fold_conv2d"


def test_a_rule_failing_inside_its_opaque_form_falls_back_to_the_original(monkeypatch):
    """The decomposition runs at step time, past the compile's fault containment: a failure
    there runs the original convolution (warned once), not an exception in the user's step."""
    from convlower.decompositions import opaque_form

    def broken(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(RULES["time_fold_conv2d"], "emit", broken)
    monkeypatch.setattr(opaque_form, "_warned", set())
    x, w, b = _inputs((2, 3, 4, 8, 8), (5, 3, 2, 2, 2))
    g = torch.randn(2, 5, 2, 4, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="boom"):
        out = ops.lowered_conv(x, w, b, "time_fold_conv2d", "", False, *P3)
        grads = ops.lowered_conv_backward(g, x, w, "time_fold_conv2d", "", False, True, *P3,
                                          [True, True, True])
    torch.testing.assert_close(out, torch.ops.aten.convolution(x, w, b, *P3))
    want = torch.ops.aten.convolution_backward(g, x, w, [5], *P3, [True, True, True])
    for a, r in zip(grads, want):
        torch.testing.assert_close(a, r)


def test_the_backward_runs_under_inference_mode():
    with torch.inference_mode():
        x, w, _ = _inputs((2, 3, 4, 8, 8), (5, 3, 2, 2, 2))
        g = torch.randn(2, 5, 2, 4, 4, dtype=torch.float64)
        got = ops.lowered_conv_backward(g, x, w, "time_sum_conv2d", "", False, False, *P3,
                                        [True, True, False])
        want = torch.ops.aten.convolution_backward(g, x, w, None, *P3, [True, True, False])[:2]
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r)


def test_the_backward_runs_only_the_gemms_a_gradient_needs():
    """The backward differentiates the rule's forward; the op runs that as a trace with its
    dead code removed, so the forward's own GEMM (no gradient needs it) is not run: eagerly it
    doubled the cost of ViT's patch conv backward, compiled Inductor drops it anyway."""
    from convlower.decompositions import opaque_form
    opaque_form._traced.clear()
    mask = [False, True, True]
    for layout in (None, None, torch.channels_last):  # the 2nd call replays the 1st's trace
        x, w, b = _inputs((2, 3, 8, 8), (6, 3, 4, 4), layout)
        g = torch.randn(2, 6, 2, 2, dtype=torch.float64)
        got = ops.lowered_conv_backward(g, x, w, "patchify_mm", "", False, True, *P2, mask)
        want = torch.ops.aten.convolution_backward(g, x, w, [6], *P2, mask)
        for a, r in zip(got, [t for t in want if t is not None]):
            torch.testing.assert_close(a, r)
    assert len(opaque_form._traced) == 2   # one trace per input layout
    trace = next(iter(opaque_form._traced.values()))
    gemms = [n for n in trace.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert len(gemms) == 1   # the weight gradient's; the forward's addmm is gone


def test_the_ops_compute_in_their_inputs_dtype_under_a_callers_autocast():
    """At step time the caller's autocast is still on; the ops replace a convolution whose
    inputs the graph already cast, so their GEMMs must not be recast (fp32 stays fp32)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((2, 3, 8, 8), (6, 3, 4, 4), (6,)))
    ref = torch.ops.aten.convolution(x, w, b, *P2)
    gout = torch.randn_like(ref)
    want = torch.ops.aten.convolution_backward(gout, x, w, [6], *P2, [True, True, True])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.lowered_conv(x, w, b, "patchify_mm", "", False, *P2)
        grads = ops.lowered_conv_backward(gout, x, w, "patchify_mm", "", False, True, *P2,
                                          [True, True, True])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)
