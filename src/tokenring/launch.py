"""Spawning a gloo (or NCCL) process group on one machine, with deadlines and root causes.

This module owns the worker processes of tests, the demo and the benchmark: each rank is a
process, forked from a warm zygote or a fresh interpreter (Note [Rank start]); rendezvous
goes through a FileStore in a private temp dir, every process group gets a timeout, and an
outer deadline kills every worker. When a rank fails, the others get 3 s to report their own
errors and are then ended; the error names the rank that failed *first*, with its own
traceback.

Nothing outlives a launch: SIGTERM and SIGHUP become ``SystemExit(128 + signum)`` while
``launch`` runs (SIGINT: KeyboardInterrupt), so every ``finally`` ends the ranks and removes
the temp dir; a launcher killed outright takes its ranks with it (``PR_SET_PDEATHSIG``). A rank
that succeeded tears down in order (Note [Clean exit]); one that returned its result but then
exited with an error or a signal fails the launch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from tokenring.api import close_communicators, get_communicator
from tokenring.runtime.comm import Communicator, check_timeout_s, destroy_idle_groups

__all__ = ["LaunchError", "init_distributed", "launch"]


class LaunchError(RuntimeError):
    """A launched rank failed or the deadline passed; the message names the root cause.

    Attributes:
        failed_rank: the rank that failed first; None when the deadline passed.
        remote_traceback: that rank's own error (its traceback, or how it ended and its log).
        summary: the root cause in one line, e.g. ``rank 1 failed first: ValueError: ... (at
            file.py:12 in fn)`` or ``deadline of 0.5 s passed; ranks [0] had not finished
            and were killed`` (what a command line prints).
    """

    def __init__(
        self,
        message: str,
        *,
        failed_rank: int | None,
        remote_traceback: str = "",
        summary: str = "",
    ) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.remote_traceback = remote_traceback
        self.summary = summary or message.splitlines()[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    world_size: int
    backend: str
    store_path: str
    pg_timeout_s: float
    threads: int


class _ForkedProc:
    """A rank forked by the zygote, behind the ``subprocess.Popen`` methods the launcher uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None, "started"
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


_Proc: TypeAlias = "subprocess.Popen[bytes] | _ForkedProc"
"""A rank's process: started fresh, or forked by the zygote."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Rank:
    rank: int
    proc: _Proc
    log_path: str


@dataclass(slots=True)
class _Outcome:
    ok: bool
    value: Any = None
    error: str = ""
    failed_at_s: float = 0.0
    summary: str = ""  # the error in one line: "ValueError: ... (at file.py:12 in fn)"


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> Communicator:
    """Initialise the default process group from the launcher's environment (torchrun: RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), with a timeout: NCCL when CUDA is
    available, else gloo, unless ``backend`` is given; the CUDA device from LOCAL_RANK (which
    NCCL needs with several ranks and several visible GPUs).

    Args:
        backend: torch's name of one (``"gloo"``, ``"nccl"``) or device:backend pairs
            (``"cpu:gloo,cuda:nccl"``); None: as above.
        timeout_s: the default group's timeout and its communicator's (default 300 s).

    Returns:
        The default group's communicator (Note [Communicator cache] in tokenring.api), with
        this timeout. When torch.distributed is initialised already: that communicator, its
        timeout set to ``timeout_s`` when one is given.

    Raises:
        ValueError: ``timeout_s`` not a number of seconds > 0 (below 1e7); ``backend``
            unknown or not available here (NCCL without a CUDA GPU), or, initialised already,
            not the one running; an environment variable missing or not a valid value (named,
            with its value). Nothing is initialised then.
    """
    if timeout_s is not None:
        check_timeout_s(timeout_s)
    names = None if backend is None else _check_backend(backend)
    if dist.is_initialized():
        running = str(dist.get_backend())
        if names is not None and not set(names) <= set(_backend_names(running)):
            raise ValueError(
                f"backend {backend!r} was asked for, but torch.distributed is initialised "
                f"already with {running!r}"
            )
        return get_communicator(None, timeout_s=timeout_s)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        names = [backend]
    assert names is not None
    local_rank = _launcher_env("nccl" in names)
    if "nccl" in names:
        torch.cuda.set_device(local_rank)
    seconds = 300.0 if timeout_s is None else timeout_s
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=seconds))
    return get_communicator(None, timeout_s=seconds)  # group=None calls run on it


_ENV_HINT = (
    "init_distributed reads the launcher's environment: torchrun sets RANK, WORLD_SIZE, "
    "LOCAL_RANK, MASTER_ADDR and MASTER_PORT (or initialise torch.distributed yourself first)"
)


def _env_int(name: str, low: int, high: int, expected: str, default: int | None = None) -> int:
    """The environment variable ``name`` as an int in [low, high]; ``default`` when unset
    (None: it must be set)."""
    raw = os.environ.get(name)
    if raw is None:
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set; {_ENV_HINT}")
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"environment variable {name} must be {expected}; got {name}={raw!r}")
    return value


def _launcher_env(cuda: bool) -> int:
    """Check what env:// rendezvous reads before it waits on it (a rank outside the world
    waited for a peer that never comes); this rank's LOCAL_RANK (0 when unset, which NCCL
    allows only with one visible GPU or one rank).

    Raises:
        ValueError: a variable missing or out of range, named with its value.
    """
    world_size = _env_int("WORLD_SIZE", 1, 2**31 - 1, "an int >= 1")
    _env_int("RANK", 0, world_size - 1, f"an int in [0, WORLD_SIZE) = [0, {world_size})")
    address = os.environ.get("MASTER_ADDR")
    if address is None or not address.strip():
        what = "is not set" if address is None else "is empty"
        raise ValueError(f"environment variable MASTER_ADDR {what}; {_ENV_HINT}")
    # port 0 lets rank 0 pick one, which no other rank could know
    low = 0 if world_size == 1 else 1
    _env_int("MASTER_PORT", low, 65535, f"a TCP port, an int in [{low}, 65535]")
    expected = f"an int in [0, WORLD_SIZE) = [0, {world_size})"
    if cuda and world_size > 1 and torch.cuda.device_count() > 1 and "LOCAL_RANK" not in os.environ:
        # every rank would take GPU 0 (NCCL fails later: "Duplicate GPU detected")
        raise ValueError(
            f"environment variable LOCAL_RANK is not set; with NCCL, {world_size} ranks and "
            f"{torch.cuda.device_count()} visible CUDA devices it names this rank's GPU "
            "(without it every rank would take GPU 0); " + _ENV_HINT
        )
    local_rank = _env_int("LOCAL_RANK", 0, world_size - 1, expected, default=0)
    if cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"environment variable LOCAL_RANK must name a visible CUDA device for NCCL, an int "
            f"in [0, {torch.cuda.device_count()}); got LOCAL_RANK={local_rank} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return local_rank


def _backend_names(backend: str) -> list[str]:
    """The backends in torch's spelling of one: ``"cpu:gloo,cuda:nccl"`` -> gloo, nccl."""
    return [part.strip().rpartition(":")[2] for part in backend.lower().split(",")]


def _check_backend(backend: object) -> list[str]:
    """The backends ``backend`` names, once torch knows each and this machine can run it.

    Raises:
        ValueError: naming ``backend`` and what was expected.
    """
    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f"backend must be one of {known} as a str; got {backend!r}")
    names = _backend_names(backend)
    for name in names:
        if name not in known:
            raise ValueError(
                f"backend must be one of {known}, or device:backend pairs such as "
                f"'cpu:gloo,cuda:nccl'; got {backend!r}"
            )
    if "nccl" in names and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError(
            f"backend {backend!r} needs a CUDA GPU and a torch built with NCCL; here "
            f"torch.cuda.is_available() is {torch.cuda.is_available()} (torch "
            f"{torch.__version__}); CPU ranks use 'gloo'"
        )
    built = {
        "gloo": dist.is_gloo_available,
        "mpi": dist.is_mpi_available,
        "ucc": dist.is_ucc_available,
        "xccl": getattr(dist, "is_xccl_available", lambda: True),
    }
    for name in names:
        if name in built and not built[name]():
            raise ValueError(
                f"backend {backend!r}: this torch ({torch.__version__}) has no {name} built in"
            )
    return names


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 30.0,
    backend: str = "gloo",
    threads_per_rank: int | None = None,
    wrap_command: Callable[[int, list[str]], list[str]] | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    register_pid: Callable[[int], None] | None = None,
    poll: Callable[[], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes joined in a process group
    (Note [Rank start]). ``fn`` must be a module-level function; inside it
    ``torch.distributed`` is initialised.

    Args:
        fn: the function each rank runs (module-level, so that it pickles).
        args, kwargs: its arguments, the same for every rank (they must pickle).
        world_size: the number of ranks.
        timeout_s: outer deadline for the whole run; every worker is killed past it.
        pg_timeout_s: timeout of the process group (each collective or P2P wait).
        backend: the process group's backend; ``"nccl"``: rank r on CUDA device r.
        threads_per_rank: torch intra-op threads per rank; default cpu_count // world_size.
        wrap_command: turns a worker's argv into the argv to start (e.g. ``ip netns exec``).
        rank_env: extra environment per rank (e.g. GLOO_SOCKET_IFNAME).
        register_pid: called with each worker's PID (e.g. so a lab can end it on tear-down).
        poll: called about every 20 ms while waiting (e.g. to update a progress bar).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        ValueError: world_size or threads_per_rank not an int >= 1; a timeout not a number
            of seconds > 0 (below 1e7); backend unknown or not available here (NCCL: one GPU
            per rank); fn, args or kwargs that do not pickle (named).
        RuntimeError: called by a rank re-running the main script (it lacks the
            ``if __name__ == "__main__":`` guard).
        LaunchError: a rank raised or died (message: the first failing rank's traceback), or
            the deadline passed (message: which ranks had not finished, and their log tails).
    """
    _check_launch(fn, world_size, threads_per_rank, backend, timeout_s, pg_timeout_s)
    ranks: list[_Rank] = []  # filled as they start, so that a signal mid-way ends those
    with _signals_end_the_run():
        workdir = tempfile.mkdtemp(prefix="tokenring-launch-")
        try:
            spec = _Spec(
                fn=fn,
                args=args,
                kwargs=kwargs,
                world_size=world_size,
                backend=backend,
                store_path=os.path.join(workdir, "store"),
                pg_timeout_s=pg_timeout_s,
                threads=threads_per_rank or max(1, (os.cpu_count() or 1) // world_size),
            )
            _start(spec, workdir, wrap_command, rank_env, register_pid, ranks)
            return _collect(ranks, workdir, timeout_s, poll)
        finally:
            _end(ranks)
            shutil.rmtree(workdir, ignore_errors=True)


def _check_launch(
    fn: Any,
    world_size: int,
    threads: int | None,
    backend: str,
    timeout_s: float,
    pg_timeout_s: float,
) -> None:
    """:func:`launch`'s ValueErrors."""
    for name, size in (("world_size", world_size), ("threads_per_rank", threads)):
        if size is None and name == "threads_per_rank":
            continue
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(
                f"{name} must be >= 1; got {size!r} (a {type(size).__name__}, not an int)"
            )
        if size < 1:
            raise ValueError(f"{name} must be >= 1; got {size}")
    check_timeout_s(timeout_s, "timeout_s")
    check_timeout_s(pg_timeout_s, "pg_timeout_s")  # the ranks' communicators take it
    if "nccl" in _check_backend(backend) and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend {backend!r} runs one rank per GPU; world_size={world_size} but "
            f"{torch.cuda.device_count()} CUDA devices are visible (ranks that share a GPU run "
            "over backend='gloo': Note [Staged path] in tokenring.runtime.comm)"
        )
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"fn must be importable by the worker processes; got {fn!r} defined in __main__ "
            "(move it into a module)"
        )
    importing = sys.modules.get("__mp_main__")
    if importing is not None and importing is not sys.modules.get("__main__"):
        raise RuntimeError(_RERUN_MAIN)


_RERUN_MAIN = (
    "tokenring.launch was called while a new rank re-ran the main script: ranks start as "
    "multiprocessing starts its children, which import the main script again, so a script "
    'that calls launch when it runs must do so under `if __name__ == "__main__":`'
)
_EMPTY_LOG = (
    "it failed before its log opened, so its error is on this process's stderr (a script "
    'that calls launch without `if __name__ == "__main__":` does that: each rank re-runs it)'
)


_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """While the block runs (main thread), SIGTERM and SIGHUP raise ``SystemExit(128 +
    signum)`` so its ``finally`` clauses run; a Python handler installed before runs instead
    (a ``netlab.Lab`` tears down and exits itself), an ignored signal stays ignored, and the
    previous handlers are back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread; PR_SET_PDEATHSIG still holds
        return
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        for other, handler in previous.items():
            signal.signal(other, handler)  # a second signal acts at once
        prior = previous[signum]
        if callable(prior):
            prior(signum, frame)
            return
        print(
            f"tokenring.launch: {signal.Signals(signum).name}: ending the ranks and removing "
            "temporary files",
            file=sys.stderr,
        )
        raise SystemExit(128 + signum)

    for signum in _ENDING_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is signal.SIG_IGN or handler is None:
            continue  # ignored, or owned by non-Python code: leave it alone
        previous[signum] = handler
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for ending, handler in previous.items():
            if signal.getsignal(ending) is on_signal:
                signal.signal(ending, handler)


def _start(
    spec: _Spec,
    workdir: str,
    wrap_command: Callable[[int, list[str]], list[str]] | None,
    rank_env: Callable[[int], dict[str, str]] | None,
    register_pid: Callable[[int], None] | None,
    ranks: list[_Rank],
) -> None:
    spec_path = os.path.join(workdir, "spec.pkl")
    try:
        data = pickle.dumps(spec)
    except Exception as exc:
        raise ValueError(_unpicklable(spec, exc)) from exc
    with open(spec_path, "wb") as f:
        f.write(data)
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in base_env:
        base_env["GLOO_SOCKET_IFNAME"] = "lo"
    forked = wrap_command is None and rank_env is None and _zygote_can_fork()
    for rank in range(spec.world_size):
        log_path = os.path.join(workdir, f"rank{rank}.log")
        proc: _Proc
        if forked:
            proc = _fork_rank(spec_path, rank, log_path, base_env)
        else:
            argv = [sys.executable, "-c", _WORKER_CODE, spec_path, str(rank), str(os.getpid())]
            if wrap_command is not None:
                argv = wrap_command(rank, argv)
            env = base_env if rank_env is None else {**base_env, **rank_env(rank)}
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        ranks.append(_Rank(rank=rank, proc=proc, log_path=log_path))  # ended if what follows raises
        if register_pid is not None:
            register_pid(proc.pid)


def _unpicklable(spec: _Spec, exc: Exception) -> str:
    """Which of ``fn``, its args and kwargs does not pickle, for the error."""
    parts = [("fn", spec.fn), *((f"args[{i}]", a) for i, a in enumerate(spec.args))]
    parts += [(f"kwargs[{k!r}]", v) for k, v in spec.kwargs.items()]
    culprit: tuple[str, Any] = ("fn, args and kwargs", None)
    for part in parts:
        try:
            pickle.dumps(part[1])
        except Exception as found:
            culprit, exc = part, found
            break
    return (
        f"launch's {culprit[0]} must pickle (every rank receives it; fn must be a module-level "
        f"function); got {culprit[1]!r}: {type(exc).__name__}: {exc}"
    )


# Note [Rank start]
# ~~~~~~~~~~~~~~~~~
# A fresh interpreter spends seconds importing torch and the library, so a rank is forked
# from a zygote: multiprocessing's fork server, started on the first launch with this module
# preloaded (imported once, before any process group exists: Note [Lazy package] in
# tokenring; no CUDA state, one thread, so fork is safe). Each launch sends the launcher's
# environment and sys.path: variables read when a rank runs take effect, those read at
# interpreter start (MALLOC_*, LD_PRELOAD, PYTHON*) are the zygote's. So a launch with
# ``rank_env`` or ``wrap_command`` (a network namespace must exec the rank), or off Linux,
# starts fresh interpreters. A rank, forked or fresh, ends with os._exit after its atexit
# handlers, so finalisation never races a gloo thread (Note [Clean exit]) and a thread that
# fn left running does not keep a rank that returned its result alive until the deadline.
# The zygote ends with the launcher.
_ZYGOTE_PRELOAD = ["tokenring.launch"]


def _zygote_can_fork() -> bool:
    return sys.platform.startswith("linux") and "forkserver" in (
        multiprocessing.get_all_start_methods()
    )


def _fork_rank(spec_path: str, rank: int, log_path: str, env: dict[str, str]) -> _ForkedProc:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_ZYGOTE_PRELOAD)
    process = context.Process(
        target=_forked_worker,
        args=(spec_path, rank, os.getpid(), log_path, env, list(sys.path)),
        name=f"tokenring-rank{rank}",
        daemon=False,
    )
    process.start()
    return _ForkedProc(process)


def _forked_worker(
    spec_path: str,
    rank: int,
    launcher_pid: int,
    log_path: str,
    env: dict[str, str],
    path: list[str],
) -> None:
    """A rank forked by the zygote: the same start as ``_WORKER_CODE``, then ``_worker``."""
    # Every child inherits the pipe end whose closing tells the fork server its launcher is
    # gone (CPython's private ``_forkserver_alive_fd``); held, it would keep the server (and
    # so this rank) alive past a killed launcher.
    server = multiprocessing.forkserver._forkserver
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        setattr(server, "_forkserver_alive_fd", None)  # noqa: B010  (private, untyped)
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG: when the parent dies
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent or not _alive(launcher_pid):
        os._exit(1)  # the zygote or the launcher died before PR_SET_PDEATHSIG took effect
    os.setsid()  # its own session, as start_new_session gives a fresh interpreter
    # What the zygote imported is never garbage and holds no process group: keep it out of
    # every collection and of clear_group_defaults' scan (a faster teardown).
    gc.freeze()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    libc.prctl(15, f"tokenring-r{rank}".encode(), 0, 0, 0)  # PR_SET_NAME, for ps and top
    code = 1
    try:
        code = _worker(spec_path, rank)
    except BaseException:
        traceback.print_exc()  # e.g. its result could not be written: into its log
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _not_dead(proc: _Proc) -> bool:
    """Whether a process ``poll`` finds running is not dying or dead already (Linux; elsewhere:
    True): a killed process closes its sockets (its peers fail) before it is a zombie, and a
    zygote's child is reaped by the fork server, whose report of its exit comes later."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            state, *_, flags = f.read().rpartition(b")")[2].split()[:7]  # fields 3 and 9
    except OSError:  # reaped
        return False
    return state not in (b"Z", b"X") and not int(flags) & 0x4  # PF_EXITING: in do_exit


def _read_outcome(workdir: str, rank: int) -> _Outcome | None:
    path = os.path.join(workdir, f"result{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    try:
        outcome: _Outcome = pickle.loads(data)
    except Exception as exc:  # it pickled in the rank: a class or module the launcher lacks
        return _Outcome(
            ok=False,
            error=f"rank {rank}: its result cannot be unpickled by the launcher:\n"
            + traceback.format_exc(),
            failed_at_s=time.time(),
            summary=f"its result cannot be unpickled by the launcher: {_summary(exc)}",
        )
    return outcome


def _tail(path: str, num_chars: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[-num_chars:].decode(errors="replace")


_REPORT_GRACE_S = 3.0
"""After the first failure, how long the other ranks get to report their own error before they
are ended (1 s was too short for a peer descheduled on a loaded machine: it was ended before
it could name the dead rank)."""


def _collect(
    ranks: list[_Rank], workdir: str, timeout_s: float, poll: Callable[[], None] | None
) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    first_failure: tuple[float, int, str, str] | None = None
    grace_until: float | None = None
    outcomes: dict[int, _Outcome] = {}
    alive_at = dict.fromkeys((r.rank for r in ranks), time.time())  # wall clock, as ranks report
    while True:
        now, wall = time.monotonic(), time.time()
        running = [r for r in ranks if r.proc.poll() is None]
        alive_at.update((r.rank, wall) for r in running if _not_dead(r.proc))
        for r in ranks:
            code = r.proc.poll()
            # A failed rank writes its outcome before it ends; read it while it still runs.
            if r.rank not in outcomes and (found := _read_outcome(workdir, r.rank)) is not None:
                outcomes[r.rank] = found
            candidate = _failure(r, code, outcomes.get(r.rank), alive_at[r.rank])
            if candidate is not None:  # the earliest failure, by time
                first_failure = min(first_failure or candidate, candidate)
                # let peers report their own errors (to pick the earliest), then end them
                grace_until = grace_until or now + _REPORT_GRACE_S
        if first_failure is not None and (not running or (grace_until and now > grace_until)):
            _end(ranks)
            _, rank, error, summary = first_failure
            quiet = [r for r in running if r.rank not in outcomes]  # e.g. a slow one
            also = f"ranks {[r.rank for r in quiet]} had not finished when ended\n" if quiet else ""
            raise LaunchError(
                f"rank {rank} failed first (root cause below); the other ranks were ended.\n"
                f"--- rank {rank} ---\n{error}{also}{_tails(quiet)}",
                failed_rank=rank,
                remote_traceback=error,
                summary=f"rank {rank} failed first: {summary}",
            )
        if not running:
            break
        if now > deadline:
            _end(ranks)
            summary = (
                f"deadline of {timeout_s:g} s passed; ranks {[r.rank for r in running]} had not "
                "finished and were killed"
            )
            raise LaunchError(f"{summary}\n{_tails(running)}", failed_rank=None, summary=summary)
        if poll is not None:
            poll()
        time.sleep(0.02)
    results = []
    for r in ranks:
        outcome = outcomes.get(r.rank) or _read_outcome(workdir, r.rank)
        assert outcome is not None and outcome.ok
        results.append(outcome.value)
    return results


def _tails(ranks: Sequence[_Rank]) -> str:
    return "\n".join(f"--- rank {r.rank} log tail ---\n{_tail(r.log_path)}" for r in ranks)


def _failure(
    r: _Rank, code: int | None, outcome: _Outcome | None, alive_at: float
) -> tuple[float, int, str, str] | None:
    """(when, rank, error, the error in one line) if rank ``r`` reported an error or exited
    without a result or with an error status; else None. A rank that died without reporting
    (killed, os._exit) is dated by ``alive_at``, the last time it was seen running: its peers
    fail *after* it dies (connection reset), often before the next poll sees it gone, and
    must not be named."""
    if outcome is not None and not outcome.ok:
        return outcome.failed_at_s, r.rank, outcome.error, outcome.summary
    if code is None or (outcome is not None and code == 0):
        return None
    tail = _tail(r.log_path)
    if outcome is None:
        why = f"exited with {_exit_status(code)} without a result"
    else:
        why = f"returned its result but then exited with {_exit_status(code)}"
    if not tail.strip():  # it failed before its log opened
        error = f"rank {r.rank} {why} and an empty log; {_EMPTY_LOG}"
        return alive_at, r.rank, error, f"{why} and an empty log"
    last = tail.strip().splitlines()[-1].strip()
    return (
        alive_at,
        r.rank,
        f"rank {r.rank} {why}; log tail:\n" + tail,
        f"{why}; its log ends: {last}",
    )


def _exit_status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _end(ranks: Sequence[_Rank]) -> None:
    """Kill every still-running worker (its own session: children too), by PID."""
    for r in ranks:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                r.proc.kill()
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=10)


def _worker(spec_path: str, rank: int) -> int:
    try:  # loading fn imports its module: that may fail here too
        with open(spec_path, "rb") as f:
            spec: _Spec = pickle.load(f)
        outcome = _Outcome(ok=True, value=_run_rank(spec, rank))
        data = pickle.dumps(outcome)  # inside the try: a result that does not pickle fails
    except BaseException as exc:
        error = f"rank {rank}: {traceback.format_exc()}"
        outcome = _Outcome(ok=False, error=error, failed_at_s=time.time(), summary=_summary(exc))
        data = pickle.dumps(outcome)
    result_path = os.path.join(os.path.dirname(spec_path), f"result{rank}.pkl")  # the workdir
    with open(result_path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(result_path + ".tmp", result_path)
    if not outcome.ok:
        # its groups may hold collectives peers never joined: tearing them down would wait
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def _summary(exc: BaseException) -> str:
    """``exc`` in one line, with where it was raised: ``ValueError: ... (at file.py:12 in
    fn)``; an exception whose ``str()`` raises is named with that error."""
    try:
        message = " ".join(str(exc).split())
    except Exception as failed:  # unreported, the rank would end with an empty log
        message = f"<str() raised {type(failed).__name__}: {failed}>"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    where = traceback.extract_tb(exc.__traceback__)[-1]  # a caught exception: a frame at least
    return f"{text} (at {os.path.basename(where.filename)}:{where.lineno} in {where.name})"


def _run_rank(spec: _Spec, rank: int) -> Any:
    """Join the group, run ``fn``, then tear down in order (Note [Clean exit])."""
    # the library is imported before the group exists (Note [Groups in default arguments]
    # in tokenring.runtime.comm)
    torch.set_num_threads(spec.threads)
    if "nccl" in _backend_names(spec.backend):
        torch.cuda.set_device(rank)  # NCCL refuses two ranks on one device
    store = dist.FileStore(spec.store_path, spec.world_size)
    store.set_timeout(timedelta(seconds=spec.pg_timeout_s))  # group creation waits too
    dist.init_process_group(
        backend=spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.pg_timeout_s),
    )
    if spec.world_size > 1:
        get_communicator(None, timeout_s=spec.pg_timeout_s)
    value = spec.fn(*spec.args, **spec.kwargs)
    # Note [Clean exit]
    # ~~~~~~~~~~~~~~~~~
    # A gloo group's worker threads live as long as its ProcessGroup object
    # (destroy_process_group only forgets it), and a thread that takes the GIL while Python
    # finalises aborts the process (SIGABRT) after every result was right. So: wait until
    # every rank is done talking, close the library's communicators, destroy the rest, and
    # free the objects, which joins their threads while the interpreter is still whole.
    if dist.is_initialized() and spec.world_size > 1:
        get_communicator(None).barrier(label="end of launch")
    close_communicators()
    destroy_idle_groups()  # the pooled channel groups (Note [Group names] in runtime.comm)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    return value


# Before importing torch: SIGKILL when the launcher dies (PR_SET_PDEATHSIG = 1), then check
# that it did not die before that took effect.
_WORKER_CODE = """
import os, signal, sys
if sys.platform.startswith("linux"):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    libc.prctl(15, f"tokenring-r{sys.argv[2]}".encode()[:15], 0, 0, 0)
if os.getppid() != int(sys.argv[3]):
    os._exit(1)
import atexit, traceback
from tokenring.launch import _worker
code = 1
try:
    code = _worker(sys.argv[1], int(sys.argv[2]))
except BaseException:
    traceback.print_exc()
finally:  # as a forked rank ends: no wait for threads fn left running (Note [Rank start])
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
"""
