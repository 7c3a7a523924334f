"""Fuzz every rule against eager PyTorch on random convolutions (default 5,000 examples).

    .venv/bin/python bench/fuzz.py [--examples 5000] [--select heuristic] [--json out.json]

Uses the generator and checker of ``convlower.tools.conv_fuzz`` (hypothesis; each rule run
the way the graph pass runs it: proof, then the forward and backward decompositions, on real
tensors, against a float64 eager reference).  Prints how many convolutions were tried, how
many each rule accepted (and how many the default selection lowered), and how many mismatched.
Exit status 1 if any mismatched.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch
from hypothesis import HealthCheck, Phase, given, settings

from convlower.lowerings import RULES
from convlower.tools import conv_fuzz as P


def fuzz(examples: int = 5000, select=None, transposed_share: int = 10) -> dict:
    """Run ``examples`` random convolutions; every ``transposed_share``-th one is transposed."""
    stats = {"tried": 0, "transposed": 0, "transposed_lowered": 0, "eligible": collections.Counter(),
             "selected": collections.Counter(), "mismatches": 0, "mismatch_examples": [],
             "by_dtype": collections.Counter(), "by_ndim": collections.Counter()}

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(P.conv_cases(), P.conv_cases(transposed=True))
    def one(case, tcase):
        stats["tried"] += 1
        if stats["tried"] % transposed_share == 0:
            stats["transposed"] += 1
            stats["transposed_lowered"] += bool(P.check_case(tcase)["eligible"])
            return
        stats["by_dtype"][case.dtype] += 1
        stats["by_ndim"][case.nd] += 1
        res = P.check_case(case, select)
        stats["eligible"].update(res["eligible"])
        if res["selected"]:
            stats["selected"][res["selected"]] += 1
        if res["mismatches"]:
            stats["mismatches"] += 1
            if len(stats["mismatch_examples"]) < 10:
                stats["mismatch_examples"].append({"case": repr(case), "why": res["mismatches"]})

    torch.set_num_threads(max(1, torch.get_num_threads()))
    one()
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--select", default=None, help="selection mode for 'selected' (default: the default)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    s = fuzz(a.examples, a.select)
    took = time.perf_counter() - t0
    print(f"tried {s['tried']} convolutions in {took:.0f} s "
          f"({s['tried'] - s['transposed']} plain, {s['transposed']} transposed)")
    print(f"  by ndim: {dict(sorted(s['by_ndim'].items()))}  by dtype: {dict(s['by_dtype'])}")
    print(f"transposed convolutions accepted by any rule: {s['transposed_lowered']} (must be 0)")
    print("per rule: accepted by its proof (each accepted case run fwd+bwd vs eager) / "
          "lowered by the default selection")
    for name in RULES:
        print(f"  {name:20s} {s['eligible'][name]:6d} / {s['selected'][name]:6d}")
    print(f"mismatches: {s['mismatches']}")
    for m in s["mismatch_examples"]:
        print("  ", m["case"], "->", m["why"])
    if a.json:
        out = {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in s.items()}
        out["seconds"] = took
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if s["mismatches"] or s["transposed_lowered"] else 0


if __name__ == "__main__":
    sys.exit(main())
