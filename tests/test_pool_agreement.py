"""Pooled process groups (Note [Channel pool] in tokenring.runtime.comm): every rank of a new
communicator reuses the same pooled set, or every rank makes new groups, whatever each rank's
pool holds; so communicators rebuilt on every rank after a failure work.

Each test runs real gloo ranks (``tokenring.launch``) with short timeouts and checks the
rebuilt communicator's call against full attention in float64 (tests/oracle.py).

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import tokenring
from oracle import full_attention, make_inputs
from tokenring.runtime import comm as comm_module
from tokenring.runtime.comm import Communicator

TIMEOUT_S = 2.0  # the communicators' own; the launch's process group waits longer
FAILING_CALL_TIMEOUT_S = 1.0  # the failing step's call, on a communicator built with TIMEOUT_S
SEQ_LOCAL = 4


def _call_error(comm: Communicator) -> float:
    """Max abs error of one causal token-ring call over ``comm`` against the float64 oracle."""
    rank, world = comm.rank, comm.world_size
    q, k, v, _ = make_inputs(
        seed=5, batch=1, seq_global=SEQ_LOCAL * world, heads_q=4, heads_kv=2, head_dim=8
    )
    ref, _ = full_attention(q, k, v, causal=True, scale=8**-0.5)  # (B, S, H, D)
    rows = slice(rank * SEQ_LOCAL, (rank + 1) * SEQ_LOCAL)
    out = tokenring.token_ring_attn(
        q[:, rows], k[:, rows], v[:, rows], causal=True, group=comm
    )  # (B, s, H, D)
    return (out - ref[:, rows]).abs().max().item()


def _steps_with_a_failure(num_steps: int, failing_step: int) -> list[str]:
    """A communicator per step, closed when the step ends. At ``failing_step`` rank 1's own
    code raises before its call, so rank 0's rank check times out: rank 0's communicator
    failed (not pooled), rank 1's did not (pooled). Every rank handles the failure the way
    the README says: close_communicators(), then the next step builds a new one. Returns
    what went wrong on this rank."""
    rank = dist.get_rank()
    problems: list[str] = []
    for step in range(num_steps):
        # Rank 1 raises outside any call, so rank 0 learns of it only at its rank check's
        # timeout; rank 1 is by then waiting in the next build's agreement. That wait must
        # outlast rank 0's timeout, or the rebuild raced it (a fresh-clone CI run lost).
        timeout_s = TIMEOUT_S if step == failing_step else 5 * TIMEOUT_S
        try:
            comm = Communicator(timeout_s=timeout_s)
        except RuntimeError as exc:
            problems.append(f"step {step}: building the communicator failed: {exc}")
            continue
        if step == failing_step:  # its pool key keeps 2 s; rank 0's check waits out 1 s
            comm.timeout = timedelta(seconds=FAILING_CALL_TIMEOUT_S)
        with contextlib.closing(comm):
            try:
                if step == failing_step and rank == 1:
                    raise RuntimeError("this rank's own code failed before its call")
                error = _call_error(comm)
                if step == failing_step:
                    problems.append(f"step {step}: the call did not fail")
                elif error > 1e-10:
                    problems.append(f"step {step}: out differs from the oracle by {error:.3g}")
            except RuntimeError as exc:
                if step != failing_step:
                    problems.append(f"step {step}: the call failed: {exc}")
                tokenring.close_communicators()
    return problems


def test_communicators_rebuilt_after_a_failure_agree_on_pooled_groups() -> None:
    """Before: rank 1 reused its pooled groups while rank 0 (whose communicator failed, so
    pooled nothing) called dist.new_group: the rebuilt communicator failed on both ranks
    after the timeout ("a peer did not join in time"; "probe: rank(s) [0] did not arrive"),
    and every later dist.new_group was out of step between the ranks."""
    per_rank = tokenring.launch(
        _steps_with_a_failure, 4, 1, world_size=2, timeout_s=120, pg_timeout_s=30
    )
    problems = [f"rank {r}: {p}" for r, rank_problems in enumerate(per_rank) for p in rank_problems]
    assert not problems, "\n".join(problems)


def _pools_that_differ() -> dict[str, Any]:
    """Ranks whose pools hold different sets for the same key: each rank of the group pools
    one set made for both ranks, then rank 0 forgets it (as if it had failed there) and both
    pool a second, common set, then rank 1 alone forgets the second. The next communicator
    must use a set both hold (none: new groups) on both ranks."""
    rank = dist.get_rank()
    first = Communicator(timeout_s=TIMEOUT_S)
    first_control = first._own[1] if first._own is not None else None
    first.close()
    key = first._pool_key
    assert key is not None
    if rank == 0:
        comm_module._IDLE_GROUPS[key].clear()
    second = Communicator(timeout_s=TIMEOUT_S)
    second_control = second._own[1] if second._own is not None else None
    second.close()
    if rank == 1:
        comm_module._IDLE_GROUPS[key] = [
            own for own in comm_module._IDLE_GROUPS[key] if own[1] is not second_control
        ]
    third = Communicator(timeout_s=TIMEOUT_S)
    try:
        error = _call_error(third)
        control = third._own[1] if third._own is not None else None
    finally:
        third.close()
    return {
        "error": error,
        "second_reused_first": second_control is first_control,
        "third_new": control is not first_control and control is not second_control,
    }


def test_ranks_whose_pools_differ_take_no_set_only_some_hold() -> None:
    per_rank = tokenring.launch(_pools_that_differ, world_size=2, timeout_s=120, pg_timeout_s=30)
    for rank, seen in enumerate(per_rank):
        assert seen["error"] < 1e-10, (rank, seen)
        assert not seen["second_reused_first"], (rank, seen)  # rank 0 forgot the first
        assert seen["third_new"], (rank, seen)
