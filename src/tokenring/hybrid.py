"""2-D sequence parallelism: Ulysses inside a fast island, a ring strategy across islands.

This module owns the hybrid (USP-like) strategy: a 2-D mesh ``outer x inner`` of
P = P_out * P_in ranks, where the inner axis (e.g. the GPUs of one node) runs an all-to-all
from sequence to heads, the outer axis runs any ring strategy (TokenRing, Ring, bidirectional
Ring) on the resulting longer, narrower shards, and a second all-to-all brings the result back.

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P_out outer ranks,
P_in inner ranks.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator, sequence_parallel_attn
from tokenring.layout import Layout, global_positions
from tokenring.schedule import Flow, Strategy

__all__ = ["HybridMesh", "hybrid_attn", "hybrid_mesh", "hybrid_positions", "hybrid_shard"]


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


def _count(group: dist.ProcessGroup, per_peer_bytes: int, flow: Flow) -> None:
    """Count an all-to-all's messages on the inner group's communicator."""
    comm = get_communicator(group)
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


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, s, H, D) -> (B, P_in * s, H / P_in, D), differentiable."""
    p = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.permute(2, 0, 1, 3).reshape(p, h // p, b, s, d).contiguous()  # by destination
    got = all_to_all_single(send, group, Flow.TRAVEL)  # by source
    return got.permute(2, 0, 3, 1, 4).reshape(b, p * s, h // p, d)


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
        out ``(B, s, Hq, D)``, or ``(out, lse)`` with lse ``(B, Hq, s)``.

    Raises:
        NotImplementedError: Hq or Hkv not divisible by the inner size; a collective strategy
            on the outer axis.
        ValueError: as :func:`tokenring.sequence_parallel_attn`.
    """
    strategy = Strategy.parse(outer_strategy)
    if strategy.is_collective:
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
        q, k, v = (_seq_to_heads(x, mesh.inner) for x in (q, k, v))
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
        if return_lse:
            lse = _lse_to_seq(lse, mesh.inner)
    return (out, lse) if return_lse else out
