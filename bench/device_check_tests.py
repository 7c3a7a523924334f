"""The device check's test section: the ``gpu`` subset in a child pytest with its own timeout
(its own process group, so a timeout or the watchdog ends it with its workers), the JUnit
results and the cold/warm compile figures its warm-up test leaves."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESERVE_S = 8.0


def start_tests(check) -> dict:
    """Start the gpu subset in a child pytest; its warm-up test also leaves the cold/warm
    compile figures."""
    res_dir = tempfile.mkdtemp(prefix="device-check-tests-")
    junit = os.path.join(check.out, "gpu_tests.xml")
    os.makedirs(check.out, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(junit)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, CONVLOWER_TEST_DEVICE=str(check.device),
               CONVLOWER_TEST_QUICK="1" if check.args.quick else "0",
               CONVLOWER_DEVICE_CHECK_RESULTS=res_dir,
               CONVLOWER_TEST_ZOO_MODEL=check.args.zoo_model or check.plan["zoo_model"],
               CONVLOWER_TEST_ZOO_SIZE=check.plan["zoo_size"])
    timeout = max(20.0, min(check.plan["tests_timeout_s"], check.remaining() - RESERVE_S - 5))
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
           "-p", "no:logging", os.path.join("tests", "test_gpu.py"), f"--junitxml={junit}"]
    check.log(f"tests: {' '.join(cmd[2:])} (timeout {timeout:.0f} s)")
    log = open(os.path.join(res_dir, "pytest.log"), "w+", encoding="utf-8")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    check.tests_proc = proc
    return {"proc": proc, "log": log, "res_dir": res_dir, "junit": junit, "cmd": cmd,
            "t0": time.perf_counter(), "deadline": time.perf_counter() + timeout,
            "timeout": timeout}


def _wait(run: dict, tests: dict) -> None:
    proc = run["proc"]
    try:
        tests["returncode"] = proc.wait(timeout=max(1.0, run["deadline"] - time.perf_counter()))
    except subprocess.TimeoutExpired:
        tests["timed_out_after_s"] = round(run["timeout"])
    finally:  # also when the wait itself was interrupted (the row limit)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # the child pytest we started, and its workers
            proc.wait()
            tests.setdefault("returncode", None)


def finish_tests(check, run: dict) -> None:
    tests = {"command": " ".join(run["cmd"][2:]), "device": str(check.device),
             "run_on_cpu_by_request": check.device.type == "cpu"}
    try:
        _wait(run, tests)
    finally:
        _record(check, run, tests)


def _record(check, run: dict, tests: dict) -> None:
    tests["wall_s"] = round(time.perf_counter() - run["t0"], 2)
    run["log"].seek(0)
    log = run["log"].read()
    tests["output_tail"] = log[-4000:]
    run["log"].close()
    tests.update(parse_junit(run["junit"]))
    if not tests["tests"]:  # no JUnit file (a pytest stopped at its timeout): the -v lines
        tests.update(parse_verbose(log))
    counts = tests.get("counts", {})
    if tests.get("timed_out_after_s") or tests.get("returncode", 0) is None:
        tests["status"] = "timed out"
    elif counts.get("failed") or counts.get("error") or tests["returncode"] != 0:
        tests["status"] = "failed"
    elif not counts.get("passed"):
        tests["status"] = "nothing passed"  # all skipped: not a result
    else:
        tests["status"] = "passed"
    if tests["status"] != "passed":
        bad = [f"{t['name']}: {t['outcome']}: {t.get('message', '')[:300]}"
               for t in tests.get("tests", []) if t["outcome"] in ("failed", "error")]
        check.fail(f"gpu tests {tests['status']}" + (": " + "; ".join(bad) if bad else ""))
    check.results["tests"] = tests
    check.results["compile"] = read_compile_figures(run["res_dir"])
    shutil.rmtree(run["res_dir"], ignore_errors=True)
    check.tests_proc = None
    check.log(f"tests: {tests['status']} {counts} in {tests['wall_s']:.0f} s")
    check.write()


def parse_junit(path: str) -> dict:
    if not os.path.exists(path):
        return {"counts": {}, "tests": []}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:  # a pytest killed while writing it
        return {"counts": {}, "tests": [], "junit_error": str(e)}
    tests, counts = [], collections.Counter()
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or el.text or "")[:1000]
                break
        counts[outcome] += 1
        tests.append({"name": case.get("name"), "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "message": message})
    return {"counts": dict(counts), "tests": tests}


VERBOSE = re.compile(r"^(?:\S+::)?(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def parse_verbose(log: str) -> dict:
    """Outcomes from ``pytest -v`` lines (``tests/x.py::name[id] PASSED [ 4%]``)."""
    tests, counts = [], collections.Counter()
    for name, outcome in VERBOSE.findall(log):
        outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error"}.get(
            outcome, outcome.lower())
        counts[outcome] += 1
        tests.append({"name": name, "outcome": outcome, "seconds": None, "message": ""})
    return {"counts": dict(counts), "tests": tests, "from": "pytest -v output (no JUnit file)"}


def read_compile_figures(res_dir: str) -> dict:
    path = os.path.join(res_dir, "warmup.json")
    if not os.path.exists(path):
        return {"status": "not run (the warm-up test did not run or did not finish)"}
    with open(path, encoding="utf-8") as f:
        fig = json.load(f)
    fig["status"] = "ok" if fig.get("cold", {}).get("ok") and fig.get("warm", {}).get("ok") \
        else "incomplete"
    return fig
