"""TokenRing and Ring on real gloo process groups, against the float64 oracle.

One launch per world size (world size 1 in the pytest process); every strategy and the
parameter grid (layout, causal, heads, dtype) are looped inside the ranks. Each rank compares
its shard of out, lse and the gradients of q, k, v with full attention computed in float64
from the same seeded global tensors, and its counted bytes per link with the formula in
``oracle.expected_bytes``.

Tolerances (../shared/STYLE.md): float64 within 1e-10; float32 with ``assert_close``
defaults; bf16/fp16 within twice the error of plain single-process attention in that dtype
plus one rounding step at the tensor's magnitude.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    DTYPES,
    expected_bytes,
    make_inputs,
    oracle_with_grads,
    owned_positions,
    tolerance_failures,
)

HEADS = [(4, 4), (6, 2), (4, 1)]  # MHA, GQA (groups of 3), MQA
# "token_ring+lend": last_pair="lend" (Note [Borrowed last pair]; causal only: without a
# mask nothing is lent, test_schedule; with documents and windows: test_masks)
STRATEGIES = ("token_ring", "token_ring+lend", "ring", "bidir_ring", "bidir_token_ring")


def _traffic(comm: tokenring.Communicator) -> dict[tuple[str, int, int], int]:
    me = comm.rank
    return {(flow, me, peer): n for (flow, peer), n in comm.counter.sent_bytes.items()}


def _check_config(
    strategy: str, layout: str, causal: bool, heads: tuple[int, int], dtype_name: str
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[dtype_name]
    seq_local = 5 if layout == "contiguous" else 6  # odd where the layout allows it
    seq = seq_local * world
    hq, hkv = heads
    q, k, v, dout = make_inputs(
        seed=zlib.crc32(repr((layout, causal, heads)).encode()),
        batch=2,
        seq_global=seq,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=8,
    )
    scale = 8**-0.5
    ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=scale, dtype=dtype)
    idx = torch.tensor(owned_positions(layout, rank, world, seq))
    local = [x[:, idx].to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
    comm = tokenring.get_communicator()
    comm.counter.reset()
    name, _, lend = strategy.partition("+")
    options = {"last_pair": "lend"} if lend else {}
    out, lse = tokenring.sequence_parallel_attn(
        *local, strategy=name, causal=causal, layout=layout, return_lse=True, **options
    )
    fwd_bytes = _traffic(comm)
    comm.counter.reset()
    out.backward(dout[:, idx].to(dtype))
    bwd_bytes = _traffic(comm)
    got = {
        "out": out.detach(),
        "lse": lse,
        "dq": local[0].grad,
        "dk": local[1].grad,
        "dv": local[2].grad,
    }
    want = {
        "out": ref["out"][:, idx],
        "lse": ref["lse"][:, :, idx],
        "dq": ref["dq"][:, idx],
        "dk": ref["dk"][:, idx],
        "dv": ref["dv"][:, idx],
    }
    errors = {name: (got[name].double() - want[name]).abs().max().item() for name in got}
    failures = tolerance_failures(
        got, want, dtype=dtype, inputs=(q, k, v, dout), reference=ref, causal=causal, scale=scale
    )
    dims = {
        "batch": 2,
        "heads_q": hq,
        "heads_kv": hkv,
        "head_dim": 8,
        "elem_bytes": torch.empty((), dtype=dtype).element_size(),
        "acc_bytes": 8 if dtype == torch.float64 else 4,
    }
    for backward, counted in ((False, fwd_bytes), (True, bwd_bytes)):
        formula = expected_bytes(
            strategy=name,
            lend=bool(lend),
            backward=backward,
            layout=layout,
            causal=causal,
            world_size=world,
            seq_local=seq_local,
            **dims,
        )
        mine = {key: n for key, n in formula.items() if key[1] == rank}
        if counted != mine:
            failures.append(
                f"{'backward' if backward else 'forward'} bytes {counted} != formula {mine}"
            )
    return {
        "config": (strategy, layout, causal, heads, dtype_name),
        "errors": errors,
        "failures": failures,
    }


def _grid(strategy: str) -> list[dict[str, Any]]:
    results = []
    for layout, causal, heads, dtype_name in itertools.product(
        ("contiguous", "zigzag"), (False, True), HEADS, DTYPES
    ):
        if strategy.endswith("+lend") and (not causal or dtype_name == "float16"):
            continue  # nothing is lent without a mask; bfloat16 stands for the half types
        results.append(_check_config(strategy, layout, causal, heads, dtype_name))
    return results


def _determinism(strategy: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy, _, lend = strategy.partition("+")
    options = {"last_pair": "lend"} if lend else {}
    q, k, v, dout = make_inputs(
        seed=7, batch=1, seq_global=8 * world, heads_q=4, heads_kv=2, head_dim=8
    )
    idx = torch.tensor(owned_positions("zigzag", rank, world, 8 * world))
    runs = []
    for _ in range(2):
        local = [x[:, idx].float().requires_grad_(True) for x in (q, k, v)]
        out = tokenring.sequence_parallel_attn(
            *local, strategy=strategy, causal=True, layout="zigzag", **options
        )
        out.backward(dout[:, idx].float())
        runs.append([out.detach(), *(x.grad for x in local)])
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def run_grid() -> dict[str, list[list[dict[str, Any]] | bool]]:
    return {strategy: [_grid(strategy), _determinism(strategy)] for strategy in STRATEGIES}


def _assert_no_failures(per_rank: list[dict[str, list[Any]]]) -> None:
    failures = []
    for rank, by_strategy in enumerate(per_rank):
        for strategy, (grid, deterministic) in by_strategy.items():
            if not deterministic:
                failures.append(f"rank {rank} {strategy}: two identical calls differ bitwise")
            for row in grid:
                failures += [f"rank {rank} {row['config']}: {f}" for f in row["failures"]]
    assert not failures, "\n".join(failures)


def test_matches_oracle_and_traffic_formula_on_one_rank(single_rank_group: None) -> None:
    """World size 1 in the pytest process (no launch to pay for)."""
    _assert_no_failures([run_grid()])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_oracle_and_traffic_formula(world_size: int) -> None:
    """One launch per world size; every strategy and the whole grid inside the ranks."""
    _assert_no_failures(tokenring.launch(run_grid, world_size=world_size, timeout_s=400))


def test_module_rejects_return_lse(single_rank_group: None) -> None:
    """The module's forward returns out only (its docstring): return_lse=True is refused at
    build time, naming it, instead of failing (or returning a tuple) in forward."""
    for value in (True, "no", 1):
        with pytest.raises(ValueError, match=f"return_lse must be False.*; got {value!r}"):
            tokenring.SequenceParallelAttention(strategy="ring", return_lse=value)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.float64) for _ in range(3))
    module = tokenring.SequenceParallelAttention(strategy="ring", causal=True, return_lse=False)
    out = module(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, ref)


def test_return_lse_must_be_a_bool(single_rank_group: None) -> None:
    """A string is not a bool: return_lse="no" returned (out, lse), as "no" is truthy."""
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="return_lse must be a bool; got 'no'"):
        tokenring.sequence_parallel_attn(q, q, q, return_lse="no")  # type: ignore[arg-type]
    out, lse = tokenring.sequence_parallel_attn(q, q, q, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 4)
