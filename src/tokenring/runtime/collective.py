"""Runs the collective strategies (``tokenring.strategies.collective``) on one rank.

:func:`collective_forward` and :func:`collective_backward` are joined by residuals; the public
API runs them after validation and wires them into autograd. The collectives go through the
communicator (``comm.all_to_all_single``; all-gather K/V's rounds are all-to-alls too), so each
is bounded by ``comm.timeout`` and fails naming itself, the rank and the group. Every message
is counted in ``comm.counter`` per flow and destination as the backend puts it on the wire, and
the schedule's transfers add up to the same bytes. The algorithms: Note [Ulysses], Note
[All-gather K/V] and Note [All-gather K/V rounds] in ``tokenring.strategies.collective``.

Legend: B batch, S global seq (P * s), s local seq, Hq query heads, Hkv key/value heads, D head
dim, P world size, nq / nkv heads of one Ulysses rank.

Note [gloo collectives]
~~~~~~~~~~~~~~~~~~~~~~~
On gloo in torch 2.13 ``all_to_all_single`` (uneven splits, async) and
``all_gather_into_tensor`` (async, bf16 and fp16 too) are native. ``reduce_scatter_tensor``
runs but is emulated as an all-reduce followed by a local chunk (pytorch PR 118911): twice a
reduce-scatter's traffic, and every rank receives every sum. So the backward's reduce-scatter
of all-gather K/V is an ``all_to_all_single`` of each owner's dK/dV block followed by a local
sum: P - 1 blocks out per rank, the volume of a real reduce-scatter, on every backend (in
rounds, one block per round; Note [All-gather K/V rounds]). Messages are packed as bytes so
that one message carries tensors of two dtypes (out and lse).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from tokenring.core.layout import Layout, Sharding, global_positions
from tokenring.core.masks import MaskSpec
from tokenring.core.merge import merge_into
from tokenring.core.schedule import (
    Flow,
    Pass,
    Payload,
    Schedule,
    Segment,
)
from tokenring.model.costmodel import CollectiveRouting
from tokenring.runtime.comm import Communicator, Event
from tokenring.runtime.kernels import BlockKernel, PositionMask, accumulation_dtype
from tokenring.strategies.collective import (
    CollectiveStrategy,
    FieldSpec,
    HeadShare,
    Rows,
    _build,
    _shift,
    ulysses_heads,
)

__all__ = ["collective_backward", "collective_forward", "residual_fields"]


# -- messages ------------------------------------------------------------------------------


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A tensor of any dtype as a flat uint8 tensor (a view when it is contiguous)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def _num_bytes(fields: Sequence[FieldSpec]) -> int:
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in fields
    )


def _unpack(buffer: torch.Tensor, fields: Sequence[FieldSpec]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    offset = 0
    for shape, dtype in fields:
        num = _num_bytes([(shape, dtype)])
        chunk = buffer[offset : offset + num]
        if chunk.storage_offset() % torch.empty((), dtype=dtype).element_size():
            chunk = chunk.clone()  # a field after an odd-sized one: realign before the view
        out.append(chunk.view(dtype).view(shape))
        offset += num
    assert offset == buffer.numel(), "received message size differs from its fields"
    return out


class _AllToAll:
    """One all-to-all of packed messages; this rank's own message never leaves it."""

    def __init__(
        self,
        comm: Communicator,
        sends: Sequence[Sequence[torch.Tensor]],
        recv_fields: Sequence[Sequence[FieldSpec]],
        *,
        flow: Flow,
        label: str,
        device: torch.device,
    ) -> None:
        rank, p = comm.rank, comm.world_size
        self._own = list(sends[rank])
        self._fields = recv_fields
        self._rank = rank
        flat = [[_as_bytes(x) for x in sends[j]] if j != rank else [] for j in range(p)]
        send_sizes = [sum(x.numel() for x in parts) for parts in flat]
        packed = [x for parts in flat for x in parts]
        send = torch.cat(packed) if packed else torch.empty(0, dtype=torch.uint8, device=device)
        recv_sizes = [_num_bytes(recv_fields[j]) if j != rank else 0 for j in range(p)]
        self._recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        self._recv_sizes = recv_sizes
        staged = comm.path(device).endswith(
            "staged"
        )  # Note [Staged path] in tokenring.runtime.comm
        self._wire = comm.wire_buffer(self._recv.numel(), device) if staged else self._recv
        self._pending = comm.all_to_all_single(
            self._wire,
            comm.to_wire(send),
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            flow=flow,
            label=label,
        )

    def wait(self) -> list[list[torch.Tensor]]:
        """The tensors from every source rank, in rank order (this rank's: its own sends)."""
        self._pending.wait()
        if self._wire is not self._recv:
            self._recv.copy_(self._wire, non_blocking=True)
        parts: list[list[torch.Tensor]] = []
        offset = 0
        for j, size in enumerate(self._recv_sizes):
            if j == self._rank:
                parts.append(self._own)
            else:
                parts.append(_unpack(self._recv[offset : offset + size], self._fields[j]))
            offset += size
        return parts


def _timed(comm: Communicator, label: str) -> Callable[[], None]:
    start = time.perf_counter()

    def done() -> None:
        if comm.timeline is not None:
            comm.timeline.events.append(Event("compute", label, 0, start, time.perf_counter()))

    return done


# -- Ulysses -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _UlyssesPlan:
    """What one rank needs to run Ulysses: head shares, row order, local kv head map."""

    shares: tuple[HeadShare, ...]
    to_global: torch.Tensor | None  # gathered row index of each global position; None: as is
    to_layout: torch.Tensor | None  # global position of each gathered row
    kv_map: torch.Tensor | None  # local kv head of each local q head; None: kernel's own GQA
    visible: PositionMask | None = None  # (S, S) mask over the gathered rows, as positions

    @staticmethod
    def make(
        comm: Communicator,
        layout: Layout,
        causal: bool,
        shape_q: torch.Size,
        heads_kv: int,
        device: torch.device,
        masking: _Masking | None = None,
    ) -> _UlyssesPlan:
        p, s, hq = comm.world_size, shape_q[1], shape_q[2]
        shares = ulysses_heads(world_size=p, heads_q=hq, heads_kv=heads_kv)
        to_global = to_layout = None
        visible = None
        if masking is not None:  # rows stay in rank order; the mask says who sees whom
            visible = masking.block(masking.all_positions, masking.all_positions)
        elif causal and layout is not Layout.CONTIGUOUS and p > 1:
            positions = torch.cat(
                [
                    global_positions(rank=j, world_size=p, seq_local=s, layout=layout)
                    for j in range(p)
                ]
            ).to(device)  # (S,) global position of each gathered row
            to_layout = positions
            to_global = torch.argsort(positions)
        mine = shares[comm.rank]
        groups = hq // heads_kv
        local = [(h // groups) - mine.kv[0] for h in range(*mine.q)]
        kv_map = None
        if mine.num_q > 0:
            per = mine.num_q // mine.num_kv
            native = mine.num_q % mine.num_kv == 0 and local == [
                i // per for i in range(mine.num_q)
            ]
            if not native:
                kv_map = torch.tensor(local, dtype=torch.long, device=device)
        return _UlyssesPlan(shares, to_global, to_layout, kv_map, visible)

    def global_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_global is None else x.index_select(dim, self.to_global)

    def layout_order(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x if self.to_layout is None else x.index_select(dim, self.to_layout)

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, nkv, D) -> the kv head of every local q head where the kernel needs it."""
        return x if self.kv_map is None else x.index_select(2, self.kv_map)

    def reduce_kv(self, dx: torch.Tensor, num_kv: int, acc: torch.dtype) -> torch.Tensor:
        """Gradient of :meth:`expand_kv`: (B, S, nq or nkv, D) -> (B, S, nkv, D) in ``acc``."""
        if self.kv_map is None:
            return dx.to(acc)
        shape = (dx.shape[0], dx.shape[1], num_kv, dx.shape[3])
        return torch.zeros(shape, dtype=acc, device=dx.device).index_add_(
            2, self.kv_map, dx.to(acc)
        )


def _heads(x: torch.Tensor, heads: Rows) -> torch.Tensor:
    return x[:, :, heads[0] : heads[1]]


def _ulysses_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _UlyssesPlan,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Returns out (B, s, Hq, D), lse (B, Hq, s) and the tensors the backward keeps."""
    b, s, _, d = q.shape
    p, rank = comm.world_size, comm.rank
    acc = accumulation_dtype(q.dtype)
    mine = plan.shares[rank]
    nq, nkv = mine.num_q, mine.num_kv
    sends = [[_heads(q, sh.q), _heads(k, sh.kv), _heads(v, sh.kv)] for sh in plan.shares]
    mine_fields: list[FieldSpec] = [
        ((b, s, nq, d), q.dtype),
        ((b, s, nkv, d), k.dtype),
        ((b, s, nkv, d), v.dtype),
    ]
    parts = _AllToAll(
        comm, sends, [mine_fields] * p, flow=Flow.TRAVEL, label="qkv", device=q.device
    ).wait()
    del sends
    qg, kg, vg = _gathered(parts, plan, 3)  # (B, S, nq, D), (B, S, nkv, D) x 2
    done = _timed(comm, "attn")
    if nq > 0:
        out_g, lse_g = kernel.forward(
            qg,
            plan.expand_kv(kg),
            plan.expand_kv(vg),
            causal=causal and plan.visible is None,
            scale=scale,
            mask=plan.visible,
        )  # (B, S, nq, D), (B, nq, S)
    else:
        out_g = qg.new_empty(qg.shape)
        lse_g = torch.empty((b, 0, p * s), dtype=acc, device=q.device)
    done()
    del qg, kg, vg
    out_l, lse_l = plan.layout_order(out_g, 1), plan.layout_order(lse_g, 2)
    del out_g, lse_g
    sends = [[out_l[:, i * s : (i + 1) * s], lse_l[:, :, i * s : (i + 1) * s]] for i in range(p)]
    fields = [[((b, s, sh.num_q, d), q.dtype), ((b, sh.num_q, s), acc)] for sh in plan.shares]
    back = _AllToAll(comm, sends, fields, flow=Flow.RETURN, label="out", device=q.device)
    del sends, out_l, lse_l  # packed (this rank's own share stays with the all-to-all)
    parts = back.wait()
    del back
    out = torch.cat([part[0] for part in parts], dim=2)  # (B, s, Hq, D): shares in head order
    lse = torch.cat([part[1] for part in parts], dim=1).contiguous()  # (B, Hq, s)
    return out, lse, []


def _gathered(parts: list[list[torch.Tensor]], plan: _UlyssesPlan, num: int) -> list[torch.Tensor]:
    """The first ``num`` fields of every rank's part, each joined over the sequence in global
    order (B, S, ...): the received buffer is let go as soon as the last one is built."""
    joined = []
    for i in range(num):
        pieces = [part[i] for part in parts]
        joined.append(plan.global_order(torch.cat(pieces, dim=1)))
        del pieces
    parts.clear()
    return joined


def _ulysses_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: _UlyssesPlan,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathers q, dout, lse, delta of its head share and the K/V they use again, like the
    forward, instead of keeping them (Note [Ulysses])."""
    b, s, _, d = dout.shape
    heads_kv = k.shape[2]
    p, rank = comm.world_size, comm.rank
    acc = lse.dtype
    mine = plan.shares[rank]
    nq, nkv = mine.num_q, mine.num_kv
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    sends = []
    for sh in plan.shares:  # Payload.Q_GRAD (q, dout, lse, delta), then Payload.KV (k, v)
        per_head = [x[:, sh.q[0] : sh.q[1]] for x in (lse, delta)]  # (B, nq_j, s)
        q_grad = [_heads(q, sh.q), _heads(dout, sh.q), *per_head]
        sends.append([*q_grad, _heads(k, sh.kv), _heads(v, sh.kv)])
    mine_fields: list[FieldSpec] = [
        ((b, s, nq, d), q.dtype),
        ((b, s, nq, d), dout.dtype),
        ((b, nq, s), acc),
        ((b, nq, s), acc),
        ((b, s, nkv, d), k.dtype),
        ((b, s, nkv, d), v.dtype),
    ]
    gather = _AllToAll(
        comm, sends, [mine_fields] * p, flow=Flow.TRAVEL, label="q_grad", device=dout.device
    )
    del sends, delta
    parts = gather.wait()
    del gather
    lse_g, delta_g = (
        plan.global_order(torch.cat([part[i] for part in parts], dim=2), 2) for i in (2, 3)
    )  # (B, nq, S) x 2
    rows = [[part[0], part[1], part[4], part[5]] for part in parts]
    del parts
    qg, dout_g, kg, vg = _gathered(rows, plan, 4)  # (B, S, nq, D) x 2, (B, S, nkv, D) x 2
    done = _timed(comm, "attn_bwd")
    if nq > 0:
        dq_g, dk_x, dv_x = kernel.backward(
            dout_g,
            qg,
            plan.expand_kv(kg),
            plan.expand_kv(vg),
            lse_g,
            delta_g,
            causal=causal and plan.visible is None,
            scale=scale,
            mask=plan.visible,
        )
        dk_g = plan.reduce_kv(dk_x, nkv, acc)  # (B, S, nkv, D)
        dv_g = plan.reduce_kv(dv_x, nkv, acc)
        del dk_x, dv_x
    else:
        dq_g = qg.new_zeros(qg.shape)
        dk_g = torch.zeros(kg.shape, dtype=acc, device=kg.device)
        dv_g = torch.zeros(vg.shape, dtype=acc, device=vg.device)
    done()
    del qg, kg, vg, dout_g, lse_g, delta_g
    dq_l = plan.layout_order(dq_g)
    del dq_g
    dk_l = plan.layout_order(dk_g)
    del dk_g
    dv_l = plan.layout_order(dv_g)
    del dv_g
    sends = [[x[:, i * s : (i + 1) * s] for x in (dq_l, dk_l, dv_l)] for i in range(p)]
    fields = [
        [
            ((b, s, sh.num_q, d), dout.dtype),
            ((b, s, sh.num_kv, d), acc),
            ((b, s, sh.num_kv, d), acc),
        ]
        for sh in plan.shares
    ]
    back = _AllToAll(comm, sends, fields, flow=Flow.RETURN, label="dqkv", device=dout.device)
    del sends, dq_l, dk_l, dv_l  # packed (this rank's own share stays with the all-to-all)
    dk = torch.zeros((b, s, heads_kv, d), dtype=acc, device=dout.device)
    dv = torch.zeros_like(dk)
    dq_parts = []
    for sh, (dq_part, dk_part, dv_part) in zip(plan.shares, back.wait(), strict=True):
        dq_parts.append(dq_part)
        _heads(dk, sh.kv).add_(dk_part)  # a kv head used by several ranks sums here
        _heads(dv, sh.kv).add_(dv_part)
    dq = torch.cat(dq_parts, dim=2)  # (B, s, Hq, D)
    return dq, dk, dv


# -- all-gather K/V ------------------------------------------------------------------------


class _Shift:
    """One round of all-gather K/V on the wire: an all-to-all in which this rank sends
    ``send`` to ``dst`` only and receives ``recv`` from ``src`` only (every rank takes part)."""

    def __init__(
        self,
        comm: Communicator,
        send: torch.Tensor,
        recv: torch.Tensor,
        *,
        dst: int,
        src: int,
        flow: Flow,
        label: str,
    ) -> None:
        assert send.is_contiguous() and recv.is_contiguous() and send.dtype == recv.dtype
        p = comm.world_size
        self._recv = recv
        staged = comm.path(recv.device).endswith(
            "staged"
        )  # Note [Staged path] in tokenring.runtime.comm
        if staged:
            wire = comm.wire_buffer(recv.numel() * recv.element_size(), recv.device)
            self._wire = wire.view(recv.dtype)
            self._send = comm.to_wire(_as_bytes(send)).view(send.dtype)
        else:
            self._wire, self._send = recv.view(-1), send.view(-1)
        self._pending = comm.all_to_all_single(
            self._wire,
            self._send,
            output_split_sizes=[recv.numel() if j == src else 0 for j in range(p)],
            input_split_sizes=[send.numel() if j == dst else 0 for j in range(p)],
            flow=flow,
            label=label,
        )

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        if self._wire.data_ptr() != self._recv.data_ptr():
            self._recv.view(-1).copy_(self._wire, non_blocking=True)
        del self._send, self._wire
        return self._recv


def _rounds(sched: Schedule, rank: int) -> list[list[Segment]]:
    """The schedule's segments of ``rank`` by round (round k: kv rows of owner rank + k)."""
    p, s = sched.world_size, sched.seq_local
    rounds: list[list[Segment]] = [[] for _ in range(p)]
    for segment in sched.steps[rank][0].segments:
        (piece,) = segment.pieces
        rounds[(piece.kv_rows[0] // s - rank) % p].append(segment)
    return rounds


def _posted_after(sched: Schedule, rank: int) -> dict[tuple[Payload, int], int]:
    """When ``rank`` posts each of its transfers: (payload, dst) -> segments computed before."""
    return {(tr.payload, tr.dst): tr.after_segments for tr in sched.sends(rank, 0)}


def _allgather_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    scale: float,
    masking: _Masking | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, s, Hq, D) and lse (B, Hq, s); Note [All-gather K/V rounds]."""
    b, s, hq, d = q.shape
    p, rank = comm.world_size, comm.rank
    acc = accumulation_dtype(q.dtype)
    rounds = _rounds(sched, rank)
    after = _posted_after(sched, rank)
    out_acc = torch.zeros((b, s, hq, d), dtype=acc, device=q.device)
    lse_acc = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
    shape = (2, *k.shape)  # (2, B, s, Hkv, D): one round's K/V; two rounds in flight
    buffers = [torch.empty(shape, dtype=k.dtype, device=k.device) for _ in range(min(2, p - 1))]
    gathers: dict[int, tuple[_Shift, _Shift]] = {}
    computed = 0

    def post(round_: int) -> None:  # into the buffer of round - 2, computed by now
        assert after[(Payload.KV, (rank - round_) % p)] == computed, "posted as scheduled"
        buffer = buffers[(round_ - 1) % len(buffers)]
        src, dst = (rank + round_) % p, (rank - round_) % p
        gathers[round_] = tuple(  # type: ignore[assignment]
            _Shift(comm, x, buffer[i], dst=dst, src=src, flow=Flow.TRAVEL, label="kv")
            for i, x in enumerate((k, v))
        )

    for round_, segments in enumerate(rounds):
        if round_ + 1 < p:
            post(round_ + 1)
        # (B, s, Hkv, D) x 2: the own block, or the round's arrived one
        kv = (k, v) if round_ == 0 else tuple(shift.wait() for shift in gathers.pop(round_))
        offset = (rank + round_) % p * s
        for segment in segments:
            (piece,) = segment.pieces
            (a, e), (c, f) = piece.q_rows, _shift(piece.kv_rows, -offset)
            done = _timed(comm, "attn")
            mask = None if masking is None else masking.rows(rank, (a, e), piece.kv_rows)
            part = kernel.forward(
                q[:, a:e],
                kv[0][:, c:f],
                kv[1][:, c:f],
                causal=piece.causal and mask is None,
                scale=scale,
                mask=mask,
            )
            merge_into(out_acc, lse_acc, piece.q_rows, *part)
            del part
            done()
            computed += 1
        del kv
    return out_acc.to(q.dtype), lse_acc


def _allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    *,
    scale: float,
    masking: _Masking | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathers the K/V again round by round and returns each round's dK/dV partial to its
    owner before the next round (Note [All-gather K/V rounds])."""
    p, rank = comm.world_size, comm.rank
    acc = lse.dtype
    rounds = _rounds(sched, rank)
    after = _posted_after(sched, rank)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, s, Hkv, D)
    dv = torch.zeros_like(dk)
    kv_buffer = dkv = received = None
    if p > 1:
        kv_buffer = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        dkv = torch.empty((2, *k.shape), dtype=acc, device=k.device)
        received = torch.empty_like(dkv)
    computed = 0

    def post_gather(round_: int) -> tuple[_Shift, _Shift]:
        assert kv_buffer is not None
        assert after[(Payload.KV, (rank - round_) % p)] == computed, "posted as scheduled"
        src, dst = (rank + round_) % p, (rank - round_) % p
        return (
            _Shift(comm, k, kv_buffer[0], dst=dst, src=src, flow=Flow.TRAVEL, label="kv"),
            _Shift(comm, v, kv_buffer[1], dst=dst, src=src, flow=Flow.TRAVEL, label="kv"),
        )

    gather = post_gather(1) if p > 1 else None  # flies while the own block is computed
    for round_, segments in enumerate(rounds):
        if round_ == 0:
            kv, grads = (k, v), (dk, dv)
        else:
            assert gather is not None and dkv is not None
            kv = (gather[0].wait(), gather[1].wait())  # (B, s, Hkv, D) x 2
            gather = None
            dkv.zero_()
            grads = (dkv[0], dkv[1])
        offset = (rank + round_) % p * q.shape[1]
        for segment in segments:
            (piece,) = segment.pieces
            (a, e), (c, f) = piece.q_rows, _shift(piece.kv_rows, -offset)
            done = _timed(comm, "attn_bwd")
            mask = None if masking is None else masking.rows(rank, (a, e), piece.kv_rows)
            kernel.backward_into(
                (dq[:, a:e], grads[0][:, c:f], grads[1][:, c:f]),
                dout[:, a:e],
                q[:, a:e],
                kv[0][:, c:f],
                kv[1][:, c:f],
                lse[:, :, a:e],
                delta[:, :, a:e],
                causal=piece.causal and mask is None,
                scale=scale,
                mask=mask,
                out=out[:, a:e],  # this rank's own queries
            )
            done()
            computed += 1
        del kv, grads
        if round_ == 0:
            continue
        assert dkv is not None and received is not None
        owner = (rank + round_) % p
        assert after[(Payload.DKV, owner)] == computed, "returned as scheduled"
        back = _Shift(
            comm, dkv, received, dst=owner, src=(rank - round_) % p, flow=Flow.RETURN, label="dkv"
        )
        if round_ + 1 < p:  # the K/V buffer is free: the next round flies with the return
            gather = post_gather(round_ + 1)
        back.wait()
        dk += received[0]  # this rank's own rows, as computed by rank - round
        dv += received[1]
    return dq, dk, dv


# -- entry points --------------------------------------------------------------------------
# Forward and backward are separate calls joined by *residuals*, the tensors the backward keeps
# beyond q, out and lse (see tokenring.runtime.op): the public API wires them into autograd
# through a
# custom operator, which must know their shapes before it runs (residual_fields).


def residual_fields(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    *,
    batch: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    world_size: int,
    rank: int,
) -> list[FieldSpec]:
    """Shapes and dtypes of the residuals :func:`collective_forward` returns on ``rank``.

    None: both backwards gather again what they need (Note [Ulysses], Note [All-gather K/V
    rounds]).

    Raises:
        ValueError: an unknown ``strategy_name``; Hkv not dividing Hq (Ulysses).
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    if strategy is CollectiveStrategy.ALLGATHER_KV:
        return []
    ulysses_heads(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)  # validates
    return []


def _masking(
    sharding: Sharding | None, mask: MaskSpec | None, world_size: int, device: torch.device
) -> _Masking | None:
    if sharding is not None and mask is not None and (sharding.padded or not mask.plain):
        return _Masking(sharding, mask, world_size, device)
    return None


def collective_forward(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    layout: Layout | str,
    comm: Communicator,
    kernel: BlockKernel,
    sharding: Sharding | None = None,
    mask: MaskSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Ulysses or all-gather K/V attention over this rank's shard, without autograd.

    The caller has validated the inputs (``tokenring.api``): same dtype and device, Hkv
    dividing Hq, a seq_local the layout can split, the same arguments on every rank.

    Args:
        strategy_name: ``"ulysses"`` (Note [Ulysses]) or ``"allgather_kv"``
            (Note [All-gather K/V]).
        q: ``(B, s, Hq, D)`` this rank's queries.
        k, v: ``(B, s, Hkv, D)``.
        causal: causal mask over global positions.
        scale: softmax scale.
        layout: how the sequence is sharded.
        comm: the communicator of the group; collectives run on ``comm.group`` and every
            message is counted in ``comm.counter``.
        kernel: the block kernel.
        sharding, mask: with padding, documents or a window (not ``mask.plain``): q, k, v are
            the padded buffers of ``sharding`` and every kernel call gets the explicit mask
            of its rows' positions (Note [Collectives with masks]).

    Returns:
        out ``(B, s, Hq, D)`` in q's dtype, lse ``(B, Hq, s)`` in the accumulation dtype
        (float32; float64 for float64 inputs), and the residuals for
        :func:`collective_backward`, contiguous, shaped as :func:`residual_fields` says.

    Raises:
        ValueError: an unknown ``strategy_name`` or layout.
        RuntimeError: a collective failed or outlasted ``comm.timeout`` (names this rank).
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    layout = Layout.parse(layout)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    masking = _masking(sharding, mask, comm.world_size, q.device)
    # one step (the collectives' schedules have one): a named range in profiler traces
    with record_function(f"tokenring.{strategy.value}.forward.step0"):
        if strategy is CollectiveStrategy.ULYSSES:
            plan = _UlyssesPlan.make(comm, layout, causal, q.shape, k.shape[2], q.device, masking)
            return _ulysses_forward(q, k, v, plan, comm, kernel, causal=causal, scale=scale)
        routing = CollectiveRouting.for_backend(comm.backend)
        key = (layout, causal, comm.world_size, q.shape[1], q.shape[2], k.shape[2], routing)
        fwd = _build(CollectiveStrategy.ALLGATHER_KV, Pass.FORWARD, *key)
        out, lse = _allgather_forward(q, k, v, fwd, comm, kernel, scale=scale, masking=masking)
        return out, lse, []


def collective_backward(
    strategy_name: CollectiveStrategy | enum.Enum | str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype,
    causal: bool,
    scale: float,
    layout: Layout | str,
    comm: Communicator,
    kernel: BlockKernel,
    sharding: Sharding | None = None,
    mask: MaskSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`collective_forward` from its residuals.

    Args:
        dout: ``(B, s, Hq, D)`` gradient of out.
        q, k, v, out, lse: the forward's inputs (padded like them) and outputs; both
            strategies read all five (they gather again; Note [Ulysses], Note [All-gather K/V
            rounds]).
        residuals: what :func:`collective_forward` returned with them.
        dtype: the dtype of q, k and v.
        causal, scale, layout, comm, kernel, sharding, mask: as given to the forward.

    Returns:
        dq ``(B, s, Hq, D)``, dk and dv ``(B, s, Hkv, D)``, in ``dtype``.
    """
    strategy = CollectiveStrategy.parse(strategy_name)
    layout = Layout.parse(layout)
    dout = dout.contiguous()
    masking = _masking(sharding, mask, comm.world_size, dout.device)
    with record_function(f"tokenring.{strategy.value}.backward.step0"):
        if strategy is CollectiveStrategy.ULYSSES:
            assert not residuals, "Ulysses keeps no residuals"
            plan = _UlyssesPlan.make(
                comm, layout, causal, dout.shape, k.shape[2], dout.device, masking
            )
            dq, dk, dv = _ulysses_backward(
                dout,
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                out.contiguous(),
                lse.contiguous(),
                plan,
                comm,
                kernel,
                causal=causal,
                scale=scale,
            )
        else:
            heads_kv = k.shape[2]
            routing = CollectiveRouting.for_backend(comm.backend)
            key = (layout, causal, comm.world_size, q.shape[1], q.shape[2], heads_kv, routing)
            bwd = _build(CollectiveStrategy.ALLGATHER_KV, Pass.BACKWARD, *key)
            assert not residuals, "all-gather K/V keeps no residuals"
            dq, dk, dv = _allgather_backward(
                dout,
                q.contiguous(),
                k.contiguous(),
                v.contiguous(),
                out,
                lse,
                bwd,
                comm,
                kernel,
                scale=scale,
                masking=masking,
            )
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class _Masking:
    """Explicit masks for the collectives from the padded positions of every rank.

    Note [Collectives with masks]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    With padding, documents or a window the collectives keep their plain schedules, built for
    the padded ``seq_local``: their blocks stay supersets of what is visible, because padding
    and documents keep the order of the layout's chunks and windows and documents only remove
    pairs. Each kernel call gets the mask of its rows' global positions as positions
    (``tokenring.runtime.kernels.PositionMask``; padding rows see nothing and are seen by nothing),
    which the kernel cuts into tiles, skipping the tiles nobody sees. They move the same
    bytes as without a mask. The ring strategies skip whole blocks nobody sees (Note [Mask
    classes] in tokenring.core.masks).
    """

    def __init__(
        self, sharding: Sharding, spec: MaskSpec, world_size: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.seq_local = sharding.seq_local
        self.positions = [sharding.padded_positions(r).to(device) for r in range(world_size)]
        self.all_positions = torch.cat(self.positions)  # (P*s,) rows in rank order

    def block(self, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> PositionMask:
        return PositionMask(self.spec, q_positions.cpu(), kv_positions.cpu())  # (sq, sk)

    def rows(self, rank: int, q_rows: Rows, kv_rows: Rows) -> PositionMask:
        """Mask of ``rank``'s q rows against rows ``kv_rows`` of the gathered sequence."""
        q_pos = self.positions[rank][q_rows[0] : q_rows[1]]
        return self.block(q_pos, self.all_positions[kv_rows[0] : kv_rows[1]])

    def gathered(self, rank: int, q_rows: Rows, index: torch.Tensor) -> PositionMask:
        """Mask of ``rank``'s q rows against the gathered rows ``index``."""
        q_pos = self.positions[rank][q_rows[0] : q_rows[1]]
        return self.block(q_pos, self.all_positions.index_select(0, index))
