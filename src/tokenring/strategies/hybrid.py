"""The hybrid (2-D) strategy's schedule: Ulysses inside fast islands, a ring strategy across.

A 2-D mesh ``outer x inner`` of P = P_out * P_in ranks: the inner axis (e.g. the GPUs of one
node) runs an all-to-all from sequence to heads, the outer axis runs any ring strategy on the
resulting longer, narrower shards, and a second all-to-all brings the result back. This module
owns the hybrid's entry in the strategy registry: ``Strategy.HYBRID`` with its options
(:class:`HybridSpec`) and its schedule (:func:`build_hybrid_schedule`), which bench, the cost
model and the planner read like every other strategy's. ``tokenring.hybrid`` runs it.

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
``AttentionShape``. dk and dv return in the input dtype (the outer strategy hands them back
in it) and are listed as ``Payload.KV``, which weighs 2*nkv*D*e per row (:data:`GRAD_KV`; as dout is
listed as ``Payload.Q`` by ``tokenring.strategies.collective``). lse always travels with out, so the
schedule does not depend on ``return_lse``. With GLOO routing steps 0 and n + 1 take turns per
pair (``half_duplex_steps``; Note [Collective routing] in ``tokenring.strategies.collective``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenring.core.layout import Layout
from tokenring.core.schedule import (
    Pass,
    Payload,
    Piece,
    Segment,
    StepPlan,
    Strategy,
    Transfer,
)
from tokenring.model.costmodel import CollectiveRouting
from tokenring.strategies import build_schedule
from tokenring.strategies.collective import DOUT, CollectiveSchedule

if TYPE_CHECKING:
    pass

__all__ = [
    "GRAD_KV",
    "HybridSchedule",
    "HybridSpec",
    "build_hybrid_schedule",
]

Rows = tuple[int, int]

GRAD_KV = Payload.KV
"""Payload kind of the dk, dv rows the backward's inner all-to-all returns in the input dtype:
the bytes of k, v (Note [Hybrid schedule])."""


# the strategies that can run across the islands: every ring strategy
_OUTER_NAMES = ", ".join(s.value for s in Strategy if s.is_ring)


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridSpec:
    """The options of ``Strategy.HYBRID``: how the P ranks factor, and the outer strategy."""

    inner: int
    """P_in: ranks per island, running the all-to-all; divides P, Hq and Hkv."""
    outer_strategy: Strategy = Strategy.TOKEN_RING
    """The ring strategy across islands: token_ring, ring or bidir_ring."""

    def __post_init__(self) -> None:
        if isinstance(self.inner, bool) or not isinstance(self.inner, int) or self.inner < 1:
            raise ValueError(f"inner must be an int >= 1; got {self.inner!r}")
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


def build_hybrid_schedule(
    pass_: Pass | str,
    *,
    spec: HybridSpec,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    last_block_splits: int = 2,
    routing: CollectiveRouting | str = CollectiveRouting.DIRECT,
) -> HybridSchedule:
    """The schedule of one hybrid pass; see Note [Hybrid schedule]. Pure.

    Args:
        pass_: forward or backward.
        spec: inner size and outer strategy.
        layout: the outer axis' layout.
        causal: causal mask over global positions.
        world_size: P = P_out * P_in.
        seq_local: s, tokens per rank (the outer strategy runs on P_in * s).
        heads_q, heads_kv: Hq, Hkv (both divisible by P_in).
        last_block_splits: as ``build_schedule``, for an outer TokenRing.
        routing: how the backend routes the inner all-to-alls.

    Raises:
        ValueError: a factorisation that does not fit, or what ``build_schedule`` raises.
    """
    pass_ = Pass(pass_)
    routing = CollectiveRouting.parse(routing)
    spec.check(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)
    p_in = spec.inner
    p_out = world_size // p_in
    nq, nkv = heads_q // p_in, heads_kv // p_in
    s = seq_local
    outer = build_schedule(
        spec.outer_strategy,
        pass_,
        layout=layout,
        causal=causal,
        world_size=p_out,
        seq_local=p_in * s,
        last_block_splits=last_block_splits,
        heads_kv=nkv,
        heads_q=nq,
    )
    n = outer.num_steps
    forward = pass_ is Pass.FORWARD

    def rank(o: int, i: int) -> int:
        return o * p_in + i

    def shift(heads: Rows | None, kind: str, i: int) -> Rows:
        width = nkv if kind == "kv" else nq
        lo, hi = heads if heads is not None else (0, width)
        return (i * width + lo, i * width + hi)

    steps: list[tuple[StepPlan, ...]] = []
    transfers: list[Transfer] = []
    for g in range(world_size):
        o, i = divmod(g, p_in)
        row = [StepPlan(g, 0, g, (g,), ())]
        for plan in outer.steps[o]:
            segments = tuple(
                Segment(
                    seg.q_rows,
                    tuple(
                        Piece(
                            pc.q_rows,
                            pc.kv_rows,
                            pc.causal,
                            pc.lane,
                            shift(pc.heads, "kv", i),
                            pc.masked,
                            None if pc.q_heads is None else shift(pc.q_heads, "q", i),
                        )
                        for pc in seg.pieces
                    ),
                )
                for seg in plan.segments
            )
            row.append(
                StepPlan(
                    g,
                    plan.step + 1,
                    rank(plan.q_owner, i),
                    tuple(rank(kv, i) for kv in plan.kv_owners),
                    segments,
                    tuple(rank(q, i) for q in plan.q_owners),  # bidirectional TokenRing's
                )
            )
        row.append(StepPlan(g, n + 1, g, (g,), ()))
        steps.append(tuple(row))
        for j in range(p_in):
            if j == i:
                continue
            peer = rank(o, j)
            inbound = [(Payload.Q, "q"), (Payload.KV, "kv")] if forward else [(DOUT, "q")]
            for payload, kind in inbound:  # my rows of the peer's heads
                transfers.append(
                    Transfer(
                        payload=payload,
                        src=g,
                        dst=peer,
                        owner=g,
                        rows=(0, s),
                        step=0,
                        after_segments=0,
                        heads=shift(None, kind, j),
                    )
                )
            outbound = [(Payload.OUT, "q")] if forward else [(Payload.DQ, "q"), (GRAD_KV, "kv")]
            for payload, kind in outbound:  # the peer's rows of my heads
                transfers.append(
                    Transfer(
                        payload=payload,
                        src=g,
                        dst=peer,
                        owner=peer,
                        rows=(0, s),
                        step=n + 1,
                        after_segments=0,
                        heads=shift(None, kind, i),
                    )
                )
    for tr in outer.transfers:
        for i in range(p_in):
            transfers.append(
                Transfer(
                    payload=tr.payload,
                    src=rank(tr.src, i),
                    dst=rank(tr.dst, i),
                    owner=rank(tr.owner, i),
                    rows=tr.rows,
                    step=tr.step + 1,
                    after_segments=tr.after_segments,
                    heads=shift(tr.heads, tr.payload.heads_kind, i),
                    lane=tr.lane,
                )
            )
    turns = routing is CollectiveRouting.GLOO and p_in > 1
    return HybridSchedule(
        strategy=Strategy.HYBRID,
        pass_=pass_,
        layout=outer.layout,
        causal=causal,
        world_size=world_size,
        seq_local=s,
        lanes=outer.lanes,
        steps=tuple(steps),
        transfers=tuple(transfers),
        routing=routing,
        half_duplex_steps=frozenset({0, n + 1} if turns else ()),
        inner=p_in,
        outer_strategy=spec.outer_strategy,
    )
