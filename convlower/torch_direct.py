"""A compiled part's inference calls go straight to Inductor's generated code.

Why.  The split graph of regions calls each compiled part through AOTAutograd's runtime wrapper
and Inductor's ``CompiledFxGraph.__call__``.  Between a UNet's kernels, with caches cold, those
layers cost 40-60 us per part call (not the 4 us of a warm micro-benchmark): about 2 ms of a
60 ms step for its 33 parts, most of the gap between regions and the whole graph.  For an
inference call they do nothing: no input mutation to replay, no alias to rebuild, no extra
argument (RNG seed, effect token), grad already off.

Safe only where that is shown, on the part's first call, which goes the usual way while this
module records what reached Inductor's compiled graph: exactly one compiled graph ran; it got
the very arguments the part got and returned the very objects the part returned (any wrapper
that adds, drops, detaches, deduplicates or regenerates a value fails this); grad is off before
and after; no output was marked dynamic; the caller says the part mutates nothing (so no
version counter needs a bump); the graph runs no CUDA graphs.  Training (grad on) never goes
direct.  Anything else keeps the usual path.

Part of the adapter to torch internals: only ``torch_internals`` imports this module.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

_lock = threading.Lock()
_local = threading.local()
_spies = 0           # first calls recording now (the spy is installed while > 0)
_original: Any = None


def _graph_class():
    from torch._inductor.output_code import CompiledFxGraph

    return CompiledFxGraph


def _spy(self, inputs):
    seen = getattr(_local, "seen", None)
    if seen is None:   # another thread's call while a first call records: not ours
        return _original(self, inputs)
    given = list(inputs)   # Inductor's call empties the list it gets
    out = _original(self, inputs)
    seen.append((self, given, out))
    return out


def _install() -> None:
    global _spies, _original
    with _lock:
        if _spies == 0:
            cls = _graph_class()
            _original = cls.__call__
            cls.__call__ = _spy
        _spies += 1


def _uninstall() -> None:
    global _spies
    with _lock:
        _spies -= 1
        if _spies == 0:
            _graph_class().__call__ = _original


def first_call(fn: Callable, args: tuple, mutates: bool) -> tuple[Any, Optional[Callable]]:
    """``fn(*args)`` the usual way, and Inductor's compiled code to call instead from now on
    (taking a list of the arguments) when that is shown to be the same call, else None."""
    if mutates or torch.is_grad_enabled():
        return fn(*args), None
    try:
        _install()
    except Exception:   # noqa: BLE001 - another torch: the usual path
        return fn(*args), None
    _local.seen = seen = []
    try:
        out = fn(*args)
    finally:
        _local.seen = None
        _uninstall()
    return out, _direct(seen, args, out)


def _direct(seen: list, args: tuple, out) -> Optional[Callable]:
    if len(seen) != 1 or torch.is_grad_enabled():
        return None
    graph, given, returned = seen[0]
    if getattr(graph, "cudagraph_info", None) is not None:
        return None
    call = getattr(graph, "current_callable", None)
    if call is None or not _same(given, args) or not _same(returned, out):
        return None
    if any(hasattr(o, "_dynamo_dynamic_indices") for o in out if isinstance(o, torch.Tensor)):
        return None   # the wrapper marked outputs dynamic: it would have to on every call
    return call


def _same(a, b) -> bool:
    return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(x is y for x, y in zip(a, b)))
