"""Regenerate the figures of docs/reliability.md in one command.

    .venv/bin/python bench/reliability_figures.py [--examples 5000] > /tmp/reliability.txt

Prints (markdown): the fuzz run (configurations tried, per-rule accepted / lowered counts,
mismatches), the fault-injection table (faults injected, survived: result equal eager, report
says why, one warning), and recompile counts of the dynamic suite under convlower and under
stock Inductor (dynamic=True and mark_dynamic; each run in its own interpreter).
"""
from __future__ import annotations

import argparse
import logging
import sys

import torch

import fuzz  # bench/fuzz.py: the script's own folder is on sys.path
from convlower.lowerings import RULES
from convlower.tools import reliability as R


class _Patch:
    """A minimal monkeypatch (setattr + undo) for running the fault scenarios outside pytest."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self.undo.append((obj, name, had, old))

    def close(self):
        for obj, name, had, old in reversed(self.undo):
            setattr(obj, name, old) if had else delattr(obj, name)


def faults_table() -> list[str]:
    import convlower
    from convlower.backend import conv_pass as graph_pass

    torch._inductor.config.force_disable_caches = True
    rows = ["| fault injected into `patchify_mm` | convs fell back | result = eager | report says why | warnings |",
            "|---|---|---|---|---|"]
    for fault, (_, _, expected) in R.FAULTS.items():
        patch = _Patch()
        graph_pass._warned.clear()
        seen = []
        handler = logging.Handler()
        handler.emit = lambda r: seen.append(r.getMessage())
        logging.getLogger("convlower").addHandler(handler)
        convlower.reset_report()
        try:
            R.inject(patch, fault)
            res = R.run_with_fault(fault)
            why = [r for r in res["records"] if expected in r["reason"]]
            rows.append(f"| {fault} | {len(why)} | {'yes' if res['max_error'] < 1e-5 else 'NO'} | "
                        f"{'yes' if why else 'NO'} | {sum(expected in m for m in seen)} |")
        except Exception as e:  # a fault that breaks the compile is the failure this measures
            rows.append(f"| {fault} | - | compile BROKE: {type(e).__name__} | - | - |")
        finally:
            patch.close()
            logging.getLogger("convlower").removeHandler(handler)
    return rows


def dynamic_table() -> list[str]:
    rows = ["| backend | how | shapes | compiles | recompiles | max error | lowered | fallbacks | crashed |",
            "|---|---|---|---|---|---|---|---|---|"]
    for backend in ("inductor", "convlower"):
        for how in ("dynamic=True", "mark_dynamic"):
            # rules forced, as in the test: the figure is about the lowered forms
            r = R.dynamic_suite_in_subprocess(backend, how, options={"select": "always"})
            if "crashed" in r:
                rows.append(f"| {backend} | {how} | {len(R.DYNAMIC_SHAPES)} | - | - | - | - | - | "
                            f"yes (exit {r['crashed']}) |")
                continue
            lowered = sum(r["lowered"].values())
            rows.append(f"| {backend} | {how} | {r['shapes']} | {r['compiles']} | {r['recompiles']} | "
                        f"{r['max_error']:.1e} | {lowered} | {len(r['fallbacks'])} | no |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--skip-dynamic", action="store_true")
    a = ap.parse_args(argv)
    s = fuzz.fuzz(a.examples)
    print(f"## Fuzz ({s['tried']} convolutions: {s['tried'] - s['transposed']} plain, "
          f"{s['transposed']} transposed)\n")
    print(f"by ndim {dict(sorted(s['by_ndim'].items()))}, by dtype {dict(s['by_dtype'])}\n")
    print("| rule | accepted by its proof (run fwd+bwd vs eager) | lowered by default selection |")
    print("|---|---|---|")
    for name in RULES:
        print(f"| {name} | {s['eligible'][name]} | {s['selected'][name]} |")
    print(f"\nmismatches: **{s['mismatches']}**; transposed convs accepted: "
          f"**{s['transposed_lowered']}**\n")
    for m in s["mismatch_examples"]:
        print(f"- {m['case']}: {m['why']}")
    print("## Fault injection\n")
    print("\n".join(faults_table()))
    if not a.skip_dynamic:
        print("\n## Dynamic shapes (recompiles)\n")
        print("\n".join(dynamic_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
