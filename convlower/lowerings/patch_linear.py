"""patch_linear: a convolution with one output position per sample is a matrix product.

Identity.  If the kernel covers the whole zero-padded input in every spatial dim
(``size_d + 2*padding_d == kernel_d``), the single output position sees every input element
exactly once, so ``out[n, o] = bias[o] + sum_{c, i} x[n, c, i] * w[o, c, i + padding]``: the
flattened input times the flattened weight, cropped to the window over real input (the cropped
border only ever multiplies padding zeros).  Stride is irrelevant (one position).

Conditions.  Not transposed; groups == 1; per spatial dim: ``size + 2*padding == kernel`` and
(dilation == 1 or kernel == 1).

Emission.  ``addmm(bias, x.reshape(N, -1), w_cropped.reshape(O, -1).T).view(N, O, 1, ..., 1)``.
The flatten of ``x`` is a view when ``x`` is contiguous (its batch size may be symbolic); when
``x`` is dense in another dim order (channels-last) and the weight is the smaller tensor, both
are flattened in ``x``'s order (the weight copied, ``x`` a view); otherwise ``x`` is copied.
This is the Qwen2.5-VL / Qwen3-VL patch embedding (input ``[patches, 3, 2, 14, 14]``).
"""
from __future__ import annotations

import sympy
import torch

from .dense import dense, dense_order
from .rule import Condition, ConvCall, Rule, common_conditions


class PatchLinear(Rule):
    name = "patch_linear"
    summary = "kernel covers the whole (padded) input: flatten + mm"

    def conditions(self, c: ConvCall) -> list[Condition]:
        conds = common_conditions(c) + [Condition("groups == 1", sympy.Eq(c.groups, 1))]
        for d in range(c.ndim):
            k, p, dl = c.kernel[d], c.padding[d], c.dilation[d]
            conds.append(Condition(f"size[{d}] + 2*padding[{d}] == kernel[{d}]",
                                   sympy.Eq(c.in_size(d) + 2 * p, k)))
            conds.append(Condition(f"dilation[{d}] == 1 or kernel[{d}] == 1",
                                   sympy.sympify(dl == 1 or k == 1)))
        return conds

    def emit(self, c, x, weight, bias):
        n, out_ch = x.shape[0], weight.shape[0]
        # The proven size is kernel - 2*padding; using the int keeps the emission static.
        window = tuple(slice(p, k - p) for k, p in zip(c.kernel, c.padding))
        w = weight[(slice(None), slice(None)) + window]
        order = dense_order(x)
        if order is not None and _numel(w) < _numel(x):
            # x is dense in another dim order (channels-last): flatten it in that order, a view,
            # and copy the smaller weight into the same order instead of copying x.
            x, w = x.permute(order), w.permute(order)
            flat_w = dense(w).view(out_ch, -1)
        else:
            flat_w = w.reshape(out_ch, -1)
        # An explicit dense copy, not reshape: reshape picks view-or-copy from the strides seen
        # while tracing, and Inductor may lay an intermediate input out differently.
        flat_x = dense(x).view(n, flat_w.shape[1])
        out = torch.addmm(bias, flat_x, flat_w.t()) if bias is not None else flat_x @ flat_w.t()
        return out.view((n, out_ch) + (1,) * c.ndim)

    def wins_by_construction(self, c):
        return ("one output position: a single GEMM of the conv's own FLOPs that reads each "
                "input element once (3-4x on CPU)")

    def heuristic(self, c, platform):
        return True, "one output position: a single matrix product (3-4x on CPU)"


def _numel(t) -> int:
    """Elements of a tensor with static sizes (symbolic: a huge number, never "smaller")."""
    n = 1
    for s in t.shape:
        if not isinstance(s, int):
            return 1 << 62
        n *= s
    return n


RULE = PatchLinear()
