"""The benches' one harness for fresh-process compile timing.

A cold compile is timed in a fresh process on an Inductor cache that holds nothing of any
model.  It does hold what a machine keeps once it has run Inductor and convlower at all: the
CPU vector-ISA probe (Inductor builds a small library per ISA the first time it meets a cache
folder, about 9 s on the 2-core bench machine) and convlower's record that those libraries
load here (torch_caches.remember_vec_isa_probe).  Inductor still loads each library in a
child Python in every process (1.4 s), convlower not once it has that record.  The build is
paid once per machine, by every backend alike, not once per model; counted in every cold
compile it hid a tenth to a third of the difference between the plans.  ``machine_seconds()``
says what it cost, and the benches print it beside their tables.

    from fresh_process import new_cache, run_worker
    cache = new_cache(root)                  # an empty per-model cache on a machine seen before
    res = run_worker([sys.executable, HERE, "--worker", ...], {"TORCHINDUCTOR_CACHE_DIR": cache})
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_PROBE = ("import convlower.backend.compiler; from convlower import torch_caches as t; "
          "assert t.probe_vec_isa_ahead(); t.wait_for_probe_ahead()")
_MACHINE: dict = {}


def _bytecode() -> None:
    """convlower's modules compiled to bytecode once, as installing a package does (torch's come
    compiled in its wheel): where ``PYTHONDONTWRITEBYTECODE`` is set (this machine) every
    process compiled convlower's sources again, 0.1 s of each cold compile that Inductor's
    never pays.  Python reads the files even where it does not write them."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("convlower")
    if spec is not None and spec.origin:
        compileall.compile_dir(os.path.dirname(spec.origin), quiet=1)


def _template() -> str:
    """A cache folder with only the machine's ISA probe in it, made once per bench run."""
    if "dir" not in _MACHINE:
        _bytecode()
        folder = tempfile.mkdtemp(prefix="bench-machine-cache-")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", _PROBE], check=True,
                       env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=folder))
        _MACHINE.update(dir=folder, seconds=time.perf_counter() - t0)
    return _MACHINE["dir"]


def machine_seconds() -> float | None:
    """What the once-per-machine ISA probe cost (a whole process), or None before any cache."""
    return _MACHINE.get("seconds")


def new_cache(path: str | None = None) -> str:
    """An Inductor cache folder at ``path`` (a new temporary one when None) holding nothing but
    the machine's ISA probe: a cold cache for any model."""
    path = path or tempfile.mkdtemp(prefix="bench-cache-")
    if os.path.exists(path):
        shutil.rmtree(path)
    shutil.copytree(_template(), path)
    return path


def machine_line() -> str:
    s = machine_seconds()
    return ("" if s is None else
            f"cold = an empty Inductor cache on a machine that has run Inductor and convlower "
            f"once (the vector-ISA probe's libraries and convlower's record that they load "
            f"here, {s:.1f} s once per machine, are not in any cold figure)")


def run_worker(cmd: list[str], env: dict, timeout: float | None, marker: str = "") -> dict:
    """Run a worker process with ``env`` over the current environment (a None value removes
    the variable); its result is the JSON on the last stdout line (starting with ``marker``),
    or ``{"error": ...}`` with the last line of its stderr, or the time limit it passed."""
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    try:
        p = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout} s limit"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(marker) and ln.strip()]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(lines[-1][len(marker):])
