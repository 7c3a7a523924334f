"""The screen: a milliseconds-cheap eager estimate that settles clear calls without compiling.

The conv2d / mm kernels a rule calls are the same extern kernels Inductor calls, and the
original convolution is one extern kernel too; what Inductor adds is fusion of a rule's
slices and copies.  So an eager run of the rule's emission costs *at least* what the compiled
one will (its copies unfused), and an eager run of the original costs what Inductor's will,
up to the layout Inductor picks: a 2-D conv's original is timed in both memory formats, the
faster counting; a 3-D conv's in eager's only, which is the one Inductor runs (its layout
optimisation is 2-D only; oneDNN's bf16 Conv3d runs 2-12x faster channels-last, so the other
figure made every rule look like a loss).  Hence:

* rule / original <= ``WIN`` (0.85): a clear win, even before fusion helps the rule;
* rule / original >= ``LOSE`` (1.25), and the rule's GEMM / conv kernels and opaque copies
  alone (``KERNELS``: its other copies as free as fusion can make them) lose too: a clear loss;
* in between: a close call, settled by compiled measurement in ``select="measure"`` and kept
  as the original in ``select="auto"``.

Each figure is the median of a few eager runs, timed in interleaved rounds (the whole screen
of a conv stays within ``BUDGET_S``; slow calls that spend it in their warm-up are timed by
that first run).  The function timing the candidates is injectable (:func:`set_screen`).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import torch

from .. import device as _device
from .. import torch_internals as ti
from ..decompositions import emission
from ..lowerings.channels_last_conv import opaque_ops as channels_last_ops
from ..lowerings.eager_conv import RULE as EAGER_CONV, inductor_format
from ..lowerings.frames import conv2d_in
from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from . import timer as _timer
from .inputs import real_inputs

WIN = 0.85
LOSE = 1.25
BUDGET_S = float(os.environ.get("CONVLOWER_SCREEN_BUDGET_S", "0.5"))  # per site
# Below this (eagerly) the fixed costs of the extra kernels a rule adds are a large share of
# the conv and an eager figure says little about the compiled one: keep the original.
MIN_CONV_S = float(os.environ.get("CONVLOWER_SCREEN_MIN_US", "1000")) * 1e-6
SAMPLES = 3
# A rule's figure with only what its compiled code surely runs timed: its GEMM / conv kernels
# and its opaque ops (convlower::dense / stack on a graph input or output: no producer or
# consumer can fuse them; convlower::channels_last_conv, copies inside).  A clear loss needs that to lose too.
KERNELS = ":kernels"
_aten = torch.ops.aten
_CONVS = {_aten.convolution, _aten._convolution, _aten.convolution_backward,
          _aten.mkldnn_convolution, _aten.cudnn_convolution, _aten.miopen_convolution}
_KERNELS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, *_CONVS}
# The screen's figure of the original in the layout Inductor's compiled code will run it in
# (timed only when that is not eager's layout and ``eager_conv`` is a candidate).
INDUCTOR_LAYOUT = "aten_inductor_layout"

# (site, candidates, compute_dtype) -> {"aten" | rule name: seconds per call}
Screen = Callable[[ConvSite, Sequence[Rule], Optional[str]], dict]


def eager_screen(site: ConvSite, candidates: Sequence[Rule],
                 compute_dtype: Optional[str]) -> dict[str, float]:
    """Eager seconds per call of the original and of each distinct emission; with
    ``eager_conv`` among the candidates, also the original as Inductor will run it
    (``INDUCTOR_LAYOUT``, see :func:`_inductor_original`)."""
    args = real_inputs(site)
    fns = {"aten": _bound(emission.build(site, None), args)}
    lowerings = [r for r in candidates if r.lowers]
    other = _other_layout(args) if lowerings and not site.backward else None
    if other is not None:
        fns["aten_other_layout"] = _bound(emission.build(site, None), other)
    seen = set()
    for rule in lowerings:
        if rule.emission not in seen:
            seen.add(rule.emission)
            # Its 2-D convs in the layout Inductor will run them in: the figure is also what
            # the rule's opaque form runs (decompositions/opaque_form.py).
            fns[rule.name] = _bound(emission.build(site, rule, compute_dtype), args,
                                    torch.channels_last if site.layout_opt else None,
                                    live=site.backward)
            fns[rule.name + KERNELS] = _kernels_only(
                fns[rule.name], args, site.layout_opt, site.input_produced,
                site.output_consumed and not site.backward)
    fmt = inductor_format(site)
    if EAGER_CONV in candidates and fmt is not None:
        fns[EAGER_CONV.name] = _bound(emission.build(site, EAGER_CONV), args)
        fns[INDUCTOR_LAYOUT] = _inductor_original(site, args, fmt)
    times = _time_interleaved(fns, BUDGET_S)
    if "aten_other_layout" in times:
        times["aten"] = min(times["aten"], times.pop("aten_other_layout"))
    return times


def _bound(fn: Callable, args: list, conv2d_format=None, live=False) -> Callable[[], object]:
    if live:  # a rule's backward as compiled: without the forward GEMM its autograd runs
        try:
            with conv2d_in(conv2d_format):
                fn = ti.trace_live(fn, args)
        except Exception:  # noqa: BLE001 - timed untraced: an upper bound, still a figure
            pass

    def run():
        with conv2d_in(conv2d_format):
            out = fn(*args)
        _device.sync(args[0].device)
        return out
    return run


def predicted(times: dict, name: str) -> float:
    """The screen's estimate of rule ``name`` compiled: its kernels alone where timed (Inductor
    fuses the copies into producers; on this CPU that figure tracked the compiled one within
    10% for 1x1 convs whose eager run was 3-4x the original), else its eager figure."""
    return times.get(name + KERNELS, times[name])


def _kernels_only(run: Callable[[], object], args: list, layout_opt: bool = False,
                  input_produced: bool = True, output_consumed: bool = True) -> Callable[[], object]:
    """The kernels of one eager run of ``run`` that its compiled code surely runs, replayed on
    the inputs they got: what the rule costs once Inductor has fused its other ops away.  Those
    are its GEMM / conv kernels, its opaque copies, and one op per chain of other ops that
    nothing of the model can absorb (``torch_dispatch.record_kernels``: the sum of a
    multi-tap rule's conv outputs, a bias gradient's reduction; an op reading the activation
    fuses into its producer when ``input_produced``: an op of the graph makes it; an op making
    the result fuses into its consumer when ``output_consumed``).  With Inductor's layout
    optimisation (``layout_opt``, on CPU with mkldnn) its 2-D convs run channels-last, as
    the compiled code runs them (in bf16 that is the faster layout), and the copies into that
    layout that nothing can fuse are timed too: a weight's (a graph input), a saved
    activation's, and the activation's when it is a graph input (its frames, copied by an
    opaque op, are copied once more)."""
    input_fixed = not input_produced
    calls = ti.record_kernels(run, _KERNELS | _opaque_ops(),
                             fusable=args[:1] if input_produced else [],
                             output_fusable=output_consumed)
    steps = []
    for f, got, kw in calls:
        if layout_opt and f.overloadpacket in _CONVS:
            copies = [a for i, a in enumerate(got) if _fixed(f, i, input_fixed)
                      and _needs_channels_last(a)]
            steps.append((copies, f, _channels_last(got), kw))
        else:
            steps.append(((), f, got, kw))
    device = args[0].device

    def replay():
        for copies, func, args, kwargs in steps:
            for a in copies:
                a.contiguous(memory_format=torch.channels_last)
            func(*args, **kwargs)
        _device.sync(device)
    return replay


def _fixed(func, index: int, input_fixed: bool) -> bool:
    """Whether argument ``index`` of a conv call is a value no producer can write in the conv's
    layout: the weight, a backward's saved input, and the activation / gradient when fixed."""
    if func.overloadpacket is _aten.convolution_backward:   # (grad_output, input, weight, ...)
        return index in (1, 2) or (index == 0 and input_fixed)
    return index == 1 or (index == 0 and input_fixed)


def _needs_channels_last(a) -> bool:
    return (isinstance(a, torch.Tensor) and a.dim() == 4
            and not a.is_contiguous(memory_format=torch.channels_last))


def _opaque_ops() -> set:
    ops = torch.ops.convlower  # registered by convlower.lowerings.dense
    return {ops.dense, ops.stack} | channels_last_ops()


def _channels_last(args) -> tuple:
    """Every 4-D tensor of a conv call in the channels-last layout (copied once, untimed)."""
    return tuple(a.contiguous(memory_format=torch.channels_last)
                 if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)


def _inductor_original(site: ConvSite, args: list, fmt) -> Callable[[], object]:
    """The original as Inductor's compiled code runs it in ``fmt`` (its layout optimisation):
    the weight (and, backward, the saved activation) copied to ``fmt``, the activation (grad)
    too unless an op of the graph makes it (then it is written in ``fmt`` for free), and the
    outputs that leave the graph copied back to eager's layout."""
    original = emission.build(site, None)
    made = args[0].contiguous(memory_format=fmt) if site.input_produced else None
    back = site.backward or not site.output_consumed

    def run():
        first = made if made is not None else args[0].contiguous(memory_format=fmt)
        rest = [t.contiguous(memory_format=fmt) if t.dim() == first.dim() else t
                for t in args[1:]]
        out = original(first, *rest)
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o.contiguous() if back and o is not None and o.dim() == first.dim() else o
                for o in outs]
        _device.sync(first.device)
        return outs

    return run


def _other_layout(args: list) -> Optional[list]:
    """A 2-D conv's activation in the other dense memory format (Inductor may pick either);
    None for other convs, which Inductor runs in eager's layout."""
    x = args[0]
    if x.dim() != 4:
        return None
    fmt = torch.channels_last
    flipped = x.contiguous() if x.is_contiguous(memory_format=fmt) else x.contiguous(memory_format=fmt)
    return [flipped] + list(args[1:])


def _time_interleaved(fns: dict, budget_s: float) -> dict:
    """Seconds per call of each function (:func:`_every_round`), timed in rounds (each round
    calls every function once, in alternating order) so that a drift of the machine or the
    allocator (oneDNN's bf16 Conv3d took 2.3 or 5.3 ms by what the process had freed before)
    reaches every figure alike.  Up to ``SAMPLES`` rounds, fewer past ``budget_s`` (at least one),
    none when the warm-up calls alone took the budget: then each first call is the figure
    (bf16 convs on a CPU without bf16 instructions run 50-900 ms a call, and their one-time
    costs, allocation and library plans, are small beside that; the rounds had cost Mochi's
    bf16 downsample 5.9 s of screening in a 2 s compile)."""
    first = {}
    for label, fn in fns.items():
        t0 = time.perf_counter()
        fn()  # warm-up: allocations, library plans
        first[label] = time.perf_counter() - t0
    if sum(first.values()) >= budget_s:
        return first
    samples = {label: [] for label in fns}
    labels = list(fns)
    deadline = time.perf_counter() + budget_s
    for r in range(SAMPLES):
        if r and time.perf_counter() >= deadline:
            break
        for label in (labels if r % 2 == 0 else labels[::-1]):
            t0 = time.perf_counter()
            fns[label]()
            samples[label].append(time.perf_counter() - t0)
    return _every_round(samples)


def _every_round(samples: dict) -> dict:
    """Seconds per call: the original's median, and each candidate's worst ratio to the
    original over the rounds times that median, so a win must hold in every round (as a
    measurement's must).  A round disturbed from outside (another process on this shared
    2-core machine) had made ``channels_last_conv`` screen 0.67x on the Wan DiT patch conv
    twice in a row, a clear win; it runs 1.3x compiled, and 1.5x in a quiet screen."""
    median = lambda v: sorted(v)[len(v) // 2]
    base = samples.get("aten")
    out = {}
    for label, v in samples.items():
        if label.startswith("aten") or not base or len(v) != len(base):
            out[label] = median(v)
        else:
            out[label] = max(t / b for t, b in zip(v, base)) * median(base)
    return out


class _State:
    screen: Screen = eager_screen


def set_screen(screen: Optional[Screen]) -> Screen:
    """Use ``screen`` to estimate candidates (None: the eager screen); return the previous."""
    prev, _State.screen = _State.screen, screen or eager_screen
    return prev


def run(site: ConvSite, candidates: Sequence[Rule], compute_dtype: Optional[str]) -> dict:
    """The screen's figures, each checked as a measurement's are (a broken figure raises)."""
    times = _State.screen(site, candidates, compute_dtype)
    for label, seconds in times.items():
        problem = _timer.plausible(seconds)
        if problem:
            raise ValueError(f"screen of {label}: {problem}")
    return times
