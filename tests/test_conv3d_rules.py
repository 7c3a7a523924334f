"""The Conv3d -> conv2d rules: proofs, emissions (values and grads) and compiled graphs.

The parameter matrix runs each rule's emission eagerly against ``F.conv3d`` (the compiled
backward is autograd of the same emission, so eager autograd checks its identity); a few
compiles check the splice: forward and backward lowered, no 3-D convolution left in the
generated code, and dynamic frame counts compiling once.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import convlower
from convlower.lowerings import RULES
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall
from helpers import assert_close, compare_with_eager, has_conv, with_layout

RULE_NAMES = ["time_fold_conv2d", "time_unfold_conv2d", "time_sum_conv2d"]

# (kT, sT, dT, pT), spatial (stride, padding, dilation), groups, bias, (N, C, T), out channels
CASES = [
    ((3, 1, 1, 1), ((1, 1), (1, 1), (1, 1)), 1, True, (2, 4, 5), 6),  # Wan 3x3x3, "same"
    ((3, 1, 1, 0), ((1, 1), (0, 0), (1, 1)), 1, False, (1, 4, 7), 6),  # odd T, causal-style
    ((3, 2, 1, 0), ((1, 1), (0, 0), (1, 1)), 1, True, (1, 4, 5), 4),  # Wan time downsample
    ((3, 1, 2, 2), ((2, 1), (1, 0), (2, 1)), 2, True, (2, 4, 6), 6),  # dilations, groups
    ((2, 2, 1, 0), ((2, 2), (0, 0), (1, 1)), 1, True, (1, 4, 5), 8),  # Mochi-style downsample
    ((2, 2, 1, 0), ((1, 1), (1, 1), (1, 1)), 2, False, (2, 4, 4), 6),  # fold, grouped
    ((2, 1, 2, 1), ((1, 2), (1, 1), (1, 1)), 1, True, (1, 4, 5), 4),  # kT 2, dT 2
    ((1, 1, 1, 0), ((1, 1), (1, 1), (1, 1)), 1, True, (2, 4, 3), 5),  # (1,3,3): time -> batch
    ((1, 2, 1, 1), ((1, 1), (0, 0), (1, 1)), 4, True, (1, 4, 4), 4),  # kT 1, pT 1, depthwise
    ((3, 1, 1, 0), ((1, 1), (1, 1), (1, 1)), 1, True, (1, 4, 3), 4),  # T_out == 1
    ((3, 2, 2, 1), ((1, 1), (1, 1), (1, 1)), 2, True, (0, 4, 6), 4),  # batch 0
]


def _case_id(case):
    (kt, st, dt, pt), (ss, sp, sd), g, b, (n, c, t), o = case
    return f"k{kt}s{st}d{dt}p{pt}-ss{ss[0]}{ss[1]}sp{sp[0]}{sp[1]}sd{sd[0]}{sd[1]}-g{g}-{'b' if b else 'nb'}-N{n}T{t}"


def _make(case, dtype, layout, seed=0):
    (kt, st, dt, pt), (ss, sp, sd), g, has_bias, (n, c, t), o = case
    gen = torch.Generator().manual_seed(seed)
    x = with_layout(torch.randn(n, c, t, 7, 6, generator=gen), layout)
    w = torch.randn(o, c // g, kt, 3, 2, generator=gen) / (c // g * kt * 6) ** 0.5
    b = torch.randn(o, generator=gen) if has_bias else None
    cast = lambda v: None if v is None else v.to(dtype).requires_grad_()
    params = dict(stride=(st, *ss), padding=(pt, *sp), dilation=(dt, *sd), groups=g)
    return cast(x), cast(w), cast(b), params


def _grads(out, tensors):
    g = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    live = [t for t in tensors if t is not None]
    return torch.autograd.grad(out, live, g, allow_unused=True) if out.numel() else [
        torch.zeros_like(t) for t in live]


def _eligible(name, case):
    (kt, st, dt, pt) = case[0]
    if name == "time_fold_conv2d":
        return kt == st and pt == 0 and (dt == 1 or kt == 1)
    return True


@pytest.mark.parametrize("name", RULE_NAMES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_emission_matches_conv3d(name, case):
    rule = RULES[name]
    for dtype, layout in [(torch.float32, "contiguous"), (torch.float32, "channels_last"),
                          (torch.float32, "noncontig"), (torch.bfloat16, "contiguous")]:
        x, w, b, p = _make(case, dtype, layout)
        call = ConvCall.from_args([x, w, b, p["stride"], p["padding"], p["dilation"], False,
                                   (0, 0, 0), p["groups"]])
        verdict = check(rule, call)
        assert verdict.eligible == _eligible(name, case), verdict
        if not verdict.eligible:
            assert verdict.rejected
            return
        ref = F.conv3d(x, w, b, **p)
        out = rule.emit(call, x, w, b)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close(out, ref)
        for got, want in zip(_grads(out, [x, w, b]), _grads(ref, [x, w, b])):
            assert_close(got, want)


def test_time_sum_accumulates_bf16_in_fp32():
    """The result is the bf16 partial conv2ds added in fp32 and rounded once."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 5, 6, 6, generator=gen).bfloat16()
    w = (torch.randn(8, 16, 3, 3, 3, generator=gen) / 12).bfloat16()
    call = ConvCall.from_args([x, w, None, (1, 1, 1), (0, 1, 1), (1, 1, 1), False, (0, 0, 0), 1])
    out = RULES["time_sum_conv2d"].emit(call, x, w, None)
    frames = lambda i: x[:, :, i:i + 3].transpose(1, 2).reshape(3, 16, 6, 6)
    partials = [F.conv2d(frames(i), w[:, :, i], padding=1) for i in range(3)]
    fp32_sum = (partials[0].float() + partials[1].float() + partials[2].float()).bfloat16()
    bf16_sum = partials[0] + partials[1] + partials[2]
    want = fp32_sum.view(1, 3, 8, 6, 6).transpose(1, 2)
    assert torch.equal(out, want)
    assert not torch.equal(fp32_sum, bf16_sum)  # the test can tell the two apart


def test_fold_rejects_overlapping_or_padded_time():
    x, w = torch.randn(1, 2, 5, 4, 4), torch.randn(3, 2, 3, 1, 1)
    rule = RULES["time_fold_conv2d"]
    for stride, pad in [((1, 1, 1), (0, 0, 0)), ((3, 1, 1), (1, 0, 0))]:
        call = ConvCall.from_args([x, w, None, stride, pad, (1, 1, 1), False, (0, 0, 0), 1])
        verdict = check(rule, call)
        assert not verdict.eligible and "is false" in verdict.rejected
    conv2d = ConvCall.from_args([x[:, :, 0], w[:, :, 0], None, (1, 1), (0, 0), (1, 1), False,
                                 (0, 0), 1])
    for name in RULE_NAMES:
        assert not check(RULES[name], conv2d).eligible  # 3-D only


def _no_3d_conv(code: str) -> bool:
    """True if no convolution call in the generated code has 3-element stride/padding."""
    three = re.compile(r"[\(\[]\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,?\s*[\)\]]")
    lines = [l for l in code.splitlines() if "convolution" in l and "(" in l
             and not l.lstrip().startswith("#")]
    return not any(three.search(l) for l in lines)


COMPILED = {
    # rule: (module, input, dtype, layout)
    "time_fold_conv2d": (lambda: torch.nn.Conv3d(4, 6, (2, 3, 3), (2, 1, 1), (0, 1, 1), groups=2),
                         (1, 4, 5, 6, 6), torch.float32, "channels_last"),
    "time_unfold_conv2d": (lambda: torch.nn.Conv3d(4, 6, 3, (2, 1, 1), 1, dilation=(2, 1, 1)),
                           (2, 4, 6, 6, 6), torch.float32, "contiguous"),
    "time_sum_conv2d": (lambda: torch.nn.Conv3d(4, 6, 3, 1, (1, 1, 1), groups=2),
                        (1, 4, 5, 6, 6), torch.bfloat16, "contiguous"),
}


@pytest.mark.parametrize("name", RULE_NAMES)
def test_compiled_training_lowers_forward_and_backward(name):
    make, shape, dtype, layout = COMPILED[name]
    torch.manual_seed(0)
    m = make().to(dtype)
    x = with_layout(torch.randn(shape, dtype=dtype), layout)
    codes = compare_with_eager(m, x, options={"rules": [name], "select": "always"})
    entries = convlower.report().convolutions
    assert {e["phase"] for e in entries if e["rule"] == name} == {"forward", "backward"}, entries
    assert len(codes) == 2 and all(has_conv(c) for c in codes)
    assert all(_no_3d_conv(c) for c in codes)


def test_no_3d_conv_detector_can_fail():
    f = torch.compile(torch.nn.Conv3d(2, 2, 3), backend="convlower",
                      options={"rules": "none"})
    _, codes = run_and_get_code(f, torch.randn(1, 2, 4, 4, 4))
    assert not _no_3d_conv(codes[0])


@pytest.mark.parametrize("name", RULE_NAMES)
def test_dynamic_frame_count_compiles_once(name):
    torch.manual_seed(0)
    conv = (torch.nn.Conv3d(3, 4, (2, 3, 3), (2, 1, 1), (0, 1, 1)) if name == "time_fold_conv2d"
            else torch.nn.Conv3d(3, 4, 3, (2, 1, 1), (1, 1, 1)))
    f = torch.compile(conv, backend="convlower", options={"rules": [name], "select": "always"})
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for t in (5, 8, 11):
            x = torch.randn(1, 3, t, 6, 6)
            torch._dynamo.mark_dynamic(x, 2)
            assert_close(f(x), conv(x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    entries = convlower.report().convolutions
    # The proof needs no size fact (no guard from the rule); the emission's views of the
    # symbolic frame count may add 0/1-style guards, which the report lists as "emission: ...".
    assert len(entries) == 1 and entries[0]["rule"] == name
    assert all(not g.startswith(("kernel", "size", "padding")) for g in entries[0]["guards"])
    assert all(not v["guards"] for v in entries[0]["verdicts"])
    assert any(not s.isdigit() for s in entries[0]["call"]["input"])  # T really was symbolic


@pytest.mark.parametrize("name", ["time_unfold_conv2d", "time_sum_conv2d"])
def test_automatic_dynamic_after_shape_changes(name):
    """Conv3d modules of several sizes share Conv3d.forward, so Dynamo turns channels, frames
    and spatial sizes dynamic; the last call has one output frame.  time_sum_conv2d once
    viewed its summed buffer there and Inductor failed ("Invalid ranges [0:-1]")."""
    torch.manual_seed(0)
    opts = {"rules": [name], "select": "always"}
    with torch.no_grad():
        for shape in ([1, 4, 6, 10, 10], [1, 8, 6, 8, 8], [1, 16, 3, 6, 6]):
            conv = torch.nn.Conv3d(shape[1], shape[1], 3).eval()
            x = torch.randn(shape)
            out = torch.compile(conv, backend="convlower", options=opts)(x)
            assert_close(out, conv(x))
    last = convlower.report().convolutions[-1]
    assert last["rule"] == name and any(not s.isdigit() for s in last["call"]["input"])
