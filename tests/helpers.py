"""Shared test helpers: the tolerance table and layout maker (from the package's fuzzer),
compile-and-compare with eager (values and grads) and the "convolution left in the generated
code" check."""
from __future__ import annotations

import copy
import re

import torch
from torch._inductor.utils import run_and_get_code

# The one tolerance table (rtol, and atol relative to the largest magnitude of the reference)
# and layout maker, shared with the package's fuzzer (bench/fuzz.py).
from convlower.tools.conv_fuzz import TOL, with_layout

LAYOUTS = ["contiguous", "channels_last", "noncontig"]


def tol(dtype, scale: float = 1.0, rel: float | None = None) -> dict:
    """``assert_close`` keyword arguments for ``dtype`` (``rel`` overrides the table); atol is
    relative to ``scale`` (at least 1)."""
    t = TOL[dtype] if rel is None else rel
    return dict(rtol=t, atol=t * max(1.0, scale))


def assert_close(got, want, *, rel=None, msg=None):
    """``torch.testing.assert_close`` at the table's tolerance, atol scaled by ``want``."""
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    kw = {"msg": (lambda m: f"{msg}: {m}")} if msg else {}
    torch.testing.assert_close(got, want, **tol(want.dtype, scale, rel), **kw)


def clone_leaf(t, requires_grad=True):
    """A detached copy with the same strides (channels-last, strided views), as a new leaf."""
    if t is None:
        return None
    c = t.detach().clone()
    if c.stride() != t.stride():  # clone() makes non-dense views contiguous
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        c.copy_(t.detach())
    return c.requires_grad_(requires_grad)


def run_fwd_bwd(module, x, grad_input=True):
    """Forward + backward with a fixed upstream gradient; returns (out, grads dict).  ``x`` is
    a tensor or a tuple of tensors (None allowed); their grads are "x" or "x0", "x1", ..."""
    inputs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    out = module(*inputs)
    g = torch.linspace(-1, 1, out.numel(), dtype=torch.float32).reshape(out.shape).to(out.dtype)
    if out.requires_grad:
        out.backward(g)
    names = ["x"] if len(inputs) == 1 else [f"x{i}" for i in range(len(inputs))]
    grads = {n: (t.grad if grad_input else None) for n, t in zip(names, inputs) if t is not None}
    if isinstance(module, torch.nn.Module):
        for name, p in module.named_parameters():
            grads[name.replace("_orig_mod.", "")] = p.grad
    return out, grads


def compare_with_eager(module, x, *, options=None, dynamic=False, grad_input=True, backward=True,
                       rel=None):
    """Run eager and convlower on copies (``module`` a module or a function, ``x`` a tensor or
    tuple of tensors); assert equal outputs and grads within :data:`TOL` (or ``rel``).
    Returns the generated code (forward, backward) of the compiled run."""
    m_eager, m_comp = copy.deepcopy(module), copy.deepcopy(module)
    inputs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    xe = tuple(clone_leaf(t, grad_input) for t in inputs)
    xc = tuple(clone_leaf(t, grad_input) for t in inputs)
    compiled = torch.compile(m_comp, backend="convlower", options=options or {"select": "always"},
                             dynamic=dynamic)
    if backward:
        ref, ref_grads = run_fwd_bwd(m_eager, xe, grad_input)
        (out, grads), code = run_and_get_code(lambda: run_fwd_bwd(compiled, xc, grad_input))
    else:
        with torch.no_grad():
            ref = m_eager(*xe)
            out, code = run_and_get_code(compiled, *xc)
        ref_grads, grads = {}, {}
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    assert_close(out, ref, rel=rel)
    for k in ref_grads:
        if ref_grads[k] is None:
            assert grads[k] is None, k
        else:
            assert_close(grads[k], ref_grads[k], rel=rel, msg=k)
    return code


def has_conv(code) -> bool:
    """Whether generated code (a string, or the list of forward/backward sources) still calls
    a convolution kernel; comment lines (the graph Inductor prints) do not count."""
    text = code if isinstance(code, str) else "\n".join(code)
    # A generated kernel may be *named* after the node it replaced (triton_poi_fused_convolution_0
    # on CUDA): a name, not a call.  Any other identifier with "convolution" in it is a call.
    names = (t for line in text.splitlines() if not line.lstrip().startswith("#")
             for t in re.findall(r"[\w.]*convolution[\w.]*", line))
    return any(not n.startswith(("triton_", "cpp_fused_")) for n in names)
