"""Pass step: fold a zero ``constant_pad_nd`` that feeds a convolution into its padding.

Wan's causal convs pad this way.  The symmetric part of the pad per spatial dim joins the
conv's own padding, so a lowered conv pads inside its conv2d instead of reading a
materialised padded copy; an asymmetric leftover stays a ``constant_pad_nd`` in front of the
lowered conv (:class:`convlower.lowerings.site.PadFold`).  The graph is not changed here:
the fold is applied when a rule's emission is spliced, and dropped with it if no rule is.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import torch_internals as ti
from ..lowerings.rule import ConvCall
from ..lowerings.site import PadFold

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Folded:
    source: torch.fx.Node  # the pad's input: what the lowered conv reads
    fold: PadFold
    call: ConvCall         # the convolution with the folded padding, on the leftover-padded input


def fold_pad(node: torch.fx.Node) -> Optional[Folded]:
    """The fold for the ``aten.convolution`` ``node``, or None when its input is not a zero
    pad with a symmetric part to fold."""
    pad = node.args[0]
    if not (isinstance(pad, torch.fx.Node) and pad.target is aten.constant_pad_nd.default):
        return None
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
    pads = list(pad.args[1])
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0)
    nd = vals[1].dim() - 2
    if value != 0 or vals[6] or len(pads) > 2 * nd or \
            not all(isinstance(p, int) and p >= 0 for p in pads):
        return None  # a non-zero value, a transposed conv, padded batch/channels, SymInt pads
    pads += [0] * (2 * nd - len(pads))
    padding = list(ConvCall.from_args(vals).padding)
    rest = list(pads)
    for d in range(nd):  # F.pad order: last dim first, (before, after) each
        i = 2 * (nd - 1 - d)
        both = min(pads[i], pads[i + 1])
        padding[d] += both
        rest[i] -= both
        rest[i + 1] -= both
    if rest == pads:
        return None
    x = pad.args[0].meta["val"]
    if any(rest):
        with ti.in_fake_mode_of([x]):
            x = aten.constant_pad_nd(x, rest)
    call = ConvCall.from_args([x, vals[1], vals[2], vals[3], padding, *vals[5:9]])
    return Folded(pad.args[0], PadFold(tuple(pads), tuple(rest) if any(rest) else None), call)
