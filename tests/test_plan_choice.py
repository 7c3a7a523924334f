"""Plans side by side (tools/plans.py) and the warm-up that picks one (tools/plan_choice.py)."""
import json

import pytest
import torch
from torch import nn

import convlower
from convlower.tools import plan_choice, plans
from convlower.tools.spike import SpikeConfig
from convlower.tools.spike_report import _table
from convlower.tools.spike_runner import Runner, own_blocks


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class WithOwnBlocks(nn.Module):
    """diffusers' convention: ``_repeated_blocks`` names classes, ``compile_repeated_blocks()``
    compiles each instance in place."""
    _repeated_blocks = ["Block"]

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.blocks = nn.Sequential(Block(8), Block(8))

    def forward(self, x):
        return self.blocks(self.stem(x))

    def compile_repeated_blocks(self, *args, **kwargs):
        for m in self.modules():
            if type(m).__name__ in self._repeated_blocks:
                m.compile(*args, **kwargs)


def _model():
    torch.manual_seed(0)
    return WithOwnBlocks(), (torch.randn(2, 3, 8, 8),)


def test_blocks_plan_only_for_a_model_with_its_own_blocks():
    model, x = _model()
    assert own_blocks(model) is model
    assert Runner(model, x, SpikeConfig()).plans() == ["inductor", "convlower",
                                                       "convlower-regions", "blocks"]
    assert own_blocks(nn.Conv2d(1, 1, 1)) is None
    assert "blocks" not in Runner(nn.Conv2d(3, 3, 1), x, SpikeConfig()).plans()


def test_blocks_plan_compiles_a_copy_and_trains_its_parameters():
    model, x = _model()
    run = Runner(model, x, SpikeConfig(backward=True))
    ref = run.values("eager")
    run.compile("blocks", {})
    assert run.compiled["blocks"] is not model
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks)  # untouched
    assert all(b._compiled_call_impl is not None for b in run.compiled["blocks"].blocks)
    got = run.values("blocks")
    assert len(got) == len(ref) == 1 + len(list(model.parameters()))  # output + every grad
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.compiler.reset()


def test_spike_table_shows_every_plan():
    row = {"error": None, "cold_compile_s": 2.0, "warm_compile_s": 0.5, "step_median_s": 0.01,
           "step_iqr_s": 0.001, "speedup": 0.1, "break_even_calls": 5,
           "break_even_calls_warm": 2, "graph_breaks": 0, "recompiles": 0, "graphs": 1,
           "max_abs_err": 0.0, "max_rel_err": 0.0, "lowered_by_rule": {}}
    b = {"eager": {"step_median_s": 0.011, "step_iqr_s": 0.001},
         "inductor": dict(row), "convlower": dict(row),
         "convlower-regions": dict(row, cold_compile_s=1.25), "blocks": dict(row, step_median_s=0.0123)}
    lines = _table(b).splitlines()
    assert lines[0].split() == ["eager", "inductor", "convlower", "convlower-regions", "blocks"]
    assert lines[1].split()[-4:] == ["1.25", "s", "2", "s"]  # regions' and blocks' columns printed
    assert "12.3 ms" in lines[3]


def test_a_plan_off_from_eager_is_not_chosen():
    res = {"eager": {"step_median_s": 1.0},
           "inductor": {"error": None, "max_rel_err": 0.5, "cold_compile_s": 1.0,
                        "warm_compile_s": 1.0, "step_median_s": 0.1},
           "convlower": {"error": None, "max_rel_err": 1e-7, "cold_compile_s": 1.0,
                         "warm_compile_s": 1.0, "step_median_s": 0.5}}
    plan_choice._drop_inexact(res, torch.float32)
    assert "differs from eager" in res["inductor"]["error"] and res["convlower"]["error"] is None
    from convlower.tools.spike_report import plan_for_session

    assert plan_for_session(res, 100)["plan"] == "convlower"


def test_compare_end_to_end_then_remembered(tmp_path, monkeypatch):
    model, x = _model()
    with torch.no_grad():
        choice = plan_choice.choose(model, x, backward=False, options=None, dynamic=None,
                                    session_calls=5, cache_dir=str(tmp_path), runs=3)
    assert choice.state == "compared" and choice.by == "warm" and choice.seconds > 0
    assert set(choice.figures) == {"inductor", "convlower", "convlower-regions", "blocks"}
    for plan, f in choice.figures.items():
        assert f["error"] is None, plan
        assert f["cold_compile_s"] > 0 and f["step_median_s"] > 0 and f["max_rel_err"] < 1e-4
    totals = {p: t["warm"] for p, t in choice.totals_s.items()}
    assert choice.plan == min(totals, key=totals.get)  # least total time over 5 calls
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.blocks)
    saved = json.loads((tmp_path / plan_choice.FILE).read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["choice"]["plan"] == choice.plan

    def no_compare(*a, **k):
        raise AssertionError("compared again")

    monkeypatch.setattr(plans, "compare", no_compare)
    with torch.no_grad():
        again = plan_choice.choose(model, x, backward=False, options=None, dynamic=None,
                                   session_calls=5, cache_dir=str(tmp_path))
    assert again.state == "remembered" and again.plan == choice.plan and again.seconds == 0
    with pytest.raises(AssertionError, match="compared again"):  # another question: measured
        with torch.no_grad():
            plan_choice.choose(model, x, backward=False, options=None, dynamic=None,
                               session_calls=50_000, cache_dir=str(tmp_path))
    torch.compiler.reset()


def _chosen(plan):
    return plan_choice.PlanChoice(plan=plan, state="compared", session_calls=10, by="cold",
                                  totals_s={}, figures={}, seconds=0.0)


@pytest.mark.parametrize("plan", ["eager", "inductor", "blocks"])
def test_warmup_runs_a_plan_that_is_not_convlower(plan, monkeypatch):
    model, x = _model()
    monkeypatch.setattr(plan_choice, "_compare", lambda *a, **k: _chosen(plan))
    with torch.no_grad():
        compiled, result = convlower.warmup(model, x, compare_plans=True, iters=1,
                                            settle_budget_s=0)
        out = compiled(*x)
        torch.testing.assert_close(out, model(*x) if plan == "eager" else out)
    assert result.plans.plan == plan and f"plan: {plan}" in str(result)
    assert f"plan {plan} was chosen" in result.saved.why
    if plan == "eager":
        assert compiled is model and result.statistics.get("graphs", 0) == 0
    elif plan == "blocks":  # in place, as the model's own method does it
        assert compiled is model and model.blocks[0]._compiled_call_impl is not None
    else:
        assert compiled is not model
    torch.compiler.reset()


def test_warmup_compiles_the_chosen_regions_plan(monkeypatch):
    model, x = _model()
    monkeypatch.setattr(plan_choice, "_compare", lambda *a, **k: _chosen("convlower-regions"))
    convlower.reset_report()
    with torch.no_grad():
        compiled, result = convlower.warmup(model, x, compare_plans=True, iters=1,
                                            settle_budget_s=0, options={"regions": ["Block"]})
        torch.testing.assert_close(compiled(*x), model(*x), rtol=1e-4, atol=1e-5)
    assert result.plans.plan == "convlower-regions"
    regions = convlower.report().regions
    assert regions and any(r.how == "reused" for r in regions)  # two Block instances, one compile
    torch.compiler.reset()


def test_session_calls_must_be_positive():
    model, x = _model()
    with pytest.raises(ValueError, match="session_calls"):
        plan_choice.choose(model, x, backward=False, options=None, dynamic=None,
                           session_calls=0, cache_dir=None)

