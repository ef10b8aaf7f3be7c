"""2-D sequence parallelism: Ulysses inside a fast island, a ring strategy across islands.

This module owns the hybrid (USP-like) strategy: a 2-D mesh ``outer x inner`` of
P = P_out * P_in ranks, where the inner axis (e.g. the GPUs of one node) runs an all-to-all
from sequence to heads, the outer axis runs any ring strategy (TokenRing, Ring, bidirectional
Ring) on the resulting longer, narrower shards, and a second all-to-all brings the result back.
It also owns the hybrid's entry in the strategy registry: ``Strategy.HYBRID`` with its options
(:class:`HybridSpec`) and its schedule (:func:`build_hybrid_schedule`), which bench, the cost
model and the planner read like every other strategy's.

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P_out outer ranks,
P_in inner ranks, nq = Hq / P_in and nkv = Hkv / P_in (heads of one inner rank), e bytes per
element, a bytes per accumulator element.

Note [Hybrid layout]
~~~~~~~~~~~~~~~~~~~~
The outer axis owns the sequence in the caller's layout over P_out shards (zigzag for causal
balance); inside an outer shard the P_in inner ranks hold consecutive slices. The inner
all-to-all concatenates the slices in inner-rank order, so after it every inner rank holds the
whole outer shard, in the outer layout's local order, for Hq / P_in query heads -- exactly
what the ring strategy expects from an outer rank. P_out = 2, P_in = 2, zigzag, 8 chunks::

    outer rank 0 shard: c0 c7   ->  inner 0: first half of (c0 c7) = c0,  inner 1: c7
    outer rank 1 shard: c1 c6   ->  inner 0: c1,                          inner 1: c6

    after the inner all-to-all, each rank of outer rank 0 holds (c0 c7) for half the heads

Heads split evenly: Hq and Hkv must both be divisible by P_in (query head block j uses kv head
block j), else NotImplementedError; Ulysses proper (``ulysses_attn``) handles uneven splits.

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
``Dims``. dk and dv return in the input dtype (the outer strategy hands them back in it) and
are listed as ``Payload.KV``, which weighs 2*nkv*D*e per row (:data:`GRAD_KV`; as dout is
listed as ``Payload.Q`` by ``tokenring.collective``). lse always travels with out, so the
schedule does not depend on ``return_lse``. With GLOO routing steps 0 and n + 1 take turns per
pair (``half_duplex_steps``; Note [Collective routing] in ``tokenring.collective``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tokenring.collective import DOUT, CollectiveSchedule
from tokenring.costmodel import CollectiveRouting
from tokenring.layout import Layout, global_positions
from tokenring.schedule import (
    Flow,
    Pass,
    Payload,
    Piece,
    Segment,
    StepPlan,
    Strategy,
    Transfer,
    build_schedule,
)

if TYPE_CHECKING:
    from tokenring.comm import Communicator

__all__ = [
    "GRAD_KV",
    "HybridMesh",
    "HybridSchedule",
    "HybridSpec",
    "build_hybrid_schedule",
    "hybrid_attn",
    "hybrid_mesh",
    "hybrid_positions",
    "hybrid_shard",
]

Rows = tuple[int, int]

GRAD_KV = Payload.KV
"""Payload kind of the dk, dv rows the backward's inner all-to-all returns in the input dtype:
the bytes of k, v (Note [Hybrid schedule])."""


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
        if strategy.is_collective or strategy is Strategy.HYBRID:
            raise ValueError(
                "outer_strategy must be a ring strategy (token_ring, ring, bidir_ring); got "
                f"{strategy.value!r}"
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
                transfers.append(Transfer(payload, g, peer, g, (0, s), 0, 0, shift(None, kind, j)))
            outbound = [(Payload.OUT, "q")] if forward else [(Payload.DQ, "q"), (GRAD_KV, "kv")]
            for payload, kind in outbound:  # the peer's rows of my heads
                transfers.append(
                    Transfer(payload, g, peer, peer, (0, s), n + 1, 0, shift(None, kind, i))
                )
    for tr in outer.transfers:
        for i in range(p_in):
            transfers.append(
                Transfer(
                    tr.payload,
                    rank(tr.src, i),
                    rank(tr.dst, i),
                    rank(tr.owner, i),
                    tr.rows,
                    tr.step + 1,
                    tr.after_segments,
                    shift(tr.heads, tr.payload.heads_kind, i),
                    tr.lane,
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


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridMesh:
    """The two process groups of a 2-D sequence-parallel mesh."""

    outer: dist.ProcessGroup
    """Across islands: the ring strategy runs here."""
    inner: dist.ProcessGroup
    """Inside an island: the all-to-all runs here."""

    @property
    def outer_size(self) -> int:
        return dist.get_world_size(self.outer)

    @property
    def inner_size(self) -> int:
        return dist.get_world_size(self.inner)


def hybrid_mesh(outer: int, inner: int, *, device_type: str = "cpu") -> HybridMesh:
    """Build the groups from the default group: rank = outer_rank * inner + inner_rank (inner
    ranks are neighbours, e.g. the GPUs of one node). Collective over all ranks.

    Raises:
        ValueError: outer * inner differs from the world size, or a size < 1.
    """
    world = dist.get_world_size()
    if outer < 1 or inner < 1 or outer * inner != world:
        raise ValueError(
            f"outer x inner must equal the world size {world} with both >= 1; got {outer} x {inner}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (outer, inner), mesh_dim_names=("outer", "inner"))
    return HybridMesh(outer=mesh.get_group("outer"), inner=mesh.get_group("inner"))


def hybrid_positions(
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    seq_local: int,
    layout: Layout | str,
) -> torch.Tensor:
    """Global positions of one rank's shard (Note [Hybrid layout]); use them for RoPE.

    Returns:
        int64 ``(seq_local,)``.
    """
    outer_shard = global_positions(
        rank=outer_rank, world_size=outer, seq_local=seq_local * inner, layout=layout
    )
    return outer_shard[inner_rank * seq_local : (inner_rank + 1) * seq_local]


def hybrid_shard(
    x: torch.Tensor,
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    layout: Layout | str,
    seq_dim: int = 1,
) -> torch.Tensor:
    """One rank's shard of a global ``(B, S, H, D)`` tensor under the hybrid layout."""
    seq = x.shape[seq_dim]
    parts = outer * inner * (2 if Layout.parse(layout) is Layout.ZIGZAG else 1)
    if seq % parts:
        raise ValueError(
            f"sequence length must be divisible by {parts} for a {outer} x {inner} hybrid with "
            f"layout {Layout.parse(layout).value!r}; got {seq}"
        )
    index = hybrid_positions(
        outer_rank=outer_rank,
        inner_rank=inner_rank,
        outer=outer,
        inner=inner,
        seq_local=seq // (outer * inner),
        layout=layout,
    )
    return x.index_select(seq_dim, index.to(x.device)).contiguous()


def _communicator(group: dist.ProcessGroup) -> Communicator:
    from tokenring.api import get_communicator  # lazily: api -> planner -> ... -> hybrid

    return get_communicator(group)


def _count(group: dist.ProcessGroup, per_peer_bytes: int, flow: Flow) -> None:
    """Count an all-to-all's messages on the inner group's communicator."""
    comm = _communicator(group)
    for peer in range(comm.world_size):
        if peer != comm.rank:
            comm.counter.add(sent=True, flow=flow, peer=peer, num_bytes=per_peer_bytes)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (one block per rank), counted; its gradient is the
    same all-to-all of the gradient (it only permutes blocks between ranks)."""

    @staticmethod
    def forward(ctx: Any, send: torch.Tensor, group: dist.ProcessGroup, flow: Flow) -> torch.Tensor:
        ctx.group, ctx.flow = group, flow
        return _exchange(send, group, flow)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = Flow.RETURN if ctx.flow is Flow.TRAVEL else Flow.TRAVEL
        return _exchange(grad.contiguous(), ctx.group, back), None, None


def _exchange(send: torch.Tensor, group: dist.ProcessGroup, flow: Flow) -> torch.Tensor:
    _count(group, send[0].numel() * send.element_size(), flow)
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)
    return got


def all_to_all_single(send: torch.Tensor, group: dist.ProcessGroup, flow: Flow) -> torch.Tensor:
    result: torch.Tensor = _AllToAll.apply(send, group, flow)
    return result


def _seq_to_heads(xs: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """[(B, s, H_i, D)] -> [(B, P_in * s, H_i / P_in, D)], differentiable, in one all-to-all:
    one message per peer with all of them (q, k and v), as Note [Hybrid schedule] lists."""
    p = dist.get_world_size(group)
    b, s, _, d = xs[0].shape
    widths = [x.shape[2] // p for x in xs]
    send = torch.cat(
        [x.permute(2, 0, 1, 3).reshape(p, w, b, s, d) for x, w in zip(xs, widths, strict=True)],
        dim=1,
    ).contiguous()  # (P_in, sum of H_i / P_in, B, s, D) by destination
    got = all_to_all_single(send, group, Flow.TRAVEL)  # by source
    return [
        part.permute(2, 0, 3, 1, 4).reshape(b, p * s, w, d)
        for part, w in zip(got.split(widths, dim=1), widths, strict=True)
    ]


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, P_in * s, H / P_in, D) -> (B, s, H, D), differentiable."""
    p = dist.get_world_size(group)
    b, ps, hp, d = y.shape
    s = ps // p
    send = y.reshape(b, p, s, hp, d).permute(1, 3, 0, 2, 4).contiguous()  # by destination
    got = all_to_all_single(send, group, Flow.RETURN)  # by source
    return got.permute(2, 3, 0, 1, 4).reshape(b, s, p * hp, d)


def _lse_to_seq(lse: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, H / P_in, P_in * s) -> (B, H, s); lse carries no gradient."""
    p = dist.get_world_size(group)
    b, hp, ps = lse.shape
    s = ps // p
    send = lse.reshape(b, hp, p, s).permute(2, 1, 0, 3).contiguous()
    got = _exchange(send, group, Flow.RETURN)
    return got.permute(2, 0, 1, 3).reshape(b, p * hp, s)


def hybrid_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: HybridMesh,
    outer_strategy: Strategy | str = Strategy.TOKEN_RING,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: Layout | str = Layout.CONTIGUOUS,
    return_lse: bool = False,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded on a 2-D mesh (Note [Hybrid layout]).

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``: this rank's hybrid shard.
        mesh: the outer and inner groups (:func:`hybrid_mesh`).
        outer_strategy: ring strategy across the outer axis: token_ring, ring or bidir_ring.
        layout: the outer axis' layout (zigzag balances causal work).
        options: passed to :func:`tokenring.sequence_parallel_attn` for the outer axis.

    Returns:
        out ``(B, s, Hq, D)``, or ``(out, lse)`` with lse ``(B, Hq, s)``. lse travels
        back with out either way (Note [Hybrid schedule]).

    Raises:
        NotImplementedError: Hq or Hkv not divisible by the inner size; a collective strategy
            on the outer axis.
        ValueError: as :func:`tokenring.sequence_parallel_attn`.
    """
    from tokenring.api import sequence_parallel_attn

    strategy = Strategy.parse(outer_strategy)
    if strategy.is_collective or strategy is Strategy.HYBRID:
        raise NotImplementedError(
            f"outer_strategy must be a ring strategy (token_ring, ring, bidir_ring); got "
            f"{strategy.value!r}"
        )
    p_in = mesh.inner_size
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 4 or x.shape[2] % p_in:
            raise NotImplementedError(
                f"{name} heads must be divisible by the inner size {p_in} for hybrid_attn; got "
                f"shape {tuple(x.shape)} (ulysses_attn splits heads unevenly)"
            )
    if p_in > 1:
        q, k, v = _seq_to_heads([q, k, v], mesh.inner)
    out, lse = sequence_parallel_attn(
        q,
        k,
        v,
        strategy=strategy,
        causal=causal,
        softmax_scale=softmax_scale,
        group=mesh.outer,
        layout=layout,
        return_lse=True,
        **options,
    )
    if p_in > 1:
        out = _heads_to_seq(out, mesh.inner)
        lse = _lse_to_seq(lse, mesh.inner)
    return (out, lse) if return_lse else out
