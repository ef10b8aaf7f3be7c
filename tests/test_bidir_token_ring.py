"""Bidirectional TokenRing as plain data: its lanes, coverage, bytes, and the model.

Pure table tests (milliseconds each); the strategy's numerics on real gloo ranks are in
test_attention.py and test_masks.py with the other ring strategies. Expected values come from
the oracle's definitions (positions, visibility, bytes per link), not from tokenring.core.schedule.
"""

from __future__ import annotations

import itertools

import pytest

from oracle import covered_pairs, expected_bytes, owned_positions, schedule_bytes_per_link
from tokenring.core.schedule import AttentionShape, Flow, Pass, Payload, Strategy
from tokenring.model.costmodel import measured
from tokenring.model.simulate import simulate
from tokenring.strategies import build_schedule

STRATEGY = Strategy.BIDIR_TOKEN_RING
HEADS = [(4, 4), (8, 2), (6, 3), (4, 1), (2, 2)]  # MHA, GQA, odd kv heads, MQA, one each


def _lane_heads(heads_q: int, heads_kv: int) -> tuple[range, range]:
    """Query heads going down and up, from the documented rule: whole kv groups split at
    Hkv // 2; with one kv head, query heads split at Hq // 2."""
    groups = heads_q // heads_kv
    down = (heads_kv // 2) * groups if heads_kv >= 2 else heads_q // 2
    return range(down), range(down, heads_q)


def test_every_needed_pair_and_head_computed_exactly_once() -> None:
    """Each (query position, key position, query head) the mask allows, exactly once, and each
    piece reads the kv head of its query heads (head h reads kv head h // groups)."""
    for (heads_q, heads_kv), layout, causal, world_size in itertools.product(
        HEADS, ("contiguous", "zigzag"), (False, True), (1, 2, 3, 4, 5)
    ):
        seq_local = 6
        seq = world_size * seq_local
        groups = heads_q // heads_kv
        sched = build_schedule(
            STRATEGY,
            "forward",
            layout=layout,
            causal=causal,
            world_size=world_size,
            seq_local=seq_local,
            heads_q=heads_q,
            heads_kv=heads_kv,
        )
        computed = []
        for rank, step in itertools.product(range(world_size), range(world_size)):
            plan = sched.steps[rank][step]
            for piece in plan.pieces:
                qpos = owned_positions(layout, plan.lane_q_owner(piece.lane), world_size, seq)
                kpos = owned_positions(layout, rank, world_size, seq)  # K/V never move
                q_heads = range(*(piece.q_heads or (0, heads_q)))
                kv_heads = range(*(piece.heads or (0, heads_kv)))
                assert {h // groups for h in q_heads} == set(kv_heads), (piece, heads_q)
                for i in range(*piece.q_rows):
                    for j in range(*piece.kv_rows):
                        if piece.causal and j > i:
                            continue
                        computed += [(qpos[i], kpos[j], h) for h in q_heads]
        want = [
            (i, j, h)
            for i, j in covered_pairs(layout, causal, world_size, seq_local)
            for h in range(heads_q)
        ]
        assert sorted(computed) == sorted(want), (heads_q, heads_kv, layout, causal, world_size)


def test_lanes_turn_opposite_ways_and_partials_go_home() -> None:
    """Lane 0 carries the down heads r -> r-1 and holds owner (r + t) at step t, lane 1 the
    up heads r -> r+1 and owner (r - t); every partial goes straight to the owner of the Q
    it was computed from, on its lane, with its lane's heads."""
    for (heads_q, heads_kv), world_size, pass_ in itertools.product(
        HEADS, (2, 3, 4, 5), (Pass.FORWARD, Pass.BACKWARD)
    ):
        sched = build_schedule(
            STRATEGY,
            pass_,
            layout="zigzag",
            causal=True,
            world_size=world_size,
            seq_local=8,
            heads_q=heads_q,
            heads_kv=heads_kv,
        )
        lane_heads = _lane_heads(heads_q, heads_kv)
        for lane, direction in ((0, -1), (1, +1)):
            assert range(*sched.lanes[lane].q_heads) == lane_heads[lane]
            for r, t in itertools.product(range(world_size), range(1, world_size)):
                assert sched.steps[r][t].lane_q_owner(lane) == (r - direction * t) % world_size
        covered: dict[tuple[int, int, int], set[int]] = {}  # (src, step, lane): heads returned
        for tr in sched.transfers:
            if tr.payload.flow is Flow.TRAVEL:
                assert range(*tr.heads) == lane_heads[tr.lane], tr
            else:  # the last block returns in head slices (Note [Last block by heads])
                assert set(range(*tr.heads)) <= set(lane_heads[tr.lane]), tr
                covered.setdefault((tr.src, tr.step, tr.lane), set()).update(range(*tr.heads))
            if tr.payload.flow is Flow.TRAVEL:
                assert tr.payload is (Payload.Q if pass_ is Pass.FORWARD else Payload.Q_GRAD)
                assert tr.dst == (tr.src + (-1, +1)[tr.lane]) % world_size, tr
                assert sched.steps[tr.src][tr.step].lane_q_owner(tr.lane) == tr.owner
            else:
                assert tr.payload is (Payload.OUT if pass_ is Pass.FORWARD else Payload.DQ)
                assert tr.dst == tr.owner == sched.steps[tr.src][tr.step].lane_q_owner(tr.lane)
        for (_, _, lane), heads in covered.items():
            assert heads == set(lane_heads[lane]), (heads_q, heads_kv, world_size, lane, heads)


def test_bytes_per_link_match_formula() -> None:
    """Bytes per (flow, src, dst), forward and backward, equal the oracle's formula; plain and
    masked (documents, windows, padding)."""
    plain = [(None, None, (-1, -1))]
    masked = [(13, [0, 5, 13], (-1, -1)), (24, None, (3, 2)), (30, [0, 4, 4, 17, 30], (5, 5))]
    for (heads_q, heads_kv), layout, causal, world_size, backward, case in itertools.product(
        HEADS, ("contiguous", "zigzag"), (False, True), (1, 2, 3, 4), (False, True), plain + masked
    ):
        seq_len, cu_seqlens, (left, right) = case
        window = (left, 0 if causal else right)
        dims = AttentionShape(
            batch=2,
            heads_q=heads_q,
            heads_kv=heads_kv,
            head_dim=8,
            dtype="bfloat16",
        )
        sizes = {"seq_local": 6} if seq_len is None else {"seq_len": seq_len}
        sched = build_schedule(
            STRATEGY,
            Pass.BACKWARD if backward else Pass.FORWARD,
            layout=layout,
            causal=causal,
            world_size=world_size,
            heads_q=heads_q,
            heads_kv=heads_kv,
            cu_seqlens=cu_seqlens,
            window_size=window,
            **sizes,
        )
        got = schedule_bytes_per_link(sched, dims)
        want = expected_bytes(
            strategy=STRATEGY.value,
            backward=backward,
            layout=layout,
            causal=causal,
            world_size=world_size,
            batch=2,
            heads_q=heads_q,
            heads_kv=heads_kv,
            head_dim=8,
            elem_bytes=2,
            acc_bytes=4,
            cu_seqlens=cu_seqlens,
            window=window,
            **sizes,
        )
        assert got == want, (heads_q, heads_kv, layout, causal, world_size, backward, case)


def test_first_hop_and_exposed_return_are_halved() -> None:
    """MHA: each direction's first hop carries half of TokenRing's Q, and the return left
    exposed after the last compute is half of TokenRing's on each link."""
    dims = AttentionShape(batch=1, heads_q=8, heads_kv=8, head_dim=16, dtype="bfloat16")
    common = {"layout": "zigzag", "causal": True, "world_size": 4, "seq_local": 16}
    one = build_schedule("token_ring", "forward", **common)
    two = build_schedule(STRATEGY, "forward", heads_q=8, heads_kv=8, **common)

    def by_link(sched, pick):  # type: ignore[no-untyped-def]
        got: dict[tuple[int, int], int] = {}
        for tr in sched.transfers:
            if pick(sched, tr):
                got[(tr.src, tr.dst)] = got.get((tr.src, tr.dst), 0) + tr.num_bytes(dims)
        return got

    def first(sched, tr):  # type: ignore[no-untyped-def]
        return tr.step == 0

    def exposed(sched, tr):  # type: ignore[no-untyped-def]
        last = sched.num_steps - 1
        return tr.step == last and tr.after_segments == len(sched.steps[tr.src][last].segments)

    for pick in (first, exposed):
        one_links, two_links = by_link(one, pick), by_link(two, pick)
        assert two_links and 2 * max(two_links.values()) == max(one_links.values())


def test_a_single_query_head_is_refused() -> None:
    common = {"layout": "zigzag", "causal": True, "world_size": 2, "seq_local": 4}
    with pytest.raises(
        NotImplementedError, match=r"heads_q >= 2; got heads_q=1 \(use 'token_ring'\)"
    ):
        build_schedule(STRATEGY, "forward", heads_q=1, heads_kv=1, **common)
    with pytest.raises(ValueError, match=r"must be given .* got heads_q=None"):
        build_schedule(STRATEGY, "forward", heads_kv=2, **common)


def test_simulated_on_every_topology_with_the_schedules_bytes() -> None:
    """The simulator plays the schedule on ring, mesh and switch, MHA and GQA, forward and
    backward: the bytes it moves per rank and flow are the schedule's (busiest rank); on the
    mesh, where both directions of a link are free, the call beats one-way TokenRing."""
    for topology, (heads_q, heads_kv) in itertools.product(
        ("mesh", "ring", "switch"), ((8, 8), (8, 2))
    ):
        hardware = measured(
            forward_flops_per_s=2e10,
            backward_flops_per_s=1.6e10,
            link_bandwidth_bytes_per_s=12e6,
            memory_bandwidth_bytes_per_s=5e9,
            dtype="float32",
            topology=topology,
            port_bandwidth_bytes_per_s=12e6 if topology == "switch" else None,
        )
        shape = AttentionShape(heads_q=heads_q, heads_kv=heads_kv, head_dim=64, dtype="float32")
        common = {
            "layout": "zigzag",
            "causal": True,
            "world_size": 4,
            "seq_local": 128,
            "shape": shape,
            "hardware": hardware,
            "passes": "both",
        }
        call = simulate(STRATEGY, **common)
        for result, pass_ in zip(call.passes, (Pass.FORWARD, Pass.BACKWARD), strict=True):
            sched = build_schedule(
                STRATEGY,
                pass_,
                layout="zigzag",
                causal=True,
                world_size=4,
                seq_local=128,
                heads_q=heads_q,
                heads_kv=heads_kv,
            )
            sent = {(flow, r): 0 for flow in Flow for r in range(4)}
            for tr in sched.transfers:
                sent[(tr.payload.flow, tr.src)] += tr.num_bytes(shape)
            assert result.travel_bytes == max(sent[(Flow.TRAVEL, r)] for r in range(4))
            assert result.return_bytes == max(sent[(Flow.RETURN, r)] for r in range(4))
            assert result.call_s > 0
        if topology == "mesh":
            assert call.call_s <= simulate("token_ring", **common).call_s


def test_hybrid_outer_schedule_computes_every_pair_and_head_once() -> None:
    """As the outer strategy of the hybrid (the simulator's schedule of it): each (query
    position, key position, query head) exactly once, rows being those of the outer shards."""
    from tokenring.strategies.hybrid import HybridSpec, build_hybrid_schedule

    hq, hkv, s = 8, 4, 4
    for (outer, inner), pass_ in itertools.product(((2, 2), (4, 1)), ("forward", "backward")):
        p, seq = outer * inner, outer * inner * s
        sched = build_hybrid_schedule(
            pass_,
            spec=HybridSpec(inner=inner, outer_strategy=STRATEGY),
            layout="zigzag",
            causal=True,
            world_size=p,
            seq_local=s,
            heads_q=hq,
            heads_kv=hkv,
        )
        computed = []
        for g in range(p):
            for plan in sched.steps[g]:
                for piece in plan.pieces:
                    q_owner = plan.lane_q_owner(piece.lane) // inner
                    qpos = owned_positions("zigzag", q_owner, outer, seq)
                    kpos = owned_positions(
                        "zigzag", plan.kv_owners[piece.lane] // inner, outer, seq
                    )
                    assert piece.heads is not None
                    q_heads = piece.q_heads or tuple(h * (hq // hkv) for h in piece.heads)
                    for i, j in itertools.product(range(*piece.q_rows), range(*piece.kv_rows)):
                        if piece.causal and j - piece.kv_rows[0] > i - piece.q_rows[0]:
                            continue
                        computed += [(qpos[i], kpos[j], h) for h in range(*q_heads)]
        want = [(i, j, h) for i, j in covered_pairs("zigzag", True, 1, seq) for h in range(hq)]
        assert sorted(computed) == sorted(want), (outer, inner, pass_)
