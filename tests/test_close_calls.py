"""Close calls: ``auto`` notes them, a warm-up settles them (measured, stored, marked), and
the next compile takes the measured choice, also past Inductor's caches (the settled
decisions are part of convlower's cache key).  Screen and timer are injected: which choice
wins is the test's input, what convlower does with it is what is checked."""
import json

import pytest
import torch

import convlower
from convlower import selection
from convlower.backend.conv_pass import ConvLowerPass
from convlower.backend.options import parse
from convlower.selection import close_calls, screen


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 4, 4), torch.nn.ReLU()), \
        torch.randn(2, 4, 32, 32)


@pytest.fixture
def close_patchify(cache):
    """The screen sees patchify_mm at 1.05x the original (a close call); compiled, it takes
    half the original's time (its opaque form, the screen's eager run, 0.9x)."""
    prev = screen.set_screen(lambda site, cands, dt: {"aten": 2e-3,
                                                      **{c.name: 2.1e-3 for c in cands}})
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0}.get(
        label, 0.9 if label.endswith(":opaque") else 0.5))
    yield cache
    screen.set_screen(prev)


def _compile_rules(m, x, **kw):
    convlower.reset_report()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(m, backend="convlower", **kw)(x)
    assert torch.allclose(out, m(x), rtol=1e-5, atol=1e-5)
    return [(c.rule, c.how) for c in convlower.report().convolutions]


def test_auto_notes_a_close_call_and_a_settled_one_is_taken_next_time(close_patchify):
    m, x = _model()
    assert _compile_rules(m, x) == [(None, "screen")]
    assert close_calls.open_calls() == 1
    before = close_calls.settled_digest()
    settled, left, _ = close_calls.settle()
    assert left == 0 and close_calls.open_calls() == 0
    (s,) = settled
    assert s.rule == "patchify_mm" and s.changed and s.saved_s == pytest.approx(0.5)
    assert s.screen_ratio == pytest.approx(1.05) and s.compiled_ratio == pytest.approx(0.5)
    assert s.agrees is False  # the screen leaned to the original
    assert close_calls.settled_digest() != before
    assert _compile_rules(m, x) == [("patchify_mm", "cache")]


def test_a_cached_close_screen_is_noted_again(close_patchify):
    m, x = _model()
    _compile_rules(m, x)
    close_calls.forget()
    assert _compile_rules(m, x) == [(None, "cache")]  # the screen's close call, from the cache
    assert close_calls.open_calls() == 1


def test_settling_within_no_budget_leaves_the_calls_open(close_patchify):
    m, x = _model()
    _compile_rules(m, x)
    assert close_calls.settle(budget_s=0.0)[:2] == ([], 1)
    assert close_calls.open_calls() == 1


def test_only_settled_decisions_change_the_cache_identity(close_patchify):
    m, x = _model()
    uuid = lambda: ConvLowerPass(parse({})).uuid()
    first = uuid()
    other = torch.nn.Conv2d(4, 8, 2, 2)
    assert _compile_rules(other, x, options={"select": "exhaustive"}) == \
        [("patchify_mm", "measurement")]  # measured at compile time, not settled
    assert uuid() == first
    _compile_rules(m, x)
    close_calls.settle()
    assert uuid() != first


def test_warmup_settles_and_returns_a_model_running_the_measured_choice(close_patchify):
    m, x = _model()
    with torch.no_grad():
        compiled, result = convlower.warmup(m, (x,), iters=1)
        assert torch.allclose(compiled(x), m(x), rtol=1e-5, atol=1e-5)
    se = result.settling
    assert [s.rule for s in se.changed] == ["patchify_mm"] and se.left_open == 0
    assert se.recompile_s > 0 and len(se.steps_before_s) == 1
    assert [c.rule for c in convlower.report().convolutions] == [None, "patchify_mm"]
    d = json.loads(json.dumps(result.to_dict()))
    assert d["settling"]["saved_per_call_s"] == pytest.approx(0.5)
    assert "1 changed" in str(result)


def test_a_settled_call_that_keeps_the_original_leaves_the_cache_identity(close_patchify):
    """Nothing changes in the code, so the graphs cached before stay warm."""
    m, x = _model()
    _compile_rules(m, x)
    before = selection.decisions_digest()
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0}.get(label, 1.5))
    (s,), _, _ = close_calls.settle()
    assert s.rule is None and not s.changed
    assert selection.decisions_digest() == before


def test_warmup_without_a_budget_measures_nothing(close_patchify):
    m, x = _model()
    with torch.no_grad():
        _, result = convlower.warmup(m, (x,), iters=0, settle_budget_s=0)
    assert result.settling.settled == [] and result.settling.left_open == 1
    with pytest.raises(ValueError, match="settle_budget_s"):
        convlower.warmup(m, (x,), settle_budget_s=-1)


def test_a_seed_settles_a_close_call_below_the_users_own_measurement(close_patchify, tmp_path):
    from convlower.selection import seeds

    m, x = _model()
    table = tmp_path / "seeds.json"
    _compile_rules(m, x, options={"select": "exhaustive"})  # patchify_mm measured faster
    entries = selection.cache.CACHE.entries()
    assert seeds.export(entries, selection.measure.METHOD, str(table), "test") == 1
    prev = seeds.set_seed_file(str(table))
    try:
        digest = selection.decisions_digest()
        selection.set_cache_dir(tmp_path / "empty")  # the user's own cache: nothing measured
        selection.clear_memory()
        assert _compile_rules(m, x) == [("patchify_mm", "cache")]
        assert convlower.report().convolutions[0].reason.startswith("seed: ")
        assert close_calls.open_calls() == 0
        # the user's own measurement wins over the seed
        selection.set_timer(lambda label, fn, budget: {"aten": 0.5}.get(label, 1.0))
        _compile_rules(m, x, options={"select": "exhaustive"})
        assert _compile_rules(m, x) == [(None, "cache")]
        table.write_text("{broken")
        seeds.set_seed_file(str(table))
        with pytest.warns(RuntimeWarning, match="seed table"):
            assert selection.decisions_digest() != digest
    finally:
        seeds.set_seed_file(prev)


def test_the_shipped_seed_table_reads(recwarn):
    from convlower.selection import seeds

    prev = seeds.set_seed_file(None)
    try:
        table = seeds._table()
        assert table and not recwarn.list
        for key, d in table.items():
            fields = json.loads(key)
            assert "convlower" not in fields and fields["method"] == selection.measure.METHOD
            assert d["rule"] is None or d["rule"] in fields["candidates"]
    finally:
        seeds.set_seed_file(prev)


def test_settling_measures_every_eligible_rule_not_only_the_close_ones(cache):
    """The screen's bounds can be wrong either way (bench_settle: a bf16 Wan patch conv whose
    screen called time_sum_conv2d a clear loss ran it 1.9x faster compiled)."""
    torch.manual_seed(0)
    m = torch.nn.Conv3d(4, 8, (2, 2, 2), (2, 2, 2))
    x = torch.randn(1, 4, 4, 8, 8)
    prev = screen.set_screen(lambda site, cands, dt: {
        "aten": 2e-3, **{c.name: (2.1e-3 if c.name == "patchify_mm" else 9e-3) for c in cands}})
    try:
        selection.set_timer(lambda label, fn, budget: {"aten": 1.0, "patchify_mm": 0.8,
                                                       "time_sum_conv2d": 0.4}.get(label, 0.9))
        assert _compile_rules(m, x) == [(None, "screen")]
        (s,), _, _ = close_calls.settle()
        assert s.rule == "time_sum_conv2d" and s.screen_ratio == pytest.approx(1.05)
        assert _compile_rules(m, x) == [("time_sum_conv2d", "cache")]
    finally:
        screen.set_screen(prev)


class _Conv3dPatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(4, 8, (1, 2, 2), (1, 2, 2))

    def forward(self, x):
        return self.conv(x)


def test_a_clear_win_that_another_rule_may_beat_compiled_is_settled_too(cache):
    """The screen sees channels_last_conv clearly win eagerly (0.8x, an opaque op: its eager
    figure is its compiled one) and time_fold_conv2d lose eagerly but win on its kernels alone
    (0.3x): the clear winner is taken now and the call is noted; settling measures it, takes
    time_fold_conv2d (0.5x compiled), and the next compile uses that."""
    prev = screen.set_screen(lambda site, cands, dt: {
        "aten": 2e-3, **{c.name: 3e-3 for c in cands}, **{c.name + screen.KERNELS: 2e-3
                                                           for c in cands},
        "channels_last_conv": 1.6e-3, "channels_last_conv" + screen.KERNELS: 1.6e-3,
        "time_fold_conv2d" + screen.KERNELS: 0.6e-3})
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0, "channels_last_conv": 0.8,
                                                   "time_fold_conv2d": 0.5}.get(label, 0.9))
    try:
        torch.manual_seed(0)
        m, x = _Conv3dPatch(), torch.randn(1, 4, 3, 8, 8)
        assert _compile_rules(m, x) == [("channels_last_conv", "screen")]
        assert "time_fold_conv2d may beat it compiled" in convlower.report().convolutions[0].reason
        assert close_calls.open_calls() == 1
        before = close_calls.settled_digest()
        (s,), left, _ = close_calls.settle()
        assert s.rule == "time_fold_conv2d" and s.changed and left == 0
        assert s.saved_s == pytest.approx(0.3)  # against the screen's choice, not the original
        assert close_calls.settled_digest() != before
        assert _compile_rules(m, x) == [("time_fold_conv2d", "cache")]
    finally:
        screen.set_screen(prev)


def test_a_clear_win_with_no_faster_rival_is_not_a_close_call(cache):
    """Rivals whose kernels alone are within the margin of the winner (0.775x vs 0.8x): no
    close call; the warm-up measures the clear win itself, last."""
    prev = screen.set_screen(lambda site, cands, dt: {
        "aten": 2e-3, **{c.name: 3e-3 for c in cands}, **{c.name + screen.KERNELS: 1.55e-3
                                                           for c in cands},
        "channels_last_conv": 1.6e-3, "channels_last_conv" + screen.KERNELS: 1.6e-3})
    try:
        torch.manual_seed(0)
        assert _compile_rules(_Conv3dPatch(), torch.randn(1, 4, 3, 8, 8)) == \
            [("channels_last_conv", "screen")]
        assert close_calls.open_calls() == 0
        assert close_calls.pending() == 1  # the clear win itself: a warm-up looks again
    finally:
        screen.set_screen(prev)


@pytest.fixture
def clear_patchify(cache):
    """The screen sees patchify_mm clearly win (0.5x the original; its opaque form: kernels
    alone were not timed); compiled it takes 1.2x."""
    prev = screen.set_screen(lambda site, cands, dt: {"aten": 2e-3,
                                                      **{c.name: 1e-3 for c in cands}})
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0}.get(label, 1.2))
    yield cache
    screen.set_screen(prev)


def test_a_clear_win_that_loses_compiled_is_dropped_by_the_warm_up(clear_patchify):
    """A screen can win on a fluke (the Wan DiT fp32 patch conv: 0.18x in one screen, 1.12x in
    the next): the warm-up measures clear wins too, and the next compile keeps the original."""
    m, x = _model()
    assert _compile_rules(m, x) == [("patchify_mm", "screen")]
    assert close_calls.open_calls() == 0 and close_calls.pending() == 1
    before = close_calls.settled_digest()
    (s,), left, _ = close_calls.settle()
    assert s.clear_win and s.rule is None and s.changed and left == 0
    assert s.screen_ratio == pytest.approx(0.5) and s.compiled_ratio == pytest.approx(1.2)
    assert s.saved_s == pytest.approx(0.2)  # against the screen's choice (its opaque form)
    assert s.agrees is False and close_calls.pending() == 0
    assert close_calls.settled_digest() != before
    assert _compile_rules(m, x) == [(None, "cache")]
    assert close_calls.pending() == 0  # measured: nothing left to look at


def test_a_clear_win_confirmed_compiled_leaves_the_cache_identity(clear_patchify):
    m, x = _model()
    _compile_rules(m, x)
    before = selection.decisions_digest()
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0}.get(label, 0.5))
    (s,), _, _ = close_calls.settle()
    assert s.clear_win and s.rule == "patchify_mm:opaque" and not s.changed and s.agrees
    assert selection.decisions_digest() == before


def test_a_cached_clear_win_is_noted_again(clear_patchify):
    m, x = _model()
    _compile_rules(m, x)
    close_calls.forget()
    assert _compile_rules(m, x) == [("patchify_mm", "cache")]
    assert close_calls.pending() == 1 and close_calls.open_calls() == 0  # as a clear win


def test_close_calls_are_measured_before_clear_wins(cache):
    """One model, two convs: the first's screen is a clear win, the second's a close call; the
    budget goes to the close call first (a clear win is more often right)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 4, 4), torch.nn.Conv2d(8, 8, 2, 2))
    x = torch.randn(2, 4, 32, 32)
    prev = screen.set_screen(lambda site, cands, dt: {
        "aten": 2e-3, **{c.name: (1e-3 if site.call.weight.shape[1] == 4 else 2.1e-3)
                         for c in cands}})
    selection.set_timer(lambda label, fn, budget: {"aten": 1.0}.get(label, 0.9))
    try:
        assert _compile_rules(m, x) == [("patchify_mm", "screen"), (None, "screen")]
        assert (close_calls.open_calls(), close_calls.pending()) == (1, 2)
        said = []
        settled, left, _ = close_calls.settle(progress=said.append)
        assert [s.clear_win for s in settled] == [False, True] and left == 0
        assert "close call 1/2" in said[0] and "clear win 2/2" in said[1]
    finally:
        screen.set_screen(prev)


def test_the_warm_up_says_how_many_clear_wins_it_measured(clear_patchify):
    m, x = _model()
    with torch.no_grad():
        _, result = convlower.warmup(m, (x,), iters=0)
    (s,) = result.settling.settled
    assert s.clear_win and s.changed and result.settling.left_open == 0
    assert "0 measured (and 1 of the screen's clear wins)" in str(result)
    assert json.loads(json.dumps(result.to_dict()))["settling"]["settled"][0]["clear_win"]


def test_a_warm_up_without_a_budget_says_which_clear_wins_it_did_not_measure(clear_patchify):
    """Nothing was undecided: no close call is left open, the clear win is not measured."""
    m, x = _model()
    with torch.no_grad():
        _, result = convlower.warmup(m, (x,), iters=0, settle_budget_s=0)
    se = result.settling
    assert (se.settled, se.left_open, se.clear_wins_left) == ([], 0, 1)
    assert "close calls:" not in str(result)


def test_a_failed_measurement_of_a_clear_win_changes_nothing(clear_patchify):
    m, x = _model()
    _compile_rules(m, x)
    before = selection.decisions_digest()

    def fails(label, fn, budget):
        raise MemoryError("out of memory")

    selection.set_timer(fails)
    (s,), _, _ = close_calls.settle()
    assert s.rule is None and "measurement failed" in s.why and not s.changed
    assert selection.decisions_digest() == before
    assert _compile_rules(m, x) == [("patchify_mm", "cache")]  # the screen's, cached


def test_an_eager_conv_clear_win_is_judged_on_the_figures_it_won_on(cache):
    """eager_conv wins against the original in Inductor's layout (0.8x), not against eager's
    best layout of the same call (1.0x)."""
    from convlower.selection.close_calls import _Open, _screen_ratio

    times = {"aten": 1e-3, screen.INDUCTOR_LAYOUT: 1.25e-3, "eager_conv": 1e-3}
    call = _Open(None, (), ("eager_conv",), "k", None, times, "eager_conv", clear_win=True)
    assert _screen_ratio(call) == pytest.approx(0.8)


def test_a_clear_winner_is_no_rival_of_itself():
    """A lowering's own kernels alone always undercut its eager figure: that is no reason to
    measure it again at warm-up."""
    from convlower.lowerings import RULES
    from convlower.selection import auto

    rule, _, close = auto.judge({"aten": 2e-3, "patchify_mm": 1.6e-3,
                                 "patchify_mm" + screen.KERNELS: 0.6e-3},
                                {"patchify_mm": RULES["patchify_mm"]})
    assert rule is RULES["patchify_mm"] and close == set()


def test_clear_winners_close_to_each_other_are_settled_at_warm_up():
    """Several clear wins whose figures lie within the screen's spread of the best (equal
    forms: the Wan DiT bf16 patch conv) are a close call among them, the best in force
    meanwhile; a clear win far behind the best is no rival."""
    from convlower.lowerings import RULES
    from convlower.selection import auto

    by_name = {n: RULES[n] for n in ("patchify_mm", "time_fold_conv2d", "time_sum_conv2d")}
    times = {"aten": 1.0, "time_fold_conv2d": 0.46, "time_fold_conv2d" + screen.KERNELS: 0.44,
             "patchify_mm": 0.58, "patchify_mm" + screen.KERNELS: 0.51,
             "time_sum_conv2d": 0.8, "time_sum_conv2d" + screen.KERNELS: 0.6}
    rule, why, close = auto.judge(times, by_name)
    assert rule is RULES["time_fold_conv2d"] and close == {"time_fold_conv2d", "patchify_mm"}
    assert "patchify_mm may beat it compiled" in why


def test_a_process_that_never_warms_up_keeps_a_bounded_number_of_noted_calls(clear_patchify,
                                                                              monkeypatch):
    monkeypatch.setattr(close_calls, "MAX_OPEN", 1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 4, 4), torch.nn.Conv2d(8, 8, 2, 2))
    assert _compile_rules(m, torch.randn(2, 4, 32, 32)) == [("patchify_mm", "screen")] * 2
    assert close_calls.pending() == 1
