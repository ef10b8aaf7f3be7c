"""Lifetimes: communicators go with their groups, ranks go with their launcher, every
collective is bounded by the communicator's timeout, and ranks exit cleanly.

Each test runs real gloo ranks (``tokenring.launch``) or real processes (the CLI, a launcher
that is killed) and checks what is left afterwards: file descriptors, processes, temp files,
the threads alive while Python finalises, exit codes. Outputs are checked against full
attention in float64 (tests/oracle.py) where attention runs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from common import running
from oracle import make_inputs, oracle_with_grads
from tokenring.launch import LaunchError
from tokenring.model.netlab import lab_unavailable_reason

SRC = str(Path(__file__).parents[1] / "src")
TESTS = str(Path(__file__).parent)
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # thread names of a live gloo group
SEQ_LOCAL = 4


def _local_inputs(rank: int, world_size: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """This rank's contiguous shard of seeded q, k, v, dout, and of the causal oracle."""
    q, k, v, dout = make_inputs(
        seed=11, batch=1, seq_global=SEQ_LOCAL * world_size, heads_q=4, heads_kv=2, head_dim=8
    )
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5)
    rows = slice(rank * SEQ_LOCAL, (rank + 1) * SEQ_LOCAL)
    local = [x[:, rows].clone() for x in (q, k, v, dout)]
    return local, {name: x[:, rows] for name, x in ref.items() if name != "lse"}


def _max_error(strategy: str, local: list[torch.Tensor], ref: dict[str, Any], **kw: Any) -> float:
    """Out and dq, dk, dv of one strategy against the oracle, max abs error."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in local[:3])
    out = tokenring.sequence_parallel_attn(q, k, v, strategy=strategy, causal=True, **kw)
    out.backward(local[3])
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return max((got[name] - ref[name]).abs().max().item() for name in ref)


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # it may end meanwhile
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return names


def _rank_pids(launcher_pid: int) -> list[int]:
    """PIDs of the ranks ``tokenring.launch`` started from ``launcher_pid``: its descendants
    named ``tokenring-rN`` (a fresh interpreter is the launcher's child, a forked rank the
    zygote's)."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        names[int(entry)] = stat[stat.index("(") + 1 : stat.rindex(")")]

    def descends(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == launcher_pid:
                return True
        return False

    return [pid for pid, name in names.items() if name.startswith("tokenring-r") and descends(pid)]


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _env(tmp: Path) -> dict[str, str]:
    """Environment for a child: this tree's sources, temp files under ``tmp``."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), "TMPDIR": str(tmp)}


# -- item: communicators are released with their groups ---------------------------------------


def group_cycles(num_cycles: int) -> dict[str, Any]:
    """new_group -> attention (ring P2P and a collective) -> destroy, ``num_cycles`` times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local, ref = _local_inputs(rank, world)
    fds, errors = [], []
    for _ in range(num_cycles):
        group = dist.new_group(list(range(world)))
        for strategy in ("token_ring", "ulysses"):
            errors.append(_max_error(strategy, local, ref, group=group))
        dist.destroy_process_group(group)
        # every rank is done with the group's messages; the next lookup closes its
        # communicator (Note [Communicator cache]): what it held is let go at once
        gc.collect()
        dist.barrier()
        tokenring.get_communicator()
        gc.collect()
        fds.append(_num_fds())
    comm = tokenring.Communicator(timeout_s=30)
    errors.append(_max_error("token_ring", local, ref, group=comm))
    comm.close()
    try:
        tokenring.token_ring_attn(*local[:3], group=comm)
        closed = "no error"
    except RuntimeError as exc:
        closed = str(exc)
    return {"fds": fds, "error": max(errors), "closed": closed}


def test_cache_forgets_destroyed_groups(single_rank_group: None) -> None:
    group = dist.new_group([0])
    comm = tokenring.get_communicator(group)
    assert tokenring.get_communicator(group) is comm
    assert tokenring.get_communicator(group, timeout_s=7).timeout.total_seconds() == 7
    with pytest.raises(ValueError, match="timeout_s must be a finite number > 0; got nan"):
        tokenring.get_communicator(group, timeout_s=float("nan"))
    dist.destroy_process_group(group)
    assert not comm.group_alive and not comm.closed
    tokenring.get_communicator()  # any lookup closes the communicators of destroyed groups
    assert comm.closed
    assert group not in tokenring.api._COMMUNICATORS  # and forgets them
    with pytest.raises(RuntimeError, match=r"rank 0: this Communicator of group .* was closed"):
        comm.barrier(label="after close")


def test_close_communicators_releases_every_cached_one(single_rank_group: None) -> None:
    """Release (2) of Note [Communicator cache]; init_distributed returns the cached one."""
    default = tokenring.init_distributed()  # initialised already: returns the cached one
    assert default is tokenring.get_communicator() and not default.closed
    group = dist.new_group([0])
    comm = tokenring.get_communicator(group)
    tokenring.close_communicators()
    assert comm.closed and default.closed and not tokenring.api._COMMUNICATORS
    fresh = tokenring.get_communicator(group)  # the group lives: a new one on the next lookup
    assert fresh is not comm and not fresh.closed
    fresh.barrier(label="after close_communicators")
    dist.destroy_process_group(group)


def test_close_communicators_clears_torch_defaults_that_hold_a_group(
    single_rank_group: None,
) -> None:
    """Note [Groups in default arguments] in tokenring.runtime.comm: a default naming the
    default group or a destroyed one becomes None; one naming a live group, and functions
    outside torch, are kept."""
    live, destroyed = dist.new_group([0]), dist.new_group([0])
    dist.destroy_process_group(destroyed)
    world = dist.group.WORLD
    code = "def f(a=1, g=None, h=None, i=None, *, k=None): pass"
    functions = {}
    for module in ("torch.tokenring_test", "user_code"):
        namespace: dict[str, Any] = {"__name__": module}
        exec(code, namespace)
        fn = namespace["f"]
        fn.__defaults__ = (1, world, live, destroyed)
        fn.__kwdefaults__ = {"k": world}
        functions[module] = fn
    tokenring.close_communicators()
    ours, theirs = functions["torch.tokenring_test"], functions["user_code"]
    assert ours.__defaults__[0] == 1 and ours.__defaults__[2] is live
    assert ours.__defaults__[1] is None and ours.__defaults__[3] is None
    assert ours.__kwdefaults__ == {"k": None}
    assert theirs.__defaults__ == (1, world, live, destroyed)
    assert theirs.__kwdefaults__ == {"k": world}
    dist.destroy_process_group(live)


def test_collectives_of_one_rank(single_rank_group: None) -> None:
    comm = tokenring.get_communicator()
    for x in (torch.tensor(3.0), torch.arange(6).view(2, 3), torch.empty(0)):
        (got,) = comm.all_gather(x, label="one rank")
        assert torch.equal(got, x)
    total = torch.tensor([2.0])
    comm.all_reduce(total, label="one rank").wait()
    assert total.item() == 2.0
    comm.barrier(label="one rank")
    assert comm.all_gather_object({"rows": [1, 2]}, what="one rank") == [{"rows": [1, 2]}]


def gather_objects() -> list[Any]:
    rank = dist.get_rank()
    comm = tokenring.get_communicator()
    # sizes differ by rank (the frames take the largest); rank 1's is empty
    mine = {"rank": rank, "rows": list(range(5000 * rank))} if rank != 1 else b""
    before = comm.counter.total_sent()
    gathered = comm.all_gather_object(mine, what="test objects")
    assert comm.counter.total_sent() == before  # control data, not the strategies' traffic
    return gathered


def test_all_gather_object_returns_every_ranks_object_in_rank_order() -> None:
    results = tokenring.launch(gather_objects, world_size=3, timeout_s=120)
    want = [{"rank": 0, "rows": []}, b"", {"rank": 2, "rows": list(range(10000))}]
    assert results == [want] * 3


def test_communicators_go_with_their_groups() -> None:
    # Before: each cycle left its communicator's four channel groups (and the destroyed
    # group itself) alive, about 25 descriptors per rank per cycle.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    # 25 cycles: a leak of one descriptor per cycle shows as 24 (100 cycles cost 4 s more).
    results = tokenring.launch(group_cycles, 25, world_size=2, timeout_s=300)
    # launch's own handlers (main thread only) are gone again
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    for rank, got in enumerate(results):
        assert got["error"] < 1e-10, (rank, got["error"])
        fds = got["fds"]
        assert fds[-1] == fds[0], f"rank {rank}: descriptors after each of 25 cycles: {fds}"
        assert "this Communicator of group" in got["closed"], got["closed"]
        assert "was closed" in got["closed"], got["closed"]


# -- item: collectives are bounded by the communicator's timeout ------------------------------


COLLECTIVE_TIMEOUT_S = 1.0  # the communicators' in late_rank; the group's is 90 s


def late_rank(strategy: str, marker: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank builds the communicators first (that makes their groups, with all of them),
    # with a timeout long enough for ranks that start apart; then the call's short one.
    if strategy == "hybrid":  # the inner all-to-all, on a 1 x 2 mesh
        mesh = tokenring.hybrid_mesh(1, world)
        comms = [tokenring.get_communicator(g, timeout_s=30) for g in (mesh.inner, mesh.outer)]
    else:
        comms = [comm := tokenring.Communicator(timeout_s=30)]
    for built in comms:
        built.timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    local, _ = _local_inputs(rank, world)
    if rank == 1:
        # frozen before the call until rank 0 has failed and ended (60 s at most); then it
        # returns, which spares the launcher's grace for its report (3 s)
        _wait_for(lambda: Path(marker).exists(), 60, "rank 0 to fail")
        _wait_for(lambda: not running(int(Path(marker).read_text() or 0)), 60, "rank 0 to end")
        return
    start = time.monotonic()
    try:
        if strategy == "hybrid":
            tokenring.hybrid_attn(*local[:3], mesh=mesh, causal=True, check_ranks=False)
        else:
            tokenring.ulysses_attn(*local[:3], causal=True, group=comm, check_ranks=False)
    except RuntimeError as exc:
        Path(marker + ".tmp").write_text(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        raise RuntimeError(f"failed after {time.monotonic() - start:.1f} s: {exc}") from None


# Ulysses and the hybrid's inner all-to-all post their schedules' messages: the first one
# they wait for
_MESSAGE_TIMEOUT = (
    r"receive of 'q' rows \(0, [0-9]+\) of owner 1 from rank 1 at step 0 failed \(peer "
    rf"failed, mismatched, or slower than {COLLECTIVE_TIMEOUT_S:g} s\)"
)


LATE_RANK_STRATEGIES = ["ulysses", "hybrid"]


def _late_rank_launch(strategy: str, marker: str) -> BaseException | None:
    try:
        tokenring.launch(late_rank, strategy, marker, world_size=2, timeout_s=120, pg_timeout_s=90)
    except BaseException as exc:
        return exc
    return None


@pytest.fixture(scope="module")
def late_rank_launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each strategy's launch of late_rank (what it raised), both at once: each is rank 0
    waiting out the communicator's 1 s while rank 1 waits for it, so neither needs the cores."""
    tmp = tmp_path_factory.mktemp("late_rank")
    with ThreadPoolExecutor(max_workers=len(LATE_RANK_STRATEGIES)) as pool:
        done = {
            strategy: pool.submit(_late_rank_launch, strategy, str(tmp / f"{strategy}-rank0"))
            for strategy in LATE_RANK_STRATEGIES
        }
        return {strategy: future.result() for strategy, future in done.items()}


@pytest.mark.parametrize("strategy", LATE_RANK_STRATEGIES)
def test_collective_times_out_with_the_communicator_not_the_group(
    strategy: str, late_rank_launches: dict[str, Any]
) -> None:
    error = late_rank_launches[strategy]
    assert isinstance(error, LaunchError), error
    assert error.failed_rank == 0
    message = str(error)
    match = re.search(rf"failed after ([0-9.]+) s: rank 0: {_MESSAGE_TIMEOUT}", message)
    assert match is not None, message
    # The communicator's 1 s, not the group's 90 s (nor rank 1's wait, up to 60 s).
    assert COLLECTIVE_TIMEOUT_S <= float(match[1]) < 15.0, message


# -- item: clean exit after the collective strategies -----------------------------------------


def _record_threads(path: str) -> None:
    Path(path).write_text(json.dumps(_thread_names()))


def strategies_then_exit(strategies: list[str], threads_dir: str) -> float:
    """Run each strategy forward and backward; at exit (after the launcher's teardown, while
    Python finalises) write the names of this process's threads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local, ref = _local_inputs(rank, world)
    error = max(_max_error(strategy, local, ref) for strategy in strategies)
    atexit.register(_record_threads, os.path.join(threads_dir, f"rank{rank}.json"))
    return error


def _launch_and_check_exit(strategies: list[str], world_size: int, tmp: Path) -> None:
    tmp.mkdir()
    # launch fails when a rank exits with a nonzero code or a signal after its result.
    errors = tokenring.launch(
        strategies_then_exit, strategies, str(tmp), world_size=world_size, timeout_s=180
    )
    assert max(errors) < 1e-10, errors
    for rank in range(world_size):
        threads = json.loads((tmp / f"rank{rank}.json").read_text())
        alive = [name for name in threads if name in GLOO_THREADS]
        assert not alive, f"rank {rank}: gloo threads alive at interpreter exit: {threads}"


def test_collectives_exit_cleanly(tmp_path: Path) -> None:
    # Before: the communicator cache kept the default group (and its channel groups) alive
    # past destroy_process_group, so their gloo threads were alive while Python finalised;
    # one still holding a finished collective's tensors aborted the rank (SIGABRT,
    # "terminate called without an active exception"), which launch did not notice.
    for world_size in (2, 3):
        _launch_and_check_exit(["ulysses", "allgather_kv"], world_size, tmp_path / str(world_size))


@pytest.mark.stress
@pytest.mark.timeout(3600)
def test_every_strategy_exits_cleanly_50_times(tmp_path: Path) -> None:
    strategies = ["token_ring", "ring", "bidir_ring", "ulysses", "allgather_kv"]
    for i in range(50):
        _launch_and_check_exit(strategies, 2 + i % 3, tmp_path / str(i))


_USER_SCRIPT = """
import atexit, json, os, sys
from pathlib import Path
# Registered first, so it runs last: after tokenring's own exit hook.
names = lambda: [Path(f"/proc/self/task/{t}/comm").read_text().strip()
                 for t in os.listdir("/proc/self/task")]
atexit.register(lambda: Path(sys.argv[3]).write_text(json.dumps([during, names()])))
IMPORTS
rank, world = int(sys.argv[1]), 2
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], world), rank=rank,
                        world_size=world)
AFTER_INIT
q, k, v = (torch.randn(1, 4, 4, 8) for _ in range(3))
for strategy in ("ulysses", "allgather_kv", "token_ring"):
    tokenring.sequence_parallel_attn(q, k, v, strategy=strategy, causal=True)
during = names()
dist.destroy_process_group()
"""


_TORCH_FIRST = "import torch, torch.distributed as dist, tokenring"
_TOKENRING_FIRST = """import tokenring
assert "torch" not in sys.modules  # the package is lazy (Note [Lazy package] in tokenring)
import torch, torch.distributed as dist"""
# the library, and torch._dynamo with it, is loaded by the first call, after init
_NOT_LOADED_YET = 'assert "tokenring.api" not in sys.modules and "torch._dynamo" not in sys.modules'


@pytest.mark.parametrize(
    ("imports", "after_init"),
    [
        (_TORCH_FIRST, ""),
        (_TOKENRING_FIRST, _NOT_LOADED_YET),
        # a torch module whose functions take group=dist.group.WORLD as a default argument,
        # evaluated at import: imported now, it holds the default group (Note [Groups in
        # default arguments] in tokenring.runtime.comm)
        (_TORCH_FIRST, "import torch.distributed.fsdp.sharded_grad_scaler"),
    ],
    ids=["torch-first", "tokenring-first-loaded-after-init", "torch-binds-the-group-after-init"],
)
def test_user_program_exits_cleanly(tmp_path: Path, imports: str, after_init: str) -> None:
    """A program that owns its process group and destroys it: tokenring's exit hook releases
    the rest before Python finalises, whether the library was loaded before or after the
    group was made."""
    # Before (torch-binds-the-group-after-init; tokenring-first with a lazy package): the
    # default group's gloo_tcp_loop and two pt_gloo_runloop threads were alive at exit on
    # both ranks.
    script = _USER_SCRIPT.replace("IMPORTS", imports).replace("AFTER_INIT", after_init)
    env = {**_env(tmp_path / "tmp"), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-c", script, str(rank)),
                *(str(tmp_path / "store"), str(tmp_path / f"threads{rank}.json")),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"rank {rank}: exit code {proc.returncode}\n{err}"
            during, threads = json.loads((tmp_path / f"threads{rank}.json").read_text())
            assert set(GLOO_THREADS) <= set(during), f"rank {rank}: no gloo threads: {during}"
            alive = [name for name in threads if name in GLOO_THREADS]
            assert not alive, f"rank {rank}: gloo threads alive at interpreter exit: {threads}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


# -- item: ranks and temp files go with the launcher -------------------------------------------


def _bench_argv(*extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "tokenring", "bench", "--world-size", "2", "--seq", "16"),
        *("--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--strategies", "ring"),
        *("--causal", "yes", "--passes", "fwd", "--warmup", "0", "--iters", "1000000"),
        *extra,
    ]


def _lab_namespaces(owner_pid: int) -> list[str]:
    try:
        names = os.listdir("/var/run/netns")
    except FileNotFoundError:
        return []
    return [name for name in names if name.startswith(f"tokenring-{owner_pid}-")]


def _start_bench(tmp: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _bench_argv(*extra),
        env=_env(tmp),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_launcher(tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _LAUNCHER_SCRIPT], env=_env(tmp), text=True)


@pytest.fixture(scope="module")
def started_launchers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[str], Path]]]:
    """The bench that test_sigterm_to_bench_ends_ranks_and_removes_temp_files[None] ends and
    the launcher that test_ranks_die_with_a_killed_launcher kills, started together: each
    waits on nothing but its interpreters' imports (a few seconds of one core), so on 2 cores
    the two start in the time of one. Each test does the rest with its own; what a test did
    not end is killed here, with its ranks."""
    tmp = {name: tmp_path_factory.mktemp(name) / "tmp" for name in ("bench", "launcher")}
    procs = {"bench": _start_bench(tmp["bench"]), "launcher": _start_launcher(tmp["launcher"])}
    try:
        yield {name: (proc, tmp[name]) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            ranks = _rank_pids(proc.pid)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            _kill_leftovers(ranks)


@pytest.mark.parametrize("link", [None, pytest.param("1gbit", marks=pytest.mark.lab)])
def test_sigterm_to_bench_ends_ranks_and_removes_temp_files(
    tmp_path: Path, link: str | None, request: pytest.FixtureRequest
) -> None:
    # Before: without the lab the ranks (in sessions of their own) kept computing and both
    # temp dirs stayed; with the lab, whose handler ended the process, the dirs stayed.
    if link is not None and (reason := lab_unavailable_reason()) is not None:
        pytest.skip(reason)
    if link is None:
        proc, tmp = request.getfixturevalue("started_launchers")["bench"]
    else:
        tmp = tmp_path / "tmp"
        proc = _start_bench(tmp, "--link", link)
    ranks: list[int] = []
    try:
        _wait_for(lambda: len(_rank_pids(proc.pid)) == 2, 120, "the bench to start 2 ranks")
        ranks = _rank_pids(proc.pid)
        assert any(tmp.iterdir()), "the bench made no temp files to remove"
        assert bool(_lab_namespaces(proc.pid)) == bool(link)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        # the kernel kills them at once; 30 s leaves room for a loaded box (10 s failed once
        # with other test runs beside it), far below the ranks' 600 s sleep
        _wait_for(lambda: not any(running(pid) for pid in ranks), 30, f"ranks {ranks} to end")
        assert not list(tmp.iterdir()), f"left behind: {list(tmp.iterdir())}"
        assert not _lab_namespaces(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _kill_leftovers(ranks)


def sleep_long() -> None:
    time.sleep(600)


_LAUNCHER_SCRIPT = """
import sys, tokenring, test_lifecycle
tokenring.launch(test_lifecycle.sleep_long, world_size=2, timeout_s=900)
"""


def test_ranks_die_with_a_killed_launcher(
    started_launchers: dict[str, tuple[subprocess.Popen[str], Path]],
) -> None:
    # Before: SIGKILL of the launcher left both ranks running (for the 600 s sleep).
    proc, _ = started_launchers["launcher"]
    ranks: list[int] = []
    try:
        _wait_for(lambda: len(_rank_pids(proc.pid)) == 2, 120, "the launcher to start 2 ranks")
        ranks = _rank_pids(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        # the kernel kills them at once; 30 s leaves room for a loaded box (10 s failed once
        # with other test runs beside it), far below the ranks' 600 s sleep
        _wait_for(lambda: not any(running(pid) for pid in ranks), 30, f"ranks {ranks} to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _kill_leftovers(ranks)


def _return_one() -> int:
    return 1


@pytest.mark.parametrize("name", ["timeout_s", "pg_timeout_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_launch_rejects_timeouts_that_are_not_finite_and_positive(name: str, value: float) -> None:
    # nan used to pass (nan <= 0 is False) and disabled the deadline.
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0; got {value}"):
        tokenring.launch(_return_one, world_size=1, **{name: value})


# -- item: a forked rank sees the launcher as it is at the launch (Note [Rank start]) -----------


def _what_the_rank_sees(name: str, path_entry: str) -> tuple[str | None, bool, str, int]:
    comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip() if sys.platform == "linux" else ""
    return os.environ.get(name), path_entry in sys.path, comm, os.getppid()


def test_forked_ranks_get_the_launchers_environment_and_path_of_each_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote starts at the first launch; what the launcher sets after that (a variable,
    a sys.path entry) still reaches the ranks of the next launch, and each rank is named."""
    tokenring.launch(_return_one, world_size=2)  # the zygote exists from here on
    monkeypatch.setenv("TOKENRING_TEST_LATE_VARIABLE", "set after the zygote")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = tokenring.launch(
        _what_the_rank_sees, "TOKENRING_TEST_LATE_VARIABLE", str(tmp_path), world_size=2
    )
    for rank, (value, on_path, comm, parent) in enumerate(seen):
        assert value == "set after the zygote", (rank, value)
        assert on_path, rank
        if sys.platform == "linux":
            assert comm == f"tokenring-r{rank}", comm
            assert parent != os.getpid(), "forked by the zygote, not started by the launcher"


def test_a_script_without_the_main_guard_is_named_not_an_empty_log(tmp_path: Path) -> None:
    """A forked rank re-runs the main script before its log opens (multiprocessing does): a
    script calling launch at top level got "exited with code 1 ...; log tail:" and nothing.
    The same script with the guard runs. (The two scripts run at once: each waits on its
    interpreters' imports.)"""
    (tmp_path / "rank_fn.py").write_text("def f():\n    return 7\n")
    call = "print(tokenring.launch(rank_fn.f, world_size=2))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), SRC]))
    procs = {}
    for name, body in (
        ("guarded", f'if __name__ == "__main__":\n    {call}\n'),
        ("unguarded", call + "\n"),
    ):
        (tmp_path / f"{name}.py").write_text("import rank_fn\nimport tokenring\n" + body)
        procs[name] = subprocess.Popen(
            [sys.executable, f"{name}.py"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        out, err = procs["guarded"].communicate(timeout=120)
        assert procs["guarded"].returncode == 0 and out.strip() == "[7, 7]", err[-2000:]
        _, err = procs["unguarded"].communicate(timeout=120)
        assert procs["unguarded"].returncode != 0
        assert "launch was called while a new rank re-ran the main script" in err
        assert "without a result and an empty log; it failed before its log opened" in err
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_the_deadline_is_reported_as_given() -> None:
    """timeout_s=0.5 was reported as "deadline of 0 s passed" (``:.0f``)."""
    with pytest.raises(LaunchError, match=r"deadline of 0\.5 s passed; ranks \[0\]") as info:
        tokenring.launch(sleep_long, world_size=1, timeout_s=0.5)
    assert info.value.failed_rank is None
