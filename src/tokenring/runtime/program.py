"""One rank's list of instructions for a schedule: what the executor
(``tokenring.runtime.executor.execute``) runs and what the simulator
(``tokenring.model.simulate``) prices, one stream for both.

Legend: P world size, t step, k segment (or slot: transfers posted after k segments), r rank.

Note [Rank program]
~~~~~~~~~~~~~~~~~~~
:func:`ring_program` turns a schedule into each rank's instructions, from the schedule alone
(no tensors). ``execute`` runs them in order with the pass's runner (POST, SENT, SENT_ALL and
the step ranges itself, every other op by the runner's method of its name: the ring's
``_Forward`` / ``_Backward`` in tokenring.runtime.ring); the event engine of the simulator
replays the same tuple, one action per op::

    op         runtime, forward            runtime, backward            event engine
    DELTA      -                           delta = rowsum(dout * out)   its bytes / memory bw
    STEP t     a new profiler range        same (and the accumulators   marks the step start
                                           to pass on, so that the
                                           compute may settle them)
    POST t k   slot (t, k): receives       same                         a transfer starts once
               first, then sends                                        both ends posted it
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
last two steps, ``HOME`` and ``SENT_ALL``. In the backward, slot ``(t, n)`` of a step with n
segments comes after ``PASS t`` (the accumulators it sends are passed on there). Slots in
which this rank neither sends nor receives are left out.

Returns are taken two steps behind, after the compute of the step, so that a partial sent at
the end of step t-1 (it flies during step t, beside the next travelling block) never holds up
step t: waiting for it at the end of step t put its flight and its merge on the critical path
of every comm-bound step (the 4x A10 case of tests/test_costmodel.py: 5.6 ms a step instead
of the paper's 4.6). A rank holds at most two steps' partials for it.

What the runtime does early is its own business as long as it is never later: a backward
compute settles what it can of ``PASS t`` and ``RETURNS t-1`` after its first tile (Note
[Buffers in flight] in tokenring.runtime.ring); the op is where the program waits for the
rest, and where the simulator prices it.

:func:`cached_program` is the same vocabulary for a cached inference plan
(``tokenring.strategies.cached``; ``_PlanRunner`` in tokenring.inference runs it): a round is
a step, a kernel block a segment. A round is ``STEP t, [RETURNS t], POST t 0, (COMPUTE t k,
POST t k+1)...``, the slots after the last block, ``ARRIVE t``; the call ends with ``END,
RETURNS, SENT_ALL``; and:

- COMPUTE t k: block k of round t, a (q_owner, kv_holder) pair, merged here (its own block;
  any in the tree) or kept for the send of slot (t, k+1); the engine adds a fixed cost per
  kernel call (``Hardware.kernel_call_s``: decode pays it per block) to its roofline;
- ARRIVE t: the Q blocks and K/V shards posted in round t, used from round t + 1;
- RETURNS t: only before a round whose slot (t, 0) sends partials up merged (the tree
  merges a subtree's before going up); every other partial after END.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenring.core.schedule import Flow, Pass, Payload, Schedule, Transfer
from tokenring.strategies.cached import CachedPlan

__all__ = ["Op", "OpKind", "cached_program", "ring_program"]


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
    """One instruction: ``kind`` at ``step``; ``index`` is the slot of a POST and the segment
    of a COMPUTE; ``transfers`` are what the op waits for (receives, or for SENT this rank's
    sends), in the order it takes them."""

    kind: OpKind
    step: int = 0
    index: int = 0
    transfers: tuple[Transfer, ...] = ()


def ring_program(sched: Schedule, rank: int, steps: range | None = None) -> tuple[Op, ...]:
    """The instructions of ``rank`` for ``sched`` (its steps ``steps``; default all), as in
    Note [Rank program]. Memoised on the schedule while it lives."""
    steps = range(sched.num_steps) if steps is None else steps
    key = ("ring_program", rank, steps.start, steps.stop)
    program = sched._memo.get(key)
    if program is None:
        program = sched._memo[key] = _build(sched, rank, steps)
    assert isinstance(program, tuple)
    return program


def _recvs(sched: Schedule, rank: int, step: int, payload: Payload) -> tuple[Transfer, ...]:
    """``rank``'s receives of ``payload`` posted at ``step``, in slot and lane order."""
    found = [tr for tr in sched.recvs(rank, step) if tr.payload is payload]
    return tuple(sorted(found, key=lambda tr: (tr.after_segments, tr.lane)))


def _passing(sched: Schedule, rank: int, step: int) -> tuple[Transfer, ...]:
    """Backward: the dK/dV accumulators that followed the blocks of ``step`` here (sent at
    ``step - 1``), one per lane that passes one on at ``step``."""
    outgoing = {tr.lane for tr in sched.sends(rank, step) if tr.payload is Payload.DKV}
    owners = sched.steps[rank][step].kv_owners
    return tuple(
        tr
        for tr in _recvs(sched, rank, step - 1, Payload.DKV)
        if tr.lane in outgoing and tr.owner == owners[tr.lane]
    )


def _step(
    sched: Schedule, rank: int, t: int, first: int, passing: tuple[Transfer, ...]
) -> list[Op]:
    """The ops of step ``t`` (``first``: the program's first step)."""
    backward = sched.pass_ is Pass.BACKWARD
    n = len(sched.steps[rank][t].segments)
    slots = {tr.after_segments for tr in (*sched.sends(rank, t), *sched.recvs(rank, t))}
    ops = [Op(kind=OpKind.STEP, step=t, transfers=passing)]
    ops += [Op(kind=OpKind.POST, step=t, index=0)] if 0 in slots else []
    for k in range(n):
        ops.append(Op(kind=OpKind.COMPUTE, step=t, index=k))
        if k + 1 in slots and (not backward or k + 1 < n):
            ops.append(Op(kind=OpKind.POST, step=t, index=k + 1))
    if backward:
        ops.append(Op(kind=OpKind.PASS, step=t, transfers=passing))
        ops += [Op(kind=OpKind.POST, step=t, index=n)] if n > 0 and n in slots else []
    ops += [Op(kind=OpKind.POST, step=t, index=after) for after in sorted(slots) if after > n]
    if t >= first + 2:  # the returns of two steps ago: they had a whole step to arrive
        ops.append(_returns(sched, rank, t - 2))
    travel = tuple(tr for tr in sched.recvs(rank, t) if tr.payload.flow is Flow.TRAVEL)
    ops.append(Op(kind=OpKind.ARRIVE, step=t, transfers=travel))
    sent = [tr for tr in sched.sends(rank, t) if tr.payload.flow is Flow.TRAVEL]
    if t >= first + 2:
        sent += [tr for tr in sched.sends(rank, t - 2) if tr.payload.flow is Flow.RETURN]
    ops.append(Op(kind=OpKind.SENT, step=t, transfers=tuple(sent)))
    return ops


def _returns(sched: Schedule, rank: int, step: int) -> Op:
    """RETURNS of ``step``: the partials (dQ partials) sent to ``rank`` at ``step``."""
    returned = Payload.DQ if sched.pass_ is Pass.BACKWARD else Payload.OUT
    return Op(kind=OpKind.RETURNS, step=step, transfers=_recvs(sched, rank, step, returned))


def _build(sched: Schedule, rank: int, steps: range) -> tuple[Op, ...]:
    backward = sched.pass_ is Pass.BACKWARD
    program = [Op(kind=OpKind.DELTA)] if backward else []
    passed: set[Transfer] = set()
    for t in steps:
        passing = _passing(sched, rank, t) if backward and t > steps.start else ()
        passed.update(passing)
        program += _step(sched, rank, t, steps.start, passing)
    program.append(Op(kind=OpKind.END, step=steps.stop))
    program += [_returns(sched, rank, t) for t in steps[-2:]]
    if backward:
        home = [tr for t in steps for tr in _recvs(sched, rank, t, Payload.DKV) if tr not in passed]
        program.append(Op(kind=OpKind.HOME, transfers=tuple(home)))
    sends = tuple(tr for t in steps for tr in sched.sends(rank, t))
    program.append(Op(kind=OpKind.SENT_ALL, transfers=sends))
    return tuple(program)


def cached_program(plan: CachedPlan, rank: int) -> tuple[Op, ...]:
    """The instructions of ``rank`` for a cached inference plan, as in Note [Rank program].
    Memoised on the plan while it lives (every layer of a step runs the same plan)."""
    program = plan._memo.get(("cached_program", rank))
    if program is None:
        program = plan._memo[("cached_program", rank)] = _build_cached(plan, rank)
    assert isinstance(program, tuple)
    return program


def _build_cached(plan: CachedPlan, rank: int) -> tuple[Op, ...]:
    mine = [tr for tr in plan.transfers if rank in (tr.src, tr.dst)]
    partials = sorted(
        (tr for tr in mine if tr.dst == rank and tr.payload is Payload.OUT),
        key=lambda tr: (tr.step, tr.after_segments, tr.src),
    )
    program: list[Op] = []
    for t in range(plan.num_rounds):
        program.append(Op(kind=OpKind.STEP, step=t))
        slots = sorted({tr.after_segments for tr in mine if tr.step == t})
        first = [tr for tr in mine if (tr.step, tr.after_segments) == (t, 0)]
        if any(tr.src == rank and tr.payload is Payload.OUT for tr in first):
            # partials go up merged in slot (t, 0): merge what came from below first
            taken = tuple(tr for tr in partials if tr.step < t)
            partials = partials[len(taken) :]
            program += [Op(kind=OpKind.RETURNS, step=t, transfers=taken)] if taken else []
        program += [Op(kind=OpKind.POST, step=t, index=0)] if 0 in slots else []
        n = len(plan.computes[rank][t])
        for k in range(n):
            program.append(Op(kind=OpKind.COMPUTE, step=t, index=k))
            program += [Op(kind=OpKind.POST, step=t, index=k + 1)] if k + 1 in slots else []
        program += [Op(kind=OpKind.POST, step=t, index=k) for k in slots if k > n]
        blocks = (tr for tr in mine if tr.dst == rank and tr.step == t)
        travel = tuple(tr for tr in blocks if tr.payload.flow is Flow.TRAVEL)
        program.append(Op(kind=OpKind.ARRIVE, step=t, transfers=travel))
    program.append(Op(kind=OpKind.END, step=plan.num_rounds))
    if partials:
        program.append(Op(kind=OpKind.RETURNS, step=plan.num_rounds, transfers=tuple(partials)))
    sends = tuple(tr for tr in mine if tr.src == rank)
    program.append(Op(kind=OpKind.SENT_ALL, transfers=sends))
    return tuple(program)
