"""Local block kernels: attention of one Q block against one K/V block, with lse.

This module owns the per-block math. A kernel maps ``q, k, v -> (out, lse)`` and back; the
strategies call it once per piece of their schedule. Kernels are pluggable and chosen by
:func:`select_kernel` from what the device and dtype support; a kernel asked for explicitly
that cannot run raises instead of silently running another.

Legend: B batch, sq query rows, sk key rows, Hq query heads, Hkv key/value heads (divides Hq),
D head dim. Public tensors are ``(B, rows, H, D)``; lse and delta are ``(B, Hq, sq)`` in the
accumulation dtype (float64 for float64 inputs, else float32).

Note [Backward from delta]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The block backward needs P = exp(S - lse) with the *global* lse and delta = rowsum(dout * out)
with the *global* out. TokenRing ships delta (one number per row and head) instead of out
(D numbers), because out is not needed otherwise. Fused ops (PyTorch's CPU flash backward)
take ``out`` and compute delta themselves, so we hand them a stand-in out' with the same row
sums against dout::

    out' = dout * delta / |dout|^2      (0 where |dout| = 0, where delta is 0 too)

rowsum(dout * out') = delta exactly in real arithmetic, and |out'| <= |out| (Cauchy-Schwarz),
so the stand-in is as well-scaled as the real out and costs one extra elementwise pass.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = [
    "BlockKernel",
    "CpuFlashKernel",
    "CudaSdpaKernel",
    "ReferenceKernel",
    "accumulation_dtype",
    "available_kernels",
    "select_kernel",
]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs; float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockKernel(abc.ABC):
    """Attention of one block, forward and backward, with the log-sum-exp of each row."""

    name: str = "abstract"

    @abc.abstractmethod
    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs for tensors on ``device`` with ``dtype``."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block attention.

        Args:
            q: ``(B, sq, Hq, D)``.
            k, v: ``(B, sk, Hkv, D)``.
            causal: top-left causal mask (row i sees keys 0..i); only used with sq == sk.
            scale: softmax scale.
            mask: optional bool ``(sq, sk)``, True where the query row may see the key (the
                same for every batch row and head); not combined with ``causal``. A row that
                sees no key gets out 0 and lse -inf.

        Returns:
            out ``(B, sq, Hq, D)`` in q's dtype, lse ``(B, Hq, sq)`` in the accumulation dtype.
        """

    @abc.abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block given the global ``lse`` and ``delta`` of the q rows.

        Args:
            dout: ``(B, sq, Hq, D)``.
            q: ``(B, sq, Hq, D)``; k, v: ``(B, sk, Hkv, D)``.
            lse, delta: ``(B, Hq, sq)``, accumulation dtype (lse -inf: a row that sees no key
                anywhere; its gradients are 0).
            mask: as in :meth:`forward`.

        Returns:
            dq ``(B, sq, Hq, D)``, dk and dv ``(B, sk, Hkv, D)``, in q's dtype.
        """


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class ReferenceKernel(BlockKernel):
    """Plain torch matmuls in the accumulation dtype; any device, any dtype. Materialises the
    ``(B, Hq, sq, sk)`` score matrix, so it is the slow, obviously-correct baseline."""

    name = "reference"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def _scores(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        causal: bool,
        scale: float,
        visible: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        qh = _bhsd(q).to(acc)  # (B, Hq, sq, D)
        kh = _bhsd(k).to(acc).repeat_interleave(groups, dim=1)  # (B, Hq, sk, D)
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, Hq, sq, sk)
        if causal:
            sq, sk = scores.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return qh, kh, scores

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        _, _, scores = self._scores(q, k, causal, scale, _check_mask(mask, q, k, causal))
        lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, sq)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        vh = _bhsd(v).to(acc).repeat_interleave(groups, dim=1)  # (B, Hq, sk, D)
        out = torch.matmul(probs, vh)  # (B, Hq, sq, D)
        return _bhsd(out).to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(q.dtype)
        b, sk, hkv, d = k.shape
        groups = q.shape[2] // hkv
        qh, kh, scores = self._scores(q, k, causal, scale, _check_mask(mask, q, k, causal))
        probs = torch.exp(scores - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)  # (B, Hq, sq, sk)
        doh = _bhsd(dout).to(acc)  # (B, Hq, sq, D)
        vh = _bhsd(v).to(acc).repeat_interleave(groups, dim=1)  # (B, Hq, sk, D)
        dv = torch.matmul(probs.transpose(-1, -2), doh)  # (B, Hq, sk, D)
        dp = torch.matmul(doh, vh.transpose(-1, -2))  # (B, Hq, sq, sk)
        ds = probs * (dp - delta.to(acc).unsqueeze(-1))
        dq = torch.matmul(ds, kh) * scale  # (B, Hq, sq, D)
        dk = torch.matmul(ds.transpose(-1, -2), qh) * scale  # (B, Hq, sk, D)
        dk = dk.view(b, hkv, groups, sk, d).sum(2)  # (B, Hkv, sk, D)
        dv = dv.view(b, hkv, groups, sk, d).sum(2)
        return _bhsd(dq).to(q.dtype), _bhsd(dk).to(k.dtype), _bhsd(dv).to(v.dtype)


def _stand_in_out(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out' with rowsum(dout * out') == delta; see Note [Backward from delta]."""
    acc = delta.dtype
    do = _bhsd(dout).to(acc)  # (B, Hq, sq, D)
    norm2 = (do * do).sum(-1)  # (B, Hq, sq)
    ratio = torch.where(norm2 > 0, delta / norm2.clamp_min(torch.finfo(acc).tiny), 0.0)
    return _bhsd(do * ratio.unsqueeze(-1)).to(dout.dtype)  # (B, sq, Hq, D)


class CpuFlashKernel(BlockKernel):
    """PyTorch's fused CPU flash-attention ops (they return logsumexp); GQA native."""

    name = "cpu_flash"

    def __init__(self) -> None:
        ops = torch.ops.aten
        self._fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
        self._bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return (
            self._fwd is not None
            and self._bwd is not None
            and device.type == "cpu"
            and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._fwd is not None
        visible = _check_mask(mask, q, k, causal)
        bias = None if visible is None else _additive(visible, q.dtype)
        result = _named(
            self._fwd.default,
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            0.0,
            causal,
            attn_mask=bias,
            scale=scale,
        )
        out, lse = result["output"], result["logsumexp"]  # (B, Hq, sq, D), (B, Hq, sq)
        lse = lse.to(accumulation_dtype(q.dtype))
        if visible is not None:  # the op reports lse 0 for a row that sees no key
            lse = lse.masked_fill(~visible.any(-1), float("-inf"))
        return _bhsd(out), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self._bwd is not None
        visible = _check_mask(mask, q, k, causal)
        bias = None if visible is None else _additive(visible, q.dtype)
        out = _stand_in_out(dout, delta)
        lse_op = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        # A row with lse -inf sees no key anywhere: every score is masked, so any finite lse
        # gives P = 0 there (and -inf would give exp(-inf + inf) = NaN).
        lse_op = lse_op.masked_fill(lse_op == float("-inf"), 0.0)
        result = _named(
            self._bwd.default,
            _bhsd(dout),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            lse_op.contiguous(),
            0.0,
            causal,
            attn_mask=bias,
            scale=scale,
        )
        return _bhsd(result["grad_query"]), _bhsd(result["grad_key"]), _bhsd(result["grad_value"])


class CudaSdpaKernel(BlockKernel):
    """PyTorch's CUDA SDPA ops in the forward: flash for fp16/bf16, memory-efficient for fp32;
    reference math in the backward.

    GQA: K/V heads are repeated locally (never on the wire) and their gradients summed.
    """

    name = "cuda_sdpa"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    @staticmethod
    def _expand(x: torch.Tensor, heads_q: int) -> torch.Tensor:
        groups = heads_q // x.shape[2]
        return x if groups == 1 else x.repeat_interleave(groups, dim=2)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mask is not None:
            # SDPA's flash op takes no mask; masked pieces (document / window edges) use the
            # reference math until a masked fused path is validated on a GPU.
            return ReferenceKernel().forward(q, k, v, causal=causal, scale=scale, mask=mask)
        hq, sq = q.shape[2], q.shape[1]
        k, v = self._expand(k, hq), self._expand(v, hq)
        ops = torch.ops.aten
        if q.dtype == torch.float32:
            r = _named(
                ops._scaled_dot_product_efficient_attention.default,
                _bhsd(q),
                _bhsd(k),
                _bhsd(v),
                None,
                True,
                0.0,
                causal,
                scale=scale,
            )
            out = r["output"]
        else:
            r = _named(
                ops._scaled_dot_product_flash_attention.default,
                _bhsd(q),
                _bhsd(k),
                _bhsd(v),
                0.0,
                causal,
                False,
                scale=scale,
            )
            out = r["output"]
        lse = r["logsumexp"][..., :sq].float()  # efficient attention pads rows
        return _bhsd(out), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        delta: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The fused CUDA backward ops need side outputs of their own forward (philox state,
        # cumulative lengths) for this exact block; until that path is validated on a GPU the
        # backward uses the reference formulas (exact, materialises (B, Hq, sq, sk) in fp32).
        return ReferenceKernel().backward(
            dout, q, k, v, lse, delta, causal=causal, scale=scale, mask=mask
        )


def _check_mask(
    mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, causal: bool
) -> torch.Tensor | None:
    """The bool ``(sq, sk)`` mask on q's device, checked (an internal contract: the runtime
    builds masks from positions)."""
    if mask is None:
        return None
    assert not causal, "a block gets either the causal flag or an explicit mask"
    assert mask.dtype == torch.bool and tuple(mask.shape) == (q.shape[1], k.shape[1]), (
        f"mask must be bool {(q.shape[1], k.shape[1])}; got {mask.dtype} {tuple(mask.shape)}"
    )
    return mask.to(q.device)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere, in ``dtype`` (the fused CPU op wants q's dtype)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, float("-inf")
    )


def _named(op: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call an aten op and return its results by the names in its schema (not by position)."""
    result = op(*args, **kwargs)
    names = [ret.name for ret in op._schema.returns]
    if not isinstance(result, tuple | list):
        result = (result,)
    return dict(zip(names, result, strict=True))


_KERNELS: tuple[type[BlockKernel], ...] = (CpuFlashKernel, CudaSdpaKernel, ReferenceKernel)


def available_kernels() -> dict[str, type[BlockKernel]]:
    """Kernel classes by name."""
    return {cls.name: cls for cls in _KERNELS}


def select_kernel(
    device: torch.device, dtype: torch.dtype, kernel: str | BlockKernel | None = None
) -> BlockKernel:
    """The kernel to use for ``device``/``dtype``.

    Args:
        kernel: ``None`` picks the first that supports the inputs, in the order cpu_flash,
            cuda_sdpa, reference (so float64 on CUDA runs the reference kernel); a name or an
            instance forces that kernel.

    Raises:
        ValueError: unknown kernel name, or a forced kernel that cannot run these inputs.
    """
    if isinstance(kernel, BlockKernel):
        chosen = kernel
    elif kernel is None:
        for cls in _KERNELS:
            candidate = cls()
            if candidate.supports(device, dtype):
                return candidate
        raise ValueError(f"no block kernel supports device {device} with dtype {dtype}")
    else:
        classes = available_kernels()
        if kernel not in classes:
            raise ValueError(f"kernel must be one of {sorted(classes)}; got {kernel!r}")
        chosen = classes[kernel]()
    if not chosen.supports(device, dtype):
        raise ValueError(
            f"kernel {chosen.name!r} does not support device {device} with dtype {dtype}"
        )
    return chosen
