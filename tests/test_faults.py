"""Fault containment: a broken rule never breaks the user's compile.

Faults are injected by monkeypatching a rule object in ``convlower.lowerings.RULES`` (its
``conditions`` or ``emit``): raising, returning a wrong shape or dtype, raising only in the
backward.  Each time the convolution must fall back to the original (result equal eager), the
report must say why, and the warning must be logged once (not once per node or per recompile).
``FAULTS`` lives in convlower/tools/reliability.py, shared with bench/reliability_figures.py.
"""
from __future__ import annotations

import logging

import pytest

from convlower.backend import conv_pass as graph_pass
# The faults, the model and the run are the package's (bench/reliability_figures.py uses them too).
from convlower.tools.reliability import FAULTS, inject, run_with_fault


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
