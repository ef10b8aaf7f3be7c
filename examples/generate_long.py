"""Greedy generation with the KV cache sharded over ranks, checked token for token.

A tiny Llama-shaped causal LM (``tokenring.tinylm``: RoPE, GQA, SiLU MLP) continues a batch
of prompts of different lengths on 4 CPU ranks: the first step prefills the prompts, each later
step decodes one token per sequence, every layer's K/V live in a ``DistributedKVCache``
(block-cyclic over the ranks) and attention runs with ``tokenring.inference.cached_attn``
(``--strategy auto``: the cost model's pick per step). Each rank's cache budget is well below
what the whole context takes, and no rank holds more than a part of any prompt. The new tokens
must be exactly those of the same model on one process with plain causal attention over the
whole sequence recomputed every step (no cache at all)::

    python examples/generate_long.py                      # 4 gloo ranks, prints the check
    python examples/generate_long.py --strategy tree --lengths 700,333,512
    torchrun --nproc-per-node 4 examples/generate_long.py

Legend: B sequences, L layers, Hkv key/value heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import tokenring
from tokenring.tinylm import TinyCausalLM, TinyLMConfig, generate, generate_reference

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def make_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def generate_on_ranks(
    config: TinyLMConfig,
    dtype: str,
    prompts: list[list[int]],
    new_tokens: int,
    strategy: str,
    block_size: int,
    budget_bytes: int,
) -> dict[str, Any]:
    """Runs on every rank: the distributed generation and what each rank cached."""
    model = TinyCausalLM(config, seed=0, dtype=DTYPES[dtype])
    result = generate(
        model,
        prompts,
        new_tokens,
        strategy=strategy,
        block_size=block_size,
        budget_bytes=budget_bytes,
    )
    cache = result.cache
    return {
        "tokens": result.tokens,
        "strategies": result.strategies,
        "held": cache.tokens_held()[dist.get_rank()],
        "reserved_bytes": cache.reserved_bytes(),
        "token_bytes": cache.token_bytes * cache.num_layers,
    }


def _runs(strategies: list[str]) -> str:
    """'a x 1, b x 23': the per-step strategies, run-length encoded."""
    out: list[list[Any]] = []
    for s in strategies:
        if out and out[-1][0] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    return ", ".join(f"{s} x {n}" for s, n in out)


def report(
    per_rank: list[dict[str, Any]],
    want: list[list[int]],
    prompts: list[list[int]],
    args: argparse.Namespace,
    config: TinyLMConfig,
) -> int:
    first = per_rank[0]
    world = len(per_rank)
    context = sum(len(p) + args.new_tokens for p in prompts)
    print(
        f"tiny LM ({config.num_layers} layers, {config.heads_q}/{config.heads_kv} heads x "
        f"{config.head_dim}, {args.dtype}), prompts of {[len(p) for p in prompts]} tokens, "
        f"{args.new_tokens} new tokens each, {world} ranks, cache blocks of {args.block_size}"
    )
    print(
        f"  K/V of the whole context: {context} tokens x {first['token_bytes']} B = "
        f"{context * first['token_bytes'] / 1024:.0f} KiB; budget per rank "
        f"{args.budget_bytes / 1024:.0f} KiB"
    )
    for r, res in enumerate(per_rank):
        print(
            f"  rank {r}: holds {res['held']} tokens of each sequence, reserves "
            f"{res['reserved_bytes'] / 1024:.0f} KiB"
        )
    longest = [max(res["held"][b] for res in per_rank) for b in range(len(prompts))]
    shorter = all(n < len(p) for n, p in zip(longest, prompts, strict=True))
    print(
        f"  most any rank holds of each sequence: {longest} "
        f"({'shorter' if shorter else 'NOT shorter'} than every prompt)"
    )
    print(f"  attention per step: {_runs(first['strategies'])}")
    same = all(res["tokens"] == want for res in per_rank)
    for b, (got, ref) in enumerate(zip(first["tokens"], want, strict=True)):
        print(f"  sequence {b}, {world} ranks:  {got}")
        print(f"  sequence {b}, one process: {ref}")
    matched = sum(
        a == b
        for got, ref in zip(first["tokens"], want, strict=True)
        for a, b in zip(got, ref, strict=True)
    )
    total = sum(len(ref) for ref in want)
    print(
        f"{'IDENTICAL to' if same else 'DIFFERENT from'} the single-process tokens "
        f"({matched}/{total} equal on rank 0; every rank {'agrees' if same else 'checked'})"
    )
    return 0 if same and shorter else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ignored under torchrun")
    parser.add_argument("--lengths", default="384,257", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--strategy", default="auto", help="auto, pass_q, pass_kv, direct or tree")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="cache budget per rank (default: 40%% of the whole context's K/V)",
    )
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    config = TinyLMConfig()
    prompts = make_prompts(lengths, config.vocab_size)
    if args.budget_bytes is None:
        per_token = config.num_layers * 2 * config.heads_kv * config.head_dim
        per_token *= torch.empty((), dtype=DTYPES[args.dtype]).element_size()
        args.budget_bytes = int(0.4 * per_token * sum(n + args.new_tokens for n in lengths))
    task = (
        config,
        args.dtype,
        prompts,
        args.new_tokens,
        args.strategy,
        args.block_size,
        args.budget_bytes,
    )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        tokenring.init_distributed()
        try:
            mine = generate_on_ranks(*task)
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, mine)
            rank = dist.get_rank()
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        # the ranks import this file by name: what is sent to them must not live in __main__
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        this = importlib.import_module("generate_long")
        per_rank = tokenring.launch(
            this.generate_on_ranks, *task, world_size=args.world_size, timeout_s=600
        )
    model = TinyCausalLM(config, seed=0, dtype=DTYPES[args.dtype])
    want = generate_reference(model, prompts, args.new_tokens)
    return report(per_rank, want, prompts, args, config)


if __name__ == "__main__":
    raise SystemExit(main())
