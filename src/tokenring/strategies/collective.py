"""Collective strategies as pure schedules: Ulysses (all-to-all sequence <-> heads) and
all-gather K/V. ``tokenring.runtime.collective`` executes them through the communicator.

Legend: B batch, S global seq (P * s), s local seq, c = s // 2 (zigzag chunk), Hq query heads,
Hkv key/value heads, g = Hq // Hkv, D head dim, P world size, nq / nkv heads of one Ulysses
rank, e bytes per element, a bytes per accumulator element (4; 8 for float64).

Note [Ulysses]
~~~~~~~~~~~~~~
Two all-to-alls turn a sequence shard of every head into every row of a head shard and back.
P = 2, Hq = 4 (rows in layout order, h = query heads)::

              input              all-to-all 1          kernel            all-to-all 2
    rank 0:   rows_0 x h0..3  ->  rows_0,1 x h0,1  ->  S x S on h0,1  ->  rows_0 x h0..3
    rank 1:   rows_1 x h0..3  ->  rows_0,1 x h0,1  ->  S x S on h2,3  ->  rows_1 x h0..3

Causal attention permutes the gathered rows (layout order) to global order around the kernel;
non-causal skips it. The forward keeps nothing: the backward gathers q, dout, lse, delta
(``Payload.Q_GRAD``) and K/V again; dq and dK/dV (accumulation dtype) return.

Note [Ulysses head split]
~~~~~~~~~~~~~~~~~~~~~~~~~
Heads are never padded and Hq % P != 0 is never refused: rank j gets ceil(Hq / P) contiguous
query heads if j < Hq % P, else floor(Hq / P) (with Hq < P the last ranks only relay), and
exactly the kv heads h // g they use; a kv head used by several ranks is sent to each, and its
dK/dV partials are summed on the way home. Hq = 6, Hkv = 3 (g = 2), P = 4::

    rank   q heads   kv heads   note
    0      0 1       0
    1      2 3       1
    2      4         2          kv head 2 goes to ranks 2 and 3; both dK/dV partials
    3      5         2          of it are summed by the owner of each row

A share that does not line up with the groups repeats K/V locally, never on the wire.

Note [All-gather K/V]
~~~~~~~~~~~~~~~~~~~~~
Every rank attends with its own Q over every rank's K/V, gathered in rounds (the forward keeps
two in flight, the backward one, holding K/V and two dK/dV partials; nothing is kept for the
backward); which rows meet is Note [Causal blocks per layout]; each piece is a kernel call on a
view of its round's buffer.

Note [All-gather K/V rounds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Round k of rank r computes against the K/V of owner r + k (mod P); round 0 is its own block.
Round k >= 1 is one exchange: r sends its K/V to r - k and receives those of r + k, the
receive posted first. P = 4, rank 0 ("k/v j" = owner j's K/V)::

    pass       slot (segments before)   posts                         computes
    forward    0                        k/v round 1 (from 1, to 3)     own block (causal)
               rounds 0                 k/v round 2 (from 2, to 2)     round 1, once it arrived
               rounds 0..1              k/v round 3 (from 3, to 1)     round 2, ...
    backward   0                        k/v round 1                   own block: dq, dk, dv
               rounds 0..1 (each k)     dK/dV of round k to 0 + k,    round k, its dK/dV
                                        then k/v round k + 1          partial from zero

Note [Collective schedules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`build_collective_schedule` returns a ``Schedule`` with one step; ``steps[r][0]`` is
what rank r computes (``q_owner = kv_owner = r``)::

    strategy       q rows                        kv rows
    ulysses        gathered sequence, global     gathered sequence, global order, [0, S),
                   order, [0, S)                 one piece per rank on its own head share
    allgather_kv   r's own local rows [0, s)     the gathered K/V in rank order: row i of
                                                 owner j is j * s + i

A Ulysses rank's FLOPs are ``piece_flops(piece, dims, pass_) * share.num_q / Hq``.
``transfers`` lists every point-to-point message, all at step 0 (``after_segments``: 0 for
travel, the segments computed before it for a return), ``heads`` the head range carried.
Bytes per row (x B), s rows each::

    strategy       pass       payload       flow     r -> j (j != r), bytes per row
    ulysses        forward    q             travel   nq_j*D*e           (q of j's heads)
                              kv            travel   2*nkv_j*D*e        (k, v j needs)
                              out           return   nq_r*D*e + nq_r*a  (out + lse)
    ulysses        backward   q_grad        travel   2*nq_j*D*e + 2*nq_j*a  (q, dout, lse, delta)
                              kv            travel   2*nkv_j*D*e        (k, v j needs)
                              dq            return   nq_r*D*e
                              dkv           return   2*nkv_r*D*a
    allgather_kv   forward    kv            travel   2*Hkv*D*e          (round (r - j) mod P)
    allgather_kv   backward   kv            travel   2*Hkv*D*e          (gathered again)
                              dkv           return   2*Hkv*D*a          (round (j - r) mod P)

All-gather K/V's ``after_segments`` are its rounds' slots; its segments are one piece each.

Note [Collective routing]
~~~~~~~~~~~~~~~~~~~~~~~~~
The library's all-to-alls (Ulysses, all-gather K/V's rounds, the hybrid's inner all-to-alls)
are point-to-point messages, every receive posted before any send (``Communicator.exchange``),
so both directions of a pair run at once and the cost model prices them as direct sends.
gloo's own collectives do not (lab mesh, 100 Mbit/s links, 2 MiB per pair, in units of one
pair's transfer time; benchmarks/results/gloo_collectives.md)::

    P    P2P, receives first   all_to_all_single (equal / uneven)   all_gather_into_tensor
    2    1.00                  1.96 / 1.96                          1.47 (1.0-1.5: a race)
    3    1.00                  1.95 / 1.94                          2.01
    4    1.01                  1.96 / 1.95                          3.03

gloo's all-to-all posts each send before the matching receive, so a pair's two directions run
one after the other (../shared/netlab-notes.md, pitfall 1); its all-gather is a ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tokenring.core.enums import parse_enum
from tokenring.core.layout import Layout, split_evenly, validate_seq_local
from tokenring.core.schedule import (
    Pass,
    Payload,
    Piece,
    Rows,
    Schedule,
    Segment,
    StepPlan,
    Strategy,
    Transfer,
    block_pieces,
)

__all__ = [
    "DOUT",
    "CollectiveSchedule",
    "HeadShare",
    "build_collective_schedule",
    "parse_collective",
    "ulysses_heads",
]


DOUT = Payload.Q
"""Payload kind of dout rows in schedules: the bytes (Hq*D*e per row) and flow (travel) of q."""


_COLLECTIVE = tuple(s for s in Strategy if s.is_collective)
"""The strategies this module builds: Ulysses and all-gather K/V."""


def parse_collective(value: Strategy | str) -> Strategy:
    """A collective ``Strategy`` from a member or its value; ValueError naming the options."""
    return parse_enum(Strategy, value, "strategy_name", among=_COLLECTIVE)


@dataclass(frozen=True, slots=True)
class HeadShare:
    """The heads one Ulysses rank attends over: half-open ranges of global head indices."""

    q: Rows
    kv: Rows

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def ulysses_heads(*, world_size: int, heads_q: int, heads_kv: int) -> tuple[HeadShare, ...]:
    """Each rank's query heads and the kv heads they use (Note [Ulysses head split]);
    ValueError on world_size < 1, heads < 1, or heads_kv not dividing heads_q."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            f"heads_kv must be >= 1 and divide heads_q; got heads_q={heads_q}, heads_kv={heads_kv}"
        )
    g = heads_q // heads_kv
    return tuple(
        HeadShare((start, stop), (start // g, (stop - 1) // g + 1) if stop > start else (0, 0))
        for start, stop in split_evenly(heads_q, world_size)
    )


@dataclass(frozen=True, slots=True)
class CollectiveSchedule(Schedule):
    """A ``Schedule`` of a collective strategy: one step of point-to-point messages
    (Note [Collective schedules], Note [Collective routing])."""


def build_collective_schedule(
    strategy_name: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
) -> CollectiveSchedule:
    """The schedule of one pass of ``strategy_name`` (``"ulysses"`` or ``"allgather_kv"``;
    Note [Collective schedules]); the rest as ``tokenring.strategies.build_schedule``.

    Raises:
        ValueError: unknown strategy, pass or layout; world_size < 1; a seq_local the layout
            cannot split; heads < 1 or heads_kv not dividing heads_q.
    """
    strategy, layout = parse_collective(strategy_name), Layout.parse(layout)
    return _build(
        strategy, Pass(pass_), layout, bool(causal), world_size, seq_local, heads_q, heads_kv
    )


@functools.lru_cache(maxsize=256)
def _build(
    strategy: Strategy,
    pass_: Pass,
    layout: Layout,
    causal: bool,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
) -> CollectiveSchedule:
    validate_seq_local(seq_local, layout)
    shares = ulysses_heads(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)
    p, s = world_size, seq_local
    forward = pass_ is Pass.FORWARD
    steps: list[tuple[StepPlan, ...]] = []
    transfers: list[Transfer] = []
    for r in range(p):
        if strategy is Strategy.ULYSSES:
            segments, sends = _ulysses_rank(r, shares, causal=causal, forward=forward, s=s)
        else:
            segments, sends = _allgather_rank(r, layout, causal=causal, forward=forward, p=p, s=s)
        transfers += sends
        steps.append((StepPlan(r, 0, r, (r,), segments),))
    return CollectiveSchedule(
        strategy=strategy,
        pass_=pass_,
        layout=layout,
        causal=causal,
        world_size=p,
        seq_local=s,
        lanes=(),  # no block travels a ring: the collectives move everything at once
        steps=tuple(steps),
        transfers=tuple(transfers),
    )


def _ulysses_rank(
    r: int, shares: tuple[HeadShare, ...], *, causal: bool, forward: bool, s: int
) -> tuple[tuple[Segment, ...], list[Transfer]]:
    """Rank r's segment over all P * s rows of its heads, and what it sends each peer."""
    p = len(shares)
    whole = (0, p * s)
    segments: tuple[Segment, ...] = ()
    if shares[r].num_q > 0:
        segments = (Segment(whole, (Piece(whole, whole, causal),)),)
    transfers = []
    send = functools.partial(Transfer, src=r, rows=(0, s), step=0)
    for j in range(p):
        if j == r:
            continue
        mine, theirs = shares[r], shares[j]
        if forward:
            travel = [(Payload.Q, theirs.q), (Payload.KV, theirs.kv)]
            back = [(Payload.OUT, mine.q)]
        else:  # gathered again: the forward keeps nothing (Note [Ulysses])
            travel = [(Payload.Q_GRAD, theirs.q), (Payload.KV, theirs.kv)]
            back = [(Payload.DQ, mine.q), (Payload.DKV, mine.kv)]
        moves = [(payload, heads, r, 0) for payload, heads in travel]
        moves += [(payload, heads, j, len(segments)) for payload, heads in back]
        for payload, heads, owner, after in moves:
            if heads[1] > heads[0]:
                transfers.append(
                    send(payload=payload, dst=j, owner=owner, after_segments=after, heads=heads)
                )
    return segments, transfers


def _allgather_rank(
    r: int, layout: Layout, *, causal: bool, forward: bool, p: int, s: int
) -> tuple[tuple[Segment, ...], list[Transfer]]:
    """Rank r's segments, one per piece of each round k against owner r + k's K/V (gathered
    rows), and its K/V (backward: and dK/dV) transfers."""
    segments: list[Segment] = []
    cum = [0]  # segments before round k
    for k in range(p):
        owner = (r + k) % p
        pieces = block_pieces(
            layout=layout, causal=causal, world_size=p, seq_local=s, q_owner=r, kv_owner=owner
        )
        assert k == 0 or not any(piece.causal for piece in pieces), "only the diagonal is causal"
        for pc in pieces:
            kv_rows = (pc.kv_rows[0] + owner * s, pc.kv_rows[1] + owner * s)
            segments.append(Segment(pc.q_rows, (Piece(pc.q_rows, kv_rows, pc.causal),)))
        cum.append(len(segments))
    assert cum[1] == 1, "the own block is one piece"
    transfers = []
    send = functools.partial(Transfer, src=r, rows=(0, s), step=0)
    for k in range(1, p):  # Note [All-gather K/V rounds]
        after = cum[k - 1] if forward else (0 if k == 1 else cum[k])
        transfers.append(send(payload=Payload.KV, dst=(r - k) % p, owner=r, after_segments=after))
        if not forward:
            owner = (r + k) % p
            transfers.append(
                send(payload=Payload.DKV, dst=owner, owner=owner, after_segments=cum[k + 1])
            )
    return tuple(segments), transfers
