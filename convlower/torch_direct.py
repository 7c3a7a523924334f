"""A compiled part's inference calls go straight to Inductor's generated code.

Why.  The split graph of regions calls each compiled part through AOTAutograd's runtime wrapper
and Inductor's ``CompiledFxGraph.__call__``.  Between a UNet's kernels, with caches cold, those
layers cost 40-60 us per part call (not the 4 us of a warm micro-benchmark): about 2 ms of a
60 ms step for its 33 parts.  For a plain inference call they do nothing: no input mutation to
replay, no alias to rebuild, no version counter to bump, no extra argument (RNG seed, effect
token), grad already off, autocast not in play.

Safe only where that is shown, on the part's first call, which goes the usual way while this
module records what reached Inductor's compiled graph.  Later calls go straight only if: grad
and autocast are off (training and mixed precision keep the wrappers: AOTAutograd runs a graph
traced under autocast with autocast disabled); every argument is a tensor (no symbolic size,
whose outputs the wrapper marks dynamic); the caller says the part's graph writes nothing in
place, and no argument's version counter moved during the call (what the wrapper bumps for a
mutated input); exactly one compiled graph ran, with the very arguments the part got,
returning the very objects the part returned (any wrapper that adds, drops, detaches,
deduplicates or regenerates a value fails this); no output came back marked dynamic; the graph
runs no CUDA graphs and Inductor compiles in its normal mode (an async or progressive compile
swaps its code after the first calls).  Anything else keeps the usual path.

Part of the adapter to torch internals: imported by ``torch_saved`` (the part caller) only.
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


# Where torch's wrappers mark a tensor's dynamic dims (names differ between versions).
_DYNAMIC_MARKS = ("_dynamo_dynamic_indices", "_dynamo_propagated_dynamic_indices",
                  "_dynamo_weak_dynamic_indices")
_ABSENT = object()


def first_call(fn: Callable, args: tuple, wrapped: bool) -> tuple[Any, Optional[Callable]]:
    """``fn(*args)`` the usual way, and Inductor's compiled code to call instead from now on
    (taking a list of the arguments) when that is shown to be the same call, else None;
    ``wrapped``: the caller keeps the wrappers anyway (the part writes in place, or
    ``part_calls="wrapped"``)."""
    if wrapped or not _plain_inference(args):
        return fn(*args), None
    try:
        _install()
    except Exception:   # noqa: BLE001 - another torch: the usual path
        return fn(*args), None
    versions = _versions(args)
    _local.seen = seen = []
    try:
        out = fn(*args)
    finally:
        _local.seen = None
        _uninstall()
    return out, _direct(seen, args, out, versions)


def _plain_inference(args: tuple) -> bool:
    """Grad and autocast off, Inductor in its normal compile mode, every argument a tensor."""
    try:
        from torch._inductor import compile_fx

        staged = getattr(compile_fx, "fx_compile_async", True) or getattr(
            compile_fx, "fx_compile_progressive", True)
        autocast = torch._C._is_any_autocast_enabled()
    except Exception:   # noqa: BLE001 - another torch: the usual path
        return False
    return not (torch.is_grad_enabled() or autocast or staged) and all(
        isinstance(a, torch.Tensor) for a in args)


def _versions(args) -> list:
    # an inference tensor has no version counter, and the wrapper bumps none
    return [None if a.is_inference() else a._version for a in args if isinstance(a, torch.Tensor)]


def _direct(seen: list, args: tuple, out, versions: list) -> Optional[Callable]:
    if len(seen) != 1 or not _plain_inference(args) or _versions(args) != versions:
        return None
    graph, given, returned = seen[0]
    if getattr(graph, "cudagraph_info", _ABSENT) is not None:
        return None   # CUDA graphs, or a torch whose graphs say nothing about them
    call = getattr(graph, "current_callable", None)
    if call is None or not _same(given, args) or not _same(returned, out):
        return None
    if any(hasattr(o, mark) for o in out if isinstance(o, torch.Tensor) for mark in _DYNAMIC_MARKS):
        return None   # the wrapper marked outputs dynamic: it would have to on every call
    return call


def _same(a, b) -> bool:
    return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(x is y for x, y in zip(a, b)))
