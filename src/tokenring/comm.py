"""The communicator: every byte a strategy moves goes through one of these.

It owns a process group over the same ranks for each *channel*: a flow (``Flow.TRAVEL``:
blocks moving round the ring; ``Flow.RETURN``: partials going home, or accumulators following)
of a lane (the bidirectional ring has two, turning opposite ways). So both directions of a
link carry traffic at once on gloo (separate sockets) and NCCL (separate communicators and
streams). It
packs each :class:`~tokenring.schedule.Transfer` into one message, posts batched P2P with the
receives first, counts messages and bytes per flow and peer, and optionally records a timeline.

Note [Slots]
~~~~~~~~~~~~
P2P is posted in *slots* ``(step, after_segments)``: a rank posts, in one batch per flow, the
receives of transfers whose sender posts them in that slot and its own sends of that slot. All
ranks walk the slots in the same order, so NCCL's in-order streams cannot form a circular wait,
and gloo sees every receive posted no later than the matching send's batch (receives first in
each batch: see netlab-notes, "gloo serialises the two directions...").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenring.schedule import Flow, Transfer

__all__ = ["Communicator", "Event", "PendingRecv", "Timeline", "TrafficCounter"]

FieldSpec = tuple[tuple[int, ...], torch.dtype]

# (flow, lane): each gets its own process group. Lane 0 is the only lane of TokenRing and Ring;
# the bidirectional ring's lane 1 turns the other way round the ring.
CHANNELS: tuple[tuple[Flow, int], ...] = (
    (Flow.TRAVEL, 0),
    (Flow.RETURN, 0),
    (Flow.TRAVEL, 1),
    (Flow.RETURN, 1),
)


def _channel(tr: Transfer) -> tuple[Flow, int]:
    return (tr.payload.flow, tr.lane)


@dataclass(slots=True)
class Event:
    """One bar of a timeline: compute or a transfer, with perf_counter seconds."""

    kind: str  # "compute" | "send" | "recv" | "merge"
    label: str  # e.g. "q", "out", "kv", "step 2"
    step: int
    start_s: float
    end_s: float
    peer: int = -1
    num_bytes: int = 0


@dataclass(slots=True)
class Timeline:
    """Events of one rank; cheap (a list append per event)."""

    events: list[Event] = field(default_factory=list)

    def clear(self) -> None:
        self.events.clear()


@dataclass(slots=True)
class TrafficCounter:
    """Messages and bytes per ``(flow, peer)``, for sends and receives separately."""

    sent_bytes: dict[tuple[str, int], int] = field(default_factory=dict)
    recv_bytes: dict[tuple[str, int], int] = field(default_factory=dict)
    sent_messages: int = 0
    recv_messages: int = 0

    def add(self, *, sent: bool, flow: Flow, peer: int, num_bytes: int) -> None:
        table = self.sent_bytes if sent else self.recv_bytes
        key = (flow.value, peer)
        table[key] = table.get(key, 0) + num_bytes
        if sent:
            self.sent_messages += 1
        else:
            self.recv_messages += 1

    def total_sent(self, flow: Flow | None = None) -> int:
        return sum(v for (f, _), v in self.sent_bytes.items() if flow is None or f == flow.value)

    def reset(self) -> None:
        self.sent_bytes.clear()
        self.recv_bytes.clear()
        self.sent_messages = 0
        self.recv_messages = 0


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors of any dtypes into one uint8 buffer."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _unpack(buffer: torch.Tensor, fields: Sequence[FieldSpec]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    offset = 0
    for shape, dtype in fields:
        num = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buffer[offset : offset + num].view(dtype).view(shape))
        offset += num
    assert offset == buffer.numel(), "received message size differs from the fields"
    return out


def _num_bytes(fields: Sequence[FieldSpec]) -> int:
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in fields
    )


class PendingRecv:
    """A posted receive; ``wait()`` returns the unpacked tensors."""

    def __init__(
        self, comm: Communicator, transfer: Transfer, buffer: torch.Tensor, fields: list[FieldSpec]
    ) -> None:
        self.transfer = transfer
        self._comm = comm
        self._buffer = buffer
        self._fields = fields
        self._work: Any = None
        self._posted_s = time.perf_counter()
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._comm._wait(self._work, self.transfer, "receive")
            self._result = _unpack(self._buffer, self._fields)
            timeline = self._comm.timeline
            if timeline is not None:
                tr = self.transfer
                timeline.events.append(
                    Event(
                        "recv",
                        tr.payload.value,
                        tr.step,
                        self._posted_s,
                        time.perf_counter(),
                        tr.src,
                        self._buffer.numel(),
                    )
                )
        return self._result


class Communicator:
    """Batched, counted P2P over two process groups (travel and return) of the same ranks.

    Args:
        group: the sequence-parallel process group (its ranks, in group-rank order, form the
            ring). ``None``: the default group.
        timeout_s: how long any single transfer may take before the call fails.
        separate_groups: give each channel (flow x lane) its own process group (default).
            With False everything shares ``group`` (for experiments on the gloo ordering
            effect: both directions of a pair then share one socket).

    Group ranks are used everywhere (``Transfer.src``/``dst``), never global ranks.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 300.0,
        separate_groups: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call tokenring.init_distributed() or "
                "torch.distributed.init_process_group() before building a Communicator"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
        base = group if group is not None else dist.group.WORLD
        assert base is not None
        self.group = base
        self.rank = dist.get_rank(base)
        self.world_size = dist.get_world_size(base)
        self.timeout = timedelta(seconds=timeout_s)
        self.backend = str(dist.get_backend(base))
        ranks = dist.get_process_group_ranks(base)
        self._groups: dict[tuple[Flow, int], dist.ProcessGroup] = {}
        for channel in CHANNELS:
            if self.world_size == 1 or not separate_groups:
                self._groups[channel] = base
                continue
            # A fresh group per channel, so each flow of each lane gets its own sockets
            # (gloo) or communicator and stream (NCCL); only members take part in creating it.
            flow, lane = channel
            try:
                made = dist.new_group(
                    ranks=ranks,
                    timeout=self.timeout,
                    use_local_synchronization=True,
                    group_desc=f"tokenring_{flow.value}_{lane}",
                )
            except Exception as exc:
                raise RuntimeError(
                    f"rank {self.rank}: creating the {flow.value!r} process group of lane {lane} "
                    f"over ranks {ranks} failed; a peer did not join in time (it failed, is "
                    f"slow, or did not call attention with this group): {exc}"
                ) from exc
            assert made is not None
            self._groups[channel] = made
        self.counter = TrafficCounter()
        self.timeline: Timeline | None = None
        self._pending_sends: list[tuple[Any, Transfer]] = []

    # -- posting -----------------------------------------------------------------------------
    def exchange(
        self,
        sends: Sequence[tuple[Transfer, Sequence[torch.Tensor]]],
        recvs: Sequence[tuple[Transfer, list[FieldSpec]]],
        *,
        device: torch.device,
    ) -> dict[Transfer, PendingRecv]:
        """Post one slot's receives and sends (receives first), one batch per flow.

        Args:
            sends: each transfer with the tensors that make up its message.
            recvs: each transfer with ``(shape, dtype)`` of the tensors to receive.
            device: where receive buffers live (the tensors' device).

        Returns:
            The pending receives by transfer.
        """
        pending: dict[Transfer, PendingRecv] = {}
        for channel in CHANNELS:
            flow = channel[0]
            group = self._groups[channel]
            ops: list[dist.P2POp] = []
            for tr, fields in recvs:
                if _channel(tr) != channel:
                    continue
                buffer = torch.empty(_num_bytes(fields), dtype=torch.uint8, device=device)
                rec = PendingRecv(self, tr, buffer, fields)
                pending[tr] = rec
                ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=tr.src))
                self.counter.add(sent=False, flow=flow, peer=tr.src, num_bytes=buffer.numel())
            send_transfers: list[Transfer] = []
            for tr, tensors in sends:
                if _channel(tr) != channel:
                    continue
                buffer = _pack(tensors)
                ops.append(dist.P2POp(dist.isend, buffer, group=group, group_peer=tr.dst))
                send_transfers.append(tr)
                self.counter.add(sent=True, flow=flow, peer=tr.dst, num_bytes=buffer.numel())
                if self.timeline is not None:
                    now = time.perf_counter()
                    self.timeline.events.append(
                        Event("send", tr.payload.value, tr.step, now, now, tr.dst, buffer.numel())
                    )
            if not ops:
                continue
            works = dist.batch_isend_irecv(ops)
            num_recv = len(ops) - len(send_transfers)
            recv_list = [rec for rec in pending.values() if _channel(rec.transfer) == channel]
            if len(works) == len(ops):
                for rec, work in zip(recv_list, works[:num_recv], strict=True):
                    rec._work = work
                self._pending_sends.extend(zip(works[num_recv:], send_transfers, strict=True))
            else:  # coalesced into one work (NCCL): every op completes with it
                for rec in recv_list:
                    rec._work = works[-1] if works else None
                self._pending_sends.extend((works[-1], tr) for tr in send_transfers)
        return pending

    def wait_sends(self) -> None:
        """Wait for every send posted so far (their buffers may be reused afterwards)."""
        for work, tr in self._pending_sends:
            self._wait(work, tr, "send")
        self._pending_sends.clear()

    def _wait(self, work: Any, tr: Transfer, what: str) -> None:
        if work is None:
            return
        try:
            work.wait(self.timeout)
        except Exception as exc:
            peer = tr.src if what == "receive" else tr.dst
            raise RuntimeError(
                f"rank {self.rank}: {what} of {tr.payload.value!r} rows {tr.rows} of owner "
                f"{tr.owner} {'from' if what == 'receive' else 'to'} rank {peer} at step "
                f"{tr.step} failed (peer failed, mismatched, or slower than "
                f"{self.timeout.total_seconds():.0f} s): {exc}"
            ) from exc
