"""Random convolutions and a checker that runs every rule on one against eager PyTorch.

Each rule is run the way the graph pass runs it: eligibility from
:func:`convlower.lowerings.proof.check`, the forward and backward from
:mod:`convlower.decompositions.convolution`, on real tensors, against a float64 eager
reference, so a case needs no compile.  ``bench/fuzz.py`` and ``bench/reliability_figures.py``
run it at scale.  :func:`conv_cases` needs ``hypothesis`` (the ``dev`` extra).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..backend.options import parse as parse_options
from ..decompositions import convolution as decomp
from ..lowerings import RULES
from ..lowerings.proof import check
from ..lowerings.rule import ConvCall
from ..lowerings.site import site_of_call
from ..selection import choose

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Relative to the largest magnitude of the float64 reference (plus an elementwise rtol).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRADS = ("grad_input", "grad_weight", "grad_bias")


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


def conv_cases(transposed: bool = False, max_size: int = 4):
    """A hypothesis strategy: random convolutions, biased towards the shapes the rules target
    (and their edges)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        nd = draw(st.sampled_from([1, 2, 3]))
        kind = draw(st.sampled_from(["any", "any", "patchify", "whole", "time_window", "pointwise"]))
        groups = draw(st.sampled_from([1, 1, 1, 2, 3]))
        cin = groups * draw(st.integers(1, 3))
        cout = groups * draw(st.integers(1, 3))
        dims = [_dim(draw, st, kind, d, max_size) for d in range(nd)]
        kernel, stride, padding, dilation, size = (tuple(v) for v in zip(*dims))
        layouts = ["contiguous", "noncontig"] + (["channels_last"] if nd >= 2 else [])
        return Case(nd=nd, batch=draw(st.sampled_from([0, 1, 2, 3])), cin=cin, cout=cout,
                    groups=groups, kernel=kernel, stride=stride, padding=padding,
                    dilation=dilation, size=size, bias=draw(st.booleans()),
                    layout=draw(st.sampled_from(layouts)),
                    dtype=draw(st.sampled_from(["float32", "float32", "float32", "bfloat16",
                                                "float16"])),
                    transposed=transposed, seed=draw(st.integers(0, 2**16)))

    return cases()


def _dim(draw, st, kind: str, d: int, max_size: int) -> tuple[int, int, int, int, int]:
    """(kernel, stride, padding, dilation, size) of spatial dim ``d``."""
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
    return k, s, p, dl, n


def with_layout(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x``'s values in another memory layout: channels-last (4-D/5-D) or a non-contiguous
    view (every other element of a wider last dim)."""
    if kind == "channels_last":
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        return x.contiguous(memory_format=fmt) if fmt else x
    if kind == "noncontig":
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
    x = with_layout(x.to(dtype), case.layout)
    return x, w.to(dtype), (b.to(dtype) if b is not None else None)


def conv_args(case: Case):
    return [list(case.stride), list(case.padding), list(case.dilation), case.transposed,
            [0] * case.nd, case.groups]


def close(name: str, got: torch.Tensor, ref64: torch.Tensor, dtype) -> Optional[str]:
    """None if ``got`` matches the float64 reference within the dtype's tolerance, else why."""
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
    call = ConvCall.from_args([x, w, b, *conv_args(case)])
    out: dict = {"eligible": [], "selected": None, "mismatches": {}}
    eligible = [rule for rule in RULES.values() if check(rule, call).eligible]
    out["eligible"] = [r.name for r in eligible]
    # Only where a lowering applies: a case only eager_conv takes (its ops run eager's own
    # kernels, tests/test_eager_conv.py) would just run torch's eager conv on a random shape,
    # and torch's CPU conv has crashed the process on some (a clean-clone CI run, in the eager
    # reference below).
    if case.transposed or not any(rule.lowers for rule in eligible):
        return out
    decision = choose(site_of_call(call), eligible, select or parse_options({}).select)
    out["selected"] = decision.rule.name if decision.rule is not None else None
    refs = _references(case, x, w, b)
    for rule in eligible:
        problems = _problems(rule, call, case, (x, w, b), refs)
        if problems:
            out["mismatches"][rule.name] = "; ".join(problems)
    return out


def _references(case: Case, x, w, b) -> dict:
    """Float64 forward and gradients, eager's own output, and the upstream gradient."""
    args = conv_args(case)
    x64, w64 = x.double(), w.double()
    ref = torch.ops.aten.convolution(x64, w64, b.double() if b is not None else None, *args)
    g = torch.Generator().manual_seed(case.seed + 1)
    grad_out = torch.randn(ref.shape, generator=g).to(x.dtype)
    mask = [True, True, case.bias]
    grads = torch.ops.aten.convolution_backward(
        grad_out.double(), x64, w64, [case.cout] if case.bias else None, *args, mask)
    return {"out": ref, "grads": grads, "eager": torch.ops.aten.convolution(x, w, b, *args),
            "grad_out": grad_out, "mask": mask}


def _eager_grads(case: Case, tensors: tuple, refs: dict) -> tuple:
    x, w, _ = tensors
    return torch.ops.aten.convolution_backward(
        refs["grad_out"], x, w, [case.cout] if case.bias else None, *conv_args(case), refs["mask"])


def _problems(rule, call: ConvCall, case: Case, tensors: tuple, refs: dict) -> list[str]:
    x, w, b = tensors
    dtype, eager = x.dtype, refs["eager"]
    # A form that runs eager's own kernels (eager_conv, channels_last_conv: eager_numerics)
    # inherits eager's errors, and torch's CPU reduced-precision convs have them: bf16 backward
    # returned garbage grad_weight (kernel (6, 3) over a padded 6x3 input: NaN or 44.5 for
    # 1.14, in eager autograd too), bf16 Conv3d forwards with dilation 3 gave 1e30 in both
    # memory formats, and one such call crashed the process.  That is torch's numerics, not
    # ours: such a form is checked in fp32 only, and only where eager is right (its ops are
    # checked against eager in tests/test_eager_conv.py and tests/test_channels_last_conv.py).
    if rule.eager_numerics and dtype != torch.float32:
        return []
    try:
        fwd = decomp.convolution(rule, call)
        got = fwd(x, w, b) if b is not None else fwd(x, w)
        eager_right = lambda name, e: not close(name, e, refs["out"] if name == "forward"
                                                else refs["grads"][GRADS.index(name)], dtype)
        problems = [close("forward", got, refs["out"], dtype)
                    if not rule.eager_numerics or eager_right("forward", eager) else None]
        if got.shape != eager.shape or got.dtype != eager.dtype:
            problems.append(f"forward: {tuple(got.shape)} {got.dtype} != eager "
                            f"{tuple(eager.shape)} {eager.dtype}")
        grads = decomp.convolution_backward(rule, call, refs["mask"])(refs["grad_out"], x, w)
        eager_grads = _eager_grads(case, tensors, refs) if rule.eager_numerics else grads
        for name, want, got_g, ref_g, eager_g in zip(GRADS, refs["mask"], grads, refs["grads"],
                                                      eager_grads):
            if ref_g is not None and want and (not rule.eager_numerics
                                               or eager_right(name, eager_g)):
                problems.append(close(name, got_g, ref_g, dtype))
    except Exception as e:  # an eligible rule must compute, not raise
        problems = [f"raised {type(e).__name__}: {e}"]
    return [p for p in problems if p]
