"""diffusers AutoencoderKLWan (small explicit config, random weights): encode + decode.

Compiled with select="exhaustive" and a stub timer making each conv pick a different candidate
(every Conv3d rule and the original), the result matches eager.  Wan's causal convs pad with
F.pad before a padding-0 Conv3d, so this also exercises pad folding on a real model.  Five frames: the first chunk and one chunk of four
(the time-downsampling (3,1,1) stride-2 conv and the feature caches run).
"""
from __future__ import annotations

import pytest
import torch

import convlower

diffusers = pytest.importorskip("diffusers")

CONFIG = dict(base_dim=32, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
              temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)

# Measured selection (exhaustive: every conv timed) with a stub timer that makes a different
# candidate win at each conv, or none: one compile mixes every Conv3d rule and the original,
# which forcing each rule would take three compiles of a minute or more each to cover.  Real
# compiled timings are tested on single convs in test_selection.py.
OPTIONS = {"select": "exhaustive"}
MUST_LOWER = {"time_fold_conv2d", "time_unfold_conv2d", "time_sum_conv2d"}


def rotating_timer():
    """Per measured conv, the next of (original, rule 1, rule 2, ...) in turn is fastest."""
    state = {"conv": -1, "aten_fn": None, "order": []}

    def timer(label, fn, budget_s):
        if label == "aten" and fn is not state["aten_fn"]:  # a new conv (fn kept alive here)
            state.update(conv=state["conv"] + 1, aten_fn=fn, order=[])
        if label not in state["order"]:
            state["order"].append(label)
        winner = state["conv"] % 4  # 0: the original
        return 0.5 if state["order"].index(label) == winner else 1.0

    return timer


@pytest.fixture(scope="module")
def vae_and_input():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(**CONFIG).eval()
    x = torch.randn(1, 3, 5, 16, 16)
    with torch.no_grad():
        ref = vae.decode(vae.encode(x).latent_dist.mode()).sample
    return vae, x, ref


@pytest.mark.slow
def test_wan_vae_encode_decode_matches_eager(vae_and_input, cache):
    from convlower import selection

    vae, x, ref = vae_and_input
    selection.set_timer(rotating_timer())  # cold cache (fixture): every conv really measured
    f = torch.compile(lambda v: vae.decode(vae.encode(v).latent_dist.mode()).sample,
                      backend="convlower", options=OPTIONS)
    with torch.no_grad():
        out = f(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    entries = [e for e in convlower.report().convolutions if len(e["call"]["weight"]) == 5]
    assert entries, "no Conv3d seen"
    lowered = [e for e in entries if e["rule"]]
    assert MUST_LOWER <= {e["rule"] for e in lowered}, entries
    assert not [e for e in entries if "fell back" in e["reason"]]
    measured = [e for e in entries if e["timings"]]
    assert measured and all("aten" in e["timings"] for e in measured)
    assert any(e["rule"] is None and "kept the original" in e["reason"] for e in measured)
    assert any(e.get("pad_folded") for e in lowered)  # Wan's causal F.pad was folded
