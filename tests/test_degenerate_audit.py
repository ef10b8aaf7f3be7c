"""Degenerate and unusual inputs of the attention entry points: odd arguments on one rank fail
on every rank within the rank check (no rank waits out a timeout), windows too wide for int64
arithmetic, NaN in the inputs.

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, make_inputs, visible_mask
from tokenring.runtime.kernels import ReferenceKernel

INT64_MAX = 2**63 - 1


def _odd_argument(case: str, args: list[Any], options: dict[str, Any]) -> None:
    """Rank 1's odd call: ``args`` (q, k, v) and ``options`` changed in place."""
    if case == "softmax_scale of two elements":
        options["softmax_scale"] = torch.tensor([0.3, 0.4])
    elif case == "sparse q":
        args[0] = args[0].to_sparse()
    elif case == "nested q":
        args[0] = torch.nested.nested_tensor([args[0][0], args[0][0]])
    elif case == "meta q, k, v":
        args[:] = [x.to("meta") for x in args]
    elif case == "cu_seqlens not a sequence":
        options["cu_seqlens"] = object()
    elif case == "check_ranks not a bool":
        options["check_ranks"] = 1
    elif case == "seq_len beyond int64":
        options["seq_len"] = 2**64
    elif case == "window_size beyond int64":
        options["window_size"] = (2**64, 0)
    else:
        raise AssertionError(case)


ODD_CASES = {
    # case: what rank 1's own error says (rank 0's names rank 1 and says the same)
    "softmax_scale of two elements": "softmax_scale must be a finite number > 0 or None; got "
    "a tensor of 2 elements",
    "sparse q": "q must be a dense (strided) tensor; got layout torch.sparse_coo",
    "nested q": "q must be a dense (strided) tensor; got a nested tensor",
    "meta q, k, v": "q is on the meta device",
    "cu_seqlens not a sequence": "cu_seqlens must hold ints (a sequence or a 1-D integer tensor)",
    "check_ranks not a bool": "check_ranks must be a bool; got 1",
    "seq_len beyond int64": "q.shape[1] must be",
    # valid, and differs from rank 0's (the schema refused it on rank 1 alone)
    "window_size beyond int64": "ranks disagree on this attention call: window_size: rank 0 "
    "has [-1, -1], rank 1 has [18446744073709551616, 0]",
}


def _one_rank_odd(cases: list[str]) -> list[dict[str, Any]]:
    """For each case rank 1 makes the odd call, rank 0 a valid one; then both make a valid
    call, checked against the oracle (the ranks are still in step)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokenring.get_communicator(timeout_s=10)  # a hang fails in 10 s, not 300
    q, k, v, _ = make_inputs(seed=3, batch=1, seq_global=8, heads_q=2, heads_kv=1, head_dim=4)
    s = 8 // world_size
    mine = [x[:, rank * s : (rank + 1) * s] for x in (q, k, v)]
    results = []
    for case in cases:
        args: list[Any] = list(mine)
        options: dict[str, Any] = {}
        if rank == 1:
            _odd_argument(case, args, options)
        start = time.perf_counter()
        try:
            tokenring.sequence_parallel_attn(*args, strategy="ring", **options)
            error = None
        except Exception as exc:  # the type is part of the result
            error = f"{type(exc).__name__}: {exc}"
        elapsed_s = time.perf_counter() - start
        out = tokenring.sequence_parallel_attn(*mine, causal=True)
        ref, _ = full_attention(q, k, v, causal=True, scale=4**-0.5)
        torch.testing.assert_close(out, ref[:, rank * s : (rank + 1) * s], atol=1e-12, rtol=0)
        results.append({"error": error, "elapsed_s": elapsed_s})
    return results


def test_an_odd_argument_on_one_rank_raises_on_every_rank() -> None:
    """Each of these raised on rank 1 alone (a RuntimeError or TypeError from torch, the
    operator's schema or a helper, or the fake implementation ran for meta tensors), before
    the rank check: rank 0 waited out the timeout, or its call met rank 1's next call (a
    ValueError about the wrong differences, then a timeout). Each is now a ValueError on rank
    1 naming the argument, and on rank 0 naming rank 1 and the reason, at once."""
    cases = list(ODD_CASES)
    per_rank = tokenring.launch(_one_rank_odd, cases, world_size=2, timeout_s=300)
    for case, mine, peer in zip(cases, per_rank[1], per_rank[0], strict=True):
        message = ODD_CASES[case]
        assert mine["elapsed_s"] < 5 and peer["elapsed_s"] < 5, (case, mine, peer)
        assert mine["error"] is not None and mine["error"].startswith("ValueError: "), case
        assert message in mine["error"], (case, mine)
        assert peer["error"] is not None and message in peer["error"], (case, peer)
        if not message.startswith("ranks disagree"):
            assert "rank 1 cannot run this attention call" in peer["error"], (case, peer)


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "allgather_kv"])
@pytest.mark.parametrize("window", [(INT64_MAX, INT64_MAX), (2**64, 2**64), (2**62, 3)])
def test_a_window_wider_than_int64_arithmetic(
    single_rank_group: None, strategy: str, window: tuple[int, int]
) -> None:
    """window_size=(2**63 - 1, 2**63 - 1) overflowed i + right in the mask's int64 positions:
    Ulysses and all-gather K/V (which build the mask of every pair) were off by 2.7; 2**64
    failed in the operator's schema with a RuntimeError. Both are the unbounded window."""
    q, k, v, _ = make_inputs(seed=2, batch=1, seq_global=8, heads_q=2, heads_kv=1, head_dim=4)
    out = tokenring.sequence_parallel_attn(q, k, v, strategy=strategy, window_size=window)
    mask = visible_mask(8, causal=False, window=(min(window[0], 8), min(window[1], 8)))
    ref, _ = full_attention(q, k, v, causal=False, scale=0.5, mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_kernel_keeps_nan(single_rank_group: None, causal: bool) -> None:
    """The reference kernel (float64 and masked tiles on CUDA) turned the NaN probabilities of
    a key holding NaN into 0: out was finite where plain attention is NaN. Rows no key
    reaches still give out 0 and lse -inf."""
    q, k, v, _ = make_inputs(seed=4, batch=1, seq_global=8, heads_q=2, heads_kv=2, head_dim=4)
    k[0, 2, 0, 1] = float("nan")  # key 2 of head 0: NaN in every row that sees it
    out, lse = tokenring.sequence_parallel_attn(
        q, k, v, causal=causal, kernel="reference", return_lse=True
    )
    ref, ref_lse = full_attention(q, k, v, causal=causal, scale=0.5)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    seen = ~torch.isnan(ref)
    torch.testing.assert_close(out[seen], ref[seen], atol=1e-12, rtol=0)
    # a row that sees no key (padding): out 0 and lse -inf, no NaN
    hidden = torch.ones(8, 8, dtype=torch.bool)
    hidden[3] = False
    out, lse = ReferenceKernel().forward(q, q, v, causal=False, scale=0.5, mask=hidden)
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3])) and torch.isneginf(lse[..., 3]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., [0, 1, 2, 4, 5, 6, 7]]).all()


def test_zero_query_heads_names_q(single_rank_group: None) -> None:
    """heads_q = 0 was refused by the schedule builder as "heads_q must be an int >= 1 or
    None" (Ulysses: "heads_kv must be >= 1 and divide heads_q"): naming q's shape instead."""
    q = torch.randn(1, 4, 0, 8)
    k = torch.randn(1, 4, 1, 8)
    for strategy in ("token_ring", "ulysses"):
        with pytest.raises(ValueError, match=r"q.shape\[2\] \(heads_q\) must be >= 1; got"):
            tokenring.sequence_parallel_attn(q, k, k, strategy=strategy)
