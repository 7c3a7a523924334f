"""Bad input: convlower gives eager's result or raises eager's error, never a wrong result.

Integer and complex dtypes, meta tensors, mismatched input/weight dtypes, zero channels.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convlower


def patch_conv(x, w):  # patchify-eligible: kernel == stride, no padding
    return F.conv2d(x, w, stride=2)


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - the error itself is what is compared
        return None, e


def _fell_back():
    return [c for c in convlower.report().convolutions if "fell back" in c["reason"]]


CASES = {
    "int64": lambda: (torch.randint(-5, 5, (2, 4, 8, 8)), torch.randint(-5, 5, (8, 4, 2, 2))),
    "complex64": lambda: (torch.randn(2, 4, 8, 8, dtype=torch.complex64),
                          torch.randn(8, 4, 2, 2, dtype=torch.complex64)),
    "meta": lambda: (torch.empty(2, 4, 8, 8, device="meta"), torch.empty(8, 4, 2, 2, device="meta")),
    "float64 input, float32 weight": lambda: (torch.randn(2, 4, 8, 8, dtype=torch.float64),
                                              torch.randn(8, 4, 2, 2)),
    "zero in-channels": lambda: (torch.randn(2, 0, 8, 8), torch.randn(8, 0, 2, 2)),
    "zero out-channels": lambda: (torch.randn(2, 4, 8, 8), torch.randn(0, 4, 2, 2)),
    "zero batch": lambda: (torch.randn(0, 4, 8, 8), torch.randn(8, 4, 2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_result_or_same_error_as_eager(case):
    x, w = CASES[case]()
    ref, ref_err = _outcome(patch_conv, x, w)
    out, err = _outcome(torch.compile(patch_conv, backend="convlower",
                                      options={"select": "always"}), x, w)
    if ref_err is not None:
        torch._dynamo.reset()
        stock, stock_err = _outcome(torch.compile(patch_conv, backend="inductor"), x, w)
        if stock_err is None:  # torch < 2.13 lets Inductor compute it: convlower does the same
            assert err is None, (stock, err)
            torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)
            assert not _fell_back(), _fell_back()
            return
        assert err is not None, f"eager raised {ref_err!r}, convlower returned a result"
        assert isinstance(err, type(ref_err)), (ref_err, err)
        # Dynamo reports the error while tracing, before any backend runs: the same error as
        # torch.compile with the plain "eager" backend
        torch._dynamo.reset()
        _, stock_err = _outcome(torch.compile(patch_conv, backend="eager"), x, w)
        assert type(stock_err) is type(err) and str(stock_err) == str(err), (stock_err, err)
        return
    assert err is None, err
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    if ref.device.type != "meta":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not _fell_back(), _fell_back()  # bad input is rejected by a proof, not by a crash
