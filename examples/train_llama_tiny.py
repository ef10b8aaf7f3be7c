"""Train a tiny Llama (Hugging Face transformers) with tokenring sequence parallelism.

Every rank holds a zigzag shard of each sequence; the model runs with
``attn_implementation="tokenring"`` (or any of ``tokenring.hf.ATTN_IMPLEMENTATIONS``). The
script trains a few steps, trains the same model in one process with transformers' SDPA, and
prints whether the loss curves match, with the time per step of each::

    python examples/train_llama_tiny.py                  # spawns 4 CPU ranks (gloo) itself
    torchrun --nproc-per-node 4 examples/train_llama_tiny.py
    python examples/train_llama_tiny.py --attn tokenring_ring --seq-len 1024 --dtype float32

Needs ``pip install "tokenring-attention[hf]"``. The model is built from a config in code (no
downloads).

Legend: B batch, S global seq, s local seq, V vocab, P world size.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from tokenring import hf


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """What to train, how long, and how it is split."""

    attn: str = "tokenring"
    """A name from ``tokenring.hf.ATTN_IMPLEMENTATIONS``."""
    layout: str = "zigzag"
    seq_len: int = 128
    batch: int = 2
    steps: int = 4
    dtype: str = "float64"
    lr: float = 3e-3
    device: str = "cpu"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 128


def build_model(cfg: TrainConfig, attn_implementation: str) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same weights in every process
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(device=cfg.device, dtype=getattr(torch, cfg.dtype))


def make_batch(cfg: TrainConfig, step: int) -> torch.Tensor:
    """Token ids (B, S): arithmetic progressions mod V, so there is something to learn."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, cfg.vocab_size, (cfg.batch, 1), generator=gen)
    stride = torch.randint(1, 8, (cfg.batch, 1), generator=gen)
    ids = (start + stride * torch.arange(cfg.seq_len)) % cfg.vocab_size
    return ids.to(cfg.device)


def barrier_time() -> float:
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter()


def train_on_ranks(cfg: TrainConfig) -> dict[str, Any]:
    """One rank's training loop (also the body of each torchrun process)."""
    hf.register()
    model = build_model(cfg, cfg.attn)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sp = hf.SequenceParallel(layout=cfg.layout)
    curve, step_s = [], []
    for step in range(cfg.steps):
        ids = make_batch(cfg, step)
        start = barrier_time()
        batch = hf.shard_batch(sp, ids, labels=ids)  # (B, s) ids and labels, (1, s) positions
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ).logits  # (B, s, V)
        assert batch.shift_labels is not None
        loss = hf.causal_lm_loss(sp, logits, batch.shift_labels)  # the global mean
        loss.backward()
        hf.all_reduce_gradients(sp, model)  # each rank saw its own tokens only
        opt.step()
        opt.zero_grad()
        step_s.append(barrier_time() - start)
        curve.append(loss.item())
    return {"curve": curve, "step_s": step_s}


def train_in_one_process(cfg: TrainConfig) -> dict[str, Any]:
    """The same steps on the whole sequence with transformers' SDPA attention."""
    model = build_model(cfg, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    curve, step_s = [], []
    for step in range(cfg.steps):
        ids = make_batch(cfg, step)
        start = time.perf_counter()
        logits = model(input_ids=ids).logits  # (B, S, V)
        acc = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size).to(acc), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
        curve.append(loss.item())
    return {"curve": curve, "step_s": step_s}


TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2}


def report(cfg: TrainConfig, world_size: int, ranks: list[dict[str, Any]]) -> int:
    """Print both curves and step times; 0 when the curves match within the dtype's tolerance."""
    one = train_in_one_process(cfg)
    # a step takes as long as its slowest rank; the first step is a warm-up
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(cfg.steps)]
    diff = max(abs(a - b) for a, b in zip(ranks[0]["curve"], one["curve"], strict=True))
    tol = TOLERANCE[cfg.dtype]
    print(
        f"tiny Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_heads}/{cfg.num_kv_heads}), B={cfg.batch} S={cfg.seq_len} {cfg.dtype} "
        f"on {cfg.device}: {world_size} ranks ({cfg.attn}, {cfg.layout}) vs one process (sdpa)"
    )
    print(f"{'step':>4} {'loss, ' + str(world_size) + ' ranks':>18} {'loss, 1 process':>18}")
    for i, (a, b) in enumerate(zip(ranks[0]["curve"], one["curve"], strict=True)):
        print(f"{i:>4} {a:>18.12f} {b:>18.12f}")
    warm = slice(1, None) if cfg.steps > 1 else slice(None)
    print(
        f"time per step (median after the first): {world_size} ranks "
        f"{statistics.median(step_s[warm]) * 1e3:.1f} ms, one process "
        f"{statistics.median(one['step_s'][warm]) * 1e3:.1f} ms"
    )
    ok = diff <= tol
    print(f"max |loss diff| {diff:.3g} (tolerance {tol:g})")
    print("MATCHES the single-process run" if ok else "DOES NOT MATCH the single-process run")
    return 0 if ok else 1


def parse(argv: Sequence[str] | None) -> tuple[TrainConfig, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to spawn (not torchrun)")
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    world_size = args.pop("world_size")
    return TrainConfig(**args), world_size


def main(argv: Sequence[str] | None = None) -> int:
    cfg, world_size = parse(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: this process is one rank
        if cfg.device == "cuda":
            cfg = TrainConfig(**{**asdict(cfg), "device": f"cuda:{os.environ['LOCAL_RANK']}"})
        tokenring.init_distributed()
        try:
            mine = train_on_ranks(cfg)
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            code = report(cfg, len(ranks), ranks) if dist.get_rank() == 0 else 0
        finally:
            dist.destroy_process_group()
        return code
    # the ranks import this file by name: what is sent to them must not live in __main__
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    this = importlib.import_module("train_llama_tiny")
    ranks = tokenring.launch(
        this.train_on_ranks, this.TrainConfig(**asdict(cfg)), world_size=world_size, timeout_s=600
    )
    return report(cfg, world_size, ranks)


if __name__ == "__main__":
    raise SystemExit(main())
