"""Shared test helpers: compile with convlower, compare with eager (values and grads)."""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=1e-2, atol=1e-2)}


def clone_leaf(t, requires_grad):
    c = t.detach().clone()
    # keep the memory layout of the original (channels-last / strided views)
    if not c.is_contiguous():
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t.detach())
    return c.requires_grad_(requires_grad)


def run_fwd_bwd(module, x, grad_input=True):
    """Forward + backward with a fixed upstream gradient; returns (out, grads dict)."""
    out = module(x)
    g = torch.linspace(-1, 1, out.numel(), dtype=torch.float32).reshape(out.shape).to(out.dtype)
    if out.requires_grad:
        out.backward(g)
    grads = {"x": x.grad if grad_input else None}
    for name, p in module.named_parameters():
        grads[name.replace("_orig_mod.", "")] = p.grad
    return out, grads


def compare_with_eager(module, x, *, options=None, dynamic=False, grad_input=True, backward=True):
    """Run eager and convlower on copies; assert equal outputs and grads.  Returns the
    generated code (forward, backward) of the compiled run."""
    import copy

    dtype = x.dtype
    m_eager = copy.deepcopy(module)
    m_comp = copy.deepcopy(module)
    xe = clone_leaf(x, grad_input)
    xc = clone_leaf(x, grad_input)
    compiled = torch.compile(m_comp, backend="convlower", options=options or {"select": "always"},
                             dynamic=dynamic)
    if backward:
        ref, ref_grads = run_fwd_bwd(m_eager, xe, grad_input)
        (out, grads), code = run_and_get_code(lambda: run_fwd_bwd(compiled, xc, grad_input))
    else:
        with torch.no_grad():
            ref = m_eager(xe)
            out, code = run_and_get_code(compiled, xc)
        ref_grads, grads = {}, {}
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert out.shape == ref.shape
    for k in ref_grads:
        if ref_grads[k] is None:
            assert grads[k] is None, k
        else:
            torch.testing.assert_close(grads[k], ref_grads[k], **TOL[dtype], msg=lambda m: f"{k}: {m}")
    return code


def has_conv(code_list) -> bool:
    """Whether generated code (forward and/or backward) still calls a convolution kernel."""
    return "convolution" in "\n".join(code_list)
