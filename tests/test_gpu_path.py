"""What of the GPU path can be checked on the CPU: which path messages take (the staged path
for P ranks on one GPU), the staging logic itself, and our named ranges in torch.profiler."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import tokenring
from oracle import make_inputs, owned_positions
from tokenring.runtime.comm import Communicator, comm_path


def test_comm_path() -> None:
    assert comm_path("nccl", torch.device("cuda", 0)) == "nccl"
    assert comm_path("gloo", torch.device("cuda", 0)) == "gloo-staged"
    assert comm_path("gloo", torch.device("cpu")) == "gloo"


def _staged_equals_direct() -> list[str]:
    """Every strategy through a communicator that stages through host buffers (the staged
    path's logic, with plain host copies on the CPU) gives bitwise what the direct one does
    (the same schedule: TokenRing's last block in 2 slices on both, where the transport
    would choose 1 for shared memory: Note [Last block slices] in tokenring.api)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    staged = Communicator(stage_through_host=True)
    assert staged.path(torch.device("cpu")) == "gloo-staged"
    assert tokenring.get_communicator().path(torch.device("cpu")) == "gloo-shm"
    q, k, v, dout = make_inputs(
        seed=3, batch=1, seq_global=8 * world, heads_q=4, heads_kv=2, head_dim=8
    )
    idx = torch.tensor(owned_positions("zigzag", rank, world, 8 * world))
    problems = []
    for strategy in ("token_ring", "ring", "bidir_ring", "ulysses", "allgather_kv"):
        results = []
        for group in (None, staged):
            local = [x[:, idx].float().requires_grad_(True) for x in (q, k, v)]
            out = tokenring.sequence_parallel_attn(
                *local, strategy=strategy, causal=True, layout="zigzag", group=group,
                last_block_splits=2 if strategy == "token_ring" else None,
            )  # fmt: skip
            out.backward(dout[:, idx].float())
            results.append([out.detach(), *(x.grad for x in local)])
        if not all(torch.equal(a, b) for a, b in zip(*results, strict=True)):
            problems.append(f"rank {rank} {strategy}: staged differs from direct")
    return problems


def test_staged_path_gives_the_same_bits() -> None:
    per_rank = tokenring.launch(_staged_equals_direct, world_size=3, timeout_s=240)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems)


def test_profiler_trace_has_our_step_ranges(single_rank_group: None) -> None:
    q, k, v, dout = (
        x.float()
        for x in make_inputs(seed=1, batch=1, seq_global=16, heads_q=2, heads_kv=2, head_dim=8)
    )
    q.requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = tokenring.token_ring_attn(q, k, v, causal=True)
        out.backward(dout)
    names = {event.name for event in prof.events()}
    assert "tokenring.token_ring.forward.step0" in names, sorted(names)[:20]
    assert "tokenring.token_ring.backward.step0" in names
