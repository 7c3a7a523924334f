"""The C++ kernels of one generated module built as a few libraries instead of one each.

Why.  On CPU, Inductor builds every fused kernel as its own shared library: one g++ run per
kernel.  Most of that run is a fixed cost (start, precompiled header, link against libtorch):
on the 2-core development CPU an empty kernel takes 0.49 s, a typical one 0.7 s, and twenty
kernels in one translation unit 2.2 s instead of 14 s.  On a UNet that fixed cost is most of the
compile (docs/regions.md, "Kernel builds").

How.  While a module Inductor generated is loaded, ``AsyncCompile.cpp_pybinding`` (one call per
kernel) is answered with a :class:`_Pending`; ``AsyncCompile.wait(globals())``, which every such
module calls once at its end, then builds the pending kernels in up to ``compile_threads``
libraries (each kernel in a namespace of its own, one Python binding per kernel, Inductor's own
build command and cache) and puts the loaded functions where the module expects them.  Each
kernel's source is indexed on disk beside Inductor's cache, so a later load of any module with
that kernel (a warm start, a saved compile, another graph) finds its library without a build.

Only in a convlower compile (``active()``) are kernels built this way; elsewhere an indexed
kernel is loaded from its library, any other built as Inductor builds it.  Any failure falls
back to Inductor's per-kernel build: the generated code is the same, so results do not change.

Part of the adapter to torch internals: only ``torch_internals`` imports this module.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import math
import os
import threading
import time
from typing import Callable, Optional

from .kernel_library import bindable as _batchable
from .kernel_library import library_source as _library_source

log = logging.getLogger("convlower")

MIN_KERNELS = 2         # one kernel gains nothing from a shared library
KERNELS_PER_LIBRARY = 8  # below this, a second library's fixed cost is not worth a 2nd core

_lock = threading.Lock()
_state = {"installed": False, "active": None, "originals": None, "on_build": None}
_loaded: dict[str, Callable] = {}   # kernel key -> loaded function (this process)
_deferred = threading.local()       # .jobs: kernels left for the end of built_at_end()


class _Pending:
    """A kernel Inductor asked for, built at the module's ``wait`` (or alone when called first)."""

    __slots__ = ("argtypes", "source", "fn", "key", "name", "scope")

    def __init__(self, argtypes, source):
        self.argtypes, self.source, self.fn = list(argtypes), source, None
        self.key = self.name = self.scope = None  # scope: the module's, when built at the end

    def __call__(self, *args):
        if self.fn is None:  # called before its module's wait, or inside built_at_end()
            self.fn = _original_binding(self.argtypes, self.source)
            if self.scope is not None:
                self.scope[self.name] = self.fn
        return self.fn(*args)


def install(active: Callable[[], bool], on_build: Optional[Callable] = None) -> bool:
    """Answer Inductor's C++ kernel loads as above; ``active()`` says whether kernels not built
    yet are built together; ``on_build(built, loaded, libraries, seconds)`` hears of each
    module's kernels: built together now, loaded from earlier libraries.
    False (nothing installed) where this torch's Inductor is not the one this was written for."""
    try:
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import CppPythonBindingsCodeCache  # noqa: F401
    except ImportError:
        return False
    with _lock:
        _state["active"], _state["on_build"] = active, on_build
        if _state["installed"]:
            return True
        binding, wait = getattr(AsyncCompile, "cpp_pybinding", None), getattr(AsyncCompile, "wait", None)
        if binding is None or wait is None or list(inspect.signature(binding).parameters) != [
                "self", "argtypes", "source_code"]:
            return False
        _state["originals"] = (binding, wait)
        AsyncCompile.cpp_pybinding = _cpp_pybinding
        AsyncCompile.wait = _wait
        _state["installed"] = True
        return True


def _cpp_pybinding(self, argtypes, source_code):
    if _batchable(argtypes, source_code):
        return _Pending(argtypes, source_code)
    return _state["originals"][0](self, argtypes, source_code)


def _wait(self, scope):
    pending = {name: v for name, v in scope.items() if isinstance(v, _Pending) and v.fn is None}
    if pending:
        try:
            found = _resolve(scope, pending)
        except Exception:  # never break a compile: Inductor builds what is left, one by one
            log.warning("convlower: building kernels together failed; building them one by one",
                        exc_info=True)
            found = {}
        for name, p in pending.items():
            if name in found:
                scope[name] = found[name]
            elif p.scope is None:  # not left for the end of built_at_end()
                scope[name] = _state["originals"][0](self, p.argtypes, p.source)
    return _state["originals"][1](self, scope)


@contextlib.contextmanager
def built_at_end():
    """Kernels of every module loaded inside (a graph split into regions: one module per part)
    are built together, not module by module: while the next parts compile, whatever is held
    back is built as one library on another core (:class:`_Batch`, one at a time); what is
    left when the block ends is built then."""
    if getattr(_deferred, "jobs", None) is not None:
        yield  # nested: the outermost block builds
        return
    _deferred.jobs, _deferred.batches = [], []
    try:
        yield
    except BaseException:
        _deferred.jobs = _deferred.batches = None
        raise
    jobs, batches = _deferred.jobs, _deferred.batches
    _deferred.jobs = _deferred.batches = None
    held = [p for b in batches for p in b.jobs] + jobs
    _finish([p for p in held if p.fn is None], batches)  # not those called (built) meanwhile


class _Batch:
    """Held-back kernels built as one library in a background thread (g++ runs on another
    core while this one compiles the next part); joined at the end of built_at_end().  It runs
    at the lowest priority, so a measurement meanwhile need not wait for it (``quiet``): on the
    UNet, screens waited 6.7 s of a 43 s compile for builds to end."""

    def __init__(self, jobs: list):
        self.jobs, self.fns, self.yields, ready = jobs, {}, False, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,),
                                       name="convlower-kernel-build", daemon=True)
        self.thread.start()
        ready.wait()  # its priority is set (or cannot be) before anything is measured

    def _run(self, ready):
        self.yields = _lowest_priority()
        ready.set()
        try:
            self.fns, _ = _build(list({p.key: p for p in self.jobs}.values()), libraries=1)
        except Exception:  # built at the end (or one by one) instead
            log.debug("convlower: background kernel build failed", exc_info=True)


def _lowest_priority() -> bool:
    """This thread and the g++ it starts (children inherit it) at the lowest CPU priority: they
    take only a core nothing else of ours wants, and give it up to a measurement's threads at
    once.  False where a thread's priority cannot be set (not Linux)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return True
    except (AttributeError, OSError):
        return False


def start_held_back() -> None:
    """Inside built_at_end(): start building what is held back when no build is running: when
    a module loads, and when a graph's measurements are done (the conv pass), so a build that
    ended meanwhile is followed at once."""
    jobs, batches = getattr(_deferred, "jobs", None), getattr(_deferred, "batches", None)
    if jobs is None or batches is None or (batches and batches[-1].thread.is_alive()):
        return
    built = {k for b in batches for k in b.fns}
    fresh = [p for p in jobs if p.key not in built and p.fn is None]  # not built alone since
    if len({p.key for p in fresh}) >= MIN_KERNELS:
        batches.append(_Batch(fresh))
        jobs[:] = [p for p in jobs if p.key in built]  # assigned at the end from the batches


@contextlib.contextmanager
def quiet():
    """A measurement inside built_at_end(): what it compiles is built when loaded, as outside
    (it is called at once; held back it would only be built alone, then again at the end), and
    a background build that could not give way (``_lowest_priority``) finishes first: a g++
    beside the timing would slow what it times."""
    for batch in getattr(_deferred, "batches", None) or ():
        if not batch.yields:
            batch.thread.join()
    jobs, _deferred.jobs = getattr(_deferred, "jobs", None), None
    try:
        yield
    finally:
        _deferred.jobs = jobs


def _finish(jobs: list, batches: list = ()) -> None:
    fns, libraries, start = {}, 0, time.perf_counter()
    try:
        building = {p.key for b in batches for p in b.jobs}
        rest = list({p.key: p for p in jobs if p.key not in building}.values())
        if rest:  # while a background build still runs: both cores busy
            built, libraries = _build(rest)
            fns.update(built)
        for b in batches:
            b.thread.join()
            fns.update(b.fns)
            libraries += bool(b.fns)
        failed = list({p.key: p for p in jobs if p.key not in fns}.values())
        if failed:  # a background build that failed: once more here
            built, more = _build(failed)
            fns.update(built)
            libraries += more
        count = len({p.key for p in jobs})
        if _state["on_build"] is not None and count:  # seconds: what this thread waited
            _state["on_build"](count, 0, libraries, time.perf_counter() - start)
    except Exception:
        log.warning("convlower: building kernels together failed; building them one by one",
                    exc_info=True)
    for p in jobs:
        p.fn = fns.get(p.key) or _original_binding(p.argtypes, p.source)
        p.scope[p.name] = p.fn


def _key(argtypes, source: str) -> str:
    # with what the build command depends on: an index entry from another setting is not used
    return hashlib.sha256(repr((list(argtypes), source, _build_setting())).encode()).hexdigest()[:40]


def _build_setting() -> str:
    import torch
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{torch.__version__}|{pick_vec_isa()}|{config.cpp.cxx}|{config.cpp_cache_precompile_headers}"


def _resolve(scope: dict, pending: dict) -> dict:
    keys = {name: _key(p.argtypes, p.source) for name, p in pending.items()}
    found = {name: _loaded[k] for name, k in keys.items() if k in _loaded}
    found.update(_from_index({n: k for n, k in keys.items() if n not in found}))
    todo = [pending[n] for n in pending if n not in found]
    active, on_build = _state["active"], _state["on_build"]
    if active is None or not active():
        return found
    for name, p in pending.items():
        p.key, p.name = keys[name], name
    jobs = getattr(_deferred, "jobs", None)
    if jobs is not None:  # built at the end of built_at_end(), with the other modules' kernels
        for p in todo:
            p.scope = scope
        jobs += todo
        todo = []
        start_held_back()
    built, libraries, start = 0, 0, time.perf_counter()
    if len(todo) >= MIN_KERNELS:
        fns, libraries = _build(todo)
        found.update({p.name: fns[p.key] for p in todo})
        built = len(todo)
    if on_build is not None and (built or found):
        on_build(built, len(found) - built, libraries, time.perf_counter() - start)
    return found


def _index_dir() -> str:
    from torch._inductor.runtime.runtime_utils import cache_dir

    return os.path.join(cache_dir(), "convlower_kernels")


def _from_index(keys: dict) -> dict:
    """Kernels built together earlier (any process using this Inductor cache)."""
    out, libraries = {}, {}
    for name, k in keys.items():
        try:
            with open(os.path.join(_index_dir(), "index", k)) as f:
                library, fn_name = f.read().split()
        except (OSError, ValueError):
            continue
        try:
            if library not in libraries:
                with open(os.path.join(_index_dir(), library)) as f:
                    libraries[library] = _bindings().load_async(f.read(), "cpu")()
            out[name] = _loaded[k] = getattr(libraries[library], fn_name)
        except Exception:  # a stale or broken library: built again (or one by one)
            log.debug("convlower: kernel library %s not loaded", library, exc_info=True)
    return out


def _build(todo: list, libraries: Optional[int] = None) -> tuple[dict, int]:
    """Build the pending kernels ``todo`` in a few libraries (``libraries``, or as many as
    compile threads and their number make worth it): {kernel key: function}, and how many."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    count = libraries or max(1, min(get_compile_threads(),
                                    math.ceil(len(todo) / KERNELS_PER_LIBRARY)))
    chunks = [todo[i::count] for i in range(count)]
    sources = [_library_source([(p.argtypes, p.source) for p in c]) for c in chunks]
    submit = AsyncCompile.submit if count > 1 else None
    futures = [_bindings().load_async(s, "cpu", submit_fn=submit) for s in sources]
    fns = {}
    for chunk, source, future in zip(chunks, sources, futures):
        module = future()  # waits for g++
        library = _write_library(source)
        for i, p in enumerate(chunk):
            fns[p.key] = _loaded[p.key] = getattr(module, f"kernel_{i}")
            _write_index(p.key, library, f"kernel_{i}")
    return fns, count


def _write_library(source: str) -> str:
    name = hashlib.sha256(source.encode()).hexdigest()[:40] + ".cpp"
    _atomic_write(os.path.join(_index_dir(), name), source)
    return name


def _write_index(key: str, library: str, fn_name: str) -> None:
    _atomic_write(os.path.join(_index_dir(), "index", key), f"{library} {fn_name}\n")


def _atomic_write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _original_binding(argtypes, source):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


@functools.cache
def _bindings():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    class BatchBindings(CppPythonBindingsCodeCache):
        """Inductor's build, cache and loader for Python-bound C++, for a module of many kernels
        (its init is ``PyInit_kernels``, named by ``entry_function``)."""
        cache: dict = {}
        entry_function = "kernels"

    return BatchBindings


