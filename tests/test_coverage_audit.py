"""Audit of the statements the rest of the suite never ran: each reachable one reached here and
checked against the float64 oracle or the documented error.

- Errors of one process (a table): each names its argument, the value and what was
  expected. Two were misleading: ``build_schedule`` of a collective with a window said the
  strategy supports no windows and to use a ring strategy (the runtime and
  ``strategy_schedule`` run them); ``hybrid_mesh("2", 1)`` outside a process group raised
  torch's "Default process group has not been initialized" instead of naming ``outer``.
- Cross-attention in one process without a process group: against float64 attention.
- Calls bad on one rank or on all (ranks holding different numbers of packed tokens in the
  llama3 shim, one rank's heads_k_stride, sharded cross-attention K/V with no key anywhere):
  every rank raises at once, the bad rank naming its argument.
- Pass-KV backward on a GPU takes only the dK/dV accumulators that have arrived at a step's
  first tile (Note [Buffers in flight] in tokenring.runtime.ring); one that arrives later is
  added into the accumulator the step's tiles already wrote (``_Backward.add_arrived``). On
  CPU every arrival is waited for at the first tile, so that sum never ran: the ranks here run
  the GPU's order on CPU (gloo works report completion only when waited for), and check that
  the sum ran and every gradient is the oracle's.

Legend: B batch, S global seq, Hq / Hkv heads, D head dim, P world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, make_inputs, oracle_with_grads, sharded_positions, visible_mask
from tokenring import compat, diffusers, hybrid, tinylm
from tokenring.core import layout as layouts
from tokenring.core.schedule import AttentionShape, dtype_name
from tokenring.runtime import ring
from tokenring.runtime.comm import Communicator
from tokenring.strategies.collective import ulysses_heads
from tokenring.strategies.hybrid import HybridSpec
from tokenring.strategies.ring import build_schedule

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
    return problems + _rank_errors()


def _rank_errors() -> list[str]:
    """Inside a rank: calls that are bad on one rank or on all; every rank must raise at once
    (no timeout), the bad rank naming its argument. The problems, as lines."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hq, d = 2, 8

    def llama3(length: int, stride: Any = 1) -> Any:
        q = torch.zeros(length, hq, d)
        cu_q = torch.tensor([0, length])
        cu_k = torch.tensor([0, length * (rank + 1)])
        return compat.llama3_flash_attn_varlen_func(
            q, q, q, cu_q, cu_k, length, length * world, stride, slice(0, length * (rank + 1))
        )

    calls: list[tuple[str, Callable[[], object], tuple[str, ...]]] = [
        ("llama3 lengths", lambda: llama3(4 if rank == 0 else 3),
         ("same number of tokens", str([4] + [3] * (world - 1)))),
        ("llama3 heads_k_stride", lambda: llama3(4, "1" if rank == 1 else 1),
         ("heads_k_stride", "'1'") if rank == 1 else ("rank 1 cannot run", "heads_k_stride")),
        ("cross sharded no keys", lambda: diffusers.cross_attn(
            torch.zeros(1, 3, hq, d), *(torch.zeros(1, 0, hq, d),) * 2, kv="sharded"),
         ("k and v must hold at least one key", "none on any")),
    ]  # fmt: skip
    problems = []
    for what, call, parts in calls:
        start = time.perf_counter()
        try:
            call()
            problems.append(f"rank {rank} {what}: no error")
            continue
        except ValueError as exc:
            message = str(exc)
        if time.perf_counter() - start > 5:
            problems.append(f"rank {rank} {what}: raised after a wait: {message}")
        missing = [part for part in parts if part not in message]
        if missing:
            problems.append(f"rank {rank} {what}: {message!r} lacks {missing}")
    return problems


def test_pass_kv_backward_adds_late_accumulators_as_on_gpu() -> None:
    per_rank = tokenring.launch(_late_arrival_ranks, world_size=4, timeout_s=120)
    problems = [line for lines in per_rank for line in lines]
    assert not problems, problems


def _zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


_SCHEDULE = dict(layout="contiguous", causal=False, world_size=2, seq_local=4)

# (what, call, exception, substrings of its message: the argument, the value, the expectation)
ERRORS: tuple[tuple[str, Callable[[], object], type[Exception], tuple[str, ...]], ...] = (
    ("seq_local 0", lambda: layouts.validate_seq_local(0, layouts.Layout.CONTIGUOUS),
     ValueError, ("seq_local", ">= 1", "got 0")),
    ("seq_local and seq_len", lambda: layouts.global_length(2, 4, 8, layouts.Layout.CONTIGUOUS),
     ValueError, ("exactly one of seq_local and seq_len", "seq_local=4", "seq_len=8")),
    ("no shards", lambda: layouts.unshard([], layout="zigzag"),
     ValueError, ("shards", "one tensor per rank", "empty")),
    ("float cu_seqlens", lambda: tokenring.shard(
        _zeros(1, 8, 1, 1), rank=0, world_size=2, layout="zigzag",
        cu_seqlens=torch.tensor([0.0, 8.0])),
     ValueError, ("cu_seqlens", "1-D integer tensor", "torch.float32")),
    ("seq_len -1", lambda: layouts.normalize_cu_seqlens(None, -1),
     ValueError, ("seq_len", ">= 0", "got -1")),
    ("dtype int32", lambda: dtype_name(torch.int32),
     ValueError, ("dtype", "float64", "torch.int32")),
    ("heads_q 0", lambda: AttentionShape(heads_q=0, heads_kv=1, head_dim=8),
     ValueError, ("heads_q", ">= 1", "got 0")),
    ("collective without heads", lambda: build_schedule("ulysses", "forward", **_SCHEDULE),
     ValueError, ("heads_q and heads_kv", "'ulysses'", "None")),
    ("collective with a window", lambda: build_schedule(
        "allgather_kv", "forward", heads_q=2, heads_kv=2, window_size=(1, 1), **_SCHEDULE),
     NotImplementedError, ("'allgather_kv'", "windows", "strategy_schedule")),
    ("bidir_ring without heads_kv", lambda: build_schedule("bidir_ring", "forward", **_SCHEDULE),
     ValueError, ("heads_kv", "'bidir_ring'", "None")),
    ("ulysses on 0 ranks", lambda: ulysses_heads(world_size=0, heads_q=2, heads_kv=2),
     ValueError, ("world_size", ">= 1", "got 0")),
    ("hybrid outer ulysses", lambda: HybridSpec(inner=2, outer_strategy="ulysses"),
     ValueError, ("outer_strategy", "ring strategy", "'ulysses'")),
    ("hybrid_mesh outer '2'", lambda: hybrid.hybrid_mesh("2", 1),  # type: ignore[arg-type]
     ValueError, ("outer", "an int", "'2'")),
    ("tinylm heads", lambda: tinylm.TinyLMConfig(heads_q=3, heads_kv=2),
     ValueError, ("heads_kv must divide heads_q", "heads_q=3", "heads_kv=2")),
    ("tinylm empty prompt", lambda: tinylm.generate_reference(
        tinylm.TinyCausalLM(tinylm.TinyLMConfig()), [[]], max_new_tokens=1),
     ValueError, ("prompts", "non-empty token lists", "[[]]")),
    ("cross k, v shapes", lambda: diffusers.cross_attn(
        _zeros(1, 4, 2, 8), _zeros(1, 5, 2, 8), _zeros(1, 6, 2, 8), kv="replicated"),
     ValueError, ("k and v", "same shape", "(1, 5, 2, 8)", "(1, 6, 2, 8)")),
    ("cross k dtype", lambda: diffusers.cross_attn(
        _zeros(1, 4, 2, 8), *(_zeros(1, 5, 2, 8, dtype=torch.float64),) * 2, kv="replicated"),
     ValueError, ("k must have q's dtype", "torch.float32", "torch.float64")),
    ("cross k heads", lambda: diffusers.cross_attn(
        _zeros(1, 4, 2, 8), _zeros(1, 5, 3, 8), _zeros(1, 5, 3, 8), kv="replicated"),
     ValueError, ("k must be", "heads dividing 2", "(1, 5, 3, 8)")),
    ("cross without keys", lambda: diffusers.cross_attn(
        _zeros(1, 4, 2, 8), _zeros(1, 0, 2, 8), _zeros(1, 0, 2, 8), kv="replicated"),
     ValueError, ("k must hold at least one key", "(1, 0, 2, 8)")),
)  # fmt: skip


@pytest.mark.parametrize("row", ERRORS, ids=[r[0] for r in ERRORS])
def test_errors_name_argument_value_and_expectation(row: Any) -> None:
    _, call, exc_type, parts = row
    with pytest.raises(exc_type) as info:
        call()
    missing = [part for part in parts if part not in str(info.value)]
    assert not missing, f"{info.value!r} lacks {missing}"


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_cross_attention_in_one_process_matches_float64(heads: tuple[int, int]) -> None:
    """No process group: replicated K/V (7 keys for 5 queries) against float64 attention."""
    hq, hkv = heads
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, hq, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 7, hkv, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    got = diffusers.cross_attn(q, k, v, kv="replicated", softmax_scale=0.4)
    want, _ = full_attention(q, k, v, causal=False, scale=0.4)
    assert (got - want).abs().max() <= FP64
