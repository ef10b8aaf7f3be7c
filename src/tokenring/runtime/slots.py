"""Posting one rank's transfers slot by slot, for every executor (Note [Slots] in
tokenring.runtime.comm).

A :class:`SlotPoster` holds the transfers a rank sends and receives in one pass -- the ring
schedules' (``tokenring.runtime.ring``) and the cached inference plans'
(``tokenring.inference``) alike -- indexed by slot ``(step, after_segments)``. The executor
says when a slot is due and how to fill a send; the poster posts the slot's receives and
sends through the communicator in one exchange and keeps the pending receives until the
executor takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from tokenring.core.schedule import Flow, Payload, Transfer
from tokenring.runtime.comm import Communicator, FieldSpec, Message, PendingRecv

__all__ = ["Provide", "SlotPoster"]

Provide = Callable[[Transfer], Sequence[torch.Tensor] | Message]
"""What an executor puts in the message of a send when its slot is posted."""


class SlotPoster:
    """One rank's transfers of one pass, posted slot by slot.

    Args:
        transfers: every transfer of the pass (the rank's own are picked out).
        comm: the communicator; its rank is this rank.
        fields: the ``(shape, dtype)`` of each tensor a receive carries.
        device: where receive buffers live.
    """

    def __init__(
        self,
        transfers: Iterable[Transfer],
        comm: Communicator,
        fields: Callable[[Transfer], Sequence[FieldSpec]],
        device: torch.device,
    ) -> None:
        self.comm, self.fields, self.device = comm, fields, device
        self.rank = comm.rank
        self.pending: dict[Transfer, PendingRecv] = {}
        self._sends: dict[tuple[int, int], list[Transfer]] = {}
        self._recvs: dict[tuple[int, int], list[Transfer]] = {}
        for tr in transfers:
            mine = (
                self._sends if tr.src == self.rank else self._recvs if tr.dst == self.rank else None
            )
            if mine is None:
                continue
            mine.setdefault((tr.step, tr.after_segments), []).append(tr)

    def post(self, step: int, after: int, provide: Provide) -> dict[Transfer, PendingRecv]:
        """Post slot ``(step, after)``: its receives first, then its sends filled by
        ``provide``. Returns the receives it posted (also kept in :attr:`pending`)."""
        recvs = [(tr, list(self.fields(tr))) for tr in self._recvs.get((step, after), ())]
        sends = [(tr, provide(tr)) for tr in self._sends.get((step, after), ())]
        if not recvs and not sends:
            return {}
        posted = self.comm.exchange(sends, recvs, device=self.device)
        self.pending.update(posted)
        return posted

    def travel_in(self, step: int) -> dict[int, PendingRecv]:
        """The travelling blocks posted at ``step`` (arriving for ``step + 1``), by lane."""
        keys = [tr for tr in self.pending if tr.step == step and tr.payload.flow is Flow.TRAVEL]
        return {tr.lane: self.pending.pop(tr) for tr in keys}

    def take_ready(self, payload: Payload, before_step: int) -> list[PendingRecv]:
        """The receives of ``payload`` posted before ``before_step`` that have arrived."""
        keys = [
            tr
            for tr, rec in self.pending.items()
            if tr.payload is payload and tr.step < before_step and rec.ready()
        ]
        return [self.pending.pop(tr) for tr in keys]

    def take(
        self,
        payload: Payload,
        step: int | None = None,
        lane: int | None = None,
        owner: int | None = None,
        before_step: int | None = None,
    ) -> list[PendingRecv]:
        """The pending receives of ``payload`` (of ``step``, ``lane``, ``owner``, or posted
        before ``before_step``, where given), in slot order."""
        keys = [
            tr
            for tr in self.pending
            if tr.payload is payload
            and (step is None or tr.step == step)
            and (lane is None or tr.lane == lane)
            and (owner is None or tr.owner == owner)
            and (before_step is None or tr.step < before_step)
        ]
        keys.sort(key=lambda tr: (tr.step, tr.after_segments))
        return [self.pending.pop(tr) for tr in keys]
