"""Dense copies and stacks inside an emission: fusable when a producer can take them, opaque
otherwise.

A rule gathers patches or frames into a dense buffer for its GEMM / conv2d.  When the conv's
input is made by an op of the graph, Inductor fuses that copy into the producer's kernel, so a
``clone`` costs nothing extra.  When the input is a graph input (a model input, a saved
activation) nothing can fuse it: Inductor would generate a standalone copy kernel, build it
with the C++ or Triton toolchain at compile time (seconds, cold) and run what ATen's copy
does anyway.  There the copy is the opaque op ``convlower::dense`` instead (no generated code,
no compile time), or no copy at all when the tensor is already dense.  The emission builder
says which case a site is (:func:`opaque_copies`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import sympy
import torch

from .rule import sym

_OPAQUE = contextvars.ContextVar("convlower_opaque_copies", default=False)


@contextlib.contextmanager
def opaque_copies(on: bool):
    token = _OPAQUE.set(on)
    try:
        yield
    finally:
        _OPAQUE.reset(token)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the contiguous layout: a fusable copy, an opaque copy, or ``t`` itself."""
    if not _OPAQUE.get():
        return t.clone(memory_format=torch.contiguous_format)
    if _static_contiguous(t):
        return t
    return torch.ops.convlower.dense(t)


def stack(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.stack(ts, dim)`` (a dense new tensor): fusable, or the opaque ``convlower::stack``."""
    if not _OPAQUE.get():
        return torch.stack(ts, dim)
    return torch.ops.convlower.stack(ts, dim)


def _static_contiguous(t: torch.Tensor) -> bool:
    """Contiguous, known without a guard: each stride equals the product of the later sizes as
    an expression (size-1 dims aside).  A symbolic batch size never enters that product, so a
    contiguous input with a dynamic batch is used as it is, not copied."""
    return _contiguous(t.shape, t.stride())


def _contiguous(shape, strides) -> bool:
    expected = sympy.Integer(1)
    for size, stride in reversed(list(zip(shape, strides))):
        size = sym(size)
        if size == 1:
            continue
        if sympy.expand(sym(stride) - expected) != 0:
            return False
        expected = expected * size
    return True


def dense_order(t: torch.Tensor) -> Optional[tuple]:
    """The order of dims (batch first) in which ``t`` is contiguous, when ``t`` is not
    contiguous but dense in another order (channels-last): ``t.permute(order)`` is a dense view,
    no copy.  None when ``t`` is contiguous, or not dense in any order with the batch outermost
    (static strides only), or where a copy of ``t`` fuses into its producer (not opaque)."""
    strides = t.stride()
    if not _OPAQUE.get() or _static_contiguous(t) or \
            not all(isinstance(s, int) for s in strides):
        return None
    order = (0, *sorted(range(1, t.dim()), key=lambda d: -strides[d]))
    if _contiguous([t.shape[d] for d in order], [strides[d] for d in order]):
        return order
    return None


@torch.library.custom_op("convlower::dense", mutates_args=())
def _dense(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@_dense.register_fake
def _(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _backward(ctx, grad):
    return grad


_dense.register_autograd(_backward)


@torch.library.custom_op("convlower::stack", mutates_args=())
def _stack(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.stack(ts, dim)


@_stack.register_fake
def _(ts, dim):
    shape = list(ts[0].shape)
    shape.insert(dim, len(ts))
    return ts[0].new_empty(shape)


def _stack_setup(ctx, inputs, output):
    ctx.dim = inputs[1]


def _stack_backward(ctx, grad):
    return list(grad.unbind(ctx.dim)), None


_stack.register_autograd(_stack_backward, setup_context=_stack_setup)
