"""Devices as convlower's decisions see them: platform, name, synchronisation, tensors.

One place for "which platform is this" (Snake routing, rule selection), "what does a timing
depend on" (the decision cache key), "wait for the device" (every timer) and "the tensors in
a nested value" (warm-up, spike, device check).  ``platform`` takes the HIP version as a
parameter so the ROCm decisions are tested on machines without a ROCm GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import platform as _platform
from typing import Optional

import torch

_BUILD = object()  # "read torch.version.hip"
PLATFORMS = ("auto", "hip", "cuda", "cpu")


def platform(forced: str, device: Optional[torch.device], hip_version=_BUILD) -> str:
    """"hip", "cuda", "cpu" (or the device type) for a tensor on ``device``; ``forced``
    (not "auto", from ``options={"platform": ...}`` / ``CONVLOWER_PLATFORM``) wins."""
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


def device_name(device: torch.device) -> str:
    """What a timing depends on: GPU name, or CPU model and thread count."""
    return _device_name(str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _device_name(device: str, threads: int) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        return f"{'hip' if torch.version.hip else 'cuda'}:{name}"
    if device.type == "cpu":
        model = _platform.processor() or _platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                model = next((ln.split(":", 1)[1].strip() for ln in f
                              if ln.startswith("model name")), model)
        return f"cpu:{model}:{threads} threads"
    return device.type


def sync(device) -> None:
    """Wait until ``device`` (a device, or a tensor / nested value holding tensors) is idle."""
    if not isinstance(device, (torch.device, str)):
        devices = {t.device for t in tensors(device)}
    else:
        devices = {torch.device(device)}
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def tensors(x) -> list[torch.Tensor]:
    """Every tensor in a nested value: tensors, tuples, lists, dicts (transformers'
    ModelOutput too) and dataclasses."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in tensors(getattr(x, f.name))]
    return []
