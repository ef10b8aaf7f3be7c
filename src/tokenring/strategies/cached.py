"""Schedules of attention against a sharded KV cache, as plain data: which rank owns each new
token (:func:`place_new_tokens`, :class:`CacheStep`), and who computes which new queries
against which shard in which round, with the transfers (:class:`CachedPlan`). The runtime
(``tokenring.inference``) executes them; ``tokenring.model.planner`` prices the same plans.

Legend: B sequences, T new tokens and C cached tokens of a sequence, P world size, Hq / Hkv
query / key-value heads, D head dim, e bytes per element, a bytes per accumulator element
(4; 8 for float64), o the owner of a block of new queries, j the holder of a K/V shard, r a
rank, t a round. A rank's new queries of all sequences form one *Q block* (packed rows); its
cached K/V of all sequences form one *K/V shard*.

Note [Placement]
~~~~~~~~~~~~~~~~
A step appends T_b new tokens to each sequence b. Their owner computes them, holds their Q
and caches their K/V (the append moves nothing); every rank decides it alike::

    first prefill   every C_b = 0, every T_b = T, T % 2P == 0: the zigzag layout of the
                    ordinary attention path (rank r owns chunks r and 2P-1-r of 2P)
    otherwise       block-cyclic: position p of sequence b goes to rank (p // bs + b) mod P

Block-cyclic keeps every rank within one block of the others however long a sequence grows,
so no rank fills first; ``+ b`` spreads a batch of short sequences. P = 3, bs = 4, b = 0::

    position:  0-3  4-7  8-11  12-15  16-19  ...
    rank:       0    1    2     0      1     ...

Note [Cached strategies]
~~~~~~~~~~~~~~~~~~~~~~~~
K/V never move to be appended (Note [Placement]); only attention moves data::

    strategy  what moves                                           rounds
    pass_q    Q blocks down the ring (r -> r-1) while each rank     P
              attends the visiting block to its shard; partials
              (out, lse) go straight back to the owner (TokenRing)
    pass_kv   K/V shards down the ring; each rank attends its own    P
              Q block to the visiting shard (Ring)
    direct    each Q block straight to every rank (one round),      2
              each partial straight back to its owner
    tree      each Q block down a binomial tree rooted at its       2 ceil(log2 P) + 1
              owner; partials merged (by lse) on the way back up

A block goes on only while a rank ahead sees one of its keys, and only blocks with a visible
key are computed. ``direct`` and ``tree`` trade the ring's P - 1 hops for one round (P - 1
copies on the owner's link) or log P rounds (one copy per link and round), for decode.

Binomial tree of owner o, P = 6 (3 levels, rounds 0-6), rel = (r - o) mod P::

    broadcast  round 0: rel 0 -> 1      round 1: 0 -> 2, 1 -> 3     round 2: 0 -> 4, 1 -> 5
    compute    round 0: rel 0           round 1: 1    round 2: 2, 3    round 3: 4, 5
    reduce     round 4: 4 -> 0, 5 -> 1  round 5: 2 -> 0, 3 -> 1     round 6: 1 -> 0

In broadcast round k a rank sends every block it holds with rel < 2^k to r + 2^k (all
owners' trees share one message per pair); the reduce mirrors it. Round k computes the
blocks that arrived in round k - 1, overlapping the next hop.

Note [Pass-Q or pass-KV]
~~~~~~~~~~~~~~~~~~~~~~~~
In a steady ring round with the new tokens and the cache spread evenly, a rank sends::

    pass_q    Q (T/P rows x Hq*D*e) on one direction, a partial (T/P rows x (Hq*D*e + Hq*a))
              on the other: busiest direction T/P * Hq * (D*e + a)
    pass_kv   its shard ((T+C)/P rows x 2*Hkv*D*e)

so pass-Q moves fewer bytes on its busiest direction exactly when::

    T / (T + C)  <  2 * Hkv * D * e / (Hq * (D*e + a))  =  pass_q_threshold(...)

Meta's context-parallel inference criterion with the lse riding along each partial (MHA:
about 2, always pass-Q; GQA 32/8: about 1/2). ``choose_cached_strategy`` compares simulated
calls, not just this ratio.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from tokenring.core.enums import parse_enum
from tokenring.core.layout import check_size
from tokenring.core.schedule import Payload, Transfer

__all__ = [
    "CacheStep",
    "CachedPlan",
    "CachedShards",
    "CachedStrategy",
    "CachedTransfer",
    "build_cached_plan",
    "place_new_tokens",
    "uniform_shards",
]


def place_new_tokens(
    *, cached: Sequence[int], new: Sequence[int], world_size: int, block_size: int, zigzag: bool
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``[rank][sequence]`` int64 increasing positions of the new tokens each rank owns
    (Note [Placement]), from C_b ``cached`` and T_b ``new`` per sequence; ``zigzag``: the first
    prefill's layout (the caller checked that it applies)."""
    p = world_size
    placed: list[list[torch.Tensor]] = [[] for _ in range(p)]
    for b, (c, t) in enumerate(zip(cached, new, strict=True)):
        if zigzag:  # rank r: chunks r and 2P-1-r of 2P
            chunk = t // (2 * p)
            chunks = torch.arange(2 * p * chunk).view(2 * p, chunk)
            for r in range(p):
                placed[r].append(chunks[[r, 2 * p - 1 - r]].reshape(-1))
            continue
        pos = torch.arange(c, c + t, dtype=torch.int64)
        owner = (pos // block_size + b) % p
        for r in range(p):
            placed[r].append(pos[owner == r])
    return tuple(tuple(row) for row in placed)


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheStep:
    """Where the new tokens of one step go and what every rank holds after it; identical on
    every rank. New tokens are *packed*: a rank's rows of sequence 0, then 1, ..."""

    index: int
    """Steps begun before this one."""
    world_size: int
    """P."""
    zigzag: bool
    """The first prefill in the zigzag layout (the ordinary attention path)."""
    cached: tuple[int, ...]
    """C_b: tokens of each sequence cached before the step."""
    new: tuple[int, ...]
    """T_b: new tokens of each sequence."""
    new_positions: tuple[tuple[torch.Tensor, ...], ...]
    """``[rank][sequence]``: global positions of the new tokens the rank owns."""
    kv_positions: tuple[tuple[torch.Tensor, ...], ...]
    """``[rank][sequence]``: every position the rank caches after the step (new included)."""

    def seq_rows(self, rank: int) -> tuple[int, ...]:
        """How many new tokens of each sequence ``rank`` owns."""
        return tuple(len(x) for x in self.new_positions[rank])

    def num_rows(self, rank: int) -> int:
        """Packed new rows of ``rank``: the first dimension of its q, k, v."""
        return sum(self.seq_rows(rank))

    def positions(self, rank: int) -> torch.Tensor:
        """``(n,)`` packed global positions of ``rank``'s new rows (for RoPE, token lookup)."""
        parts = self.new_positions[rank]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class CachedStrategy(enum.Enum):
    """How new queries meet the cache; see Note [Cached strategies]."""

    PASS_Q = "pass_q"
    PASS_KV = "pass_kv"
    DIRECT = "direct"
    TREE = "tree"

    @classmethod
    def parse(cls, value: CachedStrategy | str) -> CachedStrategy:
        """Accept a member or its value; raise ValueError naming the options."""
        return parse_enum(cls, value, "strategy", also=" or 'auto'")


# -- who holds what ----------------------------------------------------------------------------
class CachedShards:
    """The input of every plan: ``[rank][sequence]`` increasing positions of the new tokens a
    rank owns (``q_positions``) and of all it caches (``kv_positions``, new included)."""

    def __init__(
        self,
        q_positions: Sequence[Sequence[torch.Tensor]],
        kv_positions: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        self.world_size = len(q_positions)
        self.num_seqs = len(q_positions[0]) if q_positions else 0
        if len(kv_positions) != self.world_size or any(
            len(x) != self.num_seqs for x in (*q_positions, *kv_positions)
        ):
            raise ValueError("q_positions and kv_positions must both be [rank][sequence]")
        self.q_positions = tuple(tuple(x) for x in q_positions)
        self.kv_positions = tuple(tuple(x) for x in kv_positions)
        self.q_seq_rows = tuple(tuple(len(x) for x in row) for row in self.q_positions)
        self.kv_seq_rows = tuple(tuple(len(x) for x in row) for row in self.kv_positions)
        self.q_rows = tuple(sum(row) for row in self.q_seq_rows)  # of each rank's Q block
        self.kv_rows = tuple(sum(row) for row in self.kv_seq_rows)  # of each rank's K/V shard
        self._splits: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}

    def split(self, q_owner: int, kv_owner: int) -> tuple[tuple[int, int], ...]:
        """Per sequence ``(n_full, n_stop)``: keys ``[0, n_full)`` are visible to every new
        query of the block, ``[n_full, n_stop)`` to some, the rest to none."""
        key = (q_owner, kv_owner)
        if key not in self._splits:
            parts = []
            for qpos, kpos in zip(
                self.q_positions[q_owner], self.kv_positions[kv_owner], strict=True
            ):
                if len(qpos) == 0 or len(kpos) == 0:
                    parts.append((0, 0))
                    continue
                bounds = torch.searchsorted(kpos, torch.stack([qpos[0], qpos[-1]]), right=True)
                parts.append((int(bounds[0]), int(bounds[1])))
            self._splits[key] = tuple(parts)
        return self._splits[key]

    def needs(self, q_owner: int, kv_owner: int) -> bool:
        """Whether any new query of ``q_owner`` sees a key of ``kv_owner``'s shard."""
        return any(stop > 0 for _, stop in self.split(q_owner, kv_owner))

    @classmethod
    def from_step(cls, step: CacheStep) -> CachedShards:
        """The shards of a ``tokenring.kvcache.CacheStep``."""
        return cls(step.new_positions, step.kv_positions)


UNIFORM_MAX_TOKENS = 1 << 27
"""The most tokens :func:`uniform_shards` places (about 4 GB and 10 s to plan)."""


def uniform_shards(
    *, world_size: int, batch: int, cached: int, new: int, block_size: int = 64
) -> CachedShards:
    """The shards of B sequences of ``cached`` tokens adding ``new``, placed block-cyclically
    as ``DistributedKVCache`` does (for planning without a cache).

    Raises:
        ValueError: a size not an int, or below 0 (1 for world_size, batch, block_size);
            more than UNIFORM_MAX_TOKENS tokens in all.
    """
    for name, value, low in (
        ("world_size", world_size, 1),
        ("batch", batch, 1),
        ("cached", cached, 0),
        ("new", new, 0),
        ("block_size", block_size, 1),
    ):
        check_size(name, value, low)
    if batch * (cached + new) > UNIFORM_MAX_TOKENS:
        raise ValueError(
            f"batch * (cached + new) must be at most {UNIFORM_MAX_TOKENS} (2**27) tokens to "
            f"plan: the plans keep every token's position, ~28 bytes a token (cached=10**9 "
            f"ran out of memory); got batch={batch}, cached={cached}, new={new}"
        )
    place = partial(place_new_tokens, world_size=world_size, block_size=block_size, zigzag=False)
    everything = place(cached=[0] * batch, new=[cached + new] * batch)  # placed alike
    return CachedShards(place(cached=[cached] * batch, new=[new] * batch), everything)


# -- plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CachedTransfer(Transfer):
    """A transfer carrying the blocks of ``owners`` (ascending), packed one after another;
    ``rows`` spans their total rows. ``step`` is the round."""

    owners: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class CachedPlan:
    """Who computes what in which round and what moves, for one strategy."""

    strategy: CachedStrategy
    world_size: int
    """P."""
    num_rounds: int
    """Rounds (slots ``(t, k)`` are posted in round order)."""
    computes: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    """``[rank][round]``: ``(q_owner, kv_owner)`` of each kernel block, in order."""
    transfers: tuple[CachedTransfer, ...]
    """Every transfer; ``step`` is its round, ``after_segments`` its slot in the round."""
    _memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)
    """What readers derive and keep while the plan lives (the ranks' programs)."""

    def merges(self, rank: int, q_owner: int) -> bool:
        """Whether ``rank`` merges its partial of ``q_owner``'s block into an accumulator (its
        own block; any in the tree) rather than sending it back."""
        return q_owner == rank or self.strategy is CachedStrategy.TREE


def _transfer(
    payload: Payload, src: int, dst: int, owners: Sequence[int], rows: int, round_: int, after: int
) -> CachedTransfer:
    owners = tuple(sorted(owners))
    return CachedTransfer(
        payload=payload,
        src=src,
        dst=dst,
        owner=owners[0],
        rows=(0, rows),
        step=round_,
        after_segments=after,
        owners=owners,
    )


def build_cached_plan(strategy: CachedStrategy | str, shards: CachedShards) -> CachedPlan:
    """The plan of ``strategy`` for ``shards``; see Note [Cached strategies].

    Raises:
        ValueError: unknown strategy.
    """
    strategy = CachedStrategy.parse(strategy)
    p = shards.world_size
    needs = [[shards.needs(o, j) for j in range(p)] for o in range(p)]
    num_rounds, computes, transfers = _PLANS[strategy](shards, needs)
    return CachedPlan(
        strategy=strategy,
        world_size=p,
        num_rounds=num_rounds,
        computes=tuple(tuple(row) for row in computes),
        transfers=tuple(transfers),
    )


_Computes = list[list[tuple[tuple[int, int], ...]]]  # [rank][round]: (q_owner, kv_owner) blocks
_Rounds = tuple[int, _Computes, list["CachedTransfer"]]  # (number of rounds, computes, transfers)


def _ring_plan(shards: CachedShards, needs: list[list[bool]], *, pass_q: bool) -> _Rounds:
    """Pass-Q or pass-KV: P rounds, the travelling block one rank down the ring each."""
    p = shards.world_size
    q_rows, kv_rows = shards.q_rows, shards.kv_rows
    transfers: list[CachedTransfer] = []
    computes: _Computes = [[() for _ in range(p)] for _ in range(p)]
    for r in range(p):
        for t in range(p):
            held = (r + t) % p  # the owner of the travelling block rank r holds in round t
            pair = (held, r) if pass_q else (r, held)
            if needs[pair[0]][pair[1]]:
                computes[r][t] = (pair,)
                if pass_q and held != r:
                    transfers.append(_transfer(Payload.OUT, r, held, [held], q_rows[held], t, 1))
            if t == p - 1:
                continue
            # The block of `held` sits on rank held - t; the ranks ahead are held - s.
            ahead = [(held - s) % p for s in range(t + 1, p)]
            wanted = any(needs[held][x] if pass_q else needs[x][held] for x in ahead)
            rows = q_rows[held] if pass_q else kv_rows[held]
            if wanted and rows:
                payload = Payload.Q if pass_q else Payload.KV
                transfers.append(_transfer(payload, r, (r - 1) % p, [held], rows, t, 0))
    return p, computes, transfers


def _direct_plan(shards: CachedShards, needs: list[list[bool]]) -> _Rounds:
    """Direct: every Q block to each rank that needs it, then every partial straight back."""
    p = shards.world_size
    q_rows = shards.q_rows
    transfers: list[CachedTransfer] = []
    num_rounds = 2 if p > 1 else 1
    computes: _Computes = [[((r, r),) if needs[r][r] else ()] for r in range(p)]
    for o in range(p):
        for j in range(p):
            if j != o and needs[o][j]:
                transfers.append(_transfer(Payload.Q, o, j, [o], q_rows[o], 0, 0))
    if p > 1:
        for r in range(p):
            order = [(r + s) % p for s in range(1, p)]
            mine = tuple((o, r) for o in order if needs[o][r])
            computes[r].append(mine)
            for k, (o, _) in enumerate(mine):
                transfers.append(_transfer(Payload.OUT, r, o, [o], q_rows[o], 1, k + 1))
    return num_rounds, computes, transfers


def _tree_plan(shards: CachedShards, needs: list[list[bool]]) -> _Rounds:
    """Tree: Q blocks broadcast down a binomial tree, partials reduced back up it."""
    p = shards.world_size
    q_rows = shards.q_rows
    transfers: list[CachedTransfer] = []
    depth = (p - 1).bit_length()  # ceil(log2 P)
    num_rounds = 2 * depth + 1
    computes: _Computes = [[() for _ in range(num_rounds)] for _ in range(p)]

    def wants(o: int, rel: int, level: int) -> bool:
        """Whether o's block has rows and a rank in the subtree of ``rel`` (joined in round
        ``level``) needs it."""
        return q_rows[o] > 0 and any(needs[o][(o + x) % p] for x in range(rel, p, 2 ** (level + 1)))

    for r in range(p):
        if needs[r][r]:
            computes[r][0] = ((r, r),)
        rel = [(r - o) % p for o in range(p)]  # r's place in each owner's tree
        for k in range(depth):
            step = 2**k
            # Broadcast round k: blocks with rel < 2^k go to r + 2^k.
            sent = [
                o for o in range(p) if rel[o] < step < p - rel[o] and wants(o, rel[o] + step, k)
            ]
            if sent:
                rows = sum(q_rows[o] for o in sent)
                transfers.append(_transfer(Payload.Q, r, (r + step) % p, sent, rows, k, 0))
            # Computed in round k + 1: the blocks received in round k.
            got = [o for o in range(p) if step <= rel[o] < 2 * step and wants(o, rel[o], k)]
            computes[r][k + 1] = tuple((o, r) for o in got if needs[o][r])
            # Reduce: level k runs in round depth + 1 + (depth - 1 - k); ranks that joined
            # in broadcast round k send their merged partials back to r - 2^k.
            if got:
                rows = sum(q_rows[o] for o in got)
                reduce_round = 2 * depth - k
                transfers.append(
                    _transfer(Payload.OUT, r, (r - step) % p, got, rows, reduce_round, 0)
                )
    return num_rounds, computes, transfers


_PLANS: dict[CachedStrategy, Callable[[CachedShards, list[list[bool]]], _Rounds]] = {
    CachedStrategy.PASS_Q: partial(_ring_plan, pass_q=True),
    CachedStrategy.PASS_KV: partial(_ring_plan, pass_q=False),
    CachedStrategy.DIRECT: _direct_plan,
    CachedStrategy.TREE: _tree_plan,
}
