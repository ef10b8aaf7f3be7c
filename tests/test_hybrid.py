"""Hybrid 2-D strategy (Ulysses inside, a ring strategy across) against the float64 oracle.

World size 4 as 2 x 2, 1 x 4 and 4 x 1; positions of each rank are spelled out here from the
layout definition (outer shard in the oracle's positions, consecutive slices inside), not
taken from tokenring.hybrid.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import make_inputs, oracle_with_grads, owned_positions, tolerance_failures
from tokenring.hybrid import hybrid_attn, hybrid_mesh, hybrid_positions


def _positions(
    layout: str, outer_rank: int, inner_rank: int, outer: int, inner: int, seq: int
) -> list[int]:
    outer_shard = owned_positions(layout, outer_rank, outer, seq)
    s = seq // (outer * inner)
    return outer_shard[inner_rank * s : (inner_rank + 1) * s]


def run_hybrid(outer: int, inner: int) -> list[str]:
    rank = dist.get_rank()
    mesh = hybrid_mesh(outer, inner)
    outer_rank, inner_rank = divmod(rank, inner)
    failures = []
    grid = itertools.product(
        ("token_ring", "ring", "bidir_ring"),
        ((True, "zigzag"), (False, "contiguous")),
        ((8, 8), (8, 4)),
        (torch.float64, torch.bfloat16),
    )
    for strategy, (causal, layout), (hq, hkv), dtype in grid:
        seq = 2 * outer * inner * 3
        q, k, v, dout = make_inputs(
            seed=11, batch=1, seq_global=seq, heads_q=hq, heads_kv=hkv, head_dim=8
        )
        ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=8**-0.5, dtype=dtype)
        mine = _positions(layout, outer_rank, inner_rank, outer, inner, seq)
        got_pos = hybrid_positions(
            outer_rank=outer_rank,
            inner_rank=inner_rank,
            outer=outer,
            inner=inner,
            seq_local=len(mine),
            layout=layout,
        ).tolist()
        if got_pos != mine:
            failures.append(f"positions {got_pos} != {mine}")
        idx = torch.tensor(mine)
        local = [x[:, idx].to(dtype).requires_grad_(True) for x in (q, k, v)]
        out, lse = hybrid_attn(
            *local,
            mesh=mesh,
            outer_strategy=strategy,
            causal=causal,
            layout=layout,
            return_lse=True,
        )
        out.backward(dout[:, idx].to(dtype))
        got = {
            "out": out.detach(),
            "lse": lse,
            "dq": local[0].grad,
            "dk": local[1].grad,
            "dv": local[2].grad,
        }
        want = {n: ref[n][:, :, idx] if n == "lse" else ref[n][:, idx] for n in got}
        config = f"{strategy} causal={causal} heads={hq}/{hkv} {dtype}"
        failures += [
            f"{config} {f}"
            for f in tolerance_failures(
                got,
                want,
                dtype=dtype,
                inputs=(q, k, v, dout),
                reference=ref,
                causal=causal,
                scale=8**-0.5,
            )
        ]
    return failures


@pytest.mark.parametrize(("outer", "inner"), [(2, 2), (1, 4), (4, 1)])
def test_hybrid_matches_oracle(outer: int, inner: int) -> None:
    per_rank = tokenring.launch(run_hybrid, outer, inner, world_size=4, timeout_s=240)
    failures: list[Any] = [f"rank {r}: {f}" for r, fs in enumerate(per_rank) for f in fs]
    assert not failures, "\n".join(failures)


def inner_traffic() -> dict[str, int]:
    mesh = hybrid_mesh(2, 2)
    q = torch.randn(1, 4, 4, 8, requires_grad=True)
    kv = torch.randn(1, 4, 2, 8, requires_grad=True)
    comm = tokenring.get_communicator(mesh.inner)
    comm.counter.reset()
    out = hybrid_attn(q, kv, kv, mesh=mesh, layout="zigzag", causal=True)
    fwd = comm.counter.total_sent()
    comm.counter.reset()
    out.sum().backward()
    uneven = torch.randn(1, 4, 3, 8)
    try:
        hybrid_attn(uneven, uneven, uneven, mesh=mesh)
        refused = "no error"
    except NotImplementedError as exc:
        refused = str(exc)
    return {"fwd": fwd, "bwd": comm.counter.total_sent(), "refused": refused}


def test_inner_all_to_all_moves_the_formula_bytes() -> None:
    """To its one inner peer a rank sends half of its q, k, v heads and gets back half of the
    output heads' rows: s * D * 4 B * (Hq + 2 Hkv) / 2 in, s * D * 4 * Hq / 2 out; the backward
    moves the same amounts the other way."""
    s, d, hq, hkv = 4, 8, 4, 2
    forward = s * d * 4 * (hq + 2 * hkv) // 2 + s * d * 4 * hq // 2
    for traffic in tokenring.launch(inner_traffic, world_size=4, timeout_s=120):
        assert "q heads must be divisible by the inner size 2" in traffic.pop("refused")
        assert traffic == {"fwd": forward, "bwd": forward}


def test_hybrid_refuses_collective_outer_axis(single_rank_group: None) -> None:
    mesh = hybrid_mesh(1, 1)
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="must be a ring strategy"):
        hybrid_attn(q, q, q, mesh=mesh, outer_strategy="ulysses")
    with pytest.raises(ValueError, match="outer x inner must equal the world size 1"):
        hybrid_mesh(2, 1)
