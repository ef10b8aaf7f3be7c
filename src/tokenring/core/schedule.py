"""The vocabulary of schedules as plain data: strategies, passes, payloads, pieces, transfers.

A :class:`Schedule` says what happens in one pass: at each step which rows of which Q shard
meet which K/V rows on which rank, and which rows of which payload travel from whom to whom.
``tokenring.strategies`` builds schedules, the runtime executes them, the cost model and the
simulator read the same objects.

Legend: B batch, s local seq, Hq query heads, Hkv key/value heads, D head dim, P world size,
c = s // 2 (zigzag chunk). Rows are half-open ``(start, stop)`` ranges of an owner's shard.

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

Q travels down the ring, so owner o's Q visits ranks o-1 .. 0 (all rows needed), then
P-1 .. o+1 (rows [c, s) only). A rank forwards the union of what the ranks ahead need, so the
rows only shrink: after the wrap TokenRing sends half of Q and gets half a partial back. Ring's
K/V likewise (first [0, s), then [0, c)); on the contiguous causal layout they move up.

With documents, windows or padding (Note [Mask classes] in ``tokenring.core.masks``) a block
is one piece per visible pair of runs; a block nobody sees has no piece.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tokenring.core.enums import parse_enum
from tokenring.core.layout import Layout, Run, Sharding, is_int, make_sharding
from tokenring.core.masks import MaskKind, MaskSpec

__all__ = [
    "DTYPE_BYTES",
    "AttentionShape",
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
    "dtype_name",
    "piece_flops",
]

Rows = tuple[int, int]


class Strategy(enum.Enum):
    """Which sequence-parallel algorithm moves which tensors."""

    TOKEN_RING = "token_ring"
    RING = "ring"
    BIDIR_RING = "bidir_ring"
    BIDIR_TOKEN_RING = "bidir_token_ring"
    ULYSSES = "ulysses"
    ALLGATHER_KV = "allgather_kv"
    HYBRID = "hybrid"  # 2-D mesh, inner all-to-all + outer ring strategy: tokenring.hybrid

    @property
    def is_collective(self) -> bool:
        """Moves everything with collectives (all-to-all, all-gather), not round a ring."""
        return self in (Strategy.ULYSSES, Strategy.ALLGATHER_KV)

    @property
    def is_ring(self) -> bool:
        """Runs round a ring step by step (what the hybrid can run across its islands)."""
        return not self.is_collective and self is not Strategy.HYBRID

    @property
    def passes_q(self) -> bool:
        """Q blocks travel and partials return; K/V stay home (TokenRing on one or two lanes)."""
        return self in (Strategy.TOKEN_RING, Strategy.BIDIR_TOKEN_RING)

    @classmethod
    def parse(cls, value: Strategy | str) -> Strategy:
        """Accept a member or its value; raise ValueError naming the options."""
        return parse_enum(cls, value, "strategy")


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
        return Flow.TRAVEL if self in (Payload.Q, Payload.KV, Payload.Q_GRAD) else Flow.RETURN


DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
"""Bytes per element of the input dtypes the library supports."""


def dtype_name(dtype: str | torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``; ValueError for any other dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}; got {dtype!r}")
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionShape:
    """The attention layer of a call, the library's one shape type: schedules turn rows into
    bytes and FLOPs with it, the runtime lays out messages with it, the model prices it."""

    batch: int = 1
    """B."""
    heads_q: int
    """Hq."""
    heads_kv: int
    """Hkv; divides Hq."""
    head_dim: int
    """D."""
    dtype: str = "bfloat16"
    """Input dtype: float16, bfloat16, float32 or float64 (a torch.dtype is stored by name)."""

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "head_dim"):
            value = getattr(self, name)
            if not is_int(value):  # 64.5 would price fractional bytes and FLOPs
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
            object.__setattr__(self, name, int(value))
        if self.heads_q % self.heads_kv != 0:
            raise ValueError(
                f"heads_kv must divide heads_q; got heads_q={self.heads_q}, "
                f"heads_kv={self.heads_kv}"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> AttentionShape:
        """The shape of a call on ``q (B, s, Hq, D)`` and ``k (B, s_k, Hkv, D)``."""
        return cls(
            batch=q.shape[0],
            heads_q=q.shape[2],
            heads_kv=k.shape[2],
            head_dim=q.shape[3],
            dtype=dtype_name(q.dtype),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def acc_dtype(self) -> torch.dtype:
        """The accumulation dtype: float64 for float64 inputs, float32 otherwise."""
        return torch.float64 if self.dtype == "float64" else torch.float32

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of q/k/v."""
        return DTYPE_BYTES[self.dtype]

    @property
    def acc_bytes(self) -> int:
        """Bytes per element of the accumulation dtype."""
        return 8 if self.dtype == "float64" else 4

    def row_bytes(self, payload: Payload, num_heads: int | None = None) -> int:
        """Bytes of one sequence row of ``payload`` (all batch entries), on ``num_heads`` heads
        of the payload's kind (``Payload.heads_kind``; None: all)."""
        b, hq, hkv, d = self.batch, self.heads_q, self.heads_kv, self.head_dim
        elem, acc = self.elem_bytes, self.acc_bytes
        if num_heads is not None and payload.heads_kind == "kv":
            hkv = num_heads
        elif num_heads is not None:
            hq = num_heads
        per_row = {
            Payload.Q: hq * d * elem,
            Payload.KV: 2 * hkv * d * elem,
            Payload.OUT: hq * d * elem + hq * acc,
            Payload.Q_GRAD: 2 * hq * d * elem + 2 * hq * acc,
            Payload.DQ: hq * d * elem,
            Payload.DKV: 2 * hkv * d * acc,
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
    # pass-Q: the rank's own queries against these rows of ``kv_owner``'s K/V, sent here
    # (Note [Borrowed last pair] in tokenring.strategies.ring); None: the usual pair
    kv_owner: int | None = None

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


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """``rows`` of ``owner``'s shard of ``payload`` from ``src`` to ``dst``, posted at ``step``
    after ``after_segments`` of the sender's segments (0: at the start); received from the
    start of the step."""

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

    def num_bytes(self, dims: AttentionShape) -> int:
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
    # what readers derive and keep while it lives (tokenring.runtime.program)
    _memo: dict[tuple[object, ...], object] = field(default_factory=dict, repr=False, compare=False)

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
    """The kernel calls of ``q_owner``'s Q against ``kv_owner``'s K/V with ``seq_local`` tokens
    per rank and a plain mask (Note [Causal blocks per layout])."""
    sharding = make_sharding(layout=layout, world_size=world_size, seq_len=seq_local * world_size)
    return sharded_block_pieces(sharding, MaskSpec(causal), q_owner, kv_owner)


def sharded_block_pieces(
    sharding: Sharding, mask: MaskSpec, q_owner: int, kv_owner: int
) -> tuple[Piece, ...]:
    """The kernel calls of ``q_owner``'s Q rows against ``kv_owner``'s K/V rows: one piece per
    visible pair of runs (Note [Mask classes]), full pieces that tile a rectangle merged."""
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
                causal, masked = kind is MaskKind.CAUSAL, kind is MaskKind.MASKED
                other.append(Piece(q_run.rows, kv_run.rows, causal, masked=masked))
    merged = [Piece(q_rows, kv_rows, False) for q_rows, kv_rows in _merge_rectangles(full)]
    return tuple(sorted(merged + other, key=lambda p: (p.q_rows, p.kv_rows)))


def _tiles(run: Run, tile: int) -> list[Run]:
    """``run`` cut into consecutive runs of at most ``tile`` tokens."""
    return [
        Run(run.local_start + i, min(tile, run.length - i), run.global_start + i, run.doc)
        for i in range(0, run.length, tile)
    ]


def _merge_rectangles(rects: list[tuple[Rows, Rows]]) -> list[tuple[Rows, Rows]]:
    """Merge (q rows, kv rows) rectangles that share one side and touch on the other: the
    first rectangle (sorted) that has a partner joins its first partner, until none has one.
    Partners are looked up by the side they share and the end they touch, not pair by pair
    (thousands of documents give thousands of rectangles)."""
    rects = sorted(rects)
    while True:
        ends: dict[tuple[object, ...], list[int]] = {}  # (shared side, its kind, end) -> indices
        for index, (q, k) in enumerate(rects):
            for key in ((k, "kv", "start", q[0]), (k, "kv", "stop", q[1])):
                ends.setdefault(key, []).append(index)
            for key in ((q, "q", "start", k[0]), (q, "q", "stop", k[1])):
                ends.setdefault(key, []).append(index)
        for i, (q, k) in enumerate(rects):
            along_q = ends.get((k, "kv", "start", q[1]), []) + ends.get((k, "kv", "stop", q[0]), [])
            along_k = ends.get((q, "q", "start", k[1]), []) + ends.get((q, "q", "stop", k[0]), [])
            if along_q or along_k:  # every partner comes later: an earlier one would have won
                j = min(along_q + along_k)
                (qb, kb) = rects[j]
                if j in along_q:
                    joined = ((min(q[0], qb[0]), max(q[1], qb[1])), k)
                else:
                    joined = (q, (min(k[0], kb[0]), max(k[1], kb[1])))
                rects = sorted([*rects[:i], *rects[i + 1 : j], *rects[j + 1 :], joined])
                break
        else:
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


def piece_flops(piece: Piece, dims: AttentionShape, pass_: Pass) -> float:
    """Matmul FLOPs of one piece: 4*B*Hq*sq*sk*D forward (QK^T and PV), 2.5x that backward;
    only the unmasked entries of a causal piece and only its heads."""
    sq, sk = piece.num_q, piece.num_kv
    pairs = sq * (sq + 1) / 2 if piece.causal else sq * sk
    heads_q = dims.heads_q
    if piece.q_heads is not None:  # a pass-Q lane's query heads
        heads_q = piece.q_heads[1] - piece.q_heads[0]
    elif piece.heads is not None:  # a lane's kv heads and the query heads of their groups
        heads_q = (piece.heads[1] - piece.heads[0]) * (dims.heads_q // dims.heads_kv)
    forward = 4.0 * dims.batch * heads_q * dims.head_dim * pairs
    return forward if pass_ is Pass.FORWARD else 2.5 * forward
