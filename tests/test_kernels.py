"""Block kernels against PyTorch's SDPA / autograd, and the lse merge."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tokenring
from tokenring.core.masks import MaskSpec
from tokenring.core.merge import merge_into
from tokenring.runtime import kernels
from tokenring.runtime.kernels import (
    MATERIALISING,
    CpuFlashKernel,
    CudaFusedKernel,
    PositionMask,
    TiledKernel,
    accumulation_dtype,
    available_kernels,
    plan_block,
    select_kernel,
)

CPU_KERNELS = ["cpu_flash", "tiled", "reference"]


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
    for given in (None, out):  # the stand-in built from delta, or the real out
        dq, dk, dv = kernel.backward(do, q, k, v, lse, delta, causal=causal, scale=0.3, out=given)
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
    for given in (None, out):  # the stand-in built from delta, or the real out
        dq, dk, dv = kernel.backward(do, q, k, v, lse, delta, causal=False, scale=0.25, out=given)
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
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install flash-attn"):
            select_kernel(torch.device("cpu"), torch.float16, "flash_attn")


# -- tiles: the tiled reference, the CUDA plan, bounded memory ----------------------------------

_PLAIN = MaskSpec(causal=False)


def _positions_mask(spec: MaskSpec, q_pos: list[int], kv_pos: list[int]) -> PositionMask:
    return PositionMask(spec, torch.tensor(q_pos), torch.tensor(kv_pos))


def _float64_block(q, k, v, do, *, causal, scale, visible):
    """Out, lse and grads of one block in float64 with autograd, from the rounded inputs;
    ``visible`` (sq, sk) bool or None. Independent of tokenring.runtime.kernels."""
    groups = q.shape[2] // k.shape[2]
    leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v)]
    qh = leaves[0].transpose(1, 2)
    kh = leaves[1].transpose(1, 2).repeat_interleave(groups, 1)
    vh = leaves[2].transpose(1, 2).repeat_interleave(groups, 1)
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[1]).view(-1, 1)
        visible = torch.arange(k.shape[1]).view(1, -1) <= i
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = (probs @ vh).transpose(1, 2)
    out.backward(do.double())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


# (name, causal, window, cu_seqlens, padding): every mask class the runtime hands a kernel
_MASK_CASES = [
    ("full", False, (-1, -1), None, 0),
    ("causal", True, (-1, -1), None, 0),
    ("window", False, (5, 3), None, 0),
    ("documents", True, (-1, -1), (0, 13, 20, 40), 0),
    ("padding", False, (-1, -1), None, 6),
]


def _case(name, causal, window, cu_seqlens, padding, sq=37, sk=37):
    """Kernel arguments of one mask class: (causal flag, mask or None, dense visible)."""
    if name in ("full", "causal"):
        return causal, None, None
    spec = MaskSpec(causal, window, cu_seqlens)
    q_pos = list(range(sq - padding)) + [-1] * padding
    kv_pos = list(range(sk))
    mask = _positions_mask(spec, q_pos, kv_pos)
    return False, mask, mask.dense()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", _MASK_CASES, ids=[c[0] for c in _MASK_CASES])
def test_tiled_reference_matches_float64(dtype: torch.dtype, case) -> None:
    """The tiled reference (tiles of 8 rows: every tile class occurs) against float64
    autograd, forward and backward, by the tolerance rule of STYLE.md."""
    causal, mask, visible = _case(*case)
    q, k, v, do = _inputs(37, 37, 6, 2, dtype, seed=3)
    want_out, want_lse, want_grads = _float64_block(
        q, k, v, do, causal=causal, scale=0.3, visible=visible
    )
    tiled = TiledKernel(tile_rows=8)
    out, lse = tiled.forward(q, k, v, causal=causal, scale=0.3, mask=mask)
    delta = (do.double() * want_out).sum(-1).transpose(1, 2).to(accumulation_dtype(dtype))
    grads = tiled.backward(
        do,
        q,
        k,
        v,
        want_lse.to(accumulation_dtype(dtype)),
        delta,
        causal=causal,
        scale=0.3,
        mask=mask,
    )
    got = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    want = {"out": want_out, "dq": want_grads[0], "dk": want_grads[1], "dv": want_grads[2]}
    assert out.dtype == dtype and lse.dtype == accumulation_dtype(dtype)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), ~seen), "rows that see no key: lse -inf"
    assert (lse.double()[seen] - want_lse[seen]).abs().max() <= (
        1e-12 if dtype == torch.float64 else 1e-5
    )
    if dtype == torch.float64:
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12)
        return
    # bf16/fp16/fp32: within twice the error of one untiled same-dtype call of PyTorch's CPU
    # flash op (plain attention in that dtype), plus one rounding step at the magnitude.
    plain = select_kernel(torch.device("cpu"), dtype, "cpu_flash")
    plain.tile_rows = 10**9
    p_out, _ = plain.forward(q, k, v, causal=causal, scale=0.3, mask=mask)
    p_grads = plain.backward(
        do,
        q,
        k,
        v,
        want_lse.to(accumulation_dtype(dtype)),
        delta,
        causal=causal,
        scale=0.3,
        mask=mask,
    )
    plain_got = {"out": p_out, "dq": p_grads[0], "dk": p_grads[1], "dv": p_grads[2]}
    eps = torch.finfo(dtype).eps
    for name in got:
        assert got[name].dtype == dtype
        err = (got[name].double() - want[name]).abs().max().item()
        plain_err = (plain_got[name].double() - want[name]).abs().max().item()
        bound = 2 * plain_err + eps * want[name].abs().max().item()
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g} (plain {plain_err:.3g})"


def test_tiled_cpu_flash_equals_one_call() -> None:
    """Tiling PyTorch's CPU flash op (T = 8) changes nothing but rounding, every mask class."""
    for case in _MASK_CASES:
        causal, mask, _ = _case(*case)
        q, k, v, do = _inputs(37, 37, 4, 4, torch.float64, seed=5)
        tiled, whole = CpuFlashKernel(tile_rows=8), select_kernel(q.device, q.dtype, "reference")
        out, lse = tiled.forward(q, k, v, causal=causal, scale=0.4, mask=mask)
        ref_out, ref_lse = whole.forward(q, k, v, causal=causal, scale=0.4, mask=mask)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
        delta = (do * ref_out).sum(-1).transpose(1, 2)
        got = tiled.backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.4, mask=mask)
        want = whole.backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.4, mask=mask)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_cpu_flash_cuts_masked_tiles_finer(monkeypatch) -> None:
    """CpuFlashKernel(T = 16, masked tiles 8): every mask class still equals one reference
    call, forward, backward and backward_into, while no call of the operator with a mask
    sees more than 8 x 8 (a masked 16-row tile is cut again, so its empty and full parts are
    skipped or run without a mask); unmasked backward tiles keep 16 rows."""
    masked_shapes: list[tuple[int, int]] = []
    plain_rows: list[int] = []
    real = kernels._dense

    def recorded(mask, q, k, causal):
        visible = real(mask, q, k, causal)
        if visible is None:
            plain_rows.append(q.shape[1])
        else:
            masked_shapes.append(tuple(visible.shape))
        return visible

    kernel = CpuFlashKernel(tile_rows=16, masked_tile_rows=8)
    whole = select_kernel(torch.device("cpu"), torch.float64, "reference")
    for case in _MASK_CASES:
        causal, mask, _ = _case(*case)
        q, k, v, do = _inputs(37, 37, 4, 2, torch.float64, seed=7)
        ref_out, ref_lse = whole.forward(q, k, v, causal=causal, scale=0.4, mask=mask)
        delta = (do * ref_out).sum(-1).transpose(1, 2)
        want = whole.backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.4, mask=mask)
        monkeypatch.setattr(kernels, "_dense", recorded)  # the tiled kernel's calls only
        out, lse = kernel.forward(q, k, v, causal=causal, scale=0.4, mask=mask)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
        got = kernel.backward(do, q, k, v, ref_lse, delta, causal=causal, scale=0.4, mask=mask)
        into = [torch.zeros_like(x) for x in (q, k, v)]
        kernel.backward_into(into, do, q, k, v, ref_lse, delta, causal=causal, scale=0.4, mask=mask)
        for g, i, w in zip(got, into, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
            torch.testing.assert_close(i, w, rtol=0, atol=1e-11)
        monkeypatch.setattr(kernels, "_dense", real)
    assert masked_shapes, "the mask cases include masked tiles"
    assert max(max(s) for s in masked_shapes) <= 8, sorted(set(masked_shapes))
    assert 16 in plain_rows, sorted(set(plain_rows))  # unmasked backward tiles: T rows


def test_cpu_flash_backward_cuts_keys_to_the_query_tile() -> None:
    """CpuFlashKernel's backward runs a non-causal piece with more kv rows than q rows as kv
    tiles of the q tile's length (at least the floor), through ``backward`` and
    ``backward_into`` alike; causal and taller pieces stay one call. Gradients as one call."""
    kernel = CpuFlashKernel(tile_rows=16)  # floor min(512, 16) = 16
    ref = select_kernel(torch.device("cpu"), torch.float64, "reference")
    for sq, sk, causal, calls in ((8, 32, False, 2), (16, 16, True, 1), (16, 8, False, 1)):
        q, k, v, do = _inputs(sq, sk, 4, 2, torch.float64, seed=sq + sk)
        out, lse = ref.forward(q, k, v, causal=causal, scale=0.3)
        delta = (do * out).sum(-1).transpose(1, 2)
        want = ref.backward(do, q, k, v, lse, delta, causal=causal, scale=0.3)
        kernel.ran.clear()
        got = kernel.backward(do, q, k, v, lse, delta, causal=causal, scale=0.3)
        assert kernel.ran["cpu_flash"] == calls, (sq, sk, causal, dict(kernel.ran))
        into = [torch.zeros_like(x) for x in (q, k, v)]
        kernel.backward_into(into, do, q, k, v, lse, delta, causal=causal, scale=0.3)
        assert kernel.ran["cpu_flash"] == 2 * calls, (sq, sk, causal, dict(kernel.ran))
        for g, i, w in zip(got, into, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
            torch.testing.assert_close(i, w, rtol=0, atol=1e-11)


def test_cpu_flash_backward_builds_one_stand_in_per_q_tile(monkeypatch) -> None:
    """Without ``out`` (a visiting Q), the stand-in out of Note [Backward from delta] is
    built once per q tile, not once per kv tile, and never for more rows than a tile's (a
    whole piece's stand-in raised Ulysses' peak memory to 2.0x); the gradients stay the
    oracle's."""
    calls = []
    real = kernels._stand_in_out

    def counted(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        calls.append(dout.shape[1])
        return real(dout, delta)

    monkeypatch.setattr(kernels, "_stand_in_out", counted)
    kernel = CpuFlashKernel(tile_rows=16)
    ref = select_kernel(torch.device("cpu"), torch.float64, "reference")
    cases = ((8, 40, False, 3, [8]), (32, 32, True, 3, [16, 16]), (16, 8, False, 1, [16]))
    for sq, sk, causal, tiles, built in cases:
        q, k, v, do = _inputs(sq, sk, 4, 2, torch.float64, seed=sq * sk)
        out, lse = ref.forward(q, k, v, causal=causal, scale=0.3)
        delta = (do * out).sum(-1).transpose(1, 2)
        want = ref.backward(do, q, k, v, lse, delta, causal=causal, scale=0.3)
        calls.clear()
        kernel.ran.clear()
        into = [torch.zeros_like(x) for x in (q, k, v)]
        kernel.backward_into(into, do, q, k, v, lse, delta, causal=causal, scale=0.3)
        assert kernel.ran["cpu_flash"] == tiles, (sq, sk, causal, dict(kernel.ran))
        # rows of each stand-in built: 8 x 40 is one q tile meeting three kv tiles; 32 x 32
        # causal, two q tiles (the first meets one kv tile, the second two); 16 x 8 one tile
        assert calls == built, (sq, sk, causal, calls)
        for i, w in zip(into, want, strict=True):
            torch.testing.assert_close(i, w, rtol=0, atol=1e-11)


def test_position_mask_tiles_are_slices_of_the_mask() -> None:
    spec = MaskSpec(True, (4, 0), (0, 9, 30))
    mask = _positions_mask(spec, [*range(3, 20), -1, -1], list(range(25)))
    dense = mask.dense()
    assert torch.equal(mask.tile((2, 11), (5, 17)).dense(), dense[2:11, 5:17])
    assert mask.tile((0, 4), (20, 25)).visibility() == (False, False)
    assert _positions_mask(_PLAIN, [1, 2], [0, 1]).visibility() == (True, True)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def _fake_fused(self, q, k, v, *, causal, scale, mask=None):  # stands in for a CUDA op
    assert mask is None
    self.ran[self.op] += 1
    b, sq, hq, _ = q.shape
    return torch.zeros_like(q), torch.zeros(b, hq, sq, dtype=accumulation_dtype(q.dtype))


def _fake_fused_backward(self, dout, q, k, v, lse, delta, *, causal, scale, mask=None, out=None):
    assert mask is None
    self.ran[self.op] += 1
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (9, 0)])
def test_cuda_plan_never_holds_a_block_sized_tensor(monkeypatch, capability) -> None:
    """For every mask class and dtype, on a claimed CUDA capability: the fused operators (here
    stand-ins that record the call; the real ones hold O(s) memory) get the unmasked tiles
    the plan names, the rest runs the tiled reference, and no tensor of (sq, sk) elements is
    ever made. sq = sk = 128 with B * Hq * D = 16, so only a (sq, sk) tensor reaches sq * sk."""
    monkeypatch.setattr(kernels._SdpaOps, "forward", _fake_fused)
    monkeypatch.setattr(kernels._SdpaOps, "backward", _fake_fused_backward)
    s = 128
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for name, causal, window, cu_seqlens, padding in _MASK_CASES:
            kernel = CudaFusedKernel(capability=capability, tile_rows=64, masked_tile_rows=32)
            flag, mask, _ = _case(name, causal, window, cu_seqlens, padding, sq=s, sk=s)
            gen = torch.Generator().manual_seed(0)
            q, k, v, do = (torch.randn(1, s, 2, 8, generator=gen).to(dtype) for _ in range(4))
            lse = torch.zeros(1, 2, s, dtype=accumulation_dtype(dtype))
            with _LargestTensor() as watch:
                kernel.forward(q, k, v, causal=flag, scale=0.3, mask=mask)
                grads = tuple(torch.zeros(x.shape, dtype=lse.dtype) for x in (q, k, v))
                kernel.backward_into(
                    grads, do, q, k, v, lse, lse, causal=flag, scale=0.3, mask=mask
                )
            assert watch.largest < s * s, (dtype, name, watch.largest)
            planned = {
                kind: plan_block(
                    device_type="cuda",
                    capability=capability,
                    dtype=dtype,
                    head_dim=8,
                    tile_class=kind,
                )
                for kind in ("full", "causal", "masked")
            }
            assert set(kernel.ran) <= set(planned.values()) | {"reference"}, kernel.ran
            if name == "full":
                assert set(kernel.ran) == {planned["full"].replace("tiled_", "")}


def test_plan_table() -> None:
    """Rows of Note [Kernel plan], read from the operators' documented limits."""

    def plan(cap, dtype, d=128, kind="full", **kw):
        return plan_block(
            device_type="cuda", capability=cap, dtype=dtype, head_dim=d, tile_class=kind, **kw
        )

    assert plan((9, 0), torch.bfloat16) == "sdpa_flash"
    assert plan((9, 0), torch.bfloat16, flash_attn=True) == "flash_attn"
    assert plan((8, 0), torch.float16, kind="causal") == "sdpa_flash"
    assert plan((9, 0), torch.float32) == "sdpa_efficient"
    assert plan((7, 5), torch.float16) == "sdpa_efficient"  # flash needs sm80
    assert plan((7, 5), torch.bfloat16) == "tiled_reference"  # bf16 needs sm80
    assert plan((9, 0), torch.float16, d=68) == "tiled_reference"  # head dim not a multiple of 8
    assert plan((9, 0), torch.float16, d=512) == "tiled_reference"
    assert plan((9, 0), torch.float64) == "tiled_reference"
    assert plan((9, 0), torch.bfloat16, kind="masked") == "tiled_reference"
    assert plan((9, 0), torch.bfloat16, kind="masked", flex=True) == "flex"
    assert (
        plan_block(
            device_type="cpu",
            capability=None,
            dtype=torch.float32,
            head_dim=64,
            tile_class="masked",
        )
        == "cpu_flash"
    )
    assert not MATERIALISING & {"sdpa_flash", "sdpa_efficient", "flash_attn", "flex"}
    with pytest.raises(ValueError, match="tile_class must be"):
        plan((9, 0), torch.float16, kind="diagonal")


def test_backward_through_autograd_gives_the_global_gradients() -> None:
    """Note [Backward through autograd]: the block's own differentiable (out_b, lse_b), turned
    into the global gradients with the global lse and delta, equal the reference backward."""
    q, k, v, do = _inputs(11, 16, 4, 2, torch.float64, seed=7)
    reference = select_kernel(q.device, q.dtype, "reference")
    out, lse = reference.forward(q, k, v, causal=False, scale=0.5)
    delta = (do * out).sum(-1).transpose(1, 2)
    block = slice(3, 12)  # keys 3..11 of the 16: the global lse covers keys this block lacks
    kb, vb = k[:, block], v[:, block]
    want = reference.backward(do, q, kb, vb, lse, delta, causal=False, scale=0.5)
    leaves = [x.clone().requires_grad_(True) for x in (q, kb, vb)]
    with torch.enable_grad():
        groups = 2
        qh = leaves[0].transpose(1, 2)
        kh = leaves[1].transpose(1, 2).repeat_interleave(groups, 1)
        vh = leaves[2].transpose(1, 2).repeat_interleave(groups, 1)
        scores = qh @ kh.transpose(-1, -2) * 0.5
        lse_b = scores.logsumexp(-1)
        out_b = torch.softmax(scores, -1) @ vh  # (B, Hq, sq, D)
    got = kernels._global_grads(out_b, lse_b, do, lse, delta, leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


# the masked classes, and a causal window over padding and a two-sided window over documents:
# every branch of the FlexAttention mask function
_FLEX_CASES = [
    *_MASK_CASES[2:],
    ("causal window", True, (4, 0), None, 3),
    ("window documents", False, (3, 2), (0, 9, 20), 0),
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", _FLEX_CASES, ids=[c[0] for c in _FLEX_CASES])
def test_flex_forward_matches_reference_on_cpu(case) -> None:
    """FlexAttention (eager on the CPU: the math of the CUDA path, not its memory) with a
    position mask gives the reference's out and lse, -inf for rows that see nothing. (Its
    backward runs on CUDA only; its math is
    test_backward_through_autograd_gives_the_global_gradients.)"""
    flex = kernels._FlexOps()
    if not flex.supports(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no FlexAttention")
    causal, mask, visible = _case(*case, sq=20, sk=20)
    q, k, v, _ = _inputs(20, 20, 4, 2, torch.float32, seed=9)
    out, lse = flex.forward(q, k, v, causal=causal, scale=0.3, mask=mask)
    want_out, want_lse, _ = _float64_block(
        q, k, v, torch.zeros_like(q), causal=causal, scale=0.3, visible=visible
    )
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", [kernels.SDPA_FLASH, kernels.SDPA_EFFICIENT])
def test_cuda_sdpa_calls_fit_the_operators_schemas(op: str) -> None:
    """The CUDA SDPA operators' calls (forward and backward, GQA, rows not a multiple of the
    efficient op's 32) on meta tensors: PyTorch's meta kernels check the arguments against
    each operator's schema and give the output shapes, so a call that a torch release no
    longer fits fails here, not on a GPU's first run."""
    kernel = kernels._SdpaOps(op)
    b, sq, sk, hq, hkv, d = 2, 37, 53, 4, 2, 64
    q = torch.empty(b, sq, hq, d, device="meta", dtype=torch.float16)
    k, v = (torch.empty(b, sk, hkv, d, device="meta", dtype=torch.float16) for _ in range(2))
    for causal in (False, True):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125, mask=None)
        assert (out.shape, out.dtype) == (q.shape, q.dtype)
        assert (lse.shape, lse.dtype) == ((b, hq, sq), torch.float32)
        delta = torch.empty(b, hq, sq, device="meta")
        grads = kernel.backward(out, q, k, v, lse, delta, causal=causal, scale=0.125, out=out)
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]


def test_cpu_tiles_grow_with_the_ranks_rows(single_rank_group: None, monkeypatch) -> None:
    """Note [Kernel plan]: the CPU flash kernel a call picks cuts its backward into 2048-row
    tiles where a rank holds at least 4096 rows and into 1024-row tiles below (a tile's
    gradients stay within half a rank's rows); a kernel given by instance keeps its own T."""
    assert [kernels.cpu_tile_rows(s) for s in (None, 1024, 4095, 4096, 65536)] == [
        1024, 1024, 1024, 2048, 2048,
    ]  # fmt: skip
    cpu = torch.device("cpu")
    for name in (None, "cpu_flash"):
        got = [select_kernel(cpu, torch.float32, name, seq_local=s).tile_rows for s in (2048, 4096)]
        assert got == [1024, 2048], (name, got)
    mine = CpuFlashKernel(tile_rows=16)
    assert select_kernel(cpu, torch.float32, mine, seq_local=8192) is mine
    tiles: list[int] = []
    real = kernels._tiles

    def recorded(n: int, tile: int) -> list[tuple[int, int]]:
        tiles.append(tile)
        return real(n, tile)

    monkeypatch.setattr(kernels, "_tiles", recorded)
    for seq, want in ((2048, 1024), (4096, 2048)):
        tiles.clear()
        q, k, v = (torch.randn(1, seq, 1, 8, requires_grad=True) for _ in range(3))
        tokenring.token_ring_attn(q, k, v, causal=True).sum().backward()
        assert tiles and set(tiles) == {want}, (seq, sorted(set(tiles)))


def empty_blocks(name: str) -> str:
    """The checks of :func:`test_blocks_with_no_rows_on_one_side`, in a launched rank."""
    kernel = select_kernel(torch.device("cpu"), torch.float32, name)
    for sq, sk in ((0, 0), (0, 5), (5, 0)):
        q, do = torch.randn(2, sq, 4, 8), torch.randn(2, sq, 4, 8)
        k, v = torch.randn(2, sk, 2, 8), torch.randn(2, sk, 2, 8)
        for causal in (False, True) if sq == sk else (False,):
            out, lse = kernel.forward(q, k, v, causal=causal, scale=0.3)
            assert out.shape == q.shape and bool((out == 0).all()), (sq, sk)
            assert lse.shape == (2, 4, sq) and bool(torch.isneginf(lse).all()), (sq, sk)
            grads = kernel.backward(do, q, k, v, lse, lse, causal=causal, scale=0.3)
            for g, x in zip(grads, (q, k, v), strict=True):
                assert g.shape == x.shape and bool((g == 0).all()), (sq, sk)
    return "ok"


@pytest.mark.parametrize("name", CPU_KERNELS)
def test_blocks_with_no_rows_on_one_side(name: str) -> None:
    """A block with 0 query or 0 key rows has no pair: out 0, lse -inf, gradients 0 (the
    fused CPU op killed the process with SIGFPE). Run in a launched rank, a child forked
    from the warm zygote (no interpreter to start): a crash, as a failed check, fails the
    launch with the rank's signal or traceback."""
    assert tokenring.launch(empty_blocks, name, world_size=1, timeout_s=120) == ["ok"]


@pytest.mark.parametrize(
    ("cls", "arg"),
    [
        (CpuFlashKernel, "tile_rows"),
        (CpuFlashKernel, "masked_tile_rows"),
        (CudaFusedKernel, "tile_rows"),
        (CudaFusedKernel, "masked_tile_rows"),
        (TiledKernel, "tile_rows"),
    ],
)
def test_tile_sizes_below_one_are_rejected_by_name(cls, arg: str) -> None:
    """The error names the argument the caller gave (masked_tile_rows=0 was reported as
    'tile_rows must be >= 1; got 0' while tile_rows was 1024)."""
    with pytest.raises(ValueError, match=f"^{arg} must be >= 1; got 0$"):
        cls(**{arg: 0})
