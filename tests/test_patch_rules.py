"""patch_linear and patchify_mm: values and gradients equal eager; no convolution left."""
import pytest
import torch

import convlower
from helpers import LAYOUTS, compare_with_eager, has_conv, with_layout

CONV = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


def rules_used():
    return {(c["phase"], c["rule"]) for c in convlower.report().convolutions}


# (ndim, in_ch, out_ch, kernel, stride, padding, input spatial size) -> the rule expected
PATCHIFY = [
    (1, 4, 6, 3, 3, 0, (10,)),            # remainder 1 dropped
    (2, 4, 6, (2, 3), (2, 3), 0, (8, 10)),  # remainder in W
    (2, 5, 7, 1, 1, 0, (5, 6)),           # pointwise
    (3, 3, 8, (1, 2, 2), (1, 2, 2), 0, (3, 6, 5)),  # DiT-style
]
PATCH_LINEAR = [
    (1, 4, 6, 5, 5, 0, (5,)),
    (2, 3, 8, 4, 4, 0, (4, 4)),
    (2, 3, 8, 6, 1, 1, (4, 4)),            # padded: kernel covers the padded input
    (3, 3, 16, (2, 4, 4), (2, 4, 4), 0, (2, 4, 4)),  # Qwen-VL shape, scaled down
]


class WithAndWithoutBias(torch.nn.Module):
    """The same conv with and without a bias on one input: one compile covers both emissions
    (addmm and mm), each lowered and checked on its own (four report entries)."""

    def __init__(self, nd, cin, cout, k, s, p):
        super().__init__()
        self.biased = CONV[nd](cin, cout, k, stride=s, padding=p, bias=True)
        self.plain = CONV[nd](cin, cout, k, stride=s, padding=p, bias=False)

    def forward(self, x):
        return torch.stack([self.biased(x), self.plain(x)])


def check_lowered_with_and_without_bias(case, kind, batch, rule):
    nd, cin, cout, k, s, p, size = case
    torch.manual_seed(0)
    x = with_layout(torch.randn(batch, cin, *size), kind)
    code = compare_with_eager(WithAndWithoutBias(nd, cin, cout, k, s, p), x)
    assert not has_conv(code)
    entries = convlower.report().convolutions
    fwd = [(e["rule"], e["call"]["bias"]) for e in entries if e["phase"] == "forward"]
    bwd = [(e["rule"], e["output_mask"][2]) for e in entries if e["phase"] == "backward"]
    assert sorted(fwd) == sorted(bwd) == [(rule, False), (rule, True)], entries


@pytest.mark.parametrize("case", PATCHIFY, ids=lambda c: f"{c[0]}d-k{c[3]}")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_patchify_mm_matches_eager(case, kind):
    check_lowered_with_and_without_bias(case, kind, 2, "patchify_mm")


@pytest.mark.parametrize("case", PATCH_LINEAR, ids=lambda c: f"{c[0]}d-k{c[3]}-p{c[5]}")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_patch_linear_matches_eager(case, kind):
    check_lowered_with_and_without_bias(case, kind, 3, "patch_linear")


@pytest.mark.parametrize("batch", [0, 1, 5])
@pytest.mark.parametrize("case", [PATCHIFY[3], PATCH_LINEAR[3]], ids=["patchify", "patch_linear"])
def test_batch_sizes(case, batch):
    nd, cin, cout, k, s, p, size = case
    m = CONV[nd](cin, cout, k, stride=s, padding=p)
    code = compare_with_eager(m, torch.randn(batch, cin, *size))
    assert not has_conv(code)


@pytest.mark.vectorized  # bf16 through Inductor's vectorised CPU kernels
@pytest.mark.parametrize("case", [PATCHIFY[1], PATCH_LINEAR[3]], ids=["patchify", "patch_linear"])
def test_bf16(case):
    nd, cin, cout, k, s, p, size = case
    torch.manual_seed(0)
    m = CONV[nd](cin, cout, k, stride=s, padding=p).to(torch.bfloat16)
    code = compare_with_eager(m, torch.randn(4, cin, *size, dtype=torch.bfloat16))
    assert not has_conv(code)


@pytest.mark.parametrize("conv", [
    torch.nn.Conv2d(3, 4, 3, stride=1, padding=1),          # overlapping windows
    torch.nn.Conv2d(4, 4, 2, stride=2, groups=2),           # groups
    torch.nn.Conv2d(3, 4, 2, stride=2, dilation=2),         # dilated kernel > 1
    torch.nn.ConvTranspose2d(3, 4, 2, stride=2),            # transposed
], ids=["overlap", "groups", "dilation", "transposed"])
def test_ineligible_convs_are_left_alone(conv):
    x = torch.randn(2, conv.in_channels, 8, 8)
    code = compare_with_eager(conv, x)
    assert has_conv(code)
    entries = convlower.report().convolutions
    assert entries and all(e["rule"] is None for e in entries)
    # no lowering accepts them (eager_conv, the original as eager calls it, may: never forced)
    assert all(v["rejected"] for e in entries for v in e["verdicts"] if v["rule"] != "eager_conv")


def test_rejection_reasons_are_specific():
    conv = torch.nn.Conv2d(3, 4, 2, stride=2, padding=1)
    compare_with_eager(conv, torch.randn(1, 3, 8, 8), backward=False)
    (entry,) = convlower.report().convolutions
    reasons = {v["rule"]: v["rejected"] for v in entry["verdicts"]}
    assert reasons["patchify_mm"] == "padding[0] == 0 is false"
    assert reasons["patch_linear"].startswith("size[0] + 2*padding[0] == kernel[0] is false")


class Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))

    def forward(self, x):
        return self.proj(x).flatten(1)


def test_frozen_weights_only_grad_input():
    m = Frozen().requires_grad_(False)
    code = compare_with_eager(m, torch.randn(4, 3, 2, 4, 4))
    assert not has_conv(code)
    assert {e["phase"] for e in convlower.report().lowered()} == {"forward", "backward"}


def test_frozen_input_only_weight_grads():
    m = Frozen()
    code = compare_with_eager(m, torch.randn(4, 3, 2, 4, 4), grad_input=False)
    assert not has_conv(code)


class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, 2, stride=2)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda t: self.proj(t).relu(), x, use_reentrant=False)


def test_activation_checkpointing():
    code = compare_with_eager(Checkpointed(), torch.randn(2, 3, 6, 6))
    assert not has_conv(code)


def test_options_rules_none_keeps_convolution():
    code = compare_with_eager(Frozen(), torch.randn(2, 3, 2, 4, 4), options={"rules": "none"})
    assert has_conv(code)
    assert all(e["rule"] is None for e in convlower.report().convolutions)


def test_options_select_one_rule():
    m = torch.nn.Conv2d(3, 8, 4, stride=4)
    compare_with_eager(m, torch.randn(2, 3, 4, 4), options={"rules": ["patchify_mm"], "select": "always"})
    assert {e["rule"] for e in convlower.report().convolutions} == {"patchify_mm"}
