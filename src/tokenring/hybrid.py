"""2-D sequence parallelism: Ulysses inside a fast island, a ring strategy across islands.

This module runs the hybrid (USP-like) strategy whose schedule ``tokenring.strategies.hybrid``
builds (Note [Hybrid schedule] there): the mesh (:class:`HybridMesh`), the layout of a
rank's shard (Note [Hybrid layout]), and :func:`hybrid_attn`, which turns sequence shards into
head shards on the inner group, runs a ring strategy over the outer group and turns the result
back.

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P_out outer ranks,
P_in inner ranks, nq = Hq / P_in and nkv = Hkv / P_in (heads of one inner rank).

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

Any length and packed documents (``seq_len``, ``cu_seqlens``) follow the same rule: the outer
layout shards the sequence over P_out ranks (zigzag per document, Note [Documents and padding]
in ``tokenring.core.layout``), and each outer shard of L_o tokens is cut into P_in consecutive
slices of near-equal length, the longer ones first (:func:`hybrid_positions`). The inner
all-to-all then has uneven splits: each rank sends its own rows to every inner peer and gets
each peer's, and the outer strategy sees exactly the outer shard it expects for
``seq_len``/``cu_seqlens``. Documents d0 = 5, d1 = 6 tokens, P_out = 2, P_in = 2, zigzag::

    outer rank 0 shard (L_0 = 6): d0[0:2] d1[0:2] | d0[4:5] d1[5:6]  ->  inner 0: 3 rows, 1: 3
    outer rank 1 shard (L_1 = 5): d0[2:3] d1[2:4] | d0[3:4] d1[4:5]  ->  inner 0: 3 rows, 1: 2

Heads split evenly: Hq and Hkv must both be divisible by P_in (query head block j uses kv head
block j), else NotImplementedError; Ulysses proper (``ulysses_attn``) handles uneven splits.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import _validate, get_communicator, sequence_parallel_attn
from tokenring.core.layout import Layout, Sharding, make_sharding, validate_seq_local
from tokenring.core.masks import chunk_documents, normalize_window
from tokenring.core.schedule import (
    Flow,
    Strategy,
)
from tokenring.runtime.comm import Communicator
from tokenring.runtime.kernels import BlockKernel
from tokenring.strategies.hybrid import _OUTER_NAMES


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridMesh:
    """The two process groups of a 2-D sequence-parallel mesh."""

    outer: dist.ProcessGroup
    """Across islands: the ring strategy runs here."""
    inner: dist.ProcessGroup
    """Inside an island: the all-to-all runs here."""

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> HybridMesh:
        """The groups of a 2-D ``DeviceMesh`` ``(outer, inner)``: its two dimensions in that
        order, e.g. ``world_mesh["sp_outer", "sp_inner"]``, a slice of a larger mesh whose
        other dimensions (data parallel, ...) hold other replicas.

        Raises:
            ValueError: not a DeviceMesh of 2 dimensions.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            got = f"ndim={mesh.ndim}" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
            raise ValueError(f"mesh must be a 2-D DeviceMesh (outer, inner); got {got}")
        return cls(outer=mesh.get_group(0), inner=mesh.get_group(1))

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
    for name, size in (("outer", outer), ("inner", inner)):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{name} must be an int; got {size!r}")
    if outer < 1 or inner < 1 or outer * inner != world:
        raise ValueError(
            f"outer x inner must equal the world size {world} with both >= 1; got {outer} x {inner}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (outer, inner), mesh_dim_names=("outer", "inner"))
    return HybridMesh(outer=mesh.get_group("outer"), inner=mesh.get_group("inner"))


def _inner_slices(length: int, inner: int) -> list[tuple[int, int]]:
    """The P_in consecutive slices of an outer shard of ``length`` rows: near-equal, the longer
    ones first (Note [Hybrid layout])."""
    bounds = [0]
    for i in range(inner):
        bounds.append(bounds[-1] + length // inner + (1 if i < length % inner else 0))
    return list(itertools.pairwise(bounds))


def _outer_lengths(
    layout: Layout | str,
    outer: int,
    inner: int,
    seq_local: int | None,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
) -> tuple[Sharding, int]:
    """The outer sharding (over P_out ranks) and S, from exactly one of ``seq_local`` (every
    rank holds that many tokens) and ``seq_len``."""
    layout = Layout.parse(layout)
    if (seq_local is None) == (seq_len is None):
        raise ValueError(
            f"give exactly one of seq_local and seq_len; got seq_local={seq_local}, "
            f"seq_len={seq_len}"
        )
    if seq_local is not None:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens needs seq_len (the global length it ends at)")
        validate_seq_local(seq_local * inner, layout, name="seq_local * inner (an outer shard)")
        seq_len = seq_local * inner * outer
    assert seq_len is not None
    sharding = make_sharding(
        layout=layout, world_size=outer, seq_len=seq_len, cu_seqlens=cu_seqlens
    )
    return sharding, seq_len


def hybrid_positions(
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    layout: Layout | str,
    seq_local: int | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Global positions of one rank's shard (Note [Hybrid layout]); use them for RoPE (with
    ``cu_seqlens``, subtract each token's document start, as ``tokenring.position_ids``).

    Give ``seq_local`` (every rank holds that many tokens, S = P_out * P_in * s) or
    ``seq_len`` (any S; the ranks' lengths may differ by a few tokens), and with ``seq_len``
    optionally ``cu_seqlens``: the outer layout is then applied per document. Pass the same
    ``seq_len`` and ``cu_seqlens`` to :func:`hybrid_attn`.

    Returns:
        int64 ``(s_r,)``, this rank's number of tokens.

    Raises:
        ValueError: ranks or sizes out of range; both or neither of seq_local and seq_len;
            a seq_local the outer layout cannot split; bad cu_seqlens.
    """
    if outer < 1 or inner < 1 or not (0 <= outer_rank < outer and 0 <= inner_rank < inner):
        raise ValueError(
            f"need 0 <= outer_rank < outer and 0 <= inner_rank < inner; got outer_rank="
            f"{outer_rank}, outer={outer}, inner_rank={inner_rank}, inner={inner}"
        )
    sharding, _ = _outer_lengths(layout, outer, inner, seq_local, seq_len, cu_seqlens)
    lo, hi = _inner_slices(sharding.local_len(outer_rank), inner)[inner_rank]
    return sharding.positions(outer_rank)[lo:hi]


def hybrid_shard(
    x: torch.Tensor,
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    layout: Layout | str,
    seq_dim: int = 1,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's shard of a global ``(B, S, H, D)`` tensor under the hybrid layout (Note
    [Hybrid layout]).

    Any S works; unless ``P_out * P_in`` (zigzag: ``2 * P_out * P_in``) divides S and there
    are no documents, the ranks' lengths differ and :func:`hybrid_attn` needs ``seq_len=S``
    (and the same ``cu_seqlens``).

    Returns:
        ``(B, s_r, H, D)``, contiguous.
    """
    index = hybrid_positions(
        outer_rank=outer_rank,
        inner_rank=inner_rank,
        outer=outer,
        inner=inner,
        layout=layout,
        seq_len=x.shape[seq_dim],
        cu_seqlens=cu_seqlens,
    )
    return x.index_select(seq_dim, index.to(x.device)).contiguous()


def _communicator(group: dist.ProcessGroup) -> Communicator:

    return get_communicator(group)


class _AllToAll(torch.autograd.Function):
    """All-to-all of a flat tensor, ``send_splits[j]`` elements to rank j and
    ``recv_splits[j]`` from it, counted; its gradient is the reverse all-to-all of the
    gradient (it only moves elements between ranks)."""

    @staticmethod
    def forward(
        ctx: Any,
        send: torch.Tensor,
        group: dist.ProcessGroup,
        flow: Flow,
        send_splits: list[int],
        recv_splits: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.flow, ctx.splits = group, flow, (send_splits, recv_splits)
        return _exchange(send, group, flow, send_splits, recv_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = Flow.RETURN if ctx.flow is Flow.TRAVEL else Flow.TRAVEL
        send_splits, recv_splits = ctx.splits
        got = _exchange(grad.contiguous(), ctx.group, back, recv_splits, send_splits)
        return got, None, None, None, None


def _exchange(
    send: torch.Tensor,
    group: dist.ProcessGroup,
    flow: Flow,
    send_splits: list[int],
    recv_splits: list[int],
) -> torch.Tensor:
    """All-to-all on the inner group's communicator: counted, bounded by its timeout."""
    got = send.new_empty(sum(recv_splits))
    _communicator(group).all_to_all_single(
        got,
        send,
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        flow=flow,
        label=f"inner {flow.value}",
    ).wait()
    return got


def all_to_all_single(
    send: torch.Tensor,
    group: dist.ProcessGroup,
    flow: Flow,
    send_splits: list[int],
    recv_splits: list[int],
) -> torch.Tensor:
    result: torch.Tensor = _AllToAll.apply(send, group, flow, send_splits, recv_splits)
    return result


def _seq_to_heads(
    xs: list[torch.Tensor], group: dist.ProcessGroup, rows: list[int]
) -> list[torch.Tensor]:
    """[(B, s_i, H_x, D)] -> [(B, L_o, H_x / P_in, D)], differentiable, in one all-to-all: one
    message per peer with all of them (q, k and v), as Note [Hybrid schedule] in
    tokenring.strategies.hybrid lists.
    ``rows[j]``: s_j, the rows of inner rank j (L_o = their sum)."""
    p, me = len(rows), dist.get_rank(group)
    b, s, _, d = xs[0].shape
    widths = [x.shape[2] // p for x in xs]
    w = sum(widths)
    send = torch.cat(
        [x.permute(2, 0, 1, 3).reshape(p, hw, b, s, d) for x, hw in zip(xs, widths, strict=True)],
        dim=1,
    )  # (P_in, sum of H_x / P_in, B, s_i, D) by destination
    per_row = w * b * d
    got = all_to_all_single(
        send.reshape(-1), group, Flow.TRAVEL, [per_row * rows[me]] * p, [per_row * n for n in rows]
    )
    by_source = [
        part.view(w, b, n, d)
        for part, n in zip(got.split([per_row * n for n in rows]), rows, strict=True)
    ]
    whole = torch.cat(by_source, dim=2)  # (sum of H_x / P_in, B, L_o, D) in inner-rank order
    return [part.permute(1, 2, 0, 3) for part in whole.split(widths, dim=0)]


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, rows: list[int]) -> torch.Tensor:
    """(B, L_o, H / P_in, D) -> (B, s_i, H, D), differentiable."""
    p, me = len(rows), dist.get_rank(group)
    b, _, hp, d = y.shape
    send = torch.cat(
        [part.permute(2, 0, 1, 3).reshape(-1) for part in y.split(rows, dim=1)]
    )  # by destination: (H / P_in, B, s_j, D) each
    per_row = hp * b * d
    got = all_to_all_single(
        send, group, Flow.RETURN, [per_row * n for n in rows], [per_row * rows[me]] * p
    )
    s = rows[me]
    return got.view(p, hp, b, s, d).permute(2, 3, 0, 1, 4).reshape(b, s, p * hp, d)


def _lse_to_seq(lse: torch.Tensor, group: dist.ProcessGroup, rows: list[int]) -> torch.Tensor:
    """(B, H / P_in, L_o) -> (B, H, s_i); lse carries no gradient."""
    p, me = len(rows), dist.get_rank(group)
    b, hp, _ = lse.shape
    send = torch.cat([part.permute(1, 0, 2).reshape(-1) for part in lse.split(rows, dim=2)])
    got = _exchange(send, group, Flow.RETURN, [hp * b * n for n in rows], [hp * b * rows[me]] * p)
    s = rows[me]
    return got.view(p, hp, b, s).permute(2, 0, 1, 3).reshape(b, p * hp, s)


def _inner_rows(
    q: torch.Tensor,
    mesh: HybridMesh,
    layout: Layout,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
) -> tuple[list[int], tuple[int, ...]]:
    """The local length of every rank of this inner group and the document boundaries, with
    this rank's checked against ``q``'s (every rank holds s when seq_len is None)."""
    p_in, p_out = mesh.inner_size, mesh.outer_size
    inner_rank, outer_rank = dist.get_rank(mesh.inner), dist.get_rank(mesh.outer)
    if seq_len is None:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens needs seq_len (the global length it ends at)")
        return [q.shape[1]] * p_in, ()  # agreed by the caller
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0; got {seq_len!r}")
    sharding, _ = _outer_lengths(layout, p_out, p_in, None, seq_len, cu_seqlens)
    rows = [hi - lo for lo, hi in _inner_slices(sharding.local_len(outer_rank), p_in)]
    if q.shape[1] != rows[inner_rank]:
        raise ValueError(
            f"q.shape[1] must be {rows[inner_rank]} on outer rank {outer_rank}, inner "
            f"rank {inner_rank}: its share of seq_len={seq_len} (see "
            f"tokenring.hybrid_shard); got {q.shape[1]}"
        )
    return rows, sharding.cu_seqlens


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
    kernel: str | BlockKernel | None = None,
    last_block_splits: int = 2,
    check_ranks: bool = True,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded on a 2-D mesh (Note [Hybrid layout]).

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``: this rank's hybrid shard
            (:func:`hybrid_shard`).
        mesh: the outer and inner groups (:func:`hybrid_mesh`).
        outer_strategy: ring strategy across the outer axis: one whose ``Strategy.is_ring`` holds.
        layout: the outer axis' layout (zigzag balances causal work).
        check_ranks: agree on a small signature first, on the inner group here and on the
            outer group in :func:`tokenring.sequence_parallel_attn` (together: every rank),
            raising a ValueError naming the difference.
        seq_len: the global length S when the ranks' lengths differ (any S, or documents);
            None: every rank holds s tokens and S = P * s.
        cu_seqlens: document boundaries ``(0, ..., S)`` (needs seq_len); shard with
            ``hybrid_shard(..., cu_seqlens=...)``.
        kernel, last_block_splits, window_size, attention_chunk_size: as
            :func:`tokenring.sequence_parallel_attn`, for the outer axis (the masks are over
            global positions).

    Returns:
        out ``(B, s, Hq, D)``, or ``(out, lse)`` with lse ``(B, Hq, s)``. lse travels
        back with out either way (Note [Hybrid schedule] in tokenring.strategies.hybrid).

    Raises:
        NotImplementedError: Hq or Hkv not divisible by the inner size; a collective strategy
            on the outer axis.
        ValueError: a local length that is not this rank's share (see hybrid_shard); ranks
            that disagree; as :func:`tokenring.sequence_parallel_attn`.
    """

    if not isinstance(check_ranks, bool):
        raise ValueError(f"check_ranks must be a bool; got {check_ranks!r}")
    p_in = mesh.inner_size
    rows: list[int] = []
    signature: dict[str, Any] | None = None
    problem: Exception | None = None
    try:  # validate, then agree on the inner group (the outer call agrees on the outer one)
        strategy = Strategy.parse(outer_strategy)
        if not strategy.is_ring:
            raise NotImplementedError(
                f"outer_strategy must be a ring strategy ({_OUTER_NAMES}); got {strategy.value!r}"
            )
        layout = Layout.parse(layout)
        for name, x in (("q", q), ("k", k)):
            if x.dim() != 4 or x.shape[2] % p_in:
                raise NotImplementedError(
                    f"{name} heads must be divisible by the inner size {p_in} for hybrid_attn; "
                    f"got shape {tuple(x.shape)} (ulysses_attn splits heads unevenly)"
                )
        _validate(q, k, v, softmax_scale)
        window = normalize_window(window_size, causal=causal)
        chunk_documents((0, 1), attention_chunk_size)  # validates it
        rows, docs = _inner_rows(q, mesh, layout, seq_len, cu_seqlens)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        signature = {
            "batch": q.shape[0],
            ("seq_len" if seq_len is not None else "seq_local"): seq_len or q.shape[1],
            "heads_q": q.shape[2],
            "heads_kv": k.shape[2],
            "head_dim": q.shape[3],
            "dtype": str(q.dtype),
            "causal": causal,
            "layout": layout.value,
            "outer_strategy": strategy.value,
            "softmax_scale": float(scale).hex(),
            "window_size": list(window),
            "cu_seqlens": [len(docs), zlib.crc32(struct.pack(f"<{len(docs)}q", *docs))],
            "attention_chunk_size": attention_chunk_size,
            "last_block_splits": last_block_splits,
        }
    except (ValueError, NotImplementedError) as exc:
        problem = exc
    if check_ranks:
        _communicator(mesh.inner).agree(signature, problem, what="hybrid attention call")
    elif problem is not None:
        raise problem
    if p_in > 1:
        q, k, v = _seq_to_heads([q, k, v], mesh.inner, rows)
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
        kernel=kernel,
        last_block_splits=last_block_splits,
        check_ranks=check_ranks,
        seq_len=seq_len,
        cu_seqlens=cu_seqlens,
        window_size=window_size,
        attention_chunk_size=attention_chunk_size,
    )
    if p_in > 1:
        out = _heads_to_seq(out, mesh.inner, rows)
        lse = _lse_to_seq(lse, mesh.inner, rows)
    return (out, lse) if return_lse else out
