"""An audit of how the entry points take their group: subgroups of a larger world, whose
ranks are not contiguous or not sorted, that ranks enter in different orders, or that some
ranks belong to and others not; communicators closed and built again over them.

Every case runs the call on a group of P ranks out of a world of 4 and checks out, lse and
the gradients of q, k and v against full attention in float64 over that group's sequence
(tests/oracle.py), as the same call on a world of P ranks would give. One launch holds every
case; each communicator gets a short timeout, so a case that hangs fails in seconds.

Legend: B batch, S global seq, Hq query heads, Hkv kv heads, D head dim, P group size.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

import tokenring
from oracle import make_inputs, oracle_with_grads, owned_positions

STRATEGIES = ("token_ring", "ring", "bidir_ring", "bidir_token_ring", "ulysses", "allgather_kv")
TIMEOUT_S = 5.0  # each subgroup communicator's; a naming clash used to wait it out
FAILING_TIMEOUT_S = 1.0  # of the call rank 0 makes alone (its rank check fails after it)
SEQ_LOCAL = 4


def _max_error(group: Any, strategy: str, *, seed: int = 3, timeout_s: float = TIMEOUT_S) -> float:
    """Max abs error of out, lse, dq, dk, dv of one causal zigzag call over ``group`` (a
    ProcessGroup or a 1-D DeviceMesh) against the float64 oracle of its P ranks."""
    pg = group.get_group() if hasattr(group, "get_group") else group
    tokenring.get_communicator(pg, timeout_s=timeout_s)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    seq = 2 * SEQ_LOCAL * world
    q, k, v, dout = make_inputs(
        seed=seed, batch=2, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8
    )
    want = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5)
    rows = owned_positions("zigzag", rank, world, seq)
    leaves = [x[:, rows].clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = tokenring.sequence_parallel_attn(
        *leaves, strategy=strategy, causal=True, layout="zigzag", group=group, return_lse=True
    )
    out.backward(dout[:, rows])
    got = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad}
    got["dv"] = leaves[2].grad
    errors = [(got[n] - want[n][:, rows]).abs().max().item() for n in ("out", "dq", "dk", "dv")]
    errors.append((lse - want["lse"][:, :, rows]).abs().max().item())
    return max(errors)


def _case(errors: dict[str, Any], name: str, group: Any, strategy: str) -> None:
    try:
        errors[name] = _max_error(group, strategy)
    except Exception as exc:  # every case reports, the others still run
        errors[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def subgroup_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    errors: dict[str, Any] = {}
    # groups of every rank made on every rank, in one order
    pairs = {
        "even_odd": [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2],
        "halves": [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2],
    }
    unsorted = "sort_ranks" in inspect.signature(dist.new_group).parameters
    if unsorted:  # group rank i is ranks[i]: the ring runs 3 -> 2 -> 1 -> 0 or 2 -> 0
        pairs["world 3,2,1,0"] = dist.new_group([3, 2, 1, 0], sort_ranks=False)
        made = [dist.new_group(r, sort_ranks=False) for r in ([2, 0], [3, 1])]
        pairs["pairs 2,0 and 3,1"] = made[rank % 2]
    # rank 0 alone in two groups of two: it holds more groups than its peers
    first, second = dist.new_group([0, 1]), dist.new_group([0, 3])
    for i, (name, group) in enumerate(pairs.items()):
        _case(errors, name, group, STRATEGIES[i % len(STRATEGIES)])
    if rank in (0, 1):
        _case(errors, "rank 0's first of two", first, "token_ring")
    if rank in (0, 3):
        _case(errors, "rank 0's second of two", second, "ulysses")
    # a 2 x 2 mesh whose halves enter its two dimensions in opposite orders
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    for dim in ("sp", "dp") if rank < 2 else ("dp", "sp"):
        _case(errors, f"mesh[{dim!r}]", mesh[dim], "bidir_token_ring")
    errors["unsorted"] = unsorted
    # a rank outside a group, and a destroyed group: refused, saying which
    outside = dist.new_group([0, 1])
    gone = dist.new_group([0, 1, 2, 3])
    dist.destroy_process_group(gone)
    q = torch.zeros(1, 4, 2, 8)
    for name, group in (("outside", outside), ("destroyed", gone)):
        if name == "outside" and rank < 2:
            continue
        try:
            tokenring.token_ring_attn(q, q, q, group=group)
            errors[f"refused {name}"] = "no error"
        except ValueError as exc:
            errors[f"refused {name}"] = str(exc)
    return errors


def test_subgroups_match_the_oracle_of_their_size() -> None:
    """Before: a group whose ranks were not sorted (new_group(sort_ranks=False)) built its
    channel groups sorted, so group rank r sent to the wrong peers: the shared-memory probe
    failed after the timeout ("rank 0 is gone"). A rank that held more process groups than
    its peers (rank 0 in [0, 1] and [0, 3]; or after building a communicator over one
    dimension of a mesh while its peer built the other first) named its new channel groups
    apart from theirs (torch names them by the number of groups a rank holds), so building
    them waited out the timeout: "a peer did not join in time"."""
    per_rank = tokenring.launch(subgroup_cases, world_size=4, timeout_s=240, pg_timeout_s=30)
    refused = {
        (rank, name): errors.pop(name)
        for rank, errors in enumerate(per_rank)
        for name in list(errors)
        if name.startswith("refused")
    }
    failures = [
        f"rank {rank}, {name}: {error}"
        for rank, errors in enumerate(per_rank)
        for name, error in errors.items()
        if name != "unsorted" and not (isinstance(error, float) and error < 1e-10)
    ]
    assert not failures, "\n".join(failures)
    names = set(per_rank[0]) | set(per_rank[3])
    assert {"rank 0's first of two", "rank 0's second of two", "mesh['dp']"} <= names
    assert len(per_rank[0]) == 7 + 2 * per_rank[0]["unsorted"]  # every case ran
    # before: "group must be a ProcessGroup, ...; got int" for what dist.new_group returned on
    # ranks 2 and 3, and torch's "Group <...> is not registered" for the destroyed group
    assert sorted(refused) == [(0, "refused destroyed"), (1, "refused destroyed")] + [
        (r, f"refused {name}") for r in (2, 3) for name in ("destroyed", "outside")
    ]
    for (rank, name), message in refused.items():
        words = "got a destroyed one" if "destroyed" in name else "NON_GROUP_MEMBER) on global"
        assert "group must" in message and words in message, (rank, message)


def closed_and_rebuilt(num_steps: int, failing_step: int) -> list[str]:
    """Halves [0, 1] and [2, 3] of a world of 4 call attention each step; after each step every
    rank runs close_communicators(). At ``failing_step`` rank 1 raises before its call, so
    rank 0's rank check times out: rank 0's communicator failed (its groups stay registered,
    never pooled), rank 1's did not. Returns what went wrong on this rank."""
    rank = dist.get_rank()
    half = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    problems = []
    for step in range(num_steps):
        try:
            tokenring.get_communicator(half, timeout_s=TIMEOUT_S)  # built on every rank
            if step == failing_step and rank == 1:
                raise RuntimeError("this rank's own code failed before its call")
            # rank 0 alone in its call at the failing step: a short timeout to wait out
            fails = step == failing_step and rank == 0
            timeout_s = FAILING_TIMEOUT_S if fails else TIMEOUT_S
            strategy = STRATEGIES[step % len(STRATEGIES)]
            error = _max_error(half, strategy, seed=step, timeout_s=timeout_s)
            if fails:
                problems.append(f"step {step}: the call did not fail")
            elif error > 1e-10:
                problems.append(f"step {step}: out differs from the oracle by {error:.3g}")
        except RuntimeError as exc:
            if step != failing_step or rank not in (0, 1):
                problems.append(f"step {step}: {' '.join(str(exc).split())[:300]}")
        tokenring.close_communicators()
        # rank 0 waits out the rank check while rank 1 is already rebuilding, whose pool
        # agreement would give up at the same time: meet first
        dist.barrier()
    return problems


def test_subgroup_communicators_are_built_again_after_close_communicators() -> None:
    """Before: close_communicators() destroyed the channel groups of [0, 1]; the next ones
    took their names back (torch names them by the number of groups a rank holds) and met
    under the old store addresses: from the third step on, 'Connection refused', and each
    call failed after the timeout. After a failure only the rank whose communicator did not
    fail pooled (then destroyed) its groups, so the ranks held different numbers of groups
    and named their new ones apart."""
    per_rank = tokenring.launch(
        closed_and_rebuilt, 6, 2, world_size=4, timeout_s=240, pg_timeout_s=30
    )
    problems = [f"rank {r}: {p}" for r, rank_problems in enumerate(per_rank) for p in rank_problems]
    assert not problems, "\n".join(problems)
