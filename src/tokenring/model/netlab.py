"""Emulated interconnect: network namespaces joined by rate-limited virtual links.

This module owns the lab that ``tokenring bench --link`` runs in: one Linux network namespace
per rank, veth links between them shaped with ``tc tbf``, and the addressing that lets gloo
connect the ranks. It builds the lab, tells the caller how to start a rank inside it
(``wrap_command``, ``env``) and tears it down on exit, error and SIGINT/SIGTERM; namespace
names carry the owner's PID and start time, so the next lab removes those of a dead owner.
It does not start ranks or time anything. Needs Linux, root (or CAP_NET_ADMIN plus
CAP_SYS_ADMIN), iproute2 and ``sysctl``; ``lab_unavailable_reason()`` says what is missing.

Note [Emulated interconnect]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank r lives in namespace ``ns[r]`` with the identity address ``10.201.0.(r+1)/32`` on an
``ifb`` device (``tr-ident``; the target kernels have no ``dummy`` device). Links carry no
addresses; a /32 host route per peer picks the link, with the identity address as source.
``GLOO_SOCKET_IFNAME=tr-ident`` makes gloo advertise it; rank 0's hosts the TCP store.
``a:dev <-> b:dev`` is one veth pair; every device below has a tbf at ``rate_bits_per_s`` on
its egress, so each direction of each pair is shaped once::

    mesh, P = 3            ring, P = 4                  switch, P = 3
    r0:v1 <-> r1:v0        r0:v1 <-> r1:v0              r0:tr-sw <-> sw:p0 \
    r0:v2 <-> r2:v0        r1:v2 <-> r2:v1              r1:tr-sw <-> sw:p1 -- sw:br0
    r1:v2 <-> r2:v1        r2:v3 <-> r3:v2              r2:tr-sw <-> sw:p2 /
                           r3:v0 <-> r0:v3
                           r0 -> r2: out of r0:v1, r1 forwards out of r1:v2

- mesh: one veth pair per rank pair, full rate each way.
- ring: pairs only between neighbours; a non-neighbour is reached the shortest way round
  (ties towards rank + 1) by IP forwarding in the ranks between, so a relayed flow occupies
  every hop it crosses.
- switch: one pair per rank into a bridge in its own namespace; ``tr-sw`` limits what the
  rank sends, ``p<r>`` what it receives, each shared by all its peers.

Reno congestion control: BBR is unstable with two-way traffic through tbf. tbf's burst is at
least 64 KiB + 2 MTU so GSO frames pass; MTU 9000 keeps header overhead near 0.5%. The bucket
starts full: time transfers well above ``burst_bytes``.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from tokenring.runtime.shm import ENV_VAR

__all__ = ["Lab", "LabConfig", "Topology", "lab_unavailable_reason", "remove_stale_labs"]

_IDENT_DEVICE = "tr-ident"  # holds the identity address inside every rank namespace
_SWITCH_UPLINK = "tr-sw"  # rank end of the veth into the switch
_BRIDGE = "br0"
_ADDRESS_PREFIX = "10.201.0."  # private range, used only inside the lab's namespaces
_MAX_WORLD_SIZE = 250  # identity addresses 10.201.0.1 .. 10.201.0.250
_NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts named namespaces (iproute2)
_COMMAND_TIMEOUT_S = 30.0
_TERM_GRACE_S = 2.0
_KILL_GRACE_S = 2.0
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_CONGESTION_CONTROL_RE = re.compile(r"[a-z][a-z0-9_]*")
# tokenring-[probe-]<owner pid>-[<owner start time>-]<random>[-<rank>|-switch]
_NAME_RE = re.compile(r"tokenring-(?:probe-)?(\d+)-(?:(\d+)-)?[0-9a-f]{6}(?:-\d+|-switch)?")


class Topology(enum.Enum):
    """How the ranks' links are wired; see Note [Emulated interconnect]."""

    MESH = "mesh"
    RING = "ring"
    SWITCH = "switch"

    @classmethod
    def parse(cls, value: Topology | str) -> Topology:
        """Accept a ``Topology`` or its value; raise ValueError naming the options. (Not
        ``parse_enum``: lab helpers load this module by path, without the package.)"""
        if isinstance(value, Topology):
            return value
        try:
            return cls(value)
        except ValueError:
            options = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"topology must be one of {options}; got {value!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class LabConfig:
    """What to emulate: how many ranks, how they are wired and how fast each link is."""

    world_size: int
    """Number of ranks, one namespace each; 2 to 250."""
    rate_bits_per_s: float
    """Rate of every shaped link direction (tc counts IP headers too)."""
    topology: Topology
    """Wiring of the ranks; a ``Topology`` or its string value."""
    mtu: int = 9000
    """MTU of every link in bytes; 576 to 65535."""
    queue_latency_s: float = 0.05
    """Longest a packet waits in a tbf queue before it is dropped; at most 10 s."""
    congestion_control: str = "reno"
    """TCP congestion control inside every namespace; must be built into the kernel."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", Topology.parse(self.topology))
        if not (_is_int(ws := self.world_size) and 2 <= ws <= _MAX_WORLD_SIZE):
            raise ValueError(f"world_size must be an int in [2, {_MAX_WORLD_SIZE}]; got {ws!r}")
        rate = self.rate_bits_per_s
        if not (_is_number(rate) and math.isfinite(rate) and round(rate) >= 1):
            raise ValueError(f"rate_bits_per_s must be a finite number >= 1; got {rate!r}")
        if not (_is_int(mtu := self.mtu) and 576 <= mtu <= 65535):
            raise ValueError(f"mtu must be an int in [576, 65535]; got {mtu!r}")
        if not (_is_number(latency := self.queue_latency_s) and 0 < latency <= 10):
            raise ValueError(f"queue_latency_s must be in (0, 10] seconds; got {latency!r}")
        cc = self.congestion_control
        if not isinstance(cc, str) or not _CONGESTION_CONTROL_RE.fullmatch(cc):
            raise ValueError(
                f"congestion_control must be a kernel algorithm name such as 'reno'; got {cc!r}"
            )

    @property
    def burst_bytes(self) -> int:
        """tbf bucket size: 64 KiB + 2 MTU, or 1 ms at the rate if more; plus 1% (tc stores
        the bucket as a transmit time and rounds it down)."""
        need = max(65536 + 2 * self.mtu, self.rate_bits_per_s / 8 * 1e-3)
        return math.ceil(need * 1.01)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _run(argv: Sequence[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one setup command; raise RuntimeError with its stderr when it fails."""
    try:
        result = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"netlab: `{' '.join(argv)}` did not run: {e}") from e
    if result.returncode != 0:
        shown = " ".join(argv) + (f" <<< {stdin.strip()!r}" if stdin else "")
        raise RuntimeError(
            f"netlab: `{shown}` failed with exit code {result.returncode}: "
            f"{result.stderr.strip() or result.stdout.strip()}"
        )
    return result


def _process_start_time(pid: int) -> int | None:
    """Start time of a live (not zombie) process in clock ticks after boot, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    state, start = fields[0], fields[19]  # fields 3 and 22 of proc_pid_stat(5)
    return None if state in ("Z", "X") else int(start)


def _owner_tag() -> str:
    """``<pid>-<start time>`` of this process (a reused PID has another start time)."""
    return f"{os.getpid()}-{_process_start_time(os.getpid())}"


def _pids_inside(namespaces: Sequence[str]) -> set[int]:
    """Live processes whose network namespace is one of ``namespaces`` (this one excluded)."""
    inodes = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(os.path.join(_NETNS_DIR, ns)).st_ino)
    pids: set[int] = set()
    for entry in os.listdir("/proc") if inodes else ():
        with contextlib.suppress(OSError, ValueError):  # a zombie's stat fails: skipped
            if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                pids.add(int(entry))
    pids.discard(os.getpid())
    return pids


def _end_processes(find: Callable[[], set[int]]) -> None:
    """SIGTERM what ``find()`` returns, then SIGKILL what is left, each with a grace time."""
    for sig, grace_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _KILL_GRACE_S)):
        pids = find()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while find() and time.monotonic() < deadline:
            time.sleep(0.02)


def _delete_namespaces(namespaces: Sequence[str]) -> list[str]:
    """End the processes inside (else a deleted namespace lives on), delete the namespaces;
    returns those that still exist."""
    _end_processes(lambda: _pids_inside(namespaces))
    for ns in namespaces:
        if os.path.exists(os.path.join(_NETNS_DIR, ns)):
            _delete_namespace(ns)
    return [ns for ns in namespaces if os.path.exists(os.path.join(_NETNS_DIR, ns))]


def _delete_namespace(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_COMMAND_TIMEOUT_S)


def remove_stale_labs() -> list[str]:
    """Delete the namespaces of labs whose owner process is gone (killed with SIGKILL), and
    what runs inside them; ``Lab`` calls it on enter. Needs what ``Lab`` needs.

    Returns:
        The names of the namespaces deleted.

    Raises:
        RuntimeError: a stale namespace could not be deleted.
    """
    try:
        names = os.listdir(_NETNS_DIR)
    except FileNotFoundError:
        return []
    stale = []
    for name in sorted(names):
        if (match := _NAME_RE.fullmatch(name)) is not None:
            now = _process_start_time(int(match[1]))
            if now is None or (match[2] is not None and int(match[2]) != now):
                stale.append(name)
    if stale and (leftovers := _delete_namespaces(stale)):
        raise RuntimeError(f"netlab: could not delete stale lab namespaces {leftovers}")
    return stale


def lab_unavailable_reason() -> str | None:
    """Say why a ``Lab`` cannot be built here (a sentence), or None when it can.

    Checks the platform, tools and privileges, then builds and deletes a probe namespace
    with the kernel features a lab uses, so a missing one shows here, not half-way through
    ``Lab.__enter__``.
    """
    if not sys.platform.startswith("linux"):
        return f"netlab needs Linux network namespaces; this platform is {sys.platform!r}"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("sysctl", "procps")):
        if shutil.which(tool) is None:
            return f"netlab needs `{tool}` on PATH (package {package}); it was not found"
    with open("/proc/self/status", encoding="ascii") as f:
        caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    if os.geteuid() != 0 and not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        return "netlab needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    probe = f"tokenring-probe-{_owner_tag()}-{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as e:
        return f"netlab cannot create a network namespace: {e}"
    try:
        devices = (
            f"{_IDENT_DEVICE} type ifb",
            "pa type veth peer name pb",
            f"{_BRIDGE} type bridge",
        )
        _run(["ip", "-n", probe, "-batch", "-"], stdin="".join(f"link add {d}\n" for d in devices))
        tbf = "root tbf rate 1000000bit burst 83968 latency 50ms"
        _run(["tc", "-n", probe, "qdisc", "replace", "dev", "pa", *tbf.split()])
        _run(["ip", "netns", "exec", probe, "sysctl", "-q", "-w", *_sysctls("reno", True)])
    except RuntimeError as e:
        return f"netlab's kernel features (ifb, veth, bridge, tbf, reno) are not usable: {e}"
    finally:
        _delete_namespace(probe)
    return None


def _sysctls(congestion_control: str, forward: bool) -> list[str]:
    return [
        f"net.ipv4.tcp_congestion_control={congestion_control}",
        f"net.ipv4.ip_forward={int(forward)}",
        # relayed ring traffic may come back another way: never drop it as spoofed
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ]


def _ring_next_hop(src: int, dst: int, world_size: int) -> int:
    """First rank after ``src`` on the shortest way round a ring to ``dst`` (ties: src + 1)."""
    assert src != dst
    forward = (dst - src) % world_size
    return (src + (1 if forward <= world_size - forward else -1)) % world_size


def _route(config: LabConfig, addr: Sequence[str], src: int, dst: int) -> str:
    """The host route from rank ``src`` to ``dst`` over the links of a mesh or a ring."""
    hop = dst if config.topology is Topology.MESH else _ring_next_hop(src, dst, config.world_size)
    if hop == dst:
        return f"route add {addr[dst]}/32 dev v{dst} src {addr[src]}"
    return f"route add {addr[dst]}/32 via {addr[hop]} dev v{hop} onlink src {addr[src]}"


_Phases = list[tuple[str, dict[str, list[str]]]]


def _build_plan(
    config: LabConfig, names: Sequence[str], switch_name: str | None
) -> tuple[frozenset[str], _Phases]:
    """A config's setup commands, pure (the wiring reads without root): the namespaces that
    route for others (``ip_forward=1``), and the phases in order, each a tool and per namespace
    its batch lines (ip: devices, veth pairs, links up and routes; tc: a tbf per device)."""
    p, mtu, topology = config.world_size, config.mtu, config.topology
    addr = [f"{_ADDRESS_PREFIX}{r + 1}" for r in range(p)]
    everyone = [*names, *([switch_name] if switch_name else [])]
    forwarding = frozenset(names) if topology is Topology.RING and p > 3 else frozenset()
    devices: dict[str, list[str]] = {ns: ["link set lo up"] for ns in everyone}
    links: dict[str, list[str]] = {ns: [] for ns in everyone}
    routes: dict[str, list[str]] = {ns: [] for ns in everyone}
    shaping: dict[str, list[str]] = {ns: [] for ns in everyone}
    phases = [("ip", devices), ("ip", links), ("ip", routes), ("tc", shaping)]
    tbf = (
        f"root tbf rate {round(config.rate_bits_per_s)}bit burst {config.burst_bytes} "
        f"latency {round(config.queue_latency_s * 1e6)}us"
    )
    for r, ns in enumerate(names):
        devices[ns] += [
            f"link add {_IDENT_DEVICE} mtu {mtu} type ifb",
            f"link set {_IDENT_DEVICE} up",
            f"addr add {addr[r]}/32 dev {_IDENT_DEVICE}",
        ]

    def veth(a_ns: str, a_dev: str, b_ns: str, b_dev: str) -> None:
        links[a_ns].append(
            f"link add {a_dev} mtu {mtu} type veth peer name {b_dev} mtu {mtu} netns {b_ns}"
        )
        for ns, dev in ((a_ns, a_dev), (b_ns, b_dev)):
            routes[ns].append(f"link set {dev} up")
            shaping[ns].append(f"qdisc replace dev {dev} {tbf}")

    if topology is Topology.SWITCH:
        assert switch_name is not None
        devices[switch_name] += [
            f"link add {_BRIDGE} mtu {mtu} type bridge stp_state 0",
            f"link set {_BRIDGE} up",
        ]
        for r, ns in enumerate(names):
            veth(ns, _SWITCH_UPLINK, switch_name, f"p{r}")
            routes[switch_name].append(f"link set p{r} master {_BRIDGE}")
            routes[ns] += [
                f"route add {addr[peer]}/32 dev {_SWITCH_UPLINK} src {addr[r]}"
                for peer in range(p)
                if peer != r
            ]
        return forwarding, phases

    if topology is Topology.MESH:
        pairs = {(a, b) for a in range(p) for b in range(a + 1, p)}
    else:
        pairs = {(min(a, (a + 1) % p), max(a, (a + 1) % p)) for a in range(p)}
    for a, b in sorted(pairs):
        veth(names[a], f"v{b}", names[b], f"v{a}")
    for r, ns in enumerate(names):
        routes[ns] += [_route(config, addr, r, peer) for peer in range(p) if peer != r]
    return forwarding, phases


_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Lab:
    """Builds the emulated interconnect on enter and removes it on exit.

    Usage::

        with Lab(LabConfig(world_size=4, rate_bits_per_s=100e6, topology="mesh")) as lab:
            for rank in range(4):
                proc = subprocess.Popen(
                    lab.wrap_command(rank, [sys.executable, "worker.py"]),
                    env={**os.environ, **lab.env(rank), "RANK": str(rank)},
                )
                lab.register_pid(proc.pid)
            ...

    Namespace names are ``tokenring-<pid>-<start time>-<random>-<rank>`` (and ``...-switch``):
    concurrent labs never collide, and entering a lab removes those of dead owners
    (``remove_stale_labs``, with a RuntimeWarning). A lab is single-use. While active and
    entered from the main thread, SIGINT and SIGTERM tear it down, then run the previous
    handler; the default action becomes ``SystemExit(128 + signum)`` so the caller's own
    clean-up runs too.

    Args:
        config: What to emulate.
    """

    def __init__(self, config: LabConfig) -> None:
        self._config = config
        prefix = f"tokenring-{_owner_tag()}-{secrets.token_hex(3)}"
        self._rank_names = tuple(f"{prefix}-{r}" for r in range(config.world_size))
        self._switch_name = f"{prefix}-switch" if config.topology is Topology.SWITCH else None
        self._created: list[str] = []  # namespaces that may exist; emptied by teardown
        self._pids: dict[int, int] = {}  # registered pid -> its start time (clock ticks)
        self._state = "new"  # new -> active -> closed
        self._previous_handlers: dict[int, _SignalHandler] = {}

    # -- what ranks need --------------------------------------------------------------------
    @property
    def config(self) -> LabConfig:
        """The configuration this lab was built from."""
        return self._config

    @property
    def namespaces(self) -> tuple[str, ...]:
        """All namespaces of this lab: rank r's at index r, then the switch's if any."""
        return self._rank_names + ((self._switch_name,) if self._switch_name else ())

    def namespace(self, rank: int) -> str:
        """Name of the network namespace rank ``rank`` runs in."""
        return self._rank_names[self._check_rank(rank)]

    def address(self, rank: int) -> str:
        """Identity IPv4 address of ``rank`` (reachable from every rank's namespace)."""
        return f"{_ADDRESS_PREFIX}{self._check_rank(rank) + 1}"

    def interface(self, rank: int) -> str:
        """Device inside rank ``rank``'s namespace that holds its identity address."""
        self._check_rank(rank)
        return _IDENT_DEVICE

    def wrap_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside rank ``rank``'s namespace (``ip netns exec`` execs
        it: pass the process's PID to ``register_pid``)."""
        if isinstance(argv, str) or not argv:
            raise ValueError(f"argv must be a non-empty list of strings; got {argv!r}")
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def env(self, rank: int) -> dict[str, str]:
        """Environment variables that make gloo and the TCP store use the lab's addresses, and
        keep every byte on the emulated links (no shared memory between the ranks: Note
        [Shared-memory transport] in tokenring.runtime.shm)."""
        return {
            "GLOO_SOCKET_IFNAME": self.interface(rank),
            "MASTER_ADDR": self.address(0),
            ENV_VAR: "0",
        }

    def register_pid(self, pid: int) -> None:
        """Remember a process started for the lab so that teardown ends it, even before it
        enters its namespace; its start time is kept, so a reused PID is never signalled."""
        if not (_is_int(pid) and pid > 0):
            raise ValueError(f"pid must be a positive int; got {pid!r}")
        if (start := _process_start_time(pid)) is not None:  # None: gone, nothing to end
            self._pids[pid] = start

    def describe(self) -> dict[str, object]:
        """JSON-ready description of the emulated links, for benchmark records."""
        c = self._config
        return {
            "topology": c.topology.value,
            "world_size": c.world_size,
            "rate_bits_per_s": c.rate_bits_per_s,
            "mtu": c.mtu,
            "shaper": "tbf",
            "burst_bytes": c.burst_bytes,
            "queue_latency_s": c.queue_latency_s,
            "congestion_control": c.congestion_control,
        }

    def _check_rank(self, rank: int) -> int:
        p = self._config.world_size
        if not (_is_int(rank) and 0 <= rank < p):
            raise ValueError(f"rank must be an int in [0, {p}); got {rank!r}")
        return rank

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Lab:
        if self._state != "new":
            raise RuntimeError(f"a Lab can be entered only once; this one is {self._state}")
        self._state = "active"
        self._install_signal_handlers()
        atexit.register(self._teardown)
        try:
            if removed := remove_stale_labs():
                warnings.warn(
                    f"netlab: removed namespaces of labs whose owner process is gone: {removed}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self._build()
        except BaseException:
            self._close(exc_in_flight=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(exc_in_flight=exc is not None)

    def _build(self) -> None:
        forwarding, phases = _build_plan(self._config, self._rank_names, self._switch_name)
        for ns in self.namespaces:
            self._created.append(ns)  # before `add`: teardown must try it even if add half-fails
            _run(["ip", "netns", "add", ns])
        for ns in self.namespaces:
            settings = _sysctls(self._config.congestion_control, ns in forwarding)
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings])
        for tool, phase in phases:
            for ns, lines in phase.items():
                if lines:
                    _run([tool, "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")

    def _close(self, *, exc_in_flight: bool) -> None:
        if leftovers := self._shutdown():
            message = f"netlab: could not delete network namespaces {leftovers}"
            if exc_in_flight:
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            else:
                raise RuntimeError(message)

    def _shutdown(self) -> list[str]:
        """Hand the signals back, then :meth:`_teardown` (no longer at exit)."""
        self._restore_signal_handlers()
        atexit.unregister(self._teardown)
        return self._teardown()

    def _teardown(self) -> list[str]:
        """End processes inside the lab, delete its namespaces; idempotent. Returns the
        namespaces that still exist."""
        self._state = "closed"
        if not self._created:
            return []
        _end_processes(self._pids_to_end)
        leftovers = _delete_namespaces(self._created)
        self._created = [ns for ns in self._created if ns in leftovers]
        return leftovers

    def _pids_to_end(self) -> set[int]:
        """Live registered processes, and live processes inside one of this lab's namespaces."""
        pids = {pid for pid, start in self._pids.items() if _process_start_time(pid) == start}
        pids.discard(os.getpid())
        return pids | _pids_inside(self._created)

    # -- signals ----------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN or previous is None:
                continue  # ignored, or owned by non-Python code: leave it alone
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        if leftovers := self._shutdown():
            print(f"netlab: could not delete network namespaces {leftovers}", file=sys.stderr)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            # the default action would skip the caller's clean-up: exit through it instead
            raise SystemExit(128 + signum)
