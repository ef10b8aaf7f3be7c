"""Attention of new tokens against the sharded KV cache: prefill with a cache, and decode.

This module owns :func:`cached_attn` and the runtime of the cached schedules
(``tokenring.strategies.cached``): append the new K/V, pick a strategy, execute its plan.

Legend: B sequences, n packed new rows of this rank (sequence 0's, then sequence 1's, ...:
``CacheStep.seq_rows``), Hq / Hkv heads, D head dim, P world size, o the owner of a Q block,
j the holder of a K/V shard. q is ``(n, Hq, D)``, lse ``(Hq, n)`` (flash-attention's varlen).

Note [Cached attention call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    1. append   this rank's new K/V go into its own shard (their owner caches them)
    2. choose   "auto": the simulated plans (model.planner.choose_cached_strategy) on the
                given hardware, once per step (every layer reuses it)
    3. run      zigzag first prefill + pass_q / pass_kv: sequence_parallel_attn
                (token_ring / ring, causal, zigzag); otherwise the plan's rank program
                (tokenring.runtime.program.cached_program) through the one executor

A Q block against a shard takes at most two kernel calls per sequence: the keys every query
sees (up to the block's first query) without a mask, and the keys up to its last query with a
position mask (later keys skipped); the partials merge by lse, so no mask grows with the cache.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenring.api import (
    AUTO_NEEDS_HARDWARE,
    autocast_hint,
    check_flags,
    check_hardware_use,
    check_softmax_scale,
    last_block_splits_for,
    refuse_tangents,
    sequence_parallel_attn,
)
from tokenring.core.merge import merge_into
from tokenring.core.schedule import Payload, Strategy, Transfer
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import Hardware, preset
from tokenring.model.planner import choose_cached_strategy, choose_zigzag_prefill
from tokenring.runtime.comm import Communicator, FieldSpec
from tokenring.runtime.executor import PassRunner, execute
from tokenring.runtime.kernels import BlockKernel, accumulation_dtype, select_kernel
from tokenring.runtime.program import Op, cached_program
from tokenring.runtime.slots import SlotPoster
from tokenring.strategies.cached import (
    CachedPlan,
    CachedShards,
    CachedStrategy,
    CachedTransfer,
    CacheStep,
    build_cached_plan,
)

__all__ = ["attend_cached", "cached_attn", "resolve_cached_strategy", "run_cached_plan"]


# -- the runtime ---------------------------------------------------------------------------------
@dataclass(eq=False)
class _PlanRunner(PassRunner):
    """One rank's part of a :class:`CachedPlan` (Note [Rank program] in
    tokenring.runtime.program)."""

    plan: CachedPlan
    shards: CachedShards
    comm: Communicator
    kernel: BlockKernel
    q: torch.Tensor  # (n, Hq, D) this rank's packed new queries
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per sequence, its cached (k, v)
    scale: float
    poster: SlotPoster = field(init=False)

    def __post_init__(self) -> None:
        q, kv, comm = self.q, self.kv, self.comm
        self.rank = comm.rank
        self.dtype, self.device = q.dtype, q.device
        self.acc = accumulation_dtype(q.dtype)
        self.heads_q, self.head_dim = q.shape[1], q.shape[2]
        self.heads_kv = kv[0][0].shape[1] if kv else 1
        self.q_blocks: dict[int, torch.Tensor] = {self.rank: q}  # owner -> (n_o, Hq, D)
        self.kv_blocks: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {self.rank: list(kv)}
        self.kv_packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # holder -> (k, v)
        self.partial: tuple[torch.Tensor, torch.Tensor] | None = None  # the last one computed
        self.accs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # owner -> (1,n,H,D),(1,H,n)
        self.poster = SlotPoster(comm, self._fields, self.device)
        self._acc(self.rank)

    @property
    def range_prefix(self) -> str:
        return f"tokenring.cached.{self.plan.strategy.value}.round"

    # -- messages ------------------------------------------------------------------------------
    def _fields(self, tr: Transfer) -> list[FieldSpec]:
        n, hq, hkv, d = tr.num_rows, self.heads_q, self.heads_kv, self.head_dim
        if tr.payload is Payload.Q:
            return [((n, hq, d), self.dtype)]
        if tr.payload is Payload.KV:
            return [((n, hkv, d), self.dtype)] * 2
        return [((n, hq, d), self.dtype), ((hq, n), self.acc)]

    def provide(self, tr: Transfer) -> list[torch.Tensor]:
        assert isinstance(tr, CachedTransfer)
        if tr.payload is Payload.Q:  # forwarded blocks arrived in an earlier round
            blocks = [self.q_blocks[o] for o in tr.owners]
            return [blocks[0] if len(blocks) == 1 else torch.cat(blocks)]
        if tr.payload is Payload.KV:
            (j,) = tr.owners
            if j not in self.kv_packed:
                k, v = (torch.cat(blocks) for blocks in zip(*self.kv_blocks[j], strict=True))
                self.kv_packed[j] = (k, v)
            return list(self.kv_packed[j])
        if not self.plan.merges(self.rank, tr.owner):  # the block just computed
            assert self.partial is not None
            return list(self.partial)
        outs = [self.accs[o][0][0].to(self.dtype) for o in tr.owners]  # merged: tree
        lses = [self.accs[o][1][0] for o in tr.owners]
        return [torch.cat(outs), torch.cat(lses, dim=1)]

    def arrive(self, op: Op) -> None:
        """ARRIVE: the Q blocks and K/V shards of a round, unpacked by owner."""
        for tr in op.transfers:
            assert isinstance(tr, CachedTransfer)
            tensors = self.poster.pending.pop(tr).wait()
            if tr.payload is Payload.Q:
                rows = [self.shards.q_rows[o] for o in tr.owners]
                for o, block in zip(tr.owners, tensors[0].split(rows), strict=True):
                    self.q_blocks[o] = block
            else:
                (j,) = tr.owners
                k, v = tensors
                self.kv_packed[j] = (k, v)
                sizes = self.shards.kv_seq_rows[j]
                self.kv_blocks[j] = list(zip(k.split(sizes), v.split(sizes), strict=True))

    # -- compute and merge ---------------------------------------------------------------------
    def _acc(self, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
        if owner not in self.accs:
            self.accs[owner] = self._empty(self.shards.q_rows[owner])
        return self.accs[owner]

    def _empty(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A partial no key has reached: out 0 ``(1, n, Hq, D)``, lse -inf ``(1, Hq, n)``."""
        out = torch.zeros(1, n, self.heads_q, self.head_dim, dtype=self.acc, device=self.device)
        lse = torch.full((1, self.heads_q, n), -math.inf, dtype=self.acc, device=self.device)
        return out, lse

    def compute(self, op: Op) -> None:
        """COMPUTE: block ``op.index`` of round ``op.step``, merged here or kept to be sent."""
        o, j = self.plan.computes[self.rank][op.step][op.index]
        out, lse = self._attend(o, j)
        if self.plan.merges(self.rank, o):
            acc_out, acc_lse = self._acc(o)
            merge_into(acc_out, acc_lse, (0, out.shape[1]), out, lse)
        else:
            self.partial = (out[0].to(self.dtype), lse[0])

    def _attend(self, q_owner: int, kv_holder: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_owner``'s block against ``kv_holder``'s shard: ``(1, n_o, Hq, D)``, ``(1, Hq,
        n_o)`` in the accumulation dtype (Note [Cached attention call])."""
        q, kv = self.q_blocks[q_owner], self.kv_blocks[kv_holder]
        out, lse = self._empty(q.shape[0])
        qpos_all = self.shards.q_positions[q_owner]
        kpos_all = self.shards.kv_positions[kv_holder]
        starts = [0, *itertools.accumulate(self.shards.q_seq_rows[q_owner])]  # packed rows of b
        for b, (full, stop) in enumerate(self.shards.split(q_owner, kv_holder)):
            rows = (starts[b], starts[b + 1])
            if rows[0] == rows[1] or stop == 0:
                continue
            qb = q[rows[0] : rows[1]].unsqueeze(0)  # (1, t, Hq, D)
            kb, vb = kv[b]
            masked = None
            if stop > full:  # (t, stop - full)
                masked = (kpos_all[b][full:stop][None] <= qpos_all[b][:, None]).to(self.device)
            pieces = [
                self.kernel.forward(
                    qb, kb[lo:hi][None], vb[lo:hi][None], causal=False, scale=self.scale, mask=mask
                )
                for lo, hi, mask in ((0, full, None), (full, stop, masked))
                if hi > lo
            ]
            if len(pieces) == 1:
                out[:, rows[0] : rows[1]] = pieces[0][0]
                lse[:, :, rows[0] : rows[1]] = pieces[0][1]
            else:
                for part_out, part_lse in pieces:
                    merge_into(out, lse, rows, part_out, part_lse)
        return out, lse

    def returns(self, op: Op) -> None:
        """RETURNS: wait for the partials ``op`` names and merge them by owner."""
        for tr in op.transfers:
            assert isinstance(tr, CachedTransfer)
            out, lse = self.poster.pending.pop(tr).wait()
            sizes = [self.shards.q_rows[o] for o in tr.owners]
            parts = zip(out.split(sizes), lse.split(sizes, dim=1), strict=True)
            for o, (part_out, part_lse) in zip(tr.owners, parts, strict=True):
                rows = (0, part_out.shape[0])
                merge_into(*self._acc(o), rows, part_out.unsqueeze(0), part_lse.unsqueeze(0))


def run_cached_plan(
    plan: CachedPlan,
    shards: CachedShards,
    comm: Communicator,
    kernel: BlockKernel,
    q: torch.Tensor,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute this rank's part of ``plan``.

    Args:
        q: ``(n, Hq, D)`` this rank's packed new queries (``shards.q_rows[rank]`` rows).
        kv: per sequence, this rank's cached ``(k, v)``, each ``(n_b, Hkv, D)`` in the order of
            ``shards.kv_positions[rank][b]``.

    Returns:
        out ``(n, Hq, D)`` in q's dtype and lse ``(Hq, n)`` in the accumulation dtype (-inf and
        out 0 for a query that sees no key).
    """
    runner = _PlanRunner(plan, shards, comm, kernel, q, kv, scale)
    execute(cached_program(plan, comm.rank), runner)
    assert not runner.poster.pending, "every receive of the plan must have been consumed"
    out, lse = runner.accs[comm.rank]
    return out[0].to(q.dtype), lse[0]


# -- choosing ------------------------------------------------------------------------------------
def resolve_cached_strategy(
    strategy: CachedStrategy | str,
    *,
    step: CacheStep,
    comm: Communicator,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    hardware: Hardware | str | None = None,
) -> CachedStrategy:
    """``strategy`` itself, or for ``"auto"`` the cheapest simulated plan on ``hardware`` (a
    ``Hardware`` or a preset name); a zigzag first prefill asks the training planner, as it
    runs on the ordinary path, for TokenRing and Ring as :func:`attend_cached` runs them
    (TokenRing returning its last pair, in the slices the communicator's path takes). Pure:
    no communication.

    Raises:
        ValueError: ``"auto"`` without ``hardware`` (Note [Calibration is passed in] in
            tokenring.api), or ``hardware`` with another strategy (it would price nothing).
    """
    if strategy != "auto":
        check_hardware_use(strategy, hardware)
        return CachedStrategy.parse(strategy)
    if hardware is None:
        raise ValueError(AUTO_NEEDS_HARDWARE)
    shape: dict[str, Any] = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype)
    shape["hardware"] = preset(hardware) if isinstance(hardware, str) else hardware
    if step.zigzag:  # what attend_cached runs: the default last pair and slices
        b = len(step.new)
        return choose_zigzag_prefill(
            **shape,
            world_size=step.world_size,
            seq_local=step.num_rows(comm.rank) // b,
            batch=b,
            last_block_splits=last_block_splits_for(comm.path(device)),
        ).pick
    return choose_cached_strategy(CachedShards.from_step(step), **shape).pick


def step_strategy(
    strategy: CachedStrategy | str,
    cache: DistributedKVCache,
    *,
    heads_q: int,
    hardware: Hardware | str | None,
) -> CachedStrategy:
    """:func:`resolve_cached_strategy` for the current step of ``cache`` (its group, K/V heads,
    head dim, dtype and device)."""
    assert cache.step is not None and cache.comm is not None
    shape = {name: getattr(cache, name) for name in ("heads_kv", "head_dim", "dtype", "device")}
    return resolve_cached_strategy(
        strategy, step=cache.step, comm=cache.comm, heads_q=heads_q, hardware=hardware, **shape
    )


def _step_strategy_memo(
    strategy: CachedStrategy | str,
    cache: DistributedKVCache,
    *,
    heads_q: int,
    hardware: Hardware | str | None,
) -> CachedStrategy:
    """:func:`step_strategy`, once per step (every layer reuses it)."""
    # by value, as the ranks agree on it: an id would outlive a freed hardware and hand its
    # pick to the next one allocated at the same address
    key = ("strategy", str(strategy), repr(hardware))
    if key not in cache.memo:
        cache.memo[key] = step_strategy(strategy, cache, heads_q=heads_q, hardware=hardware)
    chosen: CachedStrategy = cache.memo[key]
    return chosen


# -- the public call -----------------------------------------------------------------------------
def _validate(
    q: torch.Tensor, cache: DistributedKVCache, layer: int, softmax_scale: float | None
) -> CacheStep:
    if not isinstance(cache, DistributedKVCache):
        raise ValueError(f"cache must be a DistributedKVCache; got {type(cache).__name__}")
    if cache.comm is None:
        raise ValueError(
            "cache must be built with a process group (group=...) to run attention; got one "
            "built with rank= and world_size= only"
        )
    step = cache.step
    if step is None:
        raise ValueError("no cache step has begun; call cache.begin_step(new) first")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer must be an int in [0, {cache.num_layers}); got {layer!r}")
    if cache.appended(layer):
        raise ValueError(
            f"layer {layer} has already run attention in step {step.index}; call "
            "cache.begin_step for the next tokens"
        )
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be a (rows, heads_q, head_dim) tensor; got {shape}")
    n = step.num_rows(cache.rank)
    if q.shape[0] != n or q.shape[2] != cache.head_dim:
        raise ValueError(
            f"q must have shape (rows={n}, heads_q, head_dim={cache.head_dim}) (this rank's "
            f"new rows of step {step.index}); got {tuple(q.shape)}"
        )
    if q.shape[1] < 1 or q.shape[1] % cache.heads_kv:
        raise ValueError(
            f"heads_kv must divide heads_q; got heads_q={q.shape[1]}, heads_kv={cache.heads_kv}"
        )
    if q.dtype != cache.dtype or q.device != cache.device:
        raise ValueError(
            f"q must be {cache.dtype} on {cache.device} like the cache; got {q.dtype} on "
            f"{q.device}{autocast_hint(q.device)}"
        )
    check_softmax_scale(softmax_scale)
    return step


def _call_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: DistributedKVCache,
    layer: int,
    strategy: CachedStrategy | str,
    softmax_scale: float | None,
    hardware: Hardware | str | None,
    kernel: str | BlockKernel | None,
    return_lse: bool,
    *,
    check_ranks: bool = True,
) -> tuple[tuple[CachedStrategy | str, BlockKernel], dict[str, Any]]:
    """Check a :func:`cached_attn` call: (strategy or ``"auto"``, kernel) and the signature."""
    # here: a rank's bad flag reaches its peers at once
    check_flags(return_lse=return_lse, check_ranks=check_ranks)
    step = _validate(q, cache, layer, softmax_scale)
    refuse_tangents({"q": q, "k": k, "v": v})  # Note [Forward-mode AD] in tokenring.api
    if torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)
    ):
        raise ValueError(
            "cached_attn computes no gradients (its plans merge partials outside autograd); got "
            "q, k or v requiring grad with grad mode on: call it under torch.no_grad() or "
            "torch.inference_mode(), or train with tokenring.sequence_parallel_attn"
        )
    strategy = strategy if strategy == "auto" else CachedStrategy.parse(strategy)
    check_hardware_use(strategy, hardware)
    block_kernel = select_kernel(q.device, q.dtype, kernel)
    cache.check_append(layer, k, v)
    if hardware is None and strategy == "auto":  # after the arguments' own errors
        raise ValueError(AUTO_NEEDS_HARDWARE)
    # before the append: a hardware that cannot price this call fails with the cache unchanged
    _step_strategy_memo(strategy, cache, heads_q=q.shape[1], hardware=hardware)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    signature = {
        "step": step.index,
        "layer": layer,
        # which cache: ranks that call another cache here would mix shards of both; and what
        # its step's placement follows (Note [Placement]), so every rank's plan is the same
        "cache": {
            "num_layers": cache.num_layers,
            "heads_kv": cache.heads_kv,
            "head_dim": cache.head_dim,
            "dtype": str(cache.dtype),
            "block_size": cache.block_size,
            "lengths": list(cache.lengths),
            "new tokens": list(step.new),
            "zigzag": step.zigzag,
        },
        "heads_q": q.shape[1],
        "strategy": strategy if isinstance(strategy, str) else strategy.value,
        "hardware": None if hardware is None else repr(hardware),
        "softmax_scale": float(scale).hex(),
        "kernel": block_kernel.name,
    }
    return (strategy, block_kernel), signature


CACHED_CALL = "cached attention call"
"""The rank check that opens every :func:`cached_attn` call, by its name in messages."""


def cached_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: DistributedKVCache,
    layer: int,
    strategy: CachedStrategy | str = "auto",
    softmax_scale: float | None = None,
    hardware: Hardware | str | None = None,
    kernel: str | BlockKernel | None = None,
    return_lse: bool = False,
    check_ranks: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this step's new tokens against everything cached before them and
    themselves (Note [Cached attention call]). Call it once per layer and step on every rank,
    after ``cache.begin_step(new)``; prefill and decode are the same call.

    Args:
        q: ``(n, Hq, D)`` this rank's packed new queries (positions:
            ``cache.step.positions(rank)``).
        k, v: ``(n, Hkv, D)`` their keys and values (appended to the cache here).
        cache: the cache; its group runs the attention.
        layer: which layer's cache.
        strategy: ``"pass_q"``, ``"pass_kv"``, ``"direct"``, ``"tree"`` (Note [Cached
            strategies] in tokenring.strategies.cached) or ``"auto"``; the same on every rank.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        hardware: needed by ``"auto"``: a ``Hardware`` or a preset name (Note [Calibration is
            passed in] in tokenring.api).
        kernel: block kernel name or instance; None picks one for the device and dtype.
        return_lse: also return lse ``(Hq, n)`` (float32; float64 for float64 inputs).
        check_ranks: agree on the call first (Note [Rank agreement] in tokenring.api).

    Returns:
        out ``(n, Hq, D)`` in q's dtype, or ``(out, lse)`` with ``return_lse``.

    Raises:
        ValueError: no step begun, a layer out of range or already run this step, shapes,
            dtype or device that do not match the cache and the step, an unknown strategy or
            kernel, a bad softmax_scale, "auto" without hardware, a non-bool flag; q, k or v
            requiring grad in grad mode (no gradients are computed).
    """
    if not isinstance(cache, DistributedKVCache) or cache.comm is None:
        _validate(q, cache, layer, softmax_scale)  # raises: no group to agree over
    assert cache.comm is not None
    refuse_tangents({"q": q, "k": k, "v": v}, before_exchange=True)  # Note [Forward-mode AD]
    args = (q, k, v, cache, layer, strategy, softmax_scale, hardware, kernel, return_lse)
    validate = functools.partial(_call_signature, *args, check_ranks=check_ranks)
    # a check_ranks that is not a bool is validate's error: its rank tells the others (as
    # sequence_parallel_attn's), who would otherwise wait for it in the rank check
    strategy, block_kernel = cache.comm.agreed(  # before appending: every rank or none
        validate, what=CACHED_CALL, check_ranks=check_ranks is not False
    )
    cache.append(layer, k, v)
    options: dict[str, Any] = dict(
        softmax_scale=softmax_scale, hardware=hardware, kernel=block_kernel
    )
    out, lse = attend_cached(q, cache=cache, layer=layer, strategy=strategy, **options)
    return (out, lse) if return_lse else out


def attend_cached(
    q: torch.Tensor,
    *,
    cache: DistributedKVCache,
    layer: int,
    strategy: CachedStrategy | str,
    softmax_scale: float | None = None,
    hardware: Hardware | str | None = None,
    kernel: BlockKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cached_attn` after the append (the benchmark repeats it). Returns ``(out, lse)``;
    a zigzag first prefill with pass_q or pass_kv runs on the training ring.

    Raises:
        ValueError: a bad softmax_scale; hardware with a strategy other than ``"auto"``.
    """
    step, comm = cache.step, cache.comm
    assert step is not None and comm is not None and cache.appended(layer)
    check_softmax_scale(softmax_scale)  # cached_attn checked it; the benchmark calls this
    heads_q, head_dim = q.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    chosen = _step_strategy_memo(strategy, cache, heads_q=heads_q, hardware=hardware)
    kv = [cache.shard(layer, s) for s in range(len(step.new))]  # per sequence
    if step.zigzag and chosen in (CachedStrategy.PASS_Q, CachedStrategy.PASS_KV):
        b = len(kv)  # the training ring (pass_q: TokenRing, pass_kv: Ring)
        rows = step.num_rows(comm.rank) // b
        k4, v4 = (torch.stack(x) for x in zip(*kv, strict=True))  # (B, s, Hkv, D)
        out4, lse4 = sequence_parallel_attn(
            q.reshape(b, rows, heads_q, head_dim),
            k4,
            v4,
            strategy=Strategy.TOKEN_RING if chosen is CachedStrategy.PASS_Q else Strategy.RING,
            causal=True,
            softmax_scale=scale,
            group=comm,
            layout="zigzag",
            return_lse=True,
            kernel=kernel,
            check_ranks=False,
        )
        out = out4.reshape(b * rows, heads_q, head_dim)  # (n, Hq, D)
        return out, lse4.permute(1, 0, 2).reshape(heads_q, b * rows)  # (Hq, n)
    plan_key = ("plan", chosen)
    if plan_key not in cache.memo:
        shards = CachedShards.from_step(step)
        cache.memo[plan_key] = (build_cached_plan(chosen, shards), shards)
    plan, shards = cache.memo[plan_key]
    return run_cached_plan(plan, shards, comm, kernel, q, kv, scale=scale)
