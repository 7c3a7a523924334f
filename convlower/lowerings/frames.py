"""Moving time between a Conv3d's layout and conv2d batches: shared by the Conv3d rules.  And
:func:`pad_to`, the exact-size crop / pad every rule's emission uses (patchify_mm too).

Taps are strided slices of time, not ``unfold`` windows: torch 2.13 Inductor mis-compiles the
backward of ``unfold`` with size-1 or single windows (wrong gradients, then heap corruption),
while the backward of a slice is a plain ``slice_scatter``.

Sizes under dynamic shapes.  Every view size is built from the proven output size (the
conv's own formula), never compared with the input's size: sympy cannot prove
``k*(W//k) <= W``, so a slice ending there, or a reshape of a slice into ``(W//k, k)``, would
install guards (``Eq(W, 4*(W//4))``...) the rule never asked for.  :func:`pad_to` first gives
the input exactly the extent the windows read (cropping the unread remainder, or zero-padding),
after which every slice end and reshape is syntactically exact.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch

from .dense import stack
from .rule import ConvCall, sym


# The memory format a rule's 2-D convs run in when it is run eagerly (None: as they come).
_CONV2D_FORMAT: contextvars.ContextVar = contextvars.ContextVar("conv2d_format", default=None)


@contextlib.contextmanager
def conv2d_in(fmt: Optional[torch.memory_format]):
    """Within, :func:`conv2d` runs in ``fmt``: as Inductor's layout optimisation (CPU, mkldnn)
    runs every 2-D conv of a graph channels-last, so that an eager run (the screen's, the
    opaque form's) runs what the compiled code would.  A traced emission is unchanged."""
    token = _CONV2D_FORMAT.set(fmt)
    try:
        yield
    finally:
        _CONV2D_FORMAT.reset(token)


def conv2d(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    fmt = _CONV2D_FORMAT.get()
    if fmt is not None:
        x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
    return torch.conv2d(x, weight, bias, stride, padding, dilation, groups)


class _PadTo(torch.autograd.Function):
    """``constant_pad_nd`` with symbolic amounts; its backward is the opposite pad (autograd's
    own formula for ``constant_pad_nd`` takes integers only)."""

    @staticmethod
    def forward(ctx, x, pads):
        ctx.pads = pads
        return torch.constant_pad_nd(x, pads)

    @staticmethod
    def backward(ctx, grad):
        return torch.constant_pad_nd(grad, [-p for p in ctx.pads]), None


def pad_to(x: torch.Tensor, extents: dict, before: dict | None = None) -> torch.Tensor:
    """``x`` with dim ``d`` zero-padded by ``before[d]`` in front and cut or zero-padded at the
    end to exactly ``extents[d]`` elements (other dims unchanged).  The result's sizes are the
    given expressions, so views built from them need no size check."""
    before = before or {}
    pads = []
    for d in reversed(range(2, x.dim())):
        b = before.get(d, 0)
        pads += [b, _int_if_static(extents[d] - x.shape[d] - b)] if d in extents else [0, 0]
    if all(isinstance(p, int) for p in pads):  # static sizes: a plain pad and a slice
        if any(p > 0 for p in pads):
            x = torch.constant_pad_nd(x, [max(p, 0) for p in pads])
        ends = list(reversed(pads[1::2]))  # per dim 2.. in order
        return x[(slice(None), slice(None)) + tuple(
            slice(0, x.shape[2 + i] + e) if e < 0 else slice(None) for i, e in enumerate(ends))]
    return _PadTo.apply(x, pads)


def _int_if_static(v):
    e = sym(v)
    return int(e) if e.is_number else v


def time_taps(c: ConvCall, x: torch.Tensor) -> list[torch.Tensor]:
    """The kT temporal taps of a Conv3d, each (N, C, T_out, H, W): tap ``i`` holds frames
    ``t*sT + i*dT`` (t < T_out) of the input zero-padded by ``pT`` frames on both sides."""
    kt, st, pt, dt = c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]
    t_out = c.out_size(0, x)  # the conv's own formula, so the last tap ends inside the input
    span = (t_out - 1) * st + (kt - 1) * dt + 1  # the frames the taps read, padding included
    x = pad_to(x, {2: span}, {2: pt})
    return [x[:, :, i * dt:i * dt + (t_out - 1) * st + 1:st] for i in range(kt)]


def taps_to_batch(taps: list[torch.Tensor]) -> torch.Tensor:
    """kT taps (N, C, T_out, H, W) -> (N*T_out, C*kT, H, W), channel ``c*kT + i`` (group-major)."""
    n, ch, t_out, h, w = taps[0].shape
    # Stacked straight into (N, T_out, C, kT, H, W): one copy.  Not reshape, whose view-or-copy
    # choice is a size check (T_out == 1?).
    batch = stack([t.permute(0, 2, 1, 3, 4) for t in taps], dim=3)
    return batch.view(n * t_out, ch * len(taps), h, w)


def batch_to_frames(y: torch.Tensor, n, t_out) -> torch.Tensor:
    """(N*T_out, O, H', W') -> (N, O, T_out, H', W')."""
    return y.view(n, t_out, *y.shape[1:]).permute(0, 2, 1, 3, 4)


def conv2d_over_time(c: ConvCall, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """All taps folded into channels and all output frames into the batch: one conv2d with the
    weight viewed as (O, C/groups*kT, kH, kW) (same ``c*kT + i`` order) and the conv's own
    spatial stride, padding, dilation and groups."""
    taps = time_taps(c, x)
    n, t_out = taps[0].shape[0], taps[0].shape[2]
    w2 = weight.reshape(weight.shape[0], weight.shape[1] * len(taps), *weight.shape[3:])
    y = conv2d(taps_to_batch(taps), w2, bias, c.stride[1:], c.padding[1:], c.dilation[1:],
               c.groups)
    return batch_to_frames(y, n, t_out)
