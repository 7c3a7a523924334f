"""One emission builder: pad folding as a pass step, and the function timed is the one spliced."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import convlower
from convlower import selection, torch_internals as ti
from convlower.backend.pad_fold import fold_pad
from convlower.decompositions import emission
from convlower.lowerings import RULES

aten = torch.ops.aten


def _conv_node(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    (node,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    return node


def test_pad_fold_on_a_hand_built_graph():
    x, w = torch.randn(1, 2, 4, 6, 6), torch.randn(3, 2, 3, 3, 3)
    # Wan's causal pad: (W 1,1) (H 1,1) (T 2,0): spatial parts fold, the time pad stays
    node = _conv_node(lambda x, w: F.conv3d(F.pad(x, (1, 1, 1, 1, 2, 0)), w), x, w)
    folded = fold_pad(node)
    assert folded.source is node.args[0].args[0]  # the pad's input
    assert folded.fold.pads == (1, 1, 1, 1, 2, 0) and folded.fold.rest == (0, 0, 0, 0, 2, 0)
    assert folded.call.padding == (0, 1, 1)  # conv's own padding + the folded symmetric part
    assert [int(s) for s in folded.call.x.shape] == [1, 2, 6, 6, 6]  # time pad left on x

    sym = _conv_node(lambda x, w: F.conv3d(F.pad(x, (1, 1, 1, 1, 1, 1)), w, padding=(1, 0, 0)), x, w)
    assert fold_pad(sym).fold.rest is None and fold_pad(sym).call.padding == (2, 1, 1)
    for fn in (lambda x, w: F.conv3d(F.pad(x, (1, 1, 1, 1, 1, 1), value=1.0), w),  # non-zero
               lambda x, w: F.conv3d(F.pad(x, (0, 0, 0, 0, 2, 0)), w),  # nothing symmetric
               lambda x, w: F.conv3d(x, w)):  # no pad
        assert fold_pad(_conv_node(fn, x, w)) is None


@pytest.mark.parametrize("winner", ["time_sum_conv2d", "time_sum_conv2d:opaque"])
def test_the_function_timed_is_the_function_spliced(cache, monkeypatch, winner):
    """Selection and the pass both call emission.build; traced on the site's inputs the two
    functions give the same graph, leftover pad included (the timed copy once lacked it), in
    either form of the rule (traced, or opaque: one custom op)."""
    built = []
    real_build = emission.build

    def spy(site, rule, compute_dtype=None, opaque=False):
        fn = real_build(site, rule, compute_dtype, opaque)
        built.append((site, rule, opaque, fn))
        return fn

    monkeypatch.setattr(emission, "build", spy)
    monkeypatch.setattr(selection.measure, "MIN_CONV_S", 0.0)
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0, winner: 0.5}.get(label, 0.8))
    conv = torch.nn.Conv3d(2, 3, 3)
    model = lambda v: conv(F.pad(v, (1, 1, 1, 1, 2, 0))).relu()
    f = torch.compile(model, backend="convlower",
                      options={"rules": ["time_sum_conv2d"], "select": "exhaustive"})
    x = torch.randn(1, 2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x), rtol=1e-5, atol=1e-5)
    (entry,) = convlower.report().convolutions
    opaque = winner.endswith(":opaque")
    assert (entry.rule, entry.opaque, entry.how) == ("time_sum_conv2d", opaque, "measurement")
    ruled = [(site, fn) for site, rule, form, fn in built
             if rule is RULES["time_sum_conv2d"] and form == opaque]
    assert len(ruled) == 2  # once timed, once spliced
    codes = [ti.trace_aten(fn, list(site.inputs)).code for site, fn in ruled]
    assert codes[0] == codes[1]
    assert "constant_pad_nd" in codes[0]  # the leftover time pad is part of what was timed
    assert ("lowered_conv" in codes[0]) == opaque


@pytest.mark.parametrize("op,args", [
    ("dense", lambda: (torch.randn(2, 3, 4).transpose(1, 2),)),
    ("stack", lambda: ([torch.randn(2, 3), torch.randn(2, 3)[:, [2, 0, 1]]], 1)),
])
def test_opaque_copy_ops_pass_opcheck(op, args):
    """Fake kernels, autograd and schema of convlower::dense / convlower::stack agree with the
    real kernels (torch's own consistency checks, run on requires-grad inputs)."""
    a = args()
    grads = tuple(t.requires_grad_() for t in (a[0] if isinstance(a[0], list) else a[:1]))
    assert grads
    torch.library.opcheck(getattr(torch.ops.convlower, op).default, a)


@pytest.mark.parametrize("produced", [False, True], ids=["graph input", "made in the graph"])
def test_tap_stack_is_opaque_only_on_a_graph_input(produced):
    """A Conv3d reading a graph input stacks its taps with the opaque convlower::stack (no
    generated copy kernel to build); one reading an op's output stacks with aten (fusable)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 4, (2, 3, 3), stride=(2, 1, 1), padding=(0, 1, 1))
    model = (lambda v: conv(v.relu())) if produced else conv
    f = torch.compile(model, backend="convlower",
                      options={"rules": ["time_fold_conv2d"], "select": "always"})
    x = torch.randn(1, 3, 4, 6, 6)
    with torch.no_grad():
        out, (code,) = run_and_get_code(f, x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert convlower.report().convolutions[0].rule == "time_fold_conv2d"
    assert ("convlower.stack" in code) is not produced


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_dynamic_batch_input_is_copied_only_when_not_contiguous(layout):
    """A graph input with a symbolic batch size is flattened as a view when its strides are
    contiguous as expressions (an opaque copy there cost a full read and write of the input:
    on a GPU about what the bf16 patch-embedding GEMM costs); a non-contiguous one is copied."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), bias=False)
    f = torch.compile(conv, backend="convlower", dynamic=True,
                      options={"rules": ["patch_linear"], "select": "always"})
    x = torch.randn(5, 3, 2, 4, 4)
    if layout == "transposed":
        x = x.transpose(3, 4)
    with torch.no_grad():
        out, codes = run_and_get_code(f, x)
        torch.testing.assert_close(out, conv(x), rtol=1e-5, atol=1e-5)
    assert convlower.report().convolutions[0].rule == "patch_linear"
    code = "\n".join(codes)
    assert "extern_kernels.mm(" in code and re.search(r"\(s\d+, 3, 2, 4, 4\)", code), code
    assert ("convlower.dense" in code) is (layout == "transposed")


@pytest.mark.parametrize("batch", [16, 1], ids=["input larger", "weight larger"])
def test_channels_last_input_is_flattened_as_a_view_when_the_weight_is_smaller(batch):
    """patch_linear on a channels-last graph input: the input (the larger tensor) is read as a
    view in its own dim order and the weight is copied into that order, forward and backward;
    with a batch of 1 the input is the smaller one and is copied instead."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 4, (2, 4, 4), stride=(2, 4, 4), bias=False)
    f = torch.compile(conv, backend="convlower",
                      options={"rules": ["patch_linear"], "select": "always"})
    x = torch.randn(batch, 3, 2, 4, 4).to(memory_format=torch.channels_last_3d).requires_grad_()
    xe = x.detach().clone().requires_grad_()
    (out, gx, gw), codes = run_and_get_code(
        lambda: (lambda o: (o, *torch.autograd.grad(o.sum(), (x, conv.weight))))(f(x)))
    ref = conv(xe)
    rgx, rgw = torch.autograd.grad(ref.sum(), (xe, conv.weight))
    for got, want in ((out, ref), (gx, rgx), (gw, rgw)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [c.rule for c in convlower.report().convolutions] == ["patch_linear"] * 2
    view = re.compile(rf"mm\(reinterpret_tensor\((primals|arg)\w*, \({batch}, 96\), \(96, 1\), 0\)")
    fwd = codes[0]
    assert bool(view.search(fwd)) is (batch == 16), fwd
    assert fwd.count("convlower.dense.default(") == 1  # the weight (batch 16) or the input (1)


def test_has_conv_sees_calls_not_kernel_names():
    from helpers import has_conv

    named = "triton_poi_fused_convolution_0.run(buf0)\n# a comment: aten.convolution\ncpp_fused_convolution_1(x)"
    assert not has_conv(named)
    for call in ("extern_kernels.convolution(x, w)", "torch.ops.mkldnn._convolution_pointwise.default(x)",
                 "aten.convolution_backward.default(g, x, w)"):
        assert has_conv([named, call]), call
