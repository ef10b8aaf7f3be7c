"""One rank's instructions for a schedule: what ``tokenring.runtime.executor.execute`` runs
and the simulator (``tokenring.model.simulate``) prices.

Legend: P world size, t step, k segment (or slot: transfers posted after k segments), r rank,
n the steps of the hybrid's outer ring.

Note [Rank program]
~~~~~~~~~~~~~~~~~~~
:func:`program_of` turns any schedule into each rank's instructions (:func:`ring_program`;
Note [Collective rank program], Note [Hybrid rank program]). ``execute`` runs POST, SENT and
SENT_ALL itself and every other op by the runner's method of its name; the simulator's event
engine replays the same tuple::

    op         runtime, forward            runtime, backward            event engine
    DELTA      -                           delta = rowsum(dout * out)   its bytes / memory bw
    STEP t     a new profiler range        same (and the accumulators   marks the step start
                                           to pass on, so that the
                                           compute may settle them)
    POST t k   its transfers (slot (t, k)  same                         a transfer starts once
               of the ring): receives                                   both ends posted it
               first, then sends
    COMPUTE    segment k: its kernels,     segment k: its kernels,      FLOPs / F, then its own
      t k      own rows merged at once     gradients into accumulators  merge or dQ add
    PASS t     -                           the dK/dV accumulators that  waits for each, adds
                                           followed the blocks here     their bytes
                                           (sent at t-1): added, passed
                                           on in slot (t, n)
    ARRIVE t   the travelling blocks       same                         waits for each
               of step t become held
    SENT t     this rank's travel sends    same                         waits for each to
               of t and returns of t-2                                  arrive
               are done: buffers reused
    RETURNS t  partials sent at t merged   dQ partials sent at t added  waits, merge/add bytes
    END        closes the last range       same                         marks the last step's end
    HOME       -                           the accumulators of the      waits, adds
                                           last step home, added
    SENT_ALL   every send done             same                         waits for each

A step is ``STEP t, POST t 0, (COMPUTE t k, POST t k+1)...``, then the slots after the last
segment, ``RETURNS t-2, ARRIVE t, SENT t``; the call ends with ``END``, the ``RETURNS`` of the
last two steps, ``HOME`` and ``SENT_ALL``. Where the rank's own thread runs the kernels
(``host_computes``: CPU ranks), the forward's step 0 computes its first segment before
``POST 0 0``: the rank check, posted before the call, completes meanwhile, before any
transfer, instead of holding every rank until the slowest arrives (Note [Deferred agreement]
in tokenring.runtime.comm). A GPU rank only queues its kernels, so it posts first. In the
backward, slot ``(t, n)`` of a step with n segments comes after ``PASS t`` (the accumulators
it sends are passed on there). Slots in which this rank neither sends nor receives are left
out.

Returns are taken two steps behind, so a partial sent at the end of step t-1 never holds up
step t. A POST names its transfers, so a receive can be posted outside its sender's slot. The
runtime may settle things early, never later (Note [Buffers in flight] in
tokenring.runtime.ring); the op is where the program waits for the rest, and the simulator
prices it.

:func:`cached_program` is the same vocabulary for a cached inference plan
(``tokenring.strategies.cached``): a round is a step, a kernel block a segment. A round is
``STEP t, [RETURNS t], POST t 0, (COMPUTE t k, POST t k+1)...``, the slots after the last
block, ``ARRIVE t``; the call ends with ``END, RETURNS, SENT_ALL``; and:

- COMPUTE t k: block k of round t, a (q_owner, kv_holder) pair, merged here or kept for the
  send of slot (t, k+1); the engine adds ``Hardware.kernel_call_s`` per kernel call;
- ARRIVE t: the Q blocks and K/V shards posted in round t, used from round t + 1;
- RETURNS t: only before a round whose slot (t, 0) sends partials up merged (the tree
  merges a subtree's before going up); every other partial after END.

Note [Collective rank program]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The collectives' one step (Note [Collective schedules] in tokenring.strategies.collective)
in the same ops; each wait is where the runtime waits. Ulysses (a rank without heads has no
COMPUTE and receives only at slot 1)::

    [DELTA]  STEP 0  POST 0 0 (q or q_grad, and K/V of each peer's heads, both ways)
    ARRIVE 0 (q / q_grad of every peer, then its K/V)  COMPUTE 0 0 (the gathered heads)
    POST 0 1 (out, or dq and dK/dV, each peer's rows, both ways)  SENT 0 (every send: its
    buffers go before the shares are joined)  RETURNS 0 (what came back, joined)  END 1
    SENT_ALL

All-gather K/V, in rounds (Note [All-gather K/V rounds]): the POST of round k is its send to
r - k with its receive from r + k (posted together, the receive first, not in the sender's
slot); ``index`` is the segments computed before it, its send's ``after_segments``::

    forward    STEP 0  POST round 1  COMPUTE round 0 (own block)
               for k = 1 .. P-1:  SENT round k-1 (k >= 2)  POST round k+1 (k+1 < P)
               ARRIVE round k  COMPUTE round k
               END 1  SENT_ALL
    backward   DELTA  STEP 0  POST round 1  COMPUTE round 0
               for k = 1 .. P-1:  ARRIVE round k  COMPUTE round k  POST dK/dV of round k
               (to r + k, from r - k)  POST round k+1 (k+1 < P)  RETURNS dK/dV from r - k
               SENT K/V of round k, dK/dV of round k-1
               END 1  SENT_ALL

so the forward has two rounds in flight and the backward one; a round without segments
(causal) still waits for its K/V. The SENTs free each round's copies a round later.

The event engine prices all-gather K/V's merges and adds as a ring step's (each COMPUTE
merges into, or adds dQ to, the rank's own rows; RETURNS adds the dK/dV that came home) and
Ulysses' copies where they happen: ARRIVE joins what came, RETURNS joins (backward: adds)
what came back (Note [Ulysses memory work] in tokenring.model.simulate).

Note [Hybrid rank program]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The hybrid (Note [Hybrid schedule] in tokenring.strategies.hybrid) waits for all of an inner
all-to-all at once, so its program is the all-to-all of step 0 (``STEP 0, POST 0 0,
ARRIVE 0, SENT 0``: every receive and send of it done), the outer ring's program on steps
1 .. n (:func:`ring_program`, its END left out: the all-to-all back starts the next step),
the all-to-all back (``STEP n+1, POST n+1 0, RETURNS n+1, SENT n+1``), ``END n+2`` and
``SENT_ALL``; run by Note [Hybrid runner] in tokenring.runtime.hybrid.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from tokenring.core.schedule import Flow, Pass, Payload, Schedule, Strategy, Transfer
from tokenring.strategies.cached import CachedPlan

__all__ = [
    "Op",
    "OpKind",
    "cached_program",
    "collective_program",
    "hybrid_program",
    "program_of",
    "ring_program",
    "ring_step_order",
]


class OpKind(enum.Enum):
    """One instruction of a rank program (Note [Rank program])."""

    DELTA = "delta"
    STEP = "step"
    POST = "post"
    COMPUTE = "compute"
    PASS = "pass"
    ARRIVE = "arrive"
    SENT = "sent"
    RETURNS = "returns"
    END = "end"
    HOME = "home"
    SENT_ALL = "sent_all"


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One instruction: ``kind`` at ``step``; ``index`` is a POST's slot or a COMPUTE's
    segment; ``transfers`` are what a POST posts and any other op waits for, in order."""

    kind: OpKind
    step: int = 0
    index: int = 0
    transfers: tuple[Transfer, ...] = ()


def program_of(sched: Schedule, rank: int, *, host_computes: bool = False) -> tuple[Op, ...]:
    """The instructions of ``rank`` for any schedule (Note [Rank program]), memoised;
    ``host_computes``: the rank's thread runs the kernels (CPU; ``Hardware.host_computes``)."""
    if sched.strategy is Strategy.HYBRID:
        return _memo(sched, ("hybrid_program", rank), hybrid_program, rank)
    if sched.strategy.is_collective:
        return _memo(sched, ("collective_program", rank), collective_program, rank)
    return ring_program(sched, rank, host_computes=host_computes)


def ring_program(
    sched: Schedule, rank: int, steps: range | None = None, *, host_computes: bool = False
) -> tuple[Op, ...]:
    """The instructions of ``rank`` for ``steps`` (default all) of a ring schedule, memoised."""
    steps = range(sched.num_steps) if steps is None else steps
    key = ("ring_program", rank, steps.start, steps.stop, host_computes)
    return _memo(sched, key, _build, rank, steps, host_computes)


def _memo(
    sched: Schedule | CachedPlan,
    key: tuple[object, ...],
    build: Callable[..., Sequence[Op]],
    *args: object,
) -> tuple[Op, ...]:
    program = sched._memo.get(key)
    if program is None:
        program = sched._memo[key] = tuple(build(sched, *args))
    assert isinstance(program, tuple)
    return program


def _slot(mine: Sequence[Transfer], step: int, after: int) -> tuple[Transfer, ...]:
    """The transfers of slot ``(step, after)`` among ``mine``, in their order."""
    return tuple(tr for tr in mine if (tr.step, tr.after_segments) == (step, after))


def _recvs(sched: Schedule, rank: int, step: int, payload: Payload) -> tuple[Transfer, ...]:
    """``rank``'s receives of ``payload`` posted at ``step``, in slot and lane order."""
    found = [tr for tr in sched.recvs(rank, step) if tr.payload is payload]
    return tuple(sorted(found, key=lambda tr: (tr.after_segments, tr.lane)))


def _passing(sched: Schedule, rank: int, step: int) -> tuple[Transfer, ...]:
    """Backward: the dK/dV accumulators (sent at ``step - 1``) that ``step`` passes on."""
    outgoing = {tr.lane for tr in sched.sends(rank, step) if tr.payload is Payload.DKV}
    owners = sched.steps[rank][step].kv_owners
    return tuple(
        tr
        for tr in _recvs(sched, rank, step - 1, Payload.DKV)
        if tr.lane in outgoing and tr.owner == owners[tr.lane]
    )


def ring_step_order(
    num_segments: int,
    slots: Collection[int],
    *,
    backward: bool,
    returns: bool,
    compute_first: bool = False,
) -> list[tuple[OpKind, int]]:
    """``(kind, index)`` of each op of a ring step in order (Note [Rank program]): ``slots``
    are the slots the rank posts in, ``returns`` whether it takes the returns of two steps
    ago, ``compute_first`` whether a forward step computes its first segment before slot 0
    (step 0 where the host computes). Shared with the simulator's vectorised engine (Note
    [Vectorised engine])."""
    n = num_segments
    lead = compute_first and not backward and n > 0 and 0 in slots
    order = [(OpKind.STEP, 0)] + ([(OpKind.POST, 0)] if 0 in slots and not lead else [])
    for k in range(n):
        order.append((OpKind.COMPUTE, k))
        if lead and k == 0:
            order.append((OpKind.POST, 0))
        if k + 1 in slots and (not backward or k + 1 < n):
            order.append((OpKind.POST, k + 1))
    if backward:
        order.append((OpKind.PASS, 0))
        order += [(OpKind.POST, n)] if n > 0 and n in slots else []
    order += [(OpKind.POST, after) for after in sorted(slots) if after > n]
    order += [(OpKind.RETURNS, 0)] if returns else []
    return [*order, (OpKind.ARRIVE, 0), (OpKind.SENT, 0)]


def _step(
    sched: Schedule,
    rank: int,
    t: int,
    first: int,
    passing: tuple[Transfer, ...],
    host_computes: bool,
) -> list[Op]:
    """The ops of step ``t`` (``first``: the program's first step)."""
    backward = sched.pass_ is Pass.BACKWARD
    n = len(sched.steps[rank][t].segments)
    mine = (*sched.recvs(rank, t), *sched.sends(rank, t))
    slots = {tr.after_segments for tr in mine}
    travel = tuple(tr for tr in sched.recvs(rank, t) if tr.payload.flow is Flow.TRAVEL)
    sent = [tr for tr in sched.sends(rank, t) if tr.payload.flow is Flow.TRAVEL]
    if t >= first + 2:  # the returns of two steps ago: they had a whole step to arrive
        sent += [tr for tr in sched.sends(rank, t - 2) if tr.payload.flow is Flow.RETURN]
    ops = {
        OpKind.STEP: lambda k: Op(kind=OpKind.STEP, step=t, transfers=passing),
        OpKind.POST: lambda k: Op(kind=OpKind.POST, step=t, index=k, transfers=_slot(mine, t, k)),
        OpKind.COMPUTE: lambda k: Op(kind=OpKind.COMPUTE, step=t, index=k),
        OpKind.PASS: lambda k: Op(kind=OpKind.PASS, step=t, transfers=passing),
        OpKind.RETURNS: lambda k: _returns(sched, rank, t - 2),
        OpKind.ARRIVE: lambda k: Op(kind=OpKind.ARRIVE, step=t, transfers=travel),
        OpKind.SENT: lambda k: Op(kind=OpKind.SENT, step=t, transfers=tuple(sent)),
    }
    lead = host_computes and t == 0
    order = ring_step_order(n, slots, backward=backward, returns=t >= first + 2, compute_first=lead)
    return [ops[kind](index) for kind, index in order]


def _returns(sched: Schedule, rank: int, step: int) -> Op:
    """RETURNS of ``step``: the partials (dQ partials) sent to ``rank`` at ``step``."""
    returned = Payload.DQ if sched.pass_ is Pass.BACKWARD else Payload.OUT
    return Op(kind=OpKind.RETURNS, step=step, transfers=_recvs(sched, rank, step, returned))


def _build(sched: Schedule, rank: int, steps: range, host_computes: bool) -> list[Op]:
    backward = sched.pass_ is Pass.BACKWARD
    program = [Op(kind=OpKind.DELTA, step=steps.start)] if backward else []
    passed: set[Transfer] = set()
    for t in steps:
        passing = _passing(sched, rank, t) if backward and t > steps.start else ()
        passed.update(passing)
        program += _step(sched, rank, t, steps.start, passing, host_computes)
    program.append(Op(kind=OpKind.END, step=steps.stop))
    program += [_returns(sched, rank, t) for t in steps[-2:]]
    if backward:
        home = [tr for t in steps for tr in _recvs(sched, rank, t, Payload.DKV) if tr not in passed]
        program.append(Op(kind=OpKind.HOME, transfers=tuple(home)))
    sends = tuple(tr for t in steps for tr in sched.sends(rank, t))
    program.append(Op(kind=OpKind.SENT_ALL, transfers=sends))
    return program


def collective_program(sched: Schedule, rank: int) -> list[Op]:
    """The instructions of ``rank`` for a collective: Note [Collective rank program]."""
    backward = sched.pass_ is Pass.BACKWARD
    recvs, sends = sched.recvs(rank, 0), sched.sends(rank, 0)
    program = [Op(kind=OpKind.DELTA)] if backward else []
    program.append(Op(kind=OpKind.STEP))
    if sched.strategy is Strategy.ULYSSES:
        program += _ulysses(sched, rank, recvs, sends)
    else:
        program += _allgather(sched, rank, recvs, sends, backward=backward)
    return [*program, Op(kind=OpKind.END, step=1), Op(kind=OpKind.SENT_ALL, transfers=sends)]


def _ulysses(
    sched: Schedule, rank: int, recvs: Sequence[Transfer], sends: Sequence[Transfer]
) -> list[Op]:
    def slot(index: int, flow: Flow) -> tuple[list[Op], tuple[Transfer, ...]]:
        """The POST of slot 0 (travel) or 1 (return) and its receives, q-side before K/V."""
        inbound = sorted(
            (tr for tr in recvs if tr.payload.flow is flow),
            key=lambda tr: (tr.payload in (Payload.KV, Payload.DKV), tr.src),
        )
        mine = (*inbound, *(tr for tr in sends if tr.payload.flow is flow))
        return [Op(kind=OpKind.POST, index=index, transfers=mine)] if mine else [], tuple(inbound)

    (post_travel, travel), (post_back, back) = slot(0, Flow.TRAVEL), slot(1, Flow.RETURN)
    computes = [Op(kind=OpKind.COMPUTE, index=k) for k in range(len(sched.steps[rank][0].segments))]
    return [
        *post_travel,
        Op(kind=OpKind.ARRIVE, transfers=travel),
        *computes,
        *post_back,
        Op(kind=OpKind.SENT, transfers=tuple(sends)),  # its buffers go before the join
        Op(kind=OpKind.RETURNS, transfers=back),
    ]


def _allgather(
    sched: Schedule,
    rank: int,
    recvs: Sequence[Transfer],
    sends: Sequence[Transfer],
    *,
    backward: bool,
) -> list[Op]:
    p, s = sched.world_size, sched.seq_local
    segments = sched.steps[rank][0].segments
    rounds: list[list[int]] = [[] for _ in range(p)]  # segment indices by round
    for index, segment in enumerate(segments):
        rounds[(segment.pieces[0].kv_rows[0] // s - rank) % p].append(index)

    def mine(payload: Payload, k: int) -> tuple[Transfer, Transfer]:
        """Round k's receive and send of ``payload`` (K/V: from r + k, to r - k)."""
        sign = 1 if payload is Payload.KV else -1
        (recv,) = (tr for tr in recvs if tr.payload is payload and tr.src == (rank + sign * k) % p)
        (send,) = (tr for tr in sends if tr.payload is payload and tr.dst == (rank - sign * k) % p)
        return recv, send

    def post(payload: Payload, k: int) -> Op:
        recv, send = mine(payload, k)
        return Op(kind=OpKind.POST, index=send.after_segments, transfers=(recv, send))

    def sent(*done: tuple[Payload, int]) -> list[Op]:  # the sends of these rounds
        transfers = tuple(mine(payload, k)[1] for payload, k in done if k >= 1)
        return [Op(kind=OpKind.SENT, transfers=transfers)] if transfers else []

    program = [post(Payload.KV, 1)] if p > 1 else []
    for k in range(p):
        arrive = [Op(kind=OpKind.ARRIVE, transfers=mine(Payload.KV, k)[:1])] if k >= 1 else []
        if not backward and 1 <= k < p - 1:  # round k+1 takes the buffers of round k-1
            arrive = [*sent((Payload.KV, k - 1)), post(Payload.KV, k + 1), *arrive]
        program += [*arrive, *(Op(kind=OpKind.COMPUTE, index=index) for index in rounds[k])]
        if k >= 1 and backward:
            program.append(post(Payload.DKV, k))
            program += [post(Payload.KV, k + 1)] if k + 1 < p else []
            program.append(Op(kind=OpKind.RETURNS, transfers=mine(Payload.DKV, k)[:1]))
            program += sent((Payload.KV, k), (Payload.DKV, k - 1))
    return program


def hybrid_program(sched: Schedule, rank: int) -> list[Op]:
    """The instructions of ``rank`` for the hybrid: Note [Hybrid rank program]."""
    n = sched.num_steps - 2

    def all_to_all(t: int, take: OpKind) -> list[Op]:
        recvs, sends = sched.recvs(rank, t), sched.sends(rank, t)
        post = [Op(kind=OpKind.POST, step=t, transfers=(*recvs, *sends))] if recvs or sends else []
        return [
            Op(kind=OpKind.STEP, step=t),
            *post,
            Op(kind=take, step=t, transfers=recvs),
            Op(kind=OpKind.SENT, step=t, transfers=sends),
        ]

    ring = [op for op in ring_program(sched, rank, range(1, n + 1)) if op.kind is not OpKind.END]
    every = tuple(tr for t in range(n + 2) for tr in sched.sends(rank, t))
    return [
        *all_to_all(0, OpKind.ARRIVE),
        *ring,
        *all_to_all(n + 1, OpKind.RETURNS),
        Op(kind=OpKind.END, step=n + 2),
        Op(kind=OpKind.SENT_ALL, transfers=every),
    ]


def cached_program(plan: CachedPlan, rank: int) -> tuple[Op, ...]:
    """The instructions of ``rank`` for a cached inference plan, memoised (Note [Rank program])."""
    return _memo(plan, ("cached_program", rank), _build_cached, rank)


def _build_cached(plan: CachedPlan, rank: int) -> list[Op]:
    mine = [tr for tr in plan.transfers if rank in (tr.src, tr.dst)]
    partials = sorted(
        (tr for tr in mine if tr.dst == rank and tr.payload is Payload.OUT),
        key=lambda tr: (tr.step, tr.after_segments, tr.src),
    )
    program: list[Op] = []
    for t in range(plan.num_rounds):
        program.append(Op(kind=OpKind.STEP, step=t))
        slots = {tr.after_segments for tr in mine if tr.step == t}
        first = [tr for tr in mine if (tr.step, tr.after_segments) == (t, 0)]
        if any(tr.src == rank and tr.payload is Payload.OUT for tr in first):
            # partials go up merged in slot (t, 0): merge what came from below first
            taken = tuple(tr for tr in partials if tr.step < t)
            partials = partials[len(taken) :]
            program += [Op(kind=OpKind.RETURNS, step=t, transfers=taken)] if taken else []
        # a ring step's POSTs and COMPUTEs (Note [Rank program]), without STEP, ARRIVE and SENT
        order = ring_step_order(len(plan.computes[rank][t]), slots, backward=False, returns=False)
        for kind, k in order[1:-2]:
            transfers = _slot(mine, t, k) if kind is OpKind.POST else ()
            program.append(Op(kind=kind, step=t, index=k, transfers=transfers))
        blocks = (tr for tr in mine if tr.dst == rank and tr.step == t)
        travel = tuple(tr for tr in blocks if tr.payload.flow is Flow.TRAVEL)
        program.append(Op(kind=OpKind.ARRIVE, step=t, transfers=travel))
    program.append(Op(kind=OpKind.END, step=plan.num_rounds))
    if partials:
        program.append(Op(kind=OpKind.RETURNS, step=plan.num_rounds, transfers=tuple(partials)))
    sends = tuple(tr for tr in mine if tr.src == rank)
    program.append(Op(kind=OpKind.SENT_ALL, transfers=sends))
    return program
