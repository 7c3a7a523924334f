"""channels_last_conv: a 3-D conv run channels-last inside an opaque op (issue 22).

The ops agree with ATen (opcheck; values, grads and eager's output strides in every layout,
zero batch), the conditions keep it to 3-D convs not already channels-last, the screen times
the op whole and judges a 3-D conv against eager's layout only, and a compiled Conv3d runs the
op forward and backward with no generated kernel, on static and dynamic shapes.
"""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from convlower import torch_internals as ti
from convlower.decompositions import emission
from convlower.lowerings import RULES
from convlower.lowerings.channels_last_conv import RULE, opaque_ops
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall
from convlower.lowerings.site import site_of_call
from convlower.selection import auto, screen
from helpers import assert_close, clone_leaf, compare_with_eager
from convlower.tools.conv_fuzz import with_layout

aten = torch.ops.aten
PARAMS = [[1, 2, 2], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 2]  # stride ... groups


def tensors(dtype=torch.float32, layout="contiguous", batch=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 3, 9, 10, generator=g).to(dtype)
    w = torch.randn(6, 2, 2, 3, 3, generator=g).to(dtype)
    b = torch.randn(6, generator=g).to(dtype)
    return with_layout(x, layout), w, b


def conv_call(x, w, b=None):
    return ConvCall.from_args([x, w, b, *PARAMS])


@pytest.mark.parametrize("bias", [True, False])
def test_ops_pass_opcheck(bias):
    x, w, b = (t.requires_grad_() for t in tensors())
    torch.library.opcheck(torch.ops.convlower.channels_last_conv.default,
                          (x, w, b if bias else None, *PARAMS))
    g = aten.convolution(x, w, b, *PARAMS).detach()
    for mask in ([True, True, bias], [False, True, False], [True, False, False]):
        torch.library.opcheck(torch.ops.convlower.channels_last_conv_backward.default,
                              (g, x.detach(), w.detach(), *PARAMS, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "noncontig", "zero batch"])
def test_forward_and_backward_equal_eager(dtype, layout):
    """What the pass splices (forward and backward sites) and the op's own autograd give
    ATen's values, with the strides of the node they replace."""
    x, w, b = tensors(dtype, "contiguous" if layout == "zero batch" else layout,
                      batch=0 if layout == "zero batch" else 2)
    call = conv_call(x, w, b)
    ref = aten.convolution(x, w, b, *PARAMS)
    site = site_of_call(call)
    out = emission.build(site, RULE)(x, w, b)
    assert out.stride() == site.output.stride() == ref.stride()
    assert_close(out, ref)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    for mask in ([True, True, True], [False, True, False], [True, False, False]):
        want = aten.convolution_backward(g, x, w, [6], *PARAMS, mask)
        got = emission.build(site_of_call(call, "backward", mask), RULE)(g, x, w)
        for a, e in zip(got, want):
            assert (a is None) == (e is None)
            if a is not None:
                assert a.stride() == e.stride()
                assert_close(a, e)
    xl, wl, bl = (clone_leaf(t) for t in (x, w, b))
    torch.ops.convlower.channels_last_conv(xl, wl, bl, *PARAMS).backward(g)
    for leaf, e in zip((xl, wl, bl), aten.convolution_backward(g, x, w, [6], *PARAMS,
                                                              [True, True, True])):
        assert_close(leaf.grad, e)


def test_conditions_keep_it_to_3d_convs_not_already_channels_last():
    x, w, b = tensors()
    assert check(RULE, conv_call(x, w, b)).eligible
    cl = x.contiguous(memory_format=torch.channels_last_3d)
    assert check(RULE, conv_call(cl, w, b)).rejected == "activation not channels-last-3d is false"
    wcl = w.contiguous(memory_format=torch.channels_last_3d)
    assert check(RULE, conv_call(x, wcl, b)).rejected == "weight not channels-last-3d is false"
    c2 = ConvCall.from_args([torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), None,
                             [1, 1], [0, 0], [1, 1], False, [0, 0], 1])
    assert check(RULE, c2).rejected == "a 3-D conv is false"
    dilated = ConvCall.from_args([x, w, b, [1, 1, 1], [0, 0, 0], [1, 2, 1], False, [0, 0, 0], 2])
    assert check(RULE, dilated).rejected == "dilation == 1 is false"  # NDHWC crashed on such
    assert RULE.lowers and RULES["channels_last_conv"] is RULE


def test_screen_times_the_op_whole_and_a_3d_original_in_eagers_layout_only():
    """The kernels-alone figure of an opaque op is the op (its copies cannot fuse away); a
    3-D conv's original is not also timed channels-last (Inductor never runs it so)."""
    x, w, b = tensors()
    run = lambda: emission.build(site_of_call(conv_call(x, w, b)), RULE)(x, w, b)
    calls = ti.record_kernels(run, screen._opaque_ops(), fusable=[x], output_fusable=True)
    assert [f.overloadpacket for f, _, _ in calls] == [torch.ops.convlower.channels_last_conv]
    assert screen._other_layout([x, w, b]) is None
    x2 = torch.randn(1, 2, 5, 5)
    assert screen._other_layout([x2])[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.ops.convlower.channels_last_conv in opaque_ops()


@pytest.mark.parametrize("figure,chosen", [(1.0e-3, "channels_last_conv"), (1.9e-3, None)],
                         ids=["clear win", "close"])
def test_screen_takes_it_on_a_clear_win(figures, figure, chosen):
    figures({"aten": 2e-3, "channels_last_conv": figure, "channels_last_conv:kernels": figure})
    x, w, b = tensors()
    d = auto.decide(site_of_call(conv_call(x, w, b)), [RULE], None, measure_close=False)
    assert (d.rule.name if d.rule else None) == chosen, d.why


class PatchTokens(torch.nn.Module):
    """Wan's patch embedding: a Conv3d then tokens (the op's output read by views only)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(4, 8, (1, 2, 2), stride=(1, 2, 2))

    def forward(self, x):
        return self.conv(x).flatten(2).transpose(1, 2)


OPTS = {"select": "always", "rules": ["channels_last_conv"]}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_conv3d_runs_the_op_with_no_generated_kernel(dynamic):
    torch._dynamo.reset()
    m = PatchTokens()
    code = compare_with_eager(m, torch.randn(2, 4, 3, 8, 8), options=OPTS, dynamic=dynamic)
    forward = code[0]
    assert "convlower.channels_last_conv" in forward and "cpp_fused" not in forward
    assert "channels_last_conv_backward" in code[1]
    if dynamic:  # another batch and resolution: the same graph, equal to eager
        f = torch.compile(m, backend="convlower", options=OPTS, dynamic=True)
        with torch.no_grad():
            for shape in [(1, 4, 3, 8, 8), (3, 4, 2, 6, 10)]:
                x = torch.randn(shape)
                assert_close(f(x), m(x))


def test_compiled_conv3d_channels_last_input_keeps_the_original():
    """An activation already channels-last-3d: nothing to gain, the original stays."""
    torch._dynamo.reset()
    m = PatchTokens()
    x = torch.randn(2, 4, 3, 8, 8).contiguous(memory_format=torch.channels_last_3d)
    f = torch.compile(m, backend="convlower", options=OPTS)
    with torch.no_grad():
        out, code = run_and_get_code(f, x)
    assert "channels_last_conv" not in code[0]
    assert_close(out, m(x))
