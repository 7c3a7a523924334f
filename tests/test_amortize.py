"""The amortisation verdict on synthetic timings, at and around each threshold."""
import math

import pytest

from convlower.tools.amortize import DONT, SESSION_LOAD, amortize


def test_speedup_and_break_even():
    a = amortize(1.2, 1.0, 30.0)
    assert a.speedup == pytest.approx(0.2)
    assert a.saved_per_call_s == pytest.approx(0.2)
    assert a.break_even_calls == 150  # 30 s / 0.2 s, not 151 from float rounding


def test_below_low_threshold_is_dont():
    a = amortize(1.0499, 1.0, 1.0)
    assert (a.code, a.verdict) == ("dont", DONT)


def test_exactly_low_threshold_is_long_sessions():
    a = amortize(1.05, 1.0, 10.0)
    assert a.code == "long_sessions"
    assert a.verdict == f"compile only for sessions of >= {a.break_even_calls} calls"
    assert a.break_even_calls == 200


def test_exactly_high_threshold_and_stable_is_session_load():
    a = amortize(1.15, 1.0, 10.0, spread_s=0.0)
    assert (a.code, a.verdict) == ("session_load", SESSION_LOAD)
    assert a.stable


def test_just_below_high_threshold_is_long_sessions():
    a = amortize(1.1499, 1.0, 10.0, spread_s=0.0)
    assert a.code == "long_sessions"
    assert "below 15%" in a.reason


def test_high_but_unstable_is_long_sessions():
    # saved 0.2 s per call; spread 0.11 s > 0.5 * 0.2
    a = amortize(1.2, 1.0, 10.0, spread_s=0.11)
    assert not a.stable
    assert a.code == "long_sessions"
    assert "unstable" in a.reason
    # spread exactly at the stability bound counts as stable
    assert amortize(1.2, 1.0, 10.0, spread_s=0.1).code == "session_load"


def test_slower_compiled_never_breaks_even():
    a = amortize(1.0, 1.5, 10.0)
    assert a.code == "dont"
    assert a.break_even_calls is None
    assert a.speedup < 0


def test_thresholds_are_parameters():
    assert amortize(1.08, 1.0, 1.0, low=0.1).code == "dont"
    assert amortize(1.08, 1.0, 1.0, low=0.05, high=0.08).code == "session_load"
    assert amortize(1.3, 1.0, 1.0, spread_s=0.2, stability=1.0).code == "session_load"
    assert amortize(1.3, 1.0, 1.0, spread_s=0.2, stability=0.5).code == "long_sessions"


@pytest.mark.parametrize("bad", [dict(eager_step_s=-1.0), dict(compiled_step_s=0.0),
                                 dict(compile_s=math.nan), dict(spread_s=math.inf)])
def test_bad_inputs_raise(bad):
    args = dict(eager_step_s=1.0, compiled_step_s=1.0, compile_s=1.0, spread_s=0.0)
    args.update(bad)
    with pytest.raises(ValueError):
        amortize(args.pop("eager_step_s"), args.pop("compiled_step_s"), args.pop("compile_s"), **args)


def test_low_above_high_raises():
    with pytest.raises(ValueError):
        amortize(1.2, 1.0, 1.0, low=0.2, high=0.1)


def test_to_dict_is_json_ready():
    import json

    d = amortize(1.2, 1.0, 3.0).to_dict()
    assert json.loads(json.dumps(d))["verdict"] == SESSION_LOAD
