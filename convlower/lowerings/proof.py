"""Deciding a rule's conditions over (possibly symbolic) shapes.

Each condition is a sympy relation.  With concrete sizes it folds to True or False.  With
symbolic sizes the shape environment is asked to prove or refute it statically (no guard).
A fact it can neither prove nor refute is decided by the current size hint: when the hint says
False the rule is simply not used (the original convolution is correct for every size, so no
guard is needed); when the hint says True and guards are allowed, the fact is installed as a
guard (a later call that violates it recompiles) and recorded.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import sympy

from .. import torch_internals as ti
from .rule import ConvCall, Rule


@dataclasses.dataclass
class Verdict:
    rule: str
    eligible: bool
    proven: list[str] = dataclasses.field(default_factory=list)
    guards: list[str] = dataclasses.field(default_factory=list)
    rejected: Optional[str] = None
    # Facts that hold for the current sizes but are not provable: installed as guards only if
    # this rule is chosen (see install_guards).
    pending: list = dataclasses.field(default_factory=list, repr=False)

    def install_guards(self, shape_env) -> None:
        for cond in self.pending:
            _install_guard(cond.relation, shape_env)
            self.guards.append(f"{cond.text}  [{sympy.sympify(cond.relation)}]")
        self.pending = []

    def to_dict(self) -> dict:
        return {"rule": self.rule, "eligible": self.eligible, "proven": list(self.proven),
                "guards": list(self.guards), "rejected": self.rejected}


def _static_value(relation, shape_env) -> Optional[bool]:
    rel = sympy.sympify(relation)
    if rel is sympy.true or rel is True:
        return True
    if rel is sympy.false or rel is False:
        return False
    if shape_env is None:
        return None
    return ti.evaluate_static(rel, shape_env)


def hint_holds(relation, shape_env) -> bool:
    rel = sympy.sympify(relation)
    hints = ti.size_hints(shape_env)
    subs = {s: hints[s] for s in rel.free_symbols if s in hints}
    return bool(rel.xreplace(subs))


def _install_guard(relation, shape_env) -> None:
    # evaluate_expr installs a guard on the expression, like any size check during tracing.
    shape_env.evaluate_expr(sympy.sympify(relation))


def check(rule: Rule, call: ConvCall, shape_env=None, allow_guards: bool = True,
          site=None) -> Verdict:
    """Decide whether ``rule`` may lower ``call`` (at ``site``, when the pass knows it: then
    the rule's site conditions count too).  Installs no guard: a chosen verdict's
    unprovable facts are installed by :meth:`Verdict.install_guards`."""
    verdict = Verdict(rule.name, eligible=False)
    conditions = rule.conditions(call)
    if site is not None:
        conditions = conditions + rule.site_conditions(site)
    for cond in conditions:
        value = _static_value(cond.relation, shape_env)
        if value is True:
            verdict.proven.append(cond.text)
        elif value is False:
            verdict.rejected = f"{cond.text} is false"
            return verdict
        elif not hint_holds(cond.relation, shape_env):
            verdict.rejected = f"{cond.text} is false for the current sizes and not provable"
            return verdict
        elif not allow_guards:
            verdict.rejected = f"{cond.text} is not provable and guards are not allowed here"
            return verdict
        else:
            verdict.pending.append(cond)
    verdict.eligible = True
    return verdict
