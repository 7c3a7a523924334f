"""What the rules that call the original convolution inside custom ops share (eager_conv,
channels_last_conv): the ops' tags and arguments, the wanted gradients, the autograd that
routes a forward op's backward through its backward op, and the rule's opaque backward."""
from __future__ import annotations

from typing import Callable

import torch

from .rule import ConvCall

aten = torch.ops.aten


def exact_strides_tags() -> tuple:
    """Tags making Inductor hand a custom op its inputs in the strides the graph traced."""
    return (getattr(torch.Tag, "needs_exact_strides", None) or torch.Tag.needs_fixed_stride_order,)


def conv_params(c: ConvCall) -> tuple:
    """A conv's non-tensor arguments, in ``aten.convolution``'s order after the bias."""
    return (list(c.stride), list(c.padding), list(c.dilation), c.transposed,
            list(c.output_padding), c.groups)


def conv_grads(grad_out, x, weight, stride, padding, dilation, transposed, output_padding,
               groups, output_mask) -> list:
    """``aten.convolution_backward``'s wanted gradients only, in (input, weight, bias) order."""
    bias_sizes = [grad_out.shape[1]] if output_mask[2] else None
    grads = aten.convolution_backward.default(grad_out, x, weight, bias_sizes, stride, padding,
                                              dilation, transposed, output_padding, groups,
                                              list(output_mask))
    return [g for g, m in zip(grads, output_mask) if m]


def route_autograd(forward_op, backward_op) -> None:
    """Autograd of ``forward_op(x, weight, bias, *params)``: the gradients its inputs need,
    from ``backward_op(grad, x, weight, *params, mask)``."""

    def setup(ctx, inputs, output):
        x, weight, bias, *params = inputs
        ctx.save_for_backward(x, weight)
        ctx.params = params
        ctx.has_bias = bias is not None

    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.has_bias and ctx.needs_input_grad[2]]
        grads = iter(backward_op(grad, x, weight, *ctx.params, mask) if any(mask) else [])
        return (*(next(grads) if m else None for m in mask), *([None] * len(ctx.params)))

    forward_op.register_autograd(backward, setup_context=setup)


def opaque_backward(backward_op, c: ConvCall, output_mask) -> Callable:
    """A rule's ``emit_backward``: ``(grad_out, x, weight) -> (grad_x, grad_weight, grad_bias)``
    through ``backward_op``, None where not wanted."""
    mask = [bool(m) for m in output_mask]

    def backward(grad_out, x, weight):
        grads = iter(backward_op(grad_out, x, weight, *conv_params(c), mask))
        return tuple(next(grads) if m else None for m in mask)

    return backward
