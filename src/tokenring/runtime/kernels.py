"""Local block kernels: attention of one Q block against one K/V block, with lse.

A kernel maps ``q, k, v -> (out, lse)`` and back; :func:`select_kernel` picks one for a
device and dtype, and the pure function :func:`plan_block` names each tile's operator.

Legend: B batch, sq query rows, sk key rows, Hq query heads, Hkv key/value heads (divides Hq),
D head dim, T tile rows. Public tensors are ``(B, rows, H, D)``; lse and delta are
``(B, Hq, sq)`` in the accumulation dtype (float64 for float64 inputs, else float32).

Note [Backward from delta]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The block backward needs P = exp(S - lse) with the *global* lse and delta = rowsum(dout * out)
with the *global* out. TokenRing ships delta (one number per row and head) instead of out.
Fused backward ops take ``out`` and compute delta themselves, so they get a stand-in out' with
the same row sums against dout. out' is in q's dtype, so it must carry delta through that
rounding: it is zero but in the row's two largest |dout| entries j1, j2::

    out'_j1 = rnd(delta / dout_j1)      out'_j2 = rnd((delta - dout_j1 * out'_j1) / dout_j2)

(rnd: rounding into q's dtype; 0 where dout is 0, where delta is 0 too). The op sums
dout * out' in float32, where a product of two bf16 or fp16 numbers is exact, so its delta is
off by about eps^2 |delta|. The proportional form dout * delta / |dout|^2 (|out'| <= |out| by
Cauchy-Schwarz), rounded entry by entry, was off by about eps |delta|: with Ulysses in bf16 and
one key per query (dq = dk = 0 exactly) dk came out 0.0125 where plain bf16 attention gives
3e-7. A row whose out'_j1 (at most sqrt(D) |out|) leaves the dtype's range still takes the
proportional form, and so do float32 and float64, whose rounding (2^-24 or less) is not worth
the sparse form's extra passes. A caller that holds the real out (its own queries) passes it
(``out=``); :class:`TiledKernel` builds the stand-in once per q tile that meets several kv
tiles. FlexAttention uses Note [Backward through autograd].

Note [Kernel plan]
~~~~~~~~~~~~~~~~~~
No call allocates a (sq, sk) tensor on CUDA. :class:`TiledKernel` cuts every piece into tiles
of at most T x T, each skipped, full, causal (a diagonal tile) or masked (Note [Mask classes]
in tokenring.core.masks), and adds tile gradients straight into the caller's accumulators
(fused kernels run the forward of an unmasked piece whole: it holds O(s) anyway).
:func:`plan_block` names the operator of each tile:

    device  dtype        D          mask class    operator
    cuda    fp16, bf16   %8, <=256  full, causal  flash-attn 2 package, else SDPA flash (sm80+)
    cuda    fp32; fp16/bf16 where flash cannot    SDPA memory-efficient (bf16: sm80+)
    cuda    any          any        masked        FlexAttention (opt-in), else tiled reference
    cuda    fp64, or a head dim no fused op takes the tiled reference
    cpu     any          any        any           PyTorch's CPU flash op (dense mask per tile)

The tiled reference materialises (B, Hq, T, T) scores per tile; a masked tile builds its
(T, T) mask from positions (:class:`PositionMask`). The CPU op's backward walks keys slower
than queries, so its non-causal tiles have at most as many kv rows as q rows (and >= 512).
On CPU T = 1024, or 2048 where a rank holds s >= 4096 rows (:func:`cpu_tile_rows`; masked
tiles stay 1024): with two processes sharing the cores, the op's backward of a rank's pieces
at s = 4096 takes 1-8% (bf16) and 3-6% (fp32) less in 2048-row tiles than in 1024-row ones
(``benchmarks/backward_tiles.py``). A tile's dq, dk and dv are held beside the accumulators, so
T stays at most s / 2: at s = 2048, 2048-row tiles took Ulysses and all-gather K/V from 1.91x
and 1.96x of the minimum memory to 2.04x and 2.02x (``tokenring bench --mode memory``).

Note [Partials in float32]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A strategy adds the gradients of many blocks into float32 accumulators (dq over the kv
blocks a query row meets, dK/dV over the query blocks): :meth:`BlockKernel.backward_into`.
Each block's gradients rounded into q's dtype first cost one rounding per block where plain
attention rounds once. For float16 that rounding is absolute below 2^-14 (subnormals, step
2^-24): with q, k, v and dout of magnitude 1e-2, dq is ~1e-6 and every block added about as
much error as plain attention's whole result, growing with P (one process adding P blocks:
0.9, 1.7, 2.8, 3.9x the bound of ../shared/STYLE.md at P = 2, 4, 8, 16; Ring at P = 8 on gloo:
2.6x). The CPU op therefore computes float16 blocks in float32 when they are accumulated
(exact inputs; :meth:`BlockKernel.accumulated_backward`): at most 0.5x the bound at any P,
and faster here (a 1024-row block, D = 64: 41 ms against 48 ms). bfloat16 keeps its own op:
float32's exponent range (no subnormals at these magnitudes, at most 0.9x the bound up to
P = 64) and the op runs natively (30 ms against 43 ms). A block's dq that returns to its
owner (TokenRing) travels in q's dtype (the cost model's message), rounded once per visited
rank. CUDA ops return q's dtype (their fp32 accumulation is inside the op).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import torch
from torch import Tensor

from tokenring.core.masks import MaskSpec
from tokenring.core.merge import merge_into

__all__ = [
    "MATERIALISING",
    "BlockKernel",
    "CpuFlashKernel",
    "CudaFusedKernel",
    "FlashAttnKernel",
    "PositionMask",
    "ReferenceKernel",
    "TiledKernel",
    "accumulation_dtype",
    "available_kernels",
    "cpu_tile_rows",
    "plan_block",
    "row_delta",
    "select_kernel",
]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs; float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_channel_width(x: Tensor) -> int:
    """The head dim D + e of a backward that carries lse's gradient, for ``x`` ``(B, s, H, D)``
    (Note [Gradient of lse] in tokenring.runtime.op): e = 8 on CUDA where 8 divides D, so the
    fused kernels still take it, else 1."""
    d = x.shape[3]
    return d + (8 if x.device.type == "cuda" and d % 8 == 0 else 1)


def widen(x: Tensor, width: int, channel: Tensor | float) -> Tensor:
    """``x`` ``(B, s, H, D)`` as ``(B, s, H, width)``: ``channel`` in channel D, zeros after it
    (Note [Gradient of lse] in tokenring.runtime.op)."""
    d = x.shape[3]
    wide = x.new_zeros((*x.shape[:3], width))
    wide[..., :d] = x
    wide[..., d : d + 1] = channel
    return wide


def row_delta(dout: Tensor, out: Tensor, acc: torch.dtype) -> Tensor:
    """delta = rowsum(dout * out) ``(B, Hq, s)`` in ``acc`` from ``(B, s, Hq, D)`` dout and
    out (Note [Backward from delta])."""
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


@dataclass(frozen=True, slots=True)
class PositionMask:
    """A block's mask as positions (on the CPU: tiles are classified without a device sync):
    row i sees key j when ``spec.visible(q_positions[i], kv_positions[j])``."""

    spec: MaskSpec
    q_positions: Tensor  # (sq,) int64 on the CPU, -1 for padding
    kv_positions: Tensor  # (sk,)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q_positions.numel(), self.kv_positions.numel())

    def dense(self, device: torch.device | None = None) -> Tensor:
        """The ``(sq, sk)`` bool mask (a tile's, when cut first), on ``device``."""
        visible = self.spec.visible(self.q_positions, self.kv_positions)
        return visible if device is None else visible.to(device, non_blocking=True)

    def tile(self, q_rows: tuple[int, int], kv_rows: tuple[int, int]) -> PositionMask:
        q_pos, kv_pos = self.q_positions[slice(*q_rows)], self.kv_positions[slice(*kv_rows)]
        return PositionMask(self.spec, q_pos, kv_pos)

    def visibility(self, strip_rows: int = 256) -> tuple[bool, bool]:
        """(any pair visible, every pair visible), ``strip_rows`` query rows at a time."""
        any_seen, all_seen = False, True
        for a in range(0, self.shape[0], strip_rows):
            strip = self.spec.visible(self.q_positions[a : a + strip_rows], self.kv_positions)
            any_seen = any_seen or bool(strip.any())
            all_seen = all_seen and bool(strip.all())
        return any_seen, all_seen and self.shape[0] > 0


Mask: TypeAlias = "Tensor | PositionMask"
"""A block mask: bool ``(sq, sk)`` (True: visible), or positions."""
Grads: TypeAlias = tuple[Tensor, Tensor, Tensor]
"""Gradient accumulators of a block: dq ``(B, sq, Hq, D)``, dk and dv ``(B, sk, Hkv, D)``."""


def _dense(mask: Mask | None, q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """The bool ``(sq, sk)`` mask on q's device, checked."""
    if mask is None:
        return None
    assert not causal, "a block gets either the causal flag or an explicit mask"
    if isinstance(mask, PositionMask):
        mask = mask.dense(q.device)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (q.shape[1], k.shape[1]), (
        f"mask must be bool {(q.shape[1], k.shape[1])}; got {mask.dtype} {tuple(mask.shape)}"
    )
    return mask.to(q.device)


class BlockKernel(abc.ABC):
    """Attention of one block, forward and backward, with the log-sum-exp of each row.

    A kernel implements the hooks ``_forward`` and ``_backward``, which :meth:`forward` and
    :meth:`backward` run once they checked the tile against ``tiles`` and counted the call in
    ``ran[op]``; or it overrides :meth:`forward` and :meth:`backward`."""

    name: str = "abstract"
    takes_out: bool = False
    """Whether :meth:`backward` uses ``out`` (fused ops compute delta from it)."""
    op = ""
    """The operator's name in ``ran`` ("": a dispatcher; the operators it runs count)."""
    tiles = "any"
    """The tiles it takes: "any" (a mask or none), "unmasked", "masked" (a PositionMask)."""

    def __init__(self) -> None:
        self.ran: collections.Counter[str] = collections.Counter()
        """Calls per operator since the last ``ran.clear()`` (the bench reports them)."""

    @abc.abstractmethod
    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this kernel runs for tensors on ``device`` with ``dtype``."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Block attention.

        Args:
            q: ``(B, sq, Hq, D)``.
            k, v: ``(B, sk, Hkv, D)``.
            causal: top-left causal mask (row i sees keys 0..i); only used with sq == sk.
            scale: softmax scale.
            mask: optional ``(sq, sk)`` bool tensor or :class:`PositionMask`, True where the
                query row may see the key (the same for every batch row and head); not
                combined with ``causal``. A row that sees no key gets out 0 and lse -inf.

        Returns:
            out ``(B, sq, Hq, D)`` in q's dtype, lse ``(B, Hq, sq)`` in the accumulation dtype.
        """
        self._start(causal, mask)
        if q.shape[1] == 0 or k.shape[1] == 0:  # no pair (the fused CPU op dies of SIGFPE)
            acc = accumulation_dtype(q.dtype)
            lse = torch.full(_lse_shape(q), float("-inf"), dtype=acc, device=q.device)
            return torch.zeros_like(q, memory_format=torch.contiguous_format), lse
        return self._forward(_Call(q, k, v, causal, scale, mask))

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
    ) -> Grads:
        """Gradients of one block given the global ``lse`` and ``delta`` of the q rows.

        Args:
            dout: ``(B, sq, Hq, D)``.
            q: ``(B, sq, Hq, D)``; k, v: ``(B, sk, Hkv, D)``.
            lse, delta: ``(B, Hq, sq)``, accumulation dtype (lse -inf: a row that sees no key
                anywhere; its gradients are 0).
            mask: as in :meth:`forward`.
            out: ``(B, sq, Hq, D)``, the q rows' global out when the caller holds it (its own
                queries); None: kernels that need an out build one from delta (Note [Backward
                from delta]). Either gives the same gradients.

        Returns:
            dq ``(B, sq, Hq, D)``, dk and dv ``(B, sk, Hkv, D)``, in q's dtype.
        """
        self._start(causal, mask)
        if q.shape[1] == 0 or k.shape[1] == 0:  # no pair: no gradient
            return _zeros_like(q), _zeros_like(k), _zeros_like(v)
        return self._backward(_Call(q, k, v, causal, scale, mask), dout, lse, delta, out)

    def _start(self, causal: bool, mask: Mask | None) -> None:
        if self.tiles == "unmasked":
            assert mask is None, "masked tiles go to the masked kernel"
        elif self.tiles == "masked":
            assert isinstance(mask, PositionMask) and not causal, "flex serves masked tiles"
        if self.op:
            self.ran[self.op] += 1

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of a checked call."""
        raise NotImplementedError(f"{type(self).__name__} implements no forward")

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        """:meth:`backward` of a checked call."""
        raise NotImplementedError(f"{type(self).__name__} implements no backward")

    def backward_into(
        self,
        grads: Grads | Callable[[], Grads],
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
        poll: Callable[[], None] | None = None,
    ) -> None:
        """:meth:`backward` added into ``grads = (dq, dk, dv)`` (any float dtype), or into
        what ``grads()`` returns, called after the first tile; ``poll`` runs after each tile
        (Note [Buffers in flight] in tokenring.runtime.ring)."""
        parts = self.accumulated_backward(
            dout, q, k, v, lse, delta, causal=causal, scale=scale, mask=mask, out=out
        )
        if poll is not None:
            poll()
        for acc, part in zip(grads() if callable(grads) else grads, parts, strict=True):
            acc += part

    def accumulated_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
    ) -> Grads:
        """:meth:`backward` for a caller that adds the gradients into accumulation-dtype
        buffers: in q's dtype, or in the accumulation dtype where the kernel computes them
        there (Note [Partials in float32])."""
        return self.backward(
            dout, q, k, v, lse, delta, causal=causal, scale=scale, mask=mask, out=out
        )


def _lse_shape(q: Tensor) -> tuple[int, int, int]:
    """``(B, Hq, sq)`` of a ``(B, sq, Hq, D)`` q."""
    return (q.shape[0], q.shape[2], q.shape[1])


def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


def _bhsd(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def _kind(causal: bool, mask: Mask | None) -> str:
    """The tile class of a whole piece (Note [Kernel plan])."""
    return "causal" if causal else ("full" if mask is None else "masked")


class _Call(NamedTuple):
    """One kernel call's arguments but the gradient inputs."""

    q: Tensor  # (B, sq, Hq, D)
    k: Tensor  # (B, sk, Hkv, D)
    v: Tensor  # (B, sk, Hkv, D)
    causal: bool
    scale: float
    mask: Mask | None

    def options(self) -> dict[str, Any]:
        """The keywords of the call (``causal``, ``scale``, ``mask``)."""
        return {"causal": self.causal, "scale": self.scale, "mask": self.mask}


class ReferenceKernel(BlockKernel):
    """Plain torch matmuls in the accumulation dtype, materialising ``(B, Hq, sq, sk)``
    scores; any device and dtype."""

    name = op = "reference"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def _scores(call: _Call) -> Tensor:
        """``(B, Hkv, G*sq, sk)`` scores (G = Hq / Hkv query heads per kv head, no repeat)."""
        q, k, _, causal, scale, mask = call
        visible = _dense(mask, q, k, causal)
        acc = accumulation_dtype(q.dtype)
        b, sq, hq, d = q.shape
        hkv = k.shape[2]
        qh = _bhsd(q).to(acc).reshape(b, hkv, (hq // hkv) * sq, d)  # (B, Hkv, G*sq, D)
        kh = _bhsd(k).to(acc)  # (B, Hkv, sk, D)
        scores = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale)  # (B, Hkv, G*sq, sk)
        hidden = None if visible is None else ~visible  # (sq, sk); never with causal (_dense)
        if causal:
            hidden = torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).triu_(1)
        if hidden is not None:
            scores.view(b, hkv, hq // hkv, sq, -1).masked_fill_(hidden, float("-inf"))
        return scores

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        q, acc = call.q, accumulation_dtype(call.q.dtype)
        b, sq, hq, d = q.shape
        scores = self._scores(call)
        lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G*sq)
        # a row that sees no key: lse -inf, taken as 0 so exp gives 0, not NaN (a NaN of
        # the inputs stays NaN, as in plain attention)
        finite = lse.masked_fill(torch.isneginf(lse), 0.0)
        probs = scores.sub_(finite.unsqueeze(-1)).exp_()  # in place
        out = torch.matmul(probs, _bhsd(call.v).to(acc))  # (B, Hkv, G*sq, D)
        return _bhsd(out.view(b, hq, sq, d)).to(q.dtype), lse.view(b, hq, sq)

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        q, k, v = call.q, call.k, call.v
        acc = accumulation_dtype(q.dtype)
        b, sq, hq, d = q.shape
        hkv = k.shape[2]
        flat = (b, hkv, (hq // hkv) * sq)
        scores = self._scores(call)
        lse_f = lse.to(acc).reshape(flat)
        # A row with lse -inf sees no key anywhere: its scores are all -inf too, P = 0.
        lse_f = lse_f.masked_fill(torch.isneginf(lse_f), 0.0)
        probs = scores.sub_(lse_f.unsqueeze(-1)).exp_()  # (B, Hkv, G*sq, sk), in place
        doh = _bhsd(dout).to(acc).reshape(b, hkv, flat[2], d)  # (B, Hkv, G*sq, D)
        qh = _bhsd(q).to(acc).reshape(b, hkv, flat[2], d)
        dv = torch.matmul(probs.transpose(-1, -2), doh)  # (B, Hkv, sk, D): sums over G
        ds = torch.matmul(doh, _bhsd(v).to(acc).transpose(-1, -2))  # dP (B, Hkv, G*sq, sk)
        ds.sub_(delta.to(acc).reshape(flat).unsqueeze(-1)).mul_(probs)
        del probs
        dq = torch.matmul(ds, _bhsd(k).to(acc)).mul_(call.scale).view(b, hq, sq, d)
        dk = torch.matmul(ds.transpose(-1, -2), qh).mul_(call.scale)  # (B, Hkv, sk, D)
        return _bhsd(dq).to(q.dtype), _bhsd(dk).to(k.dtype), _bhsd(dv).to(v.dtype)


def _stand_in_out(dout: Tensor, delta: Tensor) -> Tensor:
    """out' ``(B, Hq, sq, D)`` of Note [Backward from delta], in dout's dtype."""
    acc, dtype = delta.dtype, dout.dtype
    want = _bhsd(delta).unsqueeze(-1)  # (B, sq, Hq, 1)

    def ratio() -> Tensor:  # (B, sq, Hq, 1): the proportional form's delta / |dout|^2
        norm2 = torch.linalg.vector_norm(dout, dim=-1, keepdim=True, dtype=acc).square_()
        return torch.where(norm2 > 0, want / norm2.clamp_min(torch.finfo(acc).tiny), 0.0)

    if torch.finfo(dtype).bits > 16 or dout.shape[-1] == 1:  # rounding by 2^-24 or less
        return _bhsd(torch.mul(dout, ratio(), out=torch.empty_like(dout)))  # proportional
    size = dout.abs()  # (B, sq, Hq, D)
    first = size.max(-1, keepdim=True).indices  # (B, sq, Hq, 1): the largest |dout| of a row
    second = size.scatter_(-1, first, -1).max(-1, keepdim=True).indices  # the second largest
    del size
    d1, d2 = dout.gather(-1, first).to(acc), dout.gather(-1, second).to(acc)
    a = _rounded_ratio(want, d1, dtype)  # delta / dout_j1, rounded into dtype
    b = _rounded_ratio(want - d1 * a.to(acc), d2, dtype)  # the residual, exact in acc
    # a row with an entry past dtype's range (|delta| / max |dout| <= sqrt(D) |out|) takes
    # the proportional form dout * delta / |dout|^2 instead (|out'| <= |out|: Cauchy-Schwarz)
    fits = torch.isfinite(a) & torch.isfinite(b)
    out = torch.zeros_like(dout, memory_format=torch.contiguous_format)
    out.scatter_(-1, first, a.masked_fill(~fits, 0)).scatter_(-1, second, b.masked_fill(~fits, 0))
    # on the CPU the check is free and every row fitting (all but extreme fp16 rows) skips a
    # pass over out; on a GPU it would synchronise, so the pass runs (adding zeros)
    if dout.device.type != "cpu" or not bool(fits.all()):
        out.addcmul_(dout, ratio().masked_fill(fits, 0.0))
    return _bhsd(out)


def _rounded_ratio(num: Tensor, den: Tensor, dtype: torch.dtype) -> Tensor:
    """num / den rounded into ``dtype`` (0 where den is 0; inf where it leaves the range)."""
    return torch.where(den != 0, num / den.where(den != 0, 1.0), 0.0).to(dtype)


def _out_of(out: Tensor | None, dout: Tensor, delta: Tensor) -> Tensor:
    """A fused backward's ``out`` ``(B, Hq, sq, D)``: the real one, or the stand-in."""
    return _bhsd(out) if out is not None else _stand_in_out(dout, delta)


def _finite_lse(lse: Tensor, dtype: torch.dtype) -> Tensor:
    """lse with -inf (rows that see no key: P = 0 anyway) as 0, which gives no NaN."""
    out = lse.to(dtype)
    return out.masked_fill(torch.isneginf(out), 0.0).contiguous()


# PyTorch's fused CPU op returns out 0 and lse 0 for a query row holding a NaN when it sees
# fewer than 16 keys (torch 2.13, every dtype; 8 in float64): a finite partial that the merge
# weighs in, hiding the NaN that plain attention (and the op with more keys) returns. The
# kernel restores NaN there below this many keys (a margin over 16; the check reads q once).
_FEW_KEYS = 32


class _CpuFlashOps(BlockKernel):
    """PyTorch's fused CPU flash-attention ops on one tile (a masked one: an additive mask)."""

    name = "cpu_flash_op"
    op = "cpu_flash"
    takes_out = True

    def __init__(self) -> None:
        super().__init__()
        ops = torch.ops.aten
        self._fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
        self._bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        ok = self._fwd is not None and self._bwd is not None and device.type == "cpu"
        return ok and dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        assert self._fwd is not None
        q = call.q
        visible = _dense(call.mask, q, call.k, call.causal)
        bias = None if visible is None else _additive(visible, q.dtype)
        qkv = (_bhsd(q), _bhsd(call.k), _bhsd(call.v))
        fwd = self._fwd.default
        result = _named(fwd, *qkv, 0.0, call.causal, attn_mask=bias, scale=call.scale)
        out, lse = result["output"], result["logsumexp"]  # (B, Hq, sq, D), (B, Hq, sq)
        lse = lse.to(accumulation_dtype(q.dtype))
        if visible is not None:  # the op reports lse 0 for a row that sees no key
            lse = lse.masked_fill(~visible.any(-1), float("-inf"))
        if call.k.shape[1] < _FEW_KEYS:  # a NaN query row: (0, 0) from the op, not NaN
            nan_rows = qkv[0].isnan().any(-1)  # (B, Hq, sq)
            out = out.masked_fill(nan_rows.unsqueeze(-1), math.nan)
            lse = lse.masked_fill(nan_rows, math.nan)
        return _bhsd(out), lse

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        assert self._bwd is not None
        q, k, v = call.q, call.k, call.v
        visible = _dense(call.mask, q, k, call.causal)
        bias = None if visible is None else _additive(visible, q.dtype)
        args = (_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _out_of(out, dout, delta))
        lse_op = _finite_lse(lse, accumulation_dtype(q.dtype))
        bwd = self._bwd.default
        r = _named(bwd, *args, lse_op, 0.0, call.causal, attn_mask=bias, scale=call.scale)
        return _bhsd(r["grad_query"]), _bhsd(r["grad_key"]), _bhsd(r["grad_value"])

    def accumulated_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
    ) -> Grads:
        """float16 blocks in float32, their gradients left there (Note [Partials in
        float32]); other dtypes as :meth:`backward`."""
        if q.dtype == torch.float16:
            dout, q, k, v = (x.float() for x in (dout, q, k, v))
            out = None if out is None else out.float()
        return self.backward(
            dout, q, k, v, lse, delta, causal=causal, scale=scale, mask=mask, out=out
        )


# -- the tiles ---------------------------------------------------------------------------------


def _tiles(n: int, tile: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile, n)) for a in range(0, max(n, 1), tile)] if n else []


def _tile_class(
    causal: bool, mask: Mask | None, q_rows: tuple[int, int], kv_rows: tuple[int, int]
) -> tuple[str, Mask | None]:
    """``("empty"|"full"|"causal"|"masked", the tile's mask)``; see Note [Kernel plan]."""
    if causal:
        if kv_rows[0] > q_rows[1] - 1:
            return "empty", None
        if kv_rows[1] - 1 <= q_rows[0]:
            return "full", None
        assert q_rows == kv_rows, "causal pieces are square and tiled alike on both sides"
        return "causal", None
    if mask is None:
        return "full", None
    sub: Mask
    if isinstance(mask, PositionMask):
        sub = mask.tile(q_rows, kv_rows)
        any_seen, all_seen = sub.visibility()
    else:  # a dense mask (the collectives'): already (sq, sk), so a tile of it is no worse
        sub = mask[q_rows[0] : q_rows[1], kv_rows[0] : kv_rows[1]]
        any_seen, all_seen = bool(sub.any()), bool(sub.all())
    if not any_seen:
        return "empty", None
    if all_seen:
        return "full", None
    return "masked", sub


class TiledKernel(BlockKernel):
    """Any kernel, run tile by tile so a call's memory is bounded by its tile (Note [Kernel
    plan]).

    Args:
        inner: the kernel of one tile (default: :class:`ReferenceKernel`, the tiled
            reference); ``masked_inner`` serves the masked tiles (default: ``inner``).
        tile_rows: T, rows of a tile on both sides.
        tile_plain_forward: cut the forward of an unmasked piece too (False for fused
            kernels, which hold O(s) in the forward anyway).
        backward_kv_tile_floor: backward of a non-causal piece: kv tiles as long as the q
            tile, but no shorter than this (None: T on both sides).
    """

    def __init__(
        self,
        inner: BlockKernel | None = None,
        *,
        tile_rows: int = 512,
        masked_inner: BlockKernel | None = None,
        tile_plain_forward: bool = True,
        backward_kv_tile_floor: int | None = None,
        name: str = "tiled",
    ) -> None:
        super().__init__()
        _check_tile_rows(tile_rows=tile_rows)
        self.inner = inner if inner is not None else ReferenceKernel()
        self.masked_inner = masked_inner if masked_inner is not None else self.inner
        self.ran = self.masked_inner.ran = self.inner.ran  # one count per operator, whoever runs it
        self.tile_rows, self.name = tile_rows, name
        self.tile_plain_forward = tile_plain_forward
        self.backward_kv_tile_floor = backward_kv_tile_floor

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self.inner.supports(device, dtype) and self.masked_inner.supports(device, dtype)

    def _tile_grid(
        self, sq: int, sk: int, causal: bool, mask: Mask | None, *, backward: bool = False
    ) -> list[tuple[tuple[int, int], list[tuple[tuple[int, int], str, Mask | None]]]]:
        grid = []
        for q_rows in _tiles(sq, self.tile_rows):
            num = q_rows[1] - q_rows[0]
            kv_tile = self._backward_kv_tile(num, causal) if backward else self.tile_rows
            row = [(kv, *_tile_class(causal, mask, q_rows, kv)) for kv in _tiles(sk, kv_tile)]
            grid.append((q_rows, [tile for tile in row if tile[1] != "empty"]))
        return grid

    def _backward_kv_tile(self, q_tile_rows: int, causal: bool) -> int:
        """The kv rows of a backward tile beside a q tile of ``q_tile_rows`` rows."""
        floor = self.backward_kv_tile_floor
        if causal or floor is None:  # causal pieces are tiled alike on both sides
            return self.tile_rows
        return min(self.tile_rows, max(q_tile_rows, floor))

    def _kernel(self, kind: str) -> BlockKernel:
        return self.masked_inner if kind == "masked" else self.inner

    def _plain_forward_whole(self, q: Tensor, causal: bool) -> bool:
        """Whether the forward of an unmasked piece runs in one call."""
        return not self.tile_plain_forward

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        q, k, v, causal, scale, mask = call
        b, sq, hq, d = q.shape
        acc = accumulation_dtype(q.dtype)
        whole = sq <= self.tile_rows and k.shape[1] <= self.tile_rows
        if whole or (mask is None and self._plain_forward_whole(q, causal)):
            return self._kernel(_kind(causal, mask)).forward(q, k, v, **call.options())
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, sq, Hq, D)
        lse = torch.empty((b, hq, sq), dtype=acc, device=q.device)
        for (qa, qb), row in self._tile_grid(sq, k.shape[1], causal, mask):
            out_t = torch.zeros((b, qb - qa, hq, d), dtype=acc, device=q.device)
            lse_t = torch.full((b, hq, qb - qa), float("-inf"), dtype=acc, device=q.device)
            for (ka, kb), kind, sub in row:
                tile: dict[str, Any] = {"causal": kind == "causal", "scale": scale, "mask": sub}
                part = self._kernel(kind).forward(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], **tile)
                merge_into(out_t, lse_t, (0, qb - qa), *part)
            out[:, qa:qb] = out_t
            lse[:, :, qa:qb] = lse_t
        return out, lse

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        dq, dk, dv = self._grads(call, dout, lse, delta, out, accumulated=False)
        return dq.to(call.q.dtype), dk.to(call.k.dtype), dv.to(call.v.dtype)

    def accumulated_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
    ) -> Grads:
        """As :meth:`backward`, the tiles' gradients left in the dtype they were added in
        (Note [Partials in float32])."""
        if q.shape[1] == 0 or k.shape[1] == 0:  # no pair: no gradient
            return _zeros_like(q), _zeros_like(k), _zeros_like(v)
        call = _Call(q, k, v, causal, scale, mask)
        return self._grads(call, dout, lse, delta, out, accumulated=True)

    def _grads(
        self,
        call: _Call,
        dout: Tensor,
        lse: Tensor,
        delta: Tensor,
        out: Tensor | None,
        *,
        accumulated: bool,
    ) -> Grads:
        """The piece's gradients: one tile's from its kernel (its ``accumulated_backward``
        if ``accumulated``), else the tiles' added in the accumulation dtype."""
        q, k, v = call.q, call.k, call.v
        sq, sk = q.shape[1], k.shape[1]
        if sq <= self.tile_rows and sk <= self._backward_kv_tile(sq, call.causal):  # one tile
            kernel = self._kernel(_kind(call.causal, call.mask))
            run = kernel.accumulated_backward if accumulated else kernel.backward
            return run(dout, q, k, v, lse, delta, out=out, **call.options())
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        self.backward_into((dq, dk, dv), dout, q, k, v, lse, delta, out=out, **call.options())
        return dq, dk, dv

    def backward_into(
        self,
        grads: Grads | Callable[[], Grads],
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        *,
        causal: bool,
        scale: float,
        mask: Mask | None = None,
        out: Tensor | None = None,
        poll: Callable[[], None] | None = None,
    ) -> None:
        targets = None if callable(grads) else grads
        grid = self._tile_grid(q.shape[1], k.shape[1], causal, mask, backward=True)
        add = _Accumulate()
        for (qa, qb), row in grid:
            q_side = (dout[:, qa:qb], q[:, qa:qb])
            stats = (lse[:, :, qa:qb], delta[:, :, qa:qb])
            out_t = None if out is None else out[:, qa:qb]
            if out_t is None and len(row) > 1 and any(self._kernel(t[1]).takes_out for t in row):
                # the stand-in of a q tile that meets several kv tiles, once for all of them
                out_t = _bhsd(_stand_in_out(q_side[0], stats[1]))
            for (ka, kb), kind, sub in row:
                kv = (k[:, ka:kb], v[:, ka:kb])
                tile: dict[str, Any] = {"causal": kind == "causal", "scale": scale, "mask": sub}
                kernel = self._kernel(kind)
                parts = kernel.accumulated_backward(*q_side, *kv, *stats, out=out_t, **tile)
                if poll is not None:
                    poll()
                if targets is None:
                    assert callable(grads)
                    targets = grads()
                dq, dk, dv = targets
                add(dq[:, qa:qb], parts[0])
                add(dk[:, ka:kb], parts[1])
                add(dv[:, ka:kb], parts[2])
                del parts, dq, dk, dv


def _check_tile_rows(**sizes: int) -> None:
    """Raise a ValueError naming the first tile size below 1."""
    for name, rows in sizes.items():
        if rows < 1:
            raise ValueError(f"{name} must be >= 1; got {rows}")


class _Accumulate:
    """``target += part`` for one backward's tiles. A part in another dtype is cast into a
    buffer reused across the tiles first: the implicit cast would allocate a temporary per
    tile, which on CPU costs as much again as the add (page faults). The same bits."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], Tensor] = {}

    def __call__(self, target: Tensor, part: Tensor) -> None:
        if part.dtype != target.dtype:
            key = (tuple(part.shape), part.stride(), target.dtype)
            buffer = self.buffers.get(key)
            if buffer is None:  # laid out as the part, so the cast reads and writes in order
                buffer = self.buffers[key] = torch.empty_like(part, dtype=target.dtype)
            part = buffer.copy_(part)
        target += part


class CpuFlashKernel(TiledKernel):
    """PyTorch's fused CPU flash ops (Note [Kernel plan]): the backward and masked pieces tile
    by tile (T = ``tile_rows``), the forward of an unmasked piece whole; masked tiles cut
    finer (``masked_tile_rows``, at most T), so that their empty and full parts are skipped or
    run without a mask."""

    def __init__(self, *, tile_rows: int = 1024, masked_tile_rows: int = 1024) -> None:
        _check_tile_rows(tile_rows=tile_rows, masked_tile_rows=masked_tile_rows)
        ops, finer = _CpuFlashOps(), min(masked_tile_rows, tile_rows)
        masked = TiledKernel(
            ops,
            tile_rows=finer,
            tile_plain_forward=False,
            backward_kv_tile_floor=min(512, finer),
            name="cpu_flash_masked",
        )
        super().__init__(
            ops,
            tile_rows=tile_rows,
            masked_inner=masked,
            tile_plain_forward=False,
            backward_kv_tile_floor=min(512, tile_rows),
            name="cpu_flash",
        )


# -- CUDA ----------------------------------------------------------------------------------------

MATERIALISING = frozenset({"reference"})
"""Operators that hold a (sq, sk) tensor (:func:`plan_block` names them for tiles only)."""

SDPA_FLASH, SDPA_EFFICIENT, FLASH_ATTN = "sdpa_flash", "sdpa_efficient", "flash_attn"
FLEX, TILED_REFERENCE, CPU_FLASH = "flex", "tiled_reference", "cpu_flash"


def plan_block(
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    head_dim: int,
    tile_class: str,
    flash_attn: bool = False,
    flex: bool = False,
) -> str:
    """The operator of one tile (Note [Kernel plan]), for a described device (no GPU query).

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: CUDA compute capability ``(major, minor)``; None on CPU.
        tile_class: ``"full"``, ``"causal"`` or ``"masked"``.
        flash_attn: the flash-attn 2 package is installed (and asked for).
        flex: FlexAttention serves masked tiles (opt-in until validated on a GPU).

    Returns:
        One of ``"flash_attn"``, ``"sdpa_flash"``, ``"sdpa_efficient"``, ``"flex"``,
        ``"tiled_reference"``, ``"cpu_flash"``.
    """
    if tile_class not in ("full", "causal", "masked"):
        raise ValueError(f"tile_class must be 'full', 'causal' or 'masked'; got {tile_class!r}")
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda":
        return TILED_REFERENCE
    assert capability is not None, "a CUDA device has a compute capability"
    if tile_class == "masked":
        return FLEX if flex and dtype != torch.float64 else TILED_REFERENCE
    aligned = head_dim % 8 == 0 and head_dim <= 256
    half = dtype in (torch.float16, torch.bfloat16)
    if half and aligned and capability >= (8, 0):
        return FLASH_ATTN if flash_attn else SDPA_FLASH
    bf16_ok = dtype != torch.bfloat16 or capability >= (8, 0)
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and aligned and bf16_ok:
        return SDPA_EFFICIENT
    return TILED_REFERENCE


def _expand_kv(x: Tensor, heads_q: int) -> Tensor:
    """``(B, H, s, D)`` with kv heads repeated to ``heads_q`` (the SDPA ops take equal heads)."""
    groups = heads_q // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx: Tensor, heads_kv: int) -> Tensor:
    """Sum ``(B, Hq, s, D)`` gradients of repeated kv heads back to ``heads_kv``."""
    b, hq, s, d = dx.shape
    return dx if hq == heads_kv else dx.view(b, heads_kv, hq // heads_kv, s, d).sum(2)


class _SdpaOps(BlockKernel):
    """One unmasked tile through the fused CUDA SDPA operator ``op`` (flash or efficient)."""

    name = "cuda_sdpa_op"
    takes_out = True
    tiles = "unmasked"

    def __init__(self, op: str) -> None:
        super().__init__()
        assert op in (SDPA_FLASH, SDPA_EFFICIENT), op
        self.op = op

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        hq, sq = call.q.shape[2], call.q.shape[1]
        qkv = (_bhsd(call.q), _expand_kv(_bhsd(call.k), hq), _expand_kv(_bhsd(call.v), hq))
        options = {"dropout_p": 0.0, "is_causal": call.causal, "scale": call.scale}
        if self.op == SDPA_FLASH:
            fwd = torch.ops.aten._scaled_dot_product_flash_attention.default
            r = _named(fwd, *qkv, **options)
        else:  # attn_bias None, compute_log_sumexp True
            fwd = torch.ops.aten._scaled_dot_product_efficient_attention.default
            r = _named(fwd, *qkv, None, True, **options)
        lse_key = "logsumexp" if "logsumexp" in r else "log_sumexp"
        lse = r[lse_key][..., :sq].float()  # memory-efficient pads rows to a multiple of 32
        return _bhsd(r["output"]), lse

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        q, k, v, causal, scale, _ = call
        b, sq, hq, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        grad_in = (_bhsd(dout), _bhsd(q), _expand_kv(_bhsd(k), hq), _expand_kv(_bhsd(v), hq))
        out = _out_of(out, dout, delta)  # (B, Hq, sq, D)
        lse_op = _finite_lse(lse, torch.float32)  # (B, Hq, sq)
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: unused
        if self.op == SDPA_FLASH:
            bwd = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
            # cum_seq_q, cum_seq_k undefined for dense batches; max_q, max_k; dropout_p
            flash = (*grad_in, out, lse_op, None, None, sq, sk, 0.0, causal, no_rng, no_rng)
            r = _named(bwd, *flash, scale=scale)
            dq, dk, dv = r["grad_query"], r["grad_key"], r["grad_value"]
        else:
            rows = -(-sq // 32) * 32  # the op reads lse padded to a multiple of 32 rows
            lse_pad = torch.zeros((b, hq, rows), dtype=torch.float32, device=q.device)
            lse_pad[..., :sq] = lse_op
            bwd = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
            wanted = [True, True, True, False]  # grads of q, k, v, not of attn_bias (None)
            efficient = (*grad_in, None, out, lse_pad, no_rng, no_rng, 0.0, wanted, causal)
            dq, dk, dv, _ = bwd(*efficient, scale=scale)
        return _bhsd(dq), _bhsd(_reduce_kv(dk, hkv)), _bhsd(_reduce_kv(dv, hkv))


class _FlexOps(BlockKernel):
    """Masked tiles through FlexAttention (compiled on CUDA); the backward recomputes them.

    Note [Backward through autograd]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An autograd backward gives gradients of the tile's own (out_b, lse_b), whose
    P_b = exp(S - lse_b) differs from the global P = w * P_b, w = exp(lse_b - lse) per row.
    With upstream gradients g_out = w * dout and g_lse = w * (rowsum(dout * out_b) - delta),
    dS = P_b * (g_out . v - g_out . out_b) + P_b * g_lse = P * (dout . v - delta), the global
    dS; dV = P_b^T g_out = P^T dout. One extra forward per tile.
    """

    name = "flex_op"
    op = FLEX
    tiles = "masked"

    def __init__(self) -> None:
        super().__init__()
        self._flex: Callable[..., Any] | None = None
        self._compiled: Any = None
        self._aux: Any = None  # flex_attention's AuxRequest, where this torch has it
        with contextlib.suppress(ImportError):
            from torch.nn.attention import flex_attention

            self._flex = flex_attention.flex_attention
            self._aux = getattr(flex_attention, "AuxRequest", None)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return self._flex is not None and dtype in (torch.float32, torch.bfloat16, torch.float16)

    def _call(
        self, q: Tensor, k: Tensor, v: Tensor, mask: PositionMask, scale: float
    ) -> tuple[Tensor, Tensor]:
        from torch.nn.attention.flex_attention import create_block_mask

        assert self._flex is not None
        spec = mask.spec
        q_pos, kv_pos = (x.to(q.device) for x in (mask.q_positions, mask.kv_positions))
        bounds = torch.tensor((spec.cu_seqlens or (0,))[1:-1], dtype=torch.int64).to(q.device)
        q_doc, kv_doc = (torch.bucketize(x, bounds, right=True) for x in (q_pos, kv_pos))
        left, right = (min(w, 2**63 - 1) for w in spec.window)  # as in MaskSpec.visible

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            # MaskSpec.visible, one pair at a time (FlexAttention evaluates it per element)
            i, j = q_pos[q_idx], kv_pos[kv_idx]
            ok = (i >= 0) & (j >= 0) & (q_doc[q_idx] == kv_doc[kv_idx])
            if spec.causal:
                ok = ok & (j <= i)
            if left >= 0:
                ok = ok & (i - j <= left)
            if not spec.causal and right >= 0:
                ok = ok & (j - i <= right)
            return ok

        block_mask = create_block_mask(
            mask_mod, None, None, q.shape[1], k.shape[1], device=q.device
        )
        fn = self._flex
        if q.device.type == "cuda":  # eager FlexAttention materialises the scores
            if self._compiled is None:
                self._compiled = torch.compile(self._flex, dynamic=True)
            fn = self._compiled
        qkv, gqa = (_bhsd(q), _bhsd(k), _bhsd(v)), q.shape[2] != k.shape[2]
        options = {"block_mask": block_mask, "scale": scale, "enable_gqa": gqa}
        if self._aux is None:  # torch < 2.9: return_lse (deprecated since, to be removed)
            out, lse = fn(*qkv, **options, return_lse=True)
        else:
            out, aux = fn(*qkv, **options, return_aux=self._aux(lse=True))
            lse = aux.lse
        return out, lse  # (B, Hq, sq, D), (B, Hq, sq) float32

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        assert isinstance(call.mask, PositionMask)
        out, lse = self._call(call.q, call.k, call.v, call.mask, call.scale)
        return _bhsd(out), lse.float()

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        assert isinstance(call.mask, PositionMask)
        leaves = [x.detach().requires_grad_(True) for x in (call.q, call.k, call.v)]
        with torch.enable_grad():
            out_b, lse_b = self._call(leaves[0], leaves[1], leaves[2], call.mask, call.scale)
        dq, dk, dv = _global_grads(out_b, lse_b, dout, lse, delta, leaves)
        return dq, dk, dv


def _global_grads(
    out_b: Tensor, lse_b: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, leaves: list[Tensor]
) -> tuple[Tensor, ...]:
    """A tile's global gradients from its own out_b, lse_b (Note [Backward through autograd])."""
    acc = delta.dtype
    seen = ~(torch.isneginf(lse_b) | torch.isneginf(lse))
    w = torch.where(seen, torch.exp(lse_b.detach().to(acc) - lse.to(acc)), 0.0)  # (B, Hq, sq)
    do = _bhsd(dout).to(acc)  # (B, Hq, sq, D)
    local_delta = (do * out_b.detach().to(acc)).sum(-1)
    g_out = (do * w.unsqueeze(-1)).to(out_b.dtype)
    g_lse = (w * (local_delta - delta.to(acc))).to(lse_b.dtype)
    return torch.autograd.grad((out_b, lse_b), leaves, (g_out, g_lse), allow_unused=True)


def _flash_attn_ops() -> Any:
    """The flash-attn 2 package's registered operators, imported on first use."""
    try:
        import flash_attn.flash_attn_interface  # noqa: F401 (registers torch.ops.flashattn)
    except ImportError as exc:
        raise ImportError(
            "kernel 'flash_attn' needs the flash-attn package (pip install flash-attn "
            "--no-build-isolation; CUDA only)"
        ) from exc
    return torch.ops.flashattn


# the flash-attn 2 operators' options this library leaves off: dropout, window, softcap, ALiBi
_FLASH_ATTN_PLAIN: dict[str, Any] = dict(
    dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None
)


class _FlashAttnOps(BlockKernel):
    """One unmasked fp16/bf16 tile through the flash-attn 2 package (GQA native)."""

    name = "flash_attn_op"
    op = FLASH_ATTN
    takes_out = True
    tiles = "unmasked"

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    @functools.cached_property
    def _ops(self) -> Any:
        return _flash_attn_ops()

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        qkv = [x.contiguous() for x in (call.q, call.k, call.v)]
        options = {"softmax_scale": call.scale, "causal": call.causal, "return_softmax": False}
        out, lse, _, _ = self._ops._flash_attn_forward(*qkv, **options, **_FLASH_ATTN_PLAIN)
        return out, lse.float()  # (B, sq, Hq, D), (B, Hq, sq)

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        q, k, v = call.q, call.k, call.v
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        inputs = [x.contiguous() for x in (dout, q, k, v, _bhsd(_out_of(out, dout, delta)))]
        options = {"softmax_scale": call.scale, "causal": call.causal, "deterministic": False}
        lse_op = _finite_lse(lse, torch.float32)
        self._ops._flash_attn_backward(
            *inputs, lse_op, dq, dk, dv, **options, rng_state=None, **_FLASH_ATTN_PLAIN
        )
        return dq, dk, dv


_CUDA_OPS: dict[str, Callable[[], BlockKernel]] = {
    SDPA_FLASH: functools.partial(_SdpaOps, SDPA_FLASH),
    SDPA_EFFICIENT: functools.partial(_SdpaOps, SDPA_EFFICIENT),
    FLASH_ATTN: _FlashAttnOps,
    FLEX: _FlexOps,
    TILED_REFERENCE: ReferenceKernel,  # on a tile (TiledKernel cut it)
}
"""The operators :func:`plan_block` names on CUDA, by name."""


class _CudaDispatch(BlockKernel):
    """Runs each tile with the operator :func:`plan_block` names for it."""

    name = "cuda_dispatch"
    takes_out = True

    def __init__(self, *, flash_attn: bool, flex: bool, capability: tuple[int, int] | None) -> None:
        super().__init__()
        self.flash_attn, self.flex, self.capability = flash_attn, flex, capability
        self._ops: dict[str, BlockKernel] = {}

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype.is_floating_point

    def plan(self, q: Tensor, kind: str, mask: Mask | None) -> str:
        """:func:`plan_block` for this tile (a dense mask cannot go to FlexAttention)."""
        capability = self.capability or torch.cuda.get_device_capability(q.device)
        name = plan_block(
            device_type="cuda",  # this kernel's device (tests claim one for CPU tensors)
            capability=capability,
            dtype=q.dtype,
            head_dim=q.shape[3],
            tile_class=kind,
            flash_attn=self.flash_attn,
            flex=self.flex,
        )
        return TILED_REFERENCE if name == FLEX and not isinstance(mask, PositionMask) else name

    def _pick(self, call: _Call) -> BlockKernel:
        """The operator of this tile, made on first use."""
        name = self.plan(call.q, _kind(call.causal, call.mask), call.mask)
        if name not in self._ops:
            self._ops[name] = _CUDA_OPS[name]()
            self._ops[name].ran = self.ran
        return self._ops[name]

    def _forward(self, call: _Call) -> tuple[Tensor, Tensor]:
        return self._pick(call).forward(call.q, call.k, call.v, **call.options())

    def _backward(
        self, call: _Call, dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor | None
    ) -> Grads:
        op = self._pick(call)
        return op.backward(dout, call.q, call.k, call.v, lse, delta, out=out, **call.options())


class CudaFusedKernel(TiledKernel):
    """Fused CUDA kernels per tile (Note [Kernel plan]); masked tiles cut finer
    (``masked_tile_rows``) or through FlexAttention (``flex``); ``capability`` for tests."""

    def __init__(
        self,
        *,
        tile_rows: int = 8192,
        masked_tile_rows: int = 1024,
        flex: bool = False,
        flash_attn: bool = False,
        capability: tuple[int, int] | None = None,
    ) -> None:
        _check_tile_rows(tile_rows=tile_rows, masked_tile_rows=masked_tile_rows)
        if flash_attn:
            _flash_attn_ops()
        name = "flash_attn" if flash_attn else "cuda_sdpa"
        self.dispatch = _CudaDispatch(flash_attn=flash_attn, flex=flex, capability=capability)
        masked = TiledKernel(self.dispatch, tile_rows=masked_tile_rows, name=f"{name}_masked")
        super().__init__(
            self.dispatch,
            tile_rows=tile_rows,
            masked_inner=masked,
            tile_plain_forward=False,
            name=name,
        )

    def _plain_forward_whole(self, q: Tensor, causal: bool) -> bool:
        # whole only through a fused operator: the reference must be cut into tiles
        return self.dispatch.plan(q, _kind(causal, None), None) != TILED_REFERENCE


class FlashAttnKernel(CudaFusedKernel):
    """:class:`CudaFusedKernel` with fp16/bf16 tiles through the flash-attn 2 package.

    Raises:
        ImportError: flash-attn is not installed (naming the package to install).
    """

    def __init__(self, *, tile_rows: int = 8192, masked_tile_rows: int = 1024) -> None:
        super().__init__(tile_rows=tile_rows, masked_tile_rows=masked_tile_rows, flash_attn=True)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
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


_KERNELS: dict[str, Callable[[], BlockKernel]] = {
    "cpu_flash": CpuFlashKernel,
    "cuda_sdpa": CudaFusedKernel,
    "flash_attn": FlashAttnKernel,
    "tiled": TiledKernel,
    "reference": ReferenceKernel,
}
_AUTO_ORDER = ("cpu_flash", "cuda_sdpa", "tiled")


def _made(name: str, seq_local: int | None) -> BlockKernel:
    if name == CPU_FLASH and seq_local is not None:
        return CpuFlashKernel(tile_rows=cpu_tile_rows(seq_local))
    return _KERNELS[name]()


def available_kernels() -> dict[str, Callable[[], BlockKernel]]:
    """Kernel factories by name."""
    return dict(_KERNELS)


def cpu_tile_rows(seq_local: int | None) -> int:
    """T of :class:`CpuFlashKernel` for ranks of ``seq_local`` rows (Note [Kernel plan]):
    2048 from 4096 rows on, else (or unknown) 1024."""
    return 2048 if seq_local is not None and seq_local >= 4096 else 1024


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    kernel: str | BlockKernel | None = None,
    *,
    seq_local: int | None = None,
) -> BlockKernel:
    """The kernel to use for ``device``/``dtype``.

    Args:
        kernel: ``None`` picks the first that supports the inputs, in the order cpu_flash,
            cuda_sdpa (which runs float64 tiles through the tiled reference), tiled; a name
            or an instance forces that kernel. ``"reference"`` materialises each piece's
            scores (tests and tiny blocks only).
        seq_local: the rows a rank holds (the same on every rank: the padded length), for
            the tile size of a cpu_flash kernel picked by name or by default
            (:func:`cpu_tile_rows`); None: its default.

    Raises:
        ValueError: unknown kernel name, or a forced kernel that cannot run these inputs.
        ImportError: ``"flash_attn"`` without the flash-attn package.
    """
    if isinstance(kernel, BlockKernel):
        chosen = kernel
    elif kernel is None:
        for name in _AUTO_ORDER:
            candidate = _made(name, seq_local)
            if candidate.supports(device, dtype):
                return candidate
        raise ValueError(f"no block kernel supports device {device} with dtype {dtype}")
    elif kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {sorted(_KERNELS)}; got {kernel!r}")
    else:
        chosen = _made(kernel, seq_local)
    if not chosen.supports(device, dtype):
        raise ValueError(
            f"kernel {chosen.name!r} does not support device {device} with dtype {dtype}"
        )
    return chosen
