"""The tiny float64 Flux transformer the diffusers audits run on 2 ranks, and its inputs'
rows per rank (test_diffusers_usage_audit, test_diffusers_audit3, test_compile_audit2).

Legend: B = 2 batch, S = IMAGE image tokens, T = TEXT text tokens, C channels.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxTransformer2DModel

WORLD_SIZE = 2
IMAGE = 24
TEXT = 6  # divisible by 2: sharded text
FLUX = {
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 8,
    "pooled_projection_dim": 8,
    "axes_dims_rope": (2, 2, 4),
}


def build_model(
    guidance: bool = False, seed: int = 0, num_blocks: int = 2
) -> FluxTransformer2DModel:
    """The model of ``seed``, its weights spread wider than the default init; ``num_blocks``
    double-stream and as many single-stream blocks."""
    torch.manual_seed(seed)
    blocks = dict(num_layers=num_blocks, num_single_layers=num_blocks)
    model = FluxTransformer2DModel(**(FLUX | blocks), guidance_embeds=guidance)
    with torch.no_grad():  # break symmetric inits (zeros, ones) so every path is exercised
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.double()


def rows(n: int, rank: int, world_size: int = WORLD_SIZE) -> slice:
    """Rank's contiguous rows of n (n divisible by world_size here)."""
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


def model_inputs(
    guidance: bool = False, num_text: int = TEXT, weight: bool = False
) -> dict[str, Any]:
    """Seeded float64 inputs of the whole sequence; ``guidance`` for a guidance-embedding
    model, ``weight`` adds per-entry loss weights (B, S, 4), drawn last."""
    gen = torch.Generator().manual_seed(1)
    f64 = torch.float64
    inputs = {
        "hidden_states": torch.randn(2, IMAGE, 4, generator=gen, dtype=f64),  # (B, S, 4)
        "encoder_hidden_states": torch.randn(2, num_text, 8, generator=gen, dtype=f64),
        "pooled_projections": torch.randn(2, 8, generator=gen, dtype=f64),
        "timestep": torch.rand(2, generator=gen, dtype=f64),
        "img_ids": torch.randn(IMAGE, 3, generator=gen, dtype=f64),  # distinct positions
        "txt_ids": torch.randn(num_text, 3, generator=gen, dtype=f64),
    }
    if guidance:
        inputs["guidance"] = torch.tensor([3.5, 2.0], dtype=f64)
    if weight:
        inputs["weight"] = torch.randn(2, IMAGE, 4, generator=gen, dtype=f64)
    return inputs


def local_inputs(
    inputs: dict[str, Any], rank: int, text: str, text_seq_len: int | None = None
) -> dict[str, Any]:
    """Rank's image rows (and text rows with ``text="sharded"``) of the model's inputs;
    ``text_seq_len`` for the processor, in ``joint_attention_kwargs``."""
    img = rows(IMAGE, rank)
    mine = inputs | {"hidden_states": inputs["hidden_states"][:, img]}
    mine["img_ids"] = inputs["img_ids"][img]
    if text == "sharded":
        txt = rows(inputs["txt_ids"].shape[0], rank)
        mine["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, txt]
        mine["txt_ids"] = inputs["txt_ids"][txt]
    if text_seq_len is not None:
        mine["joint_attention_kwargs"] = {"text_seq_len": text_seq_len}
    return mine
