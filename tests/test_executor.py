"""The one executor (tokenring.runtime.executor): what it does itself for every strategy, what
it hands to the pass's runner, that the hybrid's passes run through it, and that SENT waits
for exactly the sends it names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
import tokenring.runtime.hybrid
from tokenring.core.schedule import Pass, Payload, Strategy, Transfer
from tokenring.hybrid import hybrid_attn, hybrid_mesh
from tokenring.runtime.comm import Communicator
from tokenring.runtime.executor import PassRunner, execute
from tokenring.runtime.program import Op, OpKind, program_of, ring_program
from tokenring.strategies import build_schedule

RUNNER_OPS = ("begin", "compute", "arrive", "returns", "end", "delta", "pass_on", "home")


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

    def abandon(self, exc: BaseException) -> None:
        self.log.append(("abandon", type(exc).__name__))


class _Recorder(PassRunner):
    """Every runner op, logged; nothing computed."""

    def __init__(self, sched: Any) -> None:
        self.sched, self.log = sched, []
        self.comm: Any = _Comm(self.log)
        self.poster: Any = _Poster(self.log)

    def _record(self, op: Op) -> None:
        self.log.append(("runner", op))

    begin = compute = arrive = returns = end = delta = pass_on = home = _record


def _dispatched(program: Sequence[Op], provide: Callable[..., Any]) -> list[Any]:
    """What execute hands on for ``program``: POST to the poster with its transfers and the
    runner's provide, SENT to comm.wait_sent with the op's own transfers, SENT_ALL to
    comm.wait_sends; every other op to the runner."""
    expected: list[Any] = []
    for op in program:
        if op.kind is OpKind.POST:
            expected.append(("post", op.transfers, provide))
        elif op.kind is OpKind.SENT:
            expected.append(("wait_sent", op.transfers))
        elif op.kind is OpKind.SENT_ALL:
            expected.append(("wait_sends",))
        else:
            expected.append(("runner", op))
    return expected


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("strategy", ["token_ring", "ring"])
def test_execute_runs_every_op_once_in_program_order(strategy: str, pass_: str) -> None:
    """Every op once, in order, to the poster, the communicator or the runner."""
    sched = build_schedule(strategy, pass_, layout="zigzag", causal=True, world_size=3, seq_local=4)
    program = ring_program(sched, 1)
    runner = _Recorder(sched)
    execute(program, runner)
    assert runner.log == _dispatched(program, runner.provide)


def hybrid_passes() -> list[str]:
    """A 2 x 2 hybrid call, forward and backward, with every op execute hands on logged (the
    real runner and routes still run it): how each pass differs from its program."""
    mesh = hybrid_mesh(2, 2)
    runs: list[tuple[Sequence[Op], Any, list[Any]]] = []

    def recording(program: Sequence[Op], runner: Any) -> None:
        log: list[Any] = []

        def logged(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                log.append((kind, *args))
                return method(*args)

            return call

        for name in RUNNER_OPS:
            setattr(runner, name, logged("runner", getattr(runner, name)))
        for name in ("post", "wait_sent", "wait_sends"):  # runner.poster is runner.comm
            setattr(runner.poster, name, logged(name, getattr(runner.poster, name)))
        runs.append((program, runner, log))
        execute(program, runner)

    tokenring.runtime.hybrid.execute = recording  # type: ignore[assignment]
    try:
        q = torch.randn(1, 4, 4, 8, requires_grad=True)
        kv = torch.randn(1, 4, 2, 8, requires_grad=True)
        hybrid_attn(q, kv, kv, mesh=mesh, layout="zigzag", causal=True).sum().backward()
    finally:
        tokenring.runtime.hybrid.execute = execute
    failures = [] if len(runs) == 2 else [f"{len(runs)} programs executed"]
    for (program, runner, log), pass_ in zip(runs, Pass, strict=False):
        sched = runner.sched
        if sched.strategy is not Strategy.HYBRID or sched.pass_ is not pass_:
            failures.append(f"{sched.strategy} {sched.pass_} run for the {pass_}")
        if program != program_of(sched, dist.get_rank()):
            failures.append(f"{pass_}: not the rank's program")
        last = sched.num_steps - 1
        if not all(
            any(op.kind is OpKind.POST and op.step == t for op in program) for t in (0, last)
        ):
            failures.append(f"{pass_}: the inner all-to-alls are not ops of the program")
        if log != _dispatched(program, runner.provide):
            failures.append(f"{pass_}: ops not dispatched once each in program order")
    return failures


def test_hybrid_passes_run_their_programs_through_execute() -> None:
    """Forward and backward of the hybrid are its rank programs, all-to-alls included, each
    op dispatched by execute in program order."""
    per_rank = tokenring.launch(hybrid_passes, world_size=4, timeout_s=300)
    assert per_rank == [[]] * 4, per_rank


def test_an_op_the_runner_lacks_fails_naming_it() -> None:
    sched = build_schedule("ring", "forward", layout="contiguous", causal=False, world_size=2,
                           seq_local=2)  # fmt: skip
    runner = PassRunner()
    comm = _Comm([])
    runner.sched, runner.comm, runner.poster = sched, comm, _Poster([])  # type: ignore
    with pytest.raises(NotImplementedError, match=r"PassRunner has no OpKind\.COMPUTE"):
        execute((Op(kind=OpKind.STEP), Op(kind=OpKind.COMPUTE)), runner)
    # the pass stopped midway: its communicator is told (Note [Abandoned calls])
    assert comm.log == [("abandon", "NotImplementedError")]


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
