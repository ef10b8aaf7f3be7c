"""The rank programs (Note [Rank program]) of every strategy and of the cached inference
plans: every transfer, segment (block) and slot of a rank exactly once, in an order that can
run, and the simulator replaying them."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import pytest

from tokenring.core.schedule import AttentionShape, Flow, Pass, Payload, Schedule, Strategy
from tokenring.model.costmodel import PRESETS
from tokenring.model.simulate import simulate_cached, simulate_pass
from tokenring.runtime.program import Op, OpKind, cached_program, program_of, ring_program
from tokenring.strategies import build_schedule
from tokenring.strategies.cached import (
    CachedPlan,
    CachedStrategy,
    build_cached_plan,
    uniform_shards,
)
from tokenring.strategies.collective import build_collective_schedule
from tokenring.strategies.hybrid import HybridSpec, build_hybrid_schedule

RING_STRATEGIES = ("token_ring", "ring", "bidir_ring", "bidir_token_ring")
WAITS_FOR_RECEIVES = (OpKind.ARRIVE, OpKind.PASS, OpKind.RETURNS, OpKind.HOME)


def _cases() -> list[tuple[str, str, str, bool, int, int]]:
    grid = itertools.product(
        RING_STRATEGIES, ("forward", "backward"), ("contiguous", "zigzag"), (False, True)
    )
    return [(*case, p, kv) for case in grid for p, kv in ((1, 2), (2, 2), (3, 1), (4, 2))]


@pytest.mark.parametrize("strategy", RING_STRATEGIES)
def test_a_program_takes_each_transfer_and_segment_once_in_order(strategy: str) -> None:
    """Per rank: every receive is waited for by exactly one op of the right kind, after the
    slot that posts it; every send is posted once and waited for (SENT or SENT_ALL) after
    its slot; every segment is computed once, in step and segment order; slots are posted in
    order, and a slot after segment k only once segment k is computed; where the host
    computes, the forward's slot 0 only after its first segment (Note [Rank program])."""
    failures = []
    for name, pass_, layout, causal, p, heads_kv in _cases():
        if name != strategy:
            continue
        sched = build_schedule(
            name, pass_, layout=layout, causal=causal, world_size=p, seq_local=8,
            heads_q=4, heads_kv=heads_kv,
        )  # fmt: skip
        case = (pass_, layout, causal, p, heads_kv)
        for rank in range(p):
            program = ring_program(sched, rank)
            assert program is ring_program(sched, rank), "memoised on the schedule"
            failures += [(case, rank, what) for what in _check(sched, rank, program)]
            program = ring_program(sched, rank, host_computes=True)
            found = _check(sched, rank, program, host_computes=True)
            failures += [(case, rank, "host computes", what) for what in found]
    assert not failures, failures[:10]


def _check(
    sched: Schedule, rank: int, program: tuple[Op, ...], *, host_computes: bool = False
) -> list[str]:
    problems: list[str] = []
    posted: list[tuple[int, int]] = []
    posts: Counter[object] = Counter()
    computed: list[tuple[int, int]] = []
    received: Counter[object] = Counter()
    sends_done: Counter[object] = Counter()
    backward = sched.pass_ is Pass.BACKWARD
    hybrid = sched.strategy is Strategy.HYBRID
    ring_steps = range(1, sched.num_steps - 1) if hybrid else range(sched.num_steps)
    if sched.strategy.is_collective:
        ring_steps = range(0)
    for op in program:
        if op.kind is OpKind.POST:
            posted.append((op.step, op.index))
            for tr in op.transfers:
                posts[tr] += 1
                n = len(sched.steps[rank][op.step].segments)
                done = sum(1 for t, _ in computed if t == op.step)
                mine = tr.src == rank or (tr.dst == rank and tr.step in ring_steps)
                if tr.step != op.step or (mine and tr.after_segments != op.index):
                    problems.append(f"POST {(op.step, op.index)} posts {tr}")
                want = min(tr.after_segments, n)
                if host_computes and not backward and op.step == 0:
                    want = max(want, min(n, 1))  # Note [Deferred agreement]
                if tr.src == rank and done != want:
                    problems.append(f"{tr} posted after {done} segments, not {want}")
        elif op.kind is OpKind.COMPUTE:
            computed.append((op.step, op.index))
        elif op.kind in WAITS_FOR_RECEIVES:
            for tr in op.transfers:
                received[tr] += 1
                if tr.dst != rank or not posts[tr]:
                    problems.append(f"{op.kind} waits for {tr} before it is posted")
                if tr.step in ring_steps:
                    want = {
                        OpKind.ARRIVE: tr.payload.flow is Flow.TRAVEL,
                        OpKind.PASS: tr.payload is Payload.DKV,
                        OpKind.HOME: tr.payload is Payload.DKV,
                        OpKind.RETURNS: tr.payload is (Payload.DQ if backward else Payload.OUT),
                    }[op.kind]
                else:  # the collectives' and the hybrid's all-to-alls
                    want = {
                        OpKind.ARRIVE: tr.payload.flow is Flow.TRAVEL and tr.step == 0,
                        OpKind.RETURNS: tr.payload.flow is Flow.RETURN
                        or (hybrid and tr.step == sched.num_steps - 1),
                    }.get(op.kind, False)
                if not want:
                    problems.append(f"{op.kind} waits for a {tr.payload} of step {tr.step}")
        elif op.kind in (OpKind.SENT, OpKind.SENT_ALL):
            for tr in op.transfers:
                sends_done[tr] += 1
                if tr.src != rank or not posts[tr]:
                    problems.append(f"{op.kind} waits for {tr} before it is sent")
    mine_in = [tr for tr in sched.transfers if tr.dst == rank]
    mine_out = [tr for tr in sched.transfers if tr.src == rank]
    if sorted(map(repr, received.elements())) != sorted(map(repr, mine_in)):
        problems.append("receives waited for != the rank's receives (each once)")
    if sorted(map(repr, posts.elements())) != sorted(map(repr, mine_in + mine_out)):
        problems.append("transfers posted != the rank's transfers (each once)")
    if set(sends_done) != set(mine_out):
        problems.append("sends waited for != the rank's sends")
    if posted != sorted(posted):
        problems.append(f"slots posted out of order: {posted}")
    if sched.strategy.is_ring:
        slots = sorted({(tr.step, tr.after_segments) for tr in (*mine_in, *mine_out)})
        if posted != slots:
            problems.append(f"slots posted {posted} != the rank's slots in order {slots}")
    segments = [
        (t, k) for t in range(sched.num_steps) for k in range(len(sched.steps[rank][t].segments))
    ]
    if computed != segments:
        problems.append(f"segments computed {computed} != {segments}")
    kinds = [op.kind for op in program]
    if kinds[-1] is not OpKind.SENT_ALL or kinds.count(OpKind.END) != 1:
        problems.append("a program ends with END ... SENT_ALL")
    if backward != (OpKind.DELTA in kinds) or kinds.count(OpKind.DELTA) > 1:
        problems.append("the backward (only) has one DELTA")
    elif backward and (OpKind.COMPUTE in kinds[: kinds.index(OpKind.DELTA)]):
        problems.append("DELTA after a COMPUTE")
    if not hybrid and backward and kinds[0] is not OpKind.DELTA:
        problems.append("the backward starts with DELTA")
    return problems


def _collective_cases() -> list[tuple[str, str, str, int, int, int, int]]:
    grid = itertools.product(
        ("ulysses", "allgather_kv"),
        ("forward", "backward"),
        ("contiguous", "zigzag"),
        (False, True),
    )
    heads = ((4, 2), (6, 3), (2, 1))  # GQA, shares off the groups, fewer heads than ranks
    sizes = (1, 2, 3, 4, 8)
    return [(*case, p, hq, hkv) for case in grid for p in sizes for hq, hkv in heads]


@pytest.mark.parametrize("strategy", ["ulysses", "allgather_kv"])
def test_a_collective_program_takes_each_transfer_and_segment_once_in_order(strategy: str) -> None:
    """The checks above on Ulysses' and all-gather K/V's programs (Note [Collective rank
    program]), and where they wait: Ulysses' kernel after every receive of slot 0, its shares
    joined after every send; all-gather K/V's round k after the K/V of r + k arrived, that
    receive posted with the round's own send to r - k, at most two rounds in flight forward
    and one backward (and two or four sends), and each dK/dV partial of r - k added before
    the next round."""
    failures = []
    for name, pass_, layout, causal, p, hq, hkv in _collective_cases():
        if name != strategy:
            continue
        sched = build_collective_schedule(
            name, pass_, layout=layout, causal=bool(causal), world_size=p, seq_local=8,
            heads_q=hq, heads_kv=hkv,
        )  # fmt: skip
        case = (pass_, layout, causal, p, hq, hkv)
        for rank in range(p):
            program = program_of(sched, rank)
            assert program is program_of(sched, rank), "memoised on the schedule"
            problems = _check(sched, rank, program)
            check = _check_ulysses if name == "ulysses" else _check_allgather
            problems += check(sched, rank, program)
            failures += [(case, rank, what) for what in problems]
    assert not failures, failures[:10]


def _check_ulysses(sched: Schedule, rank: int, program: tuple[Op, ...]) -> list[str]:
    kinds = [op.kind for op in program]
    travel = [tr for tr in sched.recvs(rank, 0) if tr.payload.flow is Flow.TRAVEL]
    (arrive,) = [op for op in program if op.kind is OpKind.ARRIVE]
    problems = [] if set(arrive.transfers) == set(travel) else ["ARRIVE != the travel receives"]
    if OpKind.COMPUTE in kinds and kinds.index(OpKind.COMPUTE) < kinds.index(OpKind.ARRIVE):
        problems.append("the kernel runs before its heads arrived")
    (sent,) = [op for op in program if op.kind is OpKind.SENT]
    if set(sent.transfers) != set(sched.sends(rank, 0)):
        problems.append("SENT != every send")
    if not kinds.index(OpKind.SENT) < kinds.index(OpKind.RETURNS) < kinds.index(OpKind.END):
        problems.append("the shares are joined after every send, before END")
    return problems


def _check_allgather(sched: Schedule, rank: int, program: tuple[Op, ...]) -> list[str]:
    p, s = sched.world_size, sched.seq_local
    backward = sched.pass_ is Pass.BACKWARD
    problems = []
    in_flight: list[int] = []  # owners of the K/V posted and not arrived yet, in order
    arrived, added, most = {rank}, 0, 0
    sending: set[object] = set()  # sends posted and not waited for
    segments = sched.steps[rank][0].segments
    for op in program:
        if op.kind is OpKind.POST:
            recvs = [tr for tr in op.transfers if tr.dst == rank]
            sends = [tr for tr in op.transfers if tr.src == rank]
            if len(recvs) != 1 or len(sends) != 1 or recvs[0].payload is not sends[0].payload:
                problems.append(f"a round posts one receive with its own send: {op.transfers}")
                continue
            sending.update(sends)
            if len(sending) > (4 if backward else 2):
                problems.append(f"{len(sending)} sends in flight")
            sign = 1 if recvs[0].payload is Payload.KV else -1  # K/V from r + k, dK/dV r - k
            k = sign * (recvs[0].src - rank) % p
            if sends[0].dst != (rank - sign * k) % p:
                problems.append(f"round {k} sends {sends[0].payload} to {sends[0].dst}")
            if sign == 1:
                in_flight.append(recvs[0].owner)
                most = max(most, len(in_flight))
            elif added != k - 1:
                problems.append(f"dK/dV of round {k} posted after {added} came back")
        elif op.kind is OpKind.ARRIVE:
            (tr,) = op.transfers
            if in_flight[:1] != [tr.owner]:
                problems.append(f"K/V of {tr.owner} arrives out of order: {in_flight}")
            else:
                in_flight.pop(0)
            arrived.add(tr.owner)
        elif op.kind is OpKind.COMPUTE:
            owner = segments[op.index].pieces[0].kv_rows[0] // s
            if owner not in arrived:
                problems.append(f"round of {owner} computed before its K/V arrived")
            if backward and owner != rank and added != (owner - rank) % p - 1:
                problems.append(f"round of {owner} computed before the last dK/dV came back")
        elif op.kind is OpKind.RETURNS:
            added += len(op.transfers)
        elif op.kind is OpKind.SENT:
            sending.difference_update(op.transfers)
    if in_flight or len(arrived) != p or added != (p - 1 if backward else 0):
        problems.append("not every round arrived (and, backward, came back)")
    if most != min(1 if backward else 2, p - 1):
        problems.append(f"{most} rounds of K/V in flight at once")
    return problems


def test_the_hybrid_program_is_its_all_to_alls_around_the_outer_ring() -> None:
    """The checks above on the hybrid (Note [Hybrid rank program]), and its ops of steps
    1 .. n are the outer ring's program but its END; the all-to-alls wait for every receive
    and every send (blocking calls in the runtime)."""
    failures = []
    for outer, pass_, (layout, causal), (p, inner) in itertools.product(
        ("token_ring", "ring", "bidir_ring"),
        ("forward", "backward"),
        (("zigzag", True), ("contiguous", False)),
        ((2, 2), (4, 2), (6, 3), (4, 1)),
    ):
        spec = HybridSpec(inner=inner, outer_strategy=outer)
        sched = build_hybrid_schedule(
            pass_, spec=spec, layout=layout, causal=causal, world_size=p, seq_local=8,
            heads_q=6 * inner, heads_kv=2 * inner,
        )  # fmt: skip
        n = sched.num_steps - 2
        for rank in range(p):
            program = program_of(sched, rank)
            problems = _check(sched, rank, program)
            ring = [op for op in ring_program(sched, rank, range(1, n + 1))]
            ring.remove(next(op for op in ring if op.kind is OpKind.END))
            start = [op.kind for op in program].index(OpKind.SENT) + 1  # after step 0's
            if list(program[start : start + len(ring)]) != ring:
                problems.append("the ring's ops are not the outer ring's program")
            for t in (0, n + 1):
                ops = [op for op in program if op.step == t and op.kind is OpKind.SENT]
                if [set(op.transfers) for op in ops] != [set(sched.sends(rank, t))]:
                    problems.append(f"the all-to-all of step {t} does not wait for its sends")
            failures += [((outer, pass_, layout, p, inner), rank, what) for what in problems]
    assert not failures, failures[:10]


def test_returns_are_waited_for_two_steps_after_they_were_sent() -> None:
    """TokenRing, P = 4: the partials sent at step t are merged after the compute of step
    t + 2 (the last two steps' after the loop), so a comm-bound step never waits for them."""
    sched = build_schedule(
        "token_ring", "forward", layout="zigzag", causal=True, world_size=4, seq_local=8
    )
    program = ring_program(sched, 0)
    returns = [(i, op.step) for i, op in enumerate(program) if op.kind is OpKind.RETURNS]
    steps = [(i, op.step) for i, op in enumerate(program) if op.kind in (OpKind.STEP, OpKind.END)]
    for index, sent_at in returns:
        step_now = max(t for i, t in steps if i < index)  # END counts as step 4
        assert step_now == min(sent_at + 2, 4), (sent_at, step_now)
        last_compute = max(i for i, op in enumerate(program[:index]) if op.kind is OpKind.COMPUTE)
        assert program[last_compute].step == min(sent_at + 2, 3)


def test_the_event_engine_replays_the_program() -> None:
    """A10 preset, TokenRing forward, P = 4: the engine's timeline has one compute bar per
    COMPUTE op and one merge bar per returned partial (plus one per own segment), each
    partial's merge after the step that RETURNS takes it in, as the program orders."""
    shape = AttentionShape(heads_q=32, heads_kv=32, head_dim=128, dtype="float16")
    kw: dict[str, Any] = dict(layout="zigzag", causal=True, world_size=4, seq_local=6000)
    result = simulate_pass(
        "token_ring", "forward", shape=shape, hardware=PRESETS["a10-pcie"], mode="event", **kw
    )
    sched = build_schedule("token_ring", "forward", **kw)
    assert result.timeline is not None
    for rank, events in enumerate(result.timeline):
        program = ring_program(sched, rank)
        computes = [op.step for op in program if op.kind is OpKind.COMPUTE]
        bars = sorted(ev.step for ev in events if ev.kind == "compute")
        assert bars == sorted(computes)
        returned = sum(len(op.transfers) for op in program if op.kind is OpKind.RETURNS)
        own = sum(
            1
            for op in program
            if op.kind is OpKind.COMPUTE and sched.steps[rank][op.step].q_owner == rank
        )
        merges = [ev for ev in events if ev.kind == "merge"]
        assert len(merges) == returned + own
        start_of = {ev.step: ev.start_s for ev in events if ev.kind == "compute"}
        for op in program:
            if op.kind is OpKind.RETURNS and op.step + 2 < sched.num_steps:
                for tr in op.transfers:
                    later = start_of[op.step + 2]
                    assert [ev for ev in merges if ev.step == tr.step and ev.start_s >= later]


@pytest.mark.parametrize("strategy", RING_STRATEGIES)
def test_where_the_host_computes_the_first_send_follows_the_first_segment(strategy: str) -> None:
    """Note [Rank program]: on a GPU preset every rank's first send starts at 0 (its kernels
    run beside the host); with ``host_computes`` (CPU ranks) when its first segment (one
    compute bar and its merge) is done, and the backward is the same program either way."""
    shape = AttentionShape(heads_q=8, heads_kv=8, head_dim=64, dtype="float16")
    kw: dict[str, Any] = dict(layout="zigzag", causal=True, world_size=4, seq_local=1024)
    gpu = PRESETS["a10-pcie"]
    for host in (False, True):
        hw = dataclasses.replace(gpu, host_computes=host)
        result = simulate_pass(strategy, "forward", shape=shape, hardware=hw, mode="event", **kw)
        assert result.timeline is not None
        for rank, events in enumerate(result.timeline):
            first_send = min(ev.start_s for ev in events if ev.kind == "send")
            before = [
                ev
                for ev in events
                if ev.kind in ("compute", "merge") and ev.end_s <= first_send + 1e-12
            ]
            if not host:
                assert first_send == 0.0, (host, rank)
                continue
            assert [ev.kind for ev in before].count("compute") == 1, (rank, before)
            assert first_send == pytest.approx(max(ev.end_s for ev in before), abs=1e-12)
    sched = build_schedule(strategy, "backward", heads_q=8, heads_kv=8, **kw)
    assert ring_program(sched, 0, host_computes=True) == ring_program(sched, 0)


def test_the_event_engine_replays_a_collective_program() -> None:
    """A10 preset, all-gather K/V backward, P = 4: one compute bar per COMPUTE op, and the bar
    of a segment of round k starts once the K/V of round k and the dK/dV partial of round
    k - 1 have arrived, as the program's ARRIVE and RETURNS wait for them."""
    shape = AttentionShape(heads_q=32, heads_kv=8, head_dim=128, dtype="float16")
    kw: dict[str, Any] = dict(layout="zigzag", causal=True, world_size=4, seq_local=4096)
    result = simulate_pass(
        "allgather_kv", "backward", shape=shape, hardware=PRESETS["a10-pcie"], mode="event", **kw
    )
    sched = build_collective_schedule("allgather_kv", "backward", heads_q=32, heads_kv=8, **kw)
    assert result.timeline is not None
    p, s = 4, 4096
    for rank, events in enumerate(result.timeline):
        segments = sched.steps[rank][0].segments
        bars = sorted((ev for ev in events if ev.kind == "compute"), key=lambda ev: ev.start_s)
        assert len(bars) == sum(op.kind is OpKind.COMPUTE for op in program_of(sched, rank))
        came = {(ev.label, ev.peer): ev.end_s for ev in events if ev.kind == "recv"}
        assert len(came) == 2 * (p - 1)
        for bar, segment in zip(bars, segments, strict=True):
            k = (segment.pieces[0].kv_rows[0] // s - rank) % p
            if k >= 1:
                assert bar.start_s >= came[("kv", (rank + k) % p)]
            if k >= 2:
                assert bar.start_s >= came[("dkv", (rank - k + 1) % p)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_a_cached_program_takes_each_transfer_and_block_once_in_order(world: int) -> None:
    """Per rank of every cached plan: every receive is waited for once (ARRIVE: Q and K/V;
    RETURNS: partials) after its slot is posted; every send is posted once and waited for
    by SENT_ALL; the blocks are computed in the plan's order; slots are posted in order, a
    slot after block k of a round only once block k is computed; a block is held before it
    is computed with or forwarded, and a partial sent up merged only after every partial of
    its owners that reached this rank is merged."""
    failures = []
    for cached, new, batch in [(0, 5, 1), (3, 1, 2), (40, 1, 3), (13, 9, 2), (0, 1, 1)]:
        shards = uniform_shards(world_size=world, batch=batch, cached=cached, new=new, block_size=4)
        for strategy in CachedStrategy:
            plan = build_cached_plan(strategy, shards)
            for rank in range(world):
                program = cached_program(plan, rank)
                assert program is cached_program(plan, rank), "memoised on the plan"
                problems = _check_cached(plan, rank, program)
                failures += [(cached, new, batch, strategy.value, rank, p) for p in problems]
    assert not failures, failures[:10]


def _check_cached(plan: CachedPlan, rank: int, program: tuple[Op, ...]) -> list[str]:
    problems: list[str] = []
    posted: list[tuple[int, int]] = []
    computed: list[tuple[int, int]] = []
    received: Counter[object] = Counter()
    sends_done: Counter[object] = Counter()
    held_q, held_kv = {rank}, {rank}
    merged: set[object] = set()
    mine_in = [tr for tr in plan.transfers if tr.dst == rank]
    mine_out = [tr for tr in plan.transfers if tr.src == rank]
    for at, op in enumerate(program):
        if op.kind is OpKind.POST:
            posted.append((op.step, op.index))
            slot = {
                tr for tr in (*mine_in, *mine_out) if (tr.step, tr.after_segments) == posted[-1]
            }
            if set(op.transfers) != slot or len(op.transfers) != len(slot):
                problems.append(f"POST {posted[-1]} posts {op.transfers}, not its slot's")
            done = sum(1 for c in program[:at] if c.kind is OpKind.COMPUTE and c.step == op.step)
            if done < min(op.index, len(plan.computes[rank][op.step])):
                problems.append(f"slot {(op.step, op.index)} posted before its blocks")
            for tr in mine_out:
                if (tr.step, tr.after_segments) != (op.step, op.index):
                    continue
                held = {Payload.Q: held_q, Payload.KV: held_kv}.get(tr.payload)
                if held is not None and not set(tr.owners) <= held:
                    problems.append(f"{tr} forwards a block before it arrived")
                below = [x for x in mine_in if x.payload is Payload.OUT]
                if tr.payload is Payload.OUT and plan.merges(rank, tr.owner):
                    late = [x for x in below if set(x.owners) & set(tr.owners) and x not in merged]
                    if late:
                        problems.append(f"{tr} goes up before {late} are merged")
        elif op.kind is OpKind.COMPUTE:
            computed.append((op.step, op.index))
            o, j = plan.computes[rank][op.step][op.index]
            if o not in held_q or j not in held_kv:
                problems.append(f"block {(o, j)} computed before it arrived")
        elif op.kind in (OpKind.ARRIVE, OpKind.RETURNS):
            ahead = program[at + 1]
            if op.kind is OpKind.RETURNS and ahead.kind is not OpKind.SENT_ALL:
                up = [tr for tr in mine_out if tr.payload is Payload.OUT and tr.after_segments == 0]
                if (ahead.kind, ahead.index) != (OpKind.POST, 0) or not [
                    tr for tr in up if tr.step == ahead.step and plan.merges(rank, tr.owner)
                ]:
                    problems.append(f"RETURNS {op.step} waits neither at the end nor to go up")
            for tr in op.transfers:
                received[tr] += 1
                if (tr.step, tr.after_segments) not in posted:
                    problems.append(f"{op.kind} waits for {tr} before its slot is posted")
                if (op.kind is OpKind.ARRIVE) != (tr.payload.flow is Flow.TRAVEL):
                    problems.append(f"{op.kind} waits for a {tr.payload}")
                held = held_q if tr.payload is Payload.Q else held_kv
                held.update(tr.owners)
                merged.add(tr)
        elif op.kind is OpKind.SENT_ALL:
            for tr in op.transfers:
                sends_done[tr] += 1
                if (tr.step, tr.after_segments) not in posted:
                    problems.append(f"{op.kind} waits for {tr} before it is sent")
        elif op.kind not in (OpKind.STEP, OpKind.END):
            problems.append(f"a cached program has no {op.kind}")
    if sorted(map(repr, received.elements())) != sorted(map(repr, mine_in)):
        problems.append("receives waited for != the rank's receives (each once)")
    if sorted(map(repr, sends_done.elements())) != sorted(map(repr, mine_out)):
        problems.append("sends waited for != the rank's sends (each once)")
    slots = sorted({(tr.step, tr.after_segments) for tr in (*mine_in, *mine_out)})
    if sorted(posted) != slots or posted != sorted(posted):
        problems.append(f"slots posted {posted} != the rank's slots in order {slots}")
    blocks = [(t, k) for t in range(plan.num_rounds) for k in range(len(plan.computes[rank][t]))]
    if computed != blocks:
        problems.append(f"blocks computed {computed} != {blocks}")
    kinds = [op.kind for op in program]
    steps = [op.step for op in program if op.kind is OpKind.STEP]
    if kinds[-1] is not OpKind.SENT_ALL or kinds.count(OpKind.END) != 1:
        problems.append("a program ends with END ... SENT_ALL")
    if steps != list(range(plan.num_rounds)):
        problems.append(f"rounds {steps} != 0..{plan.num_rounds - 1}")
    return problems


def test_the_event_engine_replays_the_cached_program() -> None:
    """P = 4, every plan: the engine's timeline has one compute bar per COMPUTE op and one
    merge bar per merged block and per partial a RETURNS takes; in the tree a partial goes
    up only after the merges of the partials that came from below."""
    shards = uniform_shards(world_size=4, batch=2, cached=13, new=9, block_size=4)
    shape = AttentionShape(batch=1, heads_q=8, heads_kv=2, head_dim=16, dtype="float16")
    for strategy in CachedStrategy:
        plan = build_cached_plan(strategy, shards)
        _, _, _, timeline = simulate_cached(plan, shards, shape=shape, hardware=PRESETS["a10-pcie"])
        for rank, events in enumerate(timeline):
            program = cached_program(plan, rank)
            computes = [op for op in program if op.kind is OpKind.COMPUTE]
            blocks = [plan.computes[rank][op.step][op.index] for op in computes]
            returned = sum(len(op.transfers) for op in program if op.kind is OpKind.RETURNS)
            merged = sum(1 for o, _ in blocks if plan.merges(rank, o))
            assert [ev.step for ev in events if ev.kind == "compute"] == [
                op.step for op in computes
            ]
            merges = [ev for ev in events if ev.kind == "merge"]
            assert len(merges) == merged + returned, (strategy, rank)
            ups = [ev for ev in events if ev.kind == "send" and ev.label == "out"]
            for up in ups if strategy is CachedStrategy.TREE else []:
                below = [ev for ev in merges if ev.step < up.step and ev.end_s > up.start_s]
                assert not below, (rank, up, below)
