"""Rule selection: measured (stubbed timer, disk cache), heuristic, always, and the report.

No test here depends on real timings: the timer is injected.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import convlower
from convlower import selection
from convlower.backend import options
from convlower.selection import measure
from convlower.lowerings import RULES
from convlower.lowerings.rule import ConvCall
from convlower.lowerings.site import site_of_call
from convlower.selection import cache as decision_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def forms(names) -> list[str]:
    """Each traced rule is measured in both its forms: traced, and opaque (one custom op)."""
    return [label for n in names for label in (n, n + ":opaque")]


def stub(times: dict, default: float = 2.0, calls: list | None = None):
    """A timer that reports ``times[label]`` (``default`` otherwise) without running anything."""

    def timer(label, fn, budget_s):
        if calls is not None:
            calls.append(label)
        return times.get(label, default)

    return timer


def conv_call(shape=(1, 4, 4, 6, 6), kernel=(2, 2, 2), stride=(2, 2, 2), bias=True, dtype=torch.float32):
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(8, shape[1], *kernel, dtype=dtype)
    b = torch.randn(8, dtype=dtype) if bias else None
    return ConvCall.from_args([x, w, b, stride, (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])


# three distinct emissions (time_unfold_conv2d shares time_fold_conv2d's, see below)
CANDIDATES = [RULES["patchify_mm"], RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]]


def measured(call, candidates, phase="forward", output_mask=None, compute_dtype=None, **ctx):
    """(rule, why, timings) of a measured decision for a bare call."""
    d = measure.decide(site_of_call(call, phase, output_mask, **ctx), candidates, compute_dtype)
    return d.rule, d.why, d.timings


def key(call, candidates, phase="forward", output_mask=None, compute_dtype=None, produced=True,
        consumed=True):
    site = site_of_call(call, phase, output_mask, input_produced=produced,
                        output_consumed=consumed)
    return decision_cache.decision_key(site, candidates, compute_dtype, measure.METHOD)


def test_measure_keeps_original_when_every_rule_is_slower(cache):
    calls = []
    selection.set_timer(stub({"aten": 1.0}, default=1.5, calls=calls))
    rule, why, timings = measured(conv_call(), CANDIDATES)
    assert rule is None and "kept the original" in why
    names = forms(r.name for r in CANDIDATES)
    assert sorted(calls) == sorted(["aten", *names] * measure.ROUNDS)
    assert timings == {"aten": 1.0, **{n: 1.5 for n in names}}


def test_measure_picks_fastest_rule_only_beyond_margin(cache):
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": 0.8, "time_sum_conv2d": 0.7}))
    rule, why, _ = measured(conv_call(), CANDIDATES)
    assert rule is RULES["time_sum_conv2d"] and "0.70x" in why
    selection.clear_memory()
    selection.set_cache_dir(cache / "other")
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": 0.97}))  # within noise
    rule, why, _ = measured(conv_call(), CANDIDATES)
    assert rule is None and "5%" in why


def test_measure_timer_runs_real_benchmarks(cache):
    """The default path builds real tensors and runs every candidate (the stub only records)."""
    ran = []

    def timer(label, fn, budget_s):
        out = fn()
        ran.append((label, tuple(out.shape) if isinstance(out, torch.Tensor) else len(out)))
        assert budget_s > 0
        return {"aten": 1.0}.get(label, 2.0)

    selection.set_timer(timer)
    call = ConvCall.from_args(
        [torch.randn(2, 4, 5, 6, 6).to(memory_format=torch.channels_last_3d),
         torch.randn(8, 4, 2, 2, 2), None, (2, 2, 2), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    measured(call, CANDIDATES)
    one_round = [("aten", (2, 8, 2, 3, 3))] + [(n, (2, 8, 2, 3, 3))
                                               for n in forms(r.name for r in CANDIDATES)]
    assert ran == one_round * measure.ROUNDS  # interleaved rounds
    ran.clear()
    measured(call, CANDIDATES, phase="backward", output_mask=[True, True, False])
    assert [r[0] for r in ran] == [n for n, _ in one_round] * measure.ROUNDS  # phase is in the key


def test_measured_candidates_are_inductor_compiled_graphs_of_the_same_value(cache):
    """What is timed is each candidate compiled by Inductor (as it will run in the model), all
    compiled before the first timing; each computes the original's value, fwd and bwd."""
    outs, compiled_at_first_timing = {}, []

    def timer(label, fn, budget_s):
        if not outs:
            compiled_at_first_timing.extend(f.compiled() for f in fns_seen)
        outs[label] = fn()
        return {"aten": 1.0}.get(label, 2.0)

    fns_seen = []
    real_benchmarks = measure.benchmarks

    def spy(*args, **kwargs):
        fns = real_benchmarks(*args, **kwargs)
        fns_seen.extend(fns.values())
        return fns

    selection.set_timer(timer, compiles=True)
    call = ConvCall.from_args([torch.randn(2, 4, 4, 6, 6), torch.randn(8, 4, 2, 2, 2),
                               torch.randn(8), (2, 2, 2), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "benchmarks", spy)
        mp.setattr(measure, "MIN_CONV_S", 0.0)  # measure this tiny conv all the same
        for phase, mask in (("forward", None), ("backward", [True, True, True])):
            outs.clear()
            compiled_at_first_timing.clear()
            fns_seen.clear()
            measured(call, CANDIDATES, phase=phase, output_mask=mask)
            assert compiled_at_first_timing == [True] * (1 + 2 * len(CANDIDATES))
            assert set(outs) == {"aten", *forms(r.name for r in CANDIDATES)}
            for name, out in outs.items():
                torch.testing.assert_close(out, outs["aten"], rtol=1e-4, atol=1e-4, msg=name)


def test_a_tiny_conv_keeps_the_original_without_compiling(cache, monkeypatch):
    """Compiling candidates costs seconds: a conv faster than MIN_CONV_S is not worth it."""
    def timer(label, fn, budget_s):
        raise AssertionError("timed a candidate")

    selection.set_timer(timer, compiles=True)
    monkeypatch.setattr(measure._Run, "compile_all", lambda *a: pytest.fail("compiled"))
    # the threshold is raised so a loaded machine cannot make this tiny conv look slow
    monkeypatch.setattr(measure, "MIN_CONV_S", 1.0)
    rule, why, timings = measured(conv_call(), CANDIDATES)
    assert rule is None and "worth compiling candidates for" in why
    assert 0 < timings["aten_eager"] < measure.MIN_CONV_S
    monkeypatch.setattr(measure, "MIN_CONV_S", 0.0)  # a cached decision is not re-measured
    assert measured(conv_call(), CANDIDATES)[1].endswith("(cached)")


def test_a_rule_must_win_every_round(cache):
    rounds = []

    def timer(label, fn, budget_s):  # the rule (either form) wins clearly, except in the last round
        if label == "aten":
            rounds.append(1)
            return 1.0
        return 0.5 if len(rounds) < measure.ROUNDS else 1.0

    selection.set_timer(timer)
    rule, why, timings = measured(conv_call(), [RULES["time_fold_conv2d"]])
    assert rule is None and "every round" in why and timings["time_fold_conv2d"] == 0.5


def test_a_rule_that_won_every_round_wins_when_the_fastest_did_not(cache):
    """The fastest median lost one round in noise: the next rule, which beat the original by
    the margin in every round, is taken rather than the original."""
    rounds = []

    def timer(label, fn, budget_s):
        if label == "aten":
            rounds.append(1)
            return 1.0
        if label.startswith("time_fold_conv2d"):  # fastest, but not in the last round
            return 0.5 if len(rounds) < measure.ROUNDS else 1.0
        return 0.8

    selection.set_timer(timer)
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]])
    # both its forms tie at 0.8x: the one with no kernels to build
    assert rule is RULES["time_sum_conv2d"] and "time_sum_conv2d:opaque takes 0.80x" in why


def test_compile_budget_bounds_measuring(cache, monkeypatch):
    monkeypatch.setattr(measure, "COMPILE_BUDGET_S", 0.0)
    monkeypatch.setattr(measure, "MIN_CONV_S", 0.0)  # measure this tiny conv all the same
    selection.set_timer(stub({"aten": 1.0}, default=0.1), compiles=True)
    rule, why, timings = measured(conv_call(), CANDIDATES)
    assert rule is None and set(timings) == {"aten"}
    assert "time_fold_conv2d not measured: the compile budget" in why


def test_failed_measurement_keeps_original(cache):
    def timer(label, fn, budget_s):
        raise RuntimeError("out of memory")

    selection.set_timer(timer)
    rule, why, _ = measured(conv_call(), CANDIDATES)
    assert rule is None and "measurement failed" in why


def test_decision_cache_on_disk_reused_by_second_process(cache):
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": 0.5}))
    rule, why, _ = measured(conv_call(), CANDIDATES)
    assert rule is RULES["time_fold_conv2d"]
    path = cache / decision_cache.CACHE_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    data = json.loads(path.read_text())
    (raw_key, decision), = data["decisions"].items()
    key = json.loads(raw_key)
    assert decision["rule"] == "time_fold_conv2d" and decision["timings"]["aten"] == 1.0
    for field in ("device", "torch", "dtype", "inputs", "strides", "stride", "padding", "groups"):
        assert field in key
    assert not [f for f in os.listdir(cache) if f.endswith(".tmp")]  # written atomically

    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_selection import conv_call, CANDIDATES, measured, key
        from convlower import selection
        def timer(label, fn, budget_s):
            raise AssertionError("measured again")
        selection.set_timer(timer)
        torch.manual_seed(1)
        rule, why, timings = measured(conv_call(), CANDIDATES)
        assert rule is not None, (why, key(conv_call(), CANDIDATES))
        print(rule.name, "|", why, "|", timings["aten"])
    """)
    env = dict(os.environ, CONVLOWER_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", script, os.path.join(REPO, "tests")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stderr, raw_key)
    name, why, aten = out.stdout.strip().split(" | ")
    assert name == "time_fold_conv2d" and why.endswith("(cached)") and float(aten) == 1.0


def test_key_separates_dtype_layout_and_shape(cache):
    a = key(conv_call(), CANDIDATES)
    b = key(conv_call(dtype=torch.bfloat16), CANDIDATES)
    c = key(conv_call(shape=(1, 4, 6, 6, 6)), CANDIDATES)
    x = torch.randn(1, 4, 4, 6, 6).to(memory_format=torch.channels_last_3d)
    cl = conv_call()
    d = key(ConvCall(x, *[getattr(cl, f) for f in (
        "weight", "has_bias", "stride", "padding", "dilation", "transposed", "output_padding",
        "groups")]), CANDIDATES)
    e = key(conv_call(), CANDIDATES, "forward", None, "bfloat16")
    assert len({a, b, c, d, e}) == 5


def test_corrupt_cache_is_ignored_with_a_warning(cache):
    (cache / decision_cache.CACHE_FILE).write_text("{not json")
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": 0.5}))
    with pytest.warns(RuntimeWarning, match="ignoring the decision cache"):
        rule, _, _ = measured(conv_call(), CANDIDATES)
    assert rule is RULES["time_fold_conv2d"]
    data = json.loads((cache / decision_cache.CACHE_FILE).read_text())  # replaced by a valid file
    assert len(data["decisions"]) == 1


def test_cache_dir_from_env_and_setter(tmp_path, monkeypatch):
    selection.set_cache_dir(None)
    monkeypatch.setenv("CONVLOWER_CACHE_DIR", str(tmp_path / "env"))
    assert selection.cache_dir() == str(tmp_path / "env")
    selection.set_cache_dir(tmp_path / "set")
    assert selection.cache_dir() == str(tmp_path / "set")
    selection.set_cache_dir(None)
    monkeypatch.delenv("CONVLOWER_CACHE_DIR")
    assert selection.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "convlower")


def test_default_select_is_auto_and_max_autotune_measures_everything():
    assert options.parse({}, env={}).select == "auto"
    assert options.parse({}, env={"CONVLOWER_SELECT": "heuristic"}).select == "heuristic"
    assert options.parse({}, env={}, mode="max-autotune").select == "exhaustive"
    assert options.parse({"select": "auto"}, env={}, mode="max-autotune").select == "auto"


def test_heuristic_table():
    mochi = conv_call(shape=(1, 8, 6, 8, 8))
    dit = ConvCall.from_args([torch.randn(1, 16, 3, 8, 8), torch.randn(32, 16, 1, 2, 2), None,
                              (1, 2, 2), (0, 0, 0), (1, 1, 1), False, (0, 0, 0), 1])
    vae = ConvCall.from_args([torch.randn(1, 8, 5, 8, 8), torch.randn(8, 8, 3, 3, 3), None,
                              (1, 1, 1), (1, 1, 1), (1, 1, 1), False, (0, 0, 0), 1])
    choose = lambda call, names, **kw: selection.choose(
        site_of_call(call), [RULES[n] for n in names], "heuristic", **kw).rule
    assert choose(mochi, ["patchify_mm", "time_fold_conv2d", "time_unfold_conv2d"]) is RULES["time_fold_conv2d"]
    assert choose(dit, ["patchify_mm", "time_fold_conv2d", "time_unfold_conv2d"]) is None
    assert choose(vae, ["time_unfold_conv2d", "time_sum_conv2d"]) is None
    assert choose(vae, ["time_unfold_conv2d", "time_sum_conv2d"], platform="hip") is RULES["time_unfold_conv2d"]
    assert selection.choose(site_of_call(vae), [RULES["time_sum_conv2d"]], "always").rule \
        is RULES["time_sum_conv2d"]


def _compile_once(opts, tol=1e-5):
    conv = torch.nn.Conv3d(3, 4, (2, 3, 3), (2, 1, 1), (0, 1, 1))
    x = torch.randn(1, 3, 4, 6, 6)
    f = torch.compile(conv, backend="convlower", options=opts)
    with torch.no_grad():
        out, codes = run_and_get_code(f, x)
        torch.testing.assert_close(out, conv(x), rtol=tol, atol=tol)
    return codes[0], convlower.report().convolutions


def test_compiled_measure_records_timings_and_keeps_slow_rules_out(cache):
    selection.set_timer(stub({"aten": 1.0}, default=3.0))
    code, (entry,) = _compile_once({"rules": ["time_fold_conv2d", "time_sum_conv2d"],
                                    "select": "exhaustive"})
    assert entry["rule"] is None and "kept the original" in entry["reason"]
    assert entry["timings"] == {"aten": 1.0, **{n: 3.0 for n in forms(["time_fold_conv2d",
                                                                       "time_sum_conv2d"])}}
    assert entry["how"] == "measurement" and entry["decision_s"] > 0
    assert "stride=(2, 1, 1)" in code  # the conv3d is still there

    torch._dynamo.reset()
    convlower.reset_report()
    selection.set_timer(stub({"aten": 1.0, "time_sum_conv2d": 0.5}, default=3.0))
    code, (entry,) = _compile_once({"rules": ["time_fold_conv2d", "time_sum_conv2d"],
                                    "select": "exhaustive", "compute_dtype": "bfloat16"}, tol=5e-2)
    assert entry["rule"] == "time_sum_conv2d" and entry["timings"]["time_sum_conv2d"] == 0.5
    assert "stride=(2, 1, 1)" not in code


def test_measured_original_returns_its_output_in_eagers_layout(cache):
    """A conv output that leaves the graph is given back in eager's strides, as the model's
    compiled graph gives it (compile_fx's user-visible outputs): Inductor computes a CPU 2-D
    conv channels-last, and the copy back is part of what the original costs there."""
    seen = {}

    def timer(label, fn, budget_s):
        out = fn()
        seen[label] = out.stride()
        return {"aten": 1.0}.get(label, 2.0)

    selection.set_timer(timer, compiles=True)
    x, w = torch.randn(1, 4, 16, 16), torch.randn(8, 4, 3, 3)
    call = ConvCall.from_args([x, w, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "MIN_CONV_S", 0.0)  # measure this tiny conv all the same
        measure.decide(site_of_call(call, "forward", input_produced=False, output_consumed=False,
                                    layout_opt=True), [RULES["eager_conv"]], None)
    want = torch.empty(1, 8, 16, 16).stride()
    assert seen == {"aten": want, "eager_conv": want}


def test_pass_tells_measure_whether_input_is_produced_and_output_consumed(cache):
    """The measurement reproduces the conv's context: a graph-input activation keeps its
    layout, a produced one may take Inductor's; a returned output (or a view of it) is
    materialised."""
    seen = []
    real_benchmarks = measure.benchmarks

    def spy(site, candidates, cdt, log):
        seen.append((site.phase, site.input_produced, site.output_consumed))
        return real_benchmarks(site, candidates, cdt, log)

    conv = torch.nn.Conv3d(3, 4, 2, 2)
    x = torch.randn(1, 3, 4, 6, 6)
    selection.set_timer(stub({"aten": 1.0}, default=3.0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "benchmarks", spy)
        for fn, want in ((conv, (False, False)), (lambda v: conv(v.relu()).relu(), (True, True)),
                         # a view of the output leaves the graph: it is materialised too
                         (lambda v: conv(v.relu()).flatten(2).transpose(1, 2), (True, False))):
            torch._dynamo.reset()
            convlower.reset_report()
            seen.clear()
            with torch.no_grad():
                torch.compile(fn, backend="convlower", options={"select": "exhaustive"})(x)
            (entry,) = convlower.report().convolutions
            assert (entry["input_produced"], entry["output_consumed"]) == want
            assert seen == [("forward", *want)]
    keys = {key(conv_call(), CANDIDATES, "forward", None, None, p, c)
            for p in (True, False) for c in (True, False)}
    assert len(keys) == 4


def test_rules_sharing_an_emission_are_timed_once(cache):
    """time_fold_conv2d and time_unfold_conv2d emit the same function: one compile, one timing,
    labelled by the first (priority order)."""
    calls = []
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": 0.5}, calls=calls))
    rule, _, timings = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_unfold_conv2d"]])
    assert rule is RULES["time_fold_conv2d"] and set(timings) == {"aten", *forms(["time_fold_conv2d"])}
    assert sorted(set(calls)) == ["aten", *forms(["time_fold_conv2d"])]


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), float("inf"), "fast"])
def test_broken_timer_values_keep_the_original_with_a_reason(cache, bad):
    """Some GPU timers report elapsed <= 0 (MIOpen 3.6 on gfx1151): never trust such a figure."""
    selection.set_timer(stub({"aten": 1.0, "time_fold_conv2d": bad}))
    rule, why, timings = measured(conv_call(), [RULES["time_fold_conv2d"]])
    assert rule is None and "time_fold_conv2d: timer returned" in why
    assert "time_fold_conv2d" not in timings
    selection.clear_memory()
    selection.set_cache_dir(cache / "aten")
    selection.set_timer(stub({"aten": bad}, default=0.5))  # a broken baseline: nothing wins
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"]])
    assert rule is None and "measurement failed" in why and "timer returned" in why


def _looks(first: dict, second: dict, calls: list):
    """A timer giving ``first[label]`` in a label's first ROUNDS timings and ``second[label]``
    after; forms share their rule's time; 2.0 when unnamed."""
    def timer(label, fn, budget_s):
        calls.append(label)
        look = first if calls.count(label) <= measure.ROUNDS else second
        return look.get(label.removesuffix(":opaque"), 2.0)
    return timer


@pytest.mark.parametrize("second, taken", [(0.92, True), (0.99, False)])
def test_a_marginal_win_is_timed_again_and_taken_only_if_it_holds(cache, second, taken):
    calls: list = []
    selection.set_timer(_looks({"aten": 1.0, "time_fold_conv2d": 0.92},
                               {"aten": 1.0, "time_fold_conv2d": second}, calls))
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]])
    assert (rule is RULES["time_fold_conv2d"]) is taken, why
    assert "timed twice" in why
    assert calls.count("aten") == calls.count("time_fold_conv2d") == 2 * measure.ROUNDS
    assert calls.count("time_sum_conv2d") == measure.ROUNDS   # out of play: not timed again


def test_two_rules_within_a_margin_are_decided_on_both_looks(cache):
    calls: list = []
    first = {"aten": 1.0, "time_fold_conv2d": 0.50, "time_sum_conv2d": 0.51}
    second = {"aten": 1.0, "time_fold_conv2d": 0.60, "time_sum_conv2d": 0.45}
    selection.set_timer(_looks(first, second, calls))
    rule, why, timings = measured(conv_call(), [RULES["time_fold_conv2d"],
                                                RULES["time_sum_conv2d"]])
    assert rule is RULES["time_sum_conv2d"], why   # one look alone would take time_fold
    assert timings["time_sum_conv2d"] == pytest.approx(0.48)   # the median of all six rounds
    assert calls.count("aten") == measure.ROUNDS   # whether they win: the first look's rounds


def test_a_tie_far_past_the_line_is_not_lost_to_one_slow_round(cache):
    """Six rounds of "every round" would keep the original over two rules 16-19% faster
    (the ViT patch embedding, bench_settle): the tie's second look orders the rules only."""
    calls: list = []

    def timer(label, fn, budget_s):
        calls.append(label)
        if label == "aten":
            return 1.0
        burst = calls.count(label) == measure.ROUNDS + 1   # every rule, in the second look
        return 1.0 if burst else {"time_fold_conv2d": 0.81, "time_sum_conv2d": 0.84}.get(
            label.removesuffix(":opaque"), 2.0)

    selection.set_timer(timer)
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]])
    assert rule is RULES["time_fold_conv2d"] and "timed twice" in why, why


def test_whether_a_tie_beats_the_original_is_the_first_looks_call(cache):
    """A loaded second look (1.03x) takes the medians of all rounds to 0.96x: the rules are
    still ordered by them, but they beat the original in the rounds timed beside it."""
    calls: list = []
    first = {"aten": 1.0, "time_fold_conv2d": 0.89, "time_sum_conv2d": 0.91}
    second = {"time_fold_conv2d": 1.03, "time_sum_conv2d": 1.03}
    selection.set_timer(_looks(first, second, calls))
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]])
    assert rule is RULES["time_fold_conv2d"] and "timed twice" in why, why


def test_a_clear_call_is_timed_once(cache):
    calls: list = []
    selection.set_timer(_looks({"aten": 1.0, "time_fold_conv2d": 0.5}, {}, calls))
    rule, why, _ = measured(conv_call(), [RULES["time_fold_conv2d"], RULES["time_sum_conv2d"]])
    assert rule is RULES["time_fold_conv2d"] and "timed twice" not in why
    assert calls.count("aten") == measure.ROUNDS


def test_which_calls_are_close():
    close = measure.close_call
    assert close({"a": 0.8, "a:opaque": 0.81}, 1.0) == []            # forms are no rivals
    assert close({"a": 0.8, "b": 0.86}, 1.0) == []                   # a margin apart
    assert close({"a": 0.8, "b": 0.83}, 1.0) == ["a", "b"]           # a tie: the rules only
    assert close({"a": 0.93}, 1.0) == ["aten", "a"]                  # near the line
    assert close({}, 1.0) == []                                      # nothing can win


def test_only_a_rule_that_won_every_round_beside_the_original_is_clear():
    run = measure._Run({})
    run.rounds = {"aten": [1.0, 1.0, 1.0], "won": [0.9, 0.9, 0.9, 1.2, 1.2, 1.2],
                  "lost_one": [0.8, 0.8, 0.97], "slow": [0.96, 0.96, 0.96]}
    assert measure.clear_wins(run) == {"won": pytest.approx(1.05)}   # ordered on all rounds
