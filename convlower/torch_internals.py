"""Every private torch API convlower calls, in one place (the adapter to torch internals; the
per-version fallbacks in torch_versions.py and Inductor's caches in torch_caches.py are parts
of it that only this module imports and re-exports).

A torch upgrade that moves one of these breaks this file, not the package.  Functions that
only observe (statistics, metrics, trace artifacts) degrade to "unknown" instead of raising;
those the compile needs (tracing, compiling, shape proofs) raise, and the caller's fault
containment keeps the original convolution.  A test (tests/test_architecture.py) fails when
a module other than this one names a private torch module.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
from typing import Callable, Optional

import sympy
import torch

from . import torch_versions as _versions

_versions.require_supported()  # at backend lookup: a clear error on a torch we cannot run on

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: E402,F401

log = logging.getLogger("convlower")


# -- fake tensors, symbolic shapes -----------------------------------------------------------------
def fake_mode_of(values):
    """The fake mode the (fake) tensors in ``values`` belong to, or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def in_fake_mode_of(values):
    """A context that runs ops in the fake mode of ``values`` when they are fake (real tensors,
    e.g. a measurement's inside a compile, must not enter the compile's ambient fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not any(isinstance(v, FakeTensor) for v in values):
        return contextlib.nullcontext()
    mode = fake_mode_of(values)
    return mode if mode is not None else contextlib.nullcontext()


def shape_env_of(values):
    mode = fake_mode_of(values)
    return mode.shape_env if mode is not None else None


def fake_mode_off():
    """A context with no fake mode active (real tensors inside a compile)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def evaluate_static(relation, shape_env) -> Optional[bool]:
    """True / False when ``shape_env`` proves or refutes ``relation`` without a guard, else None."""
    res = shape_env._maybe_evaluate_static(sympy.sympify(relation))
    return None if res is None else bool(res)


size_hints = _versions.size_hints  # (shape_env) -> {symbol: value} of every backed size


def guard_count(shape_env) -> int:
    return len(shape_env.guards) if shape_env is not None else 0


def guards_since(shape_env, start: int) -> list[str]:
    return [str(g.expr) for g in shape_env.guards[start:]] if shape_env is not None else []


def hint(v) -> int:
    """A size's concrete value, a SymInt's hint read without installing a guard."""
    return _versions.hint(v, fallback=8) if isinstance(v, torch.SymInt) else int(v)


# What torch's modules call to log their use (a no-op in a graph: nothing to compile).
api_usage_log = torch._C._log_api_usage_once


def graph_input_source(node: torch.fx.Node) -> str:
    """Where Dynamo read a graph input from (``L['self']._buffers['x']``), '' when unknown."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    return source.name if source is not None else ""


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    from torch._prims_common import suggest_memory_format

    return suggest_memory_format(t)


def inductor_layout_opt(graph: torch.fx.Graph, is_inference: bool) -> bool:
    """Inductor's layout decision (2-D convs channels-last) for ``graph`` (raises if moved)."""
    from torch._inductor.graph import GraphLowering
    return bool(GraphLowering.decide_layout_opt(graph.owning_module, is_inference=is_inference))


# A context: torch's own size checks take their general answer instead of a guard (see there).
size_oblivious = _versions.size_oblivious


# -- tracing and compiling -------------------------------------------------------------------------
@contextlib.contextmanager
def own_tracing_context(values):
    """A compile of its own inside an enclosing one (a region of a larger graph): a fresh
    TracingContext on the values' fake mode, so AOTAutograd's per-graph metadata (also that of
    the lazily compiled backward) is this graph's; size guards still land in the shared
    ShapeEnv, hence in the enclosing frame's guards."""
    from torch._guards import TracingContext, tracing

    mode = values_fake_mode(values)
    with tracing(TracingContext(mode) if mode is not None else None):
        yield


def values_fake_mode(values):
    """The fake mode the fake tensors in ``values`` were made in (not the enclosing trace's,
    which ``detect_fake_mode`` would prefer), or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)


def trace_aten(fn: Callable, values: list) -> torch.fx.GraphModule:
    """Trace ``fn`` on ``values`` into an aten graph (Inductor's replacement tracer), in the
    values' own fake mode when they are fake."""
    from torch._inductor.pattern_matcher import fwd_only

    with in_fake_mode_of(values):
        return fwd_only(fn, list(values))


def compile_inner(gm: torch.fx.GraphModule, values: list, outputs_leave: bool = True):
    """Compile an aten graph with Inductor, outside any enclosing trace and with convlower's
    pass off (a measurement candidate); returns a boxed callable.  ``outputs_leave``: its
    outputs stand for values that leave the model's graph (they keep their strides), not for
    values a later op reads (Inductor picks their layout)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    if outputs_leave:
        outputs_keep_strides(gm)
    with torch._guards.tracing(None), outer_metrics_kept(), \
            inductor_config.patch(post_grad_custom_pre_pass=None):
        return compile_fx_inner(gm, list(values))


def inductor_wrapper(mode: Optional[str], inductor_options: Optional[dict]):
    """The wrapper torch.compile builds for backend="inductor" (same mode and option handling)."""
    return torch._TorchCompileInductorWrapper(mode, inductor_options or None, None)


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str],
                          inductor_options: Optional[dict], patches: Optional[dict] = None):
    """Compile ``gm`` as ``backend="inductor"`` would (same mode and option handling), with
    ``patches`` added to Inductor's config for this compile only.

    The patches go through ``compile_fx(config_patches=...)``, which every torch since 2.0
    accepts and which also re-applies them to the backward compiled later, outside this call
    (the lazily compiled backward of torch <= 2.12).  The wrapper's own ``__call__`` only takes
    ``config_patches`` from torch 2.13 on, so it is not called."""
    from torch._inductor.compile_fx import compile_fx

    wrapper = inductor_wrapper(mode, inductor_options)
    merged = {**getattr(wrapper, "config", {}), **(patches or {})}
    return compile_fx(gm, example_inputs, config_patches=merged)


def inductor_config_keys() -> dict:
    from torch._inductor import config

    return config.get_config_copy()


def mark_dynamic(t: torch.Tensor, dims) -> None:
    """Compile ``t``'s ``dims`` as dynamic sizes (Dynamo's ``mark_dynamic``)."""
    torch._dynamo.mark_dynamic(t, dims)


def is_dynamo_control_flow(e: BaseException) -> bool:
    """Dynamo's own exceptions (restart analysis, skip frame): not failures to contain."""
    return type(e).__module__.startswith("torch._dynamo")


# Inductor adds a nested compile's time to the enclosing compile's metrics.  Measuring runs
# inside convlower's pass, whose seconds already hold it: without a restore the report would
# count it twice (once as convlower, once as Inductor / code generation).
_NESTED_COLUMNS = ("inductor_cumulative_compile_time_us",
                   "inductor_code_gen_cumulative_compile_time_us")


@contextlib.contextmanager
def outer_metrics_kept():
    try:
        from torch._dynamo.utils import get_metrics_context

        ctx = get_metrics_context()
        metrics = getattr(ctx, "_metrics", None) if ctx.in_progress() else None
    except Exception:  # moved in another torch: only the phase split suffers
        ctx = metrics = None
    before = {c: metrics.get(c) for c in _NESTED_COLUMNS} if isinstance(metrics, dict) else None
    try:
        yield
    finally:
        if before is not None and ctx.in_progress():
            for column, value in before.items():
                if value is None:
                    metrics.pop(column, None)
                else:
                    metrics[column] = value


# -- statistics (observe only: never raise) --------------------------------------------------------
def compilation_metrics() -> list:
    """Dynamo's per-compile ``CompilationMetrics`` entries (the most recent 64 by default)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        return list(get_compilation_metrics())
    except Exception:
        return []


compile_cache_counts = _versions.cache_counts  # (CompilationMetrics) -> {"fx_graph_hit": n, ...}


def counters() -> dict[str, dict[str, int]]:
    """A copy of ``torch._dynamo.utils.counters`` (cache hit/miss/bypass, graph breaks, ...)."""
    try:
        from torch._dynamo.utils import counters as c

        return {k: dict(v) for k, v in c.items()}
    except Exception:
        return {}


def current_compile_id() -> Optional[str]:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        return None if cid is None else str(cid)
    except Exception:
        return None


def on_compile(start: Callable, end: Callable) -> bool:
    try:
        from torch._dynamo import callback

        callback.on_compile_start(start)
        callback.on_compile_end(end)
        return True
    except Exception:
        return False


def backend_being_compiled() -> Optional[Callable]:
    """The backend function the frame Dynamo is starting to compile goes to (for a compile-start
    callback), unwrapped from torch.compile's wrappers; None where this torch hides it."""
    try:
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == "_compile"
                                         and "compiler_fn" in frame.f_locals):
            frame = frame.f_back
        fn = frame.f_locals["compiler_fn"] if frame is not None else None
        for _ in range(8):  # WrapBackendDebug -> _TorchCompileWrapper -> the function
            inner = (getattr(fn, "_torchdynamo_orig_backend", None)
                     or getattr(fn, "compiler_fn", None))
            if inner is None or inner is fn:
                return fn
            fn = inner
    except Exception:
        pass
    return None


def graph_break_logger() -> Optional[logging.Logger]:
    try:
        return torch._logging.getArtifactLogger("torch._dynamo.symbolic_convert", "graph_breaks")
    except Exception:
        return None


def trace_artifact(name: str, payload: dict, compile_id: Optional[str] = None) -> None:
    """Emit a JSON structured-trace artifact (a no-op unless TORCH_TRACE / a trace handler is on)."""
    try:
        from torch._guards import CompileId

        cid = CompileId.from_string(compile_id) if compile_id else None
        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
            payload_fn=lambda: json.dumps(payload, default=str), compile_id=cid)
    except Exception as e:
        log.debug("convlower: could not emit trace artifact %s: %r", name, e)


# Inductor's caches and the FX graph cache hooks live in torch_caches.py (re-exported here).
from .torch_caches import (cached_graph_guards, caches_disabled,  # noqa: E402,F401
                           clear_inductor_caches, inductor_cache_dir, inductor_caches_off,
                           on_fx_graph_cache, post_grad_pass, probe_vec_isa_ahead,
                           remember_vec_isa_probe)


# Dispatcher-level helpers (recording ops, autograd inside a custom op): torch_dispatch.py.
from .torch_dispatch import (autograd_inside_custom_op, output_strides,  # noqa: E402,F401
                             outputs_keep_strides, quick_op_registration, record_kernels,
                             trace_live)


# A generated module's C++ kernels built as a few libraries (torch_kernel_batch.py).
from .torch_kernel_batch import built_at_end as kernels_built_at_end  # noqa: E402,F401
from .torch_kernel_batch import install as build_kernels_together  # noqa: E402,F401
from .torch_kernel_batch import quiet as _kernel_builds_quiet  # noqa: E402
from .torch_kernel_batch import start_held_back as start_held_kernel_builds  # noqa: E402,F401


@contextlib.contextmanager
def kernel_builds_quiet():
    """Around a measurement: what it compiles is built when loaded, and no background work of
    ours (a kernel build, the vector-ISA probe) runs beside the timing on another core."""
    from .torch_caches import wait_for_probe_ahead

    wait_for_probe_ahead()
    with _kernel_builds_quiet():
        yield

# Whole compiled functions saved to disk (torch's AOT compile) live in torch_saved.py.
from .torch_saved import (can_save_compiled, compile_saveable,  # noqa: E402,F401
                          deserialize_compiled, dropped_guards, guard_passes,
                          inductor_config_digest, part_caller, saveable_split,
                          serialize_compiled, skip_saved_guard_check, traced_sources,
                          without_dynamo_disable)
