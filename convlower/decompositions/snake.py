"""The eager-safe Snake: ``convlower::snake`` and its backward, as opaque custom ops.

Snake is ``x + 1/(beta + 1e-9) * sin(alpha * x)^2`` (DAC passes ``beta = alpha``).  On ROCm
with bf16, Inductor's generated kernel for it failed to build, so on that route the site runs
as these two ops instead: Inductor calls them as fallback kernels and generates no code that
computes their sin/cos, forward or backward (the backward is itself a custom op, not a
formula in aten ops that Inductor would trace and fuse).

Both compute in fp32 (fp64 stays fp64) and cast back, as Inductor does for bf16 internally.
The result dtype is the promotion of the three input dtypes; the graph pass only routes a
site here when that equals the dtype the original formula produced.  Results are contiguous.
"""
from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-9  # the constant every known Snake spelling uses; part of the op's definition


def out_dtype(x: Tensor, alpha: Tensor, beta: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, alpha.dtype), beta.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("convlower::snake", mutates_args=())
def snake(x: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """``x + 1/(beta + 1e-9) * sin(alpha * x)^2``, broadcast, computed in fp32."""
    dtype = out_dtype(x, alpha, beta)
    c = _compute_dtype(dtype)
    x, alpha, beta = x.to(c), alpha.to(c), beta.to(c)
    # the formula's operations, in place on fresh temporaries (operands commuted: same bits)
    term = (alpha * x).sin_().square_() * (beta + EPS).reciprocal()
    return term.add_(x).to(dtype).contiguous()


@snake.register_fake
def _snake_fake(x, alpha, beta):
    shape = torch.broadcast_shapes(x.shape, alpha.shape, beta.shape)
    return x.new_empty(shape, dtype=out_dtype(x, alpha, beta))


@torch.library.custom_op("convlower::snake_backward", mutates_args=())
def snake_backward(grad: Tensor, x: Tensor, alpha: Tensor, beta: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`snake` w.r.t. x, alpha and beta, each summed to its input's shape."""
    c = _compute_dtype(out_dtype(x, alpha, beta))
    g, xc, a, b = grad.to(c), x.to(c), alpha.to(c), beta.to(c)
    r = (b + EPS).reciprocal()
    s = torch.sin(a * xc)
    two_sc = 2 * s * torch.cos(a * xc)  # d/du sin(u)^2
    grad_x = g * (1 + r * two_sc * a)
    grad_alpha = g * r * two_sc * xc
    grad_beta = -g * s * s * r * r  # d/db (b + eps)^-1 = -r^2
    return tuple(t.sum_to_size(v.shape).to(v.dtype).contiguous()
                 for t, v in ((grad_x, x), (grad_alpha, alpha), (grad_beta, beta)))


@snake_backward.register_fake
def _snake_backward_fake(grad, x, alpha, beta):
    return x.new_empty(x.shape), alpha.new_empty(alpha.shape), beta.new_empty(beta.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, alpha, beta = ctx.saved_tensors
    gx, ga, gb = torch.ops.convlower.snake_backward(grad, x, alpha, beta)
    need = ctx.needs_input_grad
    return gx if need[0] else None, ga if need[1] else None, gb if need[2] else None


snake.register_autograd(_backward, setup_context=_setup_context)
