"""The one executor (tokenring.runtime.executor): what it does itself for every strategy, what
it hands to the pass's runner, and that SENT waits for exactly the sends it names."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tokenring.core.schedule import Payload, Transfer
from tokenring.runtime.comm import Communicator
from tokenring.runtime.executor import PassRunner, execute
from tokenring.runtime.program import Op, OpKind, ring_program
from tokenring.strategies import build_schedule


class _Poster:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def post(self, transfers: Any, provide: Any) -> dict[Any, Any]:
        self.log.append(("post", tuple(transfers), provide))
        return {}


class _Comm:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def wait_sent(self, transfers: Any) -> None:
        self.log.append(("wait_sent", tuple(transfers)))

    def wait_sends(self) -> None:
        self.log.append(("wait_sends",))


class _Recorder(PassRunner):
    """Every runner op, logged; nothing computed."""

    def __init__(self, sched: Any) -> None:
        self.sched, self.log = sched, []
        self.comm: Any = _Comm(self.log)
        self.poster: Any = _Poster(self.log)

    def _record(self, op: Op) -> None:
        self.log.append(("runner", op))

    begin = compute = arrive = returns = end = delta = pass_on = home = _record


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("strategy", ["token_ring", "ring"])
def test_execute_runs_every_op_once_in_program_order(strategy: str, pass_: str) -> None:
    """POST goes to the poster with its transfers and the runner's provide, SENT to
    comm.wait_sent with the op's own transfers, SENT_ALL to comm.wait_sends; every other op
    to the runner, in order."""
    sched = build_schedule(strategy, pass_, layout="zigzag", causal=True, world_size=3, seq_local=4)
    program = ring_program(sched, 1)
    runner = _Recorder(sched)
    execute(program, runner)
    expected: list[Any] = []
    for op in program:
        if op.kind is OpKind.POST:
            expected.append(("post", op.transfers, runner.provide))
        elif op.kind is OpKind.SENT:
            expected.append(("wait_sent", op.transfers))
        elif op.kind is OpKind.SENT_ALL:
            expected.append(("wait_sends",))
        else:
            expected.append(("runner", op))
    assert runner.log == expected


def test_an_op_the_runner_lacks_fails_naming_it() -> None:
    sched = build_schedule("ring", "forward", layout="contiguous", causal=False, world_size=2,
                           seq_local=2)  # fmt: skip
    runner = PassRunner()
    runner.sched, runner.comm, runner.poster = sched, _Comm([]), _Poster([])  # type: ignore
    with pytest.raises(NotImplementedError, match=r"PassRunner has no OpKind\.COMPUTE"):
        execute((Op(kind=OpKind.STEP), Op(kind=OpKind.COMPUTE)), runner)


class _Work:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait(self, timeout: timedelta) -> None:
        self.log.append(self.name)


def test_wait_sent_waits_for_the_named_sends_only() -> None:
    def tr(step: int, payload: Payload) -> Transfer:
        return Transfer(step=step, after_segments=0, src=0, dst=1, payload=payload, owner=0,
                        rows=(0, 4))  # fmt: skip

    log: list[str] = []
    comm = Communicator.__new__(Communicator)
    comm.timeout = timedelta(seconds=1)
    sends = [tr(0, Payload.Q), tr(0, Payload.OUT), tr(1, Payload.Q), tr(1, Payload.OUT)]
    comm._pending_sends = [(_Work(f"{t.payload.value}{t.step}", log), t) for t in sends]
    comm.wait_sent([sends[2], sends[0]])
    assert log == ["q0", "q1"], "waited in posting order, only the named ones"
    assert [t for _, t in comm._pending_sends] == [sends[1], sends[3]]
    comm.wait_sent([])
    assert log == ["q0", "q1"]
