"""Dispatcher-level and tracing helpers (re-exported by :mod:`convlower.torch_internals`):
recording the kernels a function's compiled code runs, autograd inside a custom op's implementation, a trace with
its dead code removed, and the output strides a compiled graph keeps."""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

_C = torch._C
# What a custom op's autograd wrapper excludes while its implementation runs.
_AUTOGRAD_KEYS = tuple(getattr(_C.DispatchKey, k) for k in
                       ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor",
                        "ADInplaceOrView") if hasattr(_C.DispatchKey, k))


def record_kernels(run: Callable[[], object], packets: set, fusable: Sequence[torch.Tensor],
                   output_fusable: bool) -> list:
    """``run()`` once; the ``(op, args, kwargs)`` of each op its compiled code surely runs as a
    kernel of its own, with the real arguments it got: every op in ``packets`` (extern GEMMs and
    convs, opaque ops), and one op per chain of other ops that no kernel of the model can absorb.
    Such a chain reads graph inputs outside ``fusable`` and outputs of ``packets`` ops, and
    feeds a ``packets`` op or leaves ``run`` (unless ``output_fusable``: a consumer of the
    result fuses it); Inductor makes it one kernel, so its op moving the most bytes stands for
    it (a sum of conv outputs, a bias gradient's reduction).  An op reading only ``fusable``
    values (an activation an op of the model writes) fuses into their producer: it costs
    nothing here.  Views are free.  Every intermediate stays alive while recording."""
    from torch.utils._python_dispatch import TorchDispatchMode

    chains = _Chains(_storages(list(fusable)), packets)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            chains.add(func, args, kwargs, out)
            return out

    with Record():
        result = run()
    if not output_fusable:
        chains.end(_storages(result))
    return chains.kernels()


def _tensors(tree) -> list:
    """The tensors with elements in ``tree`` (an empty tensor costs nothing, and may share
    storage address 0 with any other)."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.numel()]


def _storages(tree) -> list:
    return [t.untyped_storage().data_ptr() for t in _tensors(tree)]


class _Chains:
    """The ops of one eager run grouped as Inductor would fuse them (see record_kernels)."""

    def __init__(self, free: list, packets: set):
        self.free, self.made, self.packets = set(free), set(), packets
        self.calls, self.packet, self.bytes, self.parent = [], [], [], []
        self.pending: dict = {}  # storage -> the chain ops that wrote its value
        self.ended: set = set()  # chains some kernel or the output reads
        self.alive: list = []    # every value: no storage is freed and reused while recording

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            i = self.parent[i]
        return i

    def end(self, keys) -> None:
        self.ended.update(self.find(i) for k in keys for i in self.pending.get(k, ()))

    def add(self, func, args, kwargs, out) -> None:
        self.alive.append(out)
        ins, outs = set(_storages((args, kwargs))), _storages(out)
        if func.overloadpacket in self.packets:
            self.end(ins)
            self._call(func, args, kwargs, True, 0)
            self.made.update(outs)
            return
        mutable = func._schema.is_mutable
        if not ins or (not mutable and set(outs) <= ins):
            return  # a factory, or a view (free where what it views is)
        if ins & self.free and not ins & self.made:
            self.free.update(outs)  # fuses into the model's producer of its input
            return
        written = _written(func, args, kwargs) if mutable else set()
        i = self._call(func, args, kwargs, False, _nbytes((args, kwargs, out)))
        for k in ins - written:  # it reads a chain's value: the same kernel
            for j in self.pending.get(k, ()):
                root = self.find(j)
                self.parent[root] = i
                if root in self.ended:
                    self.ended.add(i)
        for k, t in zip(outs, _tensors(out)):
            if written and k not in written:
                continue
            whole = t.numel() * t.element_size() >= t.untyped_storage().nbytes()
            self.pending[k] = [i] if whole else self.pending.get(k, []) + [i]
        self.made.update(outs)

    def _call(self, func, args, kwargs, packet: bool, nbytes: int) -> int:
        self.calls.append((func, args, kwargs))
        self.packet.append(packet)
        self.bytes.append(nbytes)
        self.parent.append(len(self.parent))
        return len(self.calls) - 1

    def kernels(self) -> list:
        heaviest: dict = {}  # an ended chain -> its op moving the most bytes
        for i in range(len(self.calls)):
            root = self.find(i)
            if self.packet[i] or root not in self.ended:
                continue
            if root not in heaviest or self.bytes[i] > self.bytes[heaviest[root]]:
                heaviest[root] = i
        keep = set(heaviest.values())
        return [c for i, c in enumerate(self.calls) if self.packet[i] or i in keep]


def _written(func, args, kwargs) -> set:
    """Storages a mutating op writes (its ``Tensor(a!)`` arguments)."""
    named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    return {k for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.name in named
            for k in _storages(named[a.name])}


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


@contextlib.contextmanager
def autograd_inside_custom_op():
    """Autograd on inside a custom op's implementation: its wrapper runs it below autograd
    (autograd's dispatch keys excluded), where ``torch.autograd.grad`` sees no graph.  The keys
    are put back for the block, with grad mode on (``torch.func.vjp`` would do without, but
    fails under any ``TorchDispatchMode``: profilers, FLOP counters)."""
    exclude = _C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        if exclude.has(key):
            exclude = exclude.remove(key)
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


def output_strides(op, args: Sequence) -> tuple:
    """The strides of ``op(*args)``'s tensor outputs as its fake kernel gives them (what
    Inductor plans around; device-aware, unlike the meta kernel: a CPU conv of a channels-last
    input is channels-last), without running it.  Cached per sizes, strides, dtypes, devices."""
    return _fake_strides(op, tuple(_signature(a) for a in args))


def _signature(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device))
    return tuple(a) if isinstance(a, list) else a


@functools.lru_cache(maxsize=1024)
def _fake_strides(op, signature: tuple) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty_strided(s[1], s[2], dtype=s[3], device=s[4])
                if isinstance(s, tuple) and s[:1] == ("tensor",) else
                list(s) if isinstance(s, tuple) else s for s in signature]
        out = op(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(tuple(o.stride()) if o is not None else None for o in outs)


_TRACING = threading.Lock()


def trace_live(fn: Callable, values: list) -> torch.fx.GraphModule:
    """``fn`` traced on the real ``values`` (aten ops as dispatched, autograd calls included)
    with its dead code removed: what a compiled graph of ``fn`` computes.  A backward that
    differentiates a rule's forward (``torch.autograd.grad``) also runs that forward's GEMM,
    which no gradient needs: eagerly it doubled ViT's patch conv backward (17 ms, 8.6 ms
    traced).  Raises if the trace saw no op reach its outputs (a caller that hides ops from
    dispatch modes): such a graph would replay the first call's values.

    While it traces, ``make_fx`` marks the process as FX-tracing: another thread calling a
    ``torch.compile``d function then raises, as it does during any compile's own tracing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with _TRACING:
        gm = make_fx(fn, tracing_mode="real")(*values)
    gm.graph.eliminate_dead_code()
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        raise RuntimeError("the trace holds constants: its ops were hidden from the tracer")
    gm.recompile()
    return gm


def outputs_keep_strides(gm: torch.fx.GraphModule) -> None:
    """Every output keeps the strides the trace gave it, as a model's outputs do under
    ``compile_fx`` (its "user-visible outputs", unless Inductor's ``keep_output_stride`` is
    off).  ``compile_fx_inner`` alone lets Inductor return a conv's output channels-last; timed
    so, the original skipped the copy back that the model pays (a 4-channel Conv2d measured
    0.62 ms, 0.9 ms in the model)."""
    from torch._inductor import compile_fx as _cf, config

    record = getattr(_cf, "record_original_output_strides", None)
    if record is None or not config.keep_output_stride:
        return   # an older torch: measured without the constraint
    record(gm)   # torch 2.13's compile_fx_inner records them again, after its fake propagation
    out = gm.graph.find_nodes(op="output")[0]
    values = out.args[0] if not isinstance(out.args[0], torch.fx.Node) else out.args
    out.meta["user_visible_output_idxs"] = [
        i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]


@contextlib.contextmanager
def quick_op_registration():
    """``torch.library`` notes where each fake kernel is registered with
    ``inspect.getframeinfo``, which scans every loaded module: 10 ms per op, 0.1 s of importing
    convlower (its ten custom ops), in every process's first compile.  Within this block the
    note is the frame's file and line, read directly: the same text."""
    import sys

    from torch._library import utils

    real = utils.get_source
    if getattr(real, "__name__", "") != "get_source":  # not the function this replaces
        yield
        return
    utils.get_source = lambda stacklevel: (  # noqa: E731  frame 0 is this lambda, as it was
        lambda f: f"{f.f_code.co_filename}:{f.f_lineno}")(sys._getframe(stacklevel))
    try:
        yield
    finally:
        utils.get_source = real
