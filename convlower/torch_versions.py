"""The torch versions convlower supports: the gate, and one fallback per private API whose
spelling differs between them.

Only ``torch_internals`` imports this module (tests/test_architecture.py checks it): the rest
of the package calls ``torch_internals`` and never learns which torch it runs on.  Each
fallback detects the feature, not the version string, so a backport or a nightly takes the
path it can; tests/test_torch_versions.py simulates every older API on the pinned torch.
``bash bench/compat_torch.sh VERSION`` runs the compatibility tests on another torch
(docs/compat.md lists what passed).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
from typing import Optional

import torch

# The oldest torch convlower supports (pyproject.toml says the same), and the newest tested.
MIN_TORCH = (2, 8)
NEWEST_TESTED = (2, 15)


class UnsupportedTorchError(ImportError):
    """This torch cannot run convlower; raised when the backend is looked up (imported)."""


def parse_version(text: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a torch version string ("2.11.0+cu130", "2.16.0a0+git1234"), or None."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _missing_features() -> list[str]:
    """The torch APIs the compile cannot do without and that no fallback replaces."""
    missing = []
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError as e:
        return [f"torch._inductor ({e})"]
    if not hasattr(config, "post_grad_custom_pre_pass"):
        missing.append("torch._inductor.config.post_grad_custom_pre_pass")
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        missing.append("torch.library.custom_op")
    elif "tags" not in inspect.signature(custom_op).parameters:  # torch < 2.8
        missing.append("torch.library.custom_op(tags=...)")
    return missing


def unsupported_reason(version: Optional[str] = None) -> Optional[str]:
    """Why this torch (or ``version``) cannot run convlower, or None when it can."""
    version = str(torch.__version__ if version is None else version)
    wanted = "torch>=%d.%d" % MIN_TORCH
    parsed = parse_version(version)
    trying = os.environ.get("CONVLOWER_TRY_TORCH") == "1"  # to see what breaks below the range
    if parsed is not None and parsed < MIN_TORCH and not trying:
        return (f"convlower needs {wanted} (tested up to {'%d.%d' % NEWEST_TESTED}); this is "
                f"torch {version}. Upgrade torch (pip install '{wanted}'), or compile with "
                f"backend='inductor'.")
    missing = _missing_features()
    if missing:
        return (f"convlower cannot run on torch {version}: missing {', '.join(missing)}. "
                f"Use a torch between {'%d.%d' % MIN_TORCH} and {'%d.%d' % NEWEST_TESTED}, or "
                f"compile with backend='inductor'.")
    return None


def require_supported() -> None:
    """Raise :class:`UnsupportedTorchError` on a torch convlower cannot run on.  Called when
    ``torch_internals`` is imported, so ``torch.compile(m, backend="convlower")`` fails at the
    backend lookup with this message, never later inside a compile."""
    reason = unsupported_reason()
    if reason:
        raise UnsupportedTorchError(reason)


# -- fallbacks -------------------------------------------------------------------------------------
def size_hints(shape_env) -> dict:
    """The current value of every backed size symbol: ``backed_var_to_val``, else
    ``var_to_val`` (the same map under its older name, torch 2.8)."""
    backed = getattr(shape_env, "backed_var_to_val", None)
    return backed if backed is not None else shape_env.var_to_val


def hint(v: torch.SymInt, fallback: int = 8) -> int:
    """A SymInt's hint without a guard (``fallback`` for an unbacked size):
    ``optimization_hint`` (torch >= 2.13), else the module function ``size_hint`` (2.11),
    else ``SymNode.require_hint`` when the size has a hint (2.8)."""
    from torch.fx.experimental import symbolic_shapes

    for name in ("optimization_hint", "size_hint"):
        fn = getattr(symbolic_shapes, name, None)
        if fn is not None:
            return int(fn(v, fallback=fallback))
    return int(v.node.require_hint()) if v.node.has_hint() else fallback


def shape_config():
    from torch.fx.experimental import _config

    return _config


def size_oblivious():
    """A context inside which the size checks torch makes with ``guard_or_false`` /
    ``guard_or_true`` (is a size 1? are these strides contiguous?) take their general answer,
    valid for every size, instead of installing a guard on a backed size; checks whose answer
    changes the result (``bool()`` of a SymBool) still guard (``backed_size_oblivious``, an
    experimental config).  A torch without it (2.8) guards instead: the same result, maybe
    more recompiles."""
    config = shape_config()
    if not hasattr(config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return config.patch(backed_size_oblivious=True)


_CACHE_FIELDS = {"fx_graph_hit": "inductor_fx_local_cache_hit_count",
                 "fx_graph_miss": "inductor_fx_local_cache_miss_count",
                 "aot_autograd_hit": "aotautograd_local_cache_hit_count",
                 "aot_autograd_miss": "aotautograd_local_cache_miss_count"}


def cache_counts(metrics) -> dict[str, int]:
    """FX graph / AOTAutograd cache hits and misses of one ``CompilationMetrics`` entry; a
    torch whose entries lack these fields (2.8) counts 0 (observe only: never raise)."""
    return {key: getattr(metrics, field, None) or 0 for key, field in _CACHE_FIELDS.items()}
