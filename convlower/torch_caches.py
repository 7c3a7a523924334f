"""Inductor's caches, as convlower's statistics and warm-up see them: where they live, clearing
and switching them off, and hooks on the FX graph cache (which entry a compile saved or was
served).  Part of the adapter to torch internals: only ``torch_internals`` imports this module
and re-exports its functions (tests/test_architecture.py checks both).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger("convlower")


def clear_inductor_caches() -> None:
    """Forget Inductor's in-memory caches (after its cache directory changed)."""
    try:
        from torch._inductor.utils import clear_caches

        clear_caches()
    except Exception:
        pass


def inductor_cache_dir() -> Optional[str]:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:
        return None


def caches_disabled() -> bool:
    """Whether Inductor's caches are forced off (config or TORCHINDUCTOR_FORCE_DISABLE_CACHES)."""
    try:
        return bool(torch._inductor.config.force_disable_caches)
    except Exception:
        return False


@contextlib.contextmanager
def inductor_caches_off():
    """Inductor's caches off inside (a cold compile)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(force_disable_caches=True):
        yield


# -- FX graph cache: which entry a compile saved or was served (observe only: never raise) ------
_cache_hooks: dict[str, list] = {"lookup": [], "save": []}


def post_grad_pass():
    """The post-grad custom pass in Inductor's config now (the compile's own, or None)."""
    try:
        return torch._inductor.config.post_grad_custom_pre_pass
    except Exception:
        return None


def cached_graph_guards(graph) -> str:
    """The guard expression an FX-graph-cache entry is stored under (one key holds one entry
    per guard set); set on a compiled graph when it is saved or loaded."""
    return getattr(graph, "guards_expr", None) or ""


def _run_hooks(kind: str, *args) -> None:
    for fn in _cache_hooks[kind]:
        try:
            fn(*args)
        except Exception as e:
            log.warning("convlower: FX graph cache %s hook failed: %r", kind, e)


def on_fx_graph_cache(on_lookup: Callable, on_save: Callable) -> bool:
    """After each lookup in Inductor's FX graph cache call ``on_lookup(key, graph, backward)``
    (``graph`` None on a miss), after each save ``on_save(key, graph)``.  Lookups made for an
    AOTAutograd cache hit (its forward and backward entries) pass here too."""
    try:
        import inspect

        from torch._inductor.codecache import FxGraphCache

        if on_lookup not in _cache_hooks["lookup"]:
            _cache_hooks["lookup"].append(on_lookup)
        if on_save not in _cache_hooks["save"]:
            _cache_hooks["save"].append(on_save)
        load, save = FxGraphCache.load_with_key, FxGraphCache._save_graph
        if getattr(load, "_convlower", False):
            return True
        signature = inspect.signature(load)

        def load_with_key(*args, **kwargs):
            result = load(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            _run_hooks("lookup", bound["key"], result[0], bool(bound.get("is_backward")))
            return result

        def save_graph(key, compiled_graph, *args, **kwargs):
            save(key, compiled_graph, *args, **kwargs)
            _run_hooks("save", key, compiled_graph)

        load_with_key._convlower = save_graph._convlower = True
        FxGraphCache.load_with_key = staticmethod(load_with_key)
        FxGraphCache._save_graph = staticmethod(save_graph)
        return True
    except Exception as e:
        log.debug("convlower: no FX graph cache hooks: %r", e)
        return False


def remember_vec_isa_probe(active: Callable[[], bool]) -> bool:
    """Inductor checks each CPU vector ISA once per process: it builds a small library (cached)
    and loads it in a fresh Python child, about 0.45 s per ISA, 1.4 s per process on the 2-core
    development machine even with a warm cache.  Inside a convlower compile (``active()``), or
    in the probe started ahead (:func:`probe_vec_isa_ahead`), a library that loaded on this
    machine is taken as loading again: the answer is kept beside it, for this host, CPU flags,
    Python and torch (another machine sharing the cache probes anew).  False where this torch's
    Inductor has no such probe."""
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:
        return False
    probe = getattr(VecISA, "_probe_load", None)
    if probe is None or getattr(probe, "convlower_original", None) is not None:
        return probe is not None
    import inspect

    if list(inspect.signature(probe).parameters) != ["self", "output_path"]:
        return False

    def _probe_load(self, output_path):
        if not (active() or getattr(_ahead, "on", False)):
            return probe(self, output_path)
        marker, machine = output_path + ".convlower-loads", _machine()
        try:
            with open(marker) as f:
                if f.read() == machine:
                    return True
        except OSError:
            pass
        ok = probe(self, output_path)
        if ok:
            with contextlib.suppress(OSError), open(marker, "w") as f:
                f.write(machine)
        return ok

    _probe_load.convlower_original = probe
    VecISA._probe_load = _probe_load
    return True


_ahead = threading.local()    # .on: this thread is the probe started ahead
_ahead_lock = threading.Lock()
_ahead_thread: Optional[threading.Thread] = None


def _probed_stamp() -> Optional[str]:
    folder = inductor_cache_dir()
    return None if folder is None else os.path.join(folder, "convlower_kernels", "vec-isa-probed")


_stamped: set = set()   # stamps found for this machine (every compile asks again)


def _probed_here() -> bool:
    """Whether a probe ahead finished with this cache folder on this machine: every library
    that loads is then marked, and what is left of the check is Python (no child to overlap)."""
    path = _probed_stamp()
    if path in _stamped:
        return True
    try:
        with open(path) as f:
            if f.read() == _machine():
                _stamped.add(path)
                return True
    except (OSError, TypeError):
        pass
    return False


def probe_vec_isa_ahead() -> bool:
    """Run Inductor's vector-ISA check (build and load a library per ISA) in a background
    thread, once per process: its compiler and loader children run on another core while this
    thread traces the graph.  Whoever asks for the ISA list meanwhile waits for that thread
    (two threads checking at once would share the ISA objects' temporary compiler flags).
    Nothing starts where the ISA is configured (``cpp.vec_isa_ok``: no check runs), this
    Inductor has no such check, or a probe ahead already ran with this cache on this machine
    (the marked libraries need no child; a thread would only take the interpreter's lock from
    a compile that may generate no kernel at all).  True when started."""
    global _ahead_thread
    try:
        from torch._inductor import config, cpu_vec_isa
    except ImportError:
        return False
    listed = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if (listed is None or not hasattr(listed, "cache_clear") or config.is_fbcode()
            or config.cpp.vec_isa_ok is not None):
        return False
    with _ahead_lock:
        if _ahead_thread is not None or _probed_here():
            return False
        stamp = _probed_stamp()

        def run():
            _ahead.on = True
            try:
                listed()  # cached per process: what pick_vec_isa reads
                with contextlib.suppress(OSError, TypeError):
                    os.makedirs(os.path.dirname(stamp), exist_ok=True)
                    with open(stamp, "w") as f:
                        f.write(_machine())
            except Exception as e:  # the first caller checks again, as it always did
                log.debug("convlower: vector-ISA probe ahead failed: %r", e)

        def valid_vec_isa_list():
            if threading.current_thread() is not thread:
                thread.join()
            return listed()

        valid_vec_isa_list.cache_clear = listed.cache_clear
        valid_vec_isa_list.convlower_original = listed
        thread = _ahead_thread = threading.Thread(target=run, name="convlower-vec-isa-probe",
                                                  daemon=True)
        cpu_vec_isa.valid_vec_isa_list = valid_vec_isa_list
        thread.start()
    return True


def wait_for_probe_ahead() -> None:
    """Until the probe started ahead has finished (nothing when none was started)."""
    thread = _ahead_thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _machine() -> str:
    """This machine as far as loading a CPU library goes."""
    import platform
    import socket
    import sys

    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    return "|".join((socket.gethostname(), platform.machine(), sys.executable, torch.__version__,
                     str(os.uname().release if hasattr(os, "uname") else ""), flags.strip()))
