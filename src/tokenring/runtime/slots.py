"""Posting one rank's transfers, for every executor (Note [Slots] in tokenring.runtime.comm).

A :class:`SlotPoster` posts what a program's POST names (``tokenring.runtime.program``: a
ring schedule's slot, a collective's round, a cached plan's slot) through the communicator
in one exchange, receives first, and keeps the pending receives until the runner takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenring.core.schedule import Payload, Transfer
from tokenring.runtime.comm import Communicator, FieldSpec, Message, PendingRecv

__all__ = ["Provide", "SlotPoster"]

Provide = Callable[[Transfer], Sequence[torch.Tensor] | Message]
"""What an executor puts in the message of a send when its slot is posted."""


class SlotPoster:
    """One rank's transfers of one pass, posted as its program says.

    Args:
        comm: the communicator; its rank is this rank.
        fields: the ``(shape, dtype)`` of each tensor a receive carries.
        device: where receive buffers live.
    """

    def __init__(
        self,
        comm: Communicator,
        fields: Callable[[Transfer], Sequence[FieldSpec]],
        device: torch.device,
    ) -> None:
        self.comm, self.fields, self.device = comm, fields, device
        self.rank = comm.rank
        self.pending: dict[Transfer, PendingRecv] = {}

    def post(self, transfers: Sequence[Transfer], provide: Provide) -> dict[Transfer, PendingRecv]:
        """Post ``transfers`` (a program's POST): this rank's receives among them first, then
        its sends filled by ``provide``, in one exchange. Returns the receives it posted (also
        kept in :attr:`pending`)."""
        recvs = [(tr, list(self.fields(tr))) for tr in transfers if tr.dst == self.rank]
        sends = [(tr, provide(tr)) for tr in transfers if tr.src == self.rank]
        posted = self.comm.exchange(sends, recvs, device=self.device)
        self.pending.update(posted)
        return posted

    def take(
        self,
        payload: Payload,
        step: int | None = None,
        before_step: int | None = None,
        *,
        arrived: bool = False,
    ) -> list[PendingRecv]:
        """The pending receives of ``payload`` (of ``step``, or posted before ``before_step``,
        where given; with ``arrived``, only those that have arrived), in slot order."""
        keys = [
            tr
            for tr, rec in self.pending.items()
            if tr.payload is payload
            and (step is None or tr.step == step)
            and (before_step is None or tr.step < before_step)
            and (not arrived or rec.ready())
        ]
        keys.sort(key=lambda tr: (tr.step, tr.after_segments))
        return [self.pending.pop(tr) for tr in keys]
