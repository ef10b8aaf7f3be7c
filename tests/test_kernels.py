"""Block kernels against PyTorch's SDPA / autograd, and the lse merge."""

from __future__ import annotations

import pytest
import torch

from tokenring.kernels import accumulation_dtype, available_kernels, select_kernel
from tokenring.merge import merge_into

CPU_KERNELS = ["cpu_flash", "reference"]


def _inputs(sq: int, sk: int, hq: int, hkv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, hq, 16, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(2, sk, hkv, 16, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(2, sk, hkv, 16, generator=gen, dtype=torch.float64).to(dtype)
    do = torch.randn(2, sq, hq, 16, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _autograd_reference(q, k, v, do, causal, scale):
    """SDPA in float64 with autograd: out, lse (explicit), grads."""
    groups = q.shape[2] // k.shape[2]
    leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v)]
    qh = leaves[0].transpose(1, 2)
    kh = leaves[1].transpose(1, 2).repeat_interleave(groups, 1)
    vh = leaves[2].transpose(1, 2).repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=scale
    )
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    lse = scores.logsumexp(-1)
    out.transpose(1, 2).backward(do.double())
    return out.transpose(1, 2).detach(), lse.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (4, 1)])
def test_kernel_matches_autograd_float64(name: str, causal: bool, hq: int, hkv: int) -> None:
    sq = sk = 9
    q, k, v, do = _inputs(sq, sk, hq, hkv, torch.float64)
    kernel = select_kernel(torch.device("cpu"), torch.float64, name)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.3)
    ref_out, ref_lse, (dq_ref, dk_ref, dv_ref) = _autograd_reference(q, k, v, do, causal, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    delta = (do * out).sum(-1).transpose(1, 2)  # (B, H, sq)
    dq, dk, dv = kernel.backward(do, q, k, v, lse, delta, causal=causal, scale=0.3)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_low_precision_dtypes(name: str, dtype: torch.dtype) -> None:
    q, k, v, do = _inputs(8, 12, 4, 2, dtype)
    kernel = select_kernel(torch.device("cpu"), dtype, name)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.25)
    assert out.dtype == dtype and lse.dtype == accumulation_dtype(dtype)
    ref_out, _ref_lse, grads = _autograd_reference(q, k, v, do, False, 0.25)
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref_out).abs().max() <= 4 * eps * ref_out.abs().max()
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2)
    dq, dk, dv = kernel.backward(do, q, k, v, lse, delta, causal=False, scale=0.25)
    for got, want in zip((dq, dk, dv), grads, strict=True):
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() <= 8 * eps * want.abs().max()


def test_merge_of_two_key_halves_equals_full_block() -> None:
    q, k, v, _ = _inputs(7, 10, 2, 2, torch.float64)
    kernel = select_kernel(torch.device("cpu"), torch.float64, "reference")
    full_out, full_lse = kernel.forward(q, k, v, causal=False, scale=0.5)
    out = torch.zeros(full_out.shape, dtype=torch.float64)
    lse = torch.full(full_lse.shape, float("-inf"), dtype=torch.float64)
    for a, b in ((0, 4), (4, 10)):
        part = kernel.forward(q, k[:, a:b], v[:, a:b], causal=False, scale=0.5)
        merge_into(out, lse, (0, 7), *part)
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-14)


def test_merge_keeps_unreached_rows_finite() -> None:
    out = torch.zeros(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    empty_out = torch.zeros(1, 2, 2, 4)
    empty_lse = torch.full((1, 2, 2), float("-inf"))
    merge_into(out, lse, (0, 2), empty_out, empty_lse)  # -inf merged with -inf
    assert torch.isfinite(out).all() and torch.isneginf(lse).all()
    merge_into(out, lse, (1, 3), torch.ones(1, 2, 2, 4), torch.zeros(1, 2, 2))
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 1:], torch.ones(1, 2, 2, 4)) and torch.equal(
        out[:, 0], torch.zeros(1, 2, 4)
    )


def test_select_kernel_errors() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        select_kernel(torch.device("cpu"), torch.float32, "warp_drive")
    with pytest.raises(ValueError, match="cuda_sdpa"):
        select_kernel(torch.device("cpu"), torch.float32, "cuda_sdpa")
    assert select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    assert set(CPU_KERNELS) <= set(available_kernels())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(dtype: torch.dtype) -> None:
    q, k, v, do = (x.cuda() for x in _inputs(64, 64, 4, 2, dtype))
    kernel = select_kernel(q.device, dtype, "cuda_sdpa")
    for causal in (False, True):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=0.25)
        ref_out, ref_lse, _ = _autograd_reference(q.cpu(), k.cpu(), v.cpu(), do.cpu(), causal, 0.25)
        eps = torch.finfo(dtype).eps
        assert (out.double().cpu() - ref_out).abs().max() <= 4 * eps * ref_out.abs().max()
        assert (lse.double().cpu() - ref_lse).abs().max() <= 1e-3
