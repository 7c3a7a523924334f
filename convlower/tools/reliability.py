"""Reliability scenarios: faults injected into a rule, and a dynamic-shape training run.

* :data:`FAULTS` / :func:`inject` / :func:`run_with_fault`: a rule object of
  ``convlower.lowerings.RULES`` made to raise, return a wrong shape or dtype, or raise only
  in the backward; the convolution must fall back to the original (result equal eager).
* :func:`dynamic_suite`: one training step per input shape under ``dynamic=True`` or
  ``mark_dynamic``; compiles, recompiles, error against eager and the rules lowered.

``bench/reliability_figures.py`` turns them into the tables of docs/reliability.md.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys

import torch

from .. import torch_internals as ti
from ..lowerings import RULES
from ..observe.report import report, reset_report

RULE = "patchify_mm"  # the faulty rule; the model's convs are all patchify-eligible


def _raise(*a, **k):
    raise ValueError("injected fault")


def _emit_wrong_shape(real):
    return lambda c, x, w, b: real(c, x, w, b)[..., :1]


def _emit_wrong_dtype(real):
    return lambda c, x, w, b: real(c, x, w, b).double()


def _emit_raise_in_backward(real):
    def emit(c, x, w, b):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            raise ValueError("injected backward fault")
        return real(c, x, w, b)
    return emit


def _conditions_garbage(real):
    return lambda c: real(c) + ["not a condition"]


# name -> (attribute patched, factory given the real bound method, text expected in the report)
FAULTS = {
    "conditions raise": ("conditions", lambda real: _raise, "injected fault"),
    "conditions return garbage": ("conditions", _conditions_garbage, "condition check failed"),
    "emit raises": ("emit", lambda real: _raise, "injected fault"),
    "emit returns a wrong shape": ("emit", _emit_wrong_shape, "produced"),
    "emit returns a wrong dtype": ("emit", _emit_wrong_dtype, "produced"),
    "emit raises in the backward only": ("emit", _emit_raise_in_backward, "injected backward fault"),
}


class TwoPatchConvs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 2, 2)
        self.b = torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def inject(monkeypatch, fault: str) -> None:
    """Patch :data:`RULE` with ``fault``; ``monkeypatch`` undoes it (pytest's, or any object
    with ``setattr(obj, name, value)``)."""
    attr, factory, _ = FAULTS[fault]
    rule = RULES[RULE]
    monkeypatch.setattr(rule, attr, factory(getattr(rule, attr)))


def run_with_fault(fault: str, compiles: int = 1) -> dict:
    """Train one step under the fault (``compiles`` fresh compiles); compare with eager."""
    torch.manual_seed(0)
    model = TwoPatchConvs()
    x = torch.randn(2, 3, 8, 8)
    ref = model(x)
    ref.square().mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    worst = 0.0
    for _ in range(compiles):
        torch.compiler.reset()
        model.zero_grad()
        out = torch.compile(model, backend="convlower",
                            options={"rules": [RULE], "select": "always"})(x)
        out.square().mean().backward()
        worst = max(worst, float((out - ref).detach().abs().max()),
                    *(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), ref_grads)))
    return {"max_error": worst, "records": report().convolutions}


# -- dynamic shapes ------------------------------------------------------------------------------
class VideoNet(torch.nn.Module):
    """Patch embedding, a (2,2,2)-stride-2 down-sample, a 3x3x3 conv and a pointwise conv."""

    def __init__(self, c=3, d=8):
        super().__init__()
        self.embed = torch.nn.Conv3d(c, d, (1, 2, 2), (1, 2, 2))
        self.down = torch.nn.Conv3d(d, d, 2, 2)
        self.mix = torch.nn.Conv3d(d, d, 3, padding=1)
        self.proj = torch.nn.Conv3d(d, 4, 1)

    def forward(self, x):
        return self.proj(torch.relu(self.mix(self.down(self.embed(x)))))


# (batch, frames, height, width): every dim changes at least once; all >= 2 (sizes 0 and 1 are
# specialised by Dynamo for every backend).
DYNAMIC_SHAPES = [(2, 4, 8, 8), (3, 6, 8, 12), (2, 8, 12, 8), (4, 4, 16, 16)]


def _graphs(counters: dict) -> int:
    return int(counters.get("stats", {}).get("unique_graphs", 0))


def dynamic_suite(backend: str = "convlower", how: str = "dynamic=True", shapes=DYNAMIC_SHAPES,
                  options=None) -> dict:
    """Train one step per shape; returns compiles, max error vs eager, rules lowered."""
    torch.compiler.reset()
    reset_report()
    before = ti.counters()
    seen = {id(m) for m in ti.compilation_metrics()}
    torch.manual_seed(0)
    model = VideoNet()
    compiled = torch.compile(model, backend=backend, dynamic=True if how == "dynamic=True" else None,
                             options=options if backend == "convlower" else None)
    worst = 0.0
    for n, t, h, w in shapes:
        x = torch.randn(n, 3, t, h, w)
        if how == "mark_dynamic":
            ti.mark_dynamic(x, [0, 2, 3, 4])
        worst = max(worst, _one_step(model, compiled, x))
    compiles = _graphs(ti.counters()) - _graphs(before)
    rep = report()
    lowered = collections.Counter((c["phase"], c["rule"]) for c in rep.lowered())
    reasons = [m.recompile_reason for m in ti.compilation_metrics()
               if id(m) not in seen and getattr(m, "recompile_reason", None)]
    return {"compiles": compiles, "recompiles": compiles - 1, "max_error": worst,
            "lowered": dict(lowered), "shapes": len(shapes),
            "fallbacks": [c["reason"] for c in rep.convolutions if "fell back" in c["reason"]],
            "recompile_reasons": reasons}


def _one_step(model, compiled, x) -> float:
    """The worst error of ``compiled``'s output and relative parameter gradients vs eager."""
    model.zero_grad()
    ref = model(x)
    ref.square().mean().backward()
    ref_g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(x)
    out.square().mean().backward()
    worst = float((out - ref).detach().abs().max())
    for p, g in zip(model.parameters(), ref_g):
        worst = max(worst, float((p.grad - g).abs().max() / (g.abs().max() + 1e-12)))
    return worst


def dynamic_suite_in_subprocess(backend="convlower", how="dynamic=True", options=None) -> dict:
    """Run :func:`dynamic_suite` in a fresh interpreter with Inductor's caches off: a crash in
    a compiled kernel (seen with torch 2.13 Inductor on dynamic shapes) becomes a result."""
    code = ("import json; from convlower import torch_internals as ti; "
            "from convlower.tools.reliability import dynamic_suite\n"
            "with ti.inductor_caches_off():\n"
            "    r = dynamic_suite(%r, %r, options=%r)\n"
            "r['lowered'] = {'/'.join(k): v for k, v in r['lowered'].items()}\n"
            "print('RESULT' + json.dumps(r))") % (backend, how, options)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    return {"crashed": p.returncode, "stderr_tail": p.stderr[-2000:]}
