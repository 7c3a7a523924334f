"""The cache folder of a warm-up: Inductor's cache, portable artifacts, convlower's decisions.

``convlower.warmup(..., cache_dir=D)`` keeps what makes a later compile cheap in ``D``:

* ``inductor/``: Inductor's cache directory (FX graph cache, AOTAutograd cache, the compiled
  C++ kernels).  On CPU this is what saves most: the kernels are not rebuilt.
* ``artifacts.bin``: the portable cache artifacts (``torch.compiler.save_cache_artifacts``),
  which refill an emptied Inductor cache directory (the C++ kernels are then rebuilt).
* ``convlower/``: convlower's rule decisions (:mod:`convlower.selection.cache`).

These hold pickled data: loading one runs code from it.  The folders are created owner-only
(0700), files are written owner-only (0600), and a folder another user owns or others can
write is refused (:class:`UnsafeCacheDir`).  A missing, corrupt, truncated or foreign entry is ignored with a warning, and the
model compiles anyway.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import warnings

import torch

from .. import torch_internals as ti
from ..private_files import write_atomic
from ..selection.cache import CACHE as DECISIONS
from ..version import __version__

log = logging.getLogger("convlower")

ARTIFACTS = "artifacts.bin"
_MAGIC = b"CONVLOWER-CACHE-ARTIFACTS\n"
_FORMAT = 1


class Warnings(list):
    def add(self, msg: str) -> None:
        self.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        log.warning(msg)


class UnsafeCacheDir(PermissionError):
    """A cache folder someone else could have written: loading it could run their code."""


def private_dir(path: str, warns: Warnings) -> str:
    """``path``, created owner-only (0700) if missing; a folder another user owns or others
    can write is refused (it holds pickled data: loading it runs code)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeCacheDir(f"convlower: refusing cache directory {path}: it belongs to another "
                             f"user, and it holds pickled data that runs code when loaded; use "
                             f"a directory you own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDir(f"convlower: refusing cache directory {path}: it is writable by "
                             f"others (mode {stat.S_IMODE(st.st_mode):o}), and it holds pickled "
                             f"data that runs code when loaded; `chmod 700 {path}` if only you "
                             f"write it")
    return path


def point_caches(cache_dir: str, warns: Warnings) -> None:
    private_dir(cache_dir, warns)
    inductor = private_dir(os.path.join(cache_dir, "inductor"), warns)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != inductor:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
        ti.clear_inductor_caches()  # cached paths still point at the old directory
    DECISIONS.set_directory(private_dir(os.path.join(cache_dir, "convlower"), warns))
    if ti.caches_disabled():
        warns.add("convlower: Inductor's caches are disabled (force_disable_caches / "
                  "TORCHINDUCTOR_FORCE_DISABLE_CACHES): cache_dir will not make compiles faster")


def _header() -> dict:
    return {"format": _FORMAT, "torch": torch.__version__, "convlower": __version__}


def load_artifacts(path: str, warns: Warnings) -> bool:
    """Load the portable cache artifacts at ``path``; any problem is a warning."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError as e:
        warns.add(f"convlower: cannot read cache artifacts {path}: {e}; compiling without them")
        return False
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a convlower cache-artifacts file")
        head, sep, payload = data[len(_MAGIC):].partition(b"\n")
        if not sep:
            raise ValueError("truncated header")
        meta = json.loads(head)
        want = _header()
        for k in ("format", "torch"):
            if meta.get(k) != want[k]:
                raise ValueError(f"written for {k} {meta.get(k)!r}, this is {want[k]!r}")
        if len(payload) != meta.get("size") or hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            raise ValueError(f"truncated or corrupt ({len(payload)} of {meta.get('size')} bytes)")
        torch.compiler.load_cache_artifacts(payload)
        return True
    except Exception as e:
        warns.add(f"convlower: ignoring cache artifacts {path}: {type(e).__name__}: {e}; "
                  f"compiling anyway")
        return False


def save_artifacts(path: str, warns: Warnings) -> None:
    try:
        saved = torch.compiler.save_cache_artifacts()
        if not saved or not saved[0]:
            return  # nothing new (e.g. everything came from the cache directory): keep the file
        payload = saved[0]
        meta = dict(_header(), size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        write_atomic(path, _MAGIC + json.dumps(meta).encode() + b"\n" + payload)
    except Exception as e:
        warns.add(f"convlower: could not save cache artifacts to {path}: {type(e).__name__}: {e}")


def broken_cache(error: BaseException) -> bool:
    """Whether ``error`` comes from a corrupt cached module or kernel library (an import that
    failed), not from the model: then the cache is discarded, not the model's saving."""
    for _ in range(32):  # Dynamo and Inductor wrap it
        if error is None:
            return False
        if isinstance(error, (ImportError, SyntaxError)) or "Failed to import" in str(error):
            return True
        error = getattr(error, "inner_exception", None) or error.__cause__
    return False


def fresh_inductor_dir(cache_dir: str, error: Exception, warns: Warnings) -> None:
    """Inductor ignores an unreadable cache entry but fails on a corrupt cached module or
    kernel library; move the whole Inductor cache aside and compile from scratch."""
    inductor = os.path.join(cache_dir, "inductor")
    while getattr(error, "inner_exception", None) or error.__cause__:  # Dynamo wraps it
        error = getattr(error, "inner_exception", None) or error.__cause__
    first = (str(error).strip().splitlines() or [""])[0][:300]
    warns.add(f"convlower: compiling with the cache in {inductor} failed ({type(error).__name__}: "
              f"{first}); discarding that cache and compiling anyway")
    aside = f"{inductor}.discarded-{os.getpid()}"
    with contextlib.suppress(OSError):
        os.replace(inductor, aside)
    shutil.rmtree(aside, ignore_errors=True)
    private_dir(inductor, warns)
    ti.clear_inductor_caches()
