"""Process setup and the transports as a demanding user meets them: torchrun's environment,
backends and timeouts refused before anything starts or waits, naming the variable or argument
and its value; ranks that leave threads or return what the launcher cannot read; the
communicator's in-place all-reduce of tensors that are not contiguous, and its options.

Legend: P world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from tokenring.launch import LaunchError
from tokenring.runtime.comm import Communicator

# -- init_distributed: the launcher's environment -------------------------------------------

# Each case runs in one fresh process without a process group, in turn: a refused case must
# leave torch.distributed uninitialised, or the next would take the "initialised" branch.
_INIT_CASES = r"""
import json, math, os, sys, time
import torch.distributed as dist
import tokenring

GOOD = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
cases = json.loads(sys.argv[1])
found = []
for env, kwargs in cases:
    for name in NAMES:
        os.environ.pop(name, None)
    os.environ.update({k: v for k, v in {**GOOD, **env}.items() if v is not None})
    kwargs = {k: (float(v[1:]) if isinstance(v, str) and v.startswith("#") else v)
              for k, v in kwargs.items()}
    start = time.monotonic()
    try:
        tokenring.init_distributed(**kwargs)
        found.append(["ok", "", dist.is_initialized()])
    except Exception as exc:
        found.append([type(exc).__name__, str(exc), dist.is_initialized()])
    found[-1].append(time.monotonic() - start)
comm = tokenring.init_distributed(timeout_s=30)  # GOOD: one rank, port 0 (no fixed port)
seen = [comm.timeout.total_seconds()]
seen.append(tokenring.init_distributed() is comm and comm.timeout.total_seconds())
seen.append(tokenring.init_distributed(timeout_s=7).timeout.total_seconds())
for kwargs in ({"timeout_s": -1}, {"backend": "fake"}, {"backend": "foo"}):
    try:
        tokenring.init_distributed(**kwargs)
        seen.append("accepted")
    except ValueError as exc:
        seen.append(str(exc))
seen.append(comm.timeout.total_seconds())
tokenring.close_communicators()
dist.destroy_process_group()
print(json.dumps({"cases": found, "seen": seen}))
"""

_MISSING = None  # an unset variable
_ENV_CASES: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    # RANK outside [0, WORLD_SIZE) waited 300 s for a rank 0 that never comes
    ({"RANK": "1"}, {}, "RANK must be an int in [0, WORLD_SIZE) = [0, 1); got RANK='1'"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, {}, "got RANK='-1'"),
    ({"RANK": "x"}, {}, "RANK must be an int in [0, WORLD_SIZE) = [0, 1); got RANK='x'"),
    ({"RANK": _MISSING}, {}, "environment variable RANK is not set; init_distributed reads"),
    ({"WORLD_SIZE": "0"}, {}, "WORLD_SIZE must be an int >= 1; got WORLD_SIZE='0'"),
    ({"WORLD_SIZE": "-2"}, {}, "WORLD_SIZE must be an int >= 1; got WORLD_SIZE='-2'"),
    ({"WORLD_SIZE": "abc"}, {}, "WORLD_SIZE must be an int >= 1; got WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": _MISSING}, {}, "environment variable WORLD_SIZE is not set"),
    ({"MASTER_ADDR": _MISSING}, {}, "environment variable MASTER_ADDR is not set"),
    ({"MASTER_ADDR": " "}, {}, "environment variable MASTER_ADDR is empty"),
    ({"MASTER_PORT": "abc"}, {}, "MASTER_PORT must be a TCP port, an int in [0, 65535]; got"),
    ({"MASTER_PORT": "70000"}, {}, "got MASTER_PORT='70000'"),
    # port 0: rank 0 picks one that no other rank can know
    ({"WORLD_SIZE": "2"}, {}, "MASTER_PORT must be a TCP port, an int in [1, 65535]; got"),
    ({"LOCAL_RANK": "zz"}, {}, "LOCAL_RANK must be an int in [0, WORLD_SIZE) = [0, 1); got"),
    ({"LOCAL_RANK": "1"}, {}, "got LOCAL_RANK='1'"),
    # the backend: an AssertionError "Unknown backend type foo" from inside torch before
    ({}, {"backend": "foo"}, "backend must be one of ['gloo', 'nccl'"),
    ({}, {"backend": 3}, "backend must be one of ['gloo', 'nccl'"),
    # the timeout: a TypeError ("5"), or refused by the communicator after the group existed
    ({}, {"timeout_s": True}, "timeout_s must be a finite number > 0; got True"),
    ({}, {"timeout_s": "5"}, "timeout_s must be a finite number > 0; got '5'"),
    ({}, {"timeout_s": "#nan"}, "timeout_s must be a finite number > 0; got nan"),
    ({}, {"timeout_s": "#inf"}, "timeout_s must be a finite number > 0; got inf"),
    ({}, {"timeout_s": 0}, "timeout_s must be a finite number > 0; got 0"),
    ({}, {"timeout_s": 1e8}, "got 100000000.0 (a number of seconds below 1e7)"),
]
if not torch.cuda.is_available():
    # before: AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'
    _ENV_CASES.append(({}, {"backend": "nccl"}, "backend 'nccl' needs a CUDA GPU"))
    _ENV_CASES.append(({}, {"backend": "cpu:gloo,cuda:nccl"}, "needs a CUDA GPU"))


def test_init_distributed_refuses_a_bad_environment_before_it_waits() -> None:
    cases = [[env, kwargs] for env, kwargs, _ in _ENV_CASES]
    path = os.pathsep.join(p for p in sys.path if p)  # this process's tokenring
    env = {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, "-c", _INIT_CASES, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,  # before: the RANK cases waited out the 300 s store timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    for (env_case, kwargs, words), (kind, message, initialised, took_s) in zip(
        _ENV_CASES, found["cases"], strict=True
    ):
        case = f"{env_case} {kwargs}: {kind}: {message}"
        assert kind == "ValueError" and words in message, case
        assert not initialised, f"{case}: torch.distributed was initialised before refusing"
        assert took_s < 5, f"{case}: took {took_s:.1f} s"
    # initialised: a second call sets the timeout it is given (it used to drop it, and to
    # accept -1), and refuses another backend instead of returning the gloo group's
    timeout, again, later, *refused, last = found["seen"]
    assert (timeout, again, later, last) == (30.0, 30.0, 7.0, 7.0)
    assert "timeout_s must be a finite number > 0; got -1" in refused[0]
    assert (
        "backend 'fake' was asked for, but torch.distributed is initialised already with "
        in (refused[1])
    )
    assert "backend must be one of" in refused[2]


def test_nccl_ranks_without_local_rank_are_refused_where_they_would_share_gpu_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: LOCAL_RANK unset put every rank on GPU 0 (NCCL failed later with "Duplicate GPU
    detected", or ranks shared a GPU). Checked with the visible device count faked: no GPU
    here (the NCCL branch is exercised by scripts/device_check.sh on a GPU)."""
    from tokenring.launch import _launcher_env

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for visible, cuda, expected in ((2, True, None), (1, True, 0), (2, False, 0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=visible: n)
        if expected is None:
            with pytest.raises(ValueError, match="LOCAL_RANK is not set; with NCCL, 2 ranks"):
                _launcher_env(cuda)
        else:  # one visible GPU (a launcher that sets CUDA_VISIBLE_DEVICES per rank), or gloo
            assert _launcher_env(cuda) == expected
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _launcher_env(True) == 1


# -- launch -----------------------------------------------------------------------------------


def _return_arg(x: Any = None) -> Any:
    return x


def test_launch_refuses_bad_backends_timeouts_and_arguments_before_any_rank_starts() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        # before: every rank failed with "AssertionError: Unknown backend type foo"
        ({"backend": "foo"}, "backend must be one of ['gloo', 'nccl'"),
        # before: accepted here, then every rank's communicator refused it ("got 1e8")
        ({"pg_timeout_s": 1e8}, "pg_timeout_s must be a finite number > 0; got 100000000.0"),
        ({"pg_timeout_s": "3"}, "pg_timeout_s must be a finite number > 0; got '3'"),  # TypeError
        ({"timeout_s": True}, "timeout_s must be a finite number > 0; got True"),  # a 1 s deadline
    ]
    if not torch.cuda.is_available():  # before: each rank failed in init_process_group
        cases.append(({"backend": "nccl"}, "backend 'nccl' needs a CUDA GPU"))
    elif torch.cuda.device_count() < 8:
        cases.append(({"backend": "nccl", "world_size": 8}, "runs one rank per GPU; world_size=8"))
    for kwargs, words in cases:
        start = time.monotonic()
        with pytest.raises(ValueError) as info:
            tokenring.launch(_return_arg, **{"world_size": 1, **kwargs})
        assert words in str(info.value), (kwargs, str(info.value))
        assert time.monotonic() - start < 1, kwargs  # no rank was started
    # an argument that does not pickle is named (before: "cannot pickle '_thread.lock' object")
    with pytest.raises(ValueError, match=r"launch's args\[0\] must pickle .* got <unlocked"):
        tokenring.launch(_return_arg, threading.Lock(), world_size=1)
    with pytest.raises(ValueError, match=r"launch's kwargs\['x'\] must pickle"):
        tokenring.launch(_return_arg, world_size=1, x=threading.Lock())


def _leave_a_thread_running() -> int:
    threading.Thread(target=time.sleep, args=(600,), name="left running").start()
    return dist.get_rank()


def test_a_fresh_rank_that_leaves_a_thread_running_returns_its_result() -> None:
    """``rank_env`` starts fresh interpreters, which waited for the thread at exit: the launch
    ran into its deadline (all results in hand) instead of returning."""
    start = time.monotonic()
    got = tokenring.launch(
        _leave_a_thread_running, world_size=1, rank_env=lambda r: {}, timeout_s=60
    )
    assert got == [0]
    assert time.monotonic() - start < 30


class _UnreadableHere:
    """Pickles in the rank; unpickling raises (as a class the launcher cannot import would)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return int, ("not an int",)


def _rank_one_returns_an_unreadable_value() -> Any:
    return _UnreadableHere() if dist.get_rank() == 1 else 0


def test_a_result_the_launcher_cannot_read_names_its_rank() -> None:
    """It was the bare ValueError of int('not an int') out of the launcher, naming no rank."""
    with pytest.raises(LaunchError) as info:
        tokenring.launch(_rank_one_returns_an_unreadable_value, world_size=2, timeout_s=60)
    assert info.value.failed_rank == 1
    assert "its result cannot be unpickled by the launcher: ValueError" in info.value.summary


class _StrFails(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def _raise_an_exception_whose_str_fails() -> None:
    raise _StrFails()


_IMPORT_FAILS_IN_RANKS = """
import multiprocessing
if multiprocessing.current_process().name.startswith("tokenring-rank"):
    raise ImportError("this module refuses to load in a rank")
def rank_fn():
    return 1
"""


def test_a_rank_that_fails_outside_fn_names_its_error_not_an_empty_log(tmp_path: Path) -> None:
    """A rank whose exception's str() raised, or that could not load fn (its module failed
    to import there), ended without a result or a word in its log: the launch blamed a
    script without the main guard ("an empty log")."""
    with pytest.raises(LaunchError) as info:
        tokenring.launch(_raise_an_exception_whose_str_fails, world_size=1, timeout_s=60)
    assert "_StrFails: <str() raised RuntimeError: str() of this exception fails>" in (
        info.value.summary
    )
    (tmp_path / "refuses_ranks.py").write_text(_IMPORT_FAILS_IN_RANKS)
    sys.path.insert(0, str(tmp_path))
    try:
        import refuses_ranks  # type: ignore[import-not-found]

        with pytest.raises(LaunchError) as info:
            tokenring.launch(refuses_ranks.rank_fn, world_size=1, timeout_s=60)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("refuses_ranks", None)
    assert "ImportError: this module refuses to load in a rank" in info.value.summary
    assert "empty log" not in str(info.value)


# -- the communicator ---------------------------------------------------------------------------


def _reductions_and_options() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for shared_memory in (True, False):
        comm = Communicator(timeout_s=30, shared_memory=shared_memory)
        case = f"rank {rank} shared_memory={shared_memory}"
        # a slice: gloo summed the first 6 elements of its storage, wrote them over elements
        # outside the slice, and left its own last rows alone (108, 6 where 108, 112 was due)
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank
        kept = base.clone()
        view = base[:, ::2]
        comm.all_reduce(view, label="slice").wait()
        want = sum(torch.arange(12.0).reshape(3, 4) + 100 * r for r in range(world))
        if not torch.equal(view, want[:, ::2]):
            problems.append(f"{case}: slice reduced to {view.tolist()}")
        if not torch.equal(base[:, 1::2], kept[:, 1::2]):
            problems.append(f"{case}: elements outside the slice changed: {base.tolist()}")
        # ranks whose strides differ: rank 1 passes a transposed view
        mine = torch.arange(6.0).reshape(2, 3) * (rank + 1)
        if rank == 1:
            mine = mine.t().contiguous().t()
        comm.all_reduce(mine, op=dist.ReduceOp.SUM, label="strides").wait()
        total = torch.arange(6.0).reshape(2, 3) * sum(range(1, world + 1))
        if not torch.equal(mine, total):
            problems.append(f"{case}: transposed on rank 1 reduced to {mine.tolist()}")
        # an expanded tensor: gloo read and wrote 4 elements of a 1-element storage
        try:
            comm.all_reduce(torch.ones(1).expand(4), label="expanded").wait()
            problems.append(f"{case}: an expanded tensor was reduced")
        except ValueError as exc:
            if "must not have elements that share memory; got shape (4,)" not in str(exc):
                problems.append(f"{case}: {exc}")
        for dtype in (torch.bool, torch.int8, torch.complex64, torch.bfloat16):
            values = [torch.arange(6.0).reshape(3, 2) * r for r in range(world)]
            x = values[rank].to(dtype).t()  # (2, 3), not contiguous
            op = dist.ReduceOp.MAX if dtype == torch.bool else dist.ReduceOp.SUM
            comm.all_reduce(x, op=op, label=str(dtype)).wait()
            reduced = torch.stack(values).amax(0) if dtype == torch.bool else sum(values)
            if not torch.equal(x, reduced.to(dtype).t()):
                problems.append(f"{case}: {dtype} gave {x.tolist()}")
        empty = torch.zeros(0, 3).t()
        comm.all_reduce(empty, label="empty").wait()
        # all_gather of other shapes or dtypes per rank: gloo aborted the process (SIGABRT)
        for other in (
            torch.zeros(2 + rank, 3),
            torch.zeros(2, 3, dtype=[torch.float32, torch.int64][rank]),
        ):
            try:
                comm.all_gather(other, label="odd")
                problems.append(f"{case}: all_gather of {other.shape} {other.dtype} accepted")
            except ValueError as exc:
                words = "tensor to all-gather ('odd') must have the same shape and dtype on every"
                if words not in str(exc) or "on rank 1" not in str(exc):
                    problems.append(f"{case}: {exc}")
        rows = comm.all_gather(torch.full((2, 3), float(rank)).t(), label="even")
        if [row.tolist() for row in rows] != [[[r] * 2] * 3 for r in range(world)]:
            problems.append(f"{case}: all_gather gave {rows}")
        comm.close()
    # options: a string is truthy, so shared_memory="no" turned the transport on
    for kwargs, words in [
        ({"shared_memory": "no"}, "shared_memory must be True or False or None; got 'no'"),
        ({"stage_through_host": "no"}, "stage_through_host must be True or False or None; got"),
        ({"separate_groups": 1}, "separate_groups must be True or False; got 1"),
        ({"timeout_s": 1e7}, "timeout_s must be a finite number > 0; got 10000000.0 (a number"),
    ]:
        try:
            Communicator(**{"timeout_s": 30, **kwargs})
            problems.append(f"rank {rank}: {kwargs} accepted")
        except ValueError as exc:
            if words not in str(exc):
                problems.append(f"rank {rank}: {kwargs}: {exc}")
    # ranks whose timeouts differ waited under different store keys, each blaming the other
    # at its own timeout ("rank(s) [1] did not arrive within 3 s"); 3 and 3.0 differed too
    start = time.monotonic()
    try:
        Communicator(timeout_s=3 + rank)
        problems.append(f"rank {rank}: timeouts 3 and 4 accepted")
    except ValueError as exc:
        words = "timeout_s must be the same on every rank of a communicator's group; got 3 on "
        if words + "rank 0, 4 on rank 1" not in str(exc):
            problems.append(f"rank {rank}: {exc}")
    if time.monotonic() - start > 2.5:
        problems.append(f"rank {rank}: differing timeouts took {time.monotonic() - start:.1f} s")
    same = Communicator(timeout_s=3 if rank == 0 else 3.0)  # then builds go on as before
    same.barrier(label="3 and 3.0")
    same.close()
    # separate_groups on one rank only: the ranks waited under different keys (on gloo, the
    # rank without separate groups did not wait at all) until the timeout
    for separate in (True, False):
        start = time.monotonic()
        try:
            Communicator(timeout_s=3, separate_groups=separate if rank == 0 else not separate)
            problems.append(f"rank {rank}: separate_groups {separate} and not accepted")
        except ValueError as exc:
            words = "separate_groups must be the same on every rank of a communicator's group; "
            if words + f"got {separate} on rank 0, {not separate} on rank 1" not in str(exc):
                problems.append(f"rank {rank}: {exc}")
        if time.monotonic() - start > 2.5:
            problems.append(f"rank {rank}: separate_groups took {time.monotonic() - start:.1f} s")
    for separate in (False, True):  # builds of either kind go on in step afterwards
        same = Communicator(timeout_s=3, separate_groups=separate)
        same.barrier(label=f"separate_groups={separate}")
        same.close()
    # get_communicator took 1e8 for a communicator that refuses it when built
    comm = tokenring.get_communicator(None)
    try:
        tokenring.get_communicator(comm, timeout_s=1e8)
        problems.append(f"rank {rank}: get_communicator took timeout_s=1e8")
    except ValueError as exc:
        if "timeout_s must be a finite number > 0; got 100000000.0" not in str(exc):
            problems.append(f"rank {rank}: {exc}")
    return problems


def test_all_reduce_of_tensors_that_are_not_contiguous_and_communicator_options() -> None:
    per_rank = tokenring.launch(_reductions_and_options, world_size=2, timeout_s=120)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems)
