"""Audit of the sharded KV cache: what every rank must agree on before a step is placed, and
what ``strategy="auto"`` plans for when each layer names its own hardware.

One launch of 2 gloo ranks runs every case. A fault must raise a clear error on every rank,
soon, with the cache unchanged; never a placement each rank derives from its own state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention
from test_inference_audit import _timed as _error  # (message, seconds) of a call
from tokenring.inference import cached_attn, step_strategy
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import measured

PG_TIMEOUT_S = 30.0
SOON_S = 10.0  # an agreed error arrives at once; a rank left waiting takes PG_TIMEOUT_S
OPTIONS: dict[str, Any] = dict(num_layers=1, batch=1, heads_kv=2, head_dim=8, block_size=2)


def _attend(cache: DistributedKVCache, layer: int = 0) -> None:
    assert cache.step is not None
    n = cache.step.num_rows(dist.get_rank())
    q, kv = torch.randn(n, 4, cache.head_dim), torch.randn(n, 2, cache.head_dim)
    cached_attn(q, kv, kv, cache=cache, layer=layer, strategy="pass_q")


def _crossed_lengths() -> dict[str, Any]:
    """Caches A and B, built alike, take steps of 5 and 4 tokens in another order on each rank
    (each step agreed: the same step index and count), so A holds 5 tokens on rank 0 and 4 on
    rank 1. The next step of A must not place 1 token after position 5 on one rank and after
    4 on the other."""
    rank = dist.get_rank()
    caches = {"A": DistributedKVCache(**OPTIONS), "B": DistributedKVCache(**OPTIONS)}
    for name, new in (("A", 5), ("B", 4)) if rank == 0 else (("B", 5), ("A", 4)):
        caches[name].begin_step((new,))
        _attend(caches[name])
    a = caches["A"]
    before = (a.lengths, a.tokens_held(), a.step)
    message, elapsed_s = _error(lambda: a.begin_step((1,)))
    unchanged = (a.lengths, a.tokens_held(), a.step) == before
    return {"message": message, "elapsed_s": elapsed_s, "unchanged": unchanged}


def _batch_differs() -> tuple[str, float]:
    batch = 2 if dist.get_rank() == 1 else 1
    cache = DistributedKVCache(**(OPTIONS | {"batch": batch}))
    return _error(lambda: cache.begin_step((5,) * batch))


def _hardware(link_bandwidth_bytes_per_s: float) -> Any:
    return measured(
        dtype="float32",
        forward_flops_per_s=1e6,
        backward_flops_per_s=1e6,
        link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
        memory_bandwidth_bytes_per_s=1e10,
        latency_s=1e-6,
    )


# On 2 ranks, 5 new tokens of 4 query and 1 K/V heads: a fast link makes pass-Q the cheapest,
# a slow one pass-KV.
LINKS = (1e12, 1e6, 1e12, 1e6)


def _hardware_per_layer() -> dict[str, Any]:
    """Each layer of one step plans "auto" for its own hardware, built afresh per call (so an
    earlier layer's object may be freed and its id reused)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    seq = [torch.randn(5, h, 8, generator=gen) for h in (4, 1, 1)]
    cache = DistributedKVCache(**(OPTIONS | {"num_layers": len(LINKS), "heads_kv": 1}))
    pos = cache.begin_step((5,)).new_positions[rank][0]
    want, _ = full_attention(*(x[None].double() for x in seq), causal=True, scale=8**-0.5)
    ran, errors = [], []
    for layer, link in enumerate(LINKS):
        q, k, v = (x[pos] for x in seq)
        out = cached_attn(q, k, v, cache=cache, layer=layer, hardware=_hardware(link))
        ran.append(sorted(key[1].value for key in cache.memo if key[0] == "plan"))
        errors.append((out.double() - want[0, pos]).abs().max().item())
    planned = [
        step_strategy("auto", cache, heads_q=4, hardware=_hardware(link)).value for link in LINKS
    ]
    return {"ran": ran, "planned": planned, "errors": errors}


def _crossed_calls(change: dict[str, Any], history_b: list[int]) -> tuple[str, float]:
    """Caches A (steps of 3 then 2 tokens) and B (``change``, steps ``history_b``) end at the
    same step index and lengths; rank 0 then attends A's last step and rank 1 B's. Their
    placements differ (block size, or how the tokens split into cached and new)."""
    rank = dist.get_rank()
    a, b = DistributedKVCache(**OPTIONS), DistributedKVCache(**(OPTIONS | change))
    for new_a, new_b in zip((3, 2), history_b, strict=True):
        a.begin_step((new_a,))
        b.begin_step((new_b,))
        if new_a != 2:
            _attend(a)
            _attend(b)
    return _error(lambda: _attend(a if rank == 0 else b))


def _all_cases() -> dict[str, Any]:
    return {
        "calls": [
            _crossed_calls({"block_size": 4}, [3, 2]),
            _crossed_calls({}, [4, 1]),
        ],
        "crossed": _crossed_lengths(),
        "batch": _batch_differs(),
        "hardware": _hardware_per_layer(),
    }


def test_kvcache_cases_on_two_ranks() -> None:
    per_rank = tokenring.launch(_all_cases, world_size=2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    for rank, res in enumerate(per_rank):
        # Before: agreed (same step, same new tokens), each rank placing position 5 or 4 by its
        # own lengths; only the next cached_attn noticed, with the cache already changed.
        crossed = res["crossed"]
        words = "ranks disagree on this cache step: cached tokens: rank 0 has [5], rank 1 has [4]"
        assert words in crossed["message"], (rank, crossed)
        assert crossed["unchanged"] and crossed["elapsed_s"] < SOON_S, (rank, crossed)
        # Before: "new tokens: rank 0 has [5], rank 1 has [5, 5]" without the cause.
        message, elapsed_s = res["batch"]
        assert "batch: rank 0 has 1, rank 1 has 2" in message, (rank, message)
        assert elapsed_s < SOON_S, (rank, elapsed_s)
        # Before: the pick was kept by id(hardware); a freed hardware's id reused by the next
        # layer's gave that layer the earlier pick, dropping its own hardware.
        hardware = res["hardware"]
        assert hardware["planned"] == ["pass_q", "pass_kv", "pass_q", "pass_kv"], hardware
        assert hardware["ran"][-1] == ["pass_kv", "pass_q"], hardware
        assert max(hardware["errors"]) < 1e-5, hardware
        # Before: the same step index, layer and lengths passed the check; each rank ran the
        # plan of its own cache's placement: a size mismatch or a wait for a message never sent.
        for (message, elapsed_s), words in zip(
            res["calls"],
            [
                "'block_size': 4",
                "'new tokens': [1]",
            ],
            strict=True,
        ):
            assert "ranks disagree on this cached attention call: cache:" in message, (
                rank,
                message,
            )
            assert words in message and elapsed_s < SOON_S, (rank, elapsed_s, message)
    assert per_rank[0]["crossed"]["message"] == per_rank[1]["crossed"]["message"]
