"""Tests for tokenring.model.planner: the pick, its determinism, and calibration on real ranks.

The expected picks follow from the bytes on the busiest direction of a steady step (Note
[Choosing] in tokenring.model.planner), derived here from the payload definitions: TokenRing returns
Hq*D*e + 4*Hq bytes per row where Ring moves 2*Hkv*D*e.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tokenring.core.schedule import Strategy
from tokenring.launch import launch
from tokenring.model.costmodel import PRESETS, CollectiveRouting, Hardware, Interconnect, Topology
from tokenring.model.planner import _plan, calibrate, choose_strategy, explain
from tokenring.runtime.comm import Communicator
from tokenring.strategies.hybrid import HybridSpec

# An 8-device full mesh with slow links (the numbers are made up, chosen so that a zigzag step
# of s = 4096 rows is comm-bound for Ring MHA): 100 TFLOP/s, 10 GB/s per link and direction.
MESH = Hardware(
    name="test-mesh",
    interconnect=Interconnect(
        topology=Topology.MESH, link_bandwidth_bytes_per_s=10e9, latency_s=5e-6
    ),
    forward_flops_per_s=100e12,
    backward_flops_per_s=80e12,
    memory_bandwidth_bytes_per_s=1e12,
)
CALL: dict[str, Any] = dict(
    world_size=8, seq_local=4096, head_dim=128, dtype="bfloat16", causal=True
)
PAIR = ["token_ring", "ring"]  # the two strategies the byte-ratio argument compares


def _comm_bound_per_step(heads_q: int, heads_kv: int) -> dict[Strategy, bool]:
    """Independent check of the regime: steady zigzag step time vs bytes on the busiest link."""
    s, d, e = 4096, 128, 2
    compute_s = s * (s // 2) * 4 * heads_q * d / MESH.forward_flops_per_s
    link = MESH.interconnect.link_bandwidth_bytes_per_s
    token_ring = s * (heads_q * d * e + 4 * heads_q) / link
    ring = s * 2 * heads_kv * d * e / link
    return {Strategy.TOKEN_RING: token_ring > compute_s, Strategy.RING: ring > compute_s}


def test_mha_comm_bound_picks_token_ring() -> None:
    assert _comm_bound_per_step(32, 32) == {Strategy.TOKEN_RING: True, Strategy.RING: True}
    plan = explain(
        heads_q=32,
        heads_kv=32,
        hardware=MESH,
        layout="zigzag",
        strategies=PAIR,
        **CALL,
    )
    assert plan.pick is Strategy.TOKEN_RING
    times = {p.strategy: p.total_s for p in plan.predictions}
    # Ring moves ~2x the bytes on its busiest link: clearly slower, not a coin toss.
    assert times[Strategy.RING] > 1.3 * times[Strategy.TOKEN_RING]
    assert "token_ring" in plan.reason and "ring" in plan.reason


def test_gqa_32_8_on_a_mesh_picks_ring() -> None:
    # Hq / (2 * Hkv) = 2: TokenRing's return is twice Ring's K+V, and TokenRing is comm-bound.
    assert _comm_bound_per_step(32, 8)[Strategy.TOKEN_RING]
    for training in (False, True):
        plan = explain(
            heads_q=32,
            heads_kv=8,
            hardware=MESH,
            layout="zigzag",
            training=training,
            strategies=PAIR,
            **CALL,
        )
        assert plan.pick is Strategy.RING, plan.reason
    # choose_strategy is explain's pick over every strategy, for the caller's layout
    for training in (False, True):
        kw: dict[str, Any] = dict(heads_q=32, heads_kv=8, hardware=MESH, training=training, **CALL)
        plan = explain(layout="zigzag", **kw)
        assert choose_strategy(layout="zigzag", **kw) is plan.pick


def test_choice_is_deterministic_and_ties_go_to_the_fixed_order() -> None:
    kw: dict[str, Any] = dict(heads_q=32, heads_kv=8, hardware=PRESETS["a10-pcie"], **CALL)
    kw["dtype"] = "float16"
    first = explain(**kw)
    _plan.cache_clear()  # recompute from scratch: same inputs, same plan
    assert explain(**kw) == first
    # One rank: both strategies compute the same local block, nothing moves: a tie.
    tie = dict(kw, world_size=1, layout="contiguous")
    for order in (["token_ring", "ring"], ["ring", "token_ring"]):
        plan = explain(**tie, strategies=order)
        totals = {p.strategy: p.total_s for p in plan.predictions}
        assert totals[Strategy.RING] == pytest.approx(totals[Strategy.TOKEN_RING], rel=1e-9)
        assert plan.pick is Strategy.TOKEN_RING  # Strategy's declaration order
        assert [p.strategy for p in plan.predictions][:2] == [Strategy.TOKEN_RING, Strategy.RING]


def test_explain_returns_plain_data() -> None:
    plan = explain(heads_q=32, heads_kv=32, hardware=MESH, **CALL)
    data = json.loads(json.dumps(plan.as_dict()))
    assert {p["layout"] for p in data["predictions"]} == {"contiguous", "zigzag"}
    assert data["pick"] in {s.value for s in Strategy}
    assert data["layout"] == min(data["predictions"], key=lambda p: p["total_s"])["layout"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("head_dim", 64.5),
        ("batch", 1.5),
        ("heads_q", True),
        ("seq_local", 1024.0),
        ("world_size", 4.0),
    ],
)
def test_explain_refuses_fractional_sizes(name: str, value: object) -> None:
    """A fractional size is no size: refused naming it, not priced as one (the prediction of
    head_dim=64.5 or seq_local=1024.0 used to be a number)."""
    sizes: dict[str, Any] = {"heads_q": 8, "heads_kv": 8, "batch": 1}
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1; got {value!r}"):
        explain(hardware=MESH, **{**CALL, **sizes, name: value})


def test_explain_errors_and_skips() -> None:
    with pytest.raises(ValueError, match="has attention FLOP/s for float16, bfloat16"):
        explain(heads_q=8, heads_kv=8, hardware=MESH, **dict(CALL, dtype=torch.float32))
    with pytest.raises(ValueError, match="world_size must be >= 1; got 0"):
        explain(heads_q=8, heads_kv=8, hardware=MESH, **dict(CALL, world_size=0))
    # Above the event engine's range only strategies with closed forms are predicted; the
    # others are listed with the reason, never dropped silently.
    plan = explain(
        heads_q=8,
        heads_kv=8,
        hardware=MESH,
        layout="zigzag",
        **dict(CALL, world_size=128),
    )
    predicted = {p.strategy for p in plan.predictions}
    assert {Strategy.TOKEN_RING, Strategy.RING} <= predicted
    assert predicted | {s for s, _ in plan.skipped} == set(Strategy)
    for strategy, why in plan.skipped:
        expected = "vectorised engine"
        if strategy.is_collective:  # MESH is NCCL-like (DIRECT): not measured
            expected = "not validated"
        elif strategy is Strategy.HYBRID:  # no factorisation given
            expected = "needs a 2-D mesh"
        assert expected in why, (strategy, why)


def test_collectives_are_candidates_where_their_routing_was_measured() -> None:
    """A comm-bound full mesh of 8 ranks, MHA 32/32 (per rank and link, in units of
    s*H*D*e / B): Ulysses' two all-to-alls move 3/8 (q, k, v of a peer's 4 heads) and ~1/8
    (out + lse of mine) per pair, twice that where a pair's directions take turns (gloo):
    ~1. Any ring strategy must bring K/V (or Q) of the 7 others past each rank, at least half
    a shard each under zigzag, over at most 2 incoming links: >= 7/4. So with gloo's routing
    (measured on the lab) the planner picks Ulysses; with DIRECT (NCCL, not measured here) it
    does not consider the collectives at all."""
    common: dict[str, Any] = dict(CALL, heads_q=32, heads_kv=32, layout="zigzag")
    gloo = dataclasses.replace(MESH, collectives=CollectiveRouting.GLOO)
    gloo = dataclasses.replace(gloo, forward_flops_per_s=1e18, backward_flops_per_s=1e18)
    plan = explain(hardware=gloo, **common)
    assert plan.pick is Strategy.ULYSSES, plan.reason
    assert {p.strategy for p in plan.predictions} >= {Strategy.ULYSSES, Strategy.ALLGATHER_KV}
    assert choose_strategy(hardware=gloo, training=False, **common) is Strategy.ULYSSES
    direct = dataclasses.replace(gloo, collectives=CollectiveRouting.DIRECT)
    plan = explain(hardware=direct, **common)
    assert plan.pick is not Strategy.ULYSSES
    skipped = dict(plan.skipped)
    assert "not validated" in skipped[Strategy.ULYSSES]
    assert "not validated" in skipped[Strategy.ALLGATHER_KV]


def test_hybrid_is_explained_with_a_spec_and_never_auto_picked() -> None:
    """inner = 1 is the outer strategy on every rank: the same prediction, and the tie goes
    to the earlier strategy (Ring). auto cannot run the hybrid (one group, no mesh)."""
    kw: dict[str, Any] = dict(heads_q=32, heads_kv=8, hardware=MESH, layout="zigzag", **CALL)
    plan = explain(
        strategies=["hybrid", "ring"], hybrid=HybridSpec(inner=1, outer_strategy="ring"), **kw
    )
    totals = {p.strategy: p.total_s for p in plan.predictions}
    assert totals[Strategy.HYBRID] == pytest.approx(totals[Strategy.RING], rel=1e-9)
    assert plan.pick is Strategy.RING
    hybrid = next(p for p in plan.as_dict()["predictions"] if p["strategy"] == "hybrid")
    assert hybrid["hybrid"] == "8x1 ring"
    assert choose_strategy(training=False, **kw) is not Strategy.HYBRID
    with pytest.raises(ValueError, match="strategies must name at least one strategy"):
        choose_strategy(training=False, strategies=["hybrid"], **kw)
    with pytest.raises(ValueError, match="inner size must divide the world size"):
        explain(strategies=["hybrid"], hybrid=HybridSpec(inner=3), **kw)


def _calibrate_worker() -> dict[str, Any]:
    comm = Communicator()
    before = (dict(comm.counter.sent_bytes), comm.counter.sent_messages)
    hardware = calibrate(
        comm,
        dtype=torch.float32,
        heads_q=2,
        head_dim=16,
        block_rows=64,
        probe_bytes=1 << 18,
        repeats=2,
    )
    after = (dict(comm.counter.sent_bytes), comm.counter.sent_messages)
    pick = choose_strategy(
        world_size=comm.world_size,
        seq_local=64,
        heads_q=2,
        heads_kv=2,
        head_dim=16,
        dtype=torch.float32,
        causal=True,
        layout="zigzag",
        training=True,
        hardware=hardware,
    )
    dist.barrier()
    return {"hardware": hardware, "counter_kept": before == after, "pick": pick}


def test_calibrate_agrees_across_ranks() -> None:
    results = launch(_calibrate_worker, world_size=2, timeout_s=120.0)
    first = results[0]["hardware"]
    assert all(r["hardware"] == first for r in results)  # identical, not just close
    assert first.host_computes  # CPU ranks compute on their own thread (Note [Rank program])
    assert all(r["pick"] is results[0]["pick"] for r in results)
    assert all(r["counter_kept"] for r in results)  # the probe is not the caller's traffic
    assert first.name == "measured" and first.dtypes == ("float32",)
    assert first.interconnect.topology in (Topology.MESH, Topology.SWITCH)
    for rate in (
        first.forward_flops_per_s,
        first.backward_flops_per_s,
        first.memory_bandwidth_bytes_per_s,
        first.interconnect.link_bandwidth_bytes_per_s,
    ):
        assert 0 < rate < float("inf")
    assert first.interconnect.latency_s >= 0


def test_explain_takes_a_preset_name_for_hardware() -> None:
    """A preset name means that preset (as explain_cached and sequence_parallel_attn take
    it); an unknown name or a non-Hardware is a ValueError naming hardware."""
    kw: dict[str, Any] = dict(heads_q=32, heads_kv=8, layout="zigzag", strategies=PAIR, **CALL)
    for name in ("h100-nvswitch", "a100-nvswitch"):
        plan = explain(hardware=name, **kw)
        assert plan == explain(hardware=PRESETS[name], **kw)
        assert plan.hardware == name
    with pytest.raises(ValueError, match=r"hardware must be one of .*; got 'h100'"):
        explain(hardware="h100", **kw)
    for bad in (None, 3, {"name": "h100-nvswitch"}):
        with pytest.raises(ValueError, match="hardware must be a Hardware or a preset name"):
            explain(hardware=bad, **kw)


def test_explain_flags_must_be_bools() -> None:
    kw: dict[str, Any] = dict(heads_q=8, heads_kv=8, hardware=MESH, strategies=PAIR, **CALL)
    for name, value in [("causal", "no"), ("causal", 1), ("training", "no"), ("training", None)]:
        with pytest.raises(ValueError, match=f"{name} must be a bool; got {value!r}"):
            explain(**{**kw, name: value})
    # choose_strategy goes through explain: the same check
    with pytest.raises(ValueError, match="training must be a bool; got 'no'"):
        choose_strategy(**{**kw, "layout": "zigzag", "training": "no"})


def test_explain_rejects_a_hybrid_its_strategies_leave_out() -> None:
    """hybrid= is predicted only as the 'hybrid' candidate: explicit strategies without it
    make the spec a no-op, so that is an error; strategies=None (every strategy) takes it."""
    spec = HybridSpec(inner=1, outer_strategy="ring")
    kw: dict[str, Any] = dict(heads_q=32, heads_kv=8, hardware=MESH, layout="zigzag", **CALL)
    with pytest.raises(ValueError, match="strategies must include 'hybrid'") as info:
        explain(strategies=PAIR, hybrid=spec, **kw)
    assert "['token_ring', 'ring']" in str(info.value) and repr(spec) in str(info.value)
    with pytest.raises(ValueError, match="hybrid must be a HybridSpec or None; got 2"):
        explain(strategies=["hybrid"], hybrid=2, **kw)
    everything = explain(hybrid=spec, **kw)
    assert Strategy.HYBRID in {p.strategy for p in everything.predictions}
    assert explain(strategies=[*PAIR, "hybrid"], hybrid=spec, **kw).pick is Strategy.RING


def test_no_candidate_is_free_where_memory_traffic_costs() -> None:
    """P = 1, kernels and links free, memory at M = 1 GB/s, gloo's routing (the collectives
    are candidates): every strategy runs the same one block, and its runtime still moves
    memory: every backward computes delta = rowsum(dout * out) (s B Hq (2 D e + a) bytes),
    every forward merges or joins its output, at least writing out once (s B Hq D e bytes).
    All-gather K/V merges and adds exactly as Ring
    does (one block into its own rows), so the two tie. The collectives used to be priced at
    zero here and won the pick for work the model did not count."""
    s, hq, d, e, a, mem = 64, 8, 16, 2, 4, 1e9
    hardware = Hardware(
        name="memory-only",
        interconnect=Interconnect(topology=Topology.MESH, link_bandwidth_bytes_per_s=1e21),
        forward_flops_per_s=1e21,
        backward_flops_per_s=1e21,
        memory_bandwidth_bytes_per_s=mem,
        collectives=CollectiveRouting.GLOO,
    )
    plan = explain(
        world_size=1, seq_local=s, heads_q=hq, heads_kv=hq, head_dim=d, dtype="float16",
        causal=True, layout="zigzag", hardware=hardware, training=True,
    )  # fmt: skip
    predictions = {p.strategy: p for p in plan.predictions}
    assert {Strategy.ULYSSES, Strategy.ALLGATHER_KV} <= set(predictions)
    delta_s, out_s = s * hq * (2 * d * e + a) / mem, s * hq * d * e / mem
    for strategy, prediction in predictions.items():
        assert prediction.forward_s >= out_s * (1 - 1e-9), strategy
        assert prediction.backward_s >= delta_s * (1 - 1e-9), strategy
    gathered, ring = predictions[Strategy.ALLGATHER_KV], predictions[Strategy.RING]
    assert gathered.forward_s == pytest.approx(ring.forward_s, rel=1e-9)
    assert gathered.backward_s == pytest.approx(ring.backward_s, rel=1e-9)
