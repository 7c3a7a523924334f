"""Fault containment: a broken rule never breaks the user's compile.

Faults are injected by monkeypatching a rule object in ``convlower.lowerings.RULES`` (its
``conditions`` or ``emit``): raising, returning a wrong shape or dtype, raising only in the
backward.  Each time the convolution must fall back to the original (result equal eager), the
report must say why, and the warning must be logged once (not once per node or per recompile).
``FAULTS`` is reused by bench/reliability_figures.py.
"""
from __future__ import annotations

import logging

import pytest
import torch

import convlower
from convlower.backend import conv_pass as graph_pass
from convlower.lowerings import RULES

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
        torch._dynamo.reset()
        model.zero_grad()
        out = torch.compile(model, backend="convlower",
                            options={"rules": [RULE], "select": "always"})(x)
        out.square().mean().backward()
        worst = max(worst, float((out - ref).detach().abs().max()),
                    *(float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), ref_grads)))
    return {"max_error": worst, "records": convlower.report().convolutions}


@pytest.fixture
def fresh_warnings(monkeypatch, caplog):
    monkeypatch.setattr(graph_pass, "_warned", set())
    caplog.set_level(logging.WARNING, logger="convlower")
    return caplog


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_falls_back_reports_and_warns_once(fault, monkeypatch, fresh_warnings):
    inject(monkeypatch, fault)
    # two faulty convs, forward and backward (and a recompile for one fault): one warning
    res = run_with_fault(fault, compiles=2 if fault == "emit raises" else 1)
    assert res["max_error"] < 1e-5, res["max_error"]
    _, _, expected = FAULTS[fault]
    failed = [r for r in res["records"] if expected in r["reason"]]
    assert failed, [r["reason"] for r in res["records"]]
    assert all(r["rule"] is None for r in failed)
    warnings = [r for r in fresh_warnings.records if r.name == "convlower" and expected in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
