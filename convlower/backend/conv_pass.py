"""The post-grad graph pass that lowers convolutions, as an Inductor ``CustomGraphPass``.

Inductor runs ``post_grad_custom_pre_pass`` on every aten graph it compiles: the inference
graph, and the forward and backward graphs of a training step.  For each
``aten.convolution`` / ``aten.convolution_backward`` node the pass reads a site
(:mod:`.sites`, folding a feeding pad: :mod:`.pad_fold`), proves each rule's conditions,
lets selection pick a rule, builds its emission and splices it (:mod:`.splice`).  Anything
that goes wrong leaves the original node untouched and is recorded: a rule can never break a
compile.

``uuid()`` names convlower's version, its source, the options, the decisions a warm-up
settled and the seed table (``selection.decisions_digest``), so Inductor's FX graph cache and
the AOTAutograd cache never hand out an artifact compiled under other settings, and do reuse
one compiled under the same settings.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Optional

import torch

from .. import torch_internals as ti
from ..decompositions import emission
from ..lowerings import RULES
from ..lowerings.proof import Verdict, check
from ..lowerings.site import ConvSite
from ..observe import persist as _persist
from ..observe import stats as _stats
from ..observe.records import ConvRecord, record
from ..selection import Decision, choose, decisions_digest
from ..version import __version__
from .options import Options
from .sites import input_nodes, site_of
from .splice import replace

log = logging.getLogger("convlower")
aten = torch.ops.aten

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_warned: set[str] = set()


def _source_files() -> tuple[str, ...]:
    out = []
    for root, _, files in os.walk(_PKG_DIR):
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return tuple(sorted(out))


def _warn_once(msg: str, key: Optional[str] = None) -> None:
    # ``key`` names the failure without node/graph names: a broken rule warns once, not once
    # per convolution, phase and recompile.
    key = msg if key is None else key
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def _layout_opt(graph: torch.fx.Graph, convs: list) -> bool:
    """Inductor's layout decision for the graph as it arrives (a backward graph: training);
    False (eager's layout) when torch moved it."""
    try:
        return bool(convs) and ti.inductor_layout_opt(graph, is_inference=not any(
            n.target is aten.convolution_backward.default for n in convs))
    except Exception as e:
        _warn_once(f"convlower: Inductor's layout decision unknown ({e!r}): eager_conv is off")
        return False


class ConvLowerPass(ti.CustomGraphPass):
    def __init__(self, options: Options, graph_name: str = "graph"):
        self.options = options
        self.graph_name = graph_name
        # Settled decisions and seeds change what this pass does: part of the cache key.
        self.decisions = decisions_digest()

    def uuid(self) -> Any:
        key = json.dumps({"version": __version__, "options": self.options.key(),
                          "decisions": self.decisions}, sort_keys=True)
        src = ti.get_hash_for_files(_source_files())
        return hashlib.sha256(key.encode() + src).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        start = time.perf_counter()
        recs: list[ConvRecord] = []
        try:
            recs = self._run(graph)
        finally:  # convlower's own share of the compile time (compile statistics)
            _stats.note_pass(self.graph_name, time.perf_counter() - start)
            _persist.note_pass(self.graph_name, recs)  # saved with the FX graph cache entry
            # This graph measures nothing more: earlier parts' kernels (regions) may now
            # build on another core while it lowers, without slowing a screen's timing.
            ti.start_held_kernel_builds()

    def _run(self, graph: torch.fx.Graph) -> list[ConvRecord]:
        convs = [node for node in list(graph.nodes) if node.op == "call_function"
                 and node.target in (aten.convolution.default, aten.convolution_backward.default)]
        layout_opt = _layout_opt(graph, convs)
        return [self._lower(graph, node, layout_opt) for node in convs]

    def _lower(self, graph: torch.fx.Graph, node: torch.fx.Node,
               layout_opt: bool = False) -> ConvRecord:
        site = site_of(node, self.graph_name, layout_opt)
        rec = ConvRecord(site.graph, site.phase, site.node, site.call.describe(),
                         output_mask=list(site.output_mask) if site.output_mask else None,
                         input_produced=site.input_produced,
                         output_consumed=site.output_consumed,
                         pad_folded=list(site.pad_fold.pads) if site.pad_fold else None)
        shape_env = ti.shape_env_of([v for v in site.inputs if isinstance(v, torch.Tensor)])
        n_guards = ti.guard_count(shape_env)
        try:
            verdicts = self._verdicts(site, shape_env, rec)
            eligible = [RULES[v.rule] for v in verdicts if v.eligible]
            decision = choose(site, eligible, self.options.select, platform=self.options.platform,
                              compute_dtype=self.options.compute_dtype)
            self._note(rec, decision, verdicts)
            if decision.rule is not None:
                self._apply(graph, node, site, decision, verdicts, shape_env, n_guards, rec)
        except Exception as e:  # fault containment: keep the original convolution
            rec.rule = None
            rec.reason = f"fell back to the original convolution: {type(e).__name__}: {e}"
            _warn_once(f"convlower: {rec.reason} (node {node.name} in {self.graph_name})",
                       key=rec.reason)
        record(rec)
        log.debug("convlower %s %s: %s", rec.phase, rec.node, rec.rule or rec.reason)
        return rec

    def _verdicts(self, site: ConvSite, shape_env, rec: ConvRecord) -> list[Verdict]:
        verdicts = []
        for name in self.options.rules:
            try:
                verdicts.append(check(RULES[name], site.call, shape_env,
                                      allow_guards=not site.backward, site=site))
            except Exception as e:  # a broken condition must not break the compile
                why = f"condition check failed: {e!r}"
                verdicts.append(Verdict(name, False, rejected=why))
                _warn_once(f"convlower: rule {name}: {why}; the rule is skipped (node "
                           f"{site.node} in {self.graph_name})", key=f"{name}: {why}")
        rec.verdicts = [v.to_dict() for v in verdicts]
        return verdicts

    @staticmethod
    def _note(rec: ConvRecord, decision: Decision, verdicts: list[Verdict]) -> None:
        rec.timings, rec.how, rec.decision_s = decision.timings, decision.how, decision.seconds
        rec.shared = decision.shared  # how the decision was shared across ranks
        rejected = "; ".join(f"{v.rule}: {v.rejected}" for v in verdicts if not v.eligible)
        eligible = any(v.eligible for v in verdicts)
        rec.reason = decision.why if decision.rule or eligible or not rejected else rejected

    def _apply(self, graph, node, site: ConvSite, decision: Decision, verdicts, shape_env,
               n_guards: int, rec: ConvRecord) -> None:
        rule = decision.rule
        fn = emission.build(site, rule, self.options.compute_dtype, opaque=decision.opaque)
        # The emission's own 0/1 and contiguity checks take their general answer: the guards a
        # lowered conv adds are its proof's unprovable facts, not artefacts of tracing views.
        with ti.size_oblivious():
            replace(graph, node, fn, input_nodes(node), rule.name)
        verdict = next(v for v in verdicts if v.rule == rule.name)
        if shape_env is not None:
            verdict.install_guards(shape_env)
        rec.guards = list(verdict.guards)
        # Size checks made while tracing the emission (views of symbolic shapes) are guards
        # too: record every one, so the report hides no recompile cause.
        new = ti.guards_since(shape_env, n_guards)
        rec.guards += [f"emission: {g}" for g in new[:len(new) - len(verdict.guards)]]
        rec.rule, rec.opaque = rule.name, decision.opaque
        rec.verdicts = [verdict.to_dict() if v["rule"] == rule.name else v for v in rec.verdicts]
