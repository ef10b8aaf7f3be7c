"""Audit of the statements the rest of the suite never ran: each reachable one reached here and
checked against the float64 oracle or the documented error.

- Pass-KV backward on a GPU takes only the dK/dV accumulators that have arrived at a step's
  first tile (Note [Buffers in flight] in tokenring.runtime.ring); one that arrives later is
  added into the accumulator the step's tiles already wrote (``_Backward.add_arrived``). On
  CPU every arrival is waited for at the first tile, so that sum never ran: the ranks here run
  the GPU's order on CPU (gloo works report completion only when waited for), and check that
  the sum ran and every gradient is the oracle's.

Legend: B batch, S global seq, Hq / Hkv heads, D head dim, P world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import tokenring
from oracle import make_inputs, oracle_with_grads, sharded_positions, visible_mask
from tokenring.runtime import ring
from tokenring.runtime.comm import Communicator

FP64 = 1e-10

# (strategy, causal, layout, S, window): Ring both ways round, the bidirectional ring's two
# lanes by kv heads, a window with uneven shards
LATE_ARRIVAL_CASES: tuple[tuple[str, bool, str, int, tuple[int, int]], ...] = (
    ("ring", True, "zigzag", 32, (-1, -1)),
    ("ring", False, "contiguous", 24, (-1, -1)),
    ("ring", True, "contiguous", 23, (5, 0)),
    ("bidir_ring", True, "zigzag", 32, (-1, -1)),
)


def _late_arrival_ranks() -> list[str]:
    """Inside a rank: each case's forward and backward with the GPU's non-blocking first tile;
    the problems, as lines (and one if the late sum never ran)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    begin, add_arrived = ring._Backward.begin, ring._Backward.add_arrived
    late = [0]

    def gpu_begin(self: ring._Backward, op: Any) -> None:
        begin(self, op)
        self.blocking = False  # as on CUDA: take only what has arrived

    def counted(self: ring._Backward, *, block: bool) -> None:
        late[0] += sum(lane in self.lane_grads for lane in self.dkv_in)
        add_arrived(self, block=block)

    ring._Backward.begin, ring._Backward.add_arrived = gpu_begin, counted  # type: ignore[method-assign]
    comm = Communicator(shared_memory=False, timeout_s=30)
    problems = []
    for index, (strategy, causal, layout, seq, window) in enumerate(LATE_ARRIVAL_CASES):
        q, k, v, dout = make_inputs(
            seed=index, batch=2, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8
        )
        mask = visible_mask(seq, causal=causal, window=window)
        want = oracle_with_grads(q, k, v, dout, causal=causal, scale=0.3, mask=mask)
        rows = torch.tensor(sharded_positions(layout, rank, world, seq), dtype=torch.int64)
        local = [x[:, rows].clone().requires_grad_(True) for x in (q, k, v)]
        out = tokenring.sequence_parallel_attn(
            *local, group=comm, strategy=strategy, causal=causal, layout=layout, softmax_scale=0.3,
            seq_len=seq, window_size=window,
        )  # fmt: skip
        out.backward(dout[:, rows])
        got = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad}
        got["dv"] = local[2].grad
        for name, x in got.items():
            error = float((x - want[name][:, rows]).abs().max())
            if not error <= FP64:
                problems.append(f"rank {rank} {strategy} {layout} causal={causal}: {name} {error}")
    comm.close()
    if not late[0]:
        problems.append(f"rank {rank}: no accumulator arrived after the step's first tile")
    return problems


def test_pass_kv_backward_adds_late_accumulators_as_on_gpu() -> None:
    per_rank = tokenring.launch(_late_arrival_ranks, world_size=4, timeout_s=120)
    problems = [line for lines in per_rank for line in lines]
    assert not problems, problems
