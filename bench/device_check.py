"""The device check: one prepared command for the few minutes a GPU machine is lent.

    bash bench/device_run.sh                                  # on the GPU machine (see there)
    python bench/device_check.py --out DIR                    # on a CUDA or HIP GPU, ~6 min
    python bench/device_check.py --device cpu --quick --out DIR   # the same code paths on CPU

It answers, in one run, and writes ``DIR/device_check.json`` and ``DIR/device_check.md``
(markdown with level-3/4 headings, to paste into docs/benchmarks.md under "## GPU"; also
printed), rewritten after every row, so a run cut short still leaves its files:

1. **The ``gpu`` test subset** (``tests/test_gpu.py``, pytest marker ``gpu``), in a child
   pytest (its own timeout): every rule forward and backward against eager in fp32 and bf16,
   channels-last included; the Snake routes with ``platform`` forced; measured selection with
   the real timer; ``convlower.warmup`` from a second process, which also gives **cold and
   warm compile times** for one zoo model.
2. **A performance table** (median ms per call): the Qwen2.5-VL patch embedding at 8192
   patches, fp32 and bf16, forward and forward+backward (convlower, Inductor, eager, the same
   flatten + mm compiled by Inductor, a bare mm, on CUDA convlower with CUDA graphs;
   ``convlower / bare mm`` printed), with the kernels one call runs and the host time to
   launch it (profiler) and the generated code of the convlower compile
   (``DIR/patch_embed_code.txt``); the Conv3d rows of ``bench/bench_conv3d.py`` in bf16; a Wan
   VAE decode in bf16; the Oobleck decoder's Snake in bf16, fused against the eager-safe op.
3. **On request, regions** (``--sections regions``, a run of its own: three compiles of a large
   UNet): an SDXL-layout UNet (SDXL's widths, transformer depth 1/2/4, 2x4x64x64, bf16) with
   convlower's regions against convlower's and Inductor's whole graph: step (samples of ~0.2 s
   of consecutive calls, as a generate loop runs them) and the first call's compile seconds
   (issue 20: on the CPU regions cost 3-5% of a step in host work, which a GPU may hide).

Timing (:mod:`convlower.tools.device_timing`): CUDA events on a GPU (the wall clock with
device synchronisation on a CPU), warm-up calls, samples of several calls, the median over
interleaved rounds; a variant whose timer reports <= 0 (or anything implausible) is rejected.
Compiles use a fresh Inductor cache and a cold decision cache: compile seconds and selection
are what a first run sees.

Survival: ``--budget-s`` is the whole run's wall time from process start (full: 330 s, so the
run with a cold start fits 6 minutes).  A section or row whose usual cost no longer fits is
skipped with a note; a running row, or the child pytest, is stopped at its limit and recorded
as an error; every section runs in its own try; at the budget plus a grace period a watchdog
writes the files and ends the process.  Works on any torch convlower supports (config keys
missing in a torch are noted, not fatal; without convlower's entry point installed the
backend is registered for this process and its children).  ``--quick``: tiny sizes, the tests
alongside the perf rows, on CPU in about two minutes (``tests/test_device_check.py``); its
figures mean nothing.  Exit status: 0 when every test passed and every variant ran.
"""
from __future__ import annotations

import time

PROCESS_T0 = time.perf_counter()  # the budget counts the imports too

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform as _platform  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (REPO, HERE):  # convlower from this tree; the sibling bench modules
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from device_check_report import markdown, summary_line, table_row  # noqa: E402,F401
from device_check_tests import finish_tests, parse_junit, parse_verbose, start_tests  # noqa: E402,F401

try:
    import convlower
    from convlower import selection
    from convlower.device import device_name, platform as device_platform, sync
    from convlower.tools.device_timing import clock_for, time_interleaved
    IMPORT_ERROR = None
except Exception:  # recorded in the files; the run still writes them
    IMPORT_ERROR = traceback.format_exc()

SCHEMA = 1
PINNED_TORCH = "2.13.0"
SECTIONS = ("patch_embed", "tests", "conv3d", "wan_vae", "snake", "regions")
# regions compiles a large UNet three times: a run of its own (bench/device_run.sh)
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "regions")
RESERVE_S = 8.0  # kept back at the end for writing the files

PLANS = {
    "full": dict(patches=8192, patch_cases=[("bf16", False), ("fp32", False), ("bf16", True),
                                            ("fp32", True)],
                 conv3d_dtype="bf16", conv3d_max_rules=None,
                 conv3d_shapes=["wan192", "wan384", "wan_time", "mochi", "wan96", "dit_patch"],
                 snake_frames=8, zoo_model="mochi-downsample", zoo_size="small",
                 rounds=7, warmup=3, min_sample_s=0.02, budget_s=330.0, tests_timeout_s=170.0,
                 grace_s=30.0, diagnose_all=True,
                 # a row starts only if its usual cost fits; it is stopped at its limit
                 row_cost_s=dict(tests=60, patch_embed=12, conv3d=25, wan_vae=90, snake=80,
                                 regions=240),
                 row_limit_s=dict(patch_embed=90, conv3d=100, wan_vae=180, snake=150,
                                  regions=520)),
    # quick: CPU conv3d backward in bf16 takes seconds even on 8 patches: fp32 there
    "quick": dict(patches=8, patch_cases=[("fp32", True), ("bf16", False)],
                  conv3d_dtype="bf16", conv3d_shapes=["mochi"], conv3d_max_rules=1,
                  snake_frames=1, zoo_model="mochi-downsample", zoo_size="tiny",
                  rounds=3, warmup=1, min_sample_s=0.002, budget_s=600.0, tests_timeout_s=400.0,
                  grace_s=60.0, diagnose_all=False, row_cost_s={}, row_limit_s={}),
}


class RowTimeout(BaseException):
    """Raised in the main thread when a row overruns its limit (a BaseException, so the
    ``except Exception`` of the code under test cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise RowTimeout after ``seconds`` (SIGALRM; main thread only, else no limit)."""
    usable = seconds is not None and hasattr(signal, "setitimer") and \
        threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def fire(signum, frame):
        raise RowTimeout(f"stopped at its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.5, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------ environment
def environment(device: torch.device, clock) -> dict:
    env = {"device": str(device), "device_name": str(device), "torch": torch.__version__,
           "pinned_torch": PINNED_TORCH, "cuda": torch.version.cuda, "hip": torch.version.hip,
           "python": _platform.python_version(), "threads": torch.get_num_threads(),
           "clock": getattr(clock, "kind", "?"), "host": _platform.node(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with contextlib.suppress(Exception):
        env["device_name"] = device_name(device)
        env["platform"] = device_platform("auto", device)
        env["convlower"] = convlower.__version__
    for mod in ("triton", "diffusers", "transformers"):
        with contextlib.suppress(Exception):
            env[mod] = __import__(mod).__version__
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            props = torch.cuda.get_device_properties(device)
            env.update(gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       cudnn=torch.backends.cudnn.version(),
                       cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                       matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                       cudnn_benchmark=torch.backends.cudnn.benchmark)
    return env


def set_config(notes: list, module, value, *names) -> None:
    """``module.<first existing name> = value``; a torch without any of them gets a note."""
    for name in names:
        try:
            if hasattr(module, name):
                setattr(module, name, value)
                return
        except Exception as e:
            notes.append(f"config {name} = {value!r} failed on torch {torch.__version__}: {e}")
            return
    notes.append(f"config {'/'.join(names)} not in torch {torch.__version__}: left as it is")


def ensure_backend(notes: list) -> None:
    """``backend="convlower"`` by name without an installed entry point: a dist-info folder
    with the entry point, on this process's path and its children's PYTHONPATH, and (the
    registry may have looked already) a registration in this process."""
    try:
        torch._dynamo.lookup_backend("convlower")
        return
    except Exception:
        pass
    site = tempfile.mkdtemp(prefix="device-check-entry-point-")
    info = os.path.join(site, "convlower-0+tree.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: convlower\nVersion: 0+tree\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[torch_dynamo_backends]\nconvlower = convlower.backend.compiler:convlower_backend\n")
    sys.path.append(site)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH"), site) if p)
    try:
        from torch._dynamo.backends.registry import register_backend

        register_backend(name="convlower")(convlower.convlower_backend)
    except Exception as e:
        notes.append(f"could not register backend 'convlower': {type(e).__name__}: {e}")
    notes.append("convlower is not installed here: its entry point was provided for this run "
                 f"({info})")


# ------------------------------------------------------------------------------ the run
class Check:
    """The run's state: plan, device, clock, deadline, results; writes the files often."""

    def __init__(self, args, plan: dict):
        self.args, self.plan = args, plan
        self.device = torch.device(args.device)
        self.budget_s = args.budget_s or plan["budget_s"]
        self.deadline = PROCESS_T0 + self.budget_s
        self.out = args.out
        self.lock = threading.RLock()
        self.tests_proc = None  # the child pytest, for the watchdog
        self.current_row: dict | None = None  # compare() fills its variants as they finish
        self.results = {
            "schema": SCHEMA, "quick": args.quick, "command": " ".join(sys.argv),
            "budget_s": self.budget_s, "environment": {"device": str(self.device)},
            "timing": {}, "tests": {"status": "not run"}, "compile": {"status": "not run"},
            "perf": {"rows": []}, "diagnosis": {}, "failures": [], "notes": [], "wall_s": None,
        }
        self.clock = None
        if IMPORT_ERROR is None:
            self.clock = clock_for(self.device, args.clock)
            self.results["timing"] = {
                "clock": getattr(self.clock, "kind", "?"), "rounds": plan["rounds"],
                "warmup_calls": plan["warmup"], "min_sample_s": plan["min_sample_s"],
                "statistic": "median over interleaved rounds; a variant with any timing <= 0 "
                             "(or implausible) is rejected"}
        try:
            self.results["environment"] = environment(self.device, self.clock)
        except Exception as e:
            self.fail(f"environment: {type(e).__name__}: {e}")

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[device_check {time.perf_counter() - PROCESS_T0:6.1f} s] {msg}", flush=True)

    def fail(self, msg: str) -> None:
        self.results["failures"].append(msg)

    def note(self, msg: str) -> None:
        self.results["notes"].append(msg)

    def write(self) -> None:
        with self.lock:
            self.results["wall_s"] = round(time.perf_counter() - PROCESS_T0, 2)
            os.makedirs(self.out, exist_ok=True)
            tmp = os.path.join(self.out, "device_check.json.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.results, f, indent=1, default=str)
            os.replace(tmp, os.path.join(self.out, "device_check.json"))
            text = markdown(self.results)
            with open(os.path.join(self.out, "device_check.md"), "w", encoding="utf-8") as f:
                f.write(text)
            return text

    def fits(self, section: str, what: str) -> bool:
        """Whether a row of ``section`` (usual cost in the plan) still fits the budget."""
        need = self.plan["row_cost_s"].get(section, 0.0)
        left = self.remaining() - RESERVE_S
        if left >= max(need, 1.0):
            return True
        self.note(f"{what}: skipped, needs ~{need:.0f} s, {max(left, 0):.0f} s of the "
                  f"{self.budget_s:.0f} s budget left")
        return False

    def limit(self, section: str) -> float:
        cap = self.plan["row_limit_s"].get(section)
        left = self.remaining() - RESERVE_S
        return max(1.0, min(cap, left) if cap else left)

    def bounded(self, fn, seconds=None) -> BaseException | None:
        """Run ``fn`` (within ``seconds`` if given); an exception or an overrun is returned."""
        try:
            with time_limit(seconds):
                fn()
        except (Exception, RowTimeout) as e:
            return e
        return None

    # -- one perf row: budget, limit, isolation, bookkeeping
    def row(self, section: str, case: str, dtype: str, mode: str, build) -> None:
        row = {"section": section, "case": case, "dtype": dtype, "pass": mode}
        what = f"{section} {case} {dtype} {mode}"
        if not self.fits(section, what):
            row["skipped"] = f"time budget ({self.budget_s:.0f} s) spent"
        else:
            self.log(f"{section}: {case} {dtype} {mode} (limit {self.limit(section):.0f} s)")
            t0 = time.perf_counter()
            self._reset()
            self.current_row = row   # a row stopped at its limit keeps the variants it finished
            err = self.bounded(lambda: row.update(build()), self.limit(section))
            self.current_row = None
            if err is not None:
                row["error"] = f"{type(err).__name__}: {err}"[:2000]
                row["traceback"] = "".join(traceback.format_exception(err))[-4000:]
                self.fail(f"{what}: {row['error']}")
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            with contextlib.suppress(Exception):
                self._reset()
            for name, v in row.get("variants", {}).items():
                if v.get("error"):
                    self.fail(f"{what} [{name}]: {v['error']}")
                elif v.get("rejected"):
                    self.note(f"{what} [{name}]: timing rejected: {v['rejected']}")
            self.log("  " + summary_line(row))
        self.results["perf"]["rows"].append(row)
        self.write()

    def _reset(self) -> None:
        torch._dynamo.reset()
        convlower.reset_report()
        selection.clear_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def diagnose(self, key: str, fn) -> None:
        """Extra facts about a row (inside its time limit); an error is kept, not raised."""
        t0 = time.perf_counter()
        try:
            d = fn()
        except Exception as e:
            d = {"error": f"{type(e).__name__}: {e}"[:1000]}
        d["wall_s"] = round(time.perf_counter() - t0, 2)
        self.results["diagnosis"][key] = d

    # -- timing a set of variants
    def compare(self, fns: dict, rounds: int | None = None,
                min_sample_s: float | None = None) -> dict:
        """Run each variant once (its compile: seconds and convlower's report are kept), then
        time all of them interleaved (``rounds``, ``min_sample_s``: the plan's unless given).
        The variants go into the running row as they finish, so a row stopped at its limit
        keeps the first calls it made."""
        row = self.current_row if self.current_row is not None else {}
        variants = row.setdefault("variants", {})
        for name, fn in fns.items():
            variants[name] = self._first_call(name, fn)
        live = {k: f for k, f in fns.items() if "error" not in variants[k]}
        timings = time_interleaved(live, clock=self.clock,
                                   rounds=rounds or self.plan["rounds"],
                                   warmup=self.plan["warmup"],
                                   min_sample_s=min_sample_s or self.plan["min_sample_s"])
        for name, t in timings.items():
            variants[name].update(t.to_dict())
        return variants

    def _first_call(self, name: str, fn) -> dict:
        convlower.reset_report()
        info = {}
        t0 = time.perf_counter()
        try:
            fn()
            sync(self.device)
            info["first_call_s"] = round(time.perf_counter() - t0, 3)
            rep = convlower.report()
            convs = list(rep.convolutions)
            if convs:
                info["chose"] = dict(collections.Counter(
                    f"{c.phase}:{c.rule or 'original'}" for c in convs))
                info["decided_by"] = dict(collections.Counter(c.how or "?" for c in convs))
                failed = sorted({c.reason[:300] for c in convs if "failed" in (c.reason or "")})
                if failed:
                    info["decision_problems"] = failed
                    self.results["notes"].extend(f"[{name}] {r}" for r in failed)
            if rep.snake:
                info["snake_routes"] = dict(collections.Counter(s.route for s in rep.snake))
            parts = list(getattr(rep, "regions", ()))
            if parts:  # "compiled", "reused", "runs as is", "compiled whole"
                info["region_parts"] = dict(collections.Counter(
                    r.how.split(":")[0].split(" (")[0] for r in parts))
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"[:1000]
        return info


def watchdog(check: Check) -> threading.Timer:
    """At the budget plus the grace period: stop the child pytest, write the files, exit 3."""
    def fire():
        with contextlib.suppress(Exception):
            check.fail(f"hard stop: the run passed its budget ({check.budget_s:.0f} s) by "
                       f"{check.plan['grace_s']:.0f} s; what ran is in the files")
            if check.tests_proc is not None and check.tests_proc.poll() is None:
                os.killpg(check.tests_proc.pid, 9)
            print(check.write(), flush=True)
        os._exit(3)

    delay = max(1.0, check.remaining() + check.plan["grace_s"])
    t = threading.Timer(delay, fire)
    t.daemon = True
    t.start()
    return t


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", default="auto",
                    help="cuda, cuda:N, cpu, or auto (a GPU if there is one, else cpu)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, reduced grid (CPU CI)")
    ap.add_argument("--out", default="device-check-out", help="folder for the JSON + markdown")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated, run in this order; any of {','.join(SECTIONS)} "
                         f"(default: all but regions)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for the whole run from process start (full 330, quick "
                         "600): rows that would overrun are skipped, a running row stopped")
    ap.add_argument("--zoo-model", default=None, help="zoo model for cold/warm compile times")
    ap.add_argument("--serial", action="store_true",
                    help="with --quick: run the gpu tests before the perf rows, not alongside")
    ap.add_argument("--clock", default="auto", choices=["auto", "events", "wall"])
    ap.add_argument("--inductor-cache", default=None,
                    help="Inductor cache dir: 'fresh' (a new temp dir, cold compiles: the "
                         "default on a GPU), 'default' (torch's; the default with --quick), "
                         "or a path")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.section_list = [s for s in args.sections.split(",") if s]
    bad = [s for s in args.section_list if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; valid: {', '.join(SECTIONS)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    return args


def configure(check: Check) -> str:
    """Caches and Dynamo settings for the run; returns the decision cache folder."""
    args, notes = check.args, check.results["notes"]
    cache = args.inductor_cache or ("default" if args.quick else "fresh")
    if cache == "fresh":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="device-check-inductor-")
    elif cache != "default":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)
    check.results["environment"]["inductor_cache"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                                   "torch default")
    # Every graph really compiles, so convlower's pass runs and reports what it chose (a graph
    # served from the FX graph cache runs no pass); compiled kernels are still reused.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    set_config(notes, inductor_config, False, "fx_graph_cache")
    set_config(notes, functorch_config, False, "enable_autograd_cache")
    set_config(notes, torch._dynamo.config, 64, "recompile_limit", "cache_size_limit")
    set_config(notes, torch._dynamo.config, False, "automatic_dynamic_shapes")
    if torch.__version__.split("+")[0] != PINNED_TORCH:
        notes.append(f"torch {torch.__version__}, not the pinned {PINNED_TORCH}")
    ensure_backend(notes)
    decisions = tempfile.mkdtemp(prefix="device-check-decisions-")
    selection.set_cache_dir(decisions)  # cold: selection really decides
    return decisions


def run_sections(check: Check) -> None:
    from device_check_rows import RUNNERS

    sections = check.args.section_list
    overlap = check.args.quick and not check.args.serial
    check.results["tests_alongside_perf"] = overlap
    tests = None
    if "tests" in sections and overlap:
        tests = start_tests(check)
    for name in sections:
        if name == "tests":
            if not overlap and check.fits("tests", "gpu tests"):
                err = check.bounded(lambda: finish_tests(check, start_tests(check)),
                                    check.remaining() - RESERVE_S)
                if err is not None:
                    check.fail(f"section tests: {type(err).__name__}: {err}")
            continue
        err = check.bounded(lambda: RUNNERS[name](check))  # rows are bounded one by one
        if err is not None:  # a broken section is reported; the next one still runs
            check.fail(f"section {name}: {type(err).__name__}: {err}")
            check.results.setdefault("tracebacks", {})[name] = \
                "".join(traceback.format_exception(err))[-4000:]
        check.write()
    if tests is not None:
        finish_tests(check, tests)


def main(argv=None) -> int:
    args = parse_args(argv)
    check = Check(args, dict(PLANS["quick" if args.quick else "full"]))
    check.results["sections"] = args.section_list
    check.log(f"device {check.results['environment'].get('device_name')}, torch "
              f"{torch.__version__}, {'quick' if args.quick else 'full'} plan, budget "
              f"{check.budget_s:.0f} s, out {args.out}")
    if IMPORT_ERROR is not None:
        check.fail(f"import convlower failed on torch {torch.__version__}: "
                   f"{IMPORT_ERROR.strip().splitlines()[-1]}")
        check.results["tracebacks"] = {"import": IMPORT_ERROR[-4000:]}
        print(check.write(), flush=True)
        return 1
    timer = watchdog(check)
    decisions = None
    try:
        decisions = configure(check)
        check.write()
        run_sections(check)
    except BaseException as e:  # noqa: B902 (the files are written whatever happened)
        check.fail(f"run: {type(e).__name__}: {e}")
        check.results.setdefault("tracebacks", {})["run"] = traceback.format_exc()[-4000:]
    finally:
        timer.cancel()
        text = check.write()
        if decisions:
            import shutil

            shutil.rmtree(decisions, ignore_errors=True)
    print(text, flush=True)
    return 1 if check.results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
