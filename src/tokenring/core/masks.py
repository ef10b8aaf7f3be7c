"""The attention mask as plain data (:class:`MaskSpec`: causal, sliding window, documents,
chunks) and its classification of runs of tokens into kernel calls: skipped, full, top-left
causal, or an explicit mask from positions.

Legend: S global seq, sq / sk rows of a query / key run, P world size.

Note [Mask classes]
~~~~~~~~~~~~~~~~~~~
Query i may see key j (global positions) when both are in the same document and
``i - left <= j <= i + right`` (flash-attention's ``window_size=(left, right)``; -1 means
unbounded; ``causal`` forces right = 0). For a query run [qa, qb) against a key run [ka, kb)
of the same document::

    EMPTY   kb - 1 < qa - left   or  ka > qb - 1 + right   no pair visible: skipped
    FULL    ka >= qb - 1 - left  and kb - 1 <= qa + right  every pair visible: no mask
    CAUSAL  same run, right = 0, left >= its length - 1     the kernels' top-left causal flag
    MASKED  anything else                                   bool mask from the positions

Runs of different documents are EMPTY. Chunked attention (a query sees only its own chunk of c
tokens from its document's start) is documents of the mask only: :func:`chunk_documents` cuts
the documents, and :meth:`MaskSpec.split` cuts the layout's runs (whose documents stay the
packed ones) at the mask's boundaries before pairing. d0 = [0, 10), d1 = [10, 16), c = 4::

    layout documents:  0 ........................ 10 ............... 16
    mask documents:    0 ....... 4 ....... 8 .... 10 ....... 14 .... 16

Before classifying, both runs are trimmed to the rows that see something (:meth:`MaskSpec.trim`).
Under a window the query runs are first cut into tiles about as wide as the band, so each
piece's key rows follow it (not s^2 pairs for s * w visible). Padding rows belong to no run.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenring.core.layout import Run, check_int, is_int

__all__ = ["MaskKind", "MaskSpec", "chunk_documents", "normalize_window"]

_INT64_MAX = 2**63 - 1


class MaskKind(enum.Enum):
    """How a (query run, key run) pair is computed; see Note [Mask classes]."""

    EMPTY = "empty"
    FULL = "full"
    CAUSAL = "causal"
    MASKED = "masked"


def normalize_window(window_size: Sequence[int] | int | None, *, causal: bool) -> tuple[int, int]:
    """flash-attention's ``window_size=(left, right)`` (-1: unbounded; an int w: (w, w)) as a
    checked tuple; ``causal`` forces right to 0."""
    bad = ValueError(
        "window_size must be (left, right) with each >= 0, or -1 for unbounded, as ints (an "
        f"int w: (w, w)); got {window_size!r}"
    )
    sides: Any = (-1, -1) if window_size is None else window_size
    if is_int(sides):
        sides = (sides, sides)
    try:
        window = list(sides)
    except TypeError:
        raise bad from None
    if len(window) != 2 or not all(is_int(x) and int(x) >= -1 for x in window):
        raise bad  # a float is not a number of keys: 2.9 is not rounded to 2
    left, right = (int(x) for x in window)
    return (left, 0) if causal else (left, right)


def chunk_documents(cu_seqlens: Sequence[int], attention_chunk_size: int | None) -> tuple[int, ...]:
    """Document boundaries ``(0, ..., S)`` cut into chunks of ``attention_chunk_size`` tokens
    from each document's start (Note [Mask classes]); unchanged when None.

    Raises:
        ValueError: attention_chunk_size not an int >= 1 or None.
    """
    if attention_chunk_size is None:
        return tuple(cu_seqlens)
    check_int("attention_chunk_size", attention_chunk_size, 1, optional=True)
    c = attention_chunk_size
    bounds = [0]
    for a, b in itertools.pairwise(cu_seqlens):
        bounds += [*range(a + c, b, c), b]
    return tuple(bounds)


@dataclass(frozen=True, slots=True)
class MaskSpec:
    """The attention mask over global positions. Pure data, hashable."""

    causal: bool
    """Key j visible only from queries i >= j."""
    window: tuple[int, int] = (-1, -1)
    """(left, right) from :func:`normalize_window`: i - left <= j <= i + right (-1: unbounded)."""
    cu_seqlens: tuple[int, ...] | None = None
    """The mask's document boundaries (0, ..., S), chunks included (:func:`chunk_documents`);
    None: one document."""

    @property
    def _left(self) -> float:
        return float("inf") if self.window[0] < 0 else self.window[0]

    @property
    def _right(self) -> float:
        if self.causal:
            return 0
        return float("inf") if self.window[1] < 0 else self.window[1]

    @property
    def plain(self) -> bool:
        """No window and no documents: only ``causal`` matters."""
        unbounded = self.window[0] < 0 and (self.causal or self.window[1] < 0)
        return unbounded and (self.cu_seqlens is None or len(self.cu_seqlens) <= 2)

    def split(self, run: Run) -> tuple[Run, ...]:
        """``run`` cut at this mask's document boundaries, each part with its mask document."""
        if self.cu_seqlens is None or len(self.cu_seqlens) <= 2 or run.length == 0:
            return (run,)
        start, stop = run.global_start, run.global_start + run.length
        first = bisect.bisect_right(self.cu_seqlens, start) - 1
        parts = []
        for doc in range(first, len(self.cu_seqlens) - 1):
            lo, hi = max(start, self.cu_seqlens[doc]), min(stop, self.cu_seqlens[doc + 1])
            if lo >= stop:
                break
            if hi > lo:
                parts.append(Run(run.local_start + lo - start, hi - lo, lo, doc))
        return tuple(parts)

    def band_tile(self) -> int | None:
        """Query rows per piece under a window: the band's width, at least 32 (None: no window)."""
        width = self._left + self._right + 1
        if width == float("inf"):
            return None
        return max(32, int(width))

    def classify(self, q_run: Run, kv_run: Run) -> MaskKind:
        """See Note [Mask classes]."""
        if self.trim(q_run, kv_run) is None:  # no pair visible
            return MaskKind.EMPTY
        qa, qb = q_run.global_start, q_run.global_start + q_run.length
        ka, kb = kv_run.global_start, kv_run.global_start + kv_run.length
        left, right = self._left, self._right
        if ka >= qb - 1 - left and kb - 1 <= qa + right:
            return MaskKind.FULL
        if (qa, qb) == (ka, kb) and right == 0 and left >= qb - qa - 1:
            return MaskKind.CAUSAL
        return MaskKind.MASKED

    def trim(self, q_run: Run, kv_run: Run) -> tuple[Run, Run] | None:
        """The queries that see some key and the keys some query sees (each one range), or
        None when nothing is visible."""
        if q_run.length == 0 or kv_run.length == 0 or q_run.doc != kv_run.doc:
            return None
        qa, qb = q_run.global_start, q_run.global_start + q_run.length
        ka, kb = kv_run.global_start, kv_run.global_start + kv_run.length
        left, right = self._left, self._right
        q_lo, q_hi = max(qa, ka - right), min(qb - 1, kb - 1 + left)
        k_lo, k_hi = max(ka, qa - left), min(kb - 1, qb - 1 + right)
        if q_lo > q_hi or k_lo > k_hi:
            return None
        return _sub_run(q_run, int(q_lo), int(q_hi) + 1), _sub_run(kv_run, int(k_lo), int(k_hi) + 1)

    def visible(self, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
        """``(sq, sk)`` bool: which keys each query sees. Positions -1 (padding) see nothing
        and are seen by nothing."""
        i = q_positions.view(-1, 1)
        j = kv_positions.view(1, -1)
        ok = (i >= 0) & (j >= 0)
        if self.causal:
            ok &= j <= i
        # as distances: i + right overflows int64 for a window near 2**63 (any side wider
        # than int64 is unbounded for int64 positions)
        left, right = (min(w, _INT64_MAX) for w in self.window)
        if left >= 0:
            ok &= i - j <= left
        if not self.causal and right >= 0:
            ok &= j - i <= right
        if self.cu_seqlens is not None and len(self.cu_seqlens) > 2:
            bounds = torch.tensor(self.cu_seqlens[1:-1], dtype=torch.int64, device=i.device)
            doc_q = torch.bucketize(i, bounds, right=True)
            doc_k = torch.bucketize(j, bounds, right=True)
            ok &= doc_q == doc_k
        return ok


def _sub_run(run: Run, start: int, stop: int) -> Run:
    """The tokens [start, stop) (global positions) of ``run``."""
    return Run(run.local_start + start - run.global_start, stop - start, start, run.doc)
