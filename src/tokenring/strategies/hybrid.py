"""The hybrid (2-D) strategy's options (:class:`HybridSpec`) and schedule: on a mesh of
P = P_out * P_in ranks the inner axis runs an all-to-all from sequence to heads, the outer axis
any ring strategy on the longer, narrower shards, and a second all-to-all brings the result
back. ``tokenring.runtime.hybrid`` runs it.

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P_out outer ranks,
P_in inner ranks, nq = Hq / P_in and nkv = Hkv / P_in (heads of one inner rank), e bytes per
element, a bytes per accumulator element.

Note [Hybrid schedule]
~~~~~~~~~~~~~~~~~~~~~~
:func:`build_hybrid_schedule` lists one pass on all P ranks (rank g = o * P_in + i) in
n + 2 steps, n being the outer strategy's steps (P_out)::

    step        what                                   transfers g -> g' = o * P_in + j, j != i
    0           inner all-to-all, sequence -> heads     fwd: q (j's nq heads), kv (j's nkv heads)
                                                        bwd: dout (j's nq heads)      all s rows
    1 .. n      the outer strategy's steps 0 .. n-1     its transfers, ranks o -> o * P_in + i,
                over P_in * s rows and heads            heads shifted to inner rank i's share
                [i*nq, (i+1)*nq), kv [i*nkv, (i+1)*nkv)
    n + 1       inner all-to-all, heads -> sequence     fwd: out + lse of my nq heads (j's rows)
                                                        bwd: dq, dk, dv of my heads (j's rows)

Every transfer and piece carries its head range, so bytes and FLOPs read with the global
``AttentionShape``. dk, dv return in the input dtype as ``Payload.KV`` (:data:`GRAD_KV`; dout
as ``Payload.Q``); lse always travels with out. The all-to-alls are point-to-point messages,
receives first (Note [Collective routing]). With ``seq_len`` the outer schedule covers S over
P_out ranks and rank g's all-to-all carries its slice of its outer shard (:func:`inner_slices`,
Note [Hybrid layout] in tokenring.hybrid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from tokenring.core.layout import Layout, check_int, split_evenly
from tokenring.core.schedule import (
    Pass,
    Payload,
    Piece,
    Rows,
    Schedule,
    Segment,
    StepPlan,
    Strategy,
    Transfer,
)
from tokenring.strategies import build_schedule
from tokenring.strategies.collective import DOUT, CollectiveSchedule

__all__ = [
    "GRAD_KV",
    "HybridSchedule",
    "HybridSpec",
    "build_hybrid_schedule",
    "inner_slices",
    "outer_transfers",
]


GRAD_KV = Payload.KV
"""Payload kind of the dk, dv rows the backward's all-to-all returns (input dtype)."""

_OUTER_NAMES = ", ".join(s.value for s in Strategy if s.is_ring)


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridSpec:
    """The options of ``Strategy.HYBRID``: how the P ranks factor, and the outer strategy."""

    inner: int
    """P_in: ranks per island, running the all-to-all; divides P, Hq and Hkv."""
    outer_strategy: Strategy = Strategy.TOKEN_RING
    """The ring strategy of steps 1 .. n."""

    def __post_init__(self) -> None:
        check_int("inner", self.inner, 1)
        strategy = Strategy.parse(self.outer_strategy)
        if not strategy.is_ring:
            raise ValueError(
                f"outer_strategy must be a ring strategy ({_OUTER_NAMES}); got {strategy.value!r}"
            )
        object.__setattr__(self, "outer_strategy", strategy)

    def check(self, *, world_size: int, heads_q: int, heads_kv: int) -> None:
        """Raise ValueError when this factorisation does not fit the call."""
        if world_size % self.inner or heads_q % self.inner or heads_kv % self.inner:
            raise ValueError(
                f"the hybrid's inner size must divide the world size and both head counts; "
                f"got inner={self.inner}, world_size={world_size}, heads_q={heads_q}, "
                f"heads_kv={heads_kv}"
            )

    def label(self, world_size: int) -> str:
        """``"<outer>x<inner> <outer strategy>"``, e.g. ``2x2 token_ring``."""
        return f"{world_size // self.inner}x{self.inner} {self.outer_strategy.value}"


@dataclass(frozen=True, slots=True)
class HybridSchedule(CollectiveSchedule):
    """One pass of the hybrid on all P ranks (Note [Hybrid schedule])."""

    inner: int = 1
    """P_in."""
    outer_strategy: Strategy = Strategy.TOKEN_RING
    """The ring strategy of steps 1 .. n."""
    outer: Schedule | None = field(default=None, compare=False, repr=False)
    """The outer strategy's schedule over P_out ranks, whose steps 1 .. n lift."""


def inner_slices(length: int, inner: int) -> list[tuple[int, int]]:
    """The P_in near-equal slices of an outer shard, longer first (Note [Hybrid layout])."""
    return split_evenly(length, inner)


def outer_transfers(
    sched: HybridSchedule, rank: int, *, heads_q: int, heads_kv: int
) -> dict[Transfer, Transfer]:
    """``rank``'s sends and receives of steps 1 .. n -> the outer transfer each lifts."""
    assert sched.outer is not None
    p_in, (o, i) = sched.inner, divmod(rank, sched.inner)
    nq, nkv = heads_q // p_in, heads_kv // p_in
    return {
        _lifted_transfer(tr, i, p_in=p_in, nq=nq, nkv=nkv): tr
        for tr in sched.outer.transfers
        if o in (tr.src, tr.dst)
    }


def _shift(heads: Rows | None, width: int, i: int) -> Rows:
    """``heads`` of a share of ``width`` (None: all), moved to inner rank ``i``'s share."""
    lo, hi = heads if heads is not None else (0, width)
    return (i * width + lo, i * width + hi)


def _lifted_step(plan: StepPlan, g: int, *, p_in: int, nq: int, nkv: int) -> StepPlan:
    """An outer step as rank ``g`` = o * P_in + i runs it, on inner rank i's heads."""
    i = g % p_in

    def lifted(pc: Piece) -> Piece:
        return replace(
            pc,
            heads=_shift(pc.heads, nkv, i),
            q_heads=None if pc.q_heads is None else _shift(pc.q_heads, nq, i),
            kv_owner=None if pc.kv_owner is None else pc.kv_owner * p_in + i,  # a lent pair's
        )

    segments = tuple(Segment(seg.q_rows, tuple(map(lifted, seg.pieces))) for seg in plan.segments)
    kv_owners = tuple(kv * p_in + i for kv in plan.kv_owners)
    q_owners = tuple(q * p_in + i for q in plan.q_owners)  # bidirectional TokenRing's
    return StepPlan(g, plan.step + 1, plan.q_owner * p_in + i, kv_owners, segments, q_owners)


def _lifted_transfer(tr: Transfer, i: int, *, p_in: int, nq: int, nkv: int) -> Transfer:
    """An outer transfer as inner rank ``i`` sends it (as :func:`_lifted_step`)."""
    return replace(
        tr,
        src=tr.src * p_in + i,
        dst=tr.dst * p_in + i,
        owner=tr.owner * p_in + i,
        step=tr.step + 1,
        heads=_shift(tr.heads, nkv if tr.payload.heads_kind == "kv" else nq, i),
    )


def _all_to_all_transfers(
    g: int, *, forward: bool, p_in: int, rows: list[int], last_step: int, nq: int, nkv: int
) -> list[Transfer]:
    """Rank ``g``'s all-to-all sends at step 0 and ``last_step``."""
    o, i = divmod(g, p_in)
    inbound = [(Payload.Q, nq), (Payload.KV, nkv)] if forward else [(DOUT, nq)]
    outbound = [(Payload.OUT, nq)] if forward else [(Payload.DQ, nq), (GRAD_KV, nkv)]
    sends = []
    for j in range(p_in):
        if j == i:
            continue
        peer = o * p_in + j
        send = partial(Transfer, src=g, dst=peer, after_segments=0)
        moves = [(payload, width, g, 0, j) for payload, width in inbound]  # my rows, j's heads
        moves += [(payload, width, peer, last_step, i) for payload, width in outbound]
        for payload, width, owner, step, share in moves:
            if rows[owner]:
                span, heads = (0, rows[owner]), _shift(None, width, share)
                sends.append(send(payload=payload, owner=owner, rows=span, step=step, heads=heads))
    return sends


def build_hybrid_schedule(
    pass_: Pass | str,
    *,
    spec: HybridSpec,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    heads_q: int,
    heads_kv: int,
    seq_local: int | None = None,
    last_block_splits: int = 2,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> HybridSchedule:
    """The schedule of one hybrid pass (Note [Hybrid schedule]).

    Args:
        spec: inner size and outer strategy.
        world_size: P = P_out * P_in.
        heads_q, heads_kv: Hq, Hkv (both divisible by P_in).
        seq_local: s, tokens per rank (the outer strategy runs on P_in * s); the rest as
            ``tokenring.strategies.build_schedule``.

    Raises:
        ValueError: a factorisation that does not fit, or what ``build_schedule`` raises.
        NotImplementedError: a ``bidir_token_ring`` outer axis with heads_q / inner < 2.
    """
    pass_ = Pass(pass_)
    spec.check(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)
    p_in = spec.inner
    nq, nkv = heads_q // p_in, heads_kv // p_in
    if spec.outer_strategy is Strategy.BIDIR_TOKEN_RING and nq < 2:
        raise NotImplementedError(
            "outer strategy 'bidir_token_ring' sends half of an island's heads_q / inner query "
            f"heads each way and needs at least 2; got heads_q={heads_q}, inner={p_in} (use "
            "'token_ring')"
        )
    outer = build_schedule(
        spec.outer_strategy,
        pass_,
        layout=layout,
        causal=causal,
        world_size=world_size // p_in,
        seq_local=None if seq_local is None else p_in * seq_local,
        seq_len=seq_len,
        cu_seqlens=cu_seqlens,
        window_size=window_size,
        attention_chunk_size=attention_chunk_size,
        last_block_splits=last_block_splits,
        heads_kv=nkv,
        heads_q=nq,
    )
    return _lifted(outer, world_size=world_size, p_in=p_in, nq=nq, nkv=nkv)


def _lifted(outer: Schedule, *, world_size: int, p_in: int, nq: int, nkv: int) -> HybridSchedule:
    """``outer`` lifted onto the P ranks (Note [Hybrid schedule])."""
    assert outer.sharding is not None
    lengths = (outer.sharding.local_len(o) for o in range(outer.world_size))
    rows = [hi - lo for length in lengths for lo, hi in inner_slices(length, p_in)]  # rows[g]
    n = outer.num_steps
    steps: list[tuple[StepPlan, ...]] = []
    transfers: list[Transfer] = []
    forward = outer.pass_ is Pass.FORWARD
    for g in range(world_size):
        lifted = [
            _lifted_step(plan, g, p_in=p_in, nq=nq, nkv=nkv) for plan in outer.steps[g // p_in]
        ]
        steps.append((StepPlan(g, 0, g, (g,), ()), *lifted, StepPlan(g, n + 1, g, (g,), ())))
        transfers += _all_to_all_transfers(
            g, forward=forward, p_in=p_in, rows=rows, last_step=n + 1, nq=nq, nkv=nkv
        )
    transfers += [
        _lifted_transfer(tr, i, p_in=p_in, nq=nq, nkv=nkv)
        for tr in outer.transfers
        for i in range(p_in)
    ]
    return HybridSchedule(
        strategy=Strategy.HYBRID,
        pass_=outer.pass_,
        layout=outer.layout,
        causal=outer.causal,
        world_size=world_size,
        seq_local=-(-outer.seq_local // p_in),
        lanes=outer.lanes,
        steps=tuple(steps),
        transfers=tuple(transfers),
        inner=p_in,
        outer_strategy=outer.strategy,
        outer=outer,
    )
