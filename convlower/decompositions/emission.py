"""The one builder of "the function that replaces a convolution site": what the pass splices
and what measured selection times are the same function (tests/test_emission.py).

:func:`build` turns (site, rule, compute dtype) into a pure function of the site's inputs:

* the rule's forward or backward decomposition (:mod:`.convolution`);
* in ``compute_dtype`` when asked (opt-in bf16 compute);
* the leftover part of a folded ``constant_pad_nd``, applied first (forward);
* outputs in the strides of the node they replace: downstream nodes' meta (and Inductor's view
  lowering) were computed for those strides.

With ``rule=None`` it builds the original computation (the pad, then ``aten.convolution`` /
``aten.convolution_backward`` with the node's own arguments): the baseline a measurement
times the rules against.
"""
from __future__ import annotations

from typing import Callable, Optional

import sympy
import torch

from .. import torch_internals as ti
from ..lowerings.dense import opaque_copies
from ..lowerings.proof import hint_holds
from ..lowerings.rule import Rule, sym
from ..lowerings.site import ConvSite
from . import convolution as conv_decomp
from . import opaque_form

aten = torch.ops.aten


def build(site: ConvSite, rule: Optional[Rule], compute_dtype: Optional[str] = None,
          opaque: bool = False) -> Callable:
    """The function of ``site.inputs`` that computes the site's value(s) through ``rule``
    (None: the original computation); with ``opaque``, in the rule's opaque form (one custom
    op running the same decomposition: :mod:`.opaque_form`)."""
    if rule is None:
        return _original(site)
    if opaque and not opaque_form.has_opaque_form(rule):
        raise ValueError(f"{rule.name} has no opaque form (it is not a traced lowering)")
    dtype = conv_decomp.DTYPES[compute_dtype]
    if site.backward:
        fn = (opaque_form.backward(rule, site.call, site.output_mask, compute_dtype,
                                   site.layout_opt) if opaque
              else conv_decomp.convolution_backward(rule, site.call, site.output_mask, dtype))
    else:
        fn = _forward(site, opaque_form.forward(rule, site.call, compute_dtype, site.layout_opt)
                      if opaque else conv_decomp.convolution(rule, site.call, dtype))
    # Copies of a graph input (backward: the saved activation) cannot fuse into a producer.
    fixed_input = site.backward or not site.input_produced
    return with_layout_of(_copies(fn, fixed_input), site.output,
                          opaque=not site.output_consumed)


def _copies(fn: Callable, opaque: bool) -> Callable:
    def wrapped(*args):
        with opaque_copies(opaque):
            return fn(*args)
    return wrapped


def _forward(site: ConvSite, conv: Callable) -> Callable:
    rest = site.pad_fold.rest if site.pad_fold else None
    # The tracer passes exactly one value per parameter: without a bias the traced function
    # must take two (a defaulted third parameter made every bias-less conv fail).
    if site.call.has_bias:
        return lambda x, weight, bias: conv(_pad(x, rest), weight, bias)
    return lambda x, weight: conv(_pad(x, rest), weight, None)


def _pad(x, pads):
    return aten.constant_pad_nd(x, list(pads)) if pads else x


def _original(site: ConvSite) -> Callable:
    c = site.original
    params = (list(c.stride), list(c.padding), list(c.dilation), c.transposed,
              list(c.output_padding), c.groups)
    if site.backward:
        bias_sizes = [site.inputs[2].shape[0]] if c.has_bias else None
        mask = list(site.output_mask)
        return lambda g, x, w: aten.convolution_backward(g, x, w, bias_sizes, *params, mask)
    pads = site.pad_fold.pads if site.pad_fold else None
    if c.has_bias:
        return lambda x, w, b: aten.convolution(_pad(x, pads), w, b, *params)
    return lambda x, w: aten.convolution(_pad(x, pads), w, None, *params)


# -- sizes and layouts -----------------------------------------------------------------------------
def same_sizes(a, b, shape_env, guard: bool = False) -> bool:
    """Equal sizes, proven statically.  With ``guard``, an equality sympy cannot simplify
    (e.g. ``(x**2)//(2*x)`` vs ``x//2``) that holds for the current sizes is installed as a
    guard instead (recorded as an emission guard by the caller)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            eq = sympy.Eq(sym(x), sym(y))
            if shape_env is None:
                return False
            if ti.evaluate_static(eq, shape_env) is True:
                continue
            if not (guard and hint_holds(eq, shape_env) and shape_env.evaluate_expr(eq)):
                return False
        elif int(x) != int(y):
            return False
    return True


def same_layout(a, b, shape_env, b_format=None) -> bool:
    """Same strides, or (when symbolic strides cannot be compared) both dense in the same
    memory format, which fixes the strides given equal sizes.  Inside a trace, pass ``b``'s
    format computed outside it (``b``'s SymInt strides are unknown to the tracer)."""
    if same_sizes(a.stride(), b.stride(), shape_env):
        return True
    fmt = ti.memory_format_of(b) if b_format is None else b_format
    return ti.memory_format_of(a) == fmt and a.is_contiguous(memory_format=fmt)


def with_layout_of(fn: Callable, old, opaque: bool = False) -> Callable:
    """Wrap ``fn`` so each output has the strides of the value it replaces (``old``).  With
    ``opaque`` (no op of the graph reads the output, so no consumer can fuse the copy) a
    layout copy is ATen's, not a generated kernel."""
    olds = old if isinstance(old, (tuple, list)) else (old,)
    # Decided before tracing: ``old``'s symbolic strides are not inputs of the traced
    # function, so SymInt arithmetic on them inside the tracer fails ("not tracked").
    formats = [ti.memory_format_of(v) if v is not None else None for v in olds]

    def wrapped(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        fixed = []
        for o, v, fmt in zip(outs, olds, formats):
            if o is not None and v is not None and \
                    not same_layout(o, v, ti.shape_env_of([o, v]), fmt):
                o = _layout_copy(o, fmt, opaque)
            fixed.append(o)
        return tuple(fixed) if isinstance(out, tuple) else fixed[0]

    return wrapped


def _layout_copy(o: torch.Tensor, fmt, opaque: bool) -> torch.Tensor:
    if opaque and fmt == torch.contiguous_format:
        return torch.ops.convlower.dense(o)  # a copy even when only size-1 strides differ
    return o.clone(memory_format=fmt)
