"""A convolution site: one convolution node of a graph, as selection, emission and the report
see it.  Built once by the pass (backend/sites.py) and passed along whole.

The emission computes on :attr:`ConvSite.inputs` (fake tensors in the pass, real ones in a
measurement) and must produce :attr:`ConvSite.output`'s sizes, dtype and strides:

* forward: ``(x, weight[, bias])`` -> the conv's output, where ``x`` is the input of a folded
  ``constant_pad_nd`` when there is one (:class:`PadFold`);
* backward: ``(grad_out, x, weight)`` -> ``(grad_x, grad_weight, grad_bias)``, each None where
  :attr:`ConvSite.output_mask` does not ask for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .rule import ConvCall


@dataclasses.dataclass(frozen=True)
class PadFold:
    """A zero ``constant_pad_nd`` feeding the convolution, folded into its padding: the
    symmetric part per spatial dim joined the conv's own padding, ``rest`` (F.pad order) is
    applied before the lowered conv (None when nothing is left)."""

    pads: tuple[int, ...]
    rest: Optional[tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class ConvSite:
    call: ConvCall                # as the rules see it (padding after folding)
    original: ConvCall            # the node's own arguments (what the original computes)
    phase: str                    # "forward" | "backward"
    graph: str                    # the graph's name in the report
    node: str                     # the node's name
    inputs: tuple                 # values the emission takes (see the module docstring)
    output: Any                   # the node's value(s): sizes, dtype and strides to produce
    output_mask: Optional[tuple[bool, bool, bool]] = None  # backward: wanted gradients
    pad_fold: Optional[PadFold] = None
    input_produced: bool = True   # activation / gradient made by an op of this graph
    output_consumed: bool = True  # forward output read by an op of this graph
    layout_opt: bool = False      # Inductor runs this graph's 2-D convs channels-last

    @property
    def backward(self) -> bool:
        return self.phase == "backward"


def site_of_call(call: ConvCall, phase: str = "forward", output_mask=None, *,
                 graph: str = "-", node: str = "-", input_produced: bool = True,
                 output_consumed: bool = True, layout_opt: bool = False) -> ConvSite:
    """A site for a bare call (no graph): tests, benchmarks and tools time or lower a call
    without compiling a model.  ``call``'s tensors (real, fake or meta) give the sizes."""
    import torch

    params = (list(call.stride), list(call.padding), list(call.dilation), call.transposed,
              list(call.output_padding), call.groups)
    x, w = call.x, call.weight
    b = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if call.has_bias else None
    meta = lambda t: None if t is None else torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype, device="meta")
    out = torch.ops.aten.convolution(meta(x), meta(w), meta(b), *params)
    if phase == "forward":
        return ConvSite(call, call, phase, graph, node, (x, w, b) if b is not None else (x, w),
                        out, None, None, input_produced, output_consumed, layout_opt)
    mask = tuple(bool(m) for m in (output_mask or (True, True, call.has_bias)))
    grad = torch.empty(out.shape, dtype=x.dtype, device=x.device)
    outs = tuple(v if m else None for v, m in zip((meta(x), meta(w), meta(b)), mask))
    return ConvSite(call, call, phase, graph, node, (grad, x, w), outs, mask, None,
                    input_produced, False, layout_opt)
