"""Which platform a tensor runs on, as convlower's decisions see it: "hip", "cuda", "cpu", ...

A GPU tensor is "hip" on a ROCm build (``torch.version.hip``), else "cuda"; any other tensor
is its device type.  The caller can force the answer with ``options={"platform": "hip"}`` or
``CONVLOWER_PLATFORM=hip`` (already folded into the parsed options), which is how the ROCm
decisions are exercised on machines without a ROCm GPU.  Pure functions: the build's HIP
version is a parameter so tests can inject it.
"""
from __future__ import annotations

from typing import Optional

import torch

_BUILD = object()  # "read torch.version.hip"


def site_platform(forced: str, device: Optional[torch.device], hip_version=_BUILD) -> str:
    """The platform a tensor on ``device`` runs on; ``forced`` (not "auto") wins."""
    if forced != "auto":
        return forced
    if hip_version is _BUILD:
        hip_version = torch.version.hip
    if device is None:
        return "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return "hip" if hip_version else "cuda"
    return device.type
