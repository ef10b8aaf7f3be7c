"""A video-length denoising step of a tiny random Flux DiT, its attention split over ranks.

diffusers' ``FluxTransformer2DModel`` (built from a config, random weights) with tokenring's
``FluxSequenceParallelProcessor``: the video latent is a grid of frames x height x width
tokens (RoPE ids (frame, row, column)), sharded contiguously over the ranks; the text prompt
is either replicated on every rank or sharded with the video. Attention is joint and
non-causal. The script runs one forward step both ways on CPU ranks and compares the output
with the same model in one process (diffusers' own processor, SDPA)::

    pip install "tokenring-attention[diffusers]"
    python examples/dit_video.py                  # 4 gloo ranks, 16 x 16 x 16 = 4096 tokens
    python examples/dit_video.py --world-size 2 --frames 8 --strategy ring

Legend: B batch, T text tokens, S video tokens, s local video tokens, Ch latent channels.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import tokenring

LATENT_CHANNELS = 16
TEXT_DIM = 32


def build_model(seed: int = 0) -> Any:
    try:
        from diffusers import FluxTransformer2DModel
    except ImportError as exc:
        raise ImportError(
            "this example needs diffusers: pip install 'tokenring-attention[diffusers]'"
        ) from exc
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # (frame, row, column): sums to the head dim
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.float().eval()


def make_inputs(frames: int, height: int, width: int, text_len: int) -> dict[str, torch.Tensor]:
    """Seeded noisy video latents as tokens and a prompt embedding, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    f, h, w = torch.meshgrid(
        torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"
    )
    num_tokens = frames * height * width
    return {
        "hidden_states": torch.randn(1, num_tokens, LATENT_CHANNELS, generator=gen),  # (B, S, Ch)
        "img_ids": torch.stack([f, h, w], dim=-1).reshape(num_tokens, 3).float(),  # (S, 3)
        "encoder_hidden_states": torch.randn(1, text_len, TEXT_DIM, generator=gen),  # (B, T, .)
        "txt_ids": torch.zeros(text_len, 3),  # Flux gives text position 0
        "pooled_projections": torch.randn(1, TEXT_DIM, generator=gen),
        "timestep": torch.tensor([0.7]),
    }


def step_on_ranks(
    frames: int, height: int, width: int, text_len: int, strategy: str
) -> dict[str, tuple[torch.Tensor, float]]:
    """One rank, the text replicated then sharded: its contiguous shard of the video tokens
    (and of the text if sharded); the gathered output and this rank's step time."""
    return {
        text: step_one(frames, height, width, text_len, text, strategy)
        for text in ("replicated", "sharded")
    }


def step_one(
    frames: int, height: int, width: int, text_len: int, text: str, strategy: str
) -> tuple[torch.Tensor, float]:
    from tokenring.diffusers import FluxSequenceParallelProcessor

    comm = tokenring.get_communicator()
    rank, world_size = comm.rank, comm.world_size
    model = build_model()
    model.set_attn_processor(FluxSequenceParallelProcessor(text=text, strategy=strategy))
    inputs = make_inputs(frames, height, width, text_len)

    def mine(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        return tokenring.shard(
            x, rank=rank, world_size=world_size, layout="contiguous", seq_dim=seq_dim
        )

    text_part = {
        "encoder_hidden_states": inputs["encoder_hidden_states"],
        "txt_ids": inputs["txt_ids"],
    }
    if text == "sharded":
        text_part = {
            "encoder_hidden_states": mine(inputs["encoder_hidden_states"], 1),
            "txt_ids": mine(inputs["txt_ids"], 0),
        }
    comm.barrier(label="start")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(
            hidden_states=mine(inputs["hidden_states"], 1),  # (B, s, Ch)
            img_ids=mine(inputs["img_ids"], 0),
            pooled_projections=inputs["pooled_projections"],
            timestep=inputs["timestep"],
            joint_attention_kwargs={"text_seq_len": text_len} if text == "replicated" else None,
            **text_part,
        ).sample  # (B, s, Ch)
    elapsed_s = time.perf_counter() - start
    shards = comm.all_gather(out.contiguous(), label="output")
    return tokenring.unshard(shards, layout="contiguous"), elapsed_s


def step_in_one_process(frames: int, height: int, width: int, text_len: int) -> torch.Tensor:
    model = build_model()  # diffusers' own FluxAttnProcessor
    with torch.no_grad():
        return model(**make_inputs(frames, height, width, text_len)).sample  # (B, S, Ch)


TOLERANCE = 1e-4  # float32


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--strategy", default="token_ring", help="a tokenring strategy")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--height", type=int, default=16, help="latent rows per frame")
    parser.add_argument("--width", type=int, default=16, help="latent columns per frame")
    parser.add_argument("--text-len", type=int, default=32, help="prompt tokens")
    args = parser.parse_args(argv)
    num_tokens = args.frames * args.height * args.width
    # the ranks import this file by name: what is sent to them must not live in __main__
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    this = importlib.import_module("dit_video")
    shape = (args.frames, args.height, args.width, args.text_len)
    want = step_in_one_process(*shape)
    print(
        f"tiny Flux DiT, video {args.frames}x{args.height}x{args.width} = {num_tokens} tokens "
        f"+ {args.text_len} text tokens, float32, non-causal joint attention: "
        f"{args.world_size} ranks ({args.strategy}, contiguous) vs one process"
    )
    per_rank = tokenring.launch(
        this.step_on_ranks, *shape, args.strategy, world_size=args.world_size, timeout_s=600
    )
    ok = True
    for text in ("replicated", "sharded"):
        got, elapsed_s = per_rank[0][text][0], max(r[text][1] for r in per_rank)
        diff = (got - want).abs().max().item()
        ok &= diff <= TOLERANCE
        print(
            f"  text {text:<10}  max |diff| {diff:.3g}  (tolerance {TOLERANCE:g})  "
            f"step {elapsed_s:.2f} s"
        )
    print("MATCHES the single-process run" if ok else "DOES NOT MATCH the single-process run")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
