"""Find Snake activations in the Dynamo graph and route each one: fused or eager-safe.

Snake is ``x + 1/(beta + 1e-9) * sin(alpha * x)^2``; DAC and transformers' DAC use
``beta = alpha``, diffusers' Oobleck passes ``alpha = exp(a), beta = exp(b)`` when logscale.
On ROCm with bf16, Inductor's generated kernel for it failed to build (hiprtc), so there a
site runs as the opaque custom op ``convlower::snake`` (decompositions/snake.py), whose
backward is opaque too; everywhere else Inductor fuses it as usual.

This works on the graph Dynamo hands the backend, BEFORE AOTAutograd: replacing the site
there means the backward AOTAutograd derives is the custom op's backward, not the
differentiated sin/cos that Inductor would generate code for.  The graph holds torch-level
calls in several spellings (``torch.sin(t)`` or ``t.sin()``, ``.reciprocal()`` or ``1 / t``,
``.pow(2)`` / ``** 2`` / ``square`` / ``t * t``, either operand order), so each node is first
normalised to a canonical op name.  A site is rewritten only when the constant is exactly
1e-9 and every intermediate has no other user; DAC's reshapes around it stay as they are.

Routing (:func:`decide_route`) is a pure function of the ``snake`` option, the platform
(``convlower.device.platform``, injectable) and the dtypes.  Every site found is recorded in the
report with its route and why.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import re
from typing import Optional

import torch
from torch.fx import Graph, GraphModule, Node

from ..decompositions import snake as snake_op
from ..device import platform as device_platform
from ..observe.records import SnakeRecord, record

log = logging.getLogger("convlower")

_FUNCTIONS = {
    operator.add: "add", torch.add: "add",
    operator.mul: "mul", torch.mul: "mul",
    operator.truediv: "div", torch.div: "div", torch.true_divide: "div",
    operator.pow: "pow", torch.pow: "pow",
    torch.square: "square", torch.sin: "sin", torch.reciprocal: "reciprocal", torch.exp: "exp",
    torch.reshape: "reshape",
}
_METHODS = {"add": "add", "mul": "mul", "div": "div", "true_divide": "div", "pow": "pow",
            "square": "square", "sin": "sin", "reciprocal": "reciprocal", "exp": "exp",
            "reshape": "reshape", "view": "reshape"}


def canonical(node) -> Optional[tuple[str, tuple]]:
    """``(op name, positional args)`` for the spellings Snake is written in, else None.

    ``1 / t`` becomes ``reciprocal(t)`` and ``t ** 2`` / ``t * t`` become ``square(t)``."""
    if not isinstance(node, Node) or node.kwargs:
        return None  # kwargs (add's alpha=, div's rounding_mode=) change the meaning
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        name = _METHODS.get(node.target)
    else:
        return None
    args = tuple(node.args)
    if name is None:
        return None
    if name == "div" and len(args) == 2 and _is_number(args[0], 1):
        return "reciprocal", args[1:]
    if name == "pow" and len(args) == 2 and _is_number(args[1], 2):
        return "square", args[:1]
    if name == "mul" and len(args) == 2 and isinstance(args[0], Node) and args[0] is args[1]:
        return "square", args[:1]
    return name, args


def _is_number(a, value) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == value


def _tensor(a) -> Optional[torch.Tensor]:
    v = a.meta.get("example_value") if isinstance(a, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _only_user(node, user: Node) -> bool:
    return isinstance(node, Node) and list(node.users) == [user]


def _unary(node, name: str, user: Node):
    """The operand of ``node`` when it is ``name(operand)`` used only by ``user``."""
    op = canonical(node)
    if op and op[0] == name and len(op[1]) == 1 and _only_user(node, user):
        return op[1][0]
    return None


def _pairs(args):
    return (args, args[::-1]) if len(args) == 2 else ()


@dataclasses.dataclass
class Site:
    add: Node                # the node computing the Snake's result
    x: Node
    alpha: Node
    beta: Node
    inner: tuple[Node, ...]  # the other nodes of the formula, each used once, users first
    variant: str


def match(add: Node) -> Optional[Site]:
    """The Snake site whose result is ``add``, or None."""
    op = canonical(add)
    if not op or op[0] != "add":
        return None
    for x, term in _pairs(op[1]):
        site = _match_term(add, x, term)
        if site is not None:
            return site
    return None


def _match_term(add: Node, x, term) -> Optional[Site]:
    # term = reciprocal(beta + 1e-9) * square(sin(alpha * x))
    op = canonical(term)
    if _tensor(x) is None or not op or op[0] != "mul" or not _only_user(term, add):
        return None
    for recip, sq in _pairs(op[1]):
        shifted = _unary(recip, "reciprocal", term)
        sine = _unary(sq, "square", term)
        scaled = _unary(sine, "sin", sq)
        beta = _plus_eps(shifted, recip)
        alpha = _times_x(scaled, sine, x)
        if beta is None or alpha is None:
            continue
        return Site(add, x, alpha, beta, (term, recip, shifted, sq, sine, scaled),
                    _variant(add, x, alpha, beta))
    return None


def _plus_eps(node, user: Node):
    """beta, when ``node`` is ``beta + 1e-9`` used only by ``user``."""
    op = canonical(node)
    if not op or op[0] != "add" or not _only_user(node, user):
        return None
    for beta, eps in _pairs(op[1]):
        if _tensor(beta) is not None and isinstance(eps, float) and eps == snake_op.EPS:
            return beta
    return None


def _times_x(node, user: Node, x: Node):
    """alpha, when ``node`` is ``alpha * x`` used only by ``user``."""
    op = canonical(node)
    if op and op[0] == "square" and op[1][0] is x and _only_user(node, user):
        return x  # x * x: alpha is x itself
    if not op or op[0] != "mul" or not _only_user(node, user):
        return None
    for alpha, other in _pairs(op[1]):
        if other is x and _tensor(alpha) is not None:
            return alpha
    return None


def _variant(add: Node, x: Node, alpha: Node, beta: Node) -> str:
    parts = ["alpha" if alpha is beta else "alpha,beta"]
    if alpha is not beta and all((canonical(p) or ("",))[0] == "exp" for p in (alpha, beta)):
        parts.append("logscale")
    if (canonical(x) or ("",))[0] == "reshape":
        parts.append("reshaped")
    return "+".join(parts)


def decide_route(option: str, platform: str, dtypes) -> tuple[str, str]:
    """("eager" | "fused", why) for a site running on ``platform`` with tensors of ``dtypes``."""
    if option in ("eager", "fused"):
        return option, f"snake={option!r} requested"
    names = "/".join(sorted({str(d).replace("torch.", "") for d in dtypes}))
    if platform == "hip" and torch.bfloat16 in dtypes:
        return "eager", ("HIP + bfloat16: Inductor's generated bf16 Snake kernel can fail to "
                         "build (hiprtc); runs as the opaque op convlower::snake")
    return "fused", f"{platform} + {names}: Inductor fuses it"


def _check_rewritable(site: Site) -> Optional[str]:
    """Why the custom op cannot stand in for this site exactly, or None."""
    vals = [_tensor(n) for n in (site.x, site.alpha, site.beta, site.add)]
    if any(v is None for v in vals):
        return "no example values"
    if not all(v.dtype.is_floating_point for v in vals):
        return "not floating point"
    if len({v.device for v in vals}) != 1:
        return "tensors on different devices"
    if snake_op.out_dtype(*vals[:3]) != vals[3].dtype:
        return "dtype promotion differs from convlower::snake's"
    return None


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    path = re.sub(r"^L\['[^']*'\]\.?", "", list(stack.values())[-1][0])
    return f"{path}:{node.name}" if path else node.name


def _replace(graph: Graph, site: Site) -> Node:
    value = _fake_result(site)  # may raise: before touching the graph
    with graph.inserting_before(site.add):
        new = graph.call_function(torch.ops.convlower.snake.default,
                                  (site.x, site.alpha, site.beta))
    for key in ("stack_trace", "nn_module_stack"):
        if key in site.add.meta:
            new.meta[key] = site.add.meta[key]
    new.meta["example_value"] = value
    site.add.replace_all_uses_with(new)
    for n in (site.add,) + site.inner:
        graph.erase_node(n)
    return new


def _fake_result(site: Site):
    # the example values' own fake mode (the tracing context may hold another one)
    vals = [_tensor(n) for n in (site.x, site.alpha, site.beta)]
    mode = getattr(vals[0], "fake_mode", None)
    if mode is None:
        return _tensor(site.add)
    with mode:
        return torch.ops.convlower.snake.default(*vals)


def route_snakes(gm: GraphModule, options, graph_name: str) -> list[SnakeRecord]:
    """Find every Snake site in ``gm``, route it, record it; rewrites ``gm`` in place."""
    records, changed = [], False
    for node in list(gm.graph.nodes):
        # (nodes a rewrite erases all come before it, so this loop never meets one)
        if node.op not in ("call_function", "call_method"):
            continue
        site = match(node)
        if site is None:
            continue
        out = _tensor(site.add)
        dtypes = {v.dtype for v in map(_tensor, (site.x, site.alpha, site.beta, site.add)) if v is not None}
        platform = device_platform(options.platform, out.device if out is not None else None)
        route, why = decide_route(options.snake, platform, dtypes)
        name = _module_path(site.add)
        if route == "eager":
            problem = _check_rewritable(site)
            if problem is None:
                try:
                    _replace(gm.graph, site)
                    changed = True
                except Exception as e:  # never break a compile: leave it to Inductor
                    log.warning("convlower: Snake site %s not rewritten: %s", name, e)
                    problem = f"rewrite failed: {type(e).__name__}: {e}"
            if problem is not None:
                route, why = "fused", f"{why}; but {problem}, left to Inductor"
        rec = SnakeRecord(graph_name, name, site.variant,
                          str(out.dtype).replace("torch.", "") if out is not None else "?",
                          route, why)
        record(rec)
        records.append(rec)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return records
