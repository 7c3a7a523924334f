"""bench/device_check.py stays alive between GPU loans: its timing logic with fake device
clocks (timings <= 0 rejected, warm-up, interleaved rounds, medians), its table, and the
whole ``--device cpu --quick`` run in a subprocess (the same code paths as on a GPU)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from convlower.tools import device_timing as dt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "device_check.py")


def load_device_check():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeClock:
    """A device clock that reports given seconds per call and logs what it timed."""

    def __init__(self, per_call: dict, broken: dict | None = None):
        self.per_call, self.broken, self.log = per_call, broken or {}, []

    def __call__(self, fn, reps):
        for _ in range(reps):
            name = fn()
        self.log.append((name, reps))
        n = sum(1 for k, _ in self.log if k == name)
        if name in self.broken and n >= self.broken[name][0]:
            return self.broken[name][1]
        return self.per_call[name] * reps


def variants(*names):
    calls = {n: 0 for n in names}

    def make(n):
        def fn():
            calls[n] += 1
            return n
        return fn

    return {n: make(n) for n in names}, calls


# ------------------------------------------------------------------------------ timing logic
def test_medians_samples_and_reps():
    fns, calls = variants("a", "b")
    clock = FakeClock({"a": 0.001, "b": 0.004})
    got = dt.time_interleaved(fns, clock=clock, rounds=5, warmup=2, min_sample_s=0.01)
    assert got["a"].median_s == pytest.approx(0.001) and got["a"].reps == 10
    assert got["b"].median_s == pytest.approx(0.004) and got["b"].reps == 3
    assert len(got["a"].samples) == 5 and got["a"].ok and got["a"].rejected is None
    # warm-up calls come before any timing: 2 warm-up + 1 calibration + 5 rounds x reps
    assert calls["a"] == 2 + 1 + 5 * 10


def test_rounds_are_interleaved_and_rotated():
    fns, _ = variants("a", "b", "c")
    clock = FakeClock({"a": 1e-3, "b": 1e-3, "c": 1e-3})
    dt.time_interleaved(fns, clock=clock, rounds=3, warmup=1, min_sample_s=1e-3)
    timed = [name for name, reps in clock.log[3:]]  # after the three calibrations
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


@pytest.mark.parametrize("bad", [0.0, -0.002, float("nan"), float("inf")])
def test_a_device_timer_reporting_nonpositive_or_nonfinite_time_is_rejected(bad):
    fns, _ = variants("good", "broken")
    # the broken variant's clock goes wrong in its third measurement (round 1)
    clock = FakeClock({"good": 1e-3, "broken": 1e-3}, broken={"broken": (3, bad)})
    got = dt.time_interleaved(fns, clock=clock, rounds=4, warmup=1, min_sample_s=1e-3)
    assert got["good"].ok and got["good"].median_s == pytest.approx(1e-3)
    assert got["broken"].median_s is None and not got["broken"].ok
    assert "timer returned" in got["broken"].rejected and got["broken"].rejected.startswith("round")


def test_calibration_with_a_broken_timer_is_rejected():
    fns, _ = variants("x")
    got = dt.time_interleaved(fns, clock=FakeClock({"x": 0.0}), rounds=3, warmup=1)
    assert got["x"].median_s is None and got["x"].rejected.startswith("calibration")
    assert got["x"].samples == []


def test_a_failing_variant_is_reported_and_the_others_still_timed():
    fns, _ = variants("ok")

    def boom():
        raise RuntimeError("no kernel image")

    fns["boom"] = boom
    got = dt.time_interleaved(fns, clock=FakeClock({"ok": 1e-3}), rounds=2, warmup=1)
    assert got["ok"].ok
    assert got["boom"].median_s is None and "no kernel image" in got["boom"].error


def test_real_wall_clock_on_cpu():
    clock = dt.clock_for("cpu")
    assert "wall" in clock.kind
    x = torch.randn(64, 64)
    got = dt.time_interleaved({"mm": lambda: x @ x}, clock=clock, rounds=3, warmup=1,
                              min_sample_s=1e-3)
    assert got["mm"].ok and 0 < got["mm"].median_s < 1
    assert dt.clock_for("cuda").kind == "cuda events"  # chosen, not run
    with pytest.raises(ValueError, match="valid"):
        dt.clock_for("cpu", "sundial")


# ------------------------------------------------------------------------------ the report
def test_table_marks_rejected_and_failed_variants_and_junit_parsing(tmp_path):
    dc = load_device_check()
    ok = {"median_s": 0.002}
    row = {"case": "c", "dtype": "bf16", "pass": "fwd", "primary": "convlower",
           "variants": {"eager": {"median_s": 0.004}, "inductor": {"median_s": None,
                        "rejected": "round 1: timer returned 0.0 s"},
                        "convlower": ok, "rule_x": {"error": "boom"}}}
    line = dc.table_row(row)
    assert "| 4 | rejected | 2 | rule_x error |" in line
    assert line.split("|")[8].strip() == "-"      # Inductor / convlower: no figure
    assert line.split("|")[9].strip() == "2.00"   # eager / convlower
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase name="a" time="1.5"/>'
                   '<testcase name="b"><skipped message="no GPU"/></testcase>'
                   '<testcase name="c"><failure message="bad">tb</failure></testcase>'
                   '</testsuite></testsuites>')
    got = dc.parse_junit(str(xml))
    assert got["counts"] == {"passed": 1, "skipped": 1, "failed": 1}
    assert [t["outcome"] for t in got["tests"]] == ["passed", "skipped", "failed"]
    # a pytest stopped at its timeout leaves no JUnit file: its -v lines still count
    log = ("tests/test_gpu.py::test_rule[patch_linear-bfloat16-contiguous] PASSED   [  4%]\n"
           "tests/test_gpu.py::test_snake[hip-eager] FAILED                         [  8%]\n")
    got = dc.parse_verbose(log)
    assert got["counts"] == {"passed": 1, "failed": 1}
    assert got["tests"][0]["name"] == "test_rule[patch_linear-bfloat16-contiguous]"


# ------------------------------------------------------------------------------ survival
def make_check(dc, tmp_path, budget_s=600.0, limits=None, costs=None):
    args = dc.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path / "out"),
                          "--budget-s", str(budget_s)])
    plan = dict(dc.PLANS["quick"], row_limit_s=limits or {}, row_cost_s=costs or {})
    return dc.Check(args, plan)


def test_a_row_over_its_limit_is_stopped_and_the_next_row_runs(tmp_path):
    dc = load_device_check()
    check = make_check(dc, tmp_path, limits={"slow": 0.5})
    start = time.perf_counter()
    check.row("slow", "sleeps", "fp32", "fwd", lambda: time.sleep(30) or {})
    assert time.perf_counter() - start < 10
    check.row("slow", "quick", "fp32", "fwd", lambda: {"variants": {}})
    first, second = check.results["perf"]["rows"]
    assert first["error"].startswith("RowTimeout") and "limit" in first["error"]
    assert "error" not in second
    r = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert len(r["perf"]["rows"]) == 2 and any("sleeps" in f for f in r["failures"])
    assert "| sleeps | fp32 | fwd | error: RowTimeout" in (tmp_path / "out" / "device_check.md").read_text()


def test_a_row_stopped_at_its_limit_keeps_the_first_calls_it_made(tmp_path):
    """compare() puts each variant into the running row as it finishes: a one-shot GPU row cut
    off during its third compile still reports the first two."""
    dc = load_device_check()
    check = make_check(dc, tmp_path, limits={"slow": 1.0})
    calls = []

    def build():
        fns = {"fast": lambda: calls.append("fast"), "also": lambda: calls.append("also"),
               "stuck": lambda: time.sleep(30)}
        return {"variants": check.compare(fns)}

    check.row("slow", "three compiles", "bf16", "fwd", build)
    (row,) = check.results["perf"]["rows"]
    assert row["error"].startswith("RowTimeout")
    assert row["variants"]["fast"]["first_call_s"] >= 0 and "also" in row["variants"], row
    assert check.current_row is None


def test_rows_that_do_not_fit_the_budget_are_skipped_with_a_note(tmp_path):
    dc = load_device_check()
    check = make_check(dc, tmp_path, budget_s=1.0, costs={"big": 60})  # the budget is spent
    built = []
    check.row("big", "model", "bf16", "fwd", lambda: built.append(1) or {})
    (row,) = check.results["perf"]["rows"]
    assert built == [] and "budget" in row["skipped"]
    assert any("skipped, needs ~60 s" in n for n in check.results["notes"])
    assert "skipped: time budget" in (tmp_path / "out" / "device_check.md").read_text()


def test_a_raising_section_is_recorded_and_the_next_section_runs(tmp_path, monkeypatch):
    dc = load_device_check()
    import device_check_rows  # on sys.path once device_check is loaded

    ran = []

    def broken(check):
        raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(device_check_rows, "RUNNERS", {
        "patch_embed": broken, "conv3d": lambda check: ran.append("conv3d")})
    check = make_check(dc, tmp_path)
    check.args.section_list = ["patch_embed", "conv3d"]
    dc.run_sections(check)
    assert ran == ["conv3d"]
    assert any("section patch_embed: RuntimeError: no kernel image" in f
               for f in check.results["failures"])
    assert "no kernel image" in (tmp_path / "out" / "device_check.md").read_text()


def test_watchdog_writes_the_files_and_ends_a_run_stuck_past_its_budget(tmp_path):
    """A row that never returns (a hung compile or kernel) cannot keep the run from leaving
    its files: at budget + grace the watchdog writes them and exits with status 3."""
    code = f"""if True:
        import importlib.util, time
        spec = importlib.util.spec_from_file_location("device_check", {SCRIPT!r})
        dc = importlib.util.module_from_spec(spec); spec.loader.exec_module(dc)
        args = dc.parse_args(["--device", "cpu", "--quick", "--out", {str(tmp_path)!r},
                              "--budget-s", "1"])
        check = dc.Check(args, dict(dc.PLANS["quick"], grace_s=0.5))
        dc.watchdog(check)
        time.sleep(60)  # stuck, and not interruptible by a row limit
    """
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert time.perf_counter() - start < 50
    r = json.loads((tmp_path / "device_check.json").read_text())
    assert any(f.startswith("hard stop") for f in r["failures"])
    assert "hard stop" in (tmp_path / "device_check.md").read_text()


def test_config_keys_missing_in_this_torch_are_noted_not_fatal():
    dc = load_device_check()

    class Config:
        cache_size_limit = 8

    notes, cfg = [], Config()
    dc.set_config(notes, cfg, 64, "recompile_limit", "cache_size_limit")  # the older name
    dc.set_config(notes, cfg, False, "no_such_key")
    assert cfg.cache_size_limit == 64 and not hasattr(cfg, "recompile_limit")
    assert len(notes) == 1 and "no_such_key not in torch" in notes[0]


def test_backend_entry_point_is_provided_when_convlower_is_not_installed(monkeypatch):
    import importlib.metadata

    from convlower import convlower_backend

    dc = load_device_check()

    def missing(name):
        raise RuntimeError(f"backend {name} not found")

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(torch._dynamo, "lookup_backend", missing)
    notes = []
    dc.ensure_backend(notes)
    assert any("entry point was provided" in n for n in notes)
    site = sys.path[-1]
    assert site in os.environ["PYTHONPATH"].split(os.pathsep)  # children find it too
    (dist,) = importlib.metadata.distributions(path=[site])  # what torch's registry reads
    (ep,) = [e for e in dist.entry_points if e.group == "torch_dynamo_backends"]
    assert ep.name == "convlower" and ep.load() is convlower_backend


def test_markdown_pastes_under_a_level_two_heading():
    dc = load_device_check()
    r = {"environment": {"device_name": "cuda:NVIDIA H200", "torch": "2.11.0+cu130"},
         "perf": {"rows": [{"case": "c", "dtype": "bf16", "pass": "fwd", "floor": ["bare mm"],
                            "variants": {"convlower": {"median_s": 0.08},
                                         "bare mm": {"median_s": 0.04}}}]},
         "failures": ["x"], "notes": []}
    text = dc.markdown(r)
    assert text.startswith("### cuda:NVIDIA H200 — torch 2.11.0+cu130")
    assert all(not line.startswith(("# ", "## ")) for line in text.splitlines())
    assert "convlower / bare mm **2.00**" in text


# ------------------------------------------------------------------------------ the CPU run
@pytest.mark.slow
def test_quick_cpu_run(tmp_path):
    """The whole check on CPU: every section runs, the files are written, the table printed."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "CONVLOWER_CACHE_DIR"}
    start = time.perf_counter()
    env.update(OUT=str(out), PYTHON=sys.executable)  # the GPU machine's one command
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "device_run.sh"), "--device", "cpu",
                           "--quick"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    print(f"\ndevice_check --device cpu --quick: {wall:.0f} s")
    r = json.loads((out / "device_check.json").read_text())
    table = (out / "device_check.md").read_text()
    assert r["schema"] == 1 and r["quick"] and r["environment"]["device"] == "cpu"
    assert r["timing"]["clock"].startswith("wall clock")
    # the gpu subset ran (on the CPU, by request) and every test in it passed
    tests = r["tests"]
    names = {t["name"].split("[")[0] for t in tests["tests"]}
    assert names == {"test_rule_forward_backward_matches_eager",
                     "test_snake_route_with_forced_platform",
                     "test_measured_selection_with_the_real_timer",
                     "test_warmup_from_a_second_process"}, names
    assert tests["run_on_cpu_by_request"]
    failed = [f"{t['name']}: {t['message']}" for t in tests["tests"] if t["outcome"] != "passed"]
    assert tests["status"] == "passed", (tests["counts"], failed, tests.get("output_tail", "")[-2000:])
    # cold then warm compile of one zoo model, from the warm-up test's two processes
    comp = r["compile"]
    assert comp["status"] == "ok" and comp["cold"]["cache"] == "cold"
    assert comp["warm"]["cache"] == "warm" and comp["cold"]["compile_s"] > 0
    # every perf section has its rows, every variant has a positive median
    rows = r["perf"]["rows"]
    assert {row["section"] for row in rows} == {"patch_embed", "snake", "conv3d", "wan_vae"}
    for row in rows:
        assert not row.get("error") and not row.get("skipped"), row
        for name, v in row["variants"].items():
            assert v["median_s"] and math.isfinite(v["median_s"]) and v["median_s"] > 0, (row["case"], name, v)
    by = {(row["section"], row["dtype"], row["pass"]): row for row in rows}
    assert set(by[("patch_embed", "fp32", "fwd+bwd")]["variants"]) == {
        "eager", "inductor", "convlower", "compiled mm", "bare mm"}
    # the patch embedding's diagnosis: what one call runs, and the generated code (one mm)
    diag = r["diagnosis"]["patch embed bf16 fwd"]
    assert "error" not in diag and diag["profile"]["convlower"]["kernels"], diag
    assert any("mm" in k["name"] for k in diag["profile"]["convlower"]["kernels"])
    code = (out / diag["code_file"]).read_text()
    assert code.count("extern_kernels.mm(") >= 1 and "convlower.dense" not in code
    assert "convlower / bare mm **" in table
    assert by[("patch_embed", "bf16", "fwd")]["variants"]["convlower"]["chose"] == {
        "forward:patch_linear": 1}
    snake = by[("snake", "bf16", "fwd")]["variants"]
    assert set(snake["fused"]["snake_routes"]) == {"fused"}
    assert set(snake["eager-safe"]["snake_routes"]) == {"eager"}
    assert {"eager", "inductor", "convlower", "measure"} <= set(by[("conv3d", "bf16", "fwd")]["variants"])
    assert r["failures"] == [] and proc.returncode == 0, (r["failures"], proc.stderr[-3000:])
    # the table: written and printed
    assert "| case | dtype | pass | eager | Inductor | convlower |" in table
    assert "Qwen2.5-VL patch embed" in table and "Wan VAE decode" in table
    assert "| cold | cold |" in table and "| warm | warm |" in table
    assert "## Performance" in proc.stdout and "Qwen2.5-VL patch embed" in proc.stdout
    assert "device_check exit status 0" in (out / "device_check.log").read_text()


def test_regions_is_a_run_of_its_own_and_its_compile_line():
    """``regions`` (three compiles of a large UNet) is not in a default run, is accepted by
    request, and its row's markdown gives each plan's first call and the parts."""
    dc = load_device_check()
    assert "regions" not in dc.parse_args(["--device", "cpu"]).section_list
    assert dc.parse_args(["--device", "cpu", "--sections", "regions"]).section_list == ["regions"]
    from device_check_report import compile_line

    row = {"section": "regions", "case": "unet", "dtype": "bf16", "variants": {
        "regions": {"first_call_s": 20.0, "region_parts": {"compiled": 19, "reused": 14},
                    "samples": [1.05, 1.10, 1.20, 0.90, 1.00]},
        "inductor": {"first_call_s": 50.0, "samples": [1.0, 1.0, 1.0, 1.0, 1.0]},
        "convlower": {"first_call_s": 40.0, "samples": [1.0, 1.0, 1.0, 1.0, 2.0]}}}
    line = compile_line(row)
    assert "regions 20.00 s, inductor 50.00 s, convlower 40.00 s" in line
    assert "regions / Inductor **0.40**" in line and "19 compiled, 14 reused" in line
    # per round: 1.05, 1.10, 1.20, 0.90, 1.00 over Inductor; the last round halved over convlower
    assert "regions / inductor **1.050** (0.95-1.15)" in line, line
    assert "regions / convlower **1.050** (0.70-1.15)" in line, line
    import device_check_rows

    # the GPU config is the zoo's UNet with SDXL's widths: it builds (on the meta device here)
    from convlower.tools import zoo

    with torch.device("meta"):
        unet, inputs = zoo.ZOO["sdxl-unet"].builder(
            device_check_rows.unet_config(device_check_rows.UNET["full"]))
    assert inputs[0].shape == (2, 4, 64, 64) and unet.unet.config.block_out_channels == (320, 640, 1280)


@pytest.mark.slow
def test_quick_cpu_regions_run(tmp_path):
    """The regions section on CPU (the zoo's tiny UNet): regions really split the graph,
    every plan ran and matched eager, and the table has the compile line."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "CONVLOWER_CACHE_DIR"}
    env.update(OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "device_run.sh"), "--device", "cpu",
                           "--quick", "--sections", "regions"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    r = json.loads((out / "device_check.json").read_text())
    assert r["failures"] == [] and proc.returncode == 0, (r["failures"], proc.stderr[-3000:])
    (row,) = r["perf"]["rows"]
    assert row["section"] == "regions" and not row.get("error"), row
    v = row["variants"]
    assert list(v) == ["eager", "regions", "inductor", "convlower"]  # the compile order described
    assert all(x["median_s"] > 0 for x in v.values())
    assert v["regions"].get("region_parts", {}).get("reused", 0) >= 1, v["regions"]
    assert "region_parts" not in v["convlower"]
    assert max(row["max_rel_err"].values()) < 1e-4, row["max_rel_err"]
    assert "regions / Inductor **" in (out / "device_check.md").read_text()
