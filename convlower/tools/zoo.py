"""The spike's model zoo: real model parts built from small explicit configs, random weights.

Nothing is downloaded: every entry builds its module from the config written below (with a
fixed seed), so a spike is reproducible offline.  Each entry has two sizes:

* ``tiny``  - seconds to compile, for tests;
* ``small`` - the shapes that matter (a real layer's channel counts where that is cheap
  enough on a CPU), for the benchmark and the demo.

``build(name, size)`` returns ``(model, example_inputs)``: the model returns a plain tensor
(wrappers unpack diffusers / transformers output objects), the inputs are a tuple passed as
``model(*example_inputs)``.  ``--list`` on the command line prints the same table as
:func:`describe`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

SIZES = ("tiny", "small")
DEFAULT = "qwen2.5-vl-patch-embed"


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    summary: str  # what the model is and what the spike is expected to show
    configs: dict[str, dict[str, Any]]  # size -> the config the builder uses
    builder: Callable[[dict[str, Any]], tuple[nn.Module, tuple]]
    needs: str = ""  # the optional package the entry imports

    def build(self, size: str = "small") -> tuple[nn.Module, tuple]:
        if size not in self.configs:
            raise ValueError(f"unknown size {size!r} for zoo model {self.name!r}; "
                             f"valid sizes: {', '.join(self.configs)}")
        torch.manual_seed(0)
        model, inputs = self.builder(dict(self.configs[size]))
        return model.eval(), tuple(inputs)


class _Output(nn.Module):
    """Calls ``inner`` and returns one tensor from its output object (``.sample`` etc.)."""

    def __init__(self, inner: nn.Module, field: str, method: str = "forward"):
        super().__init__()
        self.inner, self.field, self.method = inner, field, method

    def forward(self, *args):
        out = getattr(self.inner, self.method)(*args)
        return getattr(out, self.field)


# -- qwen2.5-vl-patch-embed ------------------------------------------------------------------
def _qwen_patch_embed(c):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    m = Qwen2_5_VisionPatchEmbed(patch_size=c["patch_size"], temporal_patch_size=c["temporal_patch_size"],
                                 in_channels=3, embed_dim=c["embed_dim"])
    k = 3 * c["temporal_patch_size"] * c["patch_size"] ** 2
    return m, (torch.randn(c["patches"], k),)


# -- qwen2.5-vl-vision -----------------------------------------------------------------------
def _qwen_vision(c):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)

    grid = c.pop("grid_thw")
    cfg = Qwen2_5_VLVisionConfig(**c)
    cfg._attn_implementation = "sdpa"
    m = Qwen2_5_VisionTransformerPretrainedModel(cfg)
    t, h, w = grid
    k = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
    return _Output(m, "pooler_output"), (torch.randn(t * h * w, k), torch.tensor([grid]))


# -- wan-vae ---------------------------------------------------------------------------------
_WAN_VAE = {"tiny": dict(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                         temperal_downsample=[True], latent=[1, 4, 2, 4, 4]),
            "small": dict(base_dim=32, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                          temperal_downsample=[False, True, True], latent=[1, 16, 2, 8, 8])}


def _latent_frames(configs: dict, frames: int) -> dict:
    """``configs`` with ``frames`` latent frames: the same decoder on a longer clip."""
    return {size: dict(c, latent=[*c["latent"][:2], frames, *c["latent"][3:]])
            for size, c in configs.items()}


def _wan_vae(c):
    from diffusers import AutoencoderKLWan

    latent = c.pop("latent")
    m = AutoencoderKLWan(**c)
    return _Output(m, "sample", "decode"), (torch.randn(latent),)


# -- mochi-downsample ------------------------------------------------------------------------
def _mochi_downsample(c):
    m = nn.Conv3d(c["in_channels"], c["out_channels"], kernel_size=2, stride=2)
    return m, (torch.randn(c["input"]),)


# -- oobleck ---------------------------------------------------------------------------------
def _oobleck(c):
    from diffusers import AutoencoderOobleck

    latent = c.pop("latent")
    m = AutoencoderOobleck(**c)
    return _Output(m, "sample", "decode"), (torch.randn(latent),)


# -- sdxl-unet-tiny --------------------------------------------------------------------------
class _SDXLUNet(nn.Module):
    """Positional inputs for UNet2DConditionModel's SDXL conditioning (``added_cond_kwargs``)."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        return self.unet(sample, timestep, encoder_hidden_states,
                         added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample


def _sdxl_unet(c):
    from diffusers import UNet2DConditionModel

    latent, tokens, text_dim = c.pop("latent"), c.pop("tokens"), c.pop("text_embeds_dim")
    unet = UNet2DConditionModel(
        **c, addition_embed_type="text_time",
        projection_class_embeddings_input_dim=text_dim + 6 * c["addition_time_embed_dim"])
    n = latent[0]
    inputs = (torch.randn(latent), torch.tensor([500.0] * n),
              torch.randn(n, tokens, c["cross_attention_dim"]), torch.randn(n, text_dim),
              torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]] * n))
    return _SDXLUNet(unet), inputs


# -- wan-dit-patch ---------------------------------------------------------------------------
class WanPatchEmbed(nn.Module):
    """WanTransformer3DModel's patch embedding: Conv3d(kernel == stride == patch) then tokens."""

    def __init__(self, in_channels: int, dim: int, patch_size: tuple[int, int, int]):
        super().__init__()
        self.patch_embedding = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, latent):
        return self.patch_embedding(latent).flatten(2).transpose(1, 2)


def _wan_dit_patch(c):
    return WanPatchEmbed(c["in_channels"], c["dim"], tuple(c["patch_size"])), (torch.randn(c["latent"]),)


# -- wan-dit-stack ---------------------------------------------------------------------------
class _WanDiT(nn.Module):
    """WanTransformer3DModel with positional inputs, returning the sample."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, latent, timestep, text):
        return self.inner(latent, timestep, text, return_dict=False)[0]


def _wan_dit_stack(c):
    from diffusers import WanTransformer3DModel

    latent, tokens = c.pop("latent"), c.pop("tokens")
    m = WanTransformer3DModel(**c)
    return _WanDiT(m), (torch.randn(latent), torch.tensor([500.0] * latent[0]),
                        torch.randn(latent[0], tokens, c["text_dim"]))


def _vit_patch_embed(c):
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTPatchEmbeddings

    m = ViTPatchEmbeddings(ViTConfig(image_size=c["image"], patch_size=c["patch"], num_channels=3,
                                     hidden_size=c["hidden"]))
    return m, (torch.randn(c["batch"], 3, c["image"], c["image"]),)


_SDXL_COMMON = dict(
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn", use_linear_projection=True, layers_per_block=1)

# SDXL's block layout: no attention at the first level, deeper transformer stacks below.
_SDXL_LAYOUT = dict(
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn", use_linear_projection=True, layers_per_block=2)

ZOO: dict[str, Entry] = {e.name: e for e in [
    Entry("qwen2.5-vl-patch-embed",
          "Qwen2.5-VL vision patch embedding: Conv3d kernel == stride == input (2,14,14); "
          "expected: lowered to one mm. small = the real layer (embed 1280), 256 patches.",
          {"tiny": dict(patch_size=14, temporal_patch_size=2, embed_dim=32, patches=16),
           "small": dict(patch_size=14, temporal_patch_size=2, embed_dim=1280, patches=256)},
          _qwen_patch_embed, "transformers"),
    Entry("qwen2.5-vl-vision",
          "Qwen2.5-VL vision tower (transformers Qwen2_5_VisionTransformerPretrainedModel), few "
          "layers, window + full attention, merger; the patch embed is its only conv.",
          {"tiny": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                        fullatt_block_indexes=[0], grid_thw=[1, 4, 4]),
           "small": dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16,
                         out_hidden_size=2048, patch_size=14, temporal_patch_size=2,
                         spatial_merge_size=2, window_size=112, fullatt_block_indexes=[1],
                         grid_thw=[1, 16, 16])},
          _qwen_vision, "transformers"),
    Entry("vit-patch-embed",
          "ViT / timm-style patch embedding (transformers ViTPatchEmbeddings): Conv2d(3 -> 384, "
          "kernel = stride = 16) on 224x224; a close call on a CPU (patchify_mm or the original).",
          {"tiny": dict(image=32, patch=8, hidden=16, batch=1),
           "small": dict(image=224, patch=16, hidden=384, batch=8)},
          _vit_patch_embed, "transformers"),
    Entry("wan-vae",
          "Wan2.1 video VAE decoder (diffusers AutoencoderKLWan.decode), causal 3x3x3 Conv3d, "
          "frame-by-frame with a feature cache; Wan's structure at reduced width.",
          _WAN_VAE, _wan_vae, "diffusers"),
    Entry("wan-vae-clip",
          "The same Wan2.1 VAE decoder on a clip of 8 latent frames (29 video frames; Wan "
          "decodes 21): from the third frame on, each frame's decoder blocks repeat, so regions "
          "compile them once (docs/regions.md).",
          _latent_frames(_WAN_VAE, 8), _wan_vae, "diffusers"),
    Entry("mochi-downsample",
          "Mochi VAE encoder downsample: Conv3d(128 -> 256, kernel = stride = (2,2,2)); "
          "eligible for patchify_mm and all three Conv3d rules; measurement picks one or keeps "
          "the original.",
          {"tiny": dict(in_channels=8, out_channels=16, input=[1, 8, 4, 8, 8]),
           "small": dict(in_channels=128, out_channels=256, input=[1, 128, 8, 32, 32])},
          _mochi_downsample),
    Entry("oobleck",
          "Stable Audio Oobleck VAE decoder (diffusers AutoencoderOobleck.decode): Conv1d, "
          "ConvTranspose1d and Snake activations.",
          {"tiny": dict(encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
                        decoder_channels=8, decoder_input_channels=4, audio_channels=2,
                        latent=[1, 4, 8]),
           "small": dict(encoder_hidden_size=32, downsampling_ratios=[2, 4, 4], channel_multiples=[1, 2, 4],
                         decoder_channels=32, decoder_input_channels=16, audio_channels=2,
                         latent=[1, 16, 32])},
          _oobleck, "diffusers"),
    Entry("sdxl-unet-tiny",
          "diffusers UNet2DConditionModel with SDXL block types and text_time conditioning, "
          "scaled down; a control: its 3x3 convs are eligible for no rule, only its 1x1 "
          "shortcut convs are (patchify_mm), lowered only where measured faster.",
          {"tiny": dict(_SDXL_COMMON, block_out_channels=(8, 16), norm_num_groups=4,
                        attention_head_dim=4, transformer_layers_per_block=(1, 1),
                        cross_attention_dim=8, addition_time_embed_dim=4, text_embeds_dim=8,
                        tokens=4, latent=[1, 4, 8, 8]),
           "small": dict(_SDXL_COMMON, block_out_channels=(64, 128), norm_num_groups=32,
                         attention_head_dim=8, transformer_layers_per_block=(1, 2),
                         cross_attention_dim=64, addition_time_embed_dim=32, text_embeds_dim=64,
                         tokens=16, latent=[1, 4, 32, 32])},
          _sdxl_unet, "diffusers"),
    Entry("sdxl-unet",
          "diffusers UNet2DConditionModel in SDXL's block layout (3 levels, attention at the "
          "lower two, transformer depth 1/2/4 here for SDXL's 1/2/10, text_time conditioning), "
          "narrow; the model regions (compile each repeated block once) are for.",
          {"tiny": dict(_SDXL_LAYOUT, block_out_channels=(8, 16, 32), norm_num_groups=4,
                        attention_head_dim=(2, 2, 4), transformer_layers_per_block=(1, 1, 2),
                        cross_attention_dim=8, addition_time_embed_dim=4, text_embeds_dim=8,
                        tokens=4, latent=[1, 4, 16, 16]),
           "small": dict(_SDXL_LAYOUT, block_out_channels=(32, 64, 128), norm_num_groups=32,
                         attention_head_dim=(2, 4, 8), transformer_layers_per_block=(1, 2, 4),
                         cross_attention_dim=64, addition_time_embed_dim=16, text_embeds_dim=64,
                         tokens=16, latent=[1, 4, 32, 32])},
          _sdxl_unet, "diffusers"),
    Entry("wan-dit-stack",
          "diffusers WanTransformer3DModel (Wan2.1 DiT): patch embedding, a stack of identical "
          "transformer blocks, head; narrow and shallow.",
          {"tiny": dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, in_channels=4,
                        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, latent=[1, 4, 2, 8, 8],
                        tokens=4),
           "small": dict(num_layers=8, num_attention_heads=4, attention_head_dim=32, in_channels=16,
                         out_channels=16, text_dim=64, freq_dim=64, ffn_dim=256,
                         latent=[1, 16, 3, 16, 16], tokens=16)},
          _wan_dit_stack, "diffusers"),
    Entry("wan-dit-patch",
          "Wan2.1 DiT patch embedding (WanTransformer3DModel.patch_embedding + tokens): "
          "Conv3d(16 -> 1536, kernel = stride = (1,2,2)); eligible for patchify_mm and the "
          "Conv3d rules; measurement decides.",
          {"tiny": dict(in_channels=4, dim=32, patch_size=[1, 2, 2], latent=[1, 4, 2, 8, 8]),
           "small": dict(in_channels=16, dim=1536, patch_size=[1, 2, 2], latent=[1, 16, 5, 32, 32])},
          _wan_dit_patch),
]}


def names() -> list[str]:
    return list(ZOO)


def build(name: str, size: str = "small") -> tuple[nn.Module, tuple]:
    """Build zoo model ``name`` at ``size``; raise ``KeyError`` naming the valid models."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; zoo models: {', '.join(ZOO)}")
    return ZOO[name].build(size)


def describe() -> str:
    """The zoo as text: name, summary, and the config of each size."""
    out = []
    for e in ZOO.values():
        mark = " (default)" if e.name == DEFAULT else ""
        out.append(f"{e.name}{mark}\n    {e.summary}")
        for size, cfg in e.configs.items():
            out.append(f"    {size}: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    return "\n".join(out)
