"""Seeded random combinations of every option of ``sequence_parallel_attn`` and
``hybrid_attn``, each checked against the float64 oracle (out, lse, dq, dk, dv).

The table tests check each option on its own; this file checks them together, where a bug
hides in a combination nobody wrote down (``strategy="auto"`` on uneven shards priced each
rank by its own token count, so ranks could pick differently). Every configuration drawn is
valid: the ones that must raise are checked elsewhere, so here every call must succeed.

Legend: B batch, S global seq, Hq query heads, Hkv key/value heads, D head dim, P world size.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    DTYPES,
    make_inputs,
    oracle_with_grads,
    sharded_positions,
    tolerance_failures,
    visible_mask,
)
from tokenring.model.costmodel import measured

RING = ("token_ring", "ring", "bidir_ring", "bidir_token_ring")
STRATEGIES = (*RING, "ulysses", "allgather_kv", "auto")


def draw(rng: random.Random, world_size: int, *, ring_only: bool = False) -> dict[str, Any]:
    """One valid configuration: shapes, masks, sharding and the options that go with the
    strategy drawn."""
    strategy = rng.choice(RING if ring_only else STRATEGIES)
    heads_kv = rng.choice([1, 2])
    heads_q = heads_kv * rng.choice([1, 2, 3])
    if strategy == "bidir_token_ring" and heads_q < 2:
        heads_q = 2 * heads_kv
    causal = rng.random() < 0.6
    layout = rng.choice(["contiguous", "zigzag"])
    seq_len = rng.randint(world_size, 30)
    uneven = rng.random() < 0.5
    if not uneven:  # every rank the same count: S a multiple of the layout's chunks
        chunks = world_size * (2 if layout == "zigzag" else 1)
        seq_len = max(chunks, seq_len // chunks * chunks)
    docs = None
    if rng.random() < 0.3 and seq_len > 2:
        docs = [0, *sorted(rng.sample(range(1, seq_len), k=2)), seq_len]
    window = None
    if rng.random() < 0.3:
        window = (rng.choice([-1, 0, 1, 3, 7]), 0 if causal else rng.choice([-1, 0, 2, 5]))
    options: dict[str, Any] = {}
    if strategy in ("token_ring", "auto") and rng.random() < 0.5:
        options["last_pair"] = rng.choice(["return", "lend", "auto"])
    if strategy in RING or strategy == "auto":  # drawn for every ring: the same draws as before
        splits = rng.choice([None, 1, 2, 3])
        if strategy in ("token_ring", "bidir_token_ring", "auto"):  # the others refuse it
            options["last_block_splits"] = splits
    if rng.random() < 0.25:
        options["kernel"] = "reference"
    return {
        "strategy": strategy,
        "heads_q": heads_q,
        "heads_kv": heads_kv,
        "batch": rng.choice([1, 2]),
        "head_dim": rng.choice([4, 8]),
        "causal": causal,
        "layout": layout,
        "seq_len": seq_len,
        "pass_seq_len": uneven or docs is not None,
        "docs": docs,
        "window": window,
        "chunk": rng.choice([None, None, 3, 5]),
        "scale": rng.choice([None, 0.3]),
        "options": options,
        "seed": rng.randrange(10**6),
    }


def _hardware(dtype: str) -> Any:
    return measured(
        forward_flops_per_s=1e9,
        backward_flops_per_s=5e8,
        link_bandwidth_bytes_per_s=1e8,
        memory_bandwidth_bytes_per_s=1e10,
        dtype=dtype,
    )


def _oracle(case: dict[str, Any], dtype: torch.dtype) -> tuple[Any, ...]:
    """The seeded global inputs, the (S, S) visibility and the float64 reference."""
    inputs = make_inputs(
        seed=case["seed"],
        batch=case["batch"],
        seq_global=case["seq_len"],
        heads_q=case["heads_q"],
        heads_kv=case["heads_kv"],
        head_dim=case["head_dim"],
    )
    window = case["window"] or (-1, -1)
    mask = visible_mask(
        case["seq_len"], causal=case["causal"], cu_seqlens=case["docs"], window=window,
        chunk=case["chunk"],
    )  # fmt: skip
    scale = case["scale"] if case["scale"] is not None else case["head_dim"] ** -0.5
    reference = oracle_with_grads(
        *inputs, causal=case["causal"], scale=scale, dtype=dtype, mask=mask
    )
    return inputs, mask, scale, reference


def _check(
    case: dict[str, Any],
    dtype: torch.dtype,
    positions: torch.Tensor,
    attend: Any,
) -> list[str]:
    """Run ``attend(q, k, v) -> (out, lse)`` on this rank's rows and compare with the oracle."""
    (q, k, v, dout), mask, scale, reference = _oracle(case, dtype)
    local = [x[:, positions].to(dtype).requires_grad_(True) for x in (q, k, v)]
    out, lse = attend(*local)
    out.backward(dout[:, positions].to(dtype))
    if out.shape[1] == 0:  # a rank that holds no token
        return []
    got = {"out": out.detach(), "lse": lse, "dq": local[0].grad}
    got |= {"dk": local[1].grad, "dv": local[2].grad}
    want = {name: reference[name][:, positions] for name in ("out", "dq", "dk", "dv")}
    want["lse"] = reference["lse"][:, :, positions]
    seen = torch.isfinite(want["lse"])  # rows no key reaches: -inf on both sides
    if not torch.equal(seen, torch.isfinite(got["lse"])):
        return ["lse: rows that see no key differ"]
    got["lse"], want["lse"] = got["lse"].where(seen, 0.0), want["lse"].where(seen, 0.0)
    return tolerance_failures(
        got, want, dtype=dtype, inputs=(q, k, v, dout), reference=reference,
        causal=case["causal"], scale=scale, mask=mask,
    )  # fmt: skip


def call_keywords(case: dict[str, Any]) -> dict[str, Any]:
    """The keywords of a drawn case that both entry points share (also test_masks_audit's)."""
    return {
        "causal": case["causal"],
        "layout": case["layout"],
        "softmax_scale": case["scale"],
        "seq_len": case["seq_len"] if case["pass_seq_len"] else None,
        "cu_seqlens": case["docs"],
        "window_size": case["window"],
        "attention_chunk_size": case["chunk"],
        "return_lse": True,
    }


def calls_on_ranks(seed: int, num_cases: int, dtype_name: str) -> list[tuple[int, list[str]]]:
    """Each rank's failures per drawn configuration of ``sequence_parallel_attn``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rng, dtype = random.Random(seed), DTYPES[dtype_name]
    failures = []
    for index in range(num_cases):
        case = draw(rng, world)
        options = dict(case["options"])
        if case["strategy"] == "auto" or options.get("last_pair") == "auto":
            options["hardware"] = _hardware(dtype_name)
        positions = torch.tensor(
            sharded_positions(case["layout"], rank, world, case["seq_len"], case["docs"]),
            dtype=torch.int64,
        )

        attend = functools.partial(
            tokenring.sequence_parallel_attn, strategy=case["strategy"], **call_keywords(case),
            **options,
        )  # fmt: skip
        found = _check(case, dtype, positions, attend)
        failures.append((index, [f"{case}: {f}" for f in found]))
    return failures


def hybrid_calls_on_ranks(seed: int, num_cases: int, outer: int, inner: int) -> list[Any]:
    """Each rank's failures per drawn configuration of ``hybrid_attn`` (float64)."""
    rank = dist.get_rank()
    outer_rank, inner_rank = divmod(rank, inner)
    mesh = tokenring.hybrid_mesh(outer, inner)
    rng = random.Random(seed)
    failures = []
    for index in range(num_cases):
        case = draw(rng, outer * inner, ring_only=True)
        case["heads_kv"] *= inner  # the inner all-to-all splits the heads
        case["heads_q"] *= inner
        positions = hybrid_positions(case, outer_rank, inner_rank, outer, inner)
        attend = functools.partial(
            tokenring.hybrid_attn, mesh=mesh, outer_strategy=case["strategy"],
            last_block_splits=case["options"].get("last_block_splits"),
            **{**call_keywords(case), "seq_len": case["seq_len"]},  # hybrid shards need S
        )  # fmt: skip
        found = _check(case, torch.float64, positions, attend)
        failures.append((index, [f"{case}: {f}" for f in found]))
    return failures


def hybrid_positions(
    case: dict[str, Any], outer_rank: int, inner_rank: int, outer: int, inner: int
) -> torch.Tensor:
    """A hybrid rank's positions from the definition: its outer rank's shard under the layout,
    cut into P_in near-equal contiguous slices, the longer ones first."""
    shard = sharded_positions(case["layout"], outer_rank, outer, case["seq_len"], case["docs"])
    sizes = [len(shard) // inner + (1 if i < len(shard) % inner else 0) for i in range(inner)]
    start = sum(sizes[:inner_rank])
    return torch.tensor(shard[start : start + sizes[inner_rank]], dtype=torch.int64)


def _assert_clean(per_rank: list[list[tuple[int, list[str]]]], num_cases: int) -> None:
    for rank, failures in enumerate(per_rank):
        assert [index for index, _ in failures] == list(range(num_cases)), rank
        bad = [line for _, found in failures for line in found]
        assert not bad, f"rank {rank}: {len(bad)} failures, first: {bad[:3]}"


@pytest.mark.parametrize(("world_size", "num_cases"), [(2, 40), (3, 60), (4, 40)])
def test_random_calls_match_the_oracle_in_float64(world_size: int, num_cases: int) -> None:
    per_rank = tokenring.launch(
        calls_on_ranks, 100 + world_size, num_cases, "float64", world_size=world_size,
        timeout_s=600,
    )  # fmt: skip
    _assert_clean(per_rank, num_cases)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_calls_meet_the_tolerance_rule(dtype: str) -> None:
    per_rank = tokenring.launch(calls_on_ranks, 7, 15, dtype, world_size=3, timeout_s=600)
    _assert_clean(per_rank, 15)


def test_random_hybrid_calls_match_the_oracle() -> None:
    per_rank = tokenring.launch(hybrid_calls_on_ranks, 11, 30, 2, 2, world_size=4, timeout_s=600)
    _assert_clean(per_rank, 30)


def test_the_draws_cover_every_option() -> None:
    """The seeds above reach every strategy, layout, mask kind and option value (a draw that
    stopped covering one would pass without checking it)."""
    seen: dict[str, set[Any]] = {}
    for world, seed, count in ((2, 102, 40), (3, 103, 60), (4, 104, 40)):
        rng = random.Random(seed)
        for _ in range(count):
            case = draw(rng, world)
            facts = {
                "strategy": case["strategy"],
                "layout": case["layout"],
                "uneven": case["pass_seq_len"],
                "docs": case["docs"] is not None,
                "window": case["window"] is not None,
                "chunk": case["chunk"] is not None,
                "gqa": case["heads_q"] != case["heads_kv"],
                "last_pair": case["options"].get("last_pair"),
                "splits": case["options"].get("last_block_splits"),
                "kernel": case["options"].get("kernel"),
            }
            for name, value in facts.items():
                seen.setdefault(name, set()).add(value)
    assert seen["strategy"] == set(STRATEGIES)
    assert seen["layout"] == {"contiguous", "zigzag"}
    for name in ("uneven", "docs", "window", "chunk", "gqa"):
        assert seen[name] == {True, False}, name
    assert seen["last_pair"] == {None, "return", "lend", "auto"}
    assert seen["splits"] >= {1, 2, 3}
    assert seen["kernel"] == {None, "reference"}
