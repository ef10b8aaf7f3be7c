"""A sketch of tensors' values on their own device, compared across ranks within a tolerance.

Legend: n a tensor's elements, W = 1024 elements per row, m = ceil(n / W) rows, K sketch values.

Note [Replicated values agreed by sketch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Inputs documented as the same on every rank (replicated text, replicated K/V) ride in the rank
agreement by value, so that ranks given different prompts of the same length raise instead of
returning numbers that match no attention. They cannot be compared bit for bit: the library's
own replicated outputs differ in their last bits between ranks (a text row's partials merge in
each rank's ring order), so in a Flux model the text stream after the first block differs by
about 1e-7 (float32) or 1e-4 (float16) of its norm between 4 ranks, and an exact digest failed
every layer after the first. So the ranks compare a random projection of the values, K = 8
numbers in float64::

    s[k] = sum_i,j  a[i, k] * b[j, k] * x[i, j]       x: the values in rows of W (zero-padded)
                                                      a, b: +-1 signs fixed by their indices

(``(x @ b)`` on the tensor's device, then one reduction by ``a``; several tensors add their
sketches, each with its own signs). ``|s - s'|`` is about ``|x - x'|`` and ``|s|`` about
``|x|`` (a random projection keeps norms, to within about 1 / sqrt(K)), so two ranks agree when
``|s - s'| <= rtol * max(|s|, |s'|)``. :func:`replicated_rtol` is ``min(0.25, 256 * eps)`` of
the dtype: 3e-5 in float32, 0.25 in float16 and bfloat16, 6e-14 in float64: some hundred times
the rounding seen, far below the distance of other values (two independent prompts: about
1.4; a shard of the text in place of the whole: about 1.4). What it does not catch: values
that differ by less than that (a few ulps: rounding, by design; a small part of the text in
half precision). The sketch travels in the agreement's digest frame (Note [Agreement by
digest] in tokenring.runtime.comm): no extra exchange.

Cost: one pass converting to float64, a few elementwise passes (Note [Non-finite values in a
sketch]) and a (2, m, W) @ (W, K) matmul on the tensor's device; the host reads 2K numbers,
which on a GPU waits for the work queued before it (a synchronisation: the host stops running
ahead of the GPU at that call). On a loaded 2-core CPU, float32 (1, 512, 24, 128): 2.5-5 ms;
joint_attn sketches the text rows of q, k and v, 15 ms of a 250 ms call on 2 ranks (T = 512,
512 image tokens per rank). Under ``torch.compile`` it runs eagerly (a graph break, as the
agreement's exchange is one).

Note [Non-finite values in a sketch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A NaN or inf in the projection makes every one of its K sums NaN or inf, which compare unequal
even where every rank holds the same values: ranks given the same text holding a NaN (a
diverged model) raised "ranks disagree", where a single process returns NaN as attention does.
So the non-finite values are projected apart, as codes (NaN 1, -inf 2, +inf 4: exact small
integers, so their sums are exact) compared exactly, and the finite values with those as 0
within the tolerance: the same NaN on every rank agrees, a NaN on one rank alone (or at
another place, or an inf for a NaN) differs. The signs are +-2**-64, so that float64 values
near its largest (1e308; their sums overflowed to inf, or inf - inf = NaN) stay finite; a power
of two scales without rounding (values below about 2**-1000 lose bits: far below rounding).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["SKETCH_NUM_VALUES", "Sketch", "replicated_rtol", "sketch"]

SKETCH_NUM_VALUES = 8  # K
ROW_VALUES = 1024  # W
_MAX_TENSORS = 8


@dataclass(frozen=True, slots=True)
class Sketch:
    """A signature field the rank agreement compares within ``rtol`` (Note [Replicated values
    agreed by sketch]), not exactly: rank 0's ``rtol`` decides."""

    values: tuple[float, ...]
    """K numbers: the projection of the finite values (the others as 0)."""
    rtol: float
    """Ranks agree where their sketches are within ``rtol`` of the larger one's norm."""
    nonfinite: tuple[float, ...] = (0.0,) * SKETCH_NUM_VALUES
    """K numbers: the projection of the non-finite values' codes (NaN 1, -inf 2, +inf 4),
    compared exactly (Note [Non-finite values in a sketch])."""

    def distance(self, other: Sketch) -> float:
        """``|self - other| / max(|self|, |other|)``: 0 for two zero sketches; inf where the
        non-finite values differ (in place or kind), or a sketch is not finite."""
        if self.nonfinite != other.nonfinite:
            return math.inf
        if self.values == other.values:
            return 0.0
        finite = [all(math.isfinite(x) for x in s.values) for s in (self, other)]
        if not all(finite):
            return math.inf
        norm = max(math.hypot(*self.values), math.hypot(*other.values))
        gap = math.hypot(*(a - b for a, b in zip(self.values, other.values, strict=True)))
        return gap / norm


def replicated_rtol(dtype: torch.dtype) -> float:
    """The tolerance of :class:`Sketch` for values of ``dtype``: ``min(0.25, 256 * eps)``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return min(0.25, 256 * eps)


def _signs(seed: int, count: int) -> list[float]:
    """``count`` signs +-1 from splitmix64: fixed by the algorithm alone, on every rank."""
    mask = 2**64 - 1
    out = []
    for _ in range(count):
        seed = (seed + 0x9E3779B97F4A7C15) & mask
        z = seed
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(1.0 if (z ^ (z >> 31)) & 1 else -1.0)
    return out


@functools.cache
def _column_signs_on_host() -> torch.Tensor:
    """b for each tensor: ``(tensors, W, K)`` float64, +-2**-64 (Note [Non-finite values in a
    sketch]: a power of two scales exactly, and float64 values near its largest do not
    overflow the sums)."""
    count = _MAX_TENSORS * ROW_VALUES * SKETCH_NUM_VALUES
    signs = torch.tensor(_signs(0x746F6B656E72696E, count), dtype=torch.float64) * 2.0**-64
    return signs.view(_MAX_TENSORS, ROW_VALUES, SKETCH_NUM_VALUES)


@functools.lru_cache(maxsize=8)
def _column_signs(device: torch.device) -> torch.Tensor:
    return _column_signs_on_host().to(device)


def _row_signs(rows: int, index: int, device: torch.device) -> torch.Tensor:
    """a for tensor ``index``: ``(rows, K)`` float64 signs, a hash of (row, k, index)."""
    i = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    k = torch.arange(SKETCH_NUM_VALUES, dtype=torch.int64, device=device)[None, :]
    h = (i * 0x2545F491 + k * 0x9E3779B1 + index * 0x85EBCA77) % (2**31 - 1)  # below 2**62
    h = (h * 0x27D4EB2F) % (2**31 - 1)
    return 1.0 - 2.0 * ((h >> 11) & 1).to(torch.float64)


@torch.compiler.disable  # a host read (dynamo traced _signs' loop for minutes, then broke)
def sketch(*tensors: torch.Tensor, rtol: float) -> Sketch:
    """The sketch of ``tensors``' values in float64 (Note [Replicated values agreed by
    sketch]), computed on their devices; synchronises with a GPU (the host reads 2K numbers).
    Runs eagerly under ``torch.compile``."""
    assert len(tensors) <= _MAX_TENSORS, "its callers sketch 2 or 3 tensors"
    total = torch.zeros(2, SKETCH_NUM_VALUES, dtype=torch.float64)  # values, non-finite codes
    for index, x in enumerate(tensors):
        x = x.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        device = x.device if x.device.type in ("cpu", "cuda") else torch.device("cpu")
        n = x.numel()
        if n == 0:
            continue
        rows = -(-n // ROW_VALUES)
        padded = torch.empty(rows * ROW_VALUES, dtype=torch.float64, device=device)
        padded[:n].view(x.shape).copy_(x)  # any strides
        padded[n:].zero_()
        # Note [Non-finite values in a sketch]: their codes apart, the values as 0
        finite = torch.isfinite(padded)
        codes = torch.where(torch.isnan(padded), 1.0, torch.sign(padded) + 3.0)
        parts = torch.stack([torch.where(finite, padded, 0.0), torch.where(finite, 0.0, codes)])
        per_row = parts.view(2, rows, ROW_VALUES) @ _column_signs(device)[index]  # (2, m, K)
        total += (per_row * _row_signs(rows, index, device)).sum(dim=1).cpu()
    values, nonfinite = (tuple(row) for row in total.tolist())
    return Sketch(values=values, rtol=rtol, nonfinite=nonfinite)
