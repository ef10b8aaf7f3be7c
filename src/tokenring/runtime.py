"""Executes a :class:`~tokenring.schedule.Schedule` on one rank: kernels, merges and P2P.

The schedule says what to compute and what to send in which slot; this module only moves
tensors accordingly. Every strategy shares the slot machinery (:class:`_SlotPoster`); the four
loops below differ in what travels and where results accumulate.

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
from tokenring.schedule import Flow, Payload, Schedule, Strategy, Transfer

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

    def fields(self, payload: Payload, n: int) -> list[FieldSpec]:
        """The tensors making up ``n`` rows of ``payload``, in message order."""
        b, hq, hkv, d = self.batch, self.heads_q, self.heads_kv, self.head_dim
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
            (tr, self.shapes.fields(tr.payload, tr.num_rows))
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

    def travel_in(self, step: int) -> PendingRecv | None:
        """The travelling block arriving for ``step + 1`` (posted at ``step``)."""
        for tr in self.sched.recvs(self.rank, step):
            if tr.payload.flow is Flow.TRAVEL:
                return self.pending.pop(tr)
        return None

    def take(self, payload: Payload, step: int | None = None) -> list[PendingRecv]:
        keys = [
            tr for tr in self.pending if tr.payload is payload and (step is None or tr.step == step)
        ]
        keys.sort(key=lambda tr: (tr.step, tr.after_segments))
        return [self.pending.pop(tr) for tr in keys]


def _no_send(tr: Transfer) -> Sequence[torch.Tensor]:
    raise AssertionError(f"unexpected send {tr}")


def _timed(comm: Communicator, step: int, label: str) -> Callable[[], None]:
    start = time.perf_counter()

    def done() -> None:
        if comm.timeline is not None:
            comm.timeline.events.append(Event("compute", label, step, start, time.perf_counter()))

    return done


def _merge_parts(
    parts: list[tuple[torch.Tensor, torch.Tensor]], rows: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial (out, lse) from the pieces of a segment, merged in the accumulation dtype."""
    if len(parts) == 1:
        return parts[0]
    out0, lse0 = parts[0]
    out = torch.zeros(out0.shape, dtype=lse0.dtype, device=out0.device)  # (B, n, Hq, D)
    lse = torch.full(lse0.shape, float("-inf"), dtype=lse0.dtype, device=out0.device)
    for part_out, part_lse in parts:
        merge_into(out, lse, (0, rows[1] - rows[0]), part_out, part_lse)
    return out.to(out0.dtype), lse


def _return_of(sched: Schedule, rank: int, step: int, index: int) -> Transfer:
    """The transfer that returns segment ``index`` of ``step`` to its q owner."""
    return next(
        tr
        for tr in sched.sends(rank, step)
        if tr.payload in (Payload.OUT, Payload.DQ) and tr.after_segments == index + 1
    )


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
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    shapes = Shapes(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype, acc, q.device)
    poster = _SlotPoster(sched, comm, shapes)
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    lse_acc = torch.full((q.shape[0], q.shape[2], s), float("-inf"), dtype=acc, device=q.device)
    pass_q = sched.strategy is Strategy.TOKEN_RING
    held = _Held(rank, (0, s), [q] if pass_q else [k, v])
    partials: dict[Transfer, tuple[torch.Tensor, torch.Tensor]] = {}

    def provide(tr: Transfer) -> Sequence[torch.Tensor]:
        if tr.payload is Payload.OUT:
            return partials.pop(tr)
        assert tr.owner == held.owner
        return held.slice(tr.rows)

    for step in range(sched.num_steps):
        plan = sched.steps[rank][step]
        poster.post(step, 0, provide)
        for index, segment in enumerate(plan.segments):
            done = _timed(comm, step, "attn")
            parts = []
            for piece in segment.pieces:
                (a, b), (c, d) = piece.q_rows, piece.kv_rows
                if pass_q:
                    q_p, k_p, v_p = held.rows_of(0, piece.q_rows), k[:, c:d], v[:, c:d]
                else:
                    q_p = q[:, a:b]
                    k_p, v_p = held.rows_of(0, piece.kv_rows), held.rows_of(1, piece.kv_rows)
                parts.append(kernel.forward(q_p, k_p, v_p, causal=piece.causal, scale=scale))
            part = _merge_parts(parts, segment.q_rows)
            done()
            if plan.q_owner == rank:
                merge_into(out_acc, lse_acc, segment.q_rows, *part)
            else:
                partials[_return_of(sched, rank, step, index)] = part
            poster.post(step, index + 1, provide)
        poster.post_rest(step, len(plan.segments), provide)
        incoming = poster.travel_in(step)
        if incoming is not None:
            tr = incoming.transfer
            held = _Held(tr.owner, tr.rows, incoming.wait())
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
    acc = lse.dtype
    shapes = Shapes(q.shape[0], q.shape[2], k.shape[2], q.shape[3], q.dtype, acc, q.device)
    poster = _SlotPoster(sched, comm, shapes)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()  # (B, Hq, s)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, s, Hq, D)
    pass_q = sched.strategy is Strategy.TOKEN_RING
    if pass_q:
        held = _Held(rank, (0, s), [q, dout, lse, delta])
        dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, s, Hkv, D)
        dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    else:
        held = _Held(rank, (0, s), [k, v])
    returns: dict[Transfer, list[torch.Tensor]] = {}
    dkv_home: list[torch.Tensor] | None = None

    def provide(tr: Transfer) -> Sequence[torch.Tensor]:
        if tr.payload in (Payload.DQ, Payload.DKV):
            return returns.pop(tr)
        assert tr.owner == held.owner
        return held.slice(tr.rows)

    for step in range(sched.num_steps):
        plan = sched.steps[rank][step]
        num_segments = len(plan.segments)
        poster.post(step, 0, provide)
        if not pass_q:
            dk_step = torch.zeros(k.shape, dtype=acc, device=k.device)  # kv of plan.kv_owner
            dv_step = torch.zeros(v.shape, dtype=acc, device=v.device)
        for index, segment in enumerate(plan.segments):
            done = _timed(comm, step, "attn_bwd")
            dq_seg: torch.Tensor | None = None
            for piece in segment.pieces:
                (a, b), (c, d) = piece.q_rows, piece.kv_rows
                if pass_q:
                    q_p, do_p, lse_p, delta_p = held.slice(piece.q_rows)
                    k_p, v_p = k[:, c:d], v[:, c:d]
                else:
                    q_p, do_p = q[:, a:b], dout[:, a:b]
                    lse_p, delta_p = lse[:, :, a:b], delta[:, :, a:b]
                    k_p, v_p = held.rows_of(0, piece.kv_rows), held.rows_of(1, piece.kv_rows)
                dq_p, dk_p, dv_p = kernel.backward(
                    do_p, q_p, k_p, v_p, lse_p, delta_p, causal=piece.causal, scale=scale
                )
                dq_seg = dq_p.to(acc) if dq_seg is None else dq_seg + dq_p.to(acc)
                dk_dst, dv_dst = (dk_acc, dv_acc) if pass_q else (dk_step, dv_step)
                dk_dst[:, c:d] += dk_p
                dv_dst[:, c:d] += dv_p
            done()
            assert dq_seg is not None
            if plan.q_owner == rank:
                dq_acc[:, segment.q_rows[0] : segment.q_rows[1]] += dq_seg
            else:
                returns[_return_of(sched, rank, step, index)] = [dq_seg.to(q.dtype)]
            if index + 1 < num_segments:
                poster.post(step, index + 1, provide)
        if not pass_q:
            # The accumulator of this kv owner arrives from rank+1 one step behind the kv; add
            # this step's share and pass it on (or keep it: P == 1).
            if step > 0:
                for rec in poster.take(Payload.DKV, step - 1):
                    dk_in, dv_in = rec.wait()
                    dk_step += dk_in
                    dv_step += dv_in
            outgoing = [tr for tr in sched.sends(rank, step) if tr.payload is Payload.DKV]
            if outgoing:
                returns[outgoing[0]] = [dk_step, dv_step]
            else:
                dkv_home = [dk_step, dv_step]
        if num_segments > 0:
            poster.post(step, num_segments, provide)
        poster.post_rest(step, num_segments, provide)
        incoming = poster.travel_in(step)
        if incoming is not None:
            tr = incoming.transfer
            held = _Held(tr.owner, tr.rows, incoming.wait())
    if pass_q:
        for rec in poster.take(Payload.DQ):
            (dq_part,) = rec.wait()
            start, stop = rec.transfer.rows
            dq_acc[:, start:stop] += dq_part
    else:
        final = poster.take(Payload.DKV)
        if final:
            assert len(final) == 1
            dkv_home = final[0].wait()
        assert dkv_home is not None
        dk_acc, dv_acc = dkv_home
    comm.wait_sends()
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)
