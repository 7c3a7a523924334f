"""Real tensors for a site: what the screen and the measurement run candidates on."""
from __future__ import annotations

import torch

from .. import torch_internals as ti
from ..lowerings.site import ConvSite


def real_inputs(site: ConvSite, seed: int = 0) -> list[torch.Tensor]:
    """Random tensors with the site inputs' concrete sizes, strides, dtype and device."""
    gen = None
    out = []
    for t in site.inputs:
        gen = gen or torch.Generator(device=t.device).manual_seed(seed)  # not the user's RNG
        size = [ti.hint(s) for s in t.shape]
        values = torch.randn(size, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)
        try:
            real = torch.empty_strided(size, [ti.hint(s) for s in t.stride()], device=t.device,
                                       dtype=t.dtype)
            out.append(real.copy_(values))
        except RuntimeError:  # overlapping strides (an expanded tensor): keep it contiguous
            out.append(values)
    return out
