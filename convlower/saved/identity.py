"""What a saved compile is valid for, and which of it changed.

A saved compile keeps only the guards that can be written to disk (sizes, strides, dtypes, grad
mode, constant attributes); identity guards on code and modules stay behind.  So the entry is
keyed on the rest here: versions, the model's class and structure (module tree, parameter
shapes and dtypes, ``repr`` with each module's settings), the inputs, the compile's context
(convlower's options, measured decisions, Inductor's config) and, checked at load, the source
of every module the trace read.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import platform

import torch

from .. import torch_internals as ti
from ..version import __version__

FORMAT = 2  # 2: a saved split's parts carry their outputs' traced strides (torch_saved.py)
# Fields that pick the file: another model or input signature gets a file of its own, so
# two models warmed up in one folder do not evict each other.
_SLOT_FIELDS = ("model", "inputs", "grad", "backward")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _spec(x) -> object:
    if isinstance(x, torch.Tensor):
        return [str(x.dtype), list(x.shape), list(x.stride()), str(x.device), x.requires_grad]
    return repr(type(x).__name__) if not isinstance(x, (int, float, bool, str)) else repr(x)


def _structure(model) -> str:
    if not isinstance(model, torch.nn.Module):
        return _digest(getattr(model, "__qualname__", repr(model)))
    tensors = [(n, str(t.dtype), list(t.shape)) for n, t in
               [*model.named_parameters(), *model.named_buffers()]]
    return _digest(repr(model) + json.dumps(tensors))


def identity(model, inputs: tuple, context: dict) -> dict:
    """The identity of a compile of ``model`` on ``inputs``; ``context`` adds the compile's
    settings (JSON-able), which the caller knows and this room does not."""
    kind = type(model)
    return {"format": FORMAT, "convlower": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "model": f"{kind.__module__}.{kind.__qualname__}",
            "structure": _structure(model), "inputs": [_spec(x) for x in inputs],
            "grad": torch.is_grad_enabled(), "inductor_config": ti.inductor_config_digest(),
            **{k: json.loads(json.dumps(v, default=str)) for k, v in context.items()}}


def slot(ident: dict) -> str:
    return _digest(json.dumps({k: ident.get(k) for k in _SLOT_FIELDS}, sort_keys=True))


def differences(saved: dict, now: dict) -> list[str]:
    """The fields of ``now`` that ``saved`` does not match, by name."""
    return sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))


def source_digest(module_name: str) -> str:
    """sha256 of a module's source, as torch's saved trace records it (``inspect.getsource``)."""
    try:
        return hashlib.sha256(inspect.getsource(importlib.import_module(module_name))
                              .encode()).hexdigest()
    except Exception:  # gone or unreadable: cannot match a saved digest
        return ""


def model_sources(model) -> dict[str, str]:
    """{module: source digest} of the classes ``model`` is built from (torch's own aside: the
    torch version is in the identity)."""
    kinds = model.modules() if isinstance(model, torch.nn.Module) else [model]
    names = {type(m).__module__ for m in kinds} - {"builtins"}
    return {n: source_digest(n) for n in sorted(names) if not n.startswith("torch.")}


def changed_sources(saved: dict) -> list[str]:
    """Modules whose source differs from the one the saved trace read."""
    return sorted(m for m, digest in saved.items() if source_digest(m) != digest)
