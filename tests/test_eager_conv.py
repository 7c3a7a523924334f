"""eager_conv: the original conv as eager calls it, opaque to Inductor (issue 23 item 2).

The ops agree with ATen (opcheck; values and grads in every layout, zero batch), the site
condition follows Inductor's layout decision, selection takes it only when the original in
Inductor's layout is clearly slower (injected figures: no test depends on real timings), and
a compiled conv really runs the opaque ops forward and backward.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import convlower
from convlower import selection, torch_internals
from convlower.decompositions import emission
from convlower.lowerings import RULES
from convlower.lowerings.eager_conv import RULE, inductor_format
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall
from convlower.lowerings.site import site_of_call
from convlower.selection import auto, measure, screen
from helpers import LAYOUTS, assert_close, clone_leaf
from convlower.tools.conv_fuzz import with_layout

aten = torch.ops.aten
PARAMS = dict(stride=[2, 1], padding=[1, 0], dilation=[1, 2], groups=2)


def conv_call(x, w, b=None, p=PARAMS):
    return ConvCall.from_args([x, w, b, p["stride"], p["padding"], p["dilation"], False, [0, 0],
                               p["groups"]])


def tensors(dtype=torch.float32, layout="contiguous", batch=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 9, 10, generator=g).to(dtype)
    w = torch.randn(6, 2, 3, 3, generator=g).to(dtype)
    b = torch.randn(6, generator=g).to(dtype)
    return with_layout(x, layout), w, b


def params_list(p=PARAMS):
    return [p["stride"], p["padding"], p["dilation"], False, [0, 0], p["groups"]]


@pytest.mark.parametrize("bias", [True, False])
def test_ops_pass_opcheck(bias):
    x, w, b = (t.requires_grad_() for t in tensors())
    torch.library.opcheck(torch.ops.convlower.eager_conv.default,
                          (x, w, b if bias else None, *params_list()))
    g = aten.convolution(x, w, b, *params_list()).detach()
    for mask in ([True, True, bias], [False, True, False], [True, False, False]):
        torch.library.opcheck(torch.ops.convlower.eager_conv_backward.default,
                              (g, x.detach(), w.detach(), *params_list(), mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS + ["zero batch"])
def test_forward_and_backward_equal_eager(dtype, layout):
    """What the pass splices (emission.build, forward and backward sites) and the op's own
    autograd give ATen's values: bitwise in fp32 (the same kernel on the same strides), within
    bf16 rounding otherwise."""
    x, w, b = tensors(dtype, "contiguous" if layout == "zero batch" else layout,
                      batch=0 if layout == "zero batch" else 2)
    call = conv_call(x, w, b)
    rel = 0.0 if dtype == torch.float32 else None
    ref = aten.convolution(x, w, b, *params_list())
    site = site_of_call(call)
    out = emission.build(site, RULE)(x, w, b)
    assert out.stride() == site.output.stride()  # what the node it replaces has
    assert_close(out, ref, rel=rel)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    for mask in ([True, True, True], [False, True, False]):
        want = aten.convolution_backward(g, x, w, [6], *params_list(), mask)
        got = emission.build(site_of_call(call, "backward", mask), RULE)(g, x, w)
        for a, e in zip(got, want):
            assert (a is None) == (e is None)
            if a is not None:
                assert_close(a, e, rel=rel)
    # eager autograd through the op (its registered backward is the opaque backward op)
    xl, wl, bl = (clone_leaf(t) for t in (x, w, b))
    torch.ops.convlower.eager_conv(xl, wl, bl, *params_list()).backward(g)
    for leaf, e in zip((xl, wl, bl), aten.convolution_backward(g, x, w, [6], *params_list(),
                                                              [True, True, True])):
        assert_close(leaf.grad, e, rel=rel)


def test_site_condition_follows_inductors_layout_decision():
    x, w, b = tensors()
    call = conv_call(x, w, b)
    boundary = dict(layout_opt=True, input_produced=False)  # a graph input: Inductor copies it
    assert check(RULE, call, site=site_of_call(call, **boundary)).eligible
    assert check(RULE, call, site=site_of_call(call, layout_opt=True, output_consumed=False)
                 ).eligible  # the output leaves the graph: copied back
    why = check(RULE, call, site=site_of_call(call, input_produced=False)).rejected
    assert why == "Inductor would run the original in another layout than eager is false"
    # inside a graph (made by an op, read by an op) channels-last costs no copy
    assert not check(RULE, call, site=site_of_call(call, layout_opt=True)).eligible
    cl = conv_call(x.contiguous(memory_format=torch.channels_last), w, b)  # eager's layout too
    assert not check(RULE, cl, site=site_of_call(cl, **boundary)).eligible
    c3 = ConvCall.from_args([torch.randn(1, 2, 4, 5, 5), torch.randn(3, 2, 3, 3, 3), None,
                             [1] * 3, [0] * 3, [1] * 3, False, [0] * 3, 1])
    assert inductor_format(site_of_call(c3, **boundary)) is None  # 3-D: as eager
    # Inductor's own decision on a traced graph: on by mkldnn for a CPU conv, off without one
    gm = torch.fx.symbolic_trace(torch.nn.Sequential())
    assert torch_internals.inductor_layout_opt(gm.graph, True) is False
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x, w: aten.convolution(x, w, None, *params_list()))(x, w)
    assert torch_internals.inductor_layout_opt(traced.graph, True) is \
        torch.backends.mkldnn.is_available()
    # A backward graph holds convolution_backward only: Inductor runs it in the strides it
    # gets (eager's), so eager_conv has nothing to gain there unless layout opt is forced.
    g = aten.convolution(x, w, None, *params_list())
    bwd = torch.fx.experimental.proxy_tensor.make_fx(lambda g, x, w: aten.convolution_backward(
        g, x, w, None, *params_list(), [True, True, False]))(g, x, w)
    assert torch_internals.inductor_layout_opt(bwd.graph, False) is False


FIG = screen.INDUCTOR_LAYOUT


def layout_site(**kw):
    x, w, b = tensors()
    return site_of_call(conv_call(x, w, b), layout_opt=True, **{"input_produced": False, **kw})


@pytest.mark.parametrize("times,chosen", [
    ({"aten": 2e-3, "eager_conv": 1.0e-3, FIG: 2e-3}, "eager_conv"),   # relayout costs 2x
    ({"aten": 2e-3, "eager_conv": 1.8e-3, FIG: 2e-3}, "eager_conv"),   # 0.90x: by the margin
    ({"aten": 2e-3, "eager_conv": 1.95e-3, FIG: 2e-3}, None),          # 0.975x: not clear
    ({"aten": 2e-3, "eager_conv": 2.1e-3, FIG: 2e-3}, None),           # the eager call loses
    ({"aten": 0.5e-3, "eager_conv": 0.3e-3, FIG: 0.5e-3}, "eager_conv"),  # under 1 ms too
    ({"aten": 0.5e-3, "eager_conv": 0.49e-3, FIG: 0.5e-3}, None),       # ... when clear
    ({"aten": 0.1e-3, "eager_conv": 0.05e-3, FIG: 0.1e-3}, None),       # tiny conv
    ({"aten": 2e-3, "eager_conv": 1e-3, FIG: 2e-3, "patchify_mm": 0.5e-3}, "patchify_mm"),
], ids=["inductor layout loses", "by the margin", "close", "eager loses", "small", "small close", "tiny",
        "a lowering wins first"])
def test_screen_takes_eager_conv_only_when_inductors_layout_clearly_loses(figures, times,
                                                                           chosen):
    """The GPU/CPU case alike: the screen's figures decide (here injected)."""
    figures(times)
    d = auto.decide(layout_site(), [RULES["patchify_mm"], RULE], None, measure_close=False)
    assert (d.rule.name if d.rule else None) == chosen, d.why
    if chosen == "eager_conv":
        assert "Inductor's layout" in d.why and d.how == "screen"


def test_eager_screen_times_inductors_layout_only_where_it_differs():
    """The real screen adds the eager call and the original in Inductor's layout (copies of
    the activation and weight to channels-last, the output back) for a 2-D conv under layout
    optimisation, and times neither for a site Inductor runs as eager does."""
    site = layout_site(output_consumed=False)
    times = screen.eager_screen(site, [RULE], None)
    assert set(times) == {"aten", "eager_conv", FIG}
    assert set(screen.eager_screen(site_of_call(site.call), [RULE], None)) == {"aten"}


def test_measure_and_heuristic_and_always(cache):
    prev = selection.set_timer(lambda label, fn, budget: {"aten": 1.0, "eager_conv": 0.5}[label])
    try:
        d = measure.decide(layout_site(), [RULE], None)
        assert d.rule is RULE and d.how == "measurement", d.why
        selection.clear_memory()
        selection.set_cache_dir(cache / "2")
        selection.set_timer(lambda label, fn, budget: {"aten": 1.0, "eager_conv": 0.97}[label])
        assert measure.decide(layout_site(), [RULE], None).rule is None  # within the margin
    finally:
        selection.set_timer(prev)
    assert selection.choose(layout_site(), [RULE], "always").rule is None  # never forced
    assert selection.choose(layout_site(), [RULES["patchify_mm"], RULE], "always").rule \
        is RULES["patchify_mm"]
    assert selection.choose(layout_site(), [RULE], "heuristic").rule is RULE  # fp32 on CPU


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs mkldnn (layout opt)")
def test_compiled_graph_runs_the_opaque_ops_forward_and_backward(figures):
    """A Conv2d compiled under the default select: with figures saying Inductor's layout
    loses, forward and backward become the opaque ops; no aten convolution is left, values
    and grads equal eager's.  Layout optimisation is forced so that the backward graph (which
    Inductor would otherwise run in eager's strides) has something to gain too."""
    figures({"aten": 2e-3, "eager_conv": 1e-3, FIG: 2e-3})
    conv = torch.nn.Conv2d(4, 6, 3, padding=1)
    x = torch.randn(2, 4, 8, 8)
    xe, xc = clone_leaf(x), clone_leaf(x)
    ref = conv(xe)
    ref.sum().backward()
    ref_grads = [xe.grad, conv.weight.grad, conv.bias.grad]
    conv.zero_grad()
    f = torch.compile(conv, backend="convlower", options={"force_layout_optimization": True})

    def step():
        out = f(xc)
        out.sum().backward()
        return out

    out, (fwd, bwd) = run_and_get_code(step)
    assert_close(out, ref, rel=0.0)
    for got, want in zip([xc.grad, conv.weight.grad, conv.bias.grad], ref_grads):
        assert_close(got, want)
    chosen = {(c.phase, c.rule) for c in convlower.report().convolutions}
    assert chosen == {("forward", "eager_conv"), ("backward", "eager_conv")}, chosen
    assert "convlower.eager_conv.default" in fwd and "convolution(" not in fwd
    assert "convlower.eager_conv_backward.default" in bwd
    assert "convolution_backward" not in bwd.replace("eager_conv_backward", "")
    # The ops get the graph's own tensors, in eager's strides (exact-strides tag): no layout
    # copy is generated even with layout optimisation forced.
    assert re.search(r"eager_conv\.default\(primals_\d+, primals_\d+", fwd), fwd
    assert re.search(r"eager_conv_backward\.default\(tangents_1, primals_\d+, primals_\d+", bwd)
    assert "cpp_fused" not in fwd + bwd
