"""Cases a seeded random differential fuzz of the attention entry points found (thousands of
draws over world sizes 2-8, every strategy, dtype, mask and option, against the float64 oracle).

The backward of a query block whose real out is elsewhere (Ulysses' gathered rows, TokenRing's
visiting blocks) hands fused ops a stand-in out' built from delta (Note [Backward from delta]
in tokenring.runtime.kernels). In bf16 its rounding moved delta by about eps |delta|: with one
key per query (dq = dk = 0 exactly; plain bf16 attention gives 3e-7) Ulysses returned dk off by
0.0125.

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import make_inputs, oracle_with_grads, sharded_positions, visible_mask
from tokenring.runtime.kernels import CpuFlashKernel, _stand_in_out, row_delta


def one_key_bound(dtype: torch.dtype) -> float:
    """dq and dk are exactly 0 with one key per query; plain attention in bf16 gets within 1e-6
    of it, the proportional stand-in 4e-3 to 2e-2 off: an eighth of one rounding step at
    magnitude 1."""
    return torch.finfo(dtype).eps / 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_from_delta_keeps_delta_through_rounding(dtype: torch.dtype) -> None:
    """The CPU kernel's backward from (lse, delta) alone equals the one given the real out."""
    inputs = make_inputs(seed=3, batch=2, seq_global=40, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v, dout = (x.to(dtype) for x in inputs)
    one_key = torch.eye(40, dtype=torch.bool)  # each query sees itself: dq = dk = 0
    kernel = CpuFlashKernel()
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.25, mask=one_key)
    delta = row_delta(dout, out, torch.float32)
    grads = {}
    for given in (out, None):
        grads[given is None] = kernel.backward(
            dout, q, k, v, lse, delta, causal=False, scale=0.25, mask=one_key, out=given
        )
    bound = one_key_bound(dtype)
    for name, real, stand_in in zip("qk", grads[False][:2], grads[True][:2], strict=True):
        assert real.abs().max().item() < bound, name
        assert stand_in.abs().max().item() < bound, name


def _one_key_per_query_on_ranks() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = make_inputs(seed=7, batch=2, seq_global=24, heads_q=4, heads_kv=1, head_dim=4)
    mask = visible_mask(24, causal=True, chunk=1)
    reference = oracle_with_grads(q, k, v, dout, causal=True, scale=0.5, dtype=torch.bfloat16,
                                  mask=mask)  # fmt: skip
    pos = torch.tensor(sharded_positions("zigzag", rank, world, 24), dtype=torch.int64)
    failures, bound = [], one_key_bound(torch.bfloat16)
    for strategy in ("ulysses", "token_ring", "ring", "allgather_kv"):
        local = [x[:, pos].to(torch.bfloat16).requires_grad_(True) for x in (q, k, v)]
        out = tokenring.sequence_parallel_attn(
            *local, strategy=strategy, causal=True, layout="zigzag", attention_chunk_size=1,
            softmax_scale=0.5,
        )  # fmt: skip
        out.backward(dout[:, pos].to(torch.bfloat16))
        for name, x in zip(("dq", "dk"), local[:2], strict=True):
            want = reference[name][:, pos]
            error = (x.grad.double() - want).abs().max().item()
            if error > bound:
                failures.append(f"{strategy} {name}: {error:.3g} > {bound:.3g}")
    return failures


def test_one_key_per_query_in_bf16_on_ranks() -> None:
    """Ulysses' backward runs from gathered (lse, delta): its dq and dk stay at 0 as plain
    attention's do (before: dk 0.0125 off)."""
    for rank, failures in enumerate(tokenring.launch(_one_key_per_query_on_ranks, world_size=2)):
        assert not failures, f"rank {rank}: {failures}"


def test_a_stand_in_past_the_dtype_range_takes_the_proportional_form() -> None:
    """fp16 rows whose delta / max |dout| leaves the range (out near 65504, dout equal across D)
    keep the proportional stand-in, finite and with the row sums."""
    dout = torch.full((1, 3, 2, 4), 1e-3, dtype=torch.float16)  # (B, sq, H, D)
    out = torch.full((1, 3, 2, 4), 6e4, dtype=torch.float16)
    out[:, 0] = 1.0  # a row whose sparse stand-in fits
    delta = row_delta(dout, out, torch.float32)  # (B, H, sq)
    stand_in = _stand_in_out(dout, delta).transpose(1, 2)  # (B, sq, H, D)
    assert torch.isfinite(stand_in).all()
    torch.testing.assert_close(row_delta(dout, stand_in, torch.float32), delta, rtol=2e-3, atol=0)
    nonzero = (stand_in != 0).sum(-1)  # (B, sq, H)
    assert (nonzero[:, 0] <= 2).all()  # the sparse form where it fits
    assert (nonzero[:, 1:] == 4).all()  # the proportional one where it does not
