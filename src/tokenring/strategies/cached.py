"""Schedules of attention against a sharded KV cache, their costs, and the choice among them.

This module owns *what happens* when T new tokens per sequence attend to a cache sharded over
the ranks (``tokenring.kvcache``): which rank computes which new queries against which shard
in which round, and which transfers carry what, as plain data (:class:`CachedPlan`). The
runtime (``tokenring.inference``) executes each rank's program of the plan
(``tokenring.runtime.program.cached_program``); :func:`predict_cached` prices the very same
programs with the simulator's event engine on a ``tokenring.model.costmodel.Hardware``, and
:func:`choose_cached_strategy` picks the cheapest. Nothing here touches process groups.

Legend: B sequences, T new tokens and C cached tokens of a sequence, P world size, Hq / Hkv
query / key-value heads, D head dim, e bytes per element, a bytes per accumulator element
(4; 8 for float64), o the owner of a block of new queries, j the holder of a K/V shard, r a
rank, t a round. A rank's new queries of all sequences form one *Q block* (packed rows); its
cached K/V of all sequences form one *K/V shard*.

Note [Cached strategies]
~~~~~~~~~~~~~~~~~~~~~~~~
Every new token is owned by the rank that caches it (``kvcache`` Note [Placement]), so K/V
never move to be appended; only attention moves data::

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

Blocks nobody needs are not sent: a Q block goes on only while a rank ahead has a key it can
see, and a rank computes (and returns) only a block with a visible key. ``direct`` and
``tree`` are pass-Q too; they trade the ring's P - 1 hops for one round (``direct``: the
owner's link carries P - 1 copies) or log P rounds (``tree``: one copy per link and round),
which is what decode (T of 1 to a few) needs.

Binomial tree of owner o, P = 6 (3 levels, rounds 0-6), rel = (r - o) mod P::

    broadcast  round 0: rel 0 -> 1      round 1: 0 -> 2, 1 -> 3     round 2: 0 -> 4, 1 -> 5
    compute    round 0: rel 0           round 1: 1    round 2: 2, 3    round 3: 4, 5
    reduce     round 4: 4 -> 0, 5 -> 1  round 5: 2 -> 0, 3 -> 1     round 6: 1 -> 0

In broadcast round k a rank sends every block it holds with rel < 2^k to r + 2^k, so all
owners' trees use the same pair in a round and share one message; the reduce mirrors it.
Rank r computes its own block in round 0 and the blocks that arrived in round k - 1 in round
k, overlapping the next hop.

Note [Pass-Q or pass-KV]
~~~~~~~~~~~~~~~~~~~~~~~~
In a steady ring round with the new tokens and the cache spread evenly, a rank sends::

    pass_q    Q (T/P rows x Hq*D*e) on one direction, a partial (T/P rows x (Hq*D*e + Hq*a))
              on the other: busiest direction T/P * Hq * (D*e + a)
    pass_kv   its shard ((T+C)/P rows x 2*Hkv*D*e)

so pass-Q moves fewer bytes on its busiest direction exactly when::

    T / (T + C)  <  2 * Hkv * D * e / (Hq * (D*e + a))  =  pass_q_threshold(...)

which is Meta's context-parallel inference criterion (T/(T+P) < 2 * Hkv / Hq, with their P
our C) with the lse that rides along each partial. MHA: about 2, so pass-Q always (for C >=
0); Llama-3 GQA 32/8: about 1/2. Where the kernel is slower than the links neither matters
and the exposed tail (pass-Q's last return) decides; :func:`choose_cached_strategy` compares
the simulated calls, not just this ratio.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenring.core.enums import parse_enum
from tokenring.core.schedule import AttentionShape, Flow, Payload, Transfer, dtype_name
from tokenring.kvcache import CacheStep, place_new_tokens
from tokenring.model.costmodel import Hardware, preset
from tokenring.model.simulate import simulate_cached

__all__ = [
    "CachedChoice",
    "CachedPlan",
    "CachedPrediction",
    "CachedShards",
    "CachedStrategy",
    "CachedTransfer",
    "build_cached_plan",
    "choose_cached_strategy",
    "explain_cached",
    "pass_q_threshold",
    "predict_cached",
    "uniform_shards",
]


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
    """New query positions and cached key positions of every rank: the input of every plan.

    Args:
        q_positions: ``[rank][sequence]`` increasing positions of the new tokens a rank owns.
        kv_positions: ``[rank][sequence]`` increasing positions a rank caches (new included).
    """

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
        self.q_rows = tuple(sum(row) for row in self.q_seq_rows)
        """Rows of each rank's Q block."""
        self.kv_rows = tuple(sum(row) for row in self.kv_seq_rows)
        """Rows of each rank's K/V shard."""
        self._splits: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}

    def split(self, q_owner: int, kv_owner: int) -> tuple[tuple[int, int], ...]:
        """Per sequence ``(n_full, n_stop)``: keys ``[0, n_full)`` of the shard are visible to
        every new query of the block, ``[n_full, n_stop)`` to some (masked), the rest to none.
        """
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


def uniform_shards(
    *, world_size: int, batch: int, cached: int, new: int, block_size: int = 64
) -> CachedShards:
    """The shards of B sequences that each hold ``cached`` tokens and add ``new``, placed
    block-cyclically as ``DistributedKVCache`` places them (for planning without a cache).

    Raises:
        ValueError: a size below 0 (1 for world_size, batch, block_size).
    """
    for name, value, low in (
        ("world_size", world_size, 1),
        ("batch", batch, 1),
        ("cached", cached, 0),
        ("new", new, 0),
        ("block_size", block_size, 1),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}; got {value}")
    old = place_new_tokens(
        cached=[0] * batch,
        new=[cached] * batch,
        world_size=world_size,
        block_size=block_size,
        zigzag=False,
    )
    fresh = place_new_tokens(
        cached=[cached] * batch,
        new=[new] * batch,
        world_size=world_size,
        block_size=block_size,
        zigzag=False,
    )
    kv = [
        [torch.cat([a, b]) for a, b in zip(old_r, new_r, strict=True)]
        for old_r, new_r in zip(old, fresh, strict=True)
    ]
    return CachedShards(fresh, kv)


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
    """Which strategy."""
    world_size: int
    """P."""
    num_rounds: int
    """Rounds (slots ``(t, k)`` are posted in round order)."""
    computes: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    """``[rank][round]``: ``(q_owner, kv_owner)`` of each kernel block, in order."""
    transfers: tuple[CachedTransfer, ...]
    """Every transfer; ``step`` is its round, ``after_segments`` its slot in the round."""
    _memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)
    """What readers derive from the plan and keep while it lives (the ranks' programs)."""

    def merges(self, rank: int, q_owner: int) -> bool:
        """Whether ``rank`` merges its partial of ``q_owner``'s block into an accumulator
        (its own block; any in the tree, whose partials go up merged) rather than sending it
        back as computed."""
        return q_owner == rank or self.strategy is CachedStrategy.TREE


def _transfer(
    payload: Payload,
    src: int,
    dst: int,
    owners: Sequence[int],
    num_rows: int,
    round_: int,
    after: int,
) -> CachedTransfer:
    owners = tuple(sorted(owners))
    return CachedTransfer(
        payload=payload,
        src=src,
        dst=dst,
        owner=owners[0],
        rows=(0, num_rows),
        step=round_,
        after_segments=after,
        owners=owners,
    )


def _tree_depth(world_size: int) -> int:
    return max(0, math.ceil(math.log2(world_size))) if world_size > 1 else 0


def _subtree(rel: int, level: int, world_size: int) -> range:
    """Relative ranks below (and including) node ``rel`` that joined the tree in round
    ``level``: rel + m * 2^(level+1) (see Note [Cached strategies])."""
    return range(rel, world_size, 2 ** (level + 1))


def build_cached_plan(strategy: CachedStrategy | str, shards: CachedShards) -> CachedPlan:
    """The plan of ``strategy`` for ``shards``; see Note [Cached strategies].

    Raises:
        ValueError: unknown strategy.
    """
    strategy = CachedStrategy.parse(strategy)
    p = shards.world_size
    needs = [[shards.needs(o, j) for j in range(p)] for o in range(p)]
    if strategy in (CachedStrategy.PASS_Q, CachedStrategy.PASS_KV):
        rounds = _ring_plan(strategy is CachedStrategy.PASS_Q, shards, needs)
    elif strategy is CachedStrategy.DIRECT:
        rounds = _direct_plan(shards, needs)
    else:
        rounds = _tree_plan(shards, needs)
    num_rounds, computes, transfers = rounds
    return CachedPlan(
        strategy=strategy,
        world_size=p,
        num_rounds=num_rounds,
        computes=tuple(tuple(row) for row in computes),
        transfers=tuple(transfers),
    )


_Computes = list[list[tuple[tuple[int, int], ...]]]
"""computes[rank][round]: the (q_owner, kv_owner) blocks a rank computes in a round."""
_Rounds = tuple[int, _Computes, list["CachedTransfer"]]
"""What a strategy's planner returns: the number of rounds, the computes, the transfers."""


def _ring_plan(pass_q: bool, shards: CachedShards, needs: list[list[bool]]) -> _Rounds:
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
    depth = _tree_depth(p)
    num_rounds = 2 * depth + 1
    computes: _Computes = [[() for _ in range(num_rounds)] for _ in range(p)]

    def subtree_needs(o: int, rel: int, level: int) -> bool:
        return any(needs[o][(o + x) % p] for x in _subtree(rel, level, p))

    for r in range(p):
        if needs[r][r]:
            computes[r][0] = ((r, r),)
        for k in range(depth):
            step = 2**k
            # Broadcast round k: blocks with rel < 2^k go to r + 2^k.
            sent = [
                o
                for o in range(p)
                if (r - o) % p < step
                and (r - o) % p + step < p
                and q_rows[o] > 0
                and subtree_needs(o, (r - o) % p + step, k)
            ]
            if sent:
                rows = sum(q_rows[o] for o in sent)
                transfers.append(_transfer(Payload.Q, r, (r + step) % p, sent, rows, k, 0))
            # Computed in round k + 1: the blocks received in round k.
            got = [
                o
                for o in range(p)
                if step <= (r - o) % p < 2 * step
                and q_rows[o] > 0
                and subtree_needs(o, (r - o) % p, k)
            ]
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


# -- costs ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CachedPrediction:
    """The simulator's price of one plan (:func:`predict_cached`)."""

    strategy: CachedStrategy
    """Which strategy."""
    total_s: float
    """Predicted time of the call: the last rank's end."""
    compute_s: float
    """The busiest rank's kernels and merges."""
    wire_s: float
    """The busiest link or port: its bytes over its bandwidth."""
    travel_bytes: int
    """Most bytes one rank sends on the travel flow (Q or K/V)."""
    return_bytes: int
    """Most bytes one rank sends on the return flow (partials)."""

    @property
    def bound_by(self) -> str:
        """``compute`` or ``comm``: the larger of the busiest rank's work and the busiest
        link's."""
        return "compute" if self.compute_s >= self.wire_s else "comm"


def predict_cached(
    plan: CachedPlan,
    shards: CachedShards,
    *,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    hardware: Hardware,
) -> CachedPrediction:
    """Price ``plan`` with the simulator's event engine, which replays the program each rank
    runs (``tokenring.model.simulate.simulate_cached``), charging ``hardware.kernel_call_s``
    per kernel call.

    Raises:
        ValueError: bad head counts, an unknown dtype, or one the hardware has no FLOP/s for.
    """
    dims = AttentionShape(
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype_name(dtype)
    )
    total_s, compute_s, wire_s, _ = simulate_cached(plan, shards, shape=dims, hardware=hardware)
    p = plan.world_size
    sent = {Flow.TRAVEL: [0] * p, Flow.RETURN: [0] * p}
    for tr in plan.transfers:
        sent[tr.payload.flow][tr.src] += tr.num_bytes(dims)
    return CachedPrediction(
        strategy=plan.strategy,
        total_s=total_s,
        compute_s=compute_s,
        wire_s=wire_s,
        travel_bytes=max(sent[Flow.TRAVEL]),
        return_bytes=max(sent[Flow.RETURN]),
    )


# -- the decision --------------------------------------------------------------------------------
def pass_q_threshold(
    *, heads_q: int, heads_kv: int, head_dim: int, elem_bytes: int, acc_bytes: int = 4
) -> float:
    """The new-token fraction T/(T+C) below which pass-Q's busiest direction carries fewer
    bytes than pass-KV's; see Note [Pass-Q or pass-KV].

    Returns:
        ``2 * Hkv * D * e / (Hq * (D * e + a))``.
    """
    return 2 * heads_kv * head_dim * elem_bytes / (heads_q * (head_dim * elem_bytes + acc_bytes))


@dataclass(frozen=True, kw_only=True, slots=True)
class CachedChoice:
    """What :func:`choose_cached_strategy` returns."""

    pick: CachedStrategy
    """The fastest predicted strategy."""
    predictions: tuple[CachedPrediction, ...]
    """Every candidate, in ``CachedStrategy`` order."""
    reason: str
    """One sentence: the times, the bytes and the threshold."""


def choose_cached_strategy(
    shards: CachedShards,
    *,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    hardware: Hardware,
    candidates: Sequence[CachedStrategy | str] | None = None,
) -> CachedChoice:
    """Predict every candidate plan (:func:`predict_cached`) and pick the fastest.

    Deterministic: ties (within a relative 1e-9) go to the earlier strategy in
    ``CachedStrategy`` order, so every rank picks the same from the same inputs.

    Raises:
        ValueError: bad sizes, no candidates, or a dtype the hardware has no FLOP/s for.
    """
    chosen = (
        {CachedStrategy.parse(c) for c in candidates}
        if candidates is not None
        else set(CachedStrategy)
    )
    if not chosen:
        raise ValueError("candidates must name at least one strategy; got none")
    predictions = tuple(
        predict_cached(
            build_cached_plan(s, shards),
            shards,
            heads_q=heads_q,
            heads_kv=heads_kv,
            head_dim=head_dim,
            dtype=dtype,
            hardware=hardware,
        )
        for s in CachedStrategy
        if s in chosen
    )
    best = predictions[0]
    for cand in predictions[1:]:
        if cand.total_s < best.total_s * (1 - 1e-9):
            best = cand
    dims = AttentionShape(
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype_name(dtype)
    )
    new = sum(shards.q_rows)
    total = sum(shards.kv_rows)
    fraction = new / total if total else 1.0
    threshold = pass_q_threshold(
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        elem_bytes=dims.elem_bytes,
        acc_bytes=dims.acc_bytes,
    )
    times = ", ".join(f"{p.strategy.value} {1e3 * p.total_s:.3g} ms" for p in predictions)
    reason = (
        f"{best.strategy.value} predicted fastest on {hardware.name} ({times}); new-token "
        f"fraction T/(T+C) = {fraction:.3f} vs pass-Q threshold {threshold:.3f} "
        f"(2*Hkv*D*e / (Hq*(D*e+a))); {best.strategy.value} is {best.bound_by}-bound"
    )
    return CachedChoice(pick=best.strategy, predictions=predictions, reason=reason)


def explain_cached(
    *,
    world_size: int,
    cached: int,
    new: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    hardware: Hardware | str,
    batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 64,
    candidates: Sequence[CachedStrategy | str] | None = None,
) -> CachedChoice:
    """The pick for B sequences of ``cached`` tokens each adding ``new`` (block-cyclic, as the
    cache places them) on ``hardware`` (a ``Hardware`` or a preset name).

    Raises:
        ValueError: as :func:`uniform_shards` and :func:`choose_cached_strategy`, or an
            unknown preset.
    """
    hw = preset(hardware) if isinstance(hardware, str) else hardware
    shards = uniform_shards(
        world_size=world_size, batch=batch, cached=cached, new=new, block_size=block_size
    )
    return choose_cached_strategy(
        shards,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=dtype,
        hardware=hw,
        candidates=candidates,
    )
