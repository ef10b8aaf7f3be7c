"""Degenerate and unusual inputs of the attention entry points: windows too wide for int64
arithmetic, NaN in the inputs.

Legend: B batch, S global seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import pytest
import torch

import tokenring
from oracle import full_attention, make_inputs, visible_mask
from tokenring.runtime.kernels import ReferenceKernel

INT64_MAX = 2**63 - 1


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
