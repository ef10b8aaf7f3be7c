"""Sequence layouts: which global token positions each rank owns.

Legend: B batch, S global seq, s local seq (S // P), H heads, D head dim, P world size.

``Layout.CONTIGUOUS``: rank r owns positions [r*s, (r+1)*s) (causal work unbalanced).
``Layout.ZIGZAG``: 2P chunks of c = s/2 tokens; rank r owns chunks r and 2P-1-r, one early and
one late, so causal work is balanced. Needs an even s.

Note [Zigzag chunks]
~~~~~~~~~~~~~~~~~~~~
P = 3, 2P = 6 chunks of c tokens::

    global:  | c0 | c1 | c2 | c3 | c4 | c5 |
    rank 0:  | c0 | c5 |        local rows [0, c) = c0, [c, 2c) = c5
    rank 1:  | c1 | c4 |
    rank 2:  | c2 | c3 |

Positions inside a shard increase, so the causal mask of a rank's own shard is top-left.

Note [Documents and padding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Any global length S and packed documents (``cu_seqlens``) work. The sequence (zigzag: each
document on its own) is cut into near-equal pieces, longer first, kept in a padded local buffer
of ``seq_local`` rows on every rank. A :class:`Sharding` lists each rank's *runs* (consecutive
tokens of one document in consecutive rows); other rows are padding, never computed or seen.
Zigzag, d0 (10 tokens) and d1 (4 tokens), P = 2, pieces d0: 3 3 2 2, d1: 1 1 1 1::

    rank 0 rows:  d0[0:3] d1[0:1] | d0[8:10] pad d1[3:4]     early pieces, then late pieces
    rank 1 rows:  d0[3:6] d1[1:2] | d0[6:8]  pad d1[2:3]

Every rank gets pieces r and 2P-1-r of every document; early pieces come first, so the rows
a late query block needs stay one range. Callers pass ``s_r`` rows; the attention functions
pad them.
"""

from __future__ import annotations

import enum
import functools
import itertools
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tokenring.core.enums import parse_enum

__all__ = [
    "Layout",
    "Padding",
    "Run",
    "Sharding",
    "global_length",
    "global_positions",
    "make_sharding",
    "normalize_cu_seqlens",
    "position_ids",
    "shard",
    "split_evenly",
    "unshard",
    "validate_seq_local",
]


class Layout(enum.Enum):
    """How the global sequence is distributed over the ranks of the group."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"

    @classmethod
    def parse(cls, value: Layout | str) -> Layout:
        """Accept a member or its value; raise ValueError naming the options."""
        return parse_enum(cls, value, "layout")


def validate_seq_local(seq_local: int, layout: Layout, *, name: str = "seq_local") -> None:
    """Raise ValueError when ``seq_local`` tokens per rank cannot be split by ``layout``."""
    if seq_local < 1:
        raise ValueError(f"{name} must be >= 1; got {seq_local}")
    if layout is Layout.ZIGZAG and seq_local % 2 != 0:
        raise ValueError(
            f"{name} must be even for layout 'zigzag' (two chunks per rank); got {seq_local}"
        )


def is_int(x: object) -> bool:
    """An integer (Python, NumPy or a 0-d integer tensor), not a bool."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_floating_point() and x.dtype is not torch.bool
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_int(name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """ValueError naming ``value`` unless it is an int (not a bool) >= ``minimum`` (or None if
    ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {minimum}{extra}; got {value!r}")


def check_size(name: str, value: object, minimum: int) -> None:
    """ValueError naming ``value`` unless it is an int (not a bool) >= ``minimum``: "must be an
    int >= m" for another type, "must be >= m" for an int below it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")


def _check_seq_dim(x: torch.Tensor, seq_dim: int, name: str = "x") -> None:
    dims = x.dim()
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -dims <= seq_dim < dims:
        raise ValueError(
            f"seq_dim must be an int in [{-dims}, {dims}) for {name} of shape "
            f"{tuple(x.shape)}; got {seq_dim!r}"
        )


def global_positions(
    *,
    rank: int,
    world_size: int,
    layout: Layout | str,
    seq_local: int | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """``(s_r,)`` int64 global positions held by ``rank`` in local order, from ``seq_local``
    (S = P * s) or ``seq_len`` (Note [Documents and padding]). RoPE: :func:`position_ids`.

    Args:
        rank, world_size: this rank and P.
        layout: ``"contiguous"`` or ``"zigzag"``.
        seq_local, seq_len: exactly one: s (even shards, S = P * s) or the global S.
        cu_seqlens: document boundaries ``(0, ..., S)`` of a packed sequence.
    """
    return make_sharding(
        layout=layout,
        world_size=world_size,
        seq_len=global_length(world_size, seq_local, seq_len, Layout.parse(layout)),
        cu_seqlens=cu_seqlens,
    ).positions(_checked_rank(rank, world_size))


def position_ids(
    *,
    rank: int,
    world_size: int,
    layout: Layout | str,
    seq_len: int,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """``(s_r,)`` int64: each of ``rank``'s tokens' position in its document (RoPE).

    Args:
        rank, world_size: this rank and P.
        layout: ``"contiguous"`` or ``"zigzag"``.
        seq_len: the global length S.
        cu_seqlens: document boundaries ``(0, ..., S)``; None: one document.
    """
    return make_sharding(
        layout=layout, world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
    ).doc_positions(_checked_rank(rank, world_size))


def _checked_rank(rank: int, world_size: int) -> int:
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank!r}")
    return rank


def global_length(
    world_size: int, seq_local: int | None, seq_len: int | None, layout: Layout, *, inner: int = 1
) -> int:
    """S from exactly one of ``seq_local`` and ``seq_len``; ValueError otherwise. Each of the
    P shards is held by ``inner`` ranks of s tokens (Note [Hybrid layout] in tokenring.hybrid).
    """
    if (seq_local is None) == (seq_len is None):
        raise ValueError(
            f"give exactly one of seq_local and seq_len; got seq_local={seq_local}, "
            f"seq_len={seq_len}"
        )
    if seq_local is not None:
        check_int("seq_local", seq_local, 1)
        name = "seq_local" if inner == 1 else "seq_local * inner (an outer shard)"
        validate_seq_local(seq_local * inner, layout, name=name)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        return seq_local * inner * world_size
    assert seq_len is not None
    return seq_len


def shard(
    x: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    layout: Layout | str,
    seq_dim: int = 1,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """``rank``'s shard ``(B, s_r, H, D)`` (contiguous) of a global ``x`` ``(B, S, H, D)``
    along ``seq_dim``, any S (Note [Documents and padding]).

    Args:
        x: the global tensor.
        rank, world_size: this rank and P.
        layout: ``"contiguous"`` or ``"zigzag"`` (per document when ``cu_seqlens`` is given).
        seq_dim: the sequence dimension of ``x``.
        cu_seqlens: document boundaries ``(0, ..., S)`` of a packed sequence.
    """
    _check_seq_dim(x, seq_dim)
    index = make_sharding(
        layout=layout, world_size=world_size, seq_len=x.shape[seq_dim], cu_seqlens=cu_seqlens
    ).positions(_checked_rank(rank, world_size))
    return x.index_select(seq_dim, index.to(x.device)).contiguous()


def unshard(
    shards: Sequence[torch.Tensor],
    *,
    layout: Layout | str,
    seq_dim: int = 1,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of :func:`shard`: ``shards``, one ``(B, s_r, H, D)`` per rank, as ``(B, S, H,
    D)`` in global order (``cu_seqlens``: those given to :func:`shard`).

    Args:
        shards: every rank's shard, in rank order.
        layout, seq_dim, cu_seqlens: those given to :func:`shard`.
    """
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards must hold one tensor per rank; got an empty sequence")
    _check_seq_dim(shards[0], seq_dim, "shards[0]")
    for r, x in enumerate(shards):
        expected = list(shards[0].shape)
        expected[seq_dim] = x.shape[seq_dim]
        if list(x.shape) != expected:
            raise ValueError(
                f"shards[{r}] has shape {tuple(x.shape)}; expected {tuple(expected)} (only "
                f"dim {seq_dim} may differ between ranks)"
            )
    seq_len = sum(x.shape[seq_dim] for x in shards)
    sharding = make_sharding(
        layout=layout, world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
    )
    for r, x in enumerate(shards):
        if x.shape[seq_dim] != sharding.local_len(r):
            raise ValueError(
                f"shards[{r}].shape[{seq_dim}] must be {sharding.local_len(r)} for a global "
                f"length of {seq_len} under layout '{sharding.layout.value}'; got "
                f"{x.shape[seq_dim]}"
            )
    stacked = torch.cat(list(shards), dim=seq_dim)
    positions = torch.cat([sharding.positions(r) for r in range(world_size)]).to(stacked.device)
    return stacked.index_select(seq_dim, torch.argsort(positions))  # the inverse permutation


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive global tokens of one document held in consecutive local rows."""

    local_start: int
    """First local row (in the padded local buffer)."""
    length: int
    """Number of tokens (>= 0)."""
    global_start: int
    """Global position of the first token."""
    doc: int
    """Index of the document (0 without documents)."""

    @property
    def rows(self) -> tuple[int, int]:
        return (self.local_start, self.local_start + self.length)


@dataclass(frozen=True, slots=True)
class Sharding:
    """Where every global token lives: per rank, runs in a padded buffer of ``seq_local`` rows
    (Note [Documents and padding]). Build with :func:`make_sharding`."""

    layout: Layout
    world_size: int
    seq_len: int
    """S, the caller's global length."""
    cu_seqlens: tuple[int, ...]
    """Document boundaries ``(0, ..., S)``; ``(0, S)`` without documents."""
    seq_local: int
    """s_pad, the rows of the padded buffer."""
    runs: tuple[tuple[Run, ...], ...]
    """Per rank, its runs in local order."""

    def _runs(self, rank: int) -> tuple[Run, ...]:
        """``rank``'s runs; ValueError naming a rank outside [0, P) (-1 is not the last)."""
        return self.runs[_checked_rank(rank, self.world_size)]

    def local_len(self, rank: int) -> int:
        """Tokens rank ``rank`` holds (its caller-visible local length)."""
        return sum(run.length for run in self._runs(rank))

    @property
    def padded(self) -> bool:
        """Whether some local row holds no token."""
        return any(self.local_len(r) != self.seq_local for r in range(self.world_size))

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def positions(self, rank: int) -> torch.Tensor:
        """Global position of each token of ``rank`` in local order: ``(s_r,)`` int64."""
        return _aranges((r.global_start, r.length) for r in self._runs(rank))

    def doc_positions(self, rank: int) -> torch.Tensor:
        """Position inside its document of each token of ``rank``: ``(s_r,)`` int64."""
        starts = self.cu_seqlens
        return _aranges((r.global_start - starts[r.doc], r.length) for r in self._runs(rank))

    def padded_rows(self, rank: int) -> torch.Tensor:
        """Row of the padded local buffer of each token of ``rank``: ``(s_r,)`` int64."""
        return _aranges((r.local_start, r.length) for r in self._runs(rank))

    def padded_positions(self, rank: int) -> torch.Tensor:
        """Global position held by each row of the padded buffer, -1 for padding:
        ``(seq_local,)`` int64."""
        out = torch.full((self.seq_local,), -1, dtype=torch.int64)
        out[self.padded_rows(rank)] = self.positions(rank)
        return out

    def padding(self, rank: int, device: torch.device) -> Padding:
        """How ``rank``'s tokens go into its padded buffer and back, on ``device``."""
        rows = self.padded_rows(rank).to(device) if self.padded else None
        return Padding(rows, self.seq_local)


@dataclass(frozen=True, slots=True)
class Padding:
    """One rank's tokens in and out of a :class:`Sharding`'s padded buffer (no-op unpadded)."""

    rows: torch.Tensor | None
    """Row of the padded buffer of each local token ``(s,)``; None without padding."""
    seq_local: int
    """s_pad, the rows of the padded buffer."""

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, s, H, D) in the zero padded buffer (B, s_pad, H, D)."""
        if self.rows is None:
            return x
        buffer = x.new_zeros((x.shape[0], self.seq_local, *x.shape[2:]))
        return buffer.index_copy(1, self.rows, x)

    def unpad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The local tokens' rows of a padded ``x``, along ``dim``."""
        return x if self.rows is None else x.index_select(dim, self.rows)


def _aranges(ranges: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The ranges ``[start, start + length)`` one after another: ``(n,)`` int64."""
    parts = [torch.arange(start, start + length) for start, length in ranges]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def split_evenly(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal consecutive ranges of ``range(length)``, the longer ones first."""
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + length // parts + (1 if i < length % parts else 0))
    return list(itertools.pairwise(bounds))


def normalize_cu_seqlens(
    cu_seqlens: Sequence[int] | torch.Tensor | None, seq_len: int, *, name: str = "cu_seqlens"
) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple ``(0, ..., seq_len)``; ValueError naming what is wrong."""
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0; got {seq_len}")
    if cu_seqlens is None:
        return (0, seq_len)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a 1-D integer tensor; got dtype {cu_seqlens.dtype}, shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        cu_seqlens = cu_seqlens.tolist()
    try:  # a generator once, not consumed by the check
        items = None if isinstance(cu_seqlens, str) else list(cu_seqlens)
    except TypeError:  # not iterable
        items = None
    if items is None or not all(is_int(x) for x in items):
        raise ValueError(  # a float is not a number of tokens: 4.7 is not rounded to 4
            f"{name} must hold ints (a sequence or a 1-D integer tensor); got {cu_seqlens!r}"
        )
    values = tuple(int(x) for x in items)
    if len(values) < 2 or values[0] != 0 or values[-1] != seq_len:
        raise ValueError(
            f"{name} must start at 0 and end at the global length {seq_len}; got {list(values)}"
        )
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name} must be non-decreasing; got {list(values)}")
    # drop empty documents: equal packings give equal shardings
    return (0, *sorted(set(values[1:]) - {0})) if seq_len > 0 else (0, 0)


def make_sharding(
    *,
    layout: Layout | str,
    world_size: int,
    seq_len: int,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> Sharding:
    """The :class:`Sharding` of ``seq_len`` tokens; ValueError on world_size < 1, seq_len < 0
    or malformed cu_seqlens.

    Args:
        layout: ``"contiguous"`` or ``"zigzag"``.
        world_size: P.
        seq_len: the global length S.
        cu_seqlens: document boundaries ``(0, ..., S)`` of a packed sequence.
    """
    layout = Layout.parse(layout)
    check_int("world_size", world_size, 1)
    check_int("seq_len", seq_len, 0)
    return _make_sharding(layout, world_size, seq_len, normalize_cu_seqlens(cu_seqlens, seq_len))


@functools.lru_cache(maxsize=256)
def _make_sharding(
    layout: Layout, world_size: int, seq_len: int, cu_seqlens: tuple[int, ...]
) -> Sharding:
    p = world_size
    docs = list(itertools.pairwise(cu_seqlens))
    runs: list[list[Run]] = [[] for _ in range(p)]
    if layout is Layout.CONTIGUOUS:
        for r, (lo, hi) in enumerate(split_evenly(seq_len, p)):
            for d, (a, b) in enumerate(docs):  # cut the rank's range at document boundaries
                start, stop = max(lo, a), min(hi, b)
                if start < stop:
                    runs[r].append(Run(start - lo, stop - start, start, d))
        seq_local = max(-(-seq_len // p), 1)  # the longest rank's
    else:
        widths = [-(-(b - a) // (2 * p)) for a, b in docs]  # padded chunk size per document
        half = sum(widths)
        offset = 0
        for d, ((a, b), width) in enumerate(zip(docs, widths, strict=True)):
            chunks = split_evenly(b - a, 2 * p)
            for r in range(p):
                for base, chunk in ((0, r), (half, 2 * p - 1 - r)):
                    lo, hi = chunks[chunk]
                    if hi > lo:
                        runs[r].append(Run(base + offset, hi - lo, a + lo, d))
            offset += width
        runs = [sorted(rank_runs, key=lambda run: run.local_start) for rank_runs in runs]
        seq_local = max(2 * half, 2)
    return Sharding(
        layout=layout,
        world_size=p,
        seq_len=seq_len,
        cu_seqlens=cu_seqlens,
        seq_local=seq_local,
        runs=tuple(tuple(rank_runs) for rank_runs in runs),
    )
