"""Under ``dynamic=True`` a lowered conv adds exactly the guards its proof needs and could not
prove: its emission builds every view size from proven quantities (frames.pad_to), so tracing
it over symbolic sizes adds nothing else.  Sweeps over the sizes of the issue: no more
compiles than Inductor, the conv lowered at every size; the recorded guards are goldens.

One torch artefact remains on CPU builds with NNPACK: a conv2d with a symbolic batch guards
``batch < 16`` (torch's conv backend choice, the same guard a plain Conv2d with a dynamic batch
gets under Inductor); the Conv3d rules that batch frames into a conv2d inherit it.  Older torch
(< 2.13, no size-oblivious answer to some of its own conv size checks) adds more such
``emission:`` guards: there the goldens hold up to those (see :func:`assert_guards`)."""
import re

import pytest
import torch
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters

import convlower
from convlower.torch_versions import parse_version

# The goldens were recorded on torch 2.13 and hold exactly on 2.13 - 2.15.
EXACT = parse_version(torch.__version__) >= (2, 13)

WIDTHS = [16, 4, 12, 20, 8, 28]     # multiples of the patch kernel, == kernel included
FRAMES = [4, 2, 6, 10, 8, 14]       # frame counts (multiples of the temporal kernel)


def sweep(backend, module, inputs, train, rule=None):
    """Compile ``module`` once with dynamic=True and call it on every input: (number of
    compiles, convlower's report).  Each result is checked against eager."""
    torch._dynamo.reset()
    convlower.reset_report()
    before = counters["frames"]["ok"]
    kw = {"options": {"select": "always", "rules": [rule]}} if backend == "convlower" else {}
    compiled = torch.compile(module, backend=backend, dynamic=True, **kw)
    for x in inputs:
        x = x.requires_grad_(train)
        with torch.set_grad_enabled(train):
            y = compiled(x)
            torch.testing.assert_close(y, module(x), rtol=1e-4, atol=1e-4)
            if train:
                y.sum().backward()
    return counters["frames"]["ok"] - before, convlower.report()


def guard_lines(rep) -> str:
    """One line per lowered conv: graph (numbered from 0 in this sweep), phase, rule, guards."""
    names: dict = {}
    out = []
    for c in rep.convolutions:
        out.append(f"graph{names.setdefault(c.graph, len(names))} {c.phase} {c.rule}: "
                   f"{len(c.guards)} guards")
        out += [f"    {g}" for g in c.guards]
    return "\n".join(out)


def assert_guards(actual: str, expect: str) -> None:
    """``actual`` is the golden; on torch < 2.13 up to ``emission:`` guards (torch's own size
    checks, the same a plain conv gets there): same compiles, rules and proof guards."""
    if EXACT:
        return assert_expected_inline(actual, expect, skip=1)

    def skeleton(text):
        return [re.sub(r": \d+ guards$", "", line) for line in text.splitlines()
                if not line.strip().startswith("emission:")]

    assert skeleton(actual) == skeleton(expect), actual


def _check(rep, n_compiles, train):
    """The conv was lowered in every compile (so at every size), forward and backward."""
    assert rep.convolutions and all(c.rule for c in rep.convolutions), str(rep)
    assert len(rep.convolutions) == n_compiles * (2 if train else 1), str(rep)
    assert {c.phase for c in rep.convolutions} == ({"forward", "backward"} if train
                                                   else {"forward"})


def patch_sweep(train):
    """A patchify conv over widths, against Inductor's inference sweep: for training a stricter
    bound than Inductor's training sweep, which compiles more often (6 against 2) and costs
    half a minute more."""
    torch.manual_seed(0)
    m, xs = torch.nn.Conv2d(3, 16, 4, stride=4), [torch.randn(2, 3, 8, w) for w in WIDTHS]
    n_inductor, _ = sweep("inductor", m, xs, train=False)
    n, rep = sweep("convlower", m, xs, train=train, rule="patchify_mm")
    assert n <= n_inductor, (n, n_inductor)
    _check(rep, n, train=train)
    return guard_lines(rep)


def test_patchify_sweep_training():
    assert_guards(patch_sweep(train=True), """\
graph0 forward patchify_mm: 0 guards
graph0 backward patchify_mm: 0 guards
graph1 forward patchify_mm: 0 guards
graph1 backward patchify_mm: 0 guards""")


def test_patchify_sweep_inference():
    assert_guards(patch_sweep(train=False), """\
graph0 forward patchify_mm: 0 guards
graph1 forward patchify_mm: 0 guards""")


CONV3D = {
    "time_fold_conv2d": lambda: torch.nn.Conv3d(3, 8, (2, 3, 3), stride=(2, 1, 1),
                                                padding=(0, 1, 1)),
    "time_unfold_conv2d": lambda: torch.nn.Conv3d(3, 8, 3, padding=1),
    "time_sum_conv2d": lambda: torch.nn.Conv3d(3, 8, 3, padding=1),
}


def conv3d_sweep(rule):
    """Training sweep of convlower against Inductor's inference sweep: a stricter bound than
    Inductor's training sweep, which compiles at least as often (its conv backward lowering
    specializes sizes) and costs minutes more."""
    torch.manual_seed(0)
    m = CONV3D[rule]()
    xs = [torch.randn(1, 3, t, 6, 6) for t in FRAMES]
    n_inductor, _ = sweep("inductor", m, xs, train=False)
    n, rep = sweep("convlower", m, xs, train=True, rule=rule)
    assert n <= n_inductor, (n, n_inductor)
    _check(rep, n, train=True)
    return guard_lines(rep)


@pytest.mark.skipif(not torch.backends.nnpack.is_available(),
                    reason="the golden holds NNPACK's batch guard")
def test_time_fold_sweep():
    assert_guards(conv3d_sweep("time_fold_conv2d"), """\
graph0 forward time_fold_conv2d: 1 guards
    emission: ((s69//2)) < 16
graph0 backward time_fold_conv2d: 0 guards
graph1 forward time_fold_conv2d: 1 guards
    emission: ((s69//2)) < 16
graph1 backward time_fold_conv2d: 0 guards""")


def test_time_unfold_sweep():
    assert_guards(conv3d_sweep("time_unfold_conv2d"), """\
graph0 forward time_unfold_conv2d: 0 guards
graph0 backward time_unfold_conv2d: 0 guards""")


def test_time_sum_sweep():
    assert_guards(conv3d_sweep("time_sum_conv2d"), """\
graph0 forward time_sum_conv2d: 0 guards
graph0 backward time_sum_conv2d: 0 guards""")


def test_proof_guards_are_recorded():
    """A fact the proof needs and cannot prove is the one guard: patch_linear needs the
    (symbolic) input to be exactly the kernel's size."""
    torch.manual_seed(0)
    m = torch.nn.Conv3d(3, 8, (2, 14, 14), stride=(2, 14, 14))
    n, rep = sweep("convlower", m, [torch.randn(3, 3, 2, 14, 14)], train=True,
                   rule="patch_linear")
    assert n == 1
    _check(rep, n, train=True)
    assert_expected_inline(guard_lines(rep), """\
graph0 forward patch_linear: 3 guards
    size[0] + 2*padding[0] == kernel[0]  [Eq(s69, 2)]
    size[1] + 2*padding[1] == kernel[1]  [Eq(s87, 14)]
    size[2] + 2*padding[2] == kernel[2]  [Eq(s87, 14)]
graph0 backward patch_linear: 0 guards""")
