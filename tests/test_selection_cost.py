"""select="auto" / "measure": proof, cache and an eager screen settle clear calls without
compiling; only close calls are compiled and timed, and only under "measure"."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import convlower
from convlower import selection, torch_internals
from convlower.lowerings import RULES
from convlower.lowerings.rule import ConvCall
from convlower.lowerings.site import site_of_call
from convlower.selection import auto, measure, screen


def mochi_site():
    call = ConvCall.from_args([torch.randn(1, 4, 4, 6, 6), torch.randn(8, 4, 2, 2, 2), None,
                               (2, 2, 2), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    return site_of_call(call)


RULES3 = [RULES["patchify_mm"], RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]]


@pytest.fixture
def screened(cache):
    """Inject screen figures; records each screen call.  Restores the eager screen."""
    calls = []

    def install(times):
        def fake(site, candidates, compute_dtype):
            calls.append([r.name for r in candidates])
            return dict(times)
        screen.set_screen(fake)
        return calls

    yield install
    screen.set_screen(None)


@pytest.fixture
def no_compiles(monkeypatch):
    compiled = []
    real = torch_internals.compile_inner
    monkeypatch.setattr(torch_internals, "compile_inner",
                        lambda *a, **k: compiled.append(1) or real(*a, **k))
    return compiled


def test_clear_win_is_taken_without_compiling(screened, no_compiles):
    calls = screened({"aten": 1e-2, "patchify_mm": 2e-2, "time_fold_conv2d": 5e-3,
                      "time_sum_conv2d": 9e-3})
    d = auto.decide(mochi_site(), RULES3, None, measure_close=True)
    assert d.rule is RULES["time_fold_conv2d"] and d.how == "screen" and "0.50x" in d.why
    assert calls == [[r.name for r in RULES3]] and not no_compiles


def test_clear_loss_and_tiny_conv_keep_the_original(screened, no_compiles):
    screened({"aten": 1e-2, "patchify_mm": 2e-2, "time_fold_conv2d": 1.3e-2, "time_sum_conv2d": 3e-2})
    d = auto.decide(mochi_site(), RULES3, None, measure_close=True)
    assert d.rule is None and "clear losses" in d.why
    selection.clear_memory()
    selection.set_cache_dir(selection.cache_dir() + "/tiny")
    screened({"aten": 5e-5, "time_fold_conv2d": 1e-5})  # 50 us: not worth measuring
    d = auto.decide(mochi_site(), RULES3, None, measure_close=True)
    assert d.rule is None and "an eager screen can judge" in d.why and not no_compiles
    assert "close call" not in d.why


def test_a_conv_too_small_to_screen_but_worth_measuring_is_a_close_call(screened, cache):
    """Between measure.MIN_CONV_S (200 us) and screen.MIN_CONV_S (1 ms) eagerly, the screen
    cannot judge it (a bf16 Wan patch conv of 460 us ran 1.9x faster compiled with a rule):
    auto keeps the original and notes it for a warm-up."""
    from convlower.selection import close_calls

    screened({"aten": 5e-4, "time_fold_conv2d": 3e-3})
    d = auto.decide(mochi_site(), RULES3, None, measure_close=False)
    assert d.rule is None and "a close call" in d.why
    assert close_calls.open_calls() == 1


def test_close_call_kept_under_auto_and_measured_under_measure(screened, no_compiles):
    calls = screened({"aten": 1e-2, "patchify_mm": 3e-2, "time_fold_conv2d": 0.95e-2,
                      "time_sum_conv2d": 1.1e-2})
    d = auto.decide(mochi_site(), RULES3, None, measure_close=False)
    assert d.rule is None and "close call" in d.why and not no_compiles
    timed = []
    selection.set_timer(lambda label, fn, budget: timed.append(label) or
                        {"aten": 1.0, "time_fold_conv2d": 0.6}.get(label, 2.0), compiles=True)
    measure.MIN_CONV_S, old = 0.0, measure.MIN_CONV_S
    try:
        d = auto.decide(mochi_site(), RULES3, None, measure_close=True)
    finally:
        measure.MIN_CONV_S = old
    assert d.rule is RULES["time_fold_conv2d"] and d.how == "measurement", d.why
    assert "close call" in d.why and d.timings["screen_aten"] == 1e-2
    # not the clear loser; each in both forms (traced, opaque)
    assert set(timed) == {"aten", "time_fold_conv2d", "time_sum_conv2d",
                          "time_fold_conv2d:opaque", "time_sum_conv2d:opaque"}
    assert no_compiles  # the close call was compiled
    assert len(calls) == 1  # the auto screen was cached; "measure" did not screen again


def test_proof_needs_no_screen_and_cache_needs_no_second_screen(screened, no_compiles):
    calls = screened({"aten": 1e-2, "time_fold_conv2d": 5e-3})
    call = ConvCall.from_args([torch.randn(3, 3, 2, 14, 14), torch.randn(16, 3, 2, 14, 14), None,
                               (2, 14, 14), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    d = auto.decide(site_of_call(call), [RULES["patch_linear"]], None, measure_close=True)
    assert d.rule is RULES["patch_linear"] and d.how == "proof" and not calls
    cands = [RULES["time_fold_conv2d"]]
    first = auto.decide(mochi_site(), cands, None, measure_close=False)
    again = auto.decide(mochi_site(), cands, None, measure_close=False)
    assert first.how == "screen" and again.how == "cache" and again.rule is first.rule
    assert len(calls) == 1 and not no_compiles


def test_auto_reuses_a_measured_decision(screened, no_compiles):
    """A warm-up or an earlier process that measured (exhaustive) leaves the better figure."""
    calls = screened({"aten": 1e-2, "time_fold_conv2d": 5e-3})
    selection.set_timer(lambda label, fn, budget: 1.0)  # measured: no rule wins
    cands = [RULES["time_fold_conv2d"]]
    assert measure.decide(mochi_site(), cands, None).how == "measurement"
    d = auto.decide(mochi_site(), cands, None, measure_close=False)
    assert d.how == "cache" and d.rule is None and not calls


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_broken_screen_figures_keep_the_original(screened, bad):
    screened({"aten": 1e-2, "time_fold_conv2d": bad})
    d = auto.decide(mochi_site(), [RULES["time_fold_conv2d"]], None, measure_close=True)
    assert d.rule is None and "screen failed" in d.why and "timer returned" in d.why


def test_eager_screen_times_each_emission_once(cache):
    times = screen.eager_screen(mochi_site(), [RULES["time_fold_conv2d"],
                                               RULES["time_unfold_conv2d"]], None)
    assert set(times) == {"aten", "time_fold_conv2d", "time_fold_conv2d" + screen.KERNELS}
    assert all(t > 0 for t in times.values())


def test_kernels_only_replays_the_rules_gemm_alone(cache):
    """The lower bound replays only the GEMM / conv kernels the emission called, on the
    arguments they got: patchify_mm's permute copies are left out, its mm stays."""
    from convlower import torch_internals as ti
    from convlower.decompositions import emission
    from convlower.selection.inputs import real_inputs

    site = mochi_site()
    args = real_inputs(site)
    run = lambda: emission.build(site, RULES["patchify_mm"])(*args)
    calls = ti.record_kernels(run, screen._KERNELS, fusable=args[:1], output_fusable=True)
    assert [f.overloadpacket for f, _, _ in calls] in ([torch.ops.aten.mm],
                                                        [torch.ops.aten.addmm])
    every = _all_ops(run)
    assert len(every) > len(calls)  # the copies were there, and are not replayed


def test_a_backward_is_screened_without_the_forward_gemm_its_autograd_runs(cache, monkeypatch):
    """A rule's backward differentiates its forward; compiled, the forward's own GEMM is dead
    code and dropped.  The screen runs the backward as that trace: eagerly the GEMM had doubled
    ViT's patch conv backward (1.8x the original screened, 0.9x compiled)."""
    seen = {}
    monkeypatch.setattr(screen, "_time_interleaved",
                        lambda fns, budget: seen.update(fns) or {k: 1e-3 for k in fns})
    call = ConvCall.from_args([torch.randn(2, 3, 8, 8), torch.randn(6, 3, 4, 4), torch.randn(6),
                               (4, 4), (0, 0), (1, 1), False, (0, 0), 1])
    for phase, mask, gemms in (("backward", [False, True, True], 1), ("forward", None, 1)):
        seen.clear()
        screen.eager_screen(site_of_call(call, phase, mask), [RULES["patchify_mm"]], None)
        ran = _all_ops(seen["patchify_mm"])
        assert sum(op in (torch.ops.aten.mm, torch.ops.aten.addmm) for op in ran) == gemms


class _Spy(TorchDispatchMode):
    """Every op run within, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket, args))
        return func(*args, **(kwargs or {}))


def _all_ops(run) -> list:
    """The op packets ``run`` dispatches, in order."""
    with _Spy() as spy:
        run()
    return [op for op, _ in spy.calls]


def test_a_loss_only_through_copies_is_a_close_call_not_a_clear_loss(screened, no_compiles):
    """Eagerly the rule loses (its unfused copies); its kernels alone beat the original:
    fusion may make it win, so auto keeps the original as a close call for a warm-up to
    measure.  When the kernels alone lose too, it is a clear loss."""
    screened({"aten": 1e-2, "patchify_mm": 2e-2, "patchify_mm" + screen.KERNELS: 0.8e-2})
    d = auto.decide(mochi_site(), [RULES["patchify_mm"]], None, measure_close=False)
    assert d.rule is None and "close call" in d.why and "kernels alone 0.80x" in d.why
    selection.clear_memory()
    selection.set_cache_dir(selection.cache_dir() + "/other")
    screened({"aten": 1e-2, "patchify_mm": 2e-2, "patchify_mm" + screen.KERNELS: 1.3e-2})
    d = auto.decide(mochi_site(), [RULES["patchify_mm"]], None, measure_close=False)
    assert d.rule is None and "clear losses" in d.why


def test_a_model_compiled_with_auto_compiles_no_candidate(cache, no_compiles):
    """Real eager screen, real model: decisions come from proof and screen, zero nested
    compiles, and the report says how each was made and what it cost."""
    model = torch.nn.Sequential(torch.nn.Conv3d(3, 8, (2, 4, 4), (2, 4, 4)),
                                torch.nn.Conv3d(8, 8, (2, 3, 3), (2, 1, 1), (0, 1, 1)))
    x = torch.randn(2, 3, 4, 16, 16, requires_grad=True)
    out = torch.compile(model, backend="convlower")(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    convs = convlower.report().convolutions
    assert len(convs) == 4 and not no_compiles
    assert all(c.how in ("proof", "screen", "cache", "none eligible") for c in convs)
    assert all(c.decision_s >= 0 for c in convs)


def test_exhaustive_measures_with_the_real_timer_inside_a_compile(cache, monkeypatch):
    """The default timer compiles candidates inside the outer compile: their real tensors must
    not enter the outer compile's fake mode (every measurement once failed that way)."""
    monkeypatch.setattr(measure, "MIN_CONV_S", 0.0)
    f = torch.compile(torch.nn.Conv3d(4, 8, 2, stride=2), backend="convlower",
                      options={"select": "exhaustive", "rules": ["time_fold_conv2d"]})
    with torch.no_grad():
        f(torch.randn(1, 4, 4, 8, 8))
    (entry,) = convlower.report().convolutions
    assert entry.how == "measurement" and "measurement failed" not in entry.reason
    assert "compiling the candidates took" in entry.reason and entry.decision_s > 0
    assert entry.timings["aten"] > 0 and entry.timings["time_fold_conv2d"] > 0


def _dense_then_conv(x, w, then=lambda t: t):
    """A rule's shape in miniature: an opaque copy of a graph input, then a 2-D conv."""
    def run():
        dense = torch.ops.convlower.dense(x.transpose(2, 3))
        return torch.ops.aten.convolution(then(dense), w, None, [1, 1], [0, 0], [1, 1],
                                          False, [0, 0], 1)
    return run


def test_kernels_only_keeps_opaque_copies_and_runs_2d_convs_as_inductor_does():
    """convlower::dense on a graph input survives compilation (nothing can fuse it), so the
    compiled figure includes it, and so does an op reading its output (no kernel can absorb
    that one); under Inductor's layout optimisation a 2-D conv runs channels-last, so its
    replay does too."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    run = _dense_then_conv(x, w, then=lambda t: t + 1)
    for layout_opt, fmt in ((False, torch.contiguous_format), (True, torch.channels_last)):
        replay = screen._kernels_only(run, [x, w], layout_opt)
        with _Spy() as spy:
            replay()
        calls = [(op, a) for op, a in spy.calls if op is not torch.ops.aten.clone]  # layout copies
        assert [op for op, _ in calls] == [torch.ops.convlower.dense, torch.ops.aten.add,
                                           torch.ops.aten.convolution]
        conv_args = calls[2][1]
        assert conv_args[0].is_contiguous(memory_format=fmt)
        assert conv_args[1].is_contiguous(memory_format=fmt)


def test_screen_times_its_figures_in_interleaved_rounds(monkeypatch):
    """Every figure of one screen sees the same drift: rounds call each function once, in
    alternating order, after one warm-up call each; past the budget no new round starts."""
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = screen._time_interleaved(fns, budget_s=60.0)
    assert set(times) == {"a", "b", "c"}
    rounds = [c for r in range(screen.SAMPLES) for c in ("abc" if r % 2 == 0 else "cba")]
    assert calls == list("abc") + rounds
    calls.clear()
    screen._time_interleaved(fns, budget_s=0.0)
    assert calls == list("abc"), "the warm-up took the budget: its calls are the figures"


def test_a_screen_of_slow_calls_times_their_first_calls_only():
    """Calls that spend the budget in their warm-up are not run again (bf16 convs on a CPU
    without bf16 instructions: 50-900 ms a call); faster ones get the rounds."""
    import time

    calls = []

    def slow(k):
        def run():
            calls.append(k)
            time.sleep(0.03)
        return run

    times = screen._time_interleaved({k: slow(k) for k in "ab"}, budget_s=0.05)
    assert calls == ["a", "b"] and all(t >= 0.03 for t in times.values())
    calls.clear()
    screen._time_interleaved({k: slow(k) for k in "ab"}, budget_s=1.0)
    assert len(calls) > 2, "under the budget: warm-up, then timed rounds"


def test_a_training_compile_screens_the_backward_for_real(cache):
    """Inside a real training compile the backward's screen traces the rule's backward (its
    dead code removed) and times it: a failure there would only read "screen failed"."""
    conv = torch.nn.Conv2d(3, 8, 4, 4)   # a patch conv: patchify_mm applies, both phases
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    torch._dynamo.reset()
    convlower.reset_report()
    torch.compile(conv, backend="convlower")(x).sum().backward()
    (bwd,) = [r for r in convlower.report().convolutions if r.phase == "backward"]
    assert "patchify_mm" in bwd.timings and "screen failed" not in bwd.reason, bwd.reason


def test_a_backward_that_cannot_be_traced_is_screened_untraced(cache, monkeypatch):
    """A failing trace must not cost the conv its screen: the backward is timed as it is."""
    def broken(fn, values):
        raise RuntimeError("no trace here")

    monkeypatch.setattr(torch_internals, "trace_live", broken)
    call = ConvCall.from_args([torch.randn(2, 3, 8, 8), torch.randn(6, 3, 4, 4), torch.randn(6),
                               (4, 4), (0, 0), (1, 1), False, (0, 0), 1])
    site = site_of_call(call, "backward", [False, True, True])
    times = screen.eager_screen(site, [RULES["patchify_mm"]], None)
    assert times["patchify_mm"] > 0


def test_kernels_only_times_the_layout_copies_nothing_can_fuse():
    """Under Inductor's layout optimisation a 2-D conv's weight (a graph input) is copied to
    channels-last on every call, and so are frames an opaque copy made of a graph input: the
    replay runs those copies.  Frames of a produced input are written in that layout by their
    producer: no copy."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    run = _dense_then_conv(x, w)
    copies = (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy)
    copied = {}
    for layout_opt, fixed in ((False, True), (True, False), (True, True)):
        replay = screen._kernels_only(run, [x, w], layout_opt, input_produced=not fixed)
        with _Spy() as spy:
            replay()
        copied[layout_opt, fixed] = sorted(tuple(args[0].shape) for op, args in spy.calls
                                           if op in copies)
    assert copied[False, True] == []                          # eager's layout: nothing to copy
    assert copied[True, False] == [(4, 3, 3, 3)]              # the weight
    assert copied[True, True] == [(2, 3, 8, 8), (4, 3, 3, 3)]  # and the graph input's frames


def _taps(x, w):
    """A multi-tap rule's shape in miniature: two convs on slices of the input, then the sum of
    their outputs (and a bias added to it)."""
    conv = lambda t, k: torch.ops.aten.convolution(t, w[:, :, k], None, [1, 1], [0, 0], [1, 1],
                                                   False, [0, 0], 1)
    return lambda: conv(x[:, :, 0] * 2, 0) + conv(x[:, :, 1] * 2, 1) + 1


def test_kernels_only_times_one_op_per_chain_nothing_of_the_model_can_absorb():
    """Compiled, the sum of two conv outputs (and the bias added to it) is one kernel of its
    own: nothing of the model can absorb it unless the result's consumer does.  The slices'
    scaling feeds the convs: one kernel each unless an op of the graph makes the input (then
    its producer writes them)."""
    x, w = torch.randn(2, 3, 2, 8, 8), torch.randn(4, 3, 2, 3, 3)
    ran = {}
    for produced, consumed in ((False, False), (True, False), (True, True), (False, True)):
        replay = screen._kernels_only(_taps(x, w), [x, w], False, produced, consumed)
        with _Spy() as spy:
            replay()
        ran[produced, consumed] = [op.__name__.split(".")[0] for op, _ in spy.calls]
    assert ran[False, False] == ["mul", "convolution", "mul", "convolution", "add"]
    assert ran[True, False] == ["convolution", "convolution", "add"]
    assert ran[True, True] == ["convolution", "convolution"]
    assert ran[False, True] == ["mul", "convolution", "mul", "convolution"]


def test_a_bias_gradient_reduction_is_timed_with_the_rules_gemm(cache):
    """patchify_mm's backward sums the output gradient for the bias: compiled, a reduction
    kernel of its own beside the weight gradient's GEMM when that gradient is a graph input
    (the original's conv backward sums inside its kernel).  Made by an op of the graph, the
    sum fuses into that op's kernel."""
    from convlower.decompositions import emission
    from convlower.selection.inputs import real_inputs

    call = ConvCall.from_args([torch.randn(2, 3, 8, 8), torch.randn(6, 3, 4, 4), torch.randn(6),
                               (4, 4), (0, 0), (1, 1), False, (0, 0), 1])
    site = site_of_call(call, "backward", [False, True, True])
    args = real_inputs(site)
    traced = torch_internals.trace_live(emission.build(site, RULES["patchify_mm"]), args)
    ran = {}
    for produced in (False, True):  # the output gradient a graph input, or made by an op
        replay = screen._kernels_only(lambda: traced(*args), args, False, produced, False)
        with _Spy() as spy:
            replay()
        ran[produced] = {op for op, _ in spy.calls}
    assert torch.ops.aten.sum in ran[False] and torch.ops.aten.mm in ran[False]
    assert torch.ops.aten.sum not in ran[True] and torch.ops.aten.mm in ran[True]  # fused


def test_a_chain_is_one_kernel_whatever_its_shape():
    """In-place ops on one buffer are one kernel; an op reading a conv's output cannot fuse
    into the producer of the activation it also reads; a value one GEMM reads is made even
    when another op of a fusable chain reads it too; a chain is timed by its heaviest op."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    conv = lambda t: torch.ops.aten.convolution(t, w, None, [1, 1], [1, 1], [1, 1], False,
                                                [0, 0], 1)
    mm = lambda t: torch.ops.aten.mm(t.reshape(4, -1), t.reshape(4, -1).t())

    def in_place():
        t = w * 2
        t.add_(1)
        t.mul_(3)
        return mm(t)

    def shared():
        t = w * 2
        mm(t)
        return t + 1

    def heaviest():
        y = conv(x)
        return (y.to(torch.bfloat16).float() + y * 2).to(torch.bfloat16)

    packets = {torch.ops.aten.mm, torch.ops.aten.convolution}
    timed = lambda run, fusable, out: [
        f.overloadpacket.__name__ for f, _, _ in
        torch_internals.record_kernels(run, packets, fusable, out) if f.overloadpacket not in packets]
    assert timed(in_place, [], True) == ["mul_"]
    assert timed(lambda: conv(x) * x[:, :1], [x], False) == ["mul"]
    assert timed(lambda: conv(x) * x[:, :1], [x], True) == []
    assert timed(lambda: x[:, :1] * 2, [x], False) == []      # fuses into x's producer
    assert timed(shared, [], True) == ["mul"]
    assert timed(heaviest, [], False) == ["add"]


def test_a_screened_win_must_hold_in_every_round():
    """A candidate's figure is its worst ratio to the original over the rounds (times the
    original's median): one round disturbed in its favour no longer makes a clear win."""
    samples = {"aten": [1.0, 2.0, 1.0], "rule": [0.6, 0.6, 0.95], "aten_inductor_layout": [3, 1, 2]}
    times = screen._every_round(samples)
    assert times["aten"] == 1.0 and times["aten_inductor_layout"] == 2
    assert times["rule"] == pytest.approx(0.95)     # the third round: 0.95x, not the median 0.6
    assert screen._every_round({"aten": [1.0], "rule": [0.5]})["rule"] == 0.5
