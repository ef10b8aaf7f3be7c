"""The one executor: runs a rank program (``tokenring.runtime.program``) on this rank.

Every strategy's pass is a :class:`PassRunner`: the state its program's ops work on, one
method per op that touches tensors. :func:`execute` does the rest the same way for every
strategy: posts each POST through the runner's poster (sends filled by
:meth:`PassRunner.provide`), waits for the sends an op names, and opens one profiler range per
step (``tokenring.<strategy>.<pass>.step<t>``), with autocast off (Note [Autocast]). The
simulator replays the same programs.

Note [Autocast]
~~~~~~~~~~~~~~~
Attention computes in its inputs' dtype (partials merging in the accumulation dtype) under
``torch.autocast`` too: autocast has no rule for tokenring's attention, so it neither casts its
inputs nor may reach inside. Every kernel call of every strategy runs inside a rank program,
and :func:`execute` runs each one with autocast off (:func:`outside_autocast`): the training
operator's passes (ring, bidirectional, Ulysses, all-gather K/V), the hybrid's and the cached
plans'. Autocast used to reach the matmuls of the reference and tiled kernels (and CUDA's
float64 and fallback tiles): float32 inputs under ``torch.autocast("cpu", dtype=torch.bfloat16)``
were computed in bfloat16 and returned as float32 (out 1e-2 off float64 attention instead of
2e-7), while the fused CPU kernel stayed in float32, so the precision depended on the kernel;
partials then failed the header check (the bidirectional TokenRing on 3 ranks, the hybrid and
the cached plans on 2: 136 payload bytes where 144 were expected). ``tokenring.diffusers``'
cross-attention, which calls PyTorch's attention itself, runs it under the same guard. Inputs
of two dtypes (q from an autocast matmul, k in float32) raise ValueError as they do outside
autocast, saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch
from torch.profiler import record_function

from tokenring.core.schedule import Schedule, Transfer
from tokenring.runtime.comm import Message
from tokenring.runtime.program import Op, OpKind
from tokenring.runtime.slots import Provide

__all__ = ["PassRunner", "Poster", "SendWaits", "execute", "outside_autocast"]

_AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types tokenring runs on, whose autocast :func:`outside_autocast` turns off."""


def outside_autocast() -> contextlib.ExitStack:
    """A context in which autocast is off for every device type where it is on (Note
    [Autocast]); nothing changes where it is off."""
    stack = contextlib.ExitStack()
    for device_type in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


class Poster(Protocol):
    """A ``SlotPoster``, or the hybrid runner (it posts each transfer on its group)."""

    def post(self, transfers: Sequence[Transfer], provide: Provide) -> object: ...


class SendWaits(Protocol):
    """A ``Communicator``, or the hybrid runner (it waits for each send on its group)."""

    def wait_sent(self, transfers: Sequence[Transfer]) -> None: ...

    def wait_sends(self) -> None: ...

    def abandon(self, exc: BaseException) -> None: ...


class PassRunner:
    """One pass of one strategy on one rank (Note [Rank program] in tokenring.runtime.program).
    Subclasses set ``sched``, ``comm`` and ``poster`` and override their programs' ops; an op
    not implemented raises NotImplementedError."""

    sched: Schedule
    comm: SendWaits
    poster: Poster

    @property
    def range_prefix(self) -> str:
        """The profiler range of step t is ``<range_prefix><t>``."""
        return f"tokenring.{self.sched.strategy.value}.{self.sched.pass_.value}.step"

    def provide(self, tr: Transfer) -> Sequence[torch.Tensor] | Message:
        """The tensors (or the message) of the send ``tr``, when its slot is posted."""
        raise NotImplementedError(f"{type(self).__name__} sends nothing")

    def _missing(self, op: Op) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no {op.kind}")

    delta = compute = pass_on = arrive = returns = home = _missing

    def begin(self, op: Op) -> None:
        """STEP: whatever the step needs before its first slot (nothing by default)."""

    def end(self, op: Op) -> None:
        """END: after the last step (nothing by default)."""


def execute(program: Sequence[Op], runner: PassRunner) -> None:
    """Run ``program`` with ``runner``: POST, SENT and SENT_ALL here, every other op by the
    runner's method of its name; one profiler range per step. An error on the way marks the
    communicator failed (Note [Abandoned calls] in tokenring.runtime.comm) and propagates.
    Autocast is off throughout (Note [Autocast])."""
    try:
        with outside_autocast():
            _execute(program, runner)
    except BaseException as exc:
        runner.comm.abandon(exc)
        raise


def _execute(program: Sequence[Op], runner: PassRunner) -> None:
    comm, poster = runner.comm, runner.poster
    methods = {
        OpKind.COMPUTE: runner.compute,
        OpKind.STEP: runner.begin,
        OpKind.ARRIVE: runner.arrive,
        OpKind.RETURNS: runner.returns,
        OpKind.PASS: runner.pass_on,
        OpKind.DELTA: runner.delta,
        OpKind.END: runner.end,
        OpKind.HOME: runner.home,
    }
    with contextlib.ExitStack() as step_range:  # left at the next STEP, at END, or on failure
        for op in program:
            kind = op.kind
            if kind is OpKind.POST:
                poster.post(op.transfers, runner.provide)
            elif kind is OpKind.SENT:
                comm.wait_sent(op.transfers)
            elif kind is OpKind.SENT_ALL:
                comm.wait_sends()
            else:
                if kind is OpKind.STEP or kind is OpKind.END:
                    step_range.close()
                if kind is OpKind.STEP:
                    step_range.enter_context(record_function(f"{runner.range_prefix}{op.step}"))
                methods[kind](op)
