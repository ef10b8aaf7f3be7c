"""Per-step schedules of every strategy, as plain data.

This module owns *what happens*: at each step, which Q shard meets which K/V shard on which
rank (and which rows of them), and which rows of which payload travel from whom to whom. The
runtime (``tokenring.runtime``) executes a :class:`Schedule`; the byte counts in tests and the
cost model read the very same object. Nothing here touches tensors or process groups.

Legend: B batch, s local seq, Hq query heads, Hkv key/value heads, D head dim, P world size,
c = s // 2 (zigzag chunk). Rows are half-open ``(start, stop)`` ranges of an owner's local
shard.

Note [TokenRing step table]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Q blocks travel "down" the ring (rank r sends to r-1); K/V never move. At step t rank r holds
the Q of owner o = (r + t) mod P, computes it against its own K/V, and sends the partial
(out, lse) straight back to o -- the "up" direction, a different process group. P = 4::

    step t:        0        1        2        3
    rank 0 holds:  Q0       Q1       Q2       Q3
    rank 1 holds:  Q1       Q2       Q3       Q0
    rank 2 holds:  Q2       Q3       Q0       Q1
    rank 3 holds:  Q3       Q0       Q1       Q2
    returns:       -        o<-r+1   o<-r+2   o<-r+3   (sent after the block is computed)

Q for step t+1 is posted at the start of step t, so it flies while step t computes; the partial
of step t flies while step t+1 computes. The partial of the last step cannot overlap with
anything, so the last block is computed in ``last_block_splits`` row slices, each returned as
soon as it is done: only the last slice's return is exposed.

Note [Causal blocks per layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For the Q shard of owner o and the K/V shard of owner j (c = s/2):

    layout       case      q rows      kv rows     mask
    any          o == j    [0, s)      [0, s)      causal (positions increase inside a shard)
    contiguous   j < o     [0, s)      [0, s)      full
    contiguous   j > o     -           -           empty: nothing computed, nothing sent
    zigzag       j < o     [0, s)      [0, c)      full  (both q chunks are after kv chunk j)
    zigzag       j > o     [c, s)      [0, s)      full  (only q chunk 2P-1-o is after kv)
    non-causal   any       [0, s)      [0, s)      full

Zigzag gives every rank half a block of work at every step but the first. Because Q travels
down the ring, the owner o's Q first visits ranks o-1, ..., 0 (j < o: all rows needed) and then
P-1, ..., o+1 (j > o: only rows [c, s)). The rows a rank forwards are the union of what every
rank still ahead of it needs, so they only ever shrink: after the wrap TokenRing sends half of
Q and gets half a partial back. Ring (pass-KV) uses the same mechanism for K/V, moving down as
well: K/V first visit j-1..0 (needs [0, s)), then P-1..j+1 (needs [0, c)). On the contiguous
causal layout only ranks above j see j's keys, so there Ring's K/V move up (j+1, j+2, ...).

With documents, windows or padding (Note [Mask classes] in ``tokenring.masks``) a block is
one piece per visible pair of runs instead; a block nobody sees has no piece, and rows nobody
ahead needs are not sent, so a short window ends the ring after the steps it reaches.

Note [Backward]
~~~~~~~~~~~~~~~
TokenRing: K/V and their gradient accumulators stay home. (q, dout, lse, delta) travel exactly
like q in the forward; each rank adds dK, dV of its own K/V from every visiting Q; partial dQ
goes back to its owner like ``out``. Pass-KV (Ring, bidirectional Ring): K/V travel like the
forward. The fp32 accumulator of each lane of a block leaves home after step 0 with the
owner's own dK/dV of the lane's heads and rows, follows the block one step behind on the
return process group (same direction; each visitor adds into it), and the last visitor that
computes with it sends it straight home: P hops of the lane's rows per block when every
visitor computes (the last hop is then the ring's own link home), fewer under a window.
No rank keeps its own dK/dV during the steps, only accumulators in flight (Note [Buffers in
flight] in tokenring.runtime): one more hop per block than starting the accumulator at the
first visitor, overlapped with step 1, for two K/V-sized buffers less on every rank.

Note [Bidirectional ring]
~~~~~~~~~~~~~~~~~~~~~~~~~
``Strategy.BIDIR_RING`` is pass-KV on two *lanes*, each a complete ring over a disjoint part
of K/V, turning opposite ways so both directions of every link carry K/V::

    Hkv >= 2: lane 0 carries kv heads [0, Hkv/2) down (r -> r-1),
              lane 1 carries kv heads [Hkv/2, Hkv) up (r -> r+1); queries follow their group.
    Hkv == 1: lane 0 carries K/V rows [0, s/2) down, lane 1 rows [s/2, s) up (zigzag: the
              early and the late chunk), and both lanes' partials merge by lse.

At step t rank r holds lane 0's block of owner (r + t) mod P and lane 1's of (r - t) mod P.
The local block (step 0) is computed once, on every head and row. Per step each direction
carries half of Ring's K/V bytes, and nothing is left to return at the end, unlike TokenRing.

Note [Bidirectional TokenRing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Strategy.BIDIR_TOKEN_RING`` is pass-Q on two lanes turning opposite ways, each carrying
half of the query heads; K/V stay home, and each partial goes straight back to its owner on
its lane's return group (so both directions of every link carry Q and partials)::

    Hkv >= 2: lane 0 carries the query heads of kv heads [0, Hkv/2) down (r -> r-1),
              lane 1 those of [Hkv/2, Hkv) up (r -> r+1): whole GQA groups, so a lane's
              pieces read only its own kv heads (odd Hkv splits unevenly: 3 -> 1 + 2).
    Hkv == 1: lane 0 carries query heads [0, Hq/2) down, lane 1 [Hq/2, Hq) up; both read
              the one kv head (it never moves, so sharing it costs nothing).
    Hq == 1:  nothing to split: NotImplementedError naming token_ring (no fallback).

At step t rank r holds lane 0's Q of owner (r + t) mod P and lane 1's of (r - t) mod P.
P = 4 (h0, h1: the lanes' heads)::

    step t:          0            1         2         3
    rank 0 holds:    Q0 all heads Q1h0 Q3h1 Q2h0 Q2h1 Q3h0 Q1h1
    rank 1 holds:    Q1 all heads Q2h0 Q0h1 Q3h0 Q3h1 Q0h0 Q2h1
    returns of t:    -            r+1, r-1  r+2, r-2  r+3, r-3 (each lane to its owner)

Step 0 computes the local block once, on every head (one segment, lane 0, like the
bidirectional ring). A step's segments are lane 0's then lane 1's; the last step splits each
lane's block in ``last_block_splits`` row slices, so only one slice of half the heads is
exposed, and the first hop moves half of Q on each direction. Zigzag causal: lane 0 meets
the kv owners below o first (all q rows) and sends half rows after the wrap, as TokenRing;
lane 1 meets those above o first (rows [c, s) only) but must carry every row until it has
passed the ranks below o, so it moves more than lane 0 (P = 4: 7/6 of lane 0's rows).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tokenring.layout import (
    Layout,
    Run,
    Sharding,
    global_length,
    make_sharding,
)
from tokenring.masks import MaskKind, MaskSpec, chunk_documents, normalize_window

__all__ = [
    "Dims",
    "Flow",
    "Lane",
    "Pass",
    "Payload",
    "Piece",
    "Schedule",
    "Segment",
    "StepPlan",
    "Strategy",
    "Transfer",
    "block_pieces",
    "build_schedule",
    "piece_flops",
]

Rows = tuple[int, int]


class Strategy(enum.Enum):
    """Which sequence-parallel algorithm moves which tensors."""

    TOKEN_RING = "token_ring"
    RING = "ring"
    BIDIR_RING = "bidir_ring"
    BIDIR_TOKEN_RING = "bidir_token_ring"  # pass-Q on two lanes: Note [Bidirectional TokenRing]
    ULYSSES = "ulysses"
    ALLGATHER_KV = "allgather_kv"
    HYBRID = "hybrid"  # 2-D mesh, inner all-to-all + outer ring strategy: tokenring.hybrid

    @property
    def is_collective(self) -> bool:
        """Moves everything with collectives (all-to-all, all-gather), not round a ring."""
        return self in (Strategy.ULYSSES, Strategy.ALLGATHER_KV)

    @property
    def is_ring(self) -> bool:
        """Runs round a ring of P ranks step by step (what the hybrid can run across its
        islands): neither a collective nor the hybrid itself."""
        return not self.is_collective and self is not Strategy.HYBRID

    @property
    def passes_q(self) -> bool:
        """Q blocks travel and partials return; K/V stay home (TokenRing on one or two lanes)."""
        return self in (Strategy.TOKEN_RING, Strategy.BIDIR_TOKEN_RING)

    @classmethod
    def parse(cls, value: Strategy | str) -> Strategy:
        if isinstance(value, Strategy):
            return value
        try:
            return cls(value)
        except ValueError:
            options = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"strategy must be one of {options}; got {value!r}") from None


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Flow(enum.Enum):
    """Each flow runs on its own process group so both directions of a link carry traffic."""

    TRAVEL = "travel"  # blocks moving down the ring: q, kv, (q, dout, lse, delta)
    RETURN = "return"  # partials going home or accumulators following: out, dq, dkv


class Payload(enum.Enum):
    Q = "q"  # q rows: Hq * D elements
    KV = "kv"  # k and v rows: 2 * Hkv * D elements
    OUT = "out"  # partial out rows (Hq * D) + their lse (Hq, accumulation dtype)
    Q_GRAD = "q_grad"  # q and dout rows (2 * Hq * D) + lse and delta (2 * Hq, accumulation dtype)
    DQ = "dq"  # partial dq rows: Hq * D elements
    DKV = "dkv"  # dk and dv accumulators: 2 * Hkv * D, accumulation dtype

    @property
    def heads_kind(self) -> str:
        """Whose heads a row of this payload carries: ``"q"`` or ``"kv"``."""
        return "kv" if self in (Payload.KV, Payload.DKV) else "q"

    @property
    def flow(self) -> Flow:
        if self in (Payload.Q, Payload.KV, Payload.Q_GRAD):
            return Flow.TRAVEL
        return Flow.RETURN


@dataclass(frozen=True, kw_only=True, slots=True)
class Dims:
    """Sizes that turn rows into bytes and FLOPs."""

    batch: int
    """B."""
    heads_q: int
    """Hq."""
    heads_kv: int
    """Hkv; divides Hq."""
    head_dim: int
    """D."""
    elem_bytes: int
    """Bytes per element of q/k/v (2 for bf16/fp16, 4 for fp32, 8 for fp64)."""
    acc_bytes: int = 4
    """Bytes per element of the accumulation dtype (fp32, or fp64 for fp64 inputs)."""

    def row_bytes(self, payload: Payload, num_heads: int | None = None) -> int:
        """Bytes of one sequence row of ``payload`` (all batch entries).

        Args:
            num_heads: carry only this many heads of the payload's kind (query heads for
                q/out/q_grad/dq, key/value heads for kv/dkv); None: all of them.
        """
        b, hq, hkv, d = self.batch, self.heads_q, self.heads_kv, self.head_dim
        if num_heads is not None:
            if payload.heads_kind == "kv":
                hkv = num_heads
            else:
                hq = num_heads
        per_row = {
            Payload.Q: hq * d * self.elem_bytes,
            Payload.KV: 2 * hkv * d * self.elem_bytes,
            Payload.OUT: hq * d * self.elem_bytes + hq * self.acc_bytes,
            Payload.Q_GRAD: 2 * hq * d * self.elem_bytes + 2 * hq * self.acc_bytes,
            Payload.DQ: hq * d * self.elem_bytes,
            Payload.DKV: 2 * hkv * d * self.acc_bytes,
        }[payload]
        return b * per_row


@dataclass(frozen=True, slots=True)
class Piece:
    """One kernel call: q rows of the q owner against kv rows of the kv owner."""

    q_rows: Rows
    kv_rows: Rows
    causal: bool  # top-left causal mask; only on a run against itself (equal positions)
    lane: int = 0  # which travelling block the kv rows come from (see Lane)
    heads: Rows | None = None  # kv heads computed (query heads: the same range x group); all
    masked: bool = False  # explicit mask from the rows' positions (Note [Mask classes])
    q_heads: Rows | None = None  # query heads computed when not ``heads`` x group (MQA lanes)

    @property
    def num_q(self) -> int:
        return self.q_rows[1] - self.q_rows[0]

    @property
    def num_kv(self) -> int:
        return self.kv_rows[1] - self.kv_rows[0]


@dataclass(frozen=True, slots=True)
class Segment:
    """Pieces over q rows inside ``q_rows``, merged into one partial over ``q_rows`` (the unit
    that is returned); rows no piece covers get lse -inf."""

    q_rows: Rows
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``rows`` of ``owner``'s shard of ``payload`` going from ``src`` to ``dst``.

    Posted by the sender at step ``step`` after ``after_segments`` of its compute segments of
    that step (0: at the start of the step, overlapping the whole step's compute). The receiver
    posts its receive at the start of the same step.
    """

    payload: Payload
    src: int
    dst: int
    owner: int
    rows: Rows
    step: int
    after_segments: int
    heads: Rows | None = None  # heads of the payload's kind carried (None: all)
    lane: int = 0

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    def num_bytes(self, dims: Dims) -> int:
        num_heads = None if self.heads is None else self.heads[1] - self.heads[0]
        return self.num_rows * dims.row_bytes(self.payload, num_heads)


@dataclass(frozen=True, slots=True)
class Lane:
    """One travelling block stream: its direction round the ring and what part it carries."""

    direction: int  # -1: rank r sends to r-1 ("down"); +1: to r+1 ("up")
    kv_heads: Rows | None = None  # kv heads it carries (None: all)
    kv_rows: Rows | None = None  # rows of the K/V shard it carries (None: all)
    q_heads: Rows | None = None  # pass-Q: query heads it carries (None: all)

    def visitor(self, rank: int, step: int, world_size: int) -> int:
        """The owner of the block this lane holds on ``rank`` at ``step``."""
        return (rank - self.direction * step) % world_size


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one rank computes at one step."""

    rank: int
    step: int
    q_owner: int
    kv_owners: tuple[int, ...]  # per lane: whose K/V that lane's block holds at this step
    segments: tuple[Segment, ...]
    q_owners: tuple[int, ...] = ()  # pass-Q on two lanes: whose Q each lane holds; () q_owner

    def lane_q_owner(self, lane: int) -> int:
        """Whose queries the pieces of ``lane`` compute at this step."""
        return self.q_owners[lane] if self.q_owners else self.q_owner

    @property
    def kv_owner(self) -> int:
        """The kv owner of lane 0 (the only lane of TokenRing and Ring)."""
        return self.kv_owners[0]

    @property
    def pieces(self) -> Iterator[Piece]:
        for segment in self.segments:
            yield from segment.pieces


@dataclass(frozen=True, slots=True)
class Schedule:
    """The whole plan of one attention pass of one strategy on ``world_size`` ranks."""

    strategy: Strategy
    pass_: Pass
    layout: Layout
    causal: bool
    world_size: int
    seq_local: int
    lanes: tuple[Lane, ...]
    steps: tuple[tuple[StepPlan, ...], ...]  # [rank][step]
    transfers: tuple[Transfer, ...]
    sharding: Sharding | None = None  # where tokens and padding live; None: no padding
    mask: MaskSpec | None = None  # None: plain (``causal`` only)
    _sends: dict[tuple[int, int], tuple[Transfer, ...]] = field(default_factory=dict, repr=False)
    _recvs: dict[tuple[int, int], tuple[Transfer, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        sends: dict[tuple[int, int], list[Transfer]] = {}
        recvs: dict[tuple[int, int], list[Transfer]] = {}
        for tr in self.transfers:
            sends.setdefault((tr.src, tr.step), []).append(tr)
            recvs.setdefault((tr.dst, tr.step), []).append(tr)
        self._sends.update({k: tuple(v) for k, v in sends.items()})
        self._recvs.update({k: tuple(v) for k, v in recvs.items()})

    @property
    def num_steps(self) -> int:
        return len(self.steps[0])

    def sends(self, rank: int, step: int) -> tuple[Transfer, ...]:
        """Transfers ``rank`` posts during ``step``."""
        return self._sends.get((rank, step), ())

    def recvs(self, rank: int, step: int) -> tuple[Transfer, ...]:
        """Transfers ``rank`` receives, posted at the start of ``step``."""
        return self._recvs.get((rank, step), ())


def block_pieces(
    *, layout: Layout, causal: bool, world_size: int, seq_local: int, q_owner: int, kv_owner: int
) -> tuple[Piece, ...]:
    """The kernel calls for the Q shard of ``q_owner`` against the K/V shard of ``kv_owner``
    when every rank holds ``seq_local`` tokens and only ``causal`` masks.

    See Note [Causal blocks per layout].
    """
    sharding = make_sharding(layout=layout, world_size=world_size, seq_len=seq_local * world_size)
    return sharded_block_pieces(sharding, MaskSpec(causal), q_owner, kv_owner)


def sharded_block_pieces(
    sharding: Sharding, mask: MaskSpec, q_owner: int, kv_owner: int
) -> tuple[Piece, ...]:
    """The kernel calls for the Q rows of ``q_owner`` against the K/V rows of ``kv_owner``:
    one piece per visible pair of runs (Note [Mask classes]), full pieces that tile a larger
    rectangle merged into one.

    A rank's own block under a plain causal mask, without padding, is one causal piece over
    the whole shard: positions increase along its rows (Note [Causal blocks per layout]).
    """
    q_runs, kv_runs = sharding.runs[q_owner], sharding.runs[kv_owner]
    n = sharding.local_len(q_owner)
    if (
        q_owner == kv_owner
        and mask.causal
        and mask.plain
        and n == sharding.seq_local
        and all(a.global_start < b.global_start for a, b in itertools.pairwise(q_runs))
    ):
        return (Piece((0, n), (0, n), True),)
    full: list[tuple[Rows, Rows]] = []
    other: list[Piece] = []
    # runs indexed by the mask's documents (chunks may cut the layout's documents)
    q_runs = tuple(part for run in q_runs for part in mask.split(run))
    kv_by_doc: dict[int, list[Run]] = {}
    for run in kv_runs:
        for part in mask.split(run):
            kv_by_doc.setdefault(part.doc, []).append(part)
    tile = mask.band_tile()
    if tile is not None:  # a window: cut query runs so each piece's kv rows follow the band
        q_runs = tuple(part for run in q_runs for part in _tiles(run, tile))
    for q_whole in q_runs:
        for kv_whole in kv_by_doc.get(q_whole.doc, ()):  # other documents see nothing
            trimmed = mask.trim(q_whole, kv_whole)
            if trimmed is None:
                continue
            q_run, kv_run = trimmed
            kind = mask.classify(q_run, kv_run)
            if kind is MaskKind.FULL:
                full.append((q_run.rows, kv_run.rows))
            elif kind is not MaskKind.EMPTY:
                other.append(
                    Piece(
                        q_run.rows,
                        kv_run.rows,
                        kind is MaskKind.CAUSAL,
                        masked=kind is MaskKind.MASKED,
                    )
                )
    merged = [Piece(q_rows, kv_rows, False) for q_rows, kv_rows in _merge_rectangles(full)]
    return tuple(sorted(merged + other, key=lambda p: (p.q_rows, p.kv_rows)))


def _tiles(run: Run, tile: int) -> list[Run]:
    """``run`` cut into consecutive runs of at most ``tile`` tokens."""
    return [
        Run(run.local_start + i, min(tile, run.length - i), run.global_start + i, run.doc)
        for i in range(0, run.length, tile)
    ]


def _merge_rectangles(rects: list[tuple[Rows, Rows]]) -> list[tuple[Rows, Rows]]:
    """Merge (q rows, kv rows) rectangles that share one side and touch on the other, until
    none do. The union is unchanged; only the number of kernel calls drops."""
    rects = sorted(rects)
    changed = True
    while changed:
        changed = False
        for i, (qa, ka) in enumerate(rects):
            for j in range(i + 1, len(rects)):
                qb, kb = rects[j]
                joined = None
                if ka == kb and (qa[1] == qb[0] or qb[1] == qa[0]):
                    joined = ((min(qa[0], qb[0]), max(qa[1], qb[1])), ka)
                elif qa == qb and (ka[1] == kb[0] or kb[1] == ka[0]):
                    joined = (qa, (min(ka[0], kb[0]), max(ka[1], kb[1])))
                if joined is not None:
                    rects = sorted([*rects[:i], *rects[i + 1 : j], *rects[j + 1 :], joined])
                    changed = True
                    break
            if changed:
                break
    return rects


def _union(rows: list[Rows]) -> Rows | None:
    """Smallest range covering ``rows`` (None when empty)."""
    rows = [r for r in rows if r[1] > r[0]]
    if not rows:
        return None
    return (min(r[0] for r in rows), max(r[1] for r in rows))


def _split_rows(rows: Rows, parts: int) -> list[Rows]:
    start, stop = rows
    n = stop - start
    parts = max(1, min(parts, n))
    bounds = [start + (n * i) // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _segments(pieces: tuple[Piece, ...], splits: int) -> tuple[Segment, ...]:
    """One segment for the block, or ``splits`` row slices of a single full piece."""
    if not pieces:
        return ()
    if splits > 1 and len(pieces) == 1 and not pieces[0].causal and not pieces[0].masked:
        piece = pieces[0]
        return tuple(
            Segment(rows, (Piece(rows, piece.kv_rows, False),))
            for rows in _split_rows(piece.q_rows, splits)
        )
    q_rows = _union([p.q_rows for p in pieces])
    assert q_rows is not None
    return (Segment(q_rows, pieces),)


def build_schedule(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int | None = None,
    last_block_splits: int = 2,
    heads_kv: int | None = None,
    heads_q: int | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> Schedule:
    """Build the schedule of one pass. Pure: same inputs, same schedule, on every rank.

    Args:
        strategy: a ring strategy: ``Strategy.TOKEN_RING`` (pass-Q), ``Strategy.RING``
            (pass-KV), ``BIDIR_RING`` or ``BIDIR_TOKEN_RING`` (two lanes).
        pass_: forward or backward.
        layout: how the sequence is sharded (see ``tokenring.layout``).
        causal: causal mask over global positions.
        world_size: P >= 1.
        seq_local: s, tokens per rank when every rank holds the same number (S = P * s).
        seq_len: instead of ``seq_local``: the global length S, any S >= 0 (the shards are
            padded to a common size; see Note [Documents and padding] in tokenring.layout).
        cu_seqlens: document boundaries of a packed sequence (0, ..., S); attention never
            crosses them, and with the zigzag layout every document is zigzagged on its own.
        window_size: flash-attention's sliding window ``(left, right)`` (-1: unbounded).
            Blocks outside every window are not computed, and rows nobody ahead needs are
            not sent, so ring steps beyond the window cost nothing.
        attention_chunk_size: chunked attention: queries see only the keys of their own chunk
            of this many tokens from their document's start (Note [Mask classes]); the
            sharding still follows ``cu_seqlens``.
        last_block_splits: TokenRing computes its last block in this many row slices and
            returns each as soon as it is done (see Note [TokenRing step table]).
        heads_kv: number of K/V heads; needed by ``Strategy.BIDIR_RING`` to split its lanes
            and by the collective strategies.
        heads_q: number of query heads; needed by ``Strategy.BIDIR_TOKEN_RING`` (with
            heads_kv) to split its lanes, and by the collective strategies (Ulysses splits
            them over the ranks). Their schedules come from ``tokenring.collective``.

    Raises:
        ValueError: on an unknown strategy/layout, world_size < 1, a seq_local the layout
            cannot split, both or neither of seq_local and seq_len, bad cu_seqlens,
            window_size or attention_chunk_size, or last_block_splits < 1.
        NotImplementedError: documents, windows, chunks or padding with a collective strategy;
            ``BIDIR_TOKEN_RING`` with a single query head.
    """
    strategy = Strategy.parse(strategy)
    pass_ = Pass(pass_)
    layout = Layout.parse(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    sharding = make_sharding(
        layout=layout,
        world_size=world_size,
        seq_len=global_length(world_size, seq_local, seq_len, layout),
        cu_seqlens=cu_seqlens,
    )
    mask_docs = chunk_documents(sharding.cu_seqlens, attention_chunk_size)
    mask = MaskSpec(
        causal,
        normalize_window(window_size, causal=causal),
        mask_docs if len(mask_docs) > 2 else None,
    )
    if last_block_splits < 1:
        raise ValueError(f"last_block_splits must be >= 1; got {last_block_splits}")
    if strategy.is_collective:
        if heads_q is None or heads_kv is None:
            raise ValueError(
                f"heads_q and heads_kv must be given for strategy {strategy.value!r}; got "
                f"{heads_q}, {heads_kv}"
            )
        if sharding.padded or not mask.plain:
            raise NotImplementedError(
                f"strategy {strategy.value!r} supports neither documents, windows nor padded "
                "shards yet; use a ring strategy (token_ring, ring, bidir_ring)"
            )
        from tokenring.collective import build_collective_schedule

        return build_collective_schedule(
            strategy.value,
            pass_,
            layout=layout,
            causal=causal,
            world_size=world_size,
            seq_local=sharding.seq_local,
            heads_q=heads_q,
            heads_kv=heads_kv,
        )
    p, s = world_size, sharding.seq_local
    if strategy is Strategy.BIDIR_TOKEN_RING:
        lanes = _query_lanes(heads_q, heads_kv)
    else:
        lanes = _lanes(strategy, layout, s, heads_kv, causal)
    cache: dict[tuple[int, int], tuple[Piece, ...]] = {}

    def pieces(q_owner: int, kv_owner: int) -> tuple[Piece, ...]:
        key = (q_owner, kv_owner)
        if key not in cache:
            cache[key] = sharded_block_pieces(sharding, mask, q_owner, kv_owner)
        return cache[key]

    steps: list[list[StepPlan]] = []
    for r in range(p):
        row: list[StepPlan] = []
        for t in range(p):
            kv_owners = tuple(lane.visitor(r, t, p) for lane in lanes)
            splits = last_block_splits if t == p - 1 else 1
            if strategy is Strategy.TOKEN_RING:
                q_owner = kv_owners[0]
                segments = _segments(pieces(q_owner, r), splits)
                row.append(StepPlan(r, t, q_owner, (r,), segments))
                continue
            if strategy is Strategy.BIDIR_TOKEN_RING:  # Note [Bidirectional TokenRing]
                q_owners = kv_owners  # the lanes carry Q: their visitors are q owners
                if t == 0:  # the local block, once, on every head
                    segments = _segments(pieces(r, r), splits)
                else:
                    segments = tuple(
                        _lane_segment(segment, index, lane)
                        for index, lane in enumerate(lanes)
                        for segment in _segments(pieces(q_owners[index], r), splits)
                    )
                row.append(StepPlan(r, t, q_owners[0], (r,) * 2, segments, q_owners))
                continue
            block: list[Piece] = []
            for index, lane in enumerate(lanes):
                if t == 0 and index > 0:
                    break  # the local block is computed once, by lane 0, on every head and row
                for piece in pieces(r, kv_owners[index]):
                    block += _lane_pieces(piece, index, lane, whole_block=t == 0)
            row.append(StepPlan(r, t, r, kv_owners, _by_q_rows(block)))
        steps.append(row)

    pass_q = strategy.passes_q
    travel = Payload.KV
    if pass_q:
        travel = Payload.Q if pass_ is Pass.FORWARD else Payload.Q_GRAD
    transfers: list[Transfer] = []
    for index, lane in enumerate(lanes):
        for r in range(p):
            for t in range(p - 1):
                # Rank r holds the visitor's block at step t and forwards to the next rank of
                # the lane whatever rows the ranks ahead still need. Rows only shrink.
                needed: list[Rows] = []
                for ahead in range(1, p - t):
                    plan = steps[(r + lane.direction * ahead) % p][t + ahead]
                    for piece in plan.pieces:
                        if piece.lane == index:
                            needed.append(piece.kv_rows if travel is Payload.KV else piece.q_rows)
                rows = _union(needed)
                if rows is not None:
                    transfers.append(
                        Transfer(
                            travel,
                            r,
                            (r + lane.direction) % p,
                            lane.visitor(r, t, p),
                            rows,
                            t,
                            0,
                            lane.q_heads if pass_q else lane.kv_heads,
                            index,
                        )
                    )
    if pass_q:
        ret = Payload.OUT if pass_ is Pass.FORWARD else Payload.DQ
        for r in range(p):
            for t in range(1, p):
                plan = steps[r][t]
                for k, segment in enumerate(plan.segments):
                    index = segment.pieces[0].lane  # a segment's pieces share their lane
                    owner = plan.lane_q_owner(index)
                    heads = lanes[index].q_heads
                    transfers.append(
                        Transfer(ret, r, owner, owner, segment.q_rows, t, k + 1, heads, index)
                    )
    elif pass_ is Pass.BACKWARD:
        # See Note [Backward]: the accumulator of a K/V block leaves home with the owner's
        # own dK/dV, follows the block, and the last visitor that computes sends it home.
        for index, lane in enumerate(lanes):
            for owner in range(p):
                holders = [(owner + lane.direction * t) % p for t in range(p)]
                computing = [
                    t
                    for t in range(1, p)
                    if any(piece.lane == index for piece in steps[holders[t]][t].pieces)
                ]
                if not computing:
                    continue
                last = computing[-1]
                for t in range(last + 1):
                    plan = steps[holders[t]][t]
                    transfers.append(
                        Transfer(
                            Payload.DKV,
                            holders[t],
                            holders[t + 1] if t < last else owner,
                            owner,
                            lane.kv_rows or (0, s),
                            t,
                            max(1, len(plan.segments)),
                            lane.kv_heads,
                            index,
                        )
                    )
    return Schedule(
        strategy=strategy,
        pass_=pass_,
        layout=layout,
        causal=causal,
        world_size=p,
        seq_local=s,
        lanes=lanes,
        steps=tuple(tuple(row) for row in steps),
        transfers=tuple(transfers),
        sharding=sharding,
        mask=mask,
    )


def _lanes(
    strategy: Strategy, layout: Layout, seq_local: int, heads_kv: int | None, causal: bool
) -> tuple[Lane, ...]:
    """See Note [Bidirectional ring]. Ring's K/V travel down (like TokenRing's Q) except on
    the contiguous causal layout, where only higher ranks see a shard's keys: there they
    travel up, so a sliding window's ring ends after the neighbours it reaches."""
    if strategy is not Strategy.BIDIR_RING:
        up = strategy is Strategy.RING and causal and layout is Layout.CONTIGUOUS
        return (Lane(+1 if up else -1),)
    if heads_kv is None or heads_kv < 1:
        raise ValueError(f"heads_kv must be given (>= 1) for strategy 'bidir_ring'; got {heads_kv}")
    if heads_kv >= 2:
        half = heads_kv // 2
        return (Lane(-1, kv_heads=(0, half)), Lane(+1, kv_heads=(half, heads_kv)))
    if seq_local < 2:
        return (Lane(-1),)  # one kv head and one row per rank: nothing to split, one ring
    half = seq_local // 2  # zigzag: exactly the early and the late chunk
    return (Lane(-1, kv_rows=(0, half)), Lane(+1, kv_rows=(half, seq_local)))


def _query_lanes(heads_q: int | None, heads_kv: int | None) -> tuple[Lane, ...]:
    """The two lanes of ``Strategy.BIDIR_TOKEN_RING``: see Note [Bidirectional TokenRing]."""
    if heads_q is None or heads_kv is None or heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(
            "heads_q and heads_kv must be given (heads_kv >= 1 dividing heads_q) for strategy "
            f"'bidir_token_ring'; got heads_q={heads_q}, heads_kv={heads_kv}"
        )
    if heads_q < 2:
        raise NotImplementedError(
            "strategy 'bidir_token_ring' sends half of the query heads each way round the "
            f"ring and needs heads_q >= 2; got heads_q={heads_q} (use 'token_ring')"
        )
    groups = heads_q // heads_kv
    if heads_kv >= 2:  # whole kv groups: each lane's query heads share their K/V heads
        half = heads_kv // 2
        return (
            Lane(-1, kv_heads=(0, half), q_heads=(0, half * groups)),
            Lane(+1, kv_heads=(half, heads_kv), q_heads=(half * groups, heads_q)),
        )
    half = heads_q // 2  # one kv head: both lanes' query heads read it
    return (
        Lane(-1, kv_heads=(0, 1), q_heads=(0, half)),
        Lane(+1, kv_heads=(0, 1), q_heads=(half, heads_q)),
    )


def _lane_segment(segment: Segment, index: int, lane: Lane) -> Segment:
    """``segment`` on the heads of pass-Q ``lane`` (number ``index``)."""
    return Segment(
        segment.q_rows,
        tuple(
            Piece(p.q_rows, p.kv_rows, p.causal, index, lane.kv_heads, p.masked, lane.q_heads)
            for p in segment.pieces
        ),
    )


def _lane_pieces(piece: Piece, index: int, lane: Lane, *, whole_block: bool) -> list[Piece]:
    """The part of ``piece`` a lane computes: its kv heads, or its kv rows (split a causal
    diagonal into the full and causal parts the row range leaves)."""
    if whole_block:
        return [piece]
    if lane.kv_rows is None:
        return [
            Piece(piece.q_rows, piece.kv_rows, piece.causal, index, lane.kv_heads, piece.masked)
        ]
    lo = max(piece.kv_rows[0], lane.kv_rows[0])
    hi = min(piece.kv_rows[1], lane.kv_rows[1])
    if lo >= hi:
        return []
    assert not piece.causal, "only the local block (step 0) is causal, and lane 0 owns it"
    return [Piece(piece.q_rows, (lo, hi), False, index, lane.kv_heads, piece.masked)]


def _by_q_rows(block: list[Piece]) -> tuple[Segment, ...]:
    """Group pieces with equal q rows into segments (merged into one partial each)."""
    groups: dict[Rows, list[Piece]] = {}
    for piece in block:
        groups.setdefault(piece.q_rows, []).append(piece)
    return tuple(Segment(rows, tuple(group)) for rows, group in groups.items())


def piece_flops(piece: Piece, dims: Dims, pass_: Pass) -> float:
    """Matmul FLOPs of one piece: 4*B*Hq*sq*sk*D forward (QK^T and PV), 2.5x that backward.

    A causal piece counts only the unmasked (i >= j) entries; a piece on a subset of heads
    counts only those heads.
    """
    sq, sk = piece.num_q, piece.num_kv
    pairs = sq * (sq + 1) / 2 if piece.causal else sq * sk
    heads_q = dims.heads_q
    if piece.q_heads is not None:  # a pass-Q lane's query heads
        heads_q = piece.q_heads[1] - piece.q_heads[0]
    elif piece.heads is not None:  # a lane's kv heads and the query heads of their groups
        heads_q = (piece.heads[1] - piece.heads[0]) * (dims.heads_q // dims.heads_kv)
    forward = 4.0 * dims.batch * heads_q * dims.head_dim * pairs
    return forward if pass_ is Pass.FORWARD else 2.5 * forward
