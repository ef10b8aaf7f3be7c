"""Audit of cached inference: corners the main grid (test_inference) does not reach, each
against an independent oracle, and the faults of one rank.

Oracles: float64 attention of each whole sequence (``oracle.full_attention``) indexed by global
position; greedy decoding on one process (``tinylm.generate_reference``). A fault must raise a
clear error on every rank, soon (well inside the process group's timeout), never a wrong answer.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention
from tokenring.inference import attend_cached, cached_attn, resolve_cached_strategy
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import measured
from tokenring.runtime.kernels import select_kernel
from tokenring.strategies.cached import CachedStrategy
from tokenring.tinylm import TinyCausalLM, TinyLMConfig, generate, generate_reference

STRATEGIES = [s.value for s in CachedStrategy]
PG_TIMEOUT_S = 30.0
SOON_S = 10.0  # an agreed error arrives at once; a rank left waiting takes PG_TIMEOUT_S

# Histories of steps (new tokens per sequence): empty shards (one token, then decode: ranks
# that hold nothing yet), steps of 0 tokens, a sequence that waits, several tokens per decode
# step, a zigzag prefill of a batch of 2, and a long run whose shards grow block by block.
HISTORIES = [
    [(1,), (1,), (1,), (1,)],
    [(0,), (2,), (0,), (3,)],
    [(0, 3), (2, 0), (1, 1), (3, 2)],
    [(12, 12), (1, 1), (2, 2)],
    [(3,), *[(1,)] * 20, (5,), (5,)],
]
HEADS = [(4, 1), (6, 2)]  # MQA, GQA


def _hardware() -> Any:
    return measured(
        dtype="float64",
        forward_flops_per_s=1e10,
        backward_flops_per_s=1e10,
        link_bandwidth_bytes_per_s=1e9,
        memory_bandwidth_bytes_per_s=1e10,
        latency_s=1e-5,
    )


def _corner_grid() -> list[str]:
    """Every strategy over HISTORIES x HEADS, two layers, a softmax_scale that is not the
    default, non-contiguous q and k: out and lse against float64 attention of the whole
    sequence."""
    rank = dist.get_rank()
    failures = []
    d, scale = 8, 0.37
    for history, (hq, hkv), strategy in itertools.product(HISTORIES, HEADS, STRATEGIES):
        batch = len(history[0])
        gen = torch.Generator().manual_seed(3)
        seqs = [
            [torch.randn(sum(h[b] for h in history), h, d, generator=gen, dtype=torch.float64)
             for h in (hq, hkv, hkv)]
            for b in range(batch)
        ]  # fmt: skip
        refs = [full_attention(*(x[None] for x in s), causal=True, scale=scale) for s in seqs]
        cache = DistributedKVCache(
            num_layers=2, batch=batch, heads_kv=hkv, head_dim=d, dtype=torch.float64, block_size=2
        )
        for index, new in enumerate(history):
            pos = cache.begin_step(new).new_positions[rank]
            want = torch.cat([r[0][0, p] for r, p in zip(refs, pos, strict=True)])
            want_lse = torch.cat([r[1][0, :, p] for r, p in zip(refs, pos, strict=True)], dim=1)
            for layer in range(2):
                q, k, v = (
                    torch.cat([s[i][p] for s, p in zip(seqs, pos, strict=True)]) for i in range(3)
                )
                q, k = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k))
                out, lse = cached_attn(
                    q,
                    k,
                    v,
                    cache=cache,
                    layer=layer,
                    strategy=strategy,
                    softmax_scale=scale,
                    return_lse=True,
                )
                err = max(
                    (out - want).abs().max().item() if out.numel() else 0.0,
                    (lse - want_lse).abs().max().item() if lse.numel() else 0.0,
                )
                if err > 1e-10 or out.shape != want.shape:
                    label = f"{history} {hq}/{hkv} {strategy} step {index} layer {layer}"
                    failures.append(f"{label}: {err:.3g}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_corners_match_float64_attention(world: int) -> None:
    per_rank = tokenring.launch(_corner_grid, world_size=world, timeout_s=300)
    failures = [f"rank {r}: {f}" for r, res in enumerate(per_rank) for f in res]
    assert not failures, "\n".join(failures)


# -- one rank's bad or different call --------------------------------------------------------
def _timed(fn: Any) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # every rank reports what it saw
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _one_rank_return_lse(flag: object) -> tuple[str, float]:
    rank = dist.get_rank()
    cache = DistributedKVCache(num_layers=1, batch=1, heads_kv=2, head_dim=8)
    n = cache.begin_step((5,)).num_rows(rank)
    q, kv = torch.randn(n, 4, 8), torch.randn(n, 2, 8)
    return_lse = flag if rank == 1 else False
    return _timed(
        lambda: cached_attn(
            q, kv, kv, cache=cache, layer=0, strategy="direct", return_lse=return_lse
        )
    )


def test_one_rank_with_a_non_bool_return_lse_fails_every_rank_at_once() -> None:
    # Before: rank 1 raised at once and rank 0 waited out the process group's timeout for
    # a check rank 1 never joined ("rank(s) [1] did not arrive within 30 s").
    results = tokenring.launch(
        _one_rank_return_lse, 1, world_size=2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S
    )
    for rank, (message, elapsed_s) in enumerate(results):
        assert "ValueError" in message and "return_lse must be a bool; got 1" in message, message
        assert elapsed_s < SOON_S, (rank, elapsed_s, message)


def test_hardware_with_a_forced_strategy_is_refused_by_every_entry_point(
    single_rank_group: None,
) -> None:
    """cached_attn refused it; resolve_cached_strategy and attend_cached (public, the
    benchmark's) returned the forced strategy and dropped the hardware, even a preset name
    that does not exist. attend_cached also checks softmax_scale as cached_attn does."""
    cache = DistributedKVCache(num_layers=1, batch=1, heads_kv=1, head_dim=4)
    step = cache.begin_step((3,))
    q, kv = torch.randn(3, 2, 4), torch.randn(3, 1, 4)
    shape: dict[str, Any] = dict(heads_q=2, heads_kv=1, head_dim=4, dtype=torch.float32)
    words = "hardware is only used with strategy='auto'; got hardware='no-such-preset'"
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match=words):
            resolve_cached_strategy(
                strategy,
                step=step,
                comm=tokenring.get_communicator(),
                device=torch.device("cpu"),
                hardware="no-such-preset",
                **shape,
            )
    cache.append(0, kv, kv)
    kernel = select_kernel(q.device, q.dtype, None)
    with pytest.raises(ValueError, match=words):
        attend_cached(
            q, cache=cache, layer=0, strategy="tree", hardware="no-such-preset", kernel=kernel
        )
    for scale in (-1.0, 0.0, float("nan")):  # before: computed with it (a negative scale)
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            attend_cached(
                q, cache=cache, layer=0, strategy="tree", softmax_scale=scale, kernel=kernel
            )
    out, _ = attend_cached(q, cache=cache, layer=0, strategy="tree", kernel=kernel)
    want, _ = full_attention(q[None], kv[None], kv[None], causal=True, scale=0.5)
    torch.testing.assert_close(out, want[0].float())


# -- generate: its keywords and one rank's different call ------------------------------------
def _tiny() -> TinyCausalLM:
    return TinyCausalLM(TinyLMConfig(num_layers=1, dim=16, mlp_dim=16), seed=1, dtype=torch.float64)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8]]


def test_generate_refuses_hardware_with_a_forced_strategy(single_rank_group: None) -> None:
    # Before: accepted and dropped (even a preset name that does not exist).
    for hardware in ("h100-nvswitch", "no-such-preset", _hardware()):
        with pytest.raises(ValueError, match="hardware is only used with strategy='auto'"):
            generate(_tiny(), PROMPTS, 1, strategy="pass_q", hardware=hardware)
    # and an unknown strategy is named before anything is built
    with pytest.raises(ValueError, match="strategy must be one of 'pass_q'"):
        generate(_tiny(), PROMPTS, 1, strategy="ring")


def _generate_one_rank_differs(change: str) -> tuple[str, float]:
    rank = dist.get_rank()
    model = _tiny()
    options: dict[str, Any] = {"strategy": "auto", "hardware": _hardware(), "block_size": 4}
    if rank == 1:
        if change == "no hardware":  # rank 1 would calibrate (a collective) alone
            options["hardware"] = None
        elif change == "other hardware":
            options["hardware"] = "h100-nvswitch"
        elif change == "block_size":
            options["block_size"] = 0
        elif change == "budget_bytes":
            options["budget_bytes"] = -1
        elif change == "weights":
            model = TinyCausalLM(
                TinyLMConfig(num_layers=1, dim=16, mlp_dim=16), seed=2, dtype=torch.float64
            )
    return _timed(lambda: generate(model, PROMPTS, 2, **options))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # before: "rank 1 sent another message (8388608 bytes ...)": calibrate on one rank
        ("no hardware", "hardware: rank 0 has"),
        # before: rank 1 raised alone after the first step; rank 0 timed out
        ("other hardware", "hardware: rank 0 has"),
        # before: rank 1 raised alone building its cache; rank 0 timed out
        ("block_size", "block_size must be an int >= 1; got 0"),
        ("budget_bytes", "budget_bytes must be >= 0 or None; got -1"),
        # before: no error, and tokens that are neither rank's model's (a silent wrong answer)
        ("weights", "weights: rank 0 has"),
    ],
)
def test_generate_on_ranks_that_differ_fails_every_rank_at_once(change: str, words: str) -> None:
    results = tokenring.launch(
        _generate_one_rank_differs, change, world_size=2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S
    )
    for rank, (message, elapsed_s) in enumerate(results):
        assert "ValueError" in message and words in message, (rank, message)
        assert elapsed_s < SOON_S, (rank, elapsed_s, message)


def _generate_same() -> list[list[int]]:
    return generate(_tiny(), PROMPTS, 3, strategy="auto", hardware=_hardware()).tokens


def test_generate_with_the_same_call_still_matches_one_process() -> None:
    want = generate_reference(_tiny(), PROMPTS, 3)
    for tokens in tokenring.launch(_generate_same, world_size=2, timeout_s=120):
        assert tokens == want


# -- two caches on one group, called in another order on each rank ----------------------------
def _two_caches_crossed(change: dict[str, Any], new_b: tuple[int, ...]) -> tuple[str, float]:
    """Rank 0 runs cache A then B, rank 1 B then A; B differs from A by ``change`` and its
    step by ``new_b``."""
    rank = dist.get_rank()
    options: dict[str, Any] = {"num_layers": 1, "batch": 1, "heads_kv": 2, "head_dim": 8}
    caches = {"A": DistributedKVCache(**options), "B": DistributedKVCache(**(options | change))}
    steps = {"A": caches["A"].begin_step((5,)), "B": caches["B"].begin_step(new_b)}

    def run() -> None:
        for name in "AB" if rank == 0 else "BA":
            cache = caches[name]
            n = steps[name].num_rows(rank)
            q, kv = torch.randn(n, 4, cache.head_dim), torch.randn(n, 2, cache.head_dim)
            cached_attn(q, kv, kv, cache=cache, layer=0, strategy="pass_q")

    return _timed(run)


@pytest.mark.parametrize(
    ("change", "new_b", "words"),
    [
        # before: each rank's plan for a cache of other lengths: a timeout or a foreign message
        ({}, (4,), "'lengths': [5]"),
        ({"num_layers": 2}, (5,), "'num_layers': 1"),
        ({"head_dim": 4}, (5,), "'head_dim': 8"),
    ],
)
def test_ranks_that_call_different_caches_are_told(
    change: dict[str, Any], new_b: tuple[int, ...], words: str
) -> None:
    results = tokenring.launch(
        _two_caches_crossed, change, new_b, world_size=2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S
    )
    for rank, (message, elapsed_s) in enumerate(results):
        assert "ranks disagree on this cached attention call: cache:" in message, (rank, message)
        assert words in message and elapsed_s < SOON_S, (rank, elapsed_s, message)
