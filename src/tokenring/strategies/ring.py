"""The ring strategies' schedules as plain data: TokenRing (pass-Q), Ring (pass-KV) and their
bidirectional forms.

Legend: B batch, s local seq, Hq query heads, Hkv key/value heads, D head dim, P world size,
c = s // 2 (zigzag chunk). Rows are half-open ``(start, stop)`` ranges of an owner's shard.

Note [TokenRing step table]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Q blocks travel "down" (r -> r-1); K/V never move. At step t rank r holds the Q of owner
o = (r + t) mod P, computes it against its own K/V and sends the partial (out, lse) straight
back to o on the return process group. P = 4::

    step t:        0        1        2        3
    rank 0 holds:  Q0       Q1       Q2       Q3
    rank 1 holds:  Q1       Q2       Q3       Q0
    rank 2 holds:  Q2       Q3       Q0       Q1
    rank 3 holds:  Q3       Q0       Q1       Q2
    returns:       -        o<-r+1   o<-r+2   o<-r+3   (sent after the block is computed)

Step t computes while Q of step t+1 and the partial of step t-1 fly. The last partial overlaps
nothing, so the last block is computed in ``last_block_splits`` slices, each returned when done
(Note [Last block by heads]; with ``lend_last_pair``, Note [Borrowed last pair]).

Note [Borrowed last pair]
~~~~~~~~~~~~~~~~~~~~~~~~
Neither the last step's partial nor the hop that brings the last Q overlaps anything. Zigzag
causal, P = 4: at step 3 rank 0 holds Q3, needs all its rows against kv chunk 0 only, and
returns every row 0 -> 3 as the call's tail. K/V chunk 0 costs 2 * c * Hkv per D, the Q rows
2 * c * Hq, so rank 0 *lends* the pair: its K/V rows go to q owner 3 in parts, one per step
0 .. 2 (on the wrap link 0 -> 3, which carries half Q blocks), rank 3 computes its own queries
against them after its last-step slices, and the Q3 hop 1 -> 0 at step 2 is dropped::

    step t:        0          1          2          3
    rank 0:        Q0 own     Q1         Q2         -  (lent: K/V chunk 0 -> rank 3)
    rank 3:        Q3 own     Q0         Q1         Q2 slices, then Q3 x K/V0 (borrowed)
    sent 0 -> 3:   Q0[c,s) +  Q1[c,s) +  Q2[c,s) +
                   K/V0 1/3   K/V0 2/3   K/V0 3/3

``_Ring.lend``: rank r lends its last pair (q owner r - 1) when its K/V rows cost no
more bytes than the Q hop and partial they save, and each part fits under its step's busiest
hop. The forward computes it at the last step, the backward at step 1 (K/V sent at step 0) so
its dK/dV (``Payload.DKV``) fly home later, hence from P = 3. A lent pair is one segment of
pieces with ``Piece.kv_owner`` set. It wins where links set the pace and loses where compute
does, so the caller decides (``last_pair`` of ``sequence_parallel_attn``).

Note [Last block by heads]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The last block's slices are head groups where the heads allow (whole GQA groups, or query
heads over MQA's one kv head): every row on some heads, the same kernel call on fewer heads
(row slices run fused kernels slower on fewer rows; bytes and FLOPs are the same). Rows are
sliced only with one query head (or heads not given), and then only a single full piece.

Note [Backward]
~~~~~~~~~~~~~~~
TokenRing: (q, dout, lse, delta) travel like q in the forward, each rank adds into dK, dV of
its own K/V, and partial dQ returns like ``out``. Pass-KV: K/V travel like the forward; each
lane's fp32 dK/dV accumulator leaves home after step 0, follows its block one step behind on
the return group, and the last visitor that computes sends it home (Note [Buffers in flight]
in tokenring.runtime.ring).

Note [Bidirectional ring]
~~~~~~~~~~~~~~~~~~~~~~~~~
``Strategy.BIDIR_RING`` is pass-KV on two *lanes*, each a complete ring over a disjoint part
of K/V, turning opposite ways so both directions of every link carry K/V::

    Hkv >= 2: lane 0 carries kv heads [0, Hkv/2) down (r -> r-1),
              lane 1 carries kv heads [Hkv/2, Hkv) up (r -> r+1); queries follow their group.
    Hkv == 1: lane 0 carries K/V rows [0, s/2) down, lane 1 rows [s/2, s) up (zigzag: the
              early and the late chunk), and both lanes' partials merge by lse.

At step t rank r holds lane 0's block of owner (r + t) mod P and lane 1's of (r - t) mod P.
The local block (step 0) is computed once, on every head and row.

Note [Bidirectional TokenRing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Strategy.BIDIR_TOKEN_RING`` is pass-Q on two lanes turning opposite ways, each carrying
half of the query heads; K/V stay home and each partial returns to its owner on its lane's
return group::

    Hkv >= 2: lane 0 carries the query heads of kv heads [0, Hkv/2) down (r -> r-1),
              lane 1 those of [Hkv/2, Hkv) up (r -> r+1): whole GQA groups (3 -> 1 + 2).
    Hkv == 1: lane 0 carries query heads [0, Hq/2) down, lane 1 [Hq/2, Hq) up.
    Hq == 1:  nothing to split: NotImplementedError naming token_ring (no fallback).

Lanes hold owners as in Note [Bidirectional ring]. P = 4 (h0, h1: the lanes' heads)::

    step t:          0            1         2         3
    rank 0 holds:    Q0 all heads Q1h0 Q3h1 Q2h0 Q2h1 Q3h0 Q1h1
    rank 1 holds:    Q1 all heads Q2h0 Q0h1 Q3h0 Q3h1 Q0h0 Q2h1
    returns of t:    -            r+1, r-1  r+2, r-2  r+3, r-3 (each lane to its owner)

Step 0 computes the local block once on every head (one segment, lane 0). A step's segments
are lane 0's then lane 1's; the last step slices each lane's block (Note [Last block by
heads]). Zigzag causal: lane 1 meets the kv owners above o first (rows [c, s) only) but must
carry every row until it has passed those below o, so it moves more than lane 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache, partial

import torch

from tokenring.core.layout import (
    Layout,
    Sharding,
    check_int,
    global_length,
    make_sharding,
    validate_seq_local,
)
from tokenring.core.masks import MaskSpec, chunk_documents, normalize_window
from tokenring.core.schedule import (
    AttentionShape,
    Lane,
    Pass,
    Payload,
    Piece,
    Rows,
    Schedule,
    Segment,
    StepPlan,
    Strategy,
    Transfer,
    _split_rows,
    _union,
    piece_flops,
    sharded_block_pieces,
)
from tokenring.strategies.collective import _build as _build_collective

__all__ = ["LEND_MAX_WORLD_SIZE", "RingColumns", "RingPlan", "build_schedule", "ring_plan"]


LEND_MAX_WORLD_SIZE = 64
"""TokenRing lends last pairs (Note [Borrowed last pair]) up to this many ranks, what the event
engine simulates; beyond it the plain tail, which ``ring_plan``'s columns hold."""


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
    lend_last_pair: bool = False,
) -> Schedule:
    """Build the schedule of one pass of any strategy but the hybrid. Pure.

    Args:
        strategy: ``TOKEN_RING`` (pass-Q), ``RING`` (pass-KV), ``BIDIR_RING``,
            ``BIDIR_TOKEN_RING``, or a collective one (``tokenring.strategies.collective``).
        pass_: forward or backward.
        layout: how the sequence is sharded (``tokenring.core.layout``).
        causal: causal mask over global positions.
        world_size: P >= 1.
        seq_local: s, tokens per rank (S = P * s); or instead ``seq_len``, any S >= 0 (shards
            padded to a common size: Note [Documents and padding] in tokenring.core.layout).
        cu_seqlens, window_size, attention_chunk_size: documents (0, ..., S), flash-attention's
            ``(left, right)`` window (-1: unbounded) and chunks (Note [Mask classes]).
        last_block_splits: slices of TokenRing's last block (Note [Last block by heads]).
        heads_kv, heads_q: K/V and query heads; needed to split the lanes of ``BIDIR_RING``
            (heads_kv) and ``BIDIR_TOKEN_RING`` (both), and by the collective strategies.
        lend_last_pair: TokenRing with both head counts: lend last pairs whose K/V cost fewer
            bytes than their Q (Note [Borrowed last pair]).

    Raises:
        ValueError: a bad argument (each named), both or neither of seq_local and seq_len,
            or the hybrid.
        NotImplementedError: documents, windows, chunks or padding with a collective strategy;
            ``BIDIR_TOKEN_RING`` with a single query head.
    """
    strategy, pass_, layout = Strategy.parse(strategy), Pass(pass_), Layout.parse(layout)
    _check_call(strategy, causal, heads_q, heads_kv)
    length = global_length(world_size, seq_local, seq_len, layout)  # make_sharding checks P
    sharding = make_sharding(
        layout=layout, world_size=world_size, seq_len=length, cu_seqlens=cu_seqlens
    )
    docs = chunk_documents(sharding.cu_seqlens, attention_chunk_size)
    window = normalize_window(window_size, causal=causal)
    mask = MaskSpec(causal, window, docs if len(docs) > 2 else None)
    check_int("last_block_splits", last_block_splits, 1)
    if strategy.is_collective:
        return _collective_schedule(strategy, pass_, sharding, mask, heads_q, heads_kv)
    return _ring_schedule(
        strategy, pass_, sharding, mask, last_block_splits, heads_q, heads_kv, lend_last_pair
    )


def _check_call(
    strategy: Strategy, causal: bool, heads_q: int | None, heads_kv: int | None
) -> None:
    """:func:`build_schedule`'s checks of what it does not hand on to a checking builder."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool; got {causal!r}")
    if strategy is Strategy.HYBRID:
        raise ValueError(
            "strategy 'hybrid' needs its factorisation: use tokenring.strategies.hybrid."
            "build_hybrid_schedule(pass_, spec=HybridSpec(inner=...), ...)"
        )
    for name, heads in (("heads_q", heads_q), ("heads_kv", heads_kv)):
        check_int(name, heads, 1, optional=True)
    if heads_q is not None and heads_kv is not None and heads_q % heads_kv:
        raise ValueError(
            f"heads_kv must divide heads_q; got heads_q={heads_q}, heads_kv={heads_kv}"
        )


def _ring_schedule(
    strategy: Strategy,
    pass_: Pass,
    sharding: Sharding,
    mask: MaskSpec,
    last_block_splits: int,
    heads_q: int | None,
    heads_kv: int | None,
    lend_last_pair: bool,
) -> Schedule:
    """``build_schedule`` of a ring strategy: ``steps[r][t]``, lent pairs, then transfers."""
    p, s, layout = sharding.world_size, sharding.seq_local, sharding.layout
    lanes = _lanes(strategy, layout, s, heads_q, heads_kv, mask.causal)
    pieces = cache(partial(sharded_block_pieces, sharding, mask))
    ring = _Ring(strategy, pass_, lanes, pieces, p, last_block_splits, heads_q, heads_kv)
    steps = [[ring.cell_plan(r, t) for t in range(p)] for r in range(p)]
    if strategy is Strategy.TOKEN_RING and lend_last_pair:
        ring.lend(steps)
    transfers = ring.travel_transfers(steps)
    if strategy.passes_q:
        transfers += ring.return_transfers(steps)
    elif pass_ is Pass.BACKWARD:
        transfers += ring.accumulator_transfers(steps, s)
    return Schedule(
        strategy=strategy,
        pass_=pass_,
        layout=layout,
        causal=mask.causal,
        world_size=p,
        seq_local=s,
        lanes=lanes,
        steps=tuple(tuple(row) for row in steps),
        transfers=tuple(transfers),
        sharding=sharding,
        mask=mask,
    )


def _collective_schedule(
    strategy: Strategy,
    pass_: Pass,
    sharding: Sharding,
    mask: MaskSpec,
    heads_q: int | None,
    heads_kv: int | None,
) -> Schedule:
    """``build_schedule`` of a collective strategy (``tokenring.strategies.collective``)."""
    if heads_q is None or heads_kv is None:
        raise ValueError(
            f"heads_q and heads_kv must be given for strategy {strategy.value!r}; got "
            f"{heads_q}, {heads_kv}"
        )
    if sharding.padded or not mask.plain:
        raise NotImplementedError(
            f"build_schedule gives strategy {strategy.value!r} only its plain schedule (no "
            "documents, windows, chunks or padded shards); "
            "tokenring.model.simulate.strategy_schedule attaches the mask its runtime applies"
        )
    p, s, causal = sharding.world_size, sharding.seq_local, bool(mask.causal)
    return _build_collective(strategy, pass_, sharding.layout, causal, p, s, heads_q, heads_kv)


@dataclass(frozen=True)
class _Ring:
    """What every step plan and transfer of one ring schedule reads."""

    strategy: Strategy
    pass_: Pass
    lanes: tuple[Lane, ...]
    pieces: Callable[[int, int], tuple[Piece, ...]]  # (q_owner, kv_owner) -> kernel calls
    p: int
    splits: int  # last_block_splits
    heads_q: int | None
    heads_kv: int | None

    @property
    def payloads(self) -> tuple[Payload, Payload | None]:
        """(what travels, what goes back or None)."""
        forward = self.pass_ is Pass.FORWARD
        if self.strategy.passes_q:
            return (Payload.Q, Payload.OUT) if forward else (Payload.Q_GRAD, Payload.DQ)
        return Payload.KV, None if forward else Payload.DKV

    @property
    def borrow_step(self) -> int:
        """The step at which a q owner computes a borrowed pair."""
        return self.p - 1 if self.pass_ is Pass.FORWARD else 1

    def cell_plan(self, r: int, t: int) -> StepPlan:
        """Rank r's plan at step t."""
        p, lanes = self.p, self.lanes
        kv_owners = tuple(lane.visitor(r, t, p) for lane in lanes)
        splits = self.splits if t == p - 1 and t > 0 else 1
        if self.strategy.passes_q:  # the lanes carry Q: their visitors are q owners
            if t == 0:  # the local block, once, on every head
                segments = _segments(self.pieces(r, r), 1)
            else:
                segments = tuple(
                    segment
                    for i, (lane, o) in enumerate(zip(lanes, kv_owners, strict=True))
                    for segment in self.sliced(self.pieces(o, r), i, lane, splits)
                )
            q_owners = kv_owners if len(lanes) > 1 else ()
            return StepPlan(r, t, kv_owners[0], (r,) * len(lanes), segments, q_owners)
        block: list[Piece] = []
        for index, lane in enumerate(lanes):
            if t == 0 and index > 0:
                break  # the local block is computed once, by lane 0, on every head and row
            for piece in self.pieces(r, kv_owners[index]):
                block += _lane_pieces(piece, index, lane, whole_block=t == 0)
        return StepPlan(r, t, r, kv_owners, _by_q_rows(block))

    def sliced(
        self, pieces: tuple[Piece, ...], index: int, lane: Lane, splits: int
    ) -> tuple[Segment, ...]:
        """A pass-Q block on lane ``index``'s heads in ``splits`` slices."""
        heads = self.head_slices(lane, splits) if pieces and splits > 1 else None
        slices: Sequence[tuple[Rows | None, Rows | None]] = heads or [(lane.kv_heads, lane.q_heads)]
        segments = _segments(pieces, 1 if heads else splits)
        if heads is None and lane.q_heads is None:
            return segments
        return tuple(
            Segment(
                segment.q_rows,
                tuple(replace(p, lane=index, heads=kv, q_heads=q) for p in segment.pieces),
            )
            for kv, q in slices
            for segment in segments
        )

    def head_slices(self, lane: Lane, splits: int) -> list[tuple[Rows, Rows]] | None:
        """``(kv heads, query heads)`` of up to ``splits`` head slices of ``lane``, or None."""
        heads_q, heads_kv = self.heads_q, self.heads_kv
        if heads_q is None or heads_kv is None or heads_kv < 1 or heads_q % heads_kv:
            return None
        groups = heads_q // heads_kv
        kv = lane.kv_heads or (0, heads_kv)
        q = lane.q_heads or (kv[0] * groups, kv[1] * groups)
        if kv[1] - kv[0] >= 2:
            return [(h, (h[0] * groups, h[1] * groups)) for h in _split_rows(kv, splits)]
        if q[1] - q[0] >= 2:
            return [(kv, h) for h in _split_rows(q, splits)]
        return None

    def lend(self, steps: list[list[StepPlan]]) -> None:
        """Move the last pairs worth lending (Note [Borrowed last pair]) to their q owners'
        ``borrow_step``, in place."""
        p, heads_q, heads_kv = self.p, self.heads_q, self.heads_kv
        forward = self.pass_ is Pass.FORWARD
        lendable = (2 if forward else 3) <= p <= LEND_MAX_WORLD_SIZE
        if not lendable or heads_q is None or heads_kv is None:
            return  # the backward's dK/dV home must have later steps to fly in
        compute_step = self.borrow_step
        # bytes per row in elements of D: what travels (q; q and dout), what returns, K and V
        travel_row, return_row, kv_row = heads_q * (1 if forward else 2), heads_q, 2 * heads_kv
        load: Counter[tuple[int, int, int]] = Counter()  # (src, dst, step) -> travel bytes
        for tr in self.travel_transfers(steps):
            load[(tr.src, tr.dst, tr.step)] += tr.num_rows * travel_row
        busiest = [max((n for (_, _, u), n in load.items() if u == t), default=0) for t in range(p)]
        lent: dict[int, Segment] = {}  # lender rank -> the segment its q owner computes
        for r in range(p):
            owner = (r - 1) % p  # whose Q rank r holds at the last step
            block = self.pieces(owner, r)
            q_rows = _union([pc.q_rows for pc in block])
            kv_rows = _union([pc.kv_rows for pc in block])
            if q_rows is None or kv_rows is None:
                continue
            kv_bytes = kv_row * (kv_rows[1] - kv_rows[0])
            saved = (travel_row + return_row) * (q_rows[1] - q_rows[0])
            part = kv_bytes / compute_step  # sent in parts, one a step before it is computed
            fits = all(load[(r, owner, t)] + part <= busiest[t] for t in range(compute_step))
            if kv_bytes <= saved and fits:
                parts = _split_rows(kv_rows, compute_step)
                lent[r] = Segment(
                    q_rows,
                    tuple(
                        Piece(pc.q_rows, (lo, hi), pc.causal, masked=pc.masked, kv_owner=r)
                        for pc in block
                        for lo, hi in (
                            (max(pc.kv_rows[0], a), min(pc.kv_rows[1], b)) for a, b in parts
                        )
                        if lo < hi
                    ),
                )
        for holder in lent:
            steps[holder][p - 1] = replace(steps[holder][p - 1], segments=())
        for holder, pair in lent.items():
            plan = steps[(holder - 1) % p][compute_step]  # the q owner's
            steps[plan.rank][compute_step] = replace(plan, segments=(*plan.segments, pair))

    def travel_transfers(self, steps: list[list[StepPlan]]) -> list[Transfer]:
        """The travelling blocks: rank r forwards the rows the ranks ahead still need."""
        p, (travel, _) = self.p, self.payloads
        transfers: list[Transfer] = []
        for index, lane in enumerate(self.lanes):
            heads = lane.q_heads if self.strategy.passes_q else lane.kv_heads
            send = partial(Transfer, payload=travel, after_segments=0, heads=heads, lane=index)
            # need[t][r]: the hull of the rows computed on the block rank r sends at step t,
            # at steps t + 1 ... p - 1 by the ranks ahead; one hull per step, not per
            # (step, rank ahead): O(P^2), where the union over the ranks ahead was O(P^3)
            need: list[list[Rows | None]] = [[None] * p for _ in range(p)]
            for t in range(p - 2, -1, -1):
                for r in range(p):
                    ahead = (r + lane.direction) % p
                    computed = [
                        piece.kv_rows if travel is Payload.KV else piece.q_rows
                        for piece in steps[ahead][t + 1].pieces
                        if piece.lane == index and piece.kv_owner is None
                    ]
                    later = need[t + 1][ahead]
                    need[t][r] = _union(computed if later is None else [*computed, later])
            for r in range(p):
                for t in range(p - 1):
                    rows = need[t][r]
                    if rows is not None:
                        dst, owner = (r + lane.direction) % p, lane.visitor(r, t, p)
                        transfers.append(send(src=r, dst=dst, owner=owner, rows=rows, step=t))
        return transfers

    def return_transfers(self, steps: list[list[StepPlan]]) -> list[Transfer]:
        """Pass-Q: each segment's partial straight back to its q owner once computed; then each
        borrowed pair's K/V to its q owner (backward: and its dK/dV back)."""
        backward = self.pass_ is Pass.BACKWARD
        returns: list[Transfer] = []
        borrows: list[Transfer] = []
        for plan in (plan for row in steps for plan in row):
            r, t = plan.rank, plan.step
            for k, segment in enumerate(plan.segments):
                first = segment.pieces[0]  # a segment's pieces share their lane and heads
                holder = first.kv_owner
                if holder is None and t > 0:
                    lane, to = first.lane, plan.lane_q_owner(first.lane)
                    heads = first.q_heads or self.lanes[lane].q_heads
                    payload = Payload.DQ if backward else Payload.OUT
                    send = partial(Transfer, payload=payload, src=r, dst=to, owner=to, step=t)
                    returns.append(
                        send(rows=segment.q_rows, after_segments=k + 1, heads=heads, lane=lane)
                    )
                elif holder is not None:  # a borrowed pair: our own rows, merged here
                    rows = _union([pc.kv_rows for pc in segment.pieces])
                    assert rows is not None
                    kv = partial(Transfer, payload=Payload.KV, src=holder, dst=r, owner=holder)
                    borrows += [
                        kv(rows=part, step=u, after_segments=0)
                        for u, part in enumerate(_split_rows(rows, t))
                    ]
                    if backward:
                        back = partial(
                            Transfer, payload=Payload.DKV, src=r, dst=holder, owner=holder
                        )
                        borrows.append(back(rows=rows, step=t, after_segments=k + 1))
        return returns + borrows

    def accumulator_transfers(self, steps: list[list[StepPlan]], seq_local: int) -> list[Transfer]:
        """Pass-KV backward's dK/dV accumulators (Note [Backward])."""
        p = self.p
        transfers: list[Transfer] = []
        for index, lane in enumerate(self.lanes):
            rows = lane.kv_rows or (0, seq_local)
            send = partial(
                Transfer, payload=Payload.DKV, rows=rows, heads=lane.kv_heads, lane=index
            )
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
                for t, src in enumerate(holders[: last + 1]):
                    dst = holders[t + 1] if t < last else owner
                    after = max(1, len(steps[src][t].segments))
                    transfers.append(
                        send(src=src, dst=dst, owner=owner, step=t, after_segments=after)
                    )
        return transfers


def _lanes(
    strategy: Strategy,
    layout: Layout,
    seq_local: int,
    heads_q: int | None,
    heads_kv: int | None,
    causal: bool,
) -> tuple[Lane, ...]:
    """Note [Bidirectional ring] and Note [Bidirectional TokenRing]. Ring's K/V travel up on
    the contiguous causal layout, where only higher ranks see a shard's keys; down otherwise."""
    if strategy is Strategy.BIDIR_TOKEN_RING:
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


def _lane_pieces(piece: Piece, index: int, lane: Lane, *, whole_block: bool) -> list[Piece]:
    """The part of ``piece`` a lane computes: its kv heads or its kv rows."""
    if whole_block:
        return [piece]
    if lane.kv_rows is None:
        return [replace(piece, lane=index, heads=lane.kv_heads)]
    lo, hi = max(piece.kv_rows[0], lane.kv_rows[0]), min(piece.kv_rows[1], lane.kv_rows[1])
    if lo >= hi:
        return []
    assert not piece.causal, "only the local block (step 0) is causal, and lane 0 owns it"
    return [replace(piece, kv_rows=(lo, hi), lane=index, heads=lane.kv_heads)]


def _by_q_rows(block: list[Piece]) -> tuple[Segment, ...]:
    """Group pieces with equal q rows into segments (merged into one partial each)."""
    groups: dict[Rows, list[Piece]] = {}
    for piece in block:
        groups.setdefault(piece.q_rows, []).append(piece)
    return tuple(Segment(rows, tuple(group)) for rows, group in groups.items())


# -- the same plan as columns ------------------------------------------------------------------
# Note [Ring columns]
# ~~~~~~~~~~~~~~~~~~~
# Past a few hundred ranks P^2 step plans are too many objects, so the simulator reads a
# one-lane ring schedule (TokenRing, Ring; plain mask, no padding) as (P, T) tensors. Under a
# plain mask a block's pieces depend only on whether its kv owner is below, equal to or above
# its q owner (Note [Causal blocks per layout]), so ``_Ring.cell_plan`` runs once per *kind* of
# cell (that class, last step or not). Transfers follow the builder's rules: a block forwards
# the hull of the rows later holders need (a kind is needed after step t iff it occurs on the
# block's way after t), TokenRing returns each segment from step 1, Ring's backward
# accumulator goes on to the last holder that computes. Tests compare every column with the
# schedule.


@dataclass(frozen=True, kw_only=True, slots=True)
class RingColumns:
    """Steps ``steps`` of a one-lane ring schedule, ``[rank, column]`` (K: the most segments a
    step has; Note [Ring columns])."""

    steps: range
    q_owner: torch.Tensor
    """(P, T) o of the block computed at [r, t]."""
    segment_rows: torch.Tensor
    """(P, T, K) q rows of each segment (0: none)."""
    segment_pairs: torch.Tensor
    """(P, T, K) float64: score entries x query heads of each segment (FLOPs / (4*B*D))."""
    segment_heads: torch.Tensor
    """(P, T, K) query heads of each segment (of its partial, for TokenRing's returns)."""
    travel_rows: torch.Tensor
    """(P, T) rows r sends to r + direction at the start of step t."""
    return_rows: torch.Tensor
    """(P, T, K) TokenRing: rows of segment k's partial sent to q_owner after it."""
    dkv_rows: torch.Tensor
    """(P, T) Ring backward: rows of the accumulator r sends after step t."""
    dkv_dst: torch.Tensor
    """(P, T) where it goes: r + direction, or its owner (home)."""
    dkv_home: torch.Tensor
    """(P, T) bool: it goes home."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RingPlan:
    """A one-lane ring schedule by kinds of cell (Note [Ring columns]); see :func:`ring_plan`."""

    strategy: Strategy
    pass_: Pass
    world_size: int
    seq_local: int
    direction: int
    """Where the blocks travel: rank r sends to r + direction."""
    travel_payload: Payload
    return_payload: Payload | None
    """OUT / DQ (TokenRing), DKV (Ring backward), None."""
    rows: torch.Tensor
    """(C, K) per kind of cell: q rows of each segment; ``pairs``, ``heads`` likewise."""
    pairs: torch.Tensor
    heads: torch.Tensor
    needs: torch.Tensor
    """(C, 2) the hull of the travelling rows a kind computes with; (s, 0): none."""
    last_seen: (
        torch.Tensor
    )  # (C, P) per kind and owner: last step >= 1 its block is on it (-1: never)

    def columns(self, steps: range) -> RingColumns:
        """The columns of ``steps`` ((P, len(steps)) each)."""
        p, s = self.world_size, self.seq_local
        rank = torch.arange(p).unsqueeze(1)
        step = torch.as_tensor(list(steps), dtype=torch.long).unsqueeze(0)
        kind, owner = _kinds(self.strategy, self.direction, p, rank, step)
        q_owner = owner if self.strategy.passes_q else rank.expand_as(owner)
        ahead = self.last_seen[:, owner] > step  # (C, P, T): the kind occurs after step t
        start = torch.where(ahead, self.needs[:, 0, None, None], s).amin(0)
        stop = torch.where(ahead, self.needs[:, 1, None, None], 0).amax(0)
        travel = torch.where(step < p - 1, (stop - start).clamp(min=0), 0)
        rows = self.rows[kind]
        returned = self.strategy.passes_q and p > 1
        computes = (self.rows.sum(1) > 0).unsqueeze(1)
        last = torch.where(computes, self.last_seen, -1).amax(0)[owner]  # last step computed
        dkv = self.return_payload is Payload.DKV and p > 1
        has_dkv = (step <= last) & (last >= 1) if dkv else torch.zeros_like(kind, dtype=torch.bool)
        home = has_dkv & (step == last)
        return RingColumns(
            steps=steps,
            q_owner=q_owner,
            segment_rows=rows,
            segment_pairs=self.pairs[kind],
            segment_heads=self.heads[kind],
            travel_rows=travel,
            return_rows=torch.where((step >= 1).unsqueeze(-1), rows, 0) if returned else 0 * rows,
            dkv_rows=torch.where(has_dkv, s, 0),
            dkv_dst=torch.where(home, owner, (rank + self.direction) % p),
            dkv_home=home,
        )


def ring_plan(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    last_block_splits: int = 2,
) -> RingPlan:
    """``build_schedule``'s schedule by kinds of cell (Note [Ring columns]).

    Raises:
        ValueError: as ``build_schedule``.
        NotImplementedError: a strategy other than TokenRing and Ring.
    """
    strategy, pass_, layout = Strategy.parse(strategy), Pass(pass_), Layout.parse(layout)
    if strategy not in (Strategy.TOKEN_RING, Strategy.RING):
        raise NotImplementedError(
            f"ring_plan covers 'token_ring' and 'ring'; got strategy {strategy.value!r}"
        )
    _check_call(strategy, causal, heads_q, heads_kv)
    check_int("world_size", world_size, 1)
    check_int("last_block_splits", last_block_splits, 1)
    check_int("seq_local", seq_local, 1)
    validate_seq_local(seq_local, layout)
    p, s = world_size, seq_local
    sharding = make_sharding(layout=layout, world_size=p, seq_len=p * s)
    lanes = _lanes(strategy, layout, s, heads_q, heads_kv, causal)
    pieces = partial(sharded_block_pieces, sharding, MaskSpec(causal))
    ring = _Ring(strategy, pass_, lanes, pieces, p, last_block_splits, heads_q, heads_kv)
    direction = lanes[0].direction
    # one cell of each kind: every kind occurs at step 0, 1 or P - 1
    segments: dict[int, tuple[Segment, ...]] = {}
    for t in sorted({0, min(1, p - 1), p - 1}):
        kinds, _ = _kinds(strategy, direction, p, torch.arange(p), torch.tensor(t))
        for r, kind in enumerate(kinds.tolist()):
            if kind not in segments:
                segments[kind] = ring.cell_plan(r, t).segments
    rows, pairs, heads, needs = _kind_tables(strategy, s, segments, heads_q, heads_kv)
    payloads = ring.payloads
    return RingPlan(
        strategy=strategy,
        pass_=pass_,
        world_size=p,
        seq_local=s,
        direction=direction,
        travel_payload=payloads[0],
        return_payload=payloads[1],
        rows=rows,
        pairs=pairs,
        heads=heads,
        needs=needs,
        last_seen=_last_seen(strategy, direction, p),
    )


def _kinds(
    strategy: Strategy, direction: int, p: int, rank: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kind of cell, travelling block's owner) at ``[rank, step]``: kv owner vs q owner (0:
    equal, 1: above, 2: below), + 3 on the last step."""
    visitor = (rank - direction * step) % p
    q_owner, kv_owner = (visitor, rank) if strategy.passes_q else (rank, visitor)
    return torch.sign(kv_owner - q_owner) % 3 + 3 * (step == p - 1), visitor


def _kind_tables(
    strategy: Strategy,
    seq_local: int,
    segments: dict[int, tuple[Segment, ...]],
    heads_q: int,
    heads_kv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`RingPlan`'s ``rows``, ``pairs``, ``heads`` and ``needs``."""
    unit = AttentionShape(heads_q=heads_q, heads_kv=heads_kv, head_dim=1)  # 4 FLOPs a pair
    width = max(1, *(len(segs) for segs in segments.values()))
    rows = torch.zeros(6, width, dtype=torch.long)
    heads = torch.zeros(6, width, dtype=torch.long)
    pairs = torch.zeros(6, width, dtype=torch.float64)
    needs = torch.tensor([[seq_local, 0]] * 6)
    for kind, segs in segments.items():
        for k, segment in enumerate(segs):
            rows[kind, k] = segment.q_rows[1] - segment.q_rows[0]
            first = segment.pieces[0].q_heads  # a segment's pieces share their heads
            heads[kind, k] = heads_q if first is None else first[1] - first[0]
            pairs[kind, k] = sum(piece_flops(pc, unit, Pass.FORWARD) / 4 for pc in segment.pieces)
        q_travels = strategy.passes_q
        hull = _union([pc.q_rows if q_travels else pc.kv_rows for seg in segs for pc in seg.pieces])
        if hull is not None:
            needs[kind] = torch.tensor(hull)
    return rows, pairs, heads, needs


def _last_seen(strategy: Strategy, direction: int, p: int) -> torch.Tensor:
    """:class:`RingPlan`'s ``last_seen``, walking the steps in chunks (memory linear in P)."""
    owner = torch.arange(p).unsqueeze(1)
    last = torch.full((6 * p,), -1, dtype=torch.long)
    chunk = max(1, (1 << 19) // p)
    for first in range(1, p, chunk):
        step = torch.arange(first, min(p, first + chunk)).unsqueeze(0)
        kind, _ = _kinds(strategy, direction, p, (owner + direction * step) % p, step)
        index = (kind * p + owner).reshape(-1)
        last.scatter_reduce_(0, index, step.expand_as(kind).reshape(-1), "amax")
    return last.view(6, p)
