"""The shared-memory transport (Note [Shared-memory transport] in tokenring.runtime.shm): the
same bits as sockets, the float64 oracle, the same counted bytes, segments reused and released,
and every rank on one transport.

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tokenring
from common import running
from oracle import make_inputs, oracle_with_grads, owned_positions, tolerance_failures
from tokenring.launch import LaunchError
from tokenring.runtime.comm import Communicator
from tokenring.runtime.shm import ENV_VAR, SharedMemoryLinks, make_inboxes, shm_wanted

P2P_STRATEGIES = ("token_ring", "ring", "bidir_ring", "bidir_token_ring")


def _memfds() -> int:
    """This process's open descriptors of message segments (not of inboxes: the launcher's
    default communicator keeps its own)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum("memfd:tokenring-" in name and "-to-" in name for name in names)


def _both_transports() -> list[str]:
    """Every ring strategy, causal or not, zigzag and contiguous, through a shared-memory
    communicator and a socket one: bitwise equal, within 1e-10 of the oracle, the same bytes
    counted; messages big enough to go through shared memory. The same schedule on both: the
    last block in 2 slices (left to the transport, shared memory takes 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = Communicator(shared_memory=True, timeout_s=60)
    sockets = Communicator(shared_memory=False, timeout_s=60)
    assert shared.path(torch.device("cpu")) == "gloo-shm", "shared memory not taken"
    assert sockets.path(torch.device("cpu")) == "gloo"
    seq = 64 * world
    q, k, v, dout = make_inputs(seed=5, batch=1, seq_global=seq, heads_q=4, heads_kv=2, head_dim=16)
    problems = []
    for strategy in P2P_STRATEGIES:
        for layout in ("zigzag", "contiguous"):
            for causal in (True, False):
                idx = torch.tensor(owned_positions(layout, rank, world, seq))
                want = oracle_with_grads(q, k, v, dout, causal=causal, scale=16**-0.5)
                results = []
                for comm in (shared, sockets):
                    comm.counter.reset()
                    local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
                    # read by the pass-Q strategies only (the others refuse it)
                    pass_q = strategy in ("token_ring", "bidir_token_ring")
                    splits = {"last_block_splits": 2} if pass_q else {}
                    out = tokenring.sequence_parallel_attn(
                        *local, strategy=strategy, causal=causal, layout=layout, group=comm,
                        **splits,
                    )  # fmt: skip
                    out.backward(dout[:, idx])
                    got = [out.detach(), *(x.grad for x in local)]
                    counted = (dict(comm.counter.sent_bytes), dict(comm.counter.recv_bytes))
                    results.append((got, counted))
                case = f"rank {rank} {strategy} {layout} causal={causal}"
                (got, counted), (other, other_counted) = results
                if not all(torch.equal(a, b) for a, b in zip(got, other, strict=True)):
                    problems.append(f"{case}: shared memory differs from sockets")
                if counted != other_counted:
                    problems.append(f"{case}: bytes counted {counted} vs {other_counted}")
                for name, x in zip(("out", "dq", "dk", "dv"), got, strict=True):
                    err = (x - want[name][:, idx]).abs().max().item()
                    if err > 1e-10:
                        problems.append(f"{case}: {name} off by {err:.3g}")
    links = shared.shared
    assert links is not None
    if links.num_written == 0 or links.num_viewed == 0:
        problems.append(f"rank {rank}: no message went through shared memory")
    gc.collect()
    if links.num_lent:
        problems.append(f"rank {rank}: {links.num_lent} segments still held after the calls")
    for comm in (shared, sockets):
        comm.close()
    return problems


def test_every_ring_strategy_gives_the_same_bits_through_shared_memory() -> None:
    per_rank = tokenring.launch(_both_transports, world_size=3, timeout_s=300)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems[:20])


def _odd_sized_messages() -> list[str]:
    """bf16 messages whose fields are odd numbers of elements (head dim 3, 3 rows a rank): a
    field after one of them in the header frame must still be viewable as its dtype
    (TokenRing's fp32 lse after its bf16 partial failed: 'storage_offset() must be divisible
    by 4'); every strategy, both transports, against the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for shared_memory in (True, False):
        comm = Communicator(shared_memory=shared_memory, timeout_s=60)
        inputs = make_inputs(seed=7, batch=1, seq_global=6, heads_q=3, heads_kv=1, head_dim=3)
        scale = 3**-0.5
        idx = torch.tensor(owned_positions("contiguous", rank, world, 6))
        want = oracle_with_grads(*inputs, causal=True, scale=scale, dtype=torch.bfloat16)
        for strategy in (*P2P_STRATEGIES, "ulysses", "allgather_kv"):
            local = [x[:, idx].to(torch.bfloat16).requires_grad_(True) for x in inputs[:3]]
            out = tokenring.sequence_parallel_attn(
                *local, strategy=strategy, causal=True, layout="contiguous", group=comm
            )
            out.backward(inputs[3][:, idx].to(torch.bfloat16))
            got = dict(zip(("out", "dq", "dk", "dv"), [out, *(x.grad for x in local)], strict=True))
            mine = {name: want[name][:, idx] for name in got}
            case = f"rank {rank} {strategy} shared_memory={shared_memory}"
            problems += [
                f"{case}: {failure}"
                for failure in tolerance_failures(
                    got,
                    mine,
                    dtype=torch.bfloat16,
                    inputs=inputs,
                    reference=want,
                    causal=True,
                    scale=scale,
                )
            ]
        comm.close()
    return problems


def test_odd_sized_bf16_messages_travel_on_both_transports() -> None:
    per_rank = tokenring.launch(_odd_sized_messages, world_size=2, timeout_s=300)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems[:20])


def _segments_per_call(num_calls: int) -> dict[str, object]:
    """Segments made over repeated calls, and descriptors left after close."""
    comm = Communicator(shared_memory=True, timeout_s=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = 128 * world
    q, k, v, dout = make_inputs(seed=2, batch=1, seq_global=seq, heads_q=4, heads_kv=4, head_dim=16)
    idx = torch.tensor(owned_positions("zigzag", rank, world, seq))
    counts, messages = [], 0
    for _ in range(num_calls):
        comm.counter.reset()
        local = [x[:, idx].float().requires_grad_(True) for x in (q, k, v)]
        out = tokenring.token_ring_attn(*local, causal=True, layout="zigzag", group=comm)
        out.backward(dout[:, idx].float())
        links = comm.shared
        assert links is not None
        counts.append(links.num_segments)
        messages = max(messages, comm.counter.sent_messages)
    before_close = _memfds()
    comm.barrier(label="all calls done")
    comm.close()
    gc.collect()
    after_close = _memfds()
    return {"counts": counts, "messages": messages, "before": before_close, "after": after_close}


def test_segments_are_reused_and_their_descriptors_closed() -> None:
    """Segments are reused: over 6 calls a rank makes fewer than one call sends messages
    (without reuse: 6 times as many). A closed communicator's descriptors are closed once
    every receiver has mapped its segments (here: all were)."""
    per_rank = tokenring.launch(_segments_per_call, 6, world_size=3, timeout_s=120)
    for rank, result in enumerate(per_rank):
        counts, messages = result["counts"], result["messages"]
        assert 0 < counts[0][0] <= counts[-1][0] < messages, (rank, counts, messages)
        assert result["before"] > 0, (rank, result)
        assert result["after"] == 0, (rank, result)


def _paths_when_one_rank_refuses() -> str:
    option = False if dist.get_rank() == 1 else None
    return Communicator(shared_memory=option, timeout_s=30).path(torch.device("cpu"))


def test_one_rank_asking_for_sockets_puts_every_rank_on_sockets() -> None:
    assert tokenring.launch(_paths_when_one_rank_refuses, world_size=3) == ["gloo"] * 3


def _path_from_environment() -> str:
    return tokenring.get_communicator().path(torch.device("cpu"))


def test_the_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    assert tokenring.launch(_path_from_environment, world_size=2) == ["gloo"] * 2


def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="TOKENRING_SHARED_MEMORY must be 0 or 1; got 'maybe'"):
        shm_wanted(None)
    assert shm_wanted(False) is False


def _loopback(pid: int) -> tuple[SharedMemoryLinks, torch.Tensor]:
    """Links whose one peer is this process's own inbox (rank 1 sends to itself), the peer's
    process id ``pid``; and a header to send."""
    fd, inboxes = make_inboxes(2, token=7)
    os.close(fd)
    links = SharedMemoryLinks(1, [0, pid], inboxes, {1: inboxes})
    return links, torch.arange(64, dtype=torch.uint8)


def test_frames_of_odd_sizes_keep_their_alignment_in_a_segment() -> None:
    """A frame after one of an odd size starts where its dtype can be viewed (a 6-byte bf16
    frame before an fp32 one made its view fail), and every frame holds what was written."""
    links, header = _loopback(os.getpid())
    odd = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)
    frames = [[header, odd], [torch.arange(5.0)], [odd], [torch.arange(2, dtype=torch.float64)]]
    sizes = [sum(t.numel() * t.element_size() for t in frame) for frame in frames]
    got = links.view(1, links.write(1, frames), sizes)
    for frame, parts in zip(got, frames, strict=True):
        whole = torch.cat([t.reshape(-1).view(torch.uint8) for t in parts])
        assert torch.equal(frame, whole)
        assert torch.equal(
            frame[-parts[-1].numel() * parts[-1].element_size() :].view(parts[-1].dtype), parts[-1]
        )


def _ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_inbox_delivers_in_order_and_bounds_every_wait() -> None:
    links, header = _loopback(os.getpid())
    got = torch.zeros(64, dtype=torch.uint8)
    links.post(1, header, timeout_s=1)
    links.post(1, header + 1, timeout_s=1)
    assert [links.expect(1), links.expect(1), links.expect(1)] == [0, 1, 2]
    assert links.arrived(1, 1) and not links.arrived(1, 2)
    links.wait(1, 1, got, timeout_s=1)  # out of order: the second first
    assert torch.equal(got, header + 1)
    links.wait(1, 0, got, timeout_s=1)
    assert torch.equal(got, header)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no message within 0\.3 s"):
        links.wait(1, 2, got, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2


def test_a_gone_sender_is_named_within_a_fraction_of_a_second() -> None:
    links, _ = _loopback(_ended_pid())
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="rank 1 is gone"):
        links.wait(1, 0, torch.zeros(64, dtype=torch.uint8), timeout_s=60)
    assert time.monotonic() - start < 2


def test_a_full_inbox_fails_the_send_within_the_timeout() -> None:
    links, header = _loopback(os.getpid())
    for _ in range(512):  # the inbox's slots, none read
        links.post(1, header, timeout_s=1)
    with pytest.raises(RuntimeError, match=r"rank 1 left 512 messages unread for 0\.2 s"):
        links.post(1, header, timeout_s=0.2)
    links.wait(1, links.expect(1), torch.zeros(64, dtype=torch.uint8), timeout_s=1)
    links.post(1, header, timeout_s=0.2)  # one read: room for one more


def test_a_rank_that_gave_up_is_named_at_once() -> None:
    """A waiting receive wakes when its sender's communicator gives up (a futex wake), and a
    send to a full inbox of a rank that gave up fails at once, both naming the rank."""
    links, header = _loopback(os.getpid())
    got = torch.zeros(64, dtype=torch.uint8)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            links.wait(1, links.expect(1), got, timeout_s=60)
        except ConnectionError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    assert not links.gave_up(1) and waiter.is_alive()
    links.give_up()
    waiter.join(timeout=5)
    assert links.gave_up(1) and not waiter.is_alive()
    assert time.monotonic() - start < 1.5
    assert "rank 1 is gone from this communicator" in str(raised[0])
    for _ in range(512):  # fill the inbox: the next send waits for a reader that gave up
        links.post(1, header, timeout_s=1)
    with pytest.raises(RuntimeError, match="rank 1 is gone from this communicator"):
        links.post(1, header, timeout_s=30)


def _exchanges(shared_memory: bool) -> dict[str, object]:
    """``all_gather_bytes`` of several sizes (a digest frame up to 2 MiB), with the messages
    that went through shared memory; then ranks that disagree on the frame size."""
    comm = Communicator(shared_memory=shared_memory, timeout_s=10)
    rank = dist.get_rank()
    links = comm.shared
    before = links.num_written if links is not None else 0
    gathered = [
        comm.all_gather_bytes(bytes([rank + 1]) * n, what="sizes", frame_num_bytes=n + 8)
        for n in (16, 4088, 2 << 20)
    ]
    written = (links.num_written if links is not None else 0) - before
    mismatch = "not tried"  # over gloo's sockets a size mismatch aborts the process
    try:
        if links is not None:
            comm.all_gather_bytes(b"x", what="mismatch", frame_num_bytes=24 if rank else 4096)
            mismatch = "ok"
    except RuntimeError as exc:
        mismatch = str(exc)
    return {"gathered": gathered, "written": written, "mismatch": mismatch}


def test_exchanges_of_bytes_go_through_the_inboxes() -> None:
    """Note [Exchanges through shared memory]: every rank gets every rank's bytes, as over
    sockets, one message per peer and exchange through shared memory; there, frames of
    different sizes fail on both ends, naming the peer."""
    world = 3
    for shared_memory in (True, False):
        per_rank = tokenring.launch(_exchanges, shared_memory, world_size=world, timeout_s=120)
        for rank, got in enumerate(per_rank):
            want = [[bytes([r + 1]) * n for r in range(world)] for n in (16, 4088, 2 << 20)]
            assert got["gathered"] == want, rank
            if not shared_memory:
                assert got["written"] == 0
                continue
            assert got["written"] == 3 * (world - 1), (rank, got["written"])
            assert "sent another message" in str(got["mismatch"]), (rank, got["mismatch"])
            assert "runs other code" in str(got["mismatch"]), (rank, got["mismatch"])


def _sender_exits_after_sending(out_file: str) -> None:
    """Rank 1 posts its exchange frame and exits at once; rank 0 then finds the frame in its
    inbox but the segment gone with its sender, and writes what it raised."""
    comm = Communicator(shared_memory=True, timeout_s=20)
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        comm._post_gather(b"sent", what="an exchange", frame_num_bytes=64)
        os._exit(0)
    while running(pids[1]):  # until rank 1 has exited (a zombie has closed its files)
        time.sleep(0.01)
    start = time.monotonic()
    try:
        comm.all_gather_bytes(b"mine", what="an exchange", frame_num_bytes=64)
        outcome = "ok"
    except RuntimeError as exc:
        outcome = str(exc)
    with open(out_file, "w") as f:
        f.write(f"{time.monotonic() - start:.3f} {outcome}")


def test_a_frame_whose_sender_exited_names_the_sender(tmp_path: Path) -> None:
    """An exchange frame announced by a rank that exited before it was read: its segment went
    with it; the exchange fails at once naming that rank (not an error about the file)."""
    out_file = tmp_path / "rank0.txt"
    with contextlib.suppress(LaunchError):  # rank 1 exits without a result
        tokenring.launch(_sender_exits_after_sending, str(out_file), world_size=2, timeout_s=60)
    elapsed, outcome = out_file.read_text().split(" ", 1)
    assert "rank 0: an exchange: rank 1 is gone (it exited or crashed)" in outcome, outcome
    assert float(elapsed) < 2


def _messages_per_split() -> dict[str, object]:
    """Messages a TokenRing forward sends with ``last_block_splits`` left to the transport or
    given, through shared memory and through sockets, and its distance from the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = 32 * world
    q, k, v, _ = make_inputs(seed=9, batch=1, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8)
    idx = torch.tensor(owned_positions("zigzag", rank, world, seq))
    want = oracle_with_grads(q, k, v, torch.zeros_like(q), causal=True, scale=8**-0.5)["out"]
    found: dict[str, object] = {}
    for transport in ("shared", "sockets"):
        comm = Communicator(shared_memory=transport == "shared", timeout_s=60)
        for splits in (None, 1, 2):
            comm.counter.reset()
            out = tokenring.token_ring_attn(
                *(x[:, idx] for x in (q, k, v)), causal=True, layout="zigzag", group=comm,
                last_block_splits=splits,
            )  # fmt: skip
            found[f"{transport} {splits}"] = comm.counter.sent_messages
            found[f"{transport} {splits} error"] = float((out - want[:, idx]).abs().max())
        comm.close()
    return found


def test_the_last_block_is_one_slice_through_shared_memory() -> None:
    """Note [Last block slices] in tokenring.api: left to the transport, TokenRing returns its
    last block whole through shared memory and in two slices over sockets (one message more
    per rank); an int given is used on both; every result matches the oracle."""
    for rank, found in enumerate(tokenring.launch(_messages_per_split, world_size=3)):
        assert found["shared None"] == found["shared 1"] == found["sockets 1"], (rank, found)
        assert found["sockets None"] == found["sockets 2"] == found["shared 2"], (rank, found)
        assert found["sockets 2"] == found["sockets 1"] + 1, (rank, found)
        errors = [v for key, v in found.items() if key.endswith("error")]
        assert max(errors) < 1e-10, (rank, found)


def _idle_segments_after_a_pass(idle_num_bytes: int) -> tuple[int, int, int]:
    """Segments written and mapped, and descriptors open, after two calls that end with
    ``idle_num_bytes`` of idle segments allowed (a receiver unmaps what its senders retired at
    its own next release: one pass later)."""
    comm = Communicator(shared_memory=True, timeout_s=60)
    assert comm.shared is not None
    comm.shared.idle_num_bytes = idle_num_bytes
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = 128 * world
    q, k, v, dout = make_inputs(seed=4, batch=1, seq_global=seq, heads_q=4, heads_kv=4, head_dim=16)
    idx = torch.tensor(owned_positions("zigzag", rank, world, seq))
    for _ in range(2):
        local = [x[:, idx].float().requires_grad_(True) for x in (q, k, v)]
        out = tokenring.ring_attn(*local, causal=True, layout="zigzag", group=comm)
        out.backward(dout[:, idx].float())
        del local, out
        gc.collect()
        comm.barrier(label="every rank consumed its messages")
        comm.wait_sends()  # a pass's end: releases
    comm.barrier(label="every sender retired what it does not keep")
    comm.wait_sends()  # a receiver unmaps what its senders retired at their last release
    written, mapped = comm.shared.num_segments
    return written, mapped, _memfds()


def test_idle_segments_are_released_at_a_pass_end() -> None:
    """With no idle memory allowed, nothing stays between calls: no segment written or mapped,
    no descriptor open; with the default budget the segments stay to be written again."""
    for rank, got in enumerate(tokenring.launch(_idle_segments_after_a_pass, 0, world_size=3)):
        assert got == (0, 0, 0), (rank, got)
    for rank, got in enumerate(
        tokenring.launch(_idle_segments_after_a_pass, 64 << 20, world_size=3)
    ):
        assert got[0] > 0 and got[2] > 0, (rank, got)
