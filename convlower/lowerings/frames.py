"""Moving time between a Conv3d's layout and conv2d batches: shared by the Conv3d rules.

Taps are strided slices of time, not ``unfold`` windows: torch 2.13 Inductor mis-compiles the
backward of ``unfold`` with size-1 or single windows (wrong gradients, then heap corruption),
while the backward of a slice is a plain ``slice_scatter``.
"""
from __future__ import annotations

import torch

from .rule import ConvCall


def time_taps(c: ConvCall, x: torch.Tensor) -> list[torch.Tensor]:
    """The kT temporal taps of a Conv3d, each (N, C, T_out, H, W): tap ``i`` holds frames
    ``t*sT + i*dT`` (t < T_out) of the input zero-padded by ``pT`` frames on both sides."""
    kt, st, pt, dt = c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]
    t_out = c.out_size(0, x)  # the conv's own formula, so the last tap ends inside the input
    if pt:
        x = torch.constant_pad_nd(x, [0, 0, 0, 0, pt, pt])
    return [x[:, :, i * dt:i * dt + (t_out - 1) * st + 1:st] for i in range(kt)]


def taps_to_batch(taps: list[torch.Tensor]) -> torch.Tensor:
    """kT taps (N, C, T_out, H, W) -> (N*T_out, C*kT, H, W), channel ``c*kT + i`` (group-major)."""
    n, ch, t_out, h, w = taps[0].shape
    stacked = torch.stack(taps, dim=2)  # (N, C, kT, T_out, H, W)
    return stacked.permute(0, 3, 1, 2, 4, 5).reshape(n * t_out, ch * len(taps), h, w)


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
    y = torch.conv2d(taps_to_batch(taps), w2, bias, c.stride[1:], c.padding[1:], c.dilation[1:],
                     c.groups)
    return batch_to_frames(y, n, t_out)
