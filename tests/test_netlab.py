"""Tests for tokenring.model.netlab: config validation, wiring, measured link rates, teardown.

Tests marked ``lab`` build real namespaces and need root and iproute2; they are skipped with
``lab_unavailable_reason()`` otherwise. Rates are checked as ratios to the set rate with wide
margins (the machine has 2 cores and other work may run), never as absolute times.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import tokenring.model.netlab as netlab_module
from common import running
from tokenring.model.netlab import (
    Lab,
    LabConfig,
    Topology,
    _ring_next_hop,
    lab_unavailable_reason,
    remove_stale_labs,
)

_UNAVAILABLE = lab_unavailable_reason()
# The children load the module by the path it was imported from here (the package would import
# torch, ~3 s); a move of the module cannot leave them reading a file that is gone.
_NETLAB_PATH = netlab_module.__file__

RATE_BITS_PER_S = 100_000_000
MIB = 1 << 20
WARMUP_BYTES = 256 * 1024  # > tbf burst (~84 KB): the bucket is empty when timing starts
DEADLINE_S = 30.0
# Measured time / ideal time (bytes * 8 / rate available to the flow).
LOW, HIGH = 0.7, 1.6


def _existing_namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# -- pure tests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"world_size": 1}, "world_size"),
        ({"world_size": 251}, "world_size"),
        ({"world_size": 2.0}, "world_size"),
        ({"world_size": True}, "world_size"),
        ({"rate_bits_per_s": 0}, "rate_bits_per_s"),
        ({"rate_bits_per_s": -5e6}, "rate_bits_per_s"),
        ({"rate_bits_per_s": math.nan}, "rate_bits_per_s"),
        ({"rate_bits_per_s": math.inf}, "rate_bits_per_s"),
        ({"rate_bits_per_s": "100mbit"}, "rate_bits_per_s"),
        ({"topology": "torus"}, "topology"),
        ({"mtu": 100}, "mtu"),
        ({"mtu": 70000}, "mtu"),
        ({"queue_latency_s": 0}, "queue_latency_s"),
        ({"queue_latency_s": 11}, "queue_latency_s"),
        ({"congestion_control": ""}, "congestion_control"),
        ({"congestion_control": "reno; reboot"}, "congestion_control"),
    ],
)
def test_config_rejects_invalid_values(kwargs: dict[str, Any], argument: str) -> None:
    base: dict[str, Any] = {"world_size": 2, "rate_bits_per_s": 1e8, "topology": "mesh"}
    with pytest.raises(ValueError, match=argument):
        LabConfig(**{**base, **kwargs})


def test_config_accepts_topology_string_and_sizes_burst() -> None:
    config = LabConfig(world_size=3, rate_bits_per_s=1e8, topology="switch")  # type: ignore[arg-type]
    assert config.topology is Topology.SWITCH
    assert config.burst_bytes >= 64 * 1024 + 2 * 9000
    fast = LabConfig(world_size=2, rate_bits_per_s=100e9, topology=Topology.MESH)
    assert fast.burst_bytes >= 100e9 / 8 * 1e-3  # 1 ms at 100 Gbit/s


def test_lab_names_addresses_and_env_before_enter() -> None:
    lab = Lab(LabConfig(world_size=3, rate_bits_per_s=1e8, topology=Topology.SWITCH))
    assert len(lab.namespaces) == 4  # three ranks and the switch
    assert len(set(lab.namespaces)) == 4
    # Owner PID and start time: a later lab can tell whether the owner still runs.
    owner = rf"tokenring-{os.getpid()}-\d+-[0-9a-f]{{6}}-"
    assert all(re.fullmatch(owner + r"(\d|switch)", ns) for ns in lab.namespaces), lab.namespaces
    assert [lab.address(r) for r in range(3)] == ["10.201.0.1", "10.201.0.2", "10.201.0.3"]
    assert lab.env(2) == {
        "GLOO_SOCKET_IFNAME": lab.interface(2),
        "MASTER_ADDR": "10.201.0.1",
        "TOKENRING_SHARED_MEMORY": "0",  # the emulated links carry every byte
    }
    assert lab.wrap_command(1, ["python", "-V"]) == [
        *("ip", "netns", "exec", lab.namespaces[1], "python", "-V")
    ]
    described = json.loads(json.dumps(lab.describe()))
    assert described["topology"] == "switch"
    assert described["rate_bits_per_s"] == 1e8
    assert described["world_size"] == 3
    assert described["mtu"] == 9000
    for bad_rank in (-1, 3, True):
        with pytest.raises(ValueError, match="rank"):
            lab.address(bad_rank)
    with pytest.raises(ValueError, match="argv"):
        lab.wrap_command(0, [])
    with pytest.raises(ValueError, match="pid"):
        lab.register_pid(0)
    other = Lab(LabConfig(world_size=3, rate_bits_per_s=1e8, topology=Topology.SWITCH))
    assert not set(other.namespaces) & set(lab.namespaces)


@pytest.mark.parametrize(
    ("world_size", "src", "dst", "hop"),
    [
        (5, 0, 1, 1),
        (5, 0, 2, 1),
        (5, 0, 3, 4),
        (5, 0, 4, 4),
        (5, 3, 0, 4),
        (5, 1, 4, 0),
        (4, 0, 2, 1),  # tie: towards rank + 1
        (4, 3, 1, 0),  # tie, wrapping
        (4, 2, 1, 1),
    ],
)
def test_ring_next_hop(world_size: int, src: int, dst: int, hop: int) -> None:
    assert _ring_next_hop(src, dst, world_size) == hop


# -- traffic helper --------------------------------------------------------------------------

_FLOW_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, time
    mode, host, port, warmup, num_bytes, ready_dir, senders, deadline = sys.argv[1:9]
    port, warmup, num_bytes, senders = int(port), int(warmup), int(num_bytes), int(senders)
    deadline = float(deadline)
    buf = memoryview(bytearray(1 << 20))
    if mode == "recv":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, port))
        srv.listen(1)
        srv.settimeout(deadline - time.time())
        conn, _ = srv.accept()
        conn.settimeout(deadline - time.time())
        total, t0, at_t0, t1 = 0, None, 0, None
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            total += n
            t1 = time.time()  # wall clock: comparable across processes
            if t0 is None and total >= warmup:
                t0, at_t0 = t1, total
        print(json.dumps({"total": total, "bytes": total - at_t0, "t0": t0, "t1": t1}))
    else:
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=1.0)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.02)
        sock.settimeout(deadline - time.time())
        # Start together: once every sender is connected (each leaves a file in ready_dir).
        open(os.path.join(ready_dir, str(port)), "w").close()
        while len(os.listdir(ready_dir)) < senders:
            if time.time() > deadline:
                raise TimeoutError("the other senders did not connect")
            time.sleep(0.002)
        left = warmup + num_bytes
        while left:
            n = min(left, len(buf))
            sock.sendall(buf[:n])
            left -= n
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)
        sock.close()
    """
)


def _run_flows(lab: Lab, flows: list[tuple[int, int]], num_bytes: int) -> list[dict[str, float]]:
    """Send ``num_bytes`` (after a warm-up) over each (src, dst) flow, all at the same time.

    Returns:
        Per flow, as seen by the receiver: ``bytes`` received after the warm-up, the wall time
        ``t0`` when the warm-up was complete and ``t1`` when the last byte arrived.
    """
    deadline = time.time() + DEADLINE_S
    ready_dir = tempfile.mkdtemp(prefix="tokenring-flows-")  # the senders' start line
    procs: list[subprocess.Popen[str]] = []

    def spawn(rank: int, mode: str, host: str, port: int) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", _FLOW_SCRIPT, mode, host, str(port)]
        argv += [str(WARMUP_BYTES), str(num_bytes), ready_dir, str(len(flows)), repr(deadline)]
        proc = subprocess.Popen(
            lab.wrap_command(rank, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        lab.register_pid(proc.pid)
        procs.append(proc)
        return proc

    try:
        receivers = [
            spawn(dst, "recv", lab.address(dst), 5001 + i) for i, (_, dst) in enumerate(flows)
        ]
        for i, (src, dst) in enumerate(flows):
            spawn(src, "send", lab.address(dst), 5001 + i)
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline + 5 - time.time()))
            assert proc.returncode == 0, f"flow process failed:\n{err}"
            if proc in receivers:
                results.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(ready_dir, ignore_errors=True)
    for result in results:
        assert result["total"] == WARMUP_BYTES + num_bytes
    return results


def _time_ratio(lab: Lab, results: list[dict[str, float]]) -> float:
    """Measured time / ideal time for flows that share one link of the set rate.

    TCP flows sharing a bottleneck are not fair over a second or two, so the group is judged as
    a whole: from the first warm-up's end to the last byte, the link should have carried the
    bytes of all of them at the set rate. Flows on separate links would take half the time.
    """
    span_s = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    ideal_s = sum(r["bytes"] for r in results) * 8 / lab.config.rate_bits_per_s
    return span_s / ideal_s


# -- lab tests -------------------------------------------------------------------------------


@pytest.mark.lab
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")
class TestLab:
    def test_mesh_one_direction_at_set_rate(self) -> None:
        config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.MESH)
        with Lab(config) as lab:
            ratio = _time_ratio(lab, _run_flows(lab, [(0, 1)], 6 * MIB))
        print(f"mesh 0->1: {100 / ratio:.1f}% of set rate")
        assert LOW <= ratio <= HIGH

    def test_mesh_both_directions_at_full_rate_each(self) -> None:
        config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.MESH)
        with Lab(config) as lab:
            results = _run_flows(lab, [(0, 1), (1, 0)], 6 * MIB)
        ratios = [_time_ratio(lab, [r]) for r in results]
        print("mesh 0<->1: " + ", ".join(f"{100 / r:.1f}%" for r in ratios))
        assert all(LOW <= r <= HIGH for r in ratios), ratios

    def test_switch_shares_each_ranks_port(self) -> None:
        # 0->1 and 0->2 share rank 0's way out; 1->0 and 2->0 share its way in.
        config = LabConfig(world_size=3, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.SWITCH)
        with Lab(config) as lab:
            results = _run_flows(lab, [(0, 1), (0, 2), (1, 0), (2, 0)], 3 * MIB)
        ratios = [_time_ratio(lab, results[:2]), _time_ratio(lab, results[2:])]
        print("switch, rank 0 out, in: " + ", ".join(f"{100 / r:.1f}%" for r in ratios))
        assert all(LOW <= r <= HIGH for r in ratios), ratios

    def test_ring_relays_over_every_hop(self) -> None:
        # P = 5: 0->2 goes 0->1->2 and shares hop 1->2 with the neighbour flow 1->2.
        config = LabConfig(world_size=5, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.RING)
        with Lab(config) as lab:
            ratio = _time_ratio(lab, _run_flows(lab, [(0, 2), (1, 2)], 3 * MIB))
        print(f"ring, 0->2 and 1->2 together on hop 1->2: {100 / ratio:.1f}%")
        assert LOW <= ratio <= HIGH

    def test_gloo_connects_with_lab_env(self, tmp_path: Path) -> None:
        script = textwrap.dedent(
            """
            import datetime, os, sys, torch, torch.distributed as dist
            rank = int(sys.argv[1])
            dist.init_process_group(
                "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29511", rank=rank,
                world_size=2, timeout=datetime.timedelta(seconds=20),
            )
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t)
            assert t.tolist() == [3.0] * 4, t
            dist.destroy_process_group()
            """
        )
        config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.MESH)
        with Lab(config) as lab:
            procs = []
            try:
                for rank in range(2):
                    argv = lab.wrap_command(rank, [sys.executable, "-c", script, str(rank)])
                    env = {**os.environ, **lab.env(rank)}
                    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
                    lab.register_pid(proc.pid)
                    procs.append(proc)
                for proc in procs:
                    _, err = proc.communicate(timeout=60)
                    assert proc.returncode == 0, err
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=10)

    def test_namespaces_removed_after_exit_and_after_error(self) -> None:
        config = LabConfig(world_size=3, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.SWITCH)
        with Lab(config) as lab:
            names = set(lab.namespaces)
            assert names <= _existing_namespaces()
        assert not names & _existing_namespaces()

        with pytest.raises(KeyError, match="boom"), Lab(config) as lab:
            names = set(lab.namespaces)
            assert names <= _existing_namespaces()
            raise KeyError("boom")
        assert not names & _existing_namespaces()

    def test_failed_setup_leaves_nothing_behind(self) -> None:
        config = LabConfig(
            world_size=2,
            rate_bits_per_s=RATE_BITS_PER_S,
            topology=Topology.RING,
            congestion_control="nosuchalgorithm",
        )
        lab = Lab(config)
        with pytest.raises(RuntimeError, match="nosuchalgorithm"), lab:
            pass
        assert not set(lab.namespaces) & _existing_namespaces()
        with pytest.raises(RuntimeError, match="only once"), lab:
            pass

    def test_exit_ends_registered_process(self) -> None:
        config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.MESH)
        with Lab(config) as lab:
            proc = subprocess.Popen(lab.wrap_command(1, ["sleep", "60"]))
            lab.register_pid(proc.pid)
        try:
            assert proc.wait(timeout=10) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
    def test_signal_tears_down(self, signum: signal.Signals) -> None:
        # The child loads netlab.py by path: importing the package would import torch (~3 s).
        script = textwrap.dedent(
            """
            import importlib.util, json, signal, subprocess, sys, time
            # A shell's background job starts with SIGINT ignored; the lab respects that.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            spec = importlib.util.spec_from_file_location("netlab", sys.argv[1])
            netlab = importlib.util.module_from_spec(spec)
            sys.modules["netlab"] = netlab
            spec.loader.exec_module(netlab)
            config = netlab.LabConfig(world_size=2, rate_bits_per_s=1e8, topology="ring")
            try:
                with netlab.Lab(config) as lab:
                    registered = subprocess.Popen(lab.wrap_command(0, ["sleep", "60"]))
                    lab.register_pid(registered.pid)
                    unregistered = subprocess.Popen(lab.wrap_command(1, ["sleep", "60"]))
                    time.sleep(0.2)  # let `ip netns exec` enter the namespace
                    pids = [registered.pid, unregistered.pid]
                    print(json.dumps({"names": lab.namespaces, "pids": pids}), flush=True)
                    time.sleep(60)
            finally:
                print("the caller's clean-up ran", file=sys.stderr)
            """
        )
        netlab_path = _NETLAB_PATH
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(netlab_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started: dict[str, list[Any]] = {"names": [], "pids": []}
        try:
            assert proc.stdout is not None
            started = json.loads(proc.stdout.readline() or "{}")
            names = set(started["names"])
            assert len(names) == 2
            assert names <= _existing_namespaces()
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:  # the lab under test failed: clean up after it
                proc.kill()
                proc.wait(timeout=10)
                for pid in started["pids"]:
                    if running(pid):
                        os.kill(pid, signal.SIGKILL)
                for name in set(started["names"]) & _existing_namespaces():
                    subprocess.run(["ip", "netns", "del", name], timeout=10, check=False)
        # After teardown the previous handler ran: Python's KeyboardInterrupt for SIGINT (an
        # uncaught one ends the process with SIGINT); for SIGTERM, whose default action would
        # skip the caller's clean-up, SystemExit with the status a shell gives it.
        expected = -signum if signum == signal.SIGINT else 128 + signum
        assert proc.returncode == expected, err
        assert ("KeyboardInterrupt" in err) == (signum == signal.SIGINT), err
        assert "the caller's clean-up ran" in err, err
        assert not names & _existing_namespaces()
        # Both sleeps were ended, registered or not.
        deadline = time.monotonic() + 5
        while any(running(pid) for pid in started["pids"]):
            assert time.monotonic() < deadline, f"still running: {started['pids']}"
            time.sleep(0.05)

    def test_next_lab_removes_a_killed_owners_lab(self) -> None:
        # The owner is SIGKILLed: no teardown runs. A process left inside (not registered)
        # keeps running. Before: nothing ever removed either.
        script = textwrap.dedent(
            """
            import importlib.util, json, subprocess, sys, time
            spec = importlib.util.spec_from_file_location("netlab", sys.argv[1])
            netlab = importlib.util.module_from_spec(spec)
            sys.modules["netlab"] = netlab
            spec.loader.exec_module(netlab)
            config = netlab.LabConfig(world_size=2, rate_bits_per_s=1e8, topology="switch")
            with netlab.Lab(config) as lab:
                inside = subprocess.Popen(lab.wrap_command(1, ["sleep", "60"]))
                time.sleep(0.2)  # let `ip netns exec` enter the namespace
                print(json.dumps({"names": lab.namespaces, "pid": inside.pid}), flush=True)
                time.sleep(60)
            """
        )
        netlab_path = _NETLAB_PATH
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(netlab_path)], stdout=subprocess.PIPE, text=True
        )
        started: dict[str, Any] = {"names": [], "pid": 0}
        try:
            assert proc.stdout is not None
            started = json.loads(proc.stdout.readline() or "{}")
            names = set(started["names"])
            assert len(names) == 3  # two ranks and the switch
            proc.kill()
            proc.wait(timeout=10)
            assert names <= _existing_namespaces()
            assert running(started["pid"])
            config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology="mesh")
            with (
                pytest.warns(RuntimeWarning, match="owner process is gone") as caught,
                Lab(config) as lab,
            ):
                assert not names & _existing_namespaces()
                assert set(lab.namespaces) <= _existing_namespaces()  # its own lab is built
            assert all(name in str(caught[0].message) for name in names)
            deadline = time.monotonic() + 5
            while running(started["pid"]):
                assert time.monotonic() < deadline, "the process inside the stale lab runs on"
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if started["pid"] and running(started["pid"]):
                os.kill(started["pid"], signal.SIGKILL)
            for name in set(started["names"]) & _existing_namespaces():
                subprocess.run(["ip", "netns", "del", name], timeout=10, check=False)

    def test_live_labs_are_not_stale(self) -> None:
        config = LabConfig(world_size=2, rate_bits_per_s=RATE_BITS_PER_S, topology=Topology.MESH)
        with Lab(config) as lab:
            assert remove_stale_labs() == []
            assert set(lab.namespaces) <= _existing_namespaces()
