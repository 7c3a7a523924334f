"""Which module instances become regions, read from Dynamo's ``nn_module_stack`` per node.

* a list of class names: every outermost instance of those classes;
* ``"auto"``: the classes a model lists in ``_repeated_blocks`` (diffusers' convention), plus
  every instance of a user class (not ``torch.nn``'s own layers) whose computation, shapes
  included, repeats at least twice in the graph; outer instances are preferred, so a repeated
  transformer stack is one region, not one per layer.  An instance seen only once is not a
  region: compiling it apart would share nothing and only cut fusion.
"""
from __future__ import annotations

import collections
from typing import Optional, Union

import torch.fx

from .signature import signature_of_nodes

Setting = Union[str, tuple]
# A smaller block is not worth a graph of its own under "auto": a compile's fixed cost (AOT
# trace, wrapper module, a kernel build) and the fusion lost at its seams outweigh what
# sharing it saves.  An explicit list of classes is taken as given.
MIN_AUTO_NODES = 8


def _entries(node: torch.fx.Node) -> list[tuple[str, object]]:
    """``[(instance key, class), ...]`` outermost first, from Dynamo's ``nn_module_stack``
    (whose values are ``(path, class)``; the class may be a type or its qualified name)."""
    return [(key, value[1] if isinstance(value, tuple) and len(value) > 1 else value)
            for key, value in (node.meta.get("nn_module_stack") or {}).items()]


def _name(cls) -> str:
    return cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]


def stack_of(node: torch.fx.Node) -> list[tuple[str, str]]:
    """``[(instance key, class name), ...]`` outermost first (empty for graph inputs)."""
    return [(key, _name(cls)) for key, cls in _entries(node)]


def declared_blocks(gm: torch.fx.GraphModule) -> set[str]:
    """Class names some module of the graph lists in ``_repeated_blocks``."""
    names: set[str] = set()
    for n in gm.graph.nodes:
        for _, cls in _entries(n):
            names.update(getattr(cls, "_repeated_blocks", None) or ())
    return names


def _user_class(cls) -> bool:
    module = getattr(cls, "__module__", "") if isinstance(cls, type) else str(cls)
    return not module.startswith("torch.")


def _compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def assign(gm: torch.fx.GraphModule, setting: Setting) -> dict[torch.fx.Node, Optional[str]]:
    """For each compute node, the key of the region instance it belongs to (None: glue)."""
    nodes = _compute_nodes(gm)
    wanted = set(setting) if isinstance(setting, tuple) else declared_blocks(gm)
    repeated = _repeated_instances(nodes) if setting == "auto" else set()
    out: dict = {}
    for n in nodes:
        out[n] = next((k for k, name in stack_of(n) if name in wanted or k in repeated), None)
    return out


def _repeated_instances(nodes: list) -> set[str]:
    """Keys of user-class instances whose nodes (signature_of_nodes: ops and input metadata)
    repeat in another instance of the same class, and that are big enough to stand alone."""
    members: dict[str, list] = collections.defaultdict(list)
    cls_of: dict[str, object] = {}
    for n in nodes:
        for key, cls in _entries(n):
            if _user_class(cls):
                members[key].append(n)
                cls_of[key] = cls
    by_sig: dict = collections.Counter()
    sig_of = {}
    for key, group in members.items():
        sig_of[key] = (cls_of[key], signature_of_nodes(group))
        by_sig[sig_of[key]] += 1
    return {k for k, s in sig_of.items() if by_sig[s] >= 2 and len(members[k]) >= MIN_AUTO_NODES}


def shared_share(owner: dict) -> float:
    """The share of the graph's compute nodes that lie in region instances repeating an earlier
    instance's computation (signature_of_nodes): what compiling once per block saves."""
    members: dict[str, list] = collections.defaultdict(list)
    for node, key in owner.items():
        if key is not None:
            members[key].append(node)
    seen, shared = set(), 0
    for group in members.values():
        sig = signature_of_nodes(group)
        shared += len(group) if sig in seen else 0
        seen.add(sig)
    return shared / max(len(owner), 1)
