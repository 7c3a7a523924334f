"""The post-grad graph pass that applies the rules, as an Inductor ``CustomGraphPass``.

Inductor runs ``post_grad_custom_pre_pass`` on every aten graph it compiles: the inference
graph, and the forward and backward graphs of a training step.  For each
``aten.convolution`` (forward) and ``aten.convolution_backward`` (backward) node this pass
decides a rule (proof, then selection), traces the rule's decomposition on the node's fake
values, checks the traced result has the node's exact shape and dtype, and splices it in.
Anything that goes wrong leaves the original node untouched and is recorded: a rule can
never break a compile.

``uuid()`` names convlower's version, its source and the options, so Inductor's FX graph
cache and the AOTAutograd cache never hand out an artifact compiled under other settings,
and do reuse one compiled under the same settings.
"""
from __future__ import annotations

import contextlib
import hashlib
import operator
import json
import logging
import os
import time
from typing import Any, Optional

import sympy
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import __version__
from ..decompositions import convolution as conv_decomp
from ..lowerings import RULES
from ..lowerings.proof import hint_holds, check
from ..lowerings.rule import ConvCall, sym
from . import report as _report
from . import stats as _stats
from .options import Options
from .selection import choose

log = logging.getLogger("convlower")
aten = torch.ops.aten

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_files() -> tuple[str, ...]:
    out = []
    for root, _, files in os.walk(_PKG_DIR):
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return tuple(sorted(out))


_warned: set[str] = set()


def _warn_once(msg: str, key: Optional[str] = None) -> None:
    # ``key`` names the failure without node/graph names: a broken rule warns once, not once
    # per convolution, phase and recompile.
    key = msg if key is None else key
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


class RuleFailed(RuntimeError):
    pass


def _val(a):
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


def _shape_env(vals):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(vals)
    return mode.shape_env if mode is not None else None


def _same_sizes(a, b, shape_env, guard: bool = False) -> bool:
    """Equal sizes, proven statically.  With ``guard``, an equality sympy cannot simplify
    (e.g. ``(x**2)//(2*x)`` vs ``x//2``) that holds for the current sizes is installed as a
    guard instead (recorded as an emission guard by the caller)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            eq = sympy.Eq(sym(x), sym(y))
            if shape_env is None:
                return False
            if shape_env._maybe_evaluate_static(eq) is sympy.true:
                continue
            if not (guard and hint_holds(eq, shape_env) and shape_env.evaluate_expr(eq)):
                return False
        elif int(x) != int(y):
            return False
    return True


def _trace(fn, vals):
    """Trace ``fn`` on fake values into an aten graph (Inductor's own replacement tracer)."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(vals)
    with mode if mode is not None else contextlib.nullcontext():
        return fwd_only(fn, vals)


def _splice(graph: torch.fx.Graph, before: torch.fx.Node, gm: torch.fx.GraphModule,
            inputs: list[torch.fx.Node]):
    """Copy ``gm``'s nodes into ``graph`` before ``before``; return its output node(s)."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise RuleFailed(f"traced graph takes {len(placeholders)} inputs, expected {len(inputs)}")
    env.update(zip(placeholders, inputs))
    result = None
    with graph.inserting_before(before):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                new = graph.call_function(n.target, torch.fx.map_arg(n.args, env.__getitem__),
                                          torch.fx.map_arg(n.kwargs, env.__getitem__))
                new.meta.update(n.meta)
                new.meta["convlower"] = True
                env[n] = new
            elif n.op == "output":
                result = torch.fx.map_arg(n.args[0], env.__getitem__)
            elif n.op != "placeholder":
                raise RuleFailed(f"traced graph has a {n.op} node")
    return result


def _same_layout(a, b, shape_env, b_format=None) -> bool:
    """Same strides, or (when symbolic strides cannot be compared) both dense in the same
    memory format, which fixes the strides given equal sizes.  Inside a trace, pass ``b``'s
    format computed outside it (``b``'s SymInt strides are unknown to the tracer)."""
    if _same_sizes(a.stride(), b.stride(), shape_env):
        return True
    from torch._prims_common import suggest_memory_format

    fmt = suggest_memory_format(b) if b_format is None else b_format
    return suggest_memory_format(a) == fmt and a.is_contiguous(memory_format=fmt)


def _with_layout_of(fn, old):
    """Wrap ``fn`` so each output has the strides of the node it replaces.  Graph outputs
    (user-visible results, saved activations, gradients) must keep the layout the rest of
    the compiled program was built for; other values may take whatever layout is cheapest."""
    from torch._prims_common import suggest_memory_format

    olds = old if isinstance(old, (tuple, list)) else (old,)
    # Decided before tracing: ``old``'s symbolic strides are not inputs of the traced
    # function, so SymInt arithmetic on them inside the tracer fails ("not tracked").
    formats = [suggest_memory_format(v) if v is not None else None for v in olds]

    def wrapped(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        fixed = []
        for o, v, fmt in zip(outs, olds, formats):
            if o is not None and v is not None:
                se = _shape_env([o, v])
                if not _same_layout(o, v, se, fmt):
                    o = o.clone(memory_format=fmt)
            fixed.append(o)
        return tuple(fixed) if isinstance(out, tuple) else fixed[0]

    return wrapped


def _fold_pad(node: torch.fx.Node, vals) -> Optional[tuple]:
    """A zero ``constant_pad_nd`` feeding a convolution (Wan's causal convs pad this way): its
    symmetric part per spatial dim joins the conv's own padding, so a lowered conv pads inside
    its conv2d instead of reading a materialised padded copy.  Returns (the pad's input node,
    leftover pads or None, the call with the folded padding) or None."""
    src = node.args[0]
    if not (isinstance(src, torch.fx.Node) and src.target is aten.constant_pad_nd.default):
        return None
    pads = list(src.args[1])
    value = src.args[2] if len(src.args) > 2 else src.kwargs.get("value", 0)
    nd = vals[1].dim() - 2
    if value != 0 or vals[6] or len(pads) > 2 * nd or \
            not all(isinstance(p, int) and p >= 0 for p in pads):
        return None
    pads += [0] * (2 * nd - len(pads))
    padding = list(ConvCall.from_args(vals).padding)
    rest = list(pads)
    for d in range(nd):  # F.pad order: last dim first, (before, after) each
        i = 2 * (nd - 1 - d)
        both = min(pads[i], pads[i + 1])
        padding[d] += both
        rest[i] -= both
        rest[i + 1] -= both
    if rest == pads:
        return None
    x = _val(src.args[0])
    if any(rest):
        from torch._guards import detect_fake_mode

        with detect_fake_mode([x]) or contextlib.nullcontext():
            x = aten.constant_pad_nd(x, rest)
    call = ConvCall.from_args([x, vals[1], vals[2], vals[3], padding, *vals[5:9]])
    return src.args[0], (rest if any(rest) else None), call


class ConvLowerPass(CustomGraphPass):
    def __init__(self, options: Options, graph_name: str = "graph"):
        self.options = options
        self.graph_name = graph_name

    def uuid(self) -> Any:
        key = json.dumps({"version": __version__, "options": self.options.key()}, sort_keys=True)
        src = get_hash_for_files(_source_files())
        return hashlib.sha256(key.encode() + src).hexdigest()

    # -- the pass ---------------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        try:
            self._run(graph)
        finally:  # convlower's own share of the compile time (compile statistics)
            _stats.note_pass(self.graph_name, time.perf_counter() - start)

    def _run(self, graph: torch.fx.Graph) -> None:
        rules = [RULES[n] for n in self.options.rules]
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.convolution.default:
                self._lower(graph, node, rules, backward=False)
            elif node.target is aten.convolution_backward.default:
                self._lower(graph, node, rules, backward=True)

    def _decide(self, call: ConvCall, rules, shape_env, backward: bool, entry: dict):
        verdicts = []
        for rule in rules:
            try:
                verdicts.append(check(rule, call, shape_env, allow_guards=not backward))
            except Exception as e:  # a broken condition must not break the compile
                from ..lowerings.proof import Verdict

                verdicts.append(Verdict(rule.name, False, rejected=f"condition check failed: {e!r}"))
                _warn_once(f"convlower: rule {rule.name}: condition check failed: {e!r}; the rule "
                           f"is skipped (node {entry['node']} in {self.graph_name})",
                           key=f"{rule.name}: condition check failed: {e!r}")
        entry["verdicts"] = [v.to_dict() for v in verdicts]
        eligible = [RULES[v.rule] for v in verdicts if v.eligible]
        rule, why, timings = choose(call, eligible, self.options.select, phase=entry["phase"],
                                    output_mask=entry.get("output_mask"),
                                    compute_dtype=self.options.compute_dtype,
                                    platform=self.options.platform,
                                    produced=entry["input_produced"],
                                    consumed=entry["output_consumed"])
        entry["timings"] = timings
        if rule is None:
            rejected = "; ".join(f"{v.rule}: {v.rejected}" for v in verdicts if not v.eligible)
            entry["reason"] = why if eligible or not rejected else rejected
            return None, None
        verdict = next(v for v in verdicts if v.rule == rule.name)
        entry["reason"] = why
        return rule, verdict

    def _lower(self, graph, node, rules, backward: bool) -> None:
        vals = [_val(a) for a in node.args]
        if backward:
            call = ConvCall.from_args(vals[1:10])  # (input, weight, bias_sizes, params...)
            fold = None
        else:
            fold = _fold_pad(node, vals)
            call = fold[2] if fold else ConvCall.from_args(vals)
        shape_env = _shape_env([v for v in vals if isinstance(v, torch.Tensor)])
        entry = {"graph": self.graph_name, "phase": "backward" if backward else "forward",
                 "node": node.name, "call": call.describe(), "rule": None, "reason": "",
                 "verdicts": [], "guards": [], "timings": {}}
        if backward:
            entry["output_mask"] = [bool(m) for m in node.args[10]]
        # Is the activation (forward) / gradient (backward) made by an op of this graph, or a
        # graph input with a fixed layout?  Measuring reproduces that (see measure._compiled).
        first = node.args[0].args[0] if fold else node.args[0]
        entry["input_produced"] = not (isinstance(first, torch.fx.Node) and first.op == "placeholder")
        entry["output_consumed"] = not backward and all(u.op != "output" for u in node.users)
        if fold:
            entry["pad_folded"] = list(node.args[0].args[1])
        n_guards = len(shape_env.guards) if shape_env is not None else 0
        try:
            rule, verdict = self._decide(call, rules, shape_env, backward, entry)
            if rule is not None:
                self._replace(graph, node, rule, call, backward, fold)
                if shape_env is not None:
                    verdict.install_guards(shape_env)
                entry["guards"] = list(verdict.guards)
                # Size checks made while tracing the emission (views of symbolic shapes) are
                # guards too: record every one, so the report hides no recompile cause.
                if shape_env is not None:
                    proof_guards = len(verdict.guards)
                    new = [str(g.expr) for g in shape_env.guards[n_guards:]]
                    entry["guards"] += [f"emission: {g}" for g in new[:len(new) - proof_guards]]
                entry["rule"] = rule.name
                entry["verdicts"] = [verdict.to_dict() if v["rule"] == rule.name else v
                                     for v in entry["verdicts"]]
        except Exception as e:  # fault containment: keep the original convolution
            entry["rule"] = None
            entry["reason"] = f"fell back to the original convolution: {type(e).__name__}: {e}"
            _warn_once(f"convlower: {entry['reason']} (node {node.name} in {self.graph_name})",
                       key=entry["reason"])
        _report.record("convolutions", entry)
        log.debug("convlower %s %s: %s", entry["phase"], node.name, entry["rule"] or entry["reason"])

    def _replace(self, graph, node, rule, call, backward: bool, fold=None) -> None:
        dtype = torch.bfloat16 if self.options.compute_dtype == "bfloat16" else None
        old = node.meta["val"]
        if backward:
            mask = node.args[10]
            inputs = [node.args[0], node.args[1], node.args[2]]
            fn = conv_decomp.convolution_backward(rule, call, mask, dtype)
        else:
            inputs = [a for a in node.args[:3] if a is not None]
            conv = conv_decomp.convolution(rule, call, dtype)
            if fold:  # the rule computes on the pad's input; leftover (asymmetric) pads stay
                inputs[0], rest, inner = fold[0], fold[1], conv
                conv = lambda x, weight, bias=None: inner(
                    aten.constant_pad_nd(x, rest) if rest else x, weight, bias)
            # The tracer passes exactly one value per parameter: without a bias the traced
            # function must take two (a defaulted third parameter made every bias-less conv fail).
            fn = conv if call.has_bias else (lambda x, weight: conv(x, weight))
        vals = [_val(a) for a in inputs]
        # Keep the replaced node's strides everywhere, not only at graph outputs: downstream
        # nodes' meta (and Inductor's view lowering) were computed for those strides.
        feeds_output = True
        gm = _trace(_with_layout_of(fn, old) if feeds_output else fn, vals)
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        olds = old if isinstance(old, (tuple, list)) else (old,)
        shape_env = _shape_env(vals)
        for o, v in zip(outs, olds):
            if (o is None) != (v is None):
                raise RuleFailed("the rule's outputs do not match the convolution's")
            if v is None:
                continue
            ov = o.meta["val"]
            if ov.dtype != v.dtype or not _same_sizes(ov.shape, v.shape, shape_env,
                                                      guard=not backward):
                raise RuleFailed(f"rule {rule.name} produced {tuple(ov.shape)} {ov.dtype}, "
                                 f"expected {tuple(v.shape)} {v.dtype}")
            if feeds_output and not _same_layout(ov, v, shape_env):
                raise RuleFailed(f"rule {rule.name} produced strides {ov.stride()}, "
                                 f"expected {v.stride()}")
        if backward and any(u.target is not operator.getitem for u in node.users):
            raise RuleFailed("convolution_backward result used other than by getitem")
        new = _splice(graph, node, gm, inputs)
        if backward:
            new = new if isinstance(new, (tuple, list)) else (new,)
            for user in list(node.users):
                user.replace_all_uses_with(new[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(new)
        graph.erase_node(node)
