"""Executes a :class:`~tokenring.schedule.Schedule` on one rank: kernels, merges and P2P.

The schedule says what to compute and what to send in which slot; this module only moves
tensors accordingly. Every strategy shares the slot machinery (:class:`_SlotPoster`). Pass-Q
(TokenRing) keeps K/V home and returns partials; pass-KV (Ring, bidirectional Ring) keeps Q
home and moves one block per lane (``Schedule.lanes``), each lane carrying some kv heads or
some kv rows.

Legend: B batch, s local seq, Hq query heads, Hkv kv heads, D head dim, P world size, n rows
of a transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenring.comm import Communicator, Event, FieldSpec, PendingRecv
from tokenring.kernels import BlockKernel
from tokenring.merge import merge_into
from tokenring.schedule import Flow, Lane, Payload, Piece, Schedule, Strategy, Transfer

__all__ = ["Shapes", "run_backward", "run_forward"]


@dataclass(frozen=True, slots=True)
class Shapes:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    acc_dtype: torch.dtype
    device: torch.device

    def fields(self, tr: Transfer) -> list[FieldSpec]:
        """The tensors making up the message of ``tr``, in order."""
        payload, n = tr.payload, tr.num_rows
        b, hq, hkv, d = self.batch, self.heads_q, self.heads_kv, self.head_dim
        if tr.heads is not None:
            if payload.heads_kind == "kv":
                hkv = tr.heads[1] - tr.heads[0]
            else:
                hq = tr.heads[1] - tr.heads[0]
        q_rows: FieldSpec = ((b, n, hq, d), self.dtype)
        kv_rows: FieldSpec = ((b, n, hkv, d), self.dtype)
        per_head: FieldSpec = ((b, hq, n), self.acc_dtype)
        table: dict[Payload, list[FieldSpec]] = {
            Payload.Q: [q_rows],
            Payload.KV: [kv_rows, kv_rows],
            Payload.OUT: [q_rows, per_head],
            Payload.Q_GRAD: [q_rows, q_rows, per_head, per_head],
            Payload.DQ: [q_rows],
            Payload.DKV: [((b, n, hkv, d), self.acc_dtype)] * 2,
        }
        return table[payload]


@dataclass(slots=True)
class _Held:
    """A travelling block as held by the current rank: ``rows`` of ``owner``'s shard."""

    owner: int
    rows: tuple[int, int]
    tensors: list[torch.Tensor]  # seq dim 1 for (B, n, H, D), dim 2 for (B, H, n)

    def rows_of(self, index: int, rows: tuple[int, int]) -> torch.Tensor:
        start, stop = rows[0] - self.rows[0], rows[1] - self.rows[0]
        assert 0 <= start <= stop <= self.rows[1] - self.rows[0], (rows, self.rows)
        x = self.tensors[index]
        return x[:, start:stop] if x.dim() == 4 else x[:, :, start:stop]

    def slice(self, rows: tuple[int, int]) -> list[torch.Tensor]:
        return [self.rows_of(i, rows) for i in range(len(self.tensors))]


class _SlotPoster:
    """Posts one rank's P2P slot by slot; see Note [Slots] in tokenring.comm."""

    def __init__(self, sched: Schedule, comm: Communicator, shapes: Shapes) -> None:
        self.sched, self.comm, self.shapes = sched, comm, shapes
        self.rank = comm.rank
        self.pending: dict[Transfer, PendingRecv] = {}

    def post(
        self, step: int, after: int, provide: Callable[[Transfer], Sequence[torch.Tensor]]
    ) -> None:
        recvs = [
            (tr, self.shapes.fields(tr))
            for tr in self.sched.recvs(self.rank, step)
            if tr.after_segments == after
        ]
        sends = [
            (tr, provide(tr))
            for tr in self.sched.sends(self.rank, step)
            if tr.after_segments == after
        ]
        if recvs or sends:
            self.pending.update(self.comm.exchange(sends, recvs, device=self.shapes.device))

    def post_rest(
        self, step: int, done: int, provide: Callable[[Transfer], Sequence[torch.Tensor]]
    ) -> None:
        """Post the slots of ``step`` after segment ``done`` that this rank has no compute for."""
        mine = [*self.sched.recvs(self.rank, step), *self.sched.sends(self.rank, step)]
        last = max((tr.after_segments for tr in mine), default=0)
        for after in range(done + 1, last + 1):
            self.post(step, after, provide)

    def travel_in(self, step: int) -> dict[int, PendingRecv]:
        """The travelling blocks arriving for ``step + 1`` (posted at ``step``), by lane."""
        return {
            tr.lane: self.pending.pop(tr)
            for tr in self.sched.recvs(self.rank, step)
            if tr.payload.flow is Flow.TRAVEL
        }

    def take(
        self,
        payload: Payload,
        step: int | None = None,
        lane: int | None = None,
        owner: int | None = None,
    ) -> list[PendingRecv]:
        keys = [
            tr
            for tr in self.pending
            if tr.payload is payload
            and (step is None or tr.step == step)
            and (lane is None or tr.lane == lane)
            and (owner is None or tr.owner == owner)
        ]
        keys.sort(key=lambda tr: (tr.step, tr.after_segments))
        return [self.pending.pop(tr) for tr in keys]


def _timed(comm: Communicator, step: int, label: str) -> Callable[[], None]:
    start = time.perf_counter()

    def done() -> None:
        if comm.timeline is not None:
            comm.timeline.events.append(Event("compute", label, step, start, time.perf_counter()))

    return done


def _merge_parts(
    parts: list[tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]], rows: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial (out, lse) over the segment's ``rows`` from its pieces (each over its own q
    rows inside them), merged in the accumulation dtype; rows no piece covers get lse -inf."""
    if len(parts) == 1 and parts[0][0] == rows:
        return parts[0][1]
    out0, lse0 = parts[0][1]
    n = rows[1] - rows[0]
    out = torch.zeros((out0.shape[0], n, *out0.shape[2:]), dtype=lse0.dtype, device=out0.device)
    lse = torch.full(
        (lse0.shape[0], lse0.shape[1], n), float("-inf"), dtype=lse0.dtype, device=out0.device
    )  # (B, Hq, n)
    for (start, stop), (part_out, part_lse) in parts:
        merge_into(out, lse, (start - rows[0], stop - rows[0]), part_out, part_lse)
    return out.to(out0.dtype), lse


class _Masks:
    """Explicit masks of a schedule's masked pieces, from the owners' padded positions."""

    def __init__(self, sched: Schedule, device: torch.device) -> None:
        self.sched, self.device = sched, device
        self.positions: dict[int, torch.Tensor] = {}

    def __call__(self, piece: Piece, q_owner: int, kv_owner: int) -> torch.Tensor | None:
        if not piece.masked:
            return None
        assert self.sched.sharding is not None and self.sched.mask is not None
        for owner in (q_owner, kv_owner):
            if owner not in self.positions:
                self.positions[owner] = self.sched.sharding.padded_positions(owner).to(self.device)
        q_pos = self.positions[q_owner][piece.q_rows[0] : piece.q_rows[1]]
        kv_pos = self.positions[kv_owner][piece.kv_rows[0] : piece.kv_rows[1]]
        return self.sched.mask.visible(q_pos, kv_pos)  # (sq, sk)


def _return_of(sched: Schedule, rank: int, step: int, index: int) -> Transfer:
    """The transfer that returns segment ``index`` of ``step`` to its q owner."""
    return next(
        tr
        for tr in sched.sends(rank, step)
        if tr.payload in (Payload.OUT, Payload.DQ) and tr.after_segments == index + 1
    )


def _q_heads(piece: Piece, groups: int) -> slice:
    """The query heads of a piece (its kv heads are already the lane's block)."""
    if piece.heads is None:
        return slice(None)
    return slice(piece.heads[0] * groups, piece.heads[1] * groups)


def _lane_shape(lane: Lane, k: torch.Tensor) -> tuple[int, ...]:
    """Shape of a lane's dK (or dV) accumulator: the lane's rows and kv heads of ``k``."""
    b, s, hkv, d = k.shape
    rows = lane.kv_rows or (0, s)
    heads = lane.kv_heads or (0, hkv)
    return (b, rows[1] - rows[0], heads[1] - heads[0], d)


def _lane_blocks(sched: Schedule, rank: int, tensors: list[torch.Tensor]) -> dict[int, _Held]:
    """Each lane's block at step 0: the local shard restricted to the lane's heads and rows."""
    held = {}
    for index, lane in enumerate(sched.lanes):
        rows = lane.kv_rows or (0, tensors[0].shape[1])
        heads = slice(*lane.kv_heads) if lane.kv_heads else slice(None)
        held[index] = _Held(rank, rows, [x[:, rows[0] : rows[1], heads] for x in tensors])
    return held


def run_forward(
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward pass of ``sched`` on this rank.

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``: this rank's shards.

    Returns:
        out ``(B, s, Hq, D)`` in q's dtype and lse ``(B, Hq, s)`` in the accumulation dtype.
    """
    rank, s = comm.rank, q.shape[1]
    groups = q.shape[2] // k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    shapes = Shapes(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype, acc, q.device)
    poster = _SlotPoster(sched, comm, shapes)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    lse_acc = torch.full((q.shape[0], q.shape[2], s), float("-inf"), dtype=acc, device=q.device)
    pass_q = sched.strategy is Strategy.TOKEN_RING
    held = {0: _Held(rank, (0, s), [q])} if pass_q else _lane_blocks(sched, rank, [k, v])
    partials: dict[Transfer, tuple[torch.Tensor, torch.Tensor]] = {}
    masks = _Masks(sched, q.device)

    def provide(tr: Transfer) -> Sequence[torch.Tensor]:
        if tr.payload is Payload.OUT:
            return partials.pop(tr)
        assert tr.owner == held[tr.lane].owner
        return held[tr.lane].slice(tr.rows)

    for step in range(sched.num_steps):
        plan = sched.steps[rank][step]
        poster.post(step, 0, provide)
        for index, segment in enumerate(plan.segments):
            done = _timed(comm, step, "attn")
            parts = []
            for piece in segment.pieces:
                (a, b), (c, d) = piece.q_rows, piece.kv_rows
                qh = _q_heads(piece, groups)
                if pass_q:
                    q_p, k_p, v_p = held[0].rows_of(0, piece.q_rows), k[:, c:d], v[:, c:d]
                    kv_owner = rank
                elif step == 0:  # the local block, every head
                    q_p, k_p, v_p = q[:, a:b], k[:, c:d], v[:, c:d]
                    kv_owner = rank
                else:
                    block = held[piece.lane]
                    q_p = q[:, a:b, qh]
                    k_p, v_p = block.rows_of(0, piece.kv_rows), block.rows_of(1, piece.kv_rows)
                    kv_owner = block.owner
                mask = masks(piece, plan.q_owner, kv_owner)
                part = kernel.forward(q_p, k_p, v_p, causal=piece.causal, scale=scale, mask=mask)
                if plan.q_owner == rank:  # merge straight into this rank's accumulators
                    merge_into(out_acc[:, :, qh], lse_acc[:, qh], piece.q_rows, *part)
                else:
                    parts.append((piece.q_rows, part))
            if parts:
                partials[_return_of(sched, rank, step, index)] = _merge_parts(parts, segment.q_rows)
            done()
            poster.post(step, index + 1, provide)
        poster.post_rest(step, len(plan.segments), provide)
        for lane, incoming in poster.travel_in(step).items():
            tr = incoming.transfer
            held[lane] = _Held(tr.owner, tr.rows, incoming.wait())
    for rec in poster.take(Payload.OUT):
        part_out, part_lse = rec.wait()
        done = _timed(comm, rec.transfer.step, "merge")
        merge_into(out_acc, lse_acc, rec.transfer.rows, part_out, part_lse)
        done()
    comm.wait_sends()
    return out_acc.to(q.dtype), lse_acc


def run_backward(
    sched: Schedule,
    comm: Communicator,
    kernel: BlockKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward pass of ``sched`` on this rank.

    Args:
        dout, q, out: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``; lse: ``(B, Hq, s)``.

    Returns:
        dq ``(B, s, Hq, D)``, dk and dv ``(B, s, Hkv, D)``, in the inputs' dtypes.
    """
    rank, s = comm.rank, q.shape[1]
    groups = q.shape[2] // k.shape[2]
    acc = lse.dtype
    shapes = Shapes(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype, acc, q.device)
    poster = _SlotPoster(sched, comm, shapes)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, s, Hkv, D)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    pass_q = sched.strategy is Strategy.TOKEN_RING
    if pass_q:
        held = {0: _Held(rank, (0, s), [q, dout, lse, delta])}
    else:
        held = _lane_blocks(sched, rank, [k, v])
    returns: dict[Transfer, list[torch.Tensor]] = {}
    masks = _Masks(sched, q.device)

    def provide(tr: Transfer) -> Sequence[torch.Tensor]:
        if tr.payload in (Payload.DQ, Payload.DKV):
            return returns.pop(tr)
        assert tr.owner == held[tr.lane].owner
        return held[tr.lane].slice(tr.rows)

    for step in range(sched.num_steps):
        plan = sched.steps[rank][step]
        num_segments = len(plan.segments)
        poster.post(step, 0, provide)
        # Pass-KV: this step's dK/dV for each lane's visiting block (lane heads and rows),
        # for the lanes whose block this rank computes with (and so passes an accumulator on).
        outgoing = {tr.lane: tr for tr in sched.sends(rank, step) if tr.payload is Payload.DKV}
        lane_grads: dict[int, list[torch.Tensor]] = {}
        for index in outgoing:
            shape = _lane_shape(sched.lanes[index], k)
            lane_grads[index] = [torch.zeros(shape, dtype=acc, device=k.device) for _ in "kv"]
        for index, segment in enumerate(plan.segments):
            done = _timed(comm, step, "attn_bwd")
            dq_seg: torch.Tensor | None = None
            for piece in segment.pieces:
                (a, b), (c, d) = piece.q_rows, piece.kv_rows
                qh = _q_heads(piece, groups)
                if pass_q:
                    q_p, do_p, lse_p, delta_p = held[0].slice(piece.q_rows)
                    k_p, v_p = k[:, c:d], v[:, c:d]
                    kv_owner = rank
                else:
                    q_p, do_p = q[:, a:b, qh], dout[:, a:b, qh]
                    lse_p, delta_p = lse[:, qh, a:b], delta[:, qh, a:b]
                    if step == 0:
                        k_p, v_p = k[:, c:d], v[:, c:d]
                        kv_owner = rank
                    else:
                        block = held[piece.lane]
                        k_p = block.rows_of(0, piece.kv_rows)
                        v_p = block.rows_of(1, piece.kv_rows)
                        kv_owner = block.owner
                mask = masks(piece, plan.q_owner, kv_owner)
                dq_p, dk_p, dv_p = kernel.backward(
                    do_p, q_p, k_p, v_p, lse_p, delta_p, causal=piece.causal, scale=scale, mask=mask
                )
                if pass_q or step == 0:
                    dk_acc[:, c:d] += dk_p
                    dv_acc[:, c:d] += dv_p
                else:
                    row0 = (sched.lanes[piece.lane].kv_rows or (0, s))[0]
                    dk_lane, dv_lane = lane_grads[piece.lane]
                    dk_lane[:, c - row0 : d - row0] += dk_p
                    dv_lane[:, c - row0 : d - row0] += dv_p
                if plan.q_owner == rank:
                    dq_acc[:, a:b, qh] += dq_p
                else:
                    if dq_seg is None:
                        rows = segment.q_rows
                        dq_seg = torch.zeros(
                            (q.shape[0], rows[1] - rows[0], *q.shape[2:]),
                            dtype=acc,
                            device=q.device,
                        )  # (B, n, Hq, D)
                    dq_seg[:, a - segment.q_rows[0] : b - segment.q_rows[0]] += dq_p
            done()
            if dq_seg is not None:
                returns[_return_of(sched, rank, step, index)] = [dq_seg.to(q.dtype)]
            if index + 1 < num_segments:
                poster.post(step, index + 1, provide)
        # Pass-KV: add the accumulator that followed each block (from step 2 on: the first
        # visitor created it) and pass it on; see Note [Backward] in tokenring.schedule.
        for lane, grads in lane_grads.items():
            for rec in poster.take(Payload.DKV, step - 1, lane, owner=plan.kv_owners[lane]):
                for grad, arrived in zip(grads, rec.wait(), strict=True):
                    grad += arrived
            returns[outgoing[lane]] = grads
        if num_segments > 0:
            poster.post(step, num_segments, provide)
        poster.post_rest(step, num_segments, provide)
        for lane, incoming in poster.travel_in(step).items():
            tr = incoming.transfer
            held[lane] = _Held(tr.owner, tr.rows, incoming.wait())
    for rec in poster.take(Payload.DQ):
        (dq_part,) = rec.wait()
        start, stop = rec.transfer.rows
        dq_acc[:, start:stop] += dq_part
    for rec in poster.take(Payload.DKV):  # each lane's accumulator, home at last
        tr = rec.transfer
        heads = slice(*tr.heads) if tr.heads else slice(None)
        dk_home, dv_home = rec.wait()
        dk_acc[:, tr.rows[0] : tr.rows[1], heads] += dk_home
        dv_acc[:, tr.rows[0] : tr.rows[1], heads] += dv_home
    comm.wait_sends()
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)
