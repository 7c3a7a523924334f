"""Compiled parts pass their 4-D activations to each other channels-last, the layout the
compiled code computes in.

Inductor computes a graph with convolutions channels-last on a CPU with oneDNN (its
``decide_layout_opt``), but gives every graph output the strides eager gave it.  Compiled as one
graph, a UNet's activations stay channels-last from block to block; compiled as parts, every
part would write its outputs back in eager's layout and the next part convert them again: two
copies per seam (3-4% of a UNet step here).  So a compiled part that works on images
(convolves, group-normalises, resizes or joins along channels) takes its 4-D activation inputs
(not weights) and gives its 4-D outputs channels-last, and eager's layout for everything else.
A part that cannot (its graph, run on fake inputs of the new layout, fails: a view that needs
eager's strides) is left as it was.
The split graph converts where the two meet, and at its own inputs and outputs, so what the
caller sees keeps eager's strides.  The choice is a function of a part's own graph and inputs:
identical parts stay identical and share one compile.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable, Optional

import torch
import torch.fx

from .. import torch_internals as ti
from .partition import example_inputs, example_of, returns_tuple
from .signature import signature

_IMAGE_OPS = {"conv2d", "conv_transpose2d", "group_norm", "interpolate"}
# A part using one of these may depend on its inputs' strides: run it on fake inputs to see.
_STRIDE_SENSITIVE = {"view", "view_as", "stride", "is_contiguous", "as_strided", "data_ptr"}


def channels_last_wanted(gm: torch.fx.GraphModule) -> Callable[[torch.Tensor], bool]:
    """Whether Inductor would compute a value of ``gm`` (the whole Dynamo graph) channels-last:
    the graph convolves and the value is on a CPU with oneDNN (Inductor's own rule there).  On
    GPUs Inductor decides by heuristics this step does not repeat, so seams keep eager's layout
    there."""
    convolves = _convolves(gm)   # once per graph, not per value
    return lambda example: (convolves and example.device.type == "cpu"
                            and torch.backends.mkldnn.enabled
                            and torch.backends.mkldnn.is_available())


def _convolves(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and "conv" in getattr(n.target, "__name__", "")
               for n in gm.graph.nodes)


def _image_part(sub: torch.fx.GraphModule) -> bool:
    """A part that works on images: convolves, group-normalises, resizes or joins them along
    channels (a UNet's skip connections), the ops whose 4-D tensors are (N, C, H, W).  A
    transformer's 4-D tensors are (batch, sequence, heads, dim), which channels-last would
    only scatter."""
    return any(n.op == "call_function" and (getattr(n.target, "__name__", "") in _IMAGE_OPS
                                            or _channel_cat(n))
               for n in sub.graph.nodes)


def _channel_cat(n: torch.fx.Node) -> bool:
    if n.target is not torch.cat:
        return False
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    out = example_of(n)
    return isinstance(out, torch.Tensor) and out.dim() == 4 and dim in (1, -3)


def _format(v) -> Optional[torch.memory_format]:
    """channels-last for a contiguous 4-D floating activation, else None (Inductor keeps
    5-D convolutions in eager's layout)."""
    if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 4):
        return None
    fmt = torch.channels_last
    if not v.is_contiguous() or v.is_contiguous(memory_format=fmt):
        return None   # already another layout, or one where both layouts are the same
    return fmt


def _outputs(sub: torch.fx.GraphModule) -> list:
    out = sub.graph.output_node().args[0]
    return list(out) if returns_tuple(sub) else [out]


def _runs_on(sub: torch.fx.GraphModule, inputs: list) -> bool:
    if not any(n.op == "call_method" and n.target in _STRIDE_SENSITIVE for n in sub.graph.nodes):
        return True
    try:
        with _fake(inputs):
            torch.fx.Interpreter(sub).run(*inputs)
        return True
    except Exception:   # noqa: BLE001 - any failure keeps the seam in eager's layout
        return False


def _fake(values):
    """The fake mode the values were made in (Dynamo's; not an enclosing trace's)."""
    return ti.values_fake_mode(values) or contextlib.nullcontext()


def _placeholders(sub) -> list:
    return [n for n in sub.graph.nodes if n.op == "placeholder"]


def _set_example(n: torch.fx.Node, v) -> None:
    n.meta["example_value"] = v
    if "val" in n.meta:
        n.meta["val"] = v


def channels_last_seams(split_gm: torch.fx.GraphModule, compiled: dict,
                        wanted: Callable[[torch.Tensor], bool]) -> tuple[dict, dict]:
    """Compiled parts that can work channels-last take and give their 4-D activations so
    (``compiled``: part name -> submodule of the parts that will be compiled; ``wanted(value)``:
    whether channels-last is worth it for a value).  Where such a part meets anything else (the
    graph's inputs and outputs, glue run as is, a part that cannot), the split graph converts.
    The choice depends only on a part's own graph and inputs, so identical parts stay identical
    and share one compile.  Returns, per part, how many of its outputs are now channels-last
    and how many of its inputs the split graph converts on each call."""
    memo: dict = {}
    takes: dict[str, list] = {}     # part -> per placeholder: takes it channels-last
    gives: dict[str, set] = {}      # part -> outputs it now gives channels-last
    for name, sub in compiled.items():
        plan = _channels_last_plan(sub, wanted, memo)
        if plan is None:
            continue
        inputs, outputs, given = plan
        takes[name] = inputs
        for p, cl in zip(_placeholders(sub), inputs):
            if cl:
                with _fake([example_of(p)]):
                    _set_example(p, example_of(p).contiguous(memory_format=torch.channels_last))
        for j, fmt in enumerate(outputs):
            if fmt is not None:
                _return_as(sub, j, fmt)
        gives[name] = set(given)
    converted = _convert_where_layouts_meet(split_gm, compiled, takes, gives)
    return {name: len(given) for name, given in gives.items() if given}, converted


def _channels_last_plan(sub, wanted, memo: dict) -> Optional[tuple[list, list, list]]:
    """For a part that can work channels-last: (per input: taken channels-last; per output: the
    memory format it is given back in, None for a non-tensor; the outputs made channels-last),
    else None."""
    if not _image_part(sub):
        return None
    inputs = example_inputs(sub)
    take = [_format(v) is not None and wanted(v) and _activation(p)
            for p, v in zip(_placeholders(sub), inputs)]
    eager = _eager_layout_of_outputs(sub)
    if eager is None:
        return None
    given = [j for j, v in enumerate(map(example_of, _outputs(sub)))
             if _format(v) is not None and wanted(v)]
    give = [torch.channels_last if j in given else fmt for j, fmt in enumerate(eager)]
    if not any(take) and not given:
        return None
    key = signature(sub, inputs)   # names left out: every instance of a block shares one check
    if key not in memo:
        with _fake(inputs):
            trial = [v.contiguous(memory_format=torch.channels_last) if cl else v
                     for v, cl in zip(inputs, take)]
        memo[key] = _runs_on(sub, trial)
    return (take, give, given) if memo[key] else None


def _activation(p: torch.fx.Node) -> bool:
    """Not a parameter or buffer: those are the model's own, read as they are (a layout copy
    of a weight on every call would cost what the seam saves)."""
    return not (isinstance(example_of(p), torch.nn.Parameter)
                or "._buffers[" in ti.graph_input_source(p))


def _convert_where_layouts_meet(split_gm, compiled: dict, takes: dict, gives: dict) -> dict:
    """Insert layout conversions in the split graph where a value's layout differs from what
    its user takes (``takes``: part -> per input, channels-last or not; ``gives``: part -> the
    outputs it now gives channels-last): eager's for the graph output, glue run as is and parts
    that stay in eager's layout."""
    has_cl: set = set()
    for node in split_gm.graph.nodes:
        if node.op != "call_module" or not gives.get(node.target):
            continue
        if returns_tuple(compiled[node.target]):
            has_cl |= {u for u in node.users
                       if u.target is operator.getitem and u.args[1] in gives[node.target]}
        else:
            has_cl.add(node)
    made: dict = {}

    def convert(value, to_cl: bool):
        if not isinstance(value, torch.fx.Node) or (value in has_cl) == to_cl:
            return value
        if (value, to_cl) not in made:
            fmt = torch.channels_last if to_cl else torch.contiguous_format
            with split_gm.graph.inserting_after(value):
                made[value, to_cl] = split_gm.graph.call_method(
                    "contiguous", (value,), {"memory_format": fmt})
        return made[value, to_cl]

    converted: dict[str, int] = {}
    for node in list(split_gm.graph.nodes):
        if node.op == "call_module" and node.target in takes:
            args = tuple(convert(a, cl) for a, cl in zip(node.args, takes[node.target]))
        elif node.op in ("call_module", "output"):
            args = torch.fx.node.map_arg(node.args, lambda a: convert(a, False))
        else:
            continue
        if node.op == "call_module":
            converted[node.target] = sum(a is not b for a, b in zip(args, node.args))
        node.args = args
    return converted


def _eager_layout_of_outputs(sub: torch.fx.GraphModule) -> Optional[list]:
    """Per output, the memory format eager gave it (None: not a tensor), or None when one is
    dense in no memory format (a layout this step could not give back)."""
    formats = []
    for v in map(example_of, _outputs(sub)):
        if not isinstance(v, torch.Tensor):
            formats.append(None)
            continue
        fmt = ti.memory_format_of(v)
        if not v.is_contiguous(memory_format=fmt):
            return None
        formats.append(fmt)
    return formats


def output_strides(sub: torch.fx.GraphModule) -> tuple:
    """Per output of ``sub``, its traced strides, which the parts reading it are compiled for
    (None: not a tensor, a symbolic size or stride, or strides that overlap, which no copy
    can be laid out in)."""
    return tuple(_static_strides(v) for v in map(example_of, _outputs(sub)))


def _static_strides(v) -> Optional[tuple]:
    if not isinstance(v, torch.Tensor):
        return None
    shape, strides = tuple(v.shape), tuple(v.stride())
    if not all(type(x) is int for x in shape + strides):
        return None
    extent = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, strides) if n > 1), key=lambda p: p[1]):
        if s < extent:
            return None   # overlapping (an expanded dim)
        extent = s * n
    return strides


def _return_as(sub: torch.fx.GraphModule, index: int, fmt: torch.memory_format) -> None:
    """``sub`` returns its output ``index`` in layout ``fmt``."""
    out = sub.graph.output_node()
    values = _outputs(sub)
    old = values[index]
    with sub.graph.inserting_before(out):
        new = sub.graph.call_method("contiguous", (old,), {"memory_format": fmt})
    with _fake([example_of(old)]):
        _set_example(new, example_of(old).contiguous(memory_format=fmt))
    new.meta["nn_module_stack"] = old.meta.get("nn_module_stack", {})
    values[index] = new
    out.args = (type(out.args[0])(values) if returns_tuple(sub) else new,)
    sub.recompile()
