"""Property-based equivalence: every rule, on random convolutions, equals eager PyTorch.

The bulk of the examples exercise each rule the way the graph pass does -- eligibility from
``convlower.lowerings.proof.check``, the forward from
``convlower.decompositions.convolution.convolution`` and the backward from
``convolution_backward`` -- on real tensors, so hundreds of cases need no compile.  A smaller
number go through the whole ``torch.compile(backend="convlower")`` path (padding strings,
forced rules, default selection, dynamic shapes).  Rules are read from ``RULES`` at run time,
so a rule added later is covered without editing this file.

The helpers (``conv_cases``, ``check_case``, ``dynamic_suite``) are plain functions so that
``bench/fuzz.py`` and ``bench/reliability_figures.py`` reuse them for the larger runs.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import convlower
from convlower.backend.options import parse as parse_options
from convlower.selection import choose
from convlower.decompositions import convolution as decomp
from convlower.lowerings import RULES
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall

# CI budget: 260 direct + 40 transposed + 6 compiled random examples (>= 300), plus one
# compiled example per rule and the dynamic suite.
settings.register_profile("ci", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative to the largest magnitude of the float64 reference (plus an elementwise rtol).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
_F = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclasses.dataclass(frozen=True)
class Case:
    nd: int
    batch: int
    cin: int
    cout: int
    groups: int
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    size: tuple
    bias: bool
    layout: str  # contiguous | channels_last | noncontig
    dtype: str
    transposed: bool = False
    seed: int = 0


@st.composite
def conv_cases(draw, transposed: bool = False, max_size: int = 4):
    """Random convolutions, biased towards the shapes the rules target (and their edges)."""
    nd = draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(["any", "any", "patchify", "whole", "time_window", "pointwise"]))
    groups = draw(st.sampled_from([1, 1, 1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    kernel, stride, padding, dilation, size = [], [], [], [], []
    for d in range(nd):
        k, s = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        p, dl = draw(st.integers(0, 2)), draw(st.sampled_from([1, 1, 2, 3]))
        if kind == "patchify" or (kind == "time_window" and d == 0):
            s, p = k, 0
        if kind == "pointwise":
            k, p = 1, 0
        if kind == "whole":  # the kernel covers the whole padded input (patch_linear's case)
            n = draw(st.integers(1, max_size))
            k = n + 2 * p
            dl = draw(st.sampled_from([1, 1, 2]))
            if dl * (k - 1) + 1 > n + 2 * p:
                dl = 1
        else:
            span = dl * (k - 1) + 1
            lo = max(1, span - 2 * p)
            n = draw(st.integers(lo, lo + max_size))  # lo: a single output position (T_out == 1)
        kernel.append(k), stride.append(s), padding.append(p), dilation.append(dl), size.append(n)
    layouts = ["contiguous", "noncontig"] + (["channels_last"] if nd >= 2 else [])
    return Case(nd=nd, batch=draw(st.sampled_from([0, 1, 2, 3])), cin=cin, cout=cout,
                groups=groups, kernel=tuple(kernel), stride=tuple(stride), padding=tuple(padding),
                dilation=tuple(dilation), size=tuple(size), bias=draw(st.booleans()),
                layout=draw(st.sampled_from(layouts)),
                dtype=draw(st.sampled_from(["float32", "float32", "float32", "bfloat16", "float16"])),
                transposed=transposed, seed=draw(st.integers(0, 2**16)))


def apply_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return x.contiguous(memory_format=fmt)
    if layout == "noncontig":  # every other element of a wider tensor's last dim
        return torch.cat([x, torch.zeros_like(x)], dim=-1)[..., ::2]
    return x


def make_tensors(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    x = torch.randn(case.batch, case.cin, *case.size, generator=g)
    if case.transposed:
        w = torch.randn(case.cin, case.cout // case.groups, *case.kernel, generator=g)
    else:
        w = torch.randn(case.cout, case.cin // case.groups, *case.kernel, generator=g)
    b = torch.randn(case.cout, generator=g) if case.bias else None
    x = apply_layout(x.to(dtype), case.layout)
    return x, w.to(dtype), (b.to(dtype) if b is not None else None)


def conv_args(case: Case):
    nd = case.nd
    return [list(case.stride), list(case.padding), list(case.dilation), case.transposed,
            [0] * nd, case.groups]


def _close(name: str, got: torch.Tensor, ref64: torch.Tensor, dtype) -> Optional[str]:
    """None if ``got`` matches the float64 reference within the dtype's tolerance."""
    if got.shape != ref64.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    if got.dtype != dtype:
        return f"{name}: dtype {got.dtype} != {dtype}"
    if ref64.numel() == 0:
        return None
    tol = TOL[dtype]
    scale = float(ref64.abs().max())
    err = (got.double() - ref64).abs()
    bad = err > tol * scale + tol * ref64.abs() + 1e-12
    if bool(bad.any()):
        return f"{name}: max error {float(err.max()):.3g} (scale {scale:.3g}, tol {tol})"
    return None


def check_case(case: Case, select: Optional[str] = None) -> dict:
    """Run every rule on ``case`` as the pass would; return what happened.

    ``{"eligible": [rules], "selected": rule or None, "mismatches": {rule: why}}``.
    A mismatch is a result (forward or any gradient) that differs from eager beyond the
    dtype's rounding, or a rule that raised on an eligible case.
    """
    x, w, b = make_tensors(case)
    dtype = x.dtype
    args = conv_args(case)
    call = ConvCall.from_args([x, w, b, *args])
    out = {"eligible": [], "selected": None, "mismatches": {}}
    verdicts = {name: check(rule, call) for name, rule in RULES.items()}
    eligible = [RULES[n] for n, v in verdicts.items() if v.eligible]
    out["eligible"] = [r.name for r in eligible]
    if case.transposed or not eligible:
        return out
    rule, _, _ = choose(call, eligible, select or parse_options({}).select)
    out["selected"] = rule.name if rule is not None else None

    # float64 references: forward and all three gradients
    x64, w64 = x.double(), w.double()
    b64 = b.double() if b is not None else None
    ref = torch.ops.aten.convolution(x64, w64, b64, *args)
    g = torch.Generator().manual_seed(case.seed + 1)
    grad_out = torch.randn(ref.shape, generator=g).to(dtype)
    mask = [True, True, case.bias]
    ref_grads = torch.ops.aten.convolution_backward(
        grad_out.double(), x64, w64, [case.cout] if case.bias else None, *args, mask)
    eager = torch.ops.aten.convolution(x, w, b, *args)

    for rule in eligible:
        try:
            fwd = decomp.convolution(rule, call)
            got = fwd(x, w, b) if b is not None else fwd(x, w)
            problems = [_close("forward", got, ref, dtype)]
            if got.shape != eager.shape or got.dtype != eager.dtype:
                problems.append(f"forward: {tuple(got.shape)} {got.dtype} != eager "
                                f"{tuple(eager.shape)} {eager.dtype}")
            grads = decomp.convolution_backward(rule, call, mask)(grad_out, x, w)
            for name, got_g, ref_g in zip(("grad_input", "grad_weight", "grad_bias"), grads,
                                          ref_grads):
                if ref_g is None or not mask[("grad_input", "grad_weight", "grad_bias").index(name)]:
                    continue
                problems.append(_close(name, got_g, ref_g, dtype))
        except Exception as e:  # an eligible rule must compute, not raise
            problems = [f"raised {type(e).__name__}: {e}"]
        problems = [p for p in problems if p]
        if problems:
            out["mismatches"][rule.name] = "; ".join(problems)
    return out


# -- direct path: every rule, forward and backward, on real tensors ------------------------------

@settings(max_examples=260)
@given(conv_cases())
def test_every_eligible_rule_matches_eager(case):
    res = check_case(case)
    assert not res["mismatches"], (case, res["mismatches"])
    if res["eligible"]:
        assert res["selected"] in res["eligible"] + [None]


@settings(max_examples=40)
@given(conv_cases(transposed=True))
def test_transposed_convolutions_are_left_alone(case):
    x, w, b = make_tensors(case)
    call = ConvCall.from_args([x, w, b, *conv_args(case)])
    for name, rule in RULES.items():
        verdict = check(rule, call)
        assert not verdict.eligible, f"{name} accepted a transposed convolution: {case}"


def test_the_checker_can_fail(monkeypatch):
    """A rule with an off-by-one emission is reported as a mismatch (the property has teeth)."""
    case = Case(nd=2, batch=2, cin=3, cout=4, groups=1, kernel=(2, 2), stride=(2, 2),
                padding=(0, 0), dilation=(1, 1), size=(4, 6), bias=True, layout="contiguous",
                dtype="float32")
    assert "patchify_mm" in check_case(case)["eligible"]
    rule = RULES["patchify_mm"]
    real = type(rule).emit
    monkeypatch.setattr(rule, "emit", lambda c, x, w, b: real(rule, c, x, w, b) * 1.001)
    assert "patchify_mm" in check_case(case)["mismatches"]


# -- full compile path ------------------------------------------------------------------------------

def _compile_and_compare(fn, tensors, options, dynamic=False):
    """Compile ``fn`` with convlower; forward and grads of every tensor input equal eager."""
    torch._dynamo.reset()
    convlower.reset_report()
    dtype = tensors[0].dtype
    leaves_e = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    leaves_c = [apply_layout_like(t) for t in tensors]
    ref = fn(*leaves_e)
    compiled = torch.compile(fn, backend="convlower", options=options, dynamic=dynamic)
    out = compiled(*leaves_c)
    tol = TOL[dtype] if dtype != torch.float32 else 1e-4
    scale = float(ref.detach().abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * scale)
    if ref.numel():
        g = torch.randn(ref.shape).to(dtype)
        ref.backward(g)
        out.backward(g)
        for te, tc in zip(leaves_e, leaves_c):
            if te is not None:
                s = float(te.grad.abs().max()) if te.grad.numel() else 1.0
                torch.testing.assert_close(tc.grad, te.grad, rtol=tol, atol=tol * s)
    fallbacks = [c for c in convlower.report().convolutions if "fell back" in c["reason"]]
    assert not fallbacks, fallbacks  # no rule may fail inside the pass on a valid conv
    return convlower.report()


def apply_layout_like(t):
    if t is None:
        return None
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return c.copy_(t.detach()).requires_grad_(True)


@st.composite
def compiled_cases(draw):
    case = draw(conv_cases(max_size=3))
    # padding strings are resolved by F.conv*d before aten.convolution ("same": stride 1)
    pad = draw(st.sampled_from(["ints", "ints", "same", "valid"]))
    if pad == "same":
        case = dataclasses.replace(case, stride=(1,) * case.nd)
    if pad == "valid":  # no padding: the input must hold the dilated kernel
        assume(all(s >= d * (k - 1) + 1 for s, k, d in zip(case.size, case.kernel, case.dilation)))
    rule = draw(st.sampled_from([None] + list(RULES)))
    return case, pad, rule


@settings(max_examples=6)
@given(compiled_cases())
def test_compiled_matches_eager(args):
    case, pad, rule = args
    case = dataclasses.replace(case, batch=max(case.batch, 1))  # backward needs a non-empty out
    x, w, b = make_tensors(case)
    padding = pad if pad != "ints" else case.padding
    conv = _F[case.nd]

    def fn(x, w, b):
        return conv(x, w, b, case.stride, padding, case.dilation, case.groups)

    options = {"rules": [rule], "select": "always"} if rule else None
    _compile_and_compare(fn, [x, w, b], options)


def _eligible_case(rule_name: str) -> Case:
    """A small fp32 case the rule accepts, found by search (works for rules added later)."""
    from hypothesis import find

    return find(conv_cases(max_size=3),
                lambda c: c.batch > 0 and c.dtype == "float32" and c.layout == "contiguous"
                and rule_name in check_case(c)["eligible"],
                settings=settings(max_examples=2000, database=None))


@pytest.mark.parametrize("rule_name", list(RULES))
def test_each_rule_forced_lowers_fwd_and_bwd_under_compile(rule_name):
    case = _eligible_case(rule_name)
    x, w, b = make_tensors(case)
    conv = _F[case.nd]

    def fn(x, w, b):
        return conv(x, w, b, case.stride, case.padding, case.dilation, case.groups)

    rep = _compile_and_compare(fn, [x, w, b], {"rules": [rule_name], "select": "always"})
    assert {(c["phase"], c["rule"]) for c in rep.convolutions} == {
        ("forward", rule_name), ("backward", rule_name)}, (case, str(rep))


# -- dynamic shapes ---------------------------------------------------------------------------------

class VideoNet(torch.nn.Module):
    """Patch embedding, a (2,2,2)-stride-2 down-sample, a 3x3x3 conv and a pointwise conv."""

    def __init__(self, c=3, d=8):
        super().__init__()
        self.embed = torch.nn.Conv3d(c, d, (1, 2, 2), (1, 2, 2))
        self.down = torch.nn.Conv3d(d, d, 2, 2)
        self.mix = torch.nn.Conv3d(d, d, 3, padding=1)
        self.proj = torch.nn.Conv3d(d, 4, 1)

    def forward(self, x):
        return self.proj(torch.relu(self.mix(self.down(self.embed(x)))))


# (batch, frames, height, width): every dim changes at least once; all >= 2 (sizes 0 and 1 are
# specialised by Dynamo for every backend).
DYNAMIC_SHAPES = [(2, 4, 8, 8), (3, 6, 8, 12), (2, 8, 12, 8), (4, 4, 16, 16)]


def frame_compiles() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def dynamic_suite(backend: str = "convlower", how: str = "dynamic=True", shapes=DYNAMIC_SHAPES,
                  options=None) -> dict:
    """Train one step per shape; returns compiles, max error vs eager, rules lowered."""
    torch._dynamo.reset()
    convlower.reset_report()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = VideoNet()
    dynamic = True if how == "dynamic=True" else None
    compiled = torch.compile(model, backend=backend, dynamic=dynamic,
                             options=options if backend == "convlower" else None)
    worst = 0.0
    for n, t, h, w in shapes:
        x = torch.randn(n, 3, t, h, w)
        if how == "mark_dynamic":
            for d in (0, 2, 3, 4):
                torch._dynamo.mark_dynamic(x, d)
        model.zero_grad()
        ref = model(x)
        ref.square().mean().backward()
        ref_g = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(x)
        out.square().mean().backward()
        worst = max(worst, float((out - ref).detach().abs().max()))
        for p, g in zip(model.parameters(), ref_g):
            worst = max(worst, float((p.grad - g).abs().max() / (g.abs().max() + 1e-12)))
    lowered = collections.Counter((c["phase"], c["rule"]) for c in convlower.report().lowered())
    fallbacks = [c["reason"] for c in convlower.report().convolutions if "fell back" in c["reason"]]
    reasons = [m.recompile_reason for m in torch._dynamo.utils.get_compilation_metrics()
               if getattr(m, "recompile_reason", None)]
    return {"compiles": frame_compiles(), "recompiles": frame_compiles() - 1,
            "max_error": worst, "lowered": dict(lowered), "shapes": len(shapes),
            "fallbacks": fallbacks, "recompile_reasons": reasons}


def dynamic_suite_in_subprocess(backend="convlower", how="dynamic=True", options=None) -> dict:
    """Run :func:`dynamic_suite` in a fresh interpreter: a crash in a compiled kernel (seen
    with torch 2.13 Inductor on dynamic shapes) becomes a result, not a dead test session."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys, torch; sys.path.insert(0, %r); import test_properties as P; "
            "torch._inductor.config.force_disable_caches = True; "
            "r = P.dynamic_suite(%r, %r, options=%r); "
            "r['lowered'] = {'/'.join(k): v for k, v in r['lowered'].items()}; "
            "print('RESULT' + json.dumps(r))") % (os.path.dirname(__file__), backend, how, options)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    return {"crashed": p.returncode, "stderr_tail": p.stderr[-2000:]}


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_shapes_equal_eager_without_extra_recompiles(how):
    # Rules forced: measured selection may rightly keep every original conv at these tiny
    # sizes, and this test is about the lowered forms under dynamic shapes.
    res = dynamic_suite_in_subprocess(how=how, options={"select": "always"})
    assert "crashed" not in res, res
    assert res["max_error"] < 1e-4, res
    assert not res["fallbacks"], res["fallbacks"]
    assert res["lowered"], res
    # Every recompile must come from Dynamo/Inductor themselves (duck sizing, Inductor's own
    # conv lowering), never from a guard a convlower proof installed.
    assert not [r for r in res["recompile_reasons"] if "convlower" in r], res
