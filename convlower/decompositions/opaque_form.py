"""The opaque form of a lowering: the rule's decomposition run eagerly inside one custom op.

Why.  A lowering traced into the graph gives Inductor its copies, slices and bias adds to fuse:
kernels to generate and build.  On a graph with few kernels of its own (one bf16 patch conv on
a CPU without bf16 instructions) that build is the compile: Wan DiT's patch conv compiled
2.15x Inductor's cold compile lowered, for a step the GEMM dominates.  Where fusion cannot gain
(the screen: the rule's kernels alone are not faster than its whole eager run by the
measurement's margin), ``convlower::lowered_conv`` runs the same decomposition as Inductor runs
an extern conv: nothing is generated, and the step is the screen's own eager figure.

Identity.  The op computes :func:`.convolution.convolution` (the rule's decomposition, proven
by the rule's conditions, which the pass checks as for the traced form); its backward op
:func:`.convolution.convolution_backward`.  The outputs are copied, where the decomposition's
strides differ, into the strides the original ``aten.convolution`` (``_backward``) gives on
these inputs: the fake implementations are the original on fake tensors, so Inductor plans
around exactly what runs.  ``needs_exact_strides`` makes Inductor pass the traced strides.
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from .. import torch_internals as ti
from ..lowerings import RULES
from ..lowerings.opaque_conv import conv_params, exact_strides_tags
from ..lowerings.frames import conv2d_in
from ..lowerings.rule import ConvCall
from .convolution import DTYPES, convolution, convolution_backward

aten = torch.ops.aten


def has_opaque_form(rule) -> bool:
    """A lowering whose decomposition is traced into the graph (rules that are custom ops
    already, such as channels_last_conv, are their own opaque form)."""
    return bool(rule is not None and rule.lowers and rule.traced)


def _call(x, weight, has_bias, stride, padding, dilation, transposed, output_padding, groups):
    bias = weight.new_empty(0) if has_bias else None  # ConvCall reads only its presence
    return ConvCall.from_args((x, weight, bias, stride, padding, dilation, transposed,
                               output_padding, groups))


_warned: set = set()


def _fell_back(rule: str, e: Exception) -> None:
    key = (rule, type(e).__name__)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"convlower: {rule} failed in its opaque form ({type(e).__name__}: {e}); "
                      f"the original convolution ran instead", RuntimeWarning, stacklevel=2)


def _in_strides(t: torch.Tensor, stride) -> torch.Tensor:
    """``t`` with ``stride`` (an empty tensor's strides are whatever its maker chose: copied)."""
    if t is None or stride is None or (tuple(t.stride()) == tuple(stride) and t.numel()):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


@torch.library.custom_op("convlower::lowered_conv", mutates_args=(), tags=exact_strides_tags())
def _lowered_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  rule: str, compute_dtype: str, channels_last: bool, stride: list[int],
                  padding: list[int], dilation: list[int], transposed: bool,
                  output_padding: list[int], groups: int) -> torch.Tensor:
    params = (stride, padding, dilation, transposed, output_padding, groups)
    try:
        call = _call(x, weight, bias is not None, *params)
        with _no_autocast(x), conv2d_in(torch.channels_last if channels_last else None):
            out = convolution(RULES[rule], call, DTYPES[compute_dtype or None])(x, weight, bias)
    except Exception as e:  # never break a step: the original computes the same value
        _fell_back(rule, e)
        out = aten.convolution.default(x, weight, bias, *params)
    return _in_strides(out, ti.output_strides(aten.convolution.default,
                                              (x, weight, bias, *params))[0])


@_lowered_conv.register_fake
def _(x, weight, bias, rule, compute_dtype, channels_last, stride, padding, dilation,
      transposed, output_padding, groups):
    return aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed,
                                    output_padding, groups)


@torch.library.custom_op("convlower::lowered_conv_backward", mutates_args=(),
                         tags=exact_strides_tags())
def _lowered_conv_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           rule: str, compute_dtype: str, channels_last: bool, has_bias: bool,
                           stride: list[int], padding: list[int], dilation: list[int],
                           transposed: bool, output_padding: list[int], groups: int,
                           output_mask: list[bool]) -> list[torch.Tensor]:
    """The wanted gradients only, in (input, weight, bias) order."""
    params = (stride, padding, dilation, transposed, output_padding, groups)
    bias_sizes = [weight.shape[0]] if has_bias else None
    original = lambda: aten.convolution_backward.default(  # noqa: E731
        grad_out, x, weight, bias_sizes, *params, list(output_mask))
    if torch.is_inference_mode_enabled() or any(t.is_inference() for t in (grad_out, x, weight)):
        grads = original()  # autograd cannot record inference tensors
    else:
        try:
            call = _call(x, weight, has_bias, *params)
            layout = torch.channels_last if channels_last else None
            with ti.autograd_inside_custom_op(), _no_autocast(x), conv2d_in(layout):
                args = (rule, compute_dtype, channels_last, has_bias,
                        *(tuple(p) if isinstance(p, list) else p for p in params),
                        tuple(output_mask))
                grads = _live_backward(args, call, (grad_out, x, weight))
        except Exception as e:  # never break a step: the original computes the same values
            _fell_back(rule, e)
            grads = original()
    strides = ti.output_strides(aten.convolution_backward.default,
                                (grad_out, x, weight, bias_sizes, *params, list(output_mask)))
    return [_in_strides(g, s) for g, s, m in zip(grads, strides, output_mask) if m]


_traced: dict = {}   # (op arguments, input signature) -> the backward's live trace (or itself)
_MAX_TRACED = 256    # dynamic sizes give a trace per size: forget them all past this


def _no_autocast(x: torch.Tensor):
    """The op computes in its inputs' dtypes, as the convolution it replaces: a caller's autocast
    (still on at step time) must not recast the decomposition's GEMMs."""
    return torch.autocast(x.device.type, enabled=False)


def _live_backward(args: tuple, call: ConvCall, values: tuple):
    """The rule's backward on ``values``, as its trace with the dead code removed (traced once
    per signature): the decomposition differentiates the rule's forward, whose own GEMM no
    gradient needs; traced, that GEMM is dropped as Inductor drops it from the traced form.
    Where tracing fails, the decomposition runs as it is (remembered: no second try)."""
    key = (args, tuple((t.shape, t.stride(), t.dtype, t.device) for t in values))
    run = _traced.get(key)
    if run is None:
        rule, compute_dtype, mask = args[0], args[1], list(args[-1])
        run = convolution_backward(RULES[rule], call, mask, DTYPES[compute_dtype or None])
        try:
            run = ti.trace_live(run, list(values))
        except Exception:  # noqa: BLE001 - the untraced backward computes the same values
            pass
        if len(_traced) >= _MAX_TRACED:
            _traced.clear()
        _traced[key] = run
    return run(*values)


@_lowered_conv_backward.register_fake
def _(grad_out, x, weight, rule, compute_dtype, channels_last, has_bias, stride, padding,
      dilation, transposed, output_padding, groups, output_mask):
    bias_sizes = [weight.shape[0]] if has_bias else None
    grads = aten.convolution_backward.default(grad_out, x, weight, bias_sizes, stride, padding,
                                              dilation, transposed, output_padding, groups,
                                              list(output_mask))
    return [g for g, m in zip(grads, output_mask) if m]


def _setup(ctx, inputs, output):
    x, weight, bias, *rest = inputs
    ctx.save_for_backward(x, weight)
    ctx.rest, ctx.has_bias = rest, bias is not None


def _autograd(ctx, grad):
    """Autograd of the forward op (a graph traced with it and differentiated after): its
    backward op, for the wanted gradients."""
    x, weight = ctx.saved_tensors
    rule, compute_dtype, channels_last, *params = ctx.rest
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
            ctx.has_bias and ctx.needs_input_grad[2]]
    grads = iter(_lowered_conv_backward(grad, x, weight, rule, compute_dtype, channels_last,
                                        ctx.has_bias, *params, mask) if any(mask) else [])
    return (*(next(grads) if m else None for m in mask), *([None] * len(ctx.rest)))


_lowered_conv.register_autograd(_autograd, setup_context=_setup)


def forward(rule, c: ConvCall, compute_dtype: Optional[str], channels_last: bool = False):
    """``(x, weight, bias) -> out`` through ``convlower::lowered_conv``; with
    ``channels_last`` its 2-D convs run channels-last (as Inductor's layout optimisation runs
    them in the traced form)."""
    def fn(x, weight, bias=None):
        return torch.ops.convlower.lowered_conv(x, weight, bias, rule.name, compute_dtype or "",
                                                channels_last, *conv_params(c))
    return fn


def backward(rule, c: ConvCall, output_mask: Sequence[bool], compute_dtype: Optional[str],
             channels_last: bool = False):
    """``(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias)`` through
    ``convlower::lowered_conv_backward``, None where not wanted."""
    mask = [bool(m) for m in output_mask]

    def fn(grad_out, x, weight):
        grads = iter(torch.ops.convlower.lowered_conv_backward(
            grad_out, x, weight, rule.name, compute_dtype or "", channels_last, c.has_bias,
            *conv_params(c), mask))
        return tuple(next(grads) if m else None for m in mask)
    return fn
