"""Bad input raises a ValueError naming the argument; failed or mismatched ranks never hang."""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import tokenring
from tokenring.launch import LaunchError


def _qkv(b=1, s=4, hq=4, hkv=2, d=8, dtype=torch.float32):
    return (
        torch.randn(b, s, hq, d, dtype=dtype),
        torch.randn(b, s, hkv, d, dtype=dtype),
        torch.randn(b, s, hkv, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v: (q.double(), k, v), r"k.dtype must equal q.dtype"),
        (lambda q, k, v: (q, k, v[:, :, :1]), r"k and v must have the same shape"),
        (lambda q, k, v: (q, k[:, :3], v[:, :3]), r"k must have shape \(batch=1, seq_local=4"),
        (lambda q, k, v: (q[..., :4], k, v), r"k must have shape .*head_dim=4"),
        (
            lambda q, k, v: (q[:, :, :3], k, v),
            r"heads_kv must divide heads_q; got heads_q=3, heads_kv=2",
        ),
        (lambda q, k, v: (q[0], k, v), r"q must have 4 dims"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), r"q.dtype must be one of"),
        (lambda q, k, v: (q, k.to("meta"), v.to("meta")), r"k.device must equal q.device"),
    ],
)
def test_bad_tensors(single_rank_group: None, change, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tokenring.token_ring_attn(*change(*_qkv()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layout": "spiral"}, "layout must be one of 'contiguous', 'zigzag'; got 'spiral'"),
        ({"strategy": "teleport"}, "strategy must be one of"),
        ({"strategy": "hybrid"}, r"runs on a 2-D mesh, not one group: call tokenring.hybrid_attn"),
        ({"softmax_scale": -1.0}, "softmax_scale must be a finite number > 0"),
        ({"kernel": "warp_drive"}, "kernel must be one of"),
        ({"last_block_splits": 0}, "last_block_splits must be >= 1; got 0"),
        (
            {"strategy": "ring", "last_block_splits": 2},
            r"last_block_splits is read only by the pass-Q strategies \('token_ring', "
            r"'bidir_token_ring'\) and 'auto'; got last_block_splits=2 with strategy='ring'",
        ),
        ({"strategy": "ulysses", "last_block_splits": 1}, "with strategy='ulysses'"),
        ({"strategy": "bidir_ring", "last_block_splits": 3}, "with strategy='bidir_ring'"),
        ({"strategy": "allgather_kv", "last_block_splits": 2}, "with strategy='allgather_kv'"),
        ({"group": "everyone"}, "group must be a ProcessGroup"),
    ],
)
def test_bad_options(single_rank_group: None, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tokenring.sequence_parallel_attn(*_qkv(), **kwargs)


@pytest.mark.parametrize("strategy", ["token_ring", "bidir_token_ring", "ring", "ulysses"])
def test_last_block_splits_is_taken_where_it_is_read(single_rank_group: None, strategy) -> None:
    """A given last_block_splits runs with the pass-Q strategies (and is refused with the others,
    above); left None it runs with every strategy."""
    q, k, v = _qkv(hkv=4)
    ref = tokenring.sequence_parallel_attn(q, k, v, strategy="allgather_kv", causal=True)
    splits = {"last_block_splits": 3} if strategy in ("token_ring", "bidir_token_ring") else {}
    out = tokenring.sequence_parallel_attn(q, k, v, strategy=strategy, causal=True, **splits)
    torch.testing.assert_close(out, ref)


def test_zigzag_needs_even_local_length(single_rank_group: None) -> None:
    with pytest.raises(
        ValueError,
        match=r"q.shape\[1\] \(seq_local\) must be even for layout 'zigzag' when every rank "
        r"holds the same number of tokens; got 5 \(pass seq_len= for any length\)",
    ):
        tokenring.ring_attn(*_qkv(s=5), causal=True, layout="zigzag")
    # with seq_len the same shard is fine: on one rank, 5 tokens are the whole sequence
    out = tokenring.ring_attn(*_qkv(s=5), causal=True, layout="zigzag", seq_len=5)
    assert out.shape[1] == 5


def test_shard_length_must_match_seq_len(single_rank_group: None) -> None:
    with pytest.raises(ValueError, match=r"q.shape\[1\] must be 6 on rank 0: its share of "):
        tokenring.ring_attn(*_qkv(s=5), causal=True, layout="zigzag", seq_len=6)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        tokenring.ring_attn(*_qkv(s=6), layout="zigzag", seq_len=6, cu_seqlens=[1, 6])
    with pytest.raises(ValueError, match="window_size must be"):
        tokenring.ring_attn(*_qkv(s=6), layout="zigzag", window_size=(-2, 0))
    with pytest.raises(ValueError, match="seq_len must be an int >= 0"):
        tokenring.ring_attn(*_qkv(s=6), layout="zigzag", seq_len=-1)


def test_module_wrapper_and_one_rank_equals_sdpa(single_rank_group: None) -> None:
    q, k, v = _qkv(hkv=4)
    module = tokenring.SequenceParallelAttention(strategy="ring", causal=True)
    out = module(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    assert "strategy=ring" in repr(module)


# -- multi-rank failures (functions run inside launched ranks) -------------------------------


def mismatched_seq_local() -> None:
    rank = dist.get_rank()
    q, k, v = _qkv(s=6 if rank == 1 else 4)
    tokenring.token_ring_attn(q, k, v)


def one_rank_raises() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom: rank 1 broke before attention")
    tokenring.token_ring_attn(*_qkv(), check_ranks=False)


SLOW_PEER_TIMEOUT_S = 2.0  # the slow peer's timeout (the group's, or a communicator's)


def one_rank_too_slow(where: str) -> None:
    if where == "groups":  # a fresh communicator: building it waits for every member
        group = dist.new_group(ranks=[0, 1])
        if dist.get_rank() == 1:
            time.sleep(30)
        comm = tokenring.Communicator(group, timeout_s=SLOW_PEER_TIMEOUT_S)
        tokenring.token_ring_attn(*_qkv(), check_ranks=False, group=comm)
        return
    if dist.get_rank() == 1:
        time.sleep(30)
    tokenring.token_ring_attn(*_qkv(), check_ranks=False)


def test_mismatched_ranks_fail_with_the_difference() -> None:
    with pytest.raises(LaunchError, match="seq_local: rank 0 has 4, rank 1 has 6"):
        tokenring.launch(mismatched_seq_local, world_size=3, timeout_s=60)


def test_failed_rank_is_the_reported_root_cause_and_nobody_hangs() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        tokenring.launch(one_rank_raises, world_size=3, timeout_s=60, pg_timeout_s=60)
    assert info.value.failed_rank == 1
    assert "boom: rank 1 broke before attention" in str(info.value)
    # Ranks 0 and 2 sit in a P2P wait with a 60 s timeout; the launcher must end them at once.
    assert time.monotonic() - start < 30


def one_rank_is_killed() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: no report, no traceback
    dist.barrier()  # the peers: "Connection reset by peer" at once


def test_a_killed_rank_is_named_not_the_peers_that_lost_their_connection() -> None:
    # Before: its peers reported "Connection reset by peer" at once, while the launcher dated
    # the kill when its next poll saw it, so a peer was named as the root cause.
    with pytest.raises(LaunchError) as info:
        tokenring.launch(one_rank_is_killed, world_size=3, timeout_s=60, pg_timeout_s=60)
    assert info.value.failed_rank == 1
    assert "rank 1 exited with signal SIGKILL without a result" in str(info.value)


def test_a_rank_whose_register_pid_raised_is_ended() -> None:
    # Before: the rank started but was not yet in the list the launcher ends, so it lived on
    # (waiting for its peers until the group's timeout).
    pids: list[int] = []

    def register(pid: int) -> None:
        pids.append(pid)
        raise RuntimeError("registry full")

    with pytest.raises(RuntimeError, match="registry full"):
        tokenring.launch(one_rank_raises, world_size=2, register_pid=register, pg_timeout_s=60)
    (pid,) = pids
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


SLOW_PEER_CASES = {
    "p2p": "rank 0: receive of 'q' rows (0, 4) of owner 1 from rank 1 at step 0 failed",
    "groups": "rank 0: creating the 'travel' process group of lane 0 over ranks [0, 1] failed",
}


def _slow_peer_launch(where: str) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        tokenring.launch(
            one_rank_too_slow, where, world_size=2, timeout_s=60, pg_timeout_s=SLOW_PEER_TIMEOUT_S
        )
    except BaseException as exc:
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.fixture(scope="module")
def slow_peer_launches() -> dict[str, tuple[BaseException | None, float]]:
    """Each case's launch (its error, its seconds), both at once: each waits out its 2 s
    timeout with one rank asleep and the other waiting, so neither needs the cores."""
    with pytest.MonkeyPatch.context() as patch:
        # Rank 1 sleeps and never reports: the launcher's grace for the others' reports (3 s)
        # would only be waited out before rank 1 is ended and named.
        patch.setattr(sys.modules["tokenring.launch"], "_REPORT_GRACE_S", 0.5)
        with ThreadPoolExecutor(max_workers=len(SLOW_PEER_CASES)) as pool:
            done = {where: pool.submit(_slow_peer_launch, where) for where in SLOW_PEER_CASES}
            return {where: future.result() for where, future in done.items()}


@pytest.mark.parametrize("where", list(SLOW_PEER_CASES))
def test_slow_peer_times_out_with_a_message_naming_the_cause(
    where: str, slow_peer_launches: dict[str, tuple[BaseException | None, float]]
) -> None:
    error, elapsed_s = slow_peer_launches[where]
    assert isinstance(error, LaunchError), error
    assert error.failed_rank == 0
    assert SLOW_PEER_CASES[where] in str(error)
    timeout = f"{SLOW_PEER_TIMEOUT_S:g} s"  # the timeout that fired
    assert f"slower than {timeout}" in str(error) or f"within {timeout}" in str(error)
    # and the slow rank is named (before: only "a peer ... is slower")
    assert "ranks [1] had not finished when ended\n--- rank 1 log tail ---" in str(error)
    assert elapsed_s < 25  # the 2 s timeout fired; rank 1 still sleeping was ended


def test_launch_rejects_main_module_functions_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1; got 0"):
        tokenring.launch(one_rank_raises, world_size=0)
    # before: 2.0 a TypeError once the temp dir existed, threads_per_rank=0 silently the
    # default, -1 a failure inside every rank
    for kwargs, words in [
        ({"world_size": 2.0}, r"world_size must be >= 1; got 2.0 \(a float, not an int\)"),
        ({"world_size": True}, r"world_size must be >= 1; got True \(a bool, not an int\)"),
        ({"world_size": 2, "threads_per_rank": 0}, "threads_per_rank must be >= 1; got 0"),
        ({"world_size": 2, "threads_per_rank": -1}, "threads_per_rank must be >= 1; got -1"),
    ]:
        with pytest.raises(ValueError, match=words):
            tokenring.launch(one_rank_raises, **kwargs)


def device_mesh_groups() -> tuple[float, str]:
    """A 1-D DeviceMesh works as the group; a 2-D one is refused with the fix."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4 * world, 2, 8, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
    part = tokenring.shard
    local = [part(x, rank=rank, world_size=world, layout="zigzag") for x in (q, k, v)]
    out = tokenring.token_ring_attn(*local, causal=True, layout="zigzag", group=mesh)
    error = (out - part(ref, rank=rank, world_size=world, layout="zigzag")).abs().max().item()
    mesh_2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "sp"))
    try:
        tokenring.ring_attn(*local, group=mesh_2d)
    except ValueError as exc:
        return error, str(exc)
    return error, "no error"


def test_device_mesh_as_group() -> None:
    for error, message in tokenring.launch(device_mesh_groups, world_size=4, timeout_s=90):
        assert error < 1e-12
        assert "group must be a 1-D DeviceMesh; got a mesh with ndim=2" in message
