"""A tiny DiT (diffusion transformer) with its attention split over ranks by tokenring.

Non-causal multi-head attention over image patches, adaLN conditioning on the timestep and
class, contiguous layout (non-causal work is balanced without zigzag). The script trains it
for a few steps on 4 CPU ranks and checks the outputs, the loss, every parameter gradient and
the loss curve against the same model run in one process with plain SDPA::

    python examples/dit_tiny.py                    # 4 gloo ranks; prints whether it matches
    python examples/dit_tiny.py --world-size 2 --strategy ring

Legend: B batch, S tokens (patches), s local tokens, H heads, D head dim, C hidden size.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tokenring

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class DiTConfig:
    """Shape of the model and of its inputs."""

    image_size: int = 16
    """Latent image side; S = (image_size / patch_size) ** 2 tokens."""
    patch_size: int = 2
    channels: int = 4
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    num_classes: int = 10

    @property
    def num_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain one-process attention: (B, S, H, D) in and out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps: (B,) -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN modulation of both branches."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        c = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.norm2 = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(c, 4 * c), nn.GELU(approximate="tanh"), nn.Linear(4 * c, c)
        )
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(c, 6 * c))

    def forward(self, x: torch.Tensor, cond: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, s, c = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond).chunk(6, dim=-1)  # (B, C)
        qkv = self.qkv(modulate(self.norm1(x), shift1, scale1))  # (B, s, 3C)
        q, k, v = qkv.view(b, s, 3, self.num_heads, c // self.num_heads).unbind(2)  # (B, s, H, D)
        x = x + gate1[:, None] * self.proj(attend(q, k, v).reshape(b, s, c))
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class TinyDiT(nn.Module):
    """Patch tokens in, predicted noise per patch out; attention through ``attend``."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.hidden_size
        self.patch_embed = nn.Linear(cfg.patch_dim, c)
        self.pos_embed = nn.Embedding(cfg.num_tokens, c)
        self.t_mlp = nn.Sequential(nn.Linear(c, c), nn.SiLU(), nn.Linear(c, c))
        self.y_embed = nn.Embedding(cfg.num_classes, c)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(c, 2 * c))
        self.out = nn.Linear(c, cfg.patch_dim)

    def forward(
        self,
        patches: torch.Tensor,
        positions: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """patches (B, s, patch_dim) at global ``positions`` (s,) -> (B, s, patch_dim)."""
        x = self.patch_embed(patches) + self.pos_embed(positions)[None]  # (B, s, C)
        t_emb = timestep_embedding(t, self.cfg.hidden_size).to(x.dtype)
        cond = self.t_mlp(t_emb) + self.y_embed(y)  # (B, C)
        for block in self.blocks:
            x = block(x, cond, attend)
        shift, scale = self.ada_out(cond).chunk(2, dim=-1)
        return self.out(modulate(self.norm_out(x), shift, scale))


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, Ch, side, side) -> (B, S, Ch * p * p), patches in row-major order."""
    b, ch, side, _ = images.shape
    n = side // patch_size
    x = images.reshape(b, ch, n, patch_size, n, patch_size)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, n * n, ch * patch_size**2)


def make_batch(cfg: DiTConfig, step: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded noisy latents and their noise (the target), the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    batch = 2
    x0 = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, 1000, (batch,), generator=gen)
    y = torch.randint(0, cfg.num_classes, (batch,), generator=gen)
    alpha = torch.cos(t.double() / 1000 * math.pi / 2)[:, None, None, None] ** 2
    x_t = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
    return {
        "patches": patchify(x_t, cfg.patch_size).to(dtype),
        "target": patchify(noise, cfg.patch_size).to(dtype),
        "t": t,
        "y": y,
    }


def build_model(cfg: DiTConfig, dtype: torch.dtype, seed: int = 0) -> TinyDiT:
    torch.manual_seed(seed)
    model = TinyDiT(cfg)
    with torch.no_grad():  # no adaLN-Zero init: zero gates would hide attention from the check
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.to(dtype)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name."""
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad.clone()
    return grads


# -- on the ranks ----------------------------------------------------------------------------


def mean_loss_over_ranks(local_sum: torch.Tensor, num_elements: int) -> torch.Tensor:
    """The global mean over every rank's elements; its gradient is this rank's share."""
    total = local_sum.detach().clone()
    dist.all_reduce(total)
    return total / num_elements + (local_sum - local_sum.detach()) / num_elements


def train_on_ranks(cfg: DiTConfig, dtype_name: str, strategy: str, steps: int) -> dict[str, Any]:
    """One rank: its contiguous shard of the patches, attention over the group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    model = build_model(cfg, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    attend = functools.partial(
        tokenring.sequence_parallel_attn, strategy=strategy, causal=False, layout="contiguous"
    )
    positions = tokenring.global_positions(
        rank=rank, world_size=world_size, layout="contiguous", seq_len=cfg.num_tokens
    )
    result: dict[str, Any] = {"curve": []}
    for step in range(steps):
        batch = make_batch(cfg, step, dtype)
        local = {  # (B, s, patch_dim): this rank's patches, sharded like the positions
            name: tokenring.shard(
                batch[name], rank=rank, world_size=world_size, layout="contiguous"
            )
            for name in ("patches", "target")
        }
        pred = model(local["patches"], positions, batch["t"], batch["y"], attend)  # (B, s, Pd)
        local_sum = F.mse_loss(pred, local["target"], reduction="sum")
        loss = mean_loss_over_ranks(local_sum, batch["target"].numel())
        loss.backward()
        for p in model.parameters():  # each rank's gradient covers its own tokens: sum them
            assert p.grad is not None
            dist.all_reduce(p.grad)
        if step == 0:
            shards = [torch.empty_like(pred) for _ in range(world_size)]
            dist.all_gather(shards, pred.detach().contiguous())
            result["output"] = tokenring.unshard(shards, layout="contiguous")
            result["grads"] = gradients(model)
        opt.step()
        opt.zero_grad()
        result["curve"].append(loss.item())
    return result


# -- in one process --------------------------------------------------------------------------


def train_in_one_process(cfg: DiTConfig, dtype_name: str, steps: int) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    model = build_model(cfg, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    positions = torch.arange(cfg.num_tokens)
    result: dict[str, Any] = {"curve": []}
    for step in range(steps):
        batch = make_batch(cfg, step, dtype)
        pred = model(batch["patches"], positions, batch["t"], batch["y"], sdpa_attend)
        loss = F.mse_loss(pred, batch["target"])
        loss.backward()
        if step == 0:
            result["output"] = pred.detach()
            result["grads"] = gradients(model)
        opt.step()
        opt.zero_grad()
        result["curve"].append(loss.item())
    return result


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Max abs differences: output, every gradient (the largest), the loss curve."""
    grads = [
        (got["grads"][name].double() - g.double()).abs().max().item()
        for name, g in want["grads"].items()
    ]
    return {
        "output": (got["output"].double() - want["output"].double()).abs().max().item(),
        "gradients": max(grads),
        "loss curve": max(abs(a - b) for a, b in zip(got["curve"], want["curve"], strict=True)),
    }


TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--strategy", default="token_ring", help="a tokenring strategy")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--dtype", default="float64", choices=sorted(TOLERANCE))
    parser.add_argument("--image-size", type=int, default=16, help="S = (image-size / 2) ** 2")
    args = parser.parse_args(argv)
    # the ranks import this file by name: what is sent to them must not live in __main__
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    this = importlib.import_module("dit_tiny")
    cfg = this.DiTConfig(image_size=args.image_size)
    per_rank = tokenring.launch(
        this.train_on_ranks,
        cfg,
        args.dtype,
        args.strategy,
        args.steps,
        world_size=args.world_size,
        timeout_s=300,
    )
    want = train_in_one_process(cfg, args.dtype, args.steps)
    tol = TOLERANCE[args.dtype]
    print(
        f"tiny DiT, {cfg.num_tokens} tokens, {cfg.num_heads} heads, {cfg.num_layers} layers, "
        f"{args.dtype}: {args.world_size} ranks ({args.strategy}, contiguous) vs one process"
    )
    print(f"  loss curve, {args.world_size} ranks: {[round(x, 6) for x in per_rank[0]['curve']]}")
    print(f"  loss curve, one process: {[round(x, 6) for x in want['curve']]}")
    ok = True
    for name, diff in compare(per_rank[0], want).items():
        ok &= diff <= tol
        print(f"  max |diff| {name:<11} {diff:.3g}  (tolerance {tol:g})")
    print("MATCHES the single-process run" if ok else "DOES NOT MATCH the single-process run")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
