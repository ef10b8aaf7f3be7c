"""Inference with a sharded KV cache: placement and accounting tables, plans, the pass-Q /
pass-KV decision, and attention and greedy generation on real gloo ranks against one process.

The oracles are independent of the code under test: float64 attention of each whole sequence
(``oracle.full_attention``) indexed by global position, greedy decoding on one process with
plain causal attention recomputed every step (``tinylm.generate_reference``, no cache), byte
counts from the strategies' definitions (``_expected_sent``), and placement rules written out
here. One launch per world size; the grid is looped inside the ranks.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import DTYPES, full_attention, owned_positions, plain_lse_error
from tokenring.cli import main
from tokenring.core.schedule import Payload
from tokenring.inference import cached_attn
from tokenring.kvcache import DistributedKVCache, KVCacheBudgetError
from tokenring.model.costmodel import measured
from tokenring.model.planner import (
    choose_cached_strategy,
    explain_cached,
    pass_q_threshold,
    predict_cached,
)
from tokenring.strategies.cached import (
    CachedShards,
    CachedStrategy,
    build_cached_plan,
    uniform_shards,
)
from tokenring.tinylm import TinyCausalLM, TinyLMConfig, generate, generate_reference

STRATEGIES = [s.value for s in CachedStrategy]
BLOCK = 4
# (cached per sequence, new per sequence): C in {0, small, not divisible by P}, T in {1, 3,
# block-sized}, a batch of different lengths, a sequence that does not advance, and a first
# prefill that zigzag covers at P = 2 and 4 (the ordinary path).
CONFIGS = [
    ((0,), (8,)),
    ((0, 0), (3, 1)),
    ((5,), (1,)),
    ((5,), (3,)),
    ((13,), (BLOCK,)),
    ((13, 6, 0), (1, 3, BLOCK)),
    ((7, 2), (3, 0)),
]
HEADS = [(4, 4), (6, 2)]  # MHA, GQA (groups of 3)


def _hardware(dtype: str = "float64", **over: float) -> Any:
    rates: dict[str, Any] = {
        "forward_flops_per_s": 1e10,
        "backward_flops_per_s": 1e10,
        "link_bandwidth_bytes_per_s": 1e9,
        "memory_bandwidth_bytes_per_s": 1e10,
        "latency_s": 1e-5,
    }
    rates.update(over)
    return measured(dtype=dtype, **rates)


# -- placement and accounting (tables) ---------------------------------------------------------
def _appends(world: int) -> list[list[tuple[int, ...]]]:
    """Histories of steps for a batch of 3: prefills of different lengths, then decode."""
    return [
        [(8 * world,) * 3, (1, 1, 1), (5, 0, 2)],  # zigzag first prefill when 2P divides it
        [(9, 0, 30), (1, 1, 1), (1, 1, 1), (BLOCK, 7, 3)],
        [(0, 0, 0), (1, 2, 3)],
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_placement_invariants(world: int) -> None:
    for history in _appends(world):
        caches = [
            DistributedKVCache(
                num_layers=1,
                batch=3,
                heads_kv=1,
                head_dim=2,
                block_size=BLOCK,
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]
        lengths = [0, 0, 0]
        for index, new in enumerate(history):
            steps = [c.begin_step(new) for c in caches]
            for c, s in zip(caches, steps, strict=True):
                n = s.num_rows(c.rank)
                c.append(0, torch.zeros(n, 1, 2), torch.zeros(n, 1, 2))
            step = steps[0]
            assert all(
                s.new_positions[0][0].tolist() == step.new_positions[0][0].tolist() for s in steps
            ), "every rank must derive the same placement"
            first = index == 0 and len(set(new)) == 1 and new[0] % (2 * world) == 0
            assert step.zigzag == (first and new[0] > 0)
            for b in range(3):
                got = sorted(p for r in range(world) for p in step.new_positions[r][b].tolist())
                assert got == list(range(lengths[b], lengths[b] + new[b])), "each position once"
                for r in range(world):
                    pos = step.new_positions[r][b].tolist()
                    kv = step.kv_positions[r][b].tolist()
                    assert (
                        pos == sorted(pos) and kv == sorted(kv) and kv[len(kv) - len(pos) :] == pos
                    )
                    for p in pos:
                        if step.zigzag:
                            assert p in owned_positions("zigzag", r, world, new[b])
                        else:  # block-cyclic, offset by the sequence index
                            assert r == (p // BLOCK + b) % world
                held = [len(step.kv_positions[r][b]) for r in range(world)]
                assert max(held) - min(held) <= BLOCK, f"rank loads {held} drift apart"
                lengths[b] += new[b]
            assert caches[0].lengths == tuple(lengths)
            assert caches[0].tokens_held() == [
                [len(step.kv_positions[r][b]) for b in range(3)] for r in range(world)
            ]


def test_memory_accounting_and_budget_error() -> None:
    world, layers = 3, 2
    caches = [
        DistributedKVCache(
            num_layers=layers,
            batch=2,
            heads_kv=2,
            head_dim=4,
            block_size=BLOCK,
            dtype=torch.float32,
            rank=r,
            world_size=world,
        )
        for r in range(world)
    ]
    token_bytes = 2 * 2 * 4 * 4
    for new in [(10, 3), (1, 1), (6, 0)]:
        for cache in caches:
            step = cache.begin_step(new)
            n = step.num_rows(cache.rank)
            for layer in range(layers):
                cache.append(layer, torch.randn(n, 2, 4), torch.randn(n, 2, 4))
        for r, cache in enumerate(caches):
            held = [len(step.kv_positions[r][b]) for b in range(2)]
            reserved = layers * token_bytes * sum(-(-h // BLOCK) * BLOCK for h in held)
            assert cache.reserved_bytes() == reserved == caches[0].reserved_bytes(r)
            assert cache.allocated_bytes() == reserved, "tensors grow in whole blocks"
            assert cache.used_bytes() == layers * token_bytes * sum(held)
            k, _ = cache.shard(1, 0)
            assert k.shape == (held[0], 2, 4)
    # A budget that fits the next step exactly passes; one byte less fails on every rank
    # with the same message, naming the rank, the budget and the need, and changes nothing.
    nxt = (BLOCK * world, 0)
    plans = [c.plan_step(nxt) for c in caches]
    need = [
        layers * token_bytes * sum(-(-len(x) // BLOCK) * BLOCK for x in plans[0].kv_positions[r])
        for r in range(world)
    ]
    worst = max(range(world), key=lambda r: (need[r], -r))
    for budget, fails in ((max(need), False), (max(need) - 1, True)):
        messages = set()
        for cache in caches:
            cache.budget_bytes = budget
            before = cache.lengths
            if fails:
                with pytest.raises(KVCacheBudgetError) as info:
                    cache.plan_step(nxt)  # planning never raises
                    cache.begin_step(nxt)
                err = info.value
                assert (err.rank, err.budget_bytes, err.need_bytes) == (worst, budget, need[worst])
                assert f"rank {worst}" in str(err) and str(budget) in str(err)
                assert str(need[worst]) in str(err) and cache.lengths == before
                messages.add(str(err))
        assert len(messages) == (1 if fails else 0)


def test_bad_inputs_name_argument_value_and_expectation() -> None:
    base: dict[str, Any] = {
        "num_layers": 1,
        "batch": 2,
        "heads_kv": 2,
        "head_dim": 4,
        "rank": 0,
        "world_size": 2,
    }
    for change, words in [
        ({"num_layers": 0}, "num_layers must be an int >= 1; got 0"),
        ({"block_size": -1}, "block_size must be an int >= 1; got -1"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"rank": 2}, "rank must be in [0, world_size=2); got 2"),
        ({"world_size": None}, "rank and world_size must be given together"),
        ({"budget_bytes": -5}, "budget_bytes must be >= 0 or None; got -5"),
    ]:
        with pytest.raises(ValueError, match=_literal(words)):
            DistributedKVCache(**{**base, **change})
    cache = DistributedKVCache(**base)
    for new, words in [
        ((1,), "new must be 2 ints >= 0"),
        ((1, -1), "got (1, -1)"),
        ((True, 1), "got (True, 1)"),  # a bool is not a count
        (3, "new must be 2 ints >= 0 (new tokens per sequence); got 3"),
    ]:
        with pytest.raises(ValueError, match=_literal(words)):
            cache.begin_step(new)
    with pytest.raises(ValueError, match="no cache step has begun"):
        cache.append(0, torch.zeros(0, 2, 4), torch.zeros(0, 2, 4))
    step = cache.begin_step((3, 1))
    n = step.num_rows(0)
    for layer, k, words in [
        (1, torch.zeros(n, 2, 4), "layer must be in [0, 1); got 1"),
        (0.0, torch.zeros(n, 2, 4), "layer must be in [0, 1); got 0.0"),
        (0, torch.zeros(n + 1, 2, 4), f"k must have shape (rows={n}, heads_kv=2, head_dim=4)"),
        (0, torch.zeros(n, 2, 4, dtype=torch.float64), "k must be torch.float32 on cpu"),
    ]:
        with pytest.raises(ValueError, match=_literal(words)):
            cache.append(layer, k, torch.zeros(n, 2, 4))
    for rank in (-1, 2):  # before: -1 read the last rank's bytes, 2 an IndexError
        for method in (cache.reserved_bytes, cache.used_bytes):
            with pytest.raises(
                ValueError, match=_literal(f"rank must be in [0, world_size=2); got {rank}")
            ):
                method(rank)
    with pytest.raises(ValueError, match="cache must be built with a process group"):
        cached_attn(
            torch.zeros(n, 4, 4), torch.zeros(n, 2, 4), torch.zeros(n, 2, 4), cache=cache, layer=0
        )
    cache.append(0, torch.zeros(n, 2, 4), torch.zeros(n, 2, 4))
    with pytest.raises(ValueError, match="layer 0 has already appended"):
        cache.append(0, torch.zeros(n, 2, 4), torch.zeros(n, 2, 4))
    for kwargs, words in [
        ({"world_size": 0, "batch": 1, "cached": 0, "new": 1}, "world_size must be >= 1; got 0"),
        ({"world_size": 2, "batch": 1, "cached": -1, "new": 1}, "cached must be >= 0; got -1"),
    ]:
        with pytest.raises(ValueError, match=_literal(words)):
            uniform_shards(**kwargs)
    with pytest.raises(ValueError, match="strategy must be one of 'pass_q'"):
        CachedStrategy.parse("ring")
    with pytest.raises(ValueError, match="heads_kv must divide heads_q; got heads_q=6, heads_kv=4"):
        explain_cached(
            world_size=2,
            cached=8,
            new=1,
            heads_q=6,
            heads_kv=4,
            head_dim=8,
            hardware=_hardware("bfloat16"),
        )
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1; got 0"):
        generate_reference(TinyCausalLM(TinyLMConfig()), [[1, 2]], 0)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    ("name", "value"),
    [("cached", 1000.5), ("new", 1.5), ("block_size", 16.5), ("batch", 1.5), ("world_size", 4.0),
     ("batch", True)],
)  # fmt: skip
def test_planning_sizes_must_be_ints(name: str, value: object) -> None:
    """A fractional token count is no count: it is refused, naming it, not planned as a
    rounded one (1.5 new tokens planned as 2) nor failing deep inside as a TypeError."""
    sizes: dict[str, Any] = {"world_size": 4, "batch": 2, "cached": 1000, "new": 1}
    with pytest.raises(ValueError, match=_literal(f"{name} must be an int >= ")):
        uniform_shards(**{**sizes, name: value})
    with pytest.raises(ValueError, match=_literal(f"{name} must be an int >= ")):
        explain_cached(
            **{**sizes, name: value}, heads_q=8, heads_kv=2, head_dim=64, hardware=_hardware()
        )


def test_attention_call_validation(single_rank_group: None) -> None:
    cache = DistributedKVCache(num_layers=2, batch=1, heads_kv=2, head_dim=4)
    q = torch.zeros(3, 4, 4)
    kv = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="no cache step has begun"):
        cached_attn(q, kv, kv, cache=cache, layer=0)
    cache.begin_step((3,))
    for kwargs, words in [
        ({"q": torch.zeros(2, 4, 4)}, "q must have shape (rows=3, heads_q, head_dim=4)"),
        ({"q": torch.zeros(3, 3, 4)}, "heads_kv must divide heads_q; got heads_q=3, heads_kv=2"),
        ({"q": torch.zeros(3, 4, 4, dtype=torch.float64)}, "q must be torch.float32 on cpu"),
        ({"layer": 2}, "layer must be an int in [0, 2); got 2"),
        ({"strategy": "ulysses"}, "strategy must be one of 'pass_q', 'pass_kv'"),
        ({"softmax_scale": -1.0}, "softmax_scale must be a finite number > 0 or None; got -1.0"),
        ({"kernel": "nope"}, "kernel must be one of"),
        ({"layer": True}, "layer must be an int in [0, 2); got True"),
        ({"return_lse": 1}, "return_lse must be a bool; got 1"),
        # its merges run outside autograd: before, dq and dk came back wrong (not the oracle's)
        ({"q": q.clone().requires_grad_()}, "cached_attn computes no gradients"),
        # before: raised after the append, so the layer could not run again this step
        ({"strategy": "auto", "hardware": "h100-nvswitch"}, "has attention FLOP/s for float16"),
    ]:
        args = {"q": q, "layer": 0, **kwargs}
        with pytest.raises(ValueError, match=_literal(words)):
            cached_attn(args.pop("q"), kv, kv, cache=cache, **args)
    assert not cache.appended(0), "a rejected call must not append"
    out = cached_attn(q, kv, kv, cache=cache, layer=0, strategy="direct")
    assert isinstance(out, torch.Tensor) and out.shape == (3, 4, 4)
    with pytest.raises(ValueError, match="layer 0 has already run attention in step 0"):
        cached_attn(q, kv, kv, cache=cache, layer=0)
    with pytest.raises(RuntimeError, match=_literal("layers [1] have not appended")):
        cache.begin_step((1,))


# -- plans (tables) ----------------------------------------------------------------------------
def _walk(plan: Any, shards: CachedShards) -> dict[tuple[int, int], int]:
    """Play ``plan`` symbolically: blocks are available only after the transfer that carries
    them; returns how often each (q owner, kv holder) pair is computed, and checks that every
    computed partial reaches its owner exactly once."""
    p = shards.world_size
    has_q = {r: {r} for r in range(p)}
    has_kv = {r: {r} for r in range(p)}
    computed: dict[tuple[int, int], int] = {}
    arrived = {r: {} for r in range(p)}  # owner -> pairs of kv holders merged at the owner
    covers = {(r, o): set() for r in range(p) for o in range(p)}  # kv holders in r's partial
    for t in range(plan.num_rounds):
        # Blocks that travel in round t are computed from round t + 1 on.
        for r in range(p):
            for o, j in plan.computes[r][t]:
                assert o in has_q[r] and j in has_kv[r], f"rank {r} computes ({o}, {j}) early"
                computed[(o, j)] = computed.get((o, j), 0) + 1
                covers[(r, o)].add(j)
        for tr in sorted(plan.transfers, key=lambda x: x.after_segments):
            if tr.step != t:
                continue
            if tr.payload is Payload.Q:
                assert set(tr.owners) <= has_q[tr.src], f"{tr} forwards a block it lacks"
                has_q[tr.dst] |= set(tr.owners)
            elif tr.payload is Payload.KV:
                assert set(tr.owners) <= has_kv[tr.src], f"{tr} forwards a shard it lacks"
                has_kv[tr.dst] |= set(tr.owners)
            else:
                for o in tr.owners:
                    assert covers[(tr.src, o)], f"{tr} returns an empty partial"
                    for j in covers[(tr.src, o)]:
                        if tr.dst == o:
                            arrived[o][j] = arrived[o].get(j, 0) + 1
                        else:
                            covers[(tr.dst, o)].add(j)
                    covers[(tr.src, o)] = set()
    for o in range(p):
        for j in covers[(o, o)]:
            arrived[o][j] = arrived[o].get(j, 0) + 1
    for o, j in computed:
        assert arrived[o].get(j) == 1, f"partial ({o}, {j}) reached its owner {arrived[o]}"
    return computed


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 9])
def test_plans_compute_every_visible_pair_once(world: int) -> None:
    for cached, new, batch in [(0, 5, 1), (3, 1, 2), (40, 1, 3), (13, 9, 2), (0, 1, 1)]:
        shards = uniform_shards(
            world_size=world, batch=batch, cached=cached, new=new, block_size=BLOCK
        )
        visible = {
            (o, j)
            for o in range(world)
            for j in range(world)
            if any(
                bool((kp.unsqueeze(0) <= qp.unsqueeze(1)).any())
                for qp, kp in zip(shards.q_positions[o], shards.kv_positions[j], strict=True)
            )
        }
        for strategy in CachedStrategy:
            plan = build_cached_plan(strategy, shards)
            computed = _walk(plan, shards)
            assert set(computed) == visible and set(computed.values()) <= {1}, strategy
            rounds = {
                "pass_q": world,
                "pass_kv": world,
                "direct": 2 if world > 1 else 1,
                "tree": 2 * math.ceil(math.log2(world)) + 1,
            }[strategy.value]
            assert plan.num_rounds == rounds


def _children(rel: int, world: int) -> int:
    """Children of node rel in a binomial tree of ``world`` nodes (rel 0 is the root)."""
    return sum(1 for k in range(world.bit_length()) if 2**k > rel and rel + 2**k < world)


def _expected_sent(
    strategy: str, rank: int, q_rows: list[int], kv_rows: list[int], dims: dict[str, int]
) -> dict[str, int]:
    """Bytes ``rank`` sends per flow when every rank holds a key older than every new token,
    from the strategies' definitions (Note [Cached strategies])."""
    p = len(q_rows)
    hq, hkv, d, e, a = dims["hq"], dims["hkv"], dims["d"], dims["e"], dims["a"]
    q_row, kv_row, out_row = hq * d * e, 2 * hkv * d * e, hq * d * e + hq * a
    others = [o for o in range(p) if o != rank]
    back = sum(q_rows[o] for o in others) * out_row
    if strategy == "pass_q":  # forwards every block but the one it got last (from r + 1)
        return {
            "travel": sum(q_rows[o] for o in range(p) if o != (rank - 1) % p) * q_row,
            "return": back,
        }
    if strategy == "pass_kv":  # a shard goes down the ring as far as the last rank with queries
        reach = [
            max([s for s in range(1, p) if q_rows[(j - s) % p] > 0], default=0) for j in range(p)
        ]
        return {
            "travel": sum(kv_rows[j] for j in range(p) if (j - rank) % p < reach[j]) * kv_row,
            "return": 0,
        }
    if strategy == "direct":
        return {"travel": (p - 1) * q_rows[rank] * q_row, "return": back}
    fan = sum(_children((rank - o) % p, p) * q_rows[o] for o in range(p))
    return {"travel": fan * q_row, "return": back}


def test_plan_bytes_match_definitions_and_round_model() -> None:
    dims = {"hq": 8, "hkv": 2, "d": 16, "e": 2, "a": 4}
    hw = _hardware(
        "bfloat16", forward_flops_per_s=1e30, memory_bandwidth_bytes_per_s=1e30, latency_s=0.0
    )
    for world in (2, 3, 4, 7):
        shards = uniform_shards(
            world_size=world, batch=2, cached=BLOCK * world * 3, new=11, block_size=BLOCK
        )
        for strategy in STRATEGIES:
            plan = build_cached_plan(strategy, shards)
            sent = {r: {"travel": 0, "return": 0} for r in range(world)}
            for tr in plan.transfers:
                row = {
                    Payload.Q: 8 * 16 * 2,
                    Payload.KV: 2 * 2 * 16 * 2,
                    Payload.OUT: 8 * 16 * 2 + 8 * 4,
                }[tr.payload]
                sent[tr.src][tr.payload.flow.value] += tr.num_rows * row
            for r in range(world):
                want = _expected_sent(strategy, r, list(shards.q_rows), list(shards.kv_rows), dims)
                assert sent[r] == want, (world, strategy, r)
            pred = predict_cached(
                plan, shards, heads_q=8, heads_kv=2, head_dim=16, dtype="bfloat16", hardware=hw
            )
            assert pred.travel_bytes == max(s["travel"] for s in sent.values())
            assert pred.return_bytes == max(s["return"] for s in sent.values())
    # The simulator by hand: P = 2, pass_kv, comm only: round 0 carries each shard one hop
    # (mesh: separate links), round 1's computes are free; the call is the biggest shard's
    # flight, which is also the busiest link's load.
    shards = uniform_shards(world_size=2, batch=1, cached=6, new=2, block_size=BLOCK)
    pred = predict_cached(
        build_cached_plan("pass_kv", shards),
        shards,
        heads_q=8,
        heads_kv=2,
        head_dim=16,
        dtype="bfloat16",
        hardware=hw,
    )
    biggest = max(shards.kv_rows) * 2 * 2 * 16 * 2
    assert pred.total_s == pytest.approx(biggest / 1e9)
    assert pred.wire_s == pytest.approx(biggest / 1e9) and pred.compute_s < 1e-20


def test_the_simulator_overlaps_the_ranks_computes() -> None:
    """P = 2, every new token on rank 0 (one 1024-token block), compute only: pass-Q sends
    the Q block before rank 0 computes its own, so rank 1 computes beside it and the call
    is the longer block; pass-KV computes both blocks on rank 0, one after the other."""
    hw = _hardware(
        "bfloat16",
        link_bandwidth_bytes_per_s=1e30,
        memory_bandwidth_bytes_per_s=1e30,
        latency_s=0.0,
    )
    shards = uniform_shards(world_size=2, batch=1, cached=4096, new=16, block_size=1024)
    assert shards.q_rows == (16, 0) and shards.kv_rows == (2064, 2048)
    block_s = [4 * 8 * 64 * 16 * keys / 1e10 for keys in (2064, 2048)]  # 4 Hq D T keys / F
    dims: dict[str, Any] = {"heads_q": 8, "heads_kv": 2, "head_dim": 64, "dtype": "bfloat16"}
    want = {"pass_q": max(block_s), "pass_kv": sum(block_s)}
    for strategy, want_s in want.items():
        plan = build_cached_plan(strategy, shards)
        pred = predict_cached(plan, shards, **dims, hardware=hw)
        assert pred.total_s == pytest.approx(want_s, rel=1e-9), strategy


def test_threshold_is_metas_criterion_and_the_pick_follows_it() -> None:
    assert pass_q_threshold(heads_q=32, heads_kv=8, head_dim=128, elem_bytes=2) == pytest.approx(
        2 * 8 / 32 * 256 / 260
    )
    assert pass_q_threshold(heads_q=8, heads_kv=8, head_dim=64, elem_bytes=4) > 1  # MHA: always
    # Comm-bound (compute free, no latency), P = 8: pass_q below the threshold, pass_kv above.
    hw = _hardware(
        "bfloat16", forward_flops_per_s=1e30, memory_bandwidth_bytes_per_s=1e30, latency_s=0.0
    )
    world, block = 8, 8
    for hq, hkv in [(32, 8), (8, 2), (16, 1)]:
        thr = pass_q_threshold(heads_q=hq, heads_kv=hkv, head_dim=64, elem_bytes=2)
        for factor, want in [(0.5, "pass_q"), (2.0, "pass_kv")]:
            frac = min(factor * thr, 0.95)
            total = world * block * 32
            new = round(frac * total / (world * block)) * world * block
            choice = explain_cached(
                world_size=world,
                cached=total - new,
                new=new,
                heads_q=hq,
                heads_kv=hkv,
                head_dim=64,
                hardware=hw,
                block_size=block,
                candidates=("pass_q", "pass_kv"),
            )
            assert choice.pick.value == want, (hq, hkv, frac, choice.reason)
            assert f"{thr:.3f}" in choice.reason
    # Latency-bound decode: one round of direct messages beats log P tree rounds and P - 1
    # ring hops; bandwidth-bound big blocks from one owner go to the tree (P = 8).
    slow = _hardware(
        "bfloat16",
        forward_flops_per_s=1e30,
        memory_bandwidth_bytes_per_s=1e30,
        latency_s=1e-3,
        link_bandwidth_bytes_per_s=1e12,
    )
    shards = uniform_shards(world_size=8, batch=1, cached=4096, new=1, block_size=64)
    assert (
        choose_cached_strategy(
            shards, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16", hardware=slow
        ).pick
        is CachedStrategy.DIRECT
    )
    wide = _hardware(
        "bfloat16",
        forward_flops_per_s=1e30,
        memory_bandwidth_bytes_per_s=1e30,
        latency_s=0.0,
        link_bandwidth_bytes_per_s=1e9,
    )
    from dataclasses import replace

    port = replace(
        wide,
        interconnect=replace(wide.interconnect, topology="switch", port_bandwidth_bytes_per_s=1e9),
    )
    shards = uniform_shards(world_size=8, batch=1, cached=4096, new=64, block_size=64)
    picks = choose_cached_strategy(
        shards,
        heads_q=8,
        heads_kv=2,
        head_dim=64,
        dtype="bfloat16",
        hardware=port,
        candidates=("direct", "tree"),
    )
    assert picks.pick is CachedStrategy.TREE, picks.reason


# -- distributed: attention against the oracle, bytes, generation, budget ----------------------
def _tolerance(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype,
    plain: float,
    name: str,
) -> str | None:
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    if dtype == torch.float64:
        return None if err <= 1e-10 else f"{name}: {err:.3g} > 1e-10"
    if dtype == torch.float32:
        try:
            torch.testing.assert_close(got, want.to(got.dtype))
        except AssertionError as exc:
            return f"{name}: {str(exc).splitlines()[0]}"
        return None
    eps = torch.finfo(torch.float32 if name == "lse" else dtype).eps
    bound = 2 * plain + eps * (want.abs().max().item() if want.numel() else 0.0)
    return None if err <= bound else f"{name}: {err:.3g} > {bound:.3g} (plain {plain:.3g})"


def _plain_errors(
    seq: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> tuple[float, float]:
    """Errors of plain one-process attention in ``dtype`` (out via SDPA, lse via one kernel
    call) against the float64 oracle: the bf16 yardstick."""
    q, k, v = (x.unsqueeze(0) for x in seq)
    groups = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).transpose(1, 2),
        k.to(dtype).transpose(1, 2).repeat_interleave(groups, 1),
        v.to(dtype).transpose(1, 2).repeat_interleave(groups, 1),
        is_causal=True,
        scale=q.shape[-1] ** -0.5,
    ).transpose(1, 2)
    lse = plain_lse_error(q, k, v, ref[1], causal=True, scale=q.shape[-1] ** -0.5, dtype=dtype)
    return (out.double() - ref[0]).abs().max().item(), lse


def _attention_grid(dtypes: tuple[str, ...]) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tokenring.get_communicator()
    failures = []
    for (cached, new), strategy, (hq, hkv), dtype_name in itertools.product(
        CONFIGS, [*STRATEGIES, "auto"], HEADS, dtypes
    ):
        if dtype_name != "float64" and strategy == "auto":
            continue
        dtype, d, batch = DTYPES[dtype_name], 8, len(cached)
        gen = torch.Generator().manual_seed(hash((cached, new, hq)) % 2**31)
        seqs = [
            tuple(
                torch.randn(c + t, h, d, generator=gen, dtype=torch.float64).to(dtype).double()
                for h in (hq, hkv, hkv)
            )
            for c, t in zip(cached, new, strict=True)
        ]
        refs = [
            full_attention(*(x.unsqueeze(0) for x in s), causal=True, scale=d**-0.5) for s in seqs
        ]
        plains = [
            _plain_errors(s, r, dtype) if dtype == torch.bfloat16 else (0.0, 0.0)
            for s, r in zip(seqs, refs, strict=True)
        ]
        cache = DistributedKVCache(
            num_layers=1, batch=batch, heads_kv=hkv, head_dim=d, dtype=dtype, block_size=BLOCK
        )
        label = f"{cached}+{new} {strategy} {hq}/{hkv} {dtype_name}"
        for phase in (cached, new):
            if not any(phase) and phase is cached:
                continue
            step = cache.begin_step(phase)
            pos = step.new_positions[rank]
            q, k, v = (
                torch.cat([s[i][p] for s, p in zip(seqs, pos, strict=True)]).to(dtype)
                for i in range(3)
            )
            comm.counter.reset()
            out, lse = cached_attn(
                q,
                k,
                v,
                cache=cache,
                layer=0,
                strategy=strategy,
                hardware=_hardware() if strategy == "auto" else None,
                return_lse=True,
            )
            want = torch.cat([r[0][0, p] for r, p in zip(refs, pos, strict=True)])
            want_lse = torch.cat([r[1][0, :, p] for r, p in zip(refs, pos, strict=True)], dim=1)
            if lse.dtype != (torch.float64 if dtype == torch.float64 else torch.float32):
                failures.append(f"{label}: lse dtype {lse.dtype}")
            for got, ref, plain, name in (
                (out, want, max(x[0] for x in plains), "out"),
                (lse, want_lse, max(x[1] for x in plains), "lse"),
            ):
                problem = _tolerance(got, ref, dtype, plain, name)
                if problem:
                    failures.append(f"{label} phase {phase}: {problem}")
            # Bytes: when every rank holds a key older than every new token, each strategy's
            # traffic follows from its definition.
            everyone = all(
                len(step.kv_positions[r][b]) and int(step.kv_positions[r][b][0]) < step.cached[b]
                for b in range(batch)
                if step.new[b]
                for r in range(world)
            )
            if everyone and strategy != "auto" and not step.zigzag:
                sent = {"travel": 0, "return": 0}
                for (flow, _), num in comm.counter.sent_bytes.items():
                    sent[flow] += num
                e = torch.empty((), dtype=dtype).element_size()
                dims = {"hq": hq, "hkv": hkv, "d": d, "e": e, "a": 8 if e == 8 else 4}
                want_sent = _expected_sent(
                    strategy,
                    rank,
                    [step.num_rows(r) for r in range(world)],
                    [sum(len(x) for x in step.kv_positions[r]) for r in range(world)],
                    dims,
                )
                if sent != want_sent:
                    failures.append(f"{label}: sent {sent} != definition {want_sent}")
    return failures


def _generation(prompts: list[list[int]], steps: int, strategy: str, budget: int | None) -> Any:
    model = TinyCausalLM(TinyLMConfig(), seed=5, dtype=torch.float64)
    result = generate(
        model,
        prompts,
        steps,
        strategy=strategy,
        hardware=_hardware() if strategy == "auto" else None,  # a forced strategy refuses one
        block_size=BLOCK,
        budget_bytes=budget,
    )
    return result.tokens, result.strategies, result.cache.tokens_held()


def _budget_error(budget: int) -> str:
    cache = DistributedKVCache(
        num_layers=2, batch=1, heads_kv=2, head_dim=8, budget_bytes=budget, block_size=BLOCK
    )
    step = cache.begin_step((BLOCK,))
    n = step.num_rows(cache.rank)
    for layer in range(2):
        cache.append(layer, torch.zeros(n, 2, 8), torch.zeros(n, 2, 8))
    try:
        cache.begin_step((64,))
    except KVCacheBudgetError as exc:
        return str(exc)
    return "no error"


def run_all(dtypes: tuple[str, ...], generations: list[tuple[Any, ...]]) -> dict[str, Any]:
    return {
        "attention": _attention_grid(dtypes),
        "generations": [_generation(*g) for g in generations],
        "budget": _budget_error(3000),
    }


PROMPT_RNG = torch.Generator().manual_seed(11)
PROMPTS_EQUAL = [torch.randint(0, 96, (48,), generator=PROMPT_RNG).tolist() for _ in range(2)]
PROMPTS_MIXED = [torch.randint(0, 96, (n,), generator=PROMPT_RNG).tolist() for n in (37, 21, 50)]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_cached_attention_generation_and_budget_on_ranks(
    world: int, request: pytest.FixtureRequest
) -> None:
    # World size 2 runs in test_bench_decode_mode below (attention, bytes, oracle).
    dtypes = ("float64", "float32", "bfloat16") if world == 4 else ("float64",)
    # The tiny model caches 2 layers x K/V of 2 heads x 16 dims x 8 bytes = 1 KiB a token;
    # from 3 ranks on, a rank's budget is half of what the whole batch's context needs.
    budget = 1024 * 64 if world >= 3 else None
    generations = [
        (PROMPTS_EQUAL, 6, "auto", budget),
        (PROMPTS_MIXED, 6, "auto" if world != 4 else "tree", budget),
    ]
    if world == 4:
        generations.append((PROMPTS_MIXED, 4, "pass_kv", None))
    if world == 1:
        request.getfixturevalue("single_rank_group")
        per_rank = [run_all(dtypes, generations)]
    else:
        per_rank = tokenring.launch(run_all, dtypes, generations, world_size=world, timeout_s=240)
    failures = [f"rank {r}: {f}" for r, res in enumerate(per_rank) for f in res["attention"]]
    assert not failures, "\n".join(failures)
    model = TinyCausalLM(TinyLMConfig(), seed=5, dtype=torch.float64)
    for index, (prompts, steps, strategy, budget_bytes) in enumerate(generations):
        want = generate_reference(model, prompts, steps)
        for r, res in enumerate(per_rank):
            tokens, used, _ = res["generations"][index]
            assert tokens == want, f"rank {r} {strategy}: {tokens} != one process {want}"
        _, used, held = per_rank[0]["generations"][index]
        if world > 1:  # no rank holds a whole prompt; no rank could hold the whole batch
            for b, prompt in enumerate(prompts):
                assert max(h[b] for h in held) < len(prompt), held
            total = sum(len(p) + steps for p in prompts)
            assert budget_bytes is None or budget_bytes < total * 1024
        if prompts is PROMPTS_EQUAL:
            assert used[0].endswith("(zigzag)"), used  # the first prefill's ordinary path
        if strategy != "auto":
            assert set(used) == {strategy}, used
    messages = {res["budget"] for res in per_rank}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "KV cache budget exceeded" in message and "budget is 3000 bytes" in message, message


def test_bench_decode_mode_rows(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """``tokenring bench --mode decode`` on 2 ranks: every row verified against float64, its
    bytes equal to the plan's on every rank and to the prediction's, and a pick."""
    md = tmp_path / "decode.md"
    argv = [
        "bench",
        "--mode",
        "decode",
        "--world-size",
        "2",
        "--cached",
        "37",
        "--new",
        "1,6",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "8",
        "--block-size",
        "4",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--json",
        "--markdown",
        str(md),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(r["new"], r["strategy"]) for r in rows} == {(t, s) for t in (1, 6) for s in STRATEGIES}
    for r in rows:
        assert r["verified"] and r["bytes_match_plan"], r
        assert r["world_size"] == 2 and r["ms_p10"] <= r["ms_median"] <= r["ms_p90"]
        assert r["model_ms"] > 0 and r["auto_pick"] in STRATEGIES
        assert r["travel_bytes_per_rank"] == r["model_travel_bytes"] > 0
        assert r["return_bytes_per_rank"] == r["model_return_bytes"]
        assert (r["return_bytes_per_rank"] == 0) == (r["strategy"] == "pass_kv")
    text = md.read_text()
    assert "Reproduce with" in text and text.count("\n| ") == 1 + len(rows)


def test_explain_cached_kernel_call_s_overrides_the_hardwares() -> None:
    """``kernel_call_s=`` prices a kernel call as the hardware would with that value, and a
    value the hardware does not have changes the prices (it is not ignored)."""
    from dataclasses import replace

    hw = _hardware("bfloat16")
    case: dict[str, Any] = dict(
        world_size=4, cached=1024, new=64, heads_q=8, heads_kv=2, head_dim=64, block_size=64
    )
    given = explain_cached(**case, hardware=hw, kernel_call_s=1e-3)
    assert given == explain_cached(**case, hardware=replace(hw, kernel_call_s=1e-3))
    plain = explain_cached(**case, hardware=replace(hw, kernel_call_s=0.0))
    assert all(
        a.total_s > b.total_s for a, b in zip(given.predictions, plain.predictions, strict=True)
    )
    with pytest.raises(ValueError, match="kernel_call_s must be a finite number >= 0; got -1"):
        explain_cached(**case, hardware=hw, kernel_call_s=-1.0)


def test_cache_rejects_a_group_with_rank_and_non_bool_or_bool_options(
    single_rank_group: None,
) -> None:
    """group= with rank=/world_size= is refused (not the group silently dropped), flags must
    be bools and sizes ints (True is not a size): each error names the argument and value."""
    base: dict[str, Any] = {"num_layers": 1, "batch": 1, "heads_kv": 2, "head_dim": 4}
    comm = tokenring.get_communicator(None)
    for group in (comm, dist.group.WORLD):
        for ranks in ({"rank": 0, "world_size": 1}, {"rank": 0}, {"world_size": 1}):
            with pytest.raises(ValueError, match="group and rank/world_size") as info:
                DistributedKVCache(**base, group=group, **ranks)
            assert type(group).__name__ in str(info.value)
            for name, value in ranks.items():
                assert f"{name}={value}" in str(info.value)
    for change, words in [
        ({"zigzag_first_prefill": "no"}, "zigzag_first_prefill must be a bool; got 'no'"),
        ({"zigzag_first_prefill": 0}, "zigzag_first_prefill must be a bool; got 0"),
        ({"num_layers": True}, "num_layers must be an int >= 1; got True"),
        ({"batch": True}, "batch must be an int >= 1; got True"),
        ({"heads_kv": True}, "heads_kv must be an int >= 1; got True"),
        ({"head_dim": True}, "head_dim must be an int >= 1; got True"),
        ({"block_size": True}, "block_size must be an int >= 1; got True"),
        ({"budget_bytes": True}, "budget_bytes must be >= 0 or None; got True"),
        ({"budget_bytes": "8"}, "budget_bytes must be >= 0 or None; got '8'"),
        ({"rank": True, "world_size": 2}, "rank must be in [0, world_size=2); got True"),
        ({"rank": 0, "world_size": True}, "world_size must be an int >= 1; got True"),
        ({"rank": 0, "world_size": 0}, "world_size must be an int >= 1; got 0"),
    ]:
        with pytest.raises(ValueError, match=_literal(words)):
            DistributedKVCache(**{**base, **change})
    # the valid forms still build: a group alone (attention runs on it), ranks alone
    assert DistributedKVCache(**base, group=comm).comm is comm
    assert DistributedKVCache(**base, rank=1, world_size=2).comm is None
    # zigzag_first_prefill=False is honoured: a first prefill of 2P tokens stays block-cyclic
    for flag in (True, False):
        cache = DistributedKVCache(
            **base, block_size=1, rank=0, world_size=2, zigzag_first_prefill=flag
        )
        step = cache.begin_step((4,))
        assert step.zigzag is flag
        # zigzag: rank 0 holds chunks 0 and 3 of 4; block-cyclic (bs=1): positions 0 and 2
        assert step.new_positions[0][0].tolist() == ([0, 3] if flag else [0, 2])


def test_begin_step_check_ranks_must_be_a_bool(single_rank_group: None) -> None:
    """As cached_attn: check_ranks="no" is refused (not read as true), with or without a
    group, and the cache is unchanged."""
    base: dict[str, Any] = {"num_layers": 1, "batch": 1, "heads_kv": 2, "head_dim": 4}
    for cache in (
        DistributedKVCache(**base, rank=0, world_size=2),
        DistributedKVCache(**base, group=tokenring.get_communicator(None)),
    ):
        for flag in ("no", 1, None):
            with pytest.raises(
                ValueError, match=_literal(f"check_ranks must be a bool; got {flag!r}")
            ):
                cache.begin_step((3,), check_ranks=flag)  # type: ignore[arg-type]
            assert cache.step is None and cache.lengths == (0,)
        assert cache.begin_step((3,), check_ranks=False).new == (3,)


def _cached_attention_on(device: str) -> list[str]:
    """Every strategy on a cache built with ``device`` (no index: the current one) against the
    float64 oracle: a prompt not divisible by P, then decode steps, batch 2."""
    rank = dist.get_rank()
    failures = []
    for strategy in STRATEGIES:
        cache = DistributedKVCache(
            num_layers=1, batch=2, heads_kv=2, head_dim=8, dtype=torch.float64, device=device
        )
        gen = torch.Generator().manual_seed(5)
        seqs = [
            [torch.randn(12, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
            for _ in range(2)
        ]
        refs = [full_attention(*(x[None] for x in s), causal=True, scale=8**-0.5) for s in seqs]
        for new in ((7, 5), (1, 1), (1, 0), (3, 1)):
            pos = cache.begin_step(new).new_positions[rank]
            q, k, v = (
                torch.cat([s[i][p] for s, p in zip(seqs, pos, strict=True)]) for i in range(3)
            )
            try:
                out = cached_attn(
                    *(x.to(cache.device) for x in (q, k, v)),
                    cache=cache,
                    layer=0,
                    strategy=strategy,
                )
            except ValueError as exc:
                failures.append(f"{strategy} {new}: {exc}")
                break
            want = torch.cat([r[0][0, p] for r, p in zip(refs, pos, strict=True)])
            problem = _tolerance(out.cpu(), want, torch.float64, 0.0, "out")
            if problem:
                failures.append(f"{strategy} {new}: {problem}")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cache_on_cuda_without_an_index_takes_cuda_tensors() -> None:
    # Before: device="cuda" stayed cuda while every tensor is on cuda:0, so each call was refused.
    failures = tokenring.launch(_cached_attention_on, "cuda", world_size=2, timeout_s=300)
    assert not any(failures), failures


def _caches_built_differently(change: dict[str, Any]) -> str:
    options = {"num_layers": 1, "batch": 1, "heads_kv": 2, "head_dim": 8, "block_size": 2}
    cache = DistributedKVCache(**(options | change if dist.get_rank() == 1 else options))
    try:
        cache.begin_step((12,))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # before: each rank placed every rank's tokens by its own block size: answers 0.76 off
        ({"block_size": 3}, "block_size: rank 0 has 2, rank 1 has 3"),
        # before: one rank ran the ordinary path, the other the plan: a timeout
        (
            {"zigzag_first_prefill": False},
            "zigzag_first_prefill: rank 0 has True, rank 1 has False",
        ),
        # before: only rank 1 would raise KVCacheBudgetError, and rank 0 wait for it
        ({"budget_bytes": 10}, "budget_bytes: rank 0 has None, rank 1 has 10"),
    ],
)
def test_ranks_whose_caches_differ_are_told_at_the_first_step(
    change: dict[str, Any], words: str
) -> None:
    for message in tokenring.launch(_caches_built_differently, change, world_size=2):
        assert words in message, message
