"""Property-based equivalence: every rule, on random convolutions, equals eager PyTorch.

The bulk of the examples exercise each rule the way the graph pass does -- eligibility from
``convlower.lowerings.proof.check``, the forward from
``convlower.decompositions.convolution.convolution`` and the backward from
``convolution_backward`` -- on real tensors, so hundreds of cases need no compile.  A smaller
number go through the whole ``torch.compile(backend="convlower")`` path (padding strings,
forced rules, default selection, dynamic shapes).  Rules are read from ``RULES`` at run time,
so a rule added later is covered without editing this file.

The generator and checker (``conv_cases``, ``check_case``) live in
``convlower.tools.conv_fuzz`` and the dynamic-shape run in ``convlower.tools.reliability``,
which ``bench/fuzz.py`` and ``bench/reliability_figures.py`` use for the larger runs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import convlower
from convlower.lowerings import RULES
from convlower.lowerings.proof import check
from convlower.lowerings.rule import ConvCall
from convlower.tools.conv_fuzz import Case, check_case, conv_args, conv_cases, make_tensors
from convlower.tools.reliability import dynamic_suite_in_subprocess
from helpers import compare_with_eager

# CI budget: 260 direct + 40 transposed + 6 compiled random examples (>= 300), plus one
# compiled example per rule and the dynamic suite.
settings.register_profile("ci", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

_F = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


# -- direct path: every rule, forward and backward, on real tensors ------------------------------

@settings(max_examples=260)
@given(conv_cases())
def test_every_eligible_rule_matches_eager(case):
    # "heuristic": no eager screen of random shapes here (selection has its own tests); the
    # screen's eager bf16 conv of one random shape crashed torch's CPU kernel once.
    res = check_case(case, select="heuristic")
    assert not res["mismatches"], (case, res["mismatches"])
    if res["eligible"]:
        assert res["selected"] in res["eligible"] + [None]


@settings(max_examples=40)
@given(conv_cases(transposed=True))
def test_transposed_convolutions_are_left_alone(case):
    x, w, b = make_tensors(case)
    call = ConvCall.from_args([x, w, b, *conv_args(case)])
    for name, rule in RULES.items():
        verdict = check(rule, call)
        assert not verdict.eligible, f"{name} accepted a transposed convolution: {case}"


def test_the_checker_can_fail(monkeypatch):
    """A rule with an off-by-one emission is reported as a mismatch (the property has teeth)."""
    case = Case(nd=2, batch=2, cin=3, cout=4, groups=1, kernel=(2, 2), stride=(2, 2),
                padding=(0, 0), dilation=(1, 1), size=(4, 6), bias=True, layout="contiguous",
                dtype="float32")
    assert "patchify_mm" in check_case(case)["eligible"]
    rule = RULES["patchify_mm"]
    real = type(rule).emit
    monkeypatch.setattr(rule, "emit", lambda c, x, w, b: real(rule, c, x, w, b) * 1.001)
    assert "patchify_mm" in check_case(case)["mismatches"]


# -- full compile path ------------------------------------------------------------------------------

def _compile_and_compare(fn, tensors, options):
    """Compile ``fn`` with convlower; forward and grads of every tensor input equal eager."""
    torch.compiler.reset()  # hypothesis runs many examples in one test
    convlower.reset_report()
    # fp32: compiled kernels sum in another order than eager's; bf16/fp16: the table.
    rel = 1e-4 if tensors[0].dtype == torch.float32 else None
    compare_with_eager(fn, tensors, options=options, rel=rel)
    fallbacks = [c for c in convlower.report().convolutions if "fell back" in c["reason"]]
    assert not fallbacks, fallbacks  # no rule may fail inside the pass on a valid conv
    return convlower.report()


@st.composite
def compiled_cases(draw):
    case = draw(conv_cases(max_size=3))
    # padding strings are resolved by F.conv*d before aten.convolution ("same": stride 1)
    pad = draw(st.sampled_from(["ints", "ints", "same", "valid"]))
    if pad == "same":
        case = dataclasses.replace(case, stride=(1,) * case.nd)
    if pad == "valid":  # no padding: the input must hold the dilated kernel
        assume(all(s >= d * (k - 1) + 1 for s, k, d in zip(case.size, case.kernel, case.dilation)))
    rule = draw(st.sampled_from([None] + list(RULES)))
    return case, pad, rule


@settings(max_examples=6)
@given(compiled_cases())
def test_compiled_matches_eager(args):
    case, pad, rule = args
    case = dataclasses.replace(case, batch=max(case.batch, 1))  # backward needs a non-empty out
    x, w, b = make_tensors(case)
    padding = pad if pad != "ints" else case.padding
    conv = _F[case.nd]

    def fn(x, w, b):
        return conv(x, w, b, case.stride, padding, case.dilation, case.groups)

    options = {"rules": [rule], "select": "always"} if rule else {"rules": "all"}  # default
    _compile_and_compare(fn, [x, w, b], options)


def _eligible_case(rule_name: str) -> Case:
    """A small fp32 case the rule accepts, found by search (works for rules added later)."""
    from hypothesis import find

    return find(conv_cases(max_size=3),
                lambda c: c.batch > 0 and c.dtype == "float32" and c.layout == "contiguous"
                and rule_name in check_case(c)["eligible"],
                settings=settings(max_examples=2000, database=None))


@pytest.mark.parametrize("rule_name", [r for r in RULES if RULES[r].lowers])  # eager_conv:
def test_each_rule_forced_lowers_fwd_and_bwd_under_compile(rule_name):  # test_eager_conv.py
    case = _eligible_case(rule_name)
    x, w, b = make_tensors(case)
    conv = _F[case.nd]

    def fn(x, w, b):
        return conv(x, w, b, case.stride, case.padding, case.dilation, case.groups)

    rep = _compile_and_compare(fn, [x, w, b], {"rules": [rule_name], "select": "always"})
    assert {(c["phase"], c["rule"]) for c in rep.convolutions} == {
        ("forward", rule_name), ("backward", rule_name)}, (case, str(rep))


# -- dynamic shapes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_dynamic_shapes_equal_eager_without_extra_recompiles(how):
    # Rules forced: measured selection may rightly keep every original conv at these tiny
    # sizes, and this test is about the lowered forms under dynamic shapes.
    res = dynamic_suite_in_subprocess(how=how, options={"select": "always"})
    assert "crashed" not in res, res
    assert res["max_error"] < 1e-4, res
    assert not res["fallbacks"], res["fallbacks"]
    assert res["lowered"], res
    # Every recompile must come from Dynamo/Inductor themselves (duck sizing, Inductor's own
    # conv lowering), never from a guard a convlower proof installed.
    assert not [r for r in res["recompile_reasons"] if "convlower" in r], res
