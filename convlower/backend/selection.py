"""Which eligible rule (if any) lowers a convolution.  See docs/selection.md.

``measure`` (the default): time the original convolution and each candidate on the real
device, dtype and layout, switch only for a clear win, cache the decision on disk
(:mod:`convlower.backend.measure`).  The only mode that can promise "never slower".
``heuristic``: a static table of where each rule is known to win (:func:`heuristic_ok`), no
timing.  ``always``: the first eligible rule in priority order (for experiments and tests).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..lowerings.rule import ConvCall, Rule


def detect_platform(call: ConvCall, platform: str = "auto") -> str:
    """"hip", "cuda" or "cpu" for the call's device; ``platform`` other than "auto" wins."""
    if platform != "auto":
        return platform
    if call.x.device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return "cpu"


def heuristic_ok(rule: Rule, call: ConvCall, platform: str = "auto") -> tuple[bool, str]:
    """Static knowledge of where a rule wins.  Returns (use it?, why).

    Figures are eager ratios on a 2-core CPU (original time / rule time), see docs/selection.md.
    """
    plat = detect_platform(call, platform)
    if rule.name == "patch_linear":
        return True, "one output position: a single matrix product (3-4x on CPU)"
    if rule.name == "patchify_mm":
        if call.ndim == 3:
            return False, "3-D patch convs lose as patches + mm (0.56-0.93x fp32 on CPU)"
        return True, "1-D/2-D patch or pointwise conv as patches + mm"
    if rule.name == "time_fold_conv2d":
        if call.kernel[0] >= 2:
            return True, "disjoint temporal windows folded into channels (1.25x fp32 on CPU)"
        return False, "kT == 1 (time into batch) is not a reliable win"
    if rule.name == "time_unfold_conv2d":
        if plat == "hip":
            return True, "MIOpen picks slow kernels for 3-D convs; batched conv2d is the remedy"
        return False, f"general Conv3d rewrite is often a loss on {plat} (0.4-1.2x)"
    if rule.name == "time_sum_conv2d":
        return False, "memory-lean, rarely faster: only by measurement or select=always"
    return False, "no static knowledge about this rule"


def choose(call: ConvCall, candidates: list[Rule], select: str, *, phase: str = "forward",
           output_mask: Optional[Sequence[bool]] = None, compute_dtype: Optional[str] = None,
           platform: str = "auto", produced: bool = True, consumed: bool = True
           ) -> tuple[Optional[Rule], str, dict]:
    """Return (rule or None, why, timings in seconds by "aten" / rule name).

    ``produced``: the conv's activation (forward) or gradient (backward) is made by an op of
    the same graph (its layout is Inductor's choice), not a graph input; ``consumed``: the
    forward output is read by an op of the graph rather than returned or saved."""
    if not candidates:
        return None, "no rule is eligible", {}
    if select == "always":
        return candidates[0], "forced (select=always)", {}
    if select == "heuristic":
        whys = []
        for rule in candidates:
            ok, why = heuristic_ok(rule, call, platform)
            if ok:
                return rule, f"heuristic: {why}", {}
            whys.append(f"{rule.name}: {why}")
        return None, "heuristic: " + "; ".join(whys), {}
    from .measure import choose_by_measurement

    return choose_by_measurement(call, candidates, phase=phase, output_mask=output_mask,
                                 compute_dtype=compute_dtype, produced=produced,
                                 consumed=consumed)
