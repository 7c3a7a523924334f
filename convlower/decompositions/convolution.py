"""aten decompositions of ``aten.convolution`` and ``aten.convolution_backward`` through a rule.

Both are pure functions of tensors, built for one rule and one call.  The backward is not
written by hand: it is autograd of the rule's own forward emission (traced, so the backward
graph holds the mm / reshape gradients of the lowered form and dead forward work is removed).
One identity per rule therefore serves forward and backward, and they cannot disagree.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..lowerings.rule import ConvCall, Rule

DTYPES = {None: None, "bfloat16": torch.bfloat16}  # the compute_dtype option's dtypes


def _in_compute_dtype(fn, compute_dtype: Optional[torch.dtype]):
    """Run ``fn`` on tensors cast to ``compute_dtype`` and cast the result back (opt-in)."""
    if compute_dtype is None:
        return fn

    def wrapped(*tensors):
        dtype = tensors[0].dtype
        cast = [t.to(compute_dtype) if t is not None and t.dtype != compute_dtype else t
                for t in tensors]
        out = fn(*cast)
        if isinstance(out, tuple):
            return tuple(o.to(dtype) if o is not None else None for o in out)
        return out.to(dtype)

    return wrapped


def convolution(rule: Rule, call: ConvCall, compute_dtype=None) -> Callable:
    """``(x, weight[, bias]) -> out``: the convolution's value computed by ``rule``."""

    def fn(x, weight, bias=None):
        return rule.emit(call, x, weight, bias)

    return _in_compute_dtype(fn, compute_dtype if rule.follows_compute_dtype else None)


def convolution_backward(rule: Rule, call: ConvCall, output_mask: Sequence[bool],
                         compute_dtype=None) -> Callable:
    """``(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias)`` (None where not wanted).
    A rule with an opaque backward of its own (``Rule.emit_backward``) gives it instead."""
    compute_dtype = compute_dtype if rule.follows_compute_dtype else None
    opaque = rule.emit_backward(call, output_mask)
    if opaque is not None:
        return _in_compute_dtype(opaque, compute_dtype)
    want_x, want_w, want_b = (bool(m) for m in output_mask)

    def fn(grad_out, x, weight):
        grad_x = grad_w = grad_b = None
        if want_x or want_w:
            with torch.enable_grad():
                xs = x.detach().requires_grad_(want_x)
                ws = weight.detach().requires_grad_(want_w)
                out = rule.emit(call, xs, ws, None)
                wanted = [t for t, m in ((xs, want_x), (ws, want_w)) if m]
                grads = list(torch.autograd.grad(out, wanted, grad_out))
            grad_x = grads.pop(0) if want_x else None
            grad_w = grads.pop(0) if want_w else None
        if want_b:
            grad_b = grad_out.sum([0] + list(range(2, grad_out.dim())))
        return grad_x, grad_w, grad_b

    return _in_compute_dtype(fn, compute_dtype)
