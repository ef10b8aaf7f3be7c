"""``tokenring bench``: every strategy side by side, verified, against its bound.

Spawns ``--world-size`` ranks (gloo on CPU; under torchrun the launcher's ranks, NCCL on CUDA),
inside the emulated-interconnect lab with ``--link``. Per model, causality, strategy and pass
(fwd, fwd+bwd): ms per call (median, p10, p90; max over ranks) and per steady step; bytes each
rank sends per flow (travel: q/kv/(q, dout, lse, delta) down the ring; return: partials or
dK/dV home) and their rate; overlap (kernel time / wall time); % of the bound
``max(compute-only time, busiest directed link's bytes / probed bandwidth) + exposed``, where
compute-only runs the rank's kernel calls without communication and ``exposed`` is the
transfer nothing can overlap (TokenRing's last returned slice, Ring's final dK/dV hop); and
the max error against float64 attention (a WRONG row fails the command). The hybrid runs as
``hybrid_attn`` on a ``P / inner x inner`` mesh, its bytes counted on both groups per peer.

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P world size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator, last_block_splits_for, sequence_parallel_attn
from tokenring.cli import (
    ArgumentAdder,
    bench_inference,
    bench_memory,
    check_heads,
    finite_float_at_least,
    given,
    int_at_least,
    mem_available_bytes,
    options,
    output_path,
    positive_seconds,
    ranks,
    rate_bits_per_s,
    report,
    split_list,
)
from tokenring.cli.console import make_table, print_table
from tokenring.cli.models import (
    BENCH_MODELS,
    DTYPES,
    add_hybrid_arguments,
    check_read,
    checked,
    models_from_args,
)
from tokenring.cli.plot import bench_panels, plot_timelines, pyplot, write_trace
from tokenring.cli.reference import per_rank_reference, tile_bytes
from tokenring.core.layout import Layout, Sharding, make_sharding, shard
from tokenring.core.schedule import (
    AttentionShape,
    Pass,
    Payload,
    Piece,
    Schedule,
    Strategy,
    Transfer,
    piece_flops,
)
from tokenring.hybrid import HybridMesh, hybrid_attn, hybrid_mesh, hybrid_positions, hybrid_shard
from tokenring.model.costmodel import CollectiveRouting, Hardware, measured, resource_bytes
from tokenring.model.planner import explain, lends_last_pair
from tokenring.model.simulate import simulate, strategy_schedule
from tokenring.runtime.comm import Communicator, Event, FieldSpec, Timeline
from tokenring.runtime.kernels import BlockKernel, accumulation_dtype, select_kernel
from tokenring.strategies.collective import ulysses_heads
from tokenring.strategies.hybrid import HybridSpec

__all__ = [
    "BenchConfig",
    "add_arguments",
    "check_args",
    "check_memory",
    "estimate_rank_bytes",
    "per_rank_reference",
    "run",
    "run_rank",
]

DEFAULT_HYBRID = HybridSpec(inner=2, outer_strategy=Strategy.TOKEN_RING)
"""The hybrid rows' default: islands of 2 ranks, TokenRing across them (2x2 on 4 ranks)."""
PASSES = ("fwd", "fwd+bwd")
_MODE_MODULES = {"memory": bench_memory, **dict.fromkeys(bench_inference.MODES, bench_inference)}
"""The module of each ``--mode`` other than attention."""


@functools.lru_cache(maxsize=64)
def _schedule(*args: Any, **kwargs: Any) -> Schedule:
    """``strategy_schedule``, pure: one build per row and pass, where the argument checks,
    the size guards and the rows each read them (P^2 plans: at --world-size 60 ~35 s of
    building, three times over)."""
    return strategy_schedule(*args, **kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """Everything one benchmark run measures; the same object is sent to every rank."""

    batch: int = 1
    """B."""
    seq: int = 1024
    """S, global sequence length."""
    models: dict[str, AttentionShape] = field(default_factory=lambda: dict(BENCH_MODELS))
    """Attention shapes by the label of their rows; their batch and dtype become the run's."""
    dtype: str = "float32"
    """Input dtype name."""
    strategies: tuple[Strategy, ...] = tuple(s for s in Strategy if s is not Strategy.HYBRID)
    """Strategies to compare."""
    hybrid: HybridSpec = DEFAULT_HYBRID
    """Factorisation and outer strategy of the hybrid rows (when ``strategies`` has it)."""
    causal: tuple[bool, ...] = (True, False)
    """Causal settings to run."""
    layout: Layout | None = None
    """None: zigzag for causal rows, contiguous for non-causal rows."""
    passes: tuple[str, ...] = PASSES
    """What one timed call does."""
    warmup: int = 1
    """Untimed calls per row."""
    iters: int = 5
    """Timed calls per row."""
    probe_bytes: int = 4 << 20
    """Message size of the link-bandwidth probe."""
    timeline_rows: bool = True
    """Keep the per-rank timeline of the last call of each row (for --plot)."""
    tolerance: float | None = None
    """Max abs error against the float64 oracle for a row to pass; None: by dtype."""
    last_pair: str = "return"
    """TokenRing rows: ``"return"`` or ``"lend"`` (Note [Borrowed last pair])."""

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1:
            raise ValueError(f"batch and seq must be >= 1; got {self.batch}, {self.seq}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"warmup must be >= 0 and iters >= 1; got {self.warmup}, {self.iters}")
        for p in self.passes:
            if p not in PASSES:
                raise ValueError(f"passes must be 'fwd' or 'fwd+bwd'; got {p!r}")
        if self.last_pair not in ("return", "lend"):
            raise ValueError(f"last_pair must be 'return' or 'lend'; got {self.last_pair!r}")
        if not self.models or not self.strategies or not self.causal or not self.passes:
            raise ValueError("models, strategies, causal and passes must each be non-empty")
        run: dict[str, Any] = dict(batch=self.batch, dtype=self.dtype)
        shapes = {n: dataclasses.replace(m, **run) for n, m in self.models.items()}
        object.__setattr__(self, "models", shapes)

    @property
    def lends(self) -> bool:
        return self.last_pair == "lend"

    @property
    def grads(self) -> bool:
        """Whether any row runs the backward."""
        return "fwd+bwd" in self.passes

    def layout_for(self, causal: bool) -> Layout:
        return self.layout or (Layout.ZIGZAG if causal else Layout.CONTIGUOUS)

    def cases(self) -> Iterator[tuple[str, AttentionShape, bool, Strategy]]:
        """Every (model label, shape, causal, strategy) of the run, in row order."""
        product = itertools.product(self.models.items(), self.causal, self.strategies)
        return ((name, model, causal, strategy) for (name, model), causal, strategy in product)

    def check_world(self, world_size: int) -> None:
        """Raise ValueError when a row cannot run on ``world_size`` ranks (any ``seq`` runs;
        the hybrid needs its factorisation to fit)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        if Strategy.HYBRID in self.strategies:
            for m in self.models.values():
                self.hybrid.check(world_size=world_size, heads_q=m.heads_q, heads_kv=m.heads_kv)

    def check_schedules(self, world_size: int) -> None:
        """Raise ValueError naming the strategy and model whose schedules (what the ranks
        build first) cannot be built on ``world_size`` ranks."""
        for name, model, causal, strategy in self.cases():
            try:
                self.schedules(model, strategy, causal, world_size)
            except (ValueError, NotImplementedError) as exc:
                raise ValueError(
                    f"{strategy.value} cannot run {name} on {world_size} ranks: {exc}"
                ) from None

    def schedules(
        self,
        model: AttentionShape,
        strategy: Strategy,
        causal: bool,
        world_size: int,
        *,
        last_block_splits: int = 2,
    ) -> list[Schedule]:
        """The forward and backward schedules one row runs (what the library builds for it;
        ``last_block_splits``: what the calls resolve on their communicator's path, so that the
        compute-only run and the exposed tail are the call's)."""
        return [
            _schedule(
                strategy,
                p,
                layout=self.layout_for(causal),
                causal=causal,
                world_size=world_size,
                seq_len=self.seq,
                heads_kv=model.heads_kv,
                heads_q=model.heads_q,
                hybrid=self.hybrid,
                lend_last_pair=self.lends,
                last_block_splits=last_block_splits,
            )
            for p in (Pass.FORWARD, Pass.BACKWARD)
        ]


@dataclass(slots=True)
class RankRow:
    """One rank's measurements of one row."""

    model: str
    causal: bool
    strategy: str
    pass_: str
    layout: str
    call_s: list[float]
    step_fwd_s: float | None
    step_bwd_s: float | None
    compute_s: float
    compute_fwd_s: float
    compute_bwd_s: float
    flops_fwd: float
    flops_bwd: float
    sent_bytes: dict[str, int]  # per flow
    link_bytes: dict[int, int]  # per destination peer, all flows
    exposed_bytes: dict[int, int]  # per destination peer
    max_error: float
    events: list[Event] = field(default_factory=list)
    kernel: str = ""  # the block kernel and the operators its tiles ran, e.g. cuda_sdpa[sdpa_flash]


# -- the rank side -----------------------------------------------------------------------------
_PROBE_ROUNDS = 6  # the first fills the token bucket and warms the sockets; 5 timed


def _probe_transfer(payload: Payload, src: int, dst: int, *, step: int) -> Transfer:
    """One probe message: Q down posted at the step's start, OUT up after its (empty) segment."""
    after = 0 if payload is Payload.Q else 1
    return Transfer(
        payload=payload, src=src, dst=dst, owner=src, rows=(0, 1), step=step, after_segments=after
    )


def _probe_bandwidth(comm: Communicator, num_bytes: int, device: torch.device) -> float:
    """Bytes/s per direction with both directions of each ring link busy (min over ranks)."""
    if comm.world_size == 1:
        return float("inf")
    rank, world = comm.rank, comm.world_size
    down, up = (rank - 1) % world, (rank + 1) % world
    payload = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    spec: list[FieldSpec] = [((num_bytes,), torch.uint8)]
    flows = ((Payload.Q, down, up), (Payload.OUT, up, down))  # (payload, to, from)
    times = []
    for i in range(_PROBE_ROUNDS):
        sends = [(_probe_transfer(p, rank, to, step=i), [payload]) for p, to, _ in flows]
        recvs = [(_probe_transfer(p, src, rank, step=i), spec) for p, _, src in flows]
        comm.barrier(label="bench")
        start = time.perf_counter()
        for rec in comm.exchange(sends, recvs, device=device).values():
            rec.wait()
        comm.wait_sends()
        if i > 0:
            times.append(time.perf_counter() - start)
    comm.counter.reset()
    # the fastest round: a slower one likely met TCP slow start after the barrier's idle gap
    return _min_over_ranks(comm, num_bytes / min(times))


def _min_over_ranks(comm: Communicator, rate: float) -> float:
    value = torch.tensor([rate], dtype=torch.float64)
    comm.all_reduce(value, op=dist.ReduceOp.MIN, label="bench rate").wait()
    return float(value.item())


def _probe_memory_bandwidth(comm: Communicator, device: torch.device) -> float:
    """Bytes/s of a large copy (read + write), min over ranks: what merges run at."""
    src = torch.ones(8 << 20, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return _min_over_ranks(comm, 2 * src.numel() * src.element_size() / statistics.median(times))


Operands = tuple[tuple[torch.Tensor, ...], AttentionShape]  # q, k, v, dout; FLOP sizes


def _compute_only(
    case: _Case, kernel: BlockKernel, rank: int, backward: bool, operands: Operands
) -> tuple[float, float, float, float]:
    """This rank's kernel calls of the real run without P2P: (forward s, backward s, forward
    FLOPs, backward FLOPs); the backward is 0 for a forward-only row."""
    (q, k, v, dout), dims = operands
    groups = q.shape[2] // max(1, k.shape[2])  # Ulysses with fewer heads than ranks: 0 here
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], dtype=accumulation_dtype(q.dtype))
    delta = torch.zeros_like(lse)

    def heads(piece: Piece) -> tuple[slice, slice]:
        if piece.heads is None:
            return slice(None), slice(None)
        a, b = piece.heads
        if piece.q_heads is not None:  # a pass-Q lane's query heads (one kv head: a part)
            return slice(*piece.q_heads), slice(a, b)
        return slice(a * groups, b * groups), slice(a, b)

    def run(sched: Schedule, pass_: Pass) -> tuple[float, float]:  # seconds, FLOPs
        pieces = [pc for plan in sched.steps[rank] for pc in plan.pieces]
        start = time.perf_counter()
        for piece in pieces:
            (a, b), (c, d), (qh, kh) = piece.q_rows, piece.kv_rows, heads(piece)
            blocks = (q[:, a:b, qh], k[:, c:d, kh], v[:, c:d, kh])
            if pass_ is Pass.FORWARD:
                kernel.forward(*blocks, causal=piece.causal, scale=case.scale)
            else:
                row_stats = (lse[:, qh, a:b], delta[:, qh, a:b])
                kernel.backward(
                    dout[:, a:b, qh], *blocks, *row_stats, causal=piece.causal, scale=case.scale
                )
        seconds = time.perf_counter() - start
        return seconds, sum(piece_flops(pc, dims, pass_) for pc in pieces)

    forward_s, forward_flops = run(case.scheds[0], Pass.FORWARD)
    backward_s, backward_flops = run(case.scheds[1], Pass.BACKWARD) if backward else (0.0, 0.0)
    return forward_s, backward_s, forward_flops, backward_flops


def _compute_operands(case: _Case, rank: int) -> Operands:
    """What a strategy's kernel calls read in its compute-only run, and the sizes their FLOPs
    count with: the ring strategies' shards, else random tensors of the shapes pieces index."""
    dims = case.dims
    if case.strategy.is_ring:
        return tuple(case.kernel_inputs), dims
    pieces = [pc for sched in case.scheds for plan in sched.steps[rank] for pc in plan.pieces]
    q_len = max((pc.q_rows[1] for pc in pieces), default=1)
    kv_len = max((pc.kv_rows[1] for pc in pieces), default=1)
    heads_q, heads_kv = dims.heads_q, dims.heads_kv
    if case.strategy is Strategy.ULYSSES:
        world = case.scheds[0].world_size
        share = ulysses_heads(world_size=world, heads_q=heads_q, heads_kv=heads_kv)
        heads_q = heads_kv = share[rank].num_q
        if heads_q:  # fewer heads than ranks: this rank has none, so no pieces to count
            dims = dataclasses.replace(dims, heads_q=heads_q, heads_kv=heads_kv)
    q = case.kernel_inputs[0]
    gen = torch.Generator().manual_seed(rank)
    sizes = ((q_len, heads_q), (kv_len, heads_kv), (kv_len, heads_kv), (q_len, heads_q))
    operands = (torch.randn(q.shape[0], n, h, q.shape[3], generator=gen) for n, h in sizes)
    return tuple(x.to(device=q.device, dtype=q.dtype) for x in operands), dims


def _steady_step(events: list[Event], label: str, num_steps: int) -> float | None:
    """Median gap between the starts of consecutive steps' ``label`` compute."""
    starts: dict[int, float] = {}
    for ev in events:
        if ev.kind == "compute" and ev.label == label:
            starts[ev.step] = min(starts.get(ev.step, ev.start_s), ev.start_s)
    diffs = [
        starts[t + 1] - starts[t] for t in range(num_steps - 1) if t in starts and t + 1 in starts
    ]
    # step 0 is local: skip it
    return statistics.median(diffs[1:] if len(diffs) > 2 else diffs) if diffs else None


def _exposed_bytes(sched: Schedule, dims: AttentionShape, rank: int) -> dict[int, int]:
    """Bytes per destination of the transfer posted after the rank's last compute: nothing is
    left to overlap it with (TokenRing's last returned slice, Ring's final dK/dV hop)."""
    tail = [
        tr for tr in sched.sends(rank, sched.num_steps - 1) if tr.payload.flow.value == "return"
    ]
    if not tail:
        return {}
    last = max(tail, key=lambda tr: tr.after_segments)
    return {last.dst: last.num_bytes(dims)}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Case:
    """One (model, causal, strategy) on this rank: what its rows (one per pass) run on."""

    model_name: str
    dims: AttentionShape
    causal: bool
    layout: Layout
    strategy: Strategy
    scheds: list[Schedule]  # forward, backward
    local: list[torch.Tensor]  # this rank's q, k, v, dout
    reference: list[torch.Tensor]  # float64 out (dq, dk, dv) of the rank's rows
    kernel_inputs: list[torch.Tensor]  # ``local`` in the (padded) buffer the pieces index

    @property
    def scale(self) -> float:
        return float(self.dims.head_dim**-0.5)


def run_rank(config: BenchConfig, progress_path: str | None = None) -> dict[str, Any]:
    """Run the whole benchmark on this rank (inside an initialised process group)."""
    world = dist.get_world_size()
    config.check_world(world)
    device = ranks.rank_device()
    comm = get_communicator()
    mesh, inner = None, config.hybrid.inner
    if Strategy.HYBRID in config.strategies:
        mesh = hybrid_mesh(world // inner, inner, device_type=device.type)
    bandwidth = _probe_bandwidth(comm, config.probe_bytes, device)
    memory_bandwidth = _probe_memory_bandwidth(comm, device)
    rows: list[RankRow] = []
    splits = last_block_splits_for(comm.path(device))  # what the calls take (None given)
    for case in _cases(config, comm.rank, world, device, splits):
        for pass_ in config.passes:
            rows.append(_measure_row(config, comm, case, pass_, mesh))
            ranks.row_done(progress_path)
    return {
        "rank": comm.rank,
        "bandwidth_bytes_per_s": bandwidth,
        "memory_bytes_per_s": memory_bandwidth,
        "rows": rows,
        "backend": str(dist.get_backend()),
        "device": str(device),
        "comm_path": comm.path(device),  # nccl, gloo, gloo-shm, or gloo-staged
    }


def _cases(
    config: BenchConfig, rank: int, world: int, device: torch.device, splits: int
) -> Iterator[_Case]:
    """Every (model, causal, strategy) of the run in row order, on this rank's inputs, with
    the schedules of calls that slice TokenRing's last block in ``splits``."""
    for name, model in config.models.items():
        q, k, v, dout = inputs = _global_inputs(config, model)
        check: dict[str, Any] = dict(scale=model.head_dim**-0.5, grads=config.grads)
        for causal in config.causal:
            layout = config.layout_for(causal)
            sharding = make_sharding(layout=layout, world_size=world, seq_len=config.seq)
            want = per_rank_reference(
                q, k, v, dout, sharding.positions(rank), causal=causal, **check
            )
            where: dict[str, Any] = dict(rank=rank, world_size=world, layout=layout)
            local = [shard(x, **where).to(device) for x in inputs]
            padded = _padded(sharding, rank, local)
            for strategy in config.strategies:
                mine, reference, kernel_inputs = local, want, padded
                if strategy is Strategy.HYBRID:  # its own layout (tokenring.hybrid)
                    mine, at = _hybrid_shards(config.hybrid, rank, world, layout, *inputs)
                    mine = kernel_inputs = [x.to(device) for x in mine]
                    reference = per_rank_reference(q, k, v, dout, at, causal=causal, **check)
                yield _Case(
                    model_name=name,
                    dims=model,
                    causal=causal,
                    layout=layout,
                    strategy=strategy,
                    scheds=config.schedules(
                        model, strategy, causal, world, last_block_splits=splits
                    ),
                    local=mine,
                    reference=reference,
                    kernel_inputs=kernel_inputs,
                )


def _padded(sharding: Sharding, rank: int, local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The shards in the padded buffer the schedule's rows index (the shards themselves when
    every rank holds s = S / P tokens)."""
    if not sharding.padded:
        return local
    at = sharding.padded_rows(rank).to(local[0].device)
    return [
        x.new_zeros((x.shape[0], sharding.seq_local, *x.shape[2:])).index_copy(1, at, x)
        for x in local
    ]


def _global_inputs(config: BenchConfig, model: AttentionShape) -> list[torch.Tensor]:
    """The seeded global q, k, v, dout ``(B, S, H, D)`` in the run's dtype, the same on every
    rank (each computes the reference of its own rows)."""
    gen = torch.Generator().manual_seed(1234)
    dtype = DTYPES[config.dtype]
    return [
        torch.randn(model.batch, config.seq, h, model.head_dim, generator=gen).to(dtype)
        for h in (model.heads_q, model.heads_kv, model.heads_kv, model.heads_q)
    ]


def _hybrid_shards(
    spec: HybridSpec, rank: int, world: int, layout: Layout, *inputs: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's hybrid-layout shards of the global inputs, and their global positions."""
    outer_rank, inner_rank = divmod(rank, spec.inner)
    where: dict[str, Any] = dict(
        outer_rank=outer_rank, inner_rank=inner_rank, outer=world // spec.inner, inner=spec.inner
    )
    positions = hybrid_positions(**where, layout=layout, seq_len=inputs[0].shape[1])
    return [hybrid_shard(x, **where, layout=layout) for x in inputs], positions


Counted = list[tuple[Communicator, list[int]]]  # communicators and their group -> global rank


def _measure_row(
    config: BenchConfig, comm: Communicator, case: _Case, pass_: str, mesh: HybridMesh | None
) -> RankRow:
    """One row on this rank: its timed calls, checked against the reference, and its
    compute-only run."""
    backward = pass_ == "fwd+bwd"
    times, events, got, counted = _timed_calls(config, comm, case, backward, mesh)
    max_error = _max_error(got, case.reference)
    sent = {"travel": 0, "return": 0}
    link: dict[int, int] = {}
    for c, global_rank in counted:
        for (flow, peer), num in c.counter.sent_bytes.items():
            sent[flow] += num
            link[global_rank[peer]] = link.get(global_rank[peer], 0) + num
    # the faster of two compute-only runs, and the kernel with the operators its tiles ran
    q = case.local[0]
    block_kernel = select_kernel(q.device, q.dtype, seq_local=q.shape[1])  # as the calls'
    operands = _compute_operands(case, comm.rank)
    compute = min(
        (_compute_only(case, block_kernel, comm.rank, backward, operands) for _ in range(2)),
        key=lambda c: c[0] + c[1],
    )
    kernel = f"{block_kernel.name}[{','.join(sorted(block_kernel.ran))}]"
    num_steps = case.scheds[0].num_steps
    return RankRow(
        model=case.model_name,
        causal=case.causal,
        strategy=case.strategy.value,
        pass_=pass_,
        layout=case.layout.value,
        call_s=times,
        step_fwd_s=_steady_step(events, "attn", num_steps),
        step_bwd_s=_steady_step(events, "attn_bwd", num_steps) if backward else None,
        compute_s=sum(ev.end_s - ev.start_s for ev in events if ev.kind == "compute"),
        compute_fwd_s=compute[0],
        compute_bwd_s=compute[1],
        flops_fwd=compute[2],
        flops_bwd=compute[3],
        sent_bytes=sent,
        link_bytes=link,
        exposed_bytes=_exposed_bytes(case.scheds[1 if backward else 0], case.dims, comm.rank),
        max_error=max_error,
        events=events if config.timeline_rows else [],
        kernel=kernel,
    )


def _max_error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Max abs error of the results against the float64 reference (0 for empty shards)."""
    for g, r in zip(got, reference, strict=False):
        if g.shape != r.shape:
            raise AssertionError(f"result shape {tuple(g.shape)} != reference {tuple(r.shape)}")
    return max(
        (g.double().cpu() - r).abs().max().item() if g.numel() else 0.0
        for g, r in zip(got, reference, strict=False)
    )


def _timed_calls(
    config: BenchConfig, comm: Communicator, case: _Case, backward: bool, mesh: HybridMesh | None
) -> tuple[list[float], list[Event], list[torch.Tensor], Counted]:
    """Seconds of each timed call; the last call's events (from its start), results (out
    [, dq, dk, dv]) and the (communicator, group ranks) whose counters it read."""
    counted = [(comm, list(range(comm.world_size)))]
    attend: Callable[..., Any] = functools.partial(sequence_parallel_attn, strategy=case.strategy)
    if case.strategy is Strategy.TOKEN_RING:
        attend = functools.partial(attend, last_pair=config.last_pair)
    if case.strategy is Strategy.HYBRID:
        assert mesh is not None
        groups = (mesh.inner, mesh.outer)
        counted = [(get_communicator(g), dist.get_process_group_ranks(g)) for g in groups]
        attend = functools.partial(
            hybrid_attn, mesh=mesh, outer_strategy=config.hybrid.outer_strategy
        )
    attend = functools.partial(attend, causal=case.causal, layout=case.layout, seq_len=config.seq)
    q, k, v, dout = case.local
    times: list[float] = []
    timeline = Timeline()
    calls = config.warmup + config.iters  # >= 1: out and start get set
    for i in range(calls):
        inputs = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
        timeline.clear()
        for c, _ in counted:
            c.counter.reset()
            c.timeline = timeline if i == calls - 1 else None
        comm.barrier(label="bench")
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = attend(*inputs)
        assert isinstance(out, torch.Tensor)
        if backward:
            out.backward(dout)
        if q.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        for c, _ in counted:
            c.timeline = None
        if i >= config.warmup:
            times.append(elapsed)
    for ev in timeline.events:  # align this rank's events at its own call start
        ev.start_s -= start
        ev.end_s -= start
    got = [out.detach()]
    if backward:
        got += [x.grad for x in inputs if x.grad is not None]
        assert len(got) == 4, "every input must have a gradient"
    return times, list(timeline.events), got, counted


# -- aggregation (parent side) -------------------------------------------------------------------
def aggregate(per_rank: list[dict[str, Any]], config: BenchConfig) -> list[dict[str, Any]]:
    """One dict per row: max over ranks of each rank's statistic, the bound and its %."""
    bandwidth = min(r["bandwidth_bytes_per_s"] for r in per_rank)
    results = []
    for index, first in enumerate(per_rank[0]["rows"]):
        rows: list[RankRow] = [r["rows"][index] for r in per_rank]
        median_s = max(statistics.median(r.call_s) for r in rows)
        compute_only = max(r.compute_fwd_s + r.compute_bwd_s for r in rows)  # kernels, no P2P
        # bytes that can overlap compute: all but the exposed tail, per directed link
        overlappable = max(
            (n - r.exposed_bytes.get(peer, 0) for r in rows for peer, n in r.link_bytes.items()),
            default=0,
        )
        exposed = max(sum(r.exposed_bytes.values()) for r in rows)
        # bandwidth is inf on one rank: its bytes take 0 s
        bound_s = max(compute_only, overlappable / bandwidth) + exposed / bandwidth
        steps_fwd = [r.step_fwd_s for r in rows if r.step_fwd_s is not None]
        steps_bwd = [r.step_bwd_s for r in rows if r.step_bwd_s is not None]
        travel, back = (max(r.sent_bytes[flow] for r in rows) for flow in ("travel", "return"))
        is_hybrid = first.strategy == Strategy.HYBRID.value
        results.append(
            {
                "model": first.model,
                "causal": first.causal,
                "layout": first.layout,
                "strategy": first.strategy,
                "hybrid": config.hybrid.label(len(per_rank)) if is_hybrid else None,
                "pass": first.pass_,
                "last_pair": config.last_pair if first.strategy == "token_ring" else None,
                **report.call_ms([r.call_s for r in rows]),
                "ms_max": 1e3 * max(max(r.call_s) for r in rows),
                "ms_step_fwd": 1e3 * max(steps_fwd) if steps_fwd else None,
                "ms_step_bwd": 1e3 * max(steps_bwd) if steps_bwd else None,
                "travel_bytes_per_rank": travel,
                "return_bytes_per_rank": back,
                "busiest_link_bytes": max(
                    (max(r.link_bytes.values(), default=0) for r in rows), default=0
                ),
                "travel_MBps": travel / median_s / 1e6,
                "return_MBps": back / median_s / 1e6,
                "overlap_efficiency": min(r.compute_s / statistics.median(r.call_s) for r in rows),
                "ms_compute_only": 1e3 * compute_only,
                "ms_bound": 1e3 * bound_s,
                "pct_of_bound": 100 * bound_s / median_s,
                **checked((r.max_error for r in rows), config.dtype, config.tolerance),
                "kernel": ",".join(sorted({r.kernel for r in rows})),
            }
        )
    return results


def add_predictions(
    rows: list[dict[str, Any]],
    per_rank: list[dict[str, Any]],
    config: BenchConfig,
    *,
    world_size: int,
    topology: str = "mesh",
) -> list[dict[str, Any]]:
    """Add the simulator's prediction to each row and the planner's pick to each group.

    Note [Calibrating the model from the run]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Per (model, causal, pass) group, one ``measured`` hardware description from this run's
    own probes: forward and backward FLOP/s = the group's kernel FLOPs / its compute-only
    seconds (every rank, every strategy), link bandwidth = the two-way P2P probe, memory
    bandwidth = a large copy, topology = the lab's, collective routing = the backend's. The
    planner picks among the group's strategies with it; ``planner_hit`` is true when the pick
    measured within 5% of the group's fastest. The simulator predicts each row
    (``model_ms``, ``model_step_fwd_ms``) with the same description but that strategy's own
    kernel FLOP/s (``kernel_flops_per_s``): on CPU a kernel's rate depends on its block
    shapes (a causal diagonal block runs at about half the rate of a full one), which one
    rate per pass cannot hold, so ``model_ms`` checks the schedule and the network, and the
    planner's hit rate what one rate costs.
    """
    probes = {
        "link_bytes_per_s": min(r["bandwidth_bytes_per_s"] for r in per_rank),
        "memory_bytes_per_s": min(r["memory_bytes_per_s"] for r in per_rank),
    }
    backend, host_computes = per_rank[0]["backend"], per_rank[0]["device"] == "cpu"
    splits = last_block_splits_for(per_rank[0]["comm_path"])  # what the run's calls took
    for indices in report.group_by(range(len(rows)), lambda i: _group_key(rows[i])):
        group = [rows[i] for i in indices]
        fwd_rate, bwd_rate = _kernel_rates([r["rows"][i] for r in per_rank for i in indices])
        hardware = _hardware(
            fwd_rate, bwd_rate, probes, config.dtype, topology, backend, host_computes
        )
        first = group[0]
        sharding = make_sharding(layout=first["layout"], world_size=world_size, seq_len=config.seq)
        run = dict(
            world_size=world_size,
            seq_local=sharding.seq_local,  # S / P, or the padded buffer of uneven shards
            causal=first["causal"],
            layout=first["layout"],
            last_block_splits=splits,
        )
        own_rates = [_kernel_rates([r["rows"][i] for r in per_rank]) for i in indices]
        _add_model_times(group, own_rates, config, hardware, run)
        _add_planner_pick(group, config, hardware, run)
        calibration = {"forward_flops_per_s": fwd_rate, "backward_flops_per_s": bwd_rate, **probes}
        for row, rates in zip(group, own_rates, strict=True):
            row["kernel_flops_per_s"] = rates
            row["calibration"] = dict(calibration)
    return rows


def _add_model_times(
    group: list[dict[str, Any]],
    own_rates: list[tuple[float, float]],
    config: BenchConfig,
    hardware: Hardware,
    run: dict[str, Any],
) -> None:
    """Add the simulator's prediction of each row of one group (``run``: the keywords the
    simulator and the planner share), at the row's own FLOP/s."""
    first = group[0]
    for row, (own_fwd, own_bwd) in zip(group, own_rates, strict=True):
        result = simulate(
            row["strategy"],
            passes="both" if first["pass"] == "fwd+bwd" else "forward",
            hybrid=config.hybrid,
            shape=config.models[first["model"]],
            hardware=dataclasses.replace(
                hardware, forward_flops_per_s=own_fwd, backward_flops_per_s=own_bwd
            ),
            lend_last_pair=config.lends,
            **run,
        )
        row["model_ms"] = 1e3 * result.call_s
        row["model_step_fwd_ms"] = 1e3 * result.passes[0].steady_step_s
        row["model_error_pct"] = 100 * (row["ms_median"] / row["model_ms"] - 1)


def _add_planner_pick(
    group: list[dict[str, Any]], config: BenchConfig, hardware: Hardware, run: dict[str, Any]
) -> None:
    """Add the planner's pick among one group's strategies, and its verdict, to each row."""
    first = group[0]
    shape = config.models[first["model"]]
    plan_of: dict[str, Any] = dict(
        heads_q=shape.heads_q,
        heads_kv=shape.heads_kv,
        head_dim=shape.head_dim,
        dtype=config.dtype,
        hardware=hardware,
        batch=config.batch,
        training=first["pass"] == "fwd+bwd",
        **run,
    )
    strategies = [row["strategy"] for row in group]
    plan = explain(
        **plan_of,
        strategies=strategies,
        hybrid=config.hybrid if Strategy.HYBRID.value in strategies else None,
        last_pair=config.last_pair,
    )
    planned = {p.strategy.value: 1e3 * p.total_s for p in plan.predictions}  # the candidates
    # against the measured fastest (Note [Verdicts within noise])
    fastest = min((r for r in group if r["strategy"] in planned), key=lambda r: r["ms_median"])
    pick = next(r for r in group if r["strategy"] == plan.pick.value)
    verdict, why = planner_verdict(pick, fastest)
    for row in group:
        row["planner_pick"] = plan.pick.value
        row["planner_candidate"] = row["strategy"] in planned
        row["planner_hit"] = pick["ms_median"] <= 1.05 * fastest["ms_median"]
        row["planner_ms"] = planned.get(row["strategy"])
        row["planner_verdict"] = verdict
        row["planner_why"] = why
        if row["strategy"] == Strategy.TOKEN_RING.value:  # what last_pair="auto" would run
            row["auto_last_pair"] = "lend" if lends_last_pair(**plan_of) else "return"


def _hardware(
    fwd_rate: float,
    bwd_rate: float,
    probes: dict[str, float],
    dtype: str,
    topology: str,
    backend: str,
    host_computes: bool = False,
) -> Hardware:
    """The run's ``measured`` hardware (Note [Calibrating the model from the run]);
    ``host_computes``: its ranks ran on CPUs."""
    bandwidth = probes["link_bytes_per_s"]
    return measured(
        forward_flops_per_s=fwd_rate,
        backward_flops_per_s=bwd_rate,
        link_bandwidth_bytes_per_s=bandwidth if bandwidth != float("inf") else 1e15,
        memory_bandwidth_bytes_per_s=probes["memory_bytes_per_s"],
        dtype=dtype,
        topology=topology,
        port_bandwidth_bytes_per_s=bandwidth if topology == "switch" else None,
        collectives=CollectiveRouting.for_backend(backend),
        host_computes=host_computes,
    )


def _kernel_rates(rank_rows: list[RankRow]) -> tuple[float, float]:
    """(forward, backward) FLOP/s of compute-only runs: their FLOPs over their seconds."""
    fwd_rate = sum(r.flops_fwd for r in rank_rows) / sum(r.compute_fwd_s for r in rank_rows)
    bwd_time = sum(r.compute_bwd_s for r in rank_rows)
    bwd_rate = sum(r.flops_bwd for r in rank_rows) / bwd_time if bwd_time > 0 else fwd_rate
    return fwd_rate, bwd_rate


# -- size guards (before any rank starts) -------------------------------------------------------
def estimate_rank_bytes(
    config: BenchConfig, world_size: int, *, backend: str = "gloo"
) -> dict[str, int]:
    """About how many bytes one rank of :func:`run_rank` holds at its peak, by part, for the
    (model, causal) pair that needs the most:

    - ``inputs``: the seeded global q, k, v, dout (every rank draws them all);
    - ``reference``: K and V in float64, lse and delta of every row, the rank's float64
      results and one score tile (Note [Per-rank reference] in tokenring.cli.reference);
    - ``run``: the rank's shards, and what the strategy that needs the most holds in its
      calls, its kernel's blocks and its compute-only run (:func:`_call_bytes`);
    - ``process``: the interpreter, torch and the process group.

    With ``backend="nccl"`` the ``run`` part lives on the GPU, the rest on the host.
    """
    b, seq = config.batch, config.seq
    best: dict[str, int] = {}
    elem = DTYPES[config.dtype].itemsize
    for model, causal in itertools.product(config.models.values(), config.causal):
        hq, hkv, d = model.heads_q, model.heads_kv, model.head_dim
        layout = config.layout_for(causal)
        sharding = make_sharding(layout=layout, world_size=world_size, seq_len=seq)
        n = sharding.seq_local
        tile = tile_bytes(b, hq, seq)
        reference = (
            2 * b * seq * hkv * d * 8  # K, V in float64
            + b * n * (2 * hq + 2 * hkv) * d * 8  # the rank's out, dq, dk, dv
            + (2 * b * hq * seq * 8 if config.grads else 0)  # lse, delta
            + 4 * min(tile, b * hq * seq * seq * 8)  # scores, probs, dp, ds of a tile
        )
        scheds = [config.schedules(model, s, causal, world_size) for s in config.strategies]
        on_gpu = backend == "nccl"
        run = max(_call_bytes(config, model, sc, sharding, materialises=on_gpu) for sc in scheds)
        parts = {
            "inputs": b * seq * (2 * hq + 2 * hkv) * d * elem + b * seq * hq * d * 4,  # + fp32 draw
            "reference": reference,
            # shards, padded copies, a call's inputs (cloned) with gradients and output
            "run": 3 * b * n * (2 * hq + 2 * hkv) * d * elem + run,
            "process": ranks.PROCESS_BYTES,
        }
        best = max(best, parts, key=lambda part: sum(part.values()))  # the first on a tie
    return best


def _call_bytes(
    config: BenchConfig,
    model: AttentionShape,
    scheds: list[Schedule],
    sharding: Sharding,
    *,
    materialises: bool,
) -> int:
    """What one strategy's calls hold on a rank beyond its shards: operands, accumulators,
    masks of padded or masked pieces, and whole score blocks where it ``materialises`` them."""
    acc = 8 if config.dtype == "float64" else 4
    elem = DTYPES[config.dtype].itemsize
    b, n, d = config.batch, sharding.seq_local, model.head_dim
    hq = heads_q = model.heads_q
    hkv = heads_kv = model.heads_kv
    ran = scheds[: 2 if config.grads else 1]
    pieces = [pc for sc in ran for steps in sc.steps for plan in steps for pc in plan.pieces]
    q_len = max((pc.q_rows[1] for pc in pieces), default=n)
    kv_len = max((pc.kv_rows[1] for pc in pieces), default=n)
    strategy = scheds[0].strategy
    if strategy is Strategy.ULYSSES:
        share = ulysses_heads(world_size=scheds[0].world_size, heads_q=hq, heads_kv=hkv)
        heads_q = heads_kv = max(sh.num_q for sh in share)
    # q side: q, dout, out, dq and a block in flight; k/v side: k, v, their gradients and a
    # block in flight (the gathered K/V for all-gather K/V)
    operands = b * d * elem * (5 * q_len * heads_q + 3 * 2 * kv_len * heads_kv)
    accumulators = 2 * b * q_len * heads_q * (d + 2) * acc
    masked = sharding.padded and not strategy.is_ring
    kernel = 0
    for pc in pieces:
        blocks = pc.num_q * pc.num_kv
        if pc.masked or masked:
            kernel = max(kernel, blocks * (1 + elem))  # bool mask + additive bias
        if materialises:
            heads = heads_q if pc.heads is None else (pc.heads[1] - pc.heads[0])
            kernel = max(kernel, 4 * b * heads * (hq // hkv) * blocks * acc)
    return operands + accumulators + kernel


def check_memory(config: BenchConfig, world_size: int, ranks_here: int, backend: str) -> None:
    """Raise ValueError when the ranks on this machine cannot fit (Note [Per-rank
    reference] in tokenring.cli.reference): host memory against MemAvailable; with NCCL the
    GPU part against the device's free memory."""
    ranks.check_rank_memory(
        estimate_rank_bytes(config, world_size, backend=backend),
        run=f"--seq {config.seq} --batch {config.batch} on {world_size} ranks",
        available=mem_available_bytes(),
        ranks_here=ranks_here,
        gpu_parts=("run",) if backend == "nccl" else (),
        lower_host="Lower --seq, --batch or the number of ranks per machine",
        lower_gpu="Lower --seq or --batch, or add ranks",
    )


def _check_link_time(config: BenchConfig, args: argparse.Namespace, world_size: int) -> None:
    """:func:`ranks.check_link_time` of the busiest emulated link's bytes, every call's and
    the probe's."""
    probes = {"link_bytes_per_s": args.link / 8, "memory_bytes_per_s": 1.0}
    hardware = _hardware(1.0, 1.0, probes, config.dtype, args.topology, "gloo")  # network only
    calls = config.warmup + config.iters
    # the probe: _PROBE_ROUNDS rounds of probe_bytes each way on each ring link (a port sends both)
    num_bytes = 0.0
    if world_size > 1:
        num_bytes = _PROBE_ROUNDS * config.probe_bytes * (2 if args.topology == "switch" else 1)
    for _, dims, causal, strategy in config.cases():
        scheds = config.schedules(dims, strategy, causal, world_size)
        busiest = [max(resource_bytes(sc, dims, hardware).values(), default=0) for sc in scheds]
        for pass_ in config.passes:
            num_bytes += calls * (busiest[0] + (busiest[1] if pass_ == "fwd+bwd" else 0))
    moved = f"the run moves at least {{MB}} over the busiest link ({args.topology})"
    fewer = ", or run fewer rows or calls (--strategies, --passes, --causal, --iters, --warmup)"
    ranks.check_link_time(args, world_size, num_bytes, moved, fewer)


# -- CLI -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokenring bench``, grouped by the ``--mode`` they apply to."""
    mode_help = (
        "attention: the training strategies; decode / prefill-cached: attention of new tokens "
        "against a sharded KV cache; memory: peak memory per rank beside inputs + outputs + "
        "gradients"
    )
    modes = ["attention", *bench_inference.MODES, "memory"]
    parser.add_argument("--mode", default="attention", choices=modes, help=mode_help)
    add = parser.add_argument_group("ranks and shape (every mode)").add_argument
    add("--world-size", type=int_at_least(1), default=4, help="ranks to spawn (not under torchrun)")
    add("--batch", type=int_at_least(1), default=1, help="batch size B")
    heads_help = "query heads (with --kv-heads: one custom model instead of the built-in ones)"
    add("--heads", type=int_at_least(1), help=heads_help)
    add("--kv-heads", type=int_at_least(1), help="key/value heads")
    add("--head-dim", type=int_at_least(1), default=64, help="head dimension D")
    add("--dtype", default="float32", choices=sorted(DTYPES), help="input dtype")
    add("--timeout", type=positive_seconds, default=1800, help="seconds before ranks are killed")

    _add_attention_arguments(parser.add_argument_group("--mode attention"))

    timing = "timing and checking (attention, decode, prefill-cached)"
    add = parser.add_argument_group(timing).add_argument
    add("--warmup", type=int_at_least(0), default=1, help="untimed calls per row")
    add("--iters", type=int_at_least(1), default=5, help="timed calls per row")
    tolerance_help = "max abs error vs float64 for a row to pass (default: by dtype)"
    add("--tolerance", type=finite_float_at_least(0), help=tolerance_help)
    add("--link", type=rate_bits_per_s, help="emulate links of this rate, e.g. 100mbit")
    topology_help = "topology of the emulated links (with --link)"
    add("--topology", default="mesh", choices=["mesh", "ring", "switch"], help=topology_help)
    bench_inference.add_arguments(parser.add_argument_group("--mode decode, prefill-cached"))
    bench_memory.add_arguments(parser.add_argument_group("--mode memory"))

    add = parser.add_argument_group("output").add_argument
    wide_help = (
        "every column in the terminal table (per-step times, bytes, rates, overlap); the default "
        "table fits 120 columns, and --json / --markdown always have everything"
    )
    add("--wide", action="store_true", help=wide_help)
    add("--json", action="store_true", help="print one JSON object per row")
    for flag, text in {
        "--out": "also append the JSON rows to this JSONL file",
        "--plot": "write a timeline PNG here (attention)",
        "--trace": "write the timelines as a Chrome/Perfetto trace JSON here (attention)",
        "--markdown": "write the table as markdown here, with the command (not memory)",
    }.items():
        add(flag, type=output_path, help=text)


def _add_attention_arguments(attention: ArgumentAdder) -> None:
    """The options of ``--mode attention`` (``--strategies`` and ``--causal`` also of memory)."""
    add = attention.add_argument
    seq_help = "global sequence length (any: uneven shards as tokenring.shard gives them)"
    add("--seq", type=int_at_least(1), default=1024, help=seq_help)
    strategies_help = (
        "comma-separated strategies, also for --mode memory (default: all; the hybrid where "
        "--hybrid-inner fits)"
    )
    add("--strategies", help=strategies_help)
    causal_help = "causal masks to run (memory: one, yes unless no)"
    add("--causal", choices=["both", "yes", "no"], default="both", help=causal_help)
    layout_help = "auto: zigzag when causal, contiguous otherwise"
    add("--layout", choices=["auto", "contiguous", "zigzag"], default="auto", help=layout_help)
    add("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    inner_help = "ranks per island of the hybrid rows (divides the world size and heads)"
    add_hybrid_arguments(attention, default=2, help=inner_help)
    last_pair_help = (
        "TokenRing rows: return the last pair's partial, or lend the pair to its q owner "
        "(last_pair of the attention); the rows' auto_last_pair says what 'auto' would run"
    )
    add("--last-pair", choices=["return", "lend"], default="return", help=last_pair_help)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run the arguments describe, with hybrid rows where they fit. Raises ValueError
    naming the flag that is wrong."""
    passes = split_list(args.passes, "--passes", _parse_pass, ", ".join(PASSES))
    strategies = tuple(Strategy)
    if args.strategies is not None:
        names = ", ".join(s.value for s in Strategy)
        strategies = split_list(args.strategies, "--strategies", Strategy.parse, names)
    config = BenchConfig(
        **options(args, "batch", "seq", "dtype", "warmup", "iters", "tolerance", "last_pair"),
        models=models_from_args(args),
        strategies=strategies,
        hybrid=HybridSpec(inner=args.hybrid_inner, outer_strategy=args.hybrid_outer),
        causal={"both": (True, False), "yes": (True,), "no": (False,)}[args.causal],
        layout=None if args.layout == "auto" else Layout.parse(args.layout),
        passes=passes,
        timeline_rows=args.plot is not None or args.trace is not None,
    )
    try:  # by default the hybrid only where it fits, and then said so
        config.check_world(ranks.world_size_of(args))
    except ValueError as exc:
        if args.strategies is not None:
            raise ValueError(f"--strategies hybrid: {exc}; see --hybrid-inner") from None
        if given(args, "hybrid_inner", "hybrid_outer"):
            raise ValueError(f"--hybrid-inner {args.hybrid_inner}: {exc}") from None
        report.note(f"bench: no hybrid rows ({exc}); see --hybrid-inner", args)
        config = dataclasses.replace(config, strategies=strategies[:-1])
    return config


def _parse_pass(text: str) -> str:
    if text not in PASSES:
        raise ValueError(text)
    return text


_DECODE = tuple(bench_inference.MODES)
# the modes that read each option; every other option is read by every mode
_MODES_OF_FLAG: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("seq", "layout", "passes", "hybrid_inner", "hybrid_outer"), ("attention",)),
    **dict.fromkeys(("last_pair", "plot", "trace", "wide"), ("attention",)),
    **dict.fromkeys(("strategies", "causal"), ("attention", "memory")),
    **dict.fromkeys(("warmup", "iters", "tolerance", "link", "topology"), ("attention", *_DECODE)),
    "markdown": ("attention", *_DECODE),
    **dict.fromkeys(("cached", "new", "cached_strategies", "block_size"), _DECODE),
    **dict.fromkeys(("seq_local", "device"), ("memory",)),
}


def _check_flags_of_mode(args: argparse.Namespace) -> None:
    """No option is dropped: one given that ``--mode`` does not read (at any value, its default
    too) raises naming the modes that read it; so does --topology without --link."""
    for name, modes in _MODES_OF_FLAG.items():
        if args.mode not in modes and given(args, name):
            flag = "--" + name.replace("_", "-")
            names = modes[0] if len(modes) == 1 else f"{', '.join(modes[:-1])} or {modes[-1]}"
            raise ValueError(f"{flag} is for --mode {names}; got --mode {args.mode}")
    if given(args, "topology") and args.link is None:
        raise ValueError(
            f"--topology is for the emulated links; got --topology {args.topology} without --link"
        )
    if args.mode == "memory" and args.causal == "both" and given(args, "causal"):
        raise ValueError("--causal both is for --mode attention; --mode memory runs yes or no")
    if args.wide and args.json:
        raise ValueError("--wide widens the terminal table, which --json replaces; got both")


def _runnable_defaults(config: BenchConfig, world: int, args: argparse.Namespace) -> BenchConfig:
    """``config`` without the strategies of the default list that cannot run one of its
    models on ``world`` ranks, each left out with a note, as a hybrid that does not fit is (a
    strategy named in --strategies is refused instead)."""
    kept = []
    for strategy in config.strategies:
        try:
            dataclasses.replace(config, strategies=(strategy,)).check_schedules(world)
        except ValueError as exc:
            report.note(f"bench: no {strategy.value} rows ({exc})", args)
        else:
            kept.append(strategy)
    if not kept:
        raise ValueError(f"no strategy can run the models on {world} ranks; see the notes above")
    return dataclasses.replace(config, strategies=tuple(kept))


def check_args(args: argparse.Namespace) -> None:
    """Everything about the arguments that can be known before a rank starts (Note [Bad
    input at the command line] in tokenring.cli). Raises ValueError naming the argument;
    keeps the checked config on ``args`` for :func:`run`."""
    _check_flags_of_mode(args)
    world = ranks.world_size_of(args)
    if given(args, "world_size") and args.world_size != world:  # torchrun's differ
        raise ValueError(
            f"--world-size is the ranks bench spawns; got --world-size {args.world_size} under "
            f"torchrun, whose run has {world} ranks: drop it or match it"
        )
    check_heads(args)
    ranks.check_rank_count(args)  # before any check that builds a P^2 schedule
    if args.mode != "attention":
        _MODE_MODULES[args.mode].check_args(args)
        return
    config = config_from_args(args)
    names = [s.value for s in config.strategies]
    if given(args, "last_pair"):
        check_read("--last-pair", names, [Strategy.TOKEN_RING.value])
    if given(args, "hybrid_inner", "hybrid_outer"):
        check_read("--hybrid-inner/--hybrid-outer", names, [Strategy.HYBRID.value])
    if args.strategies is None:
        config = _runnable_defaults(config, world, args)
    try:
        config.check_schedules(world)
    except ValueError as exc:
        raise ValueError(f"--strategies {exc}") from None
    if args.link is not None:
        _check_link_time(config, args, world)
    if args.plot is not None:  # drawn after every row has run
        try:
            pyplot()
        except ImportError as exc:
            raise ValueError(f"--plot {args.plot}: {exc}") from None
    backend = "nccl" if ranks.under_torchrun() and torch.cuda.is_available() else "gloo"
    check_memory(config, world, ranks.ranks_here(args), backend)
    args._config = config


def run(args: argparse.Namespace) -> int:
    if args.mode != "attention":
        return int(_MODE_MODULES[args.mode].run(args))
    config: BenchConfig = args._config
    num_rows = len(config.models) * len(config.causal) * len(config.strategies) * len(config.passes)
    title = f"bench: {num_rows} rows on {args.world_size} ranks"
    per_rank = ranks.collect_per_rank(run_rank, config, args, num_rows=num_rows, title=title)
    if per_rank is None:
        return 0
    lab = args._lab
    if lab and any(r["comm_path"] == "gloo-shm" for r in per_rank):  # the lab's env forbids it
        raise RuntimeError("the lab's ranks exchanged through shared memory, not its links")
    rows = aggregate(per_rank, config)
    topology = lab["topology"] if lab else "mesh"
    add_predictions(rows, per_rank, config, world_size=args.world_size, topology=topology)
    settings = {
        "world_size": args.world_size,
        "batch": config.batch,
        "seq": config.seq,
        "dtype": config.dtype,
        "backend": per_rank[0]["backend"],
        "device": per_rank[0]["device"],
        "comm_path": per_rank[0]["comm_path"],
        "torch": torch.__version__,
        "git_sha": ranks.git_sha(),
        "lab": lab,
        "link_probe_bytes_per_s": min(r["bandwidth_bytes_per_s"] for r in per_rank),
        "warmup": config.warmup,
        "iters": config.iters,
    }
    models = {name: asdict(m) for name, m in config.models.items()}
    report.write_records([{**settings, **row, "shape": models[row["model"]]} for row in rows], args)
    if not args.json:
        _print_table(rows, settings, wide=args.wide)
    verified = [r["verified"] for r in rows]
    why = "error above tolerance; see max_error"
    if args.markdown:  # with the check of every row, as the terminal table
        table = [[title for _, title, _ in _MD_COLUMNS]]
        for row in rows:
            mb = row["busiest_link_bytes"] / 1e6
            check = report.check_cell(row["verified"])
            shown = {**row, "strategy": _strategy_label(row), "busiest_link_MB": mb, "check": check}
            table.append(report.cells(shown, _MD_COLUMNS))
        note = report.timing_note(settings)
        lines = [*_planner_lines(rows), *report.failed_line(verified, why)]
        report.write_markdown(args.markdown, _title(settings), args.argv, note, table, lines)
    if args.plot:
        plot_timelines(per_rank, config, args.plot, title=_title(settings))
    if args.trace:
        write_trace(bench_panels(per_rank, config), args.trace)
    return report.exit_status(verified, why, args)


def _title(settings: dict[str, Any]) -> str:
    return (
        f"P={settings['world_size']} {settings['backend']} {settings['device']} "
        f"S={settings['seq']} B={settings['batch']} {settings['dtype']}, "
        f"{report.link_text(settings['lab'])}, "
        f"probe {settings['link_probe_bytes_per_s'] / 1e6:.0f} MB/s per direction"
    )


# -- the terminal table, the planner's verdicts, markdown ----------------------------------------
def _strategy_label(row: dict[str, Any]) -> str:
    """The strategy's name, with the hybrid's factorisation (e.g. ``hybrid 2x2 token_ring``)."""
    return f"{row['strategy']} {row['hybrid']}" if row.get("hybrid") else row["strategy"]


SCREEN_COLUMNS = 120
"""The terminal width the default output fits (Note [First screen])."""

# (header, cell) of the terminal table; the narrow set fits 120 columns (Note [First screen])
_NARROW_COLUMNS: list[tuple[str, Any]] = [
    ("model", lambda r: r["model"]),
    ("causal", lambda r: "yes" if r["causal"] else "no"),
    ("strategy", _strategy_label),
    ("pass", lambda r: r["pass"]),
    ("ms/call", lambda r: report.cell(r["ms_median"], "{:.1f}")),
    ("p10-p90", lambda r: f"{r['ms_p10']:.0f}-{r['ms_p90']:.0f}"),
    ("% bound", lambda r: "-" if r["pct_of_bound"] is None else f"{r['pct_of_bound']:.0f}%"),
    ("vs model", lambda r: f"{r['model_error_pct']:+.0f}%" if "model_error_pct" in r else "-"),
    ("max err", lambda r: f"{r['max_error']:.1e}"),
    ("check", lambda r: "ok" if r["verified"] else "[bold red]WRONG[/]"),
]
_WIDE_COLUMNS: list[tuple[str, Any]] = [
    *_NARROW_COLUMNS[:6],
    ("ms/step fwd", lambda r: report.cell(r["ms_step_fwd"], "{:.1f}")),
    ("ms/step bwd", lambda r: report.cell(r["ms_step_bwd"], "{:.1f}")),
    ("MB out travel", lambda r: f"{r['travel_bytes_per_rank'] / 1e6:.2f}"),
    ("MB out return", lambda r: f"{r['return_bytes_per_rank'] / 1e6:.2f}"),
    ("MB/s travel", lambda r: f"{r['travel_MBps']:.1f}"),
    ("MB/s return", lambda r: f"{r['return_MBps']:.1f}"),
    ("overlap", lambda r: f"{r['overlap_efficiency']:.2f}"),
    _NARROW_COLUMNS[6],
    ("model ms", lambda r: report.cell(r.get("model_ms"), "{:.1f}")),
    *_NARROW_COLUMNS[7:],
]


def results_table(rows: list[dict[str, Any]], settings: dict[str, Any], *, wide: bool) -> Any:
    """The terminal table (a rich Table) of the rows.

    Note [First screen]
    ~~~~~~~~~~~~~~~~~~~
    The default table has the columns a reader decides on (time with its spread, the bound,
    the model's error, the check) and fits a 120-column terminal, and so do the planner's
    verdict lines under it (a long reason folds onto indented lines); ``--wide`` adds per-step
    times, bytes, rates, overlap and the model's ms. ``--json``, ``--out`` and
    ``--markdown`` always carry every field.
    """
    columns = _WIDE_COLUMNS if wide else _NARROW_COLUMNS
    table = make_table("tokenring bench: " + _title(settings), [name for name, _ in columns])
    for r in rows:
        table.add_row(*(cell(r) for _, cell in columns))
    return table


def _print_table(rows: list[dict[str, Any]], settings: dict[str, Any], *, wide: bool) -> None:
    print_table(results_table(rows, settings, wide=wide))
    for line in _planner_lines(rows):  # a verdict's reason folds under it (Note [First screen])
        print(textwrap.fill(line, width=SCREEN_COLUMNS, subsequent_indent="    "))


def planner_verdict(pick: dict[str, Any], fastest: dict[str, Any]) -> tuple[str, str]:
    """The planner's pick against the measured fastest of its candidates: ``(verdict, why)``.

    Note [Verdicts within noise]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``hit``: the pick measured within 5% of the fastest. ``noise``: slower than that, but by
    no more than the run's own p10-p90 spread (the wider of the two rows'), so this run
    cannot tell the two apart; not a miss. ``miss``: slower by more than the spread; ``why``
    says in one line where model and machine disagree: either each strategy's own measured
    kernel rate already ranks the fastest first (the planner prices every strategy with one
    FLOP/s per pass, and the kernels' rates differ by block shape), or the model misprices
    the row it is further off on (its predicted and measured ms).
    """
    gap_ms = pick["ms_median"] - fastest["ms_median"]
    spread_ms = max(r["ms_p90"] - r["ms_p10"] for r in (pick, fastest))
    if pick["ms_median"] <= 1.05 * fastest["ms_median"]:
        return "hit", ""
    if gap_ms <= spread_ms:
        return "noise", f"{gap_ms:.1f} ms slower, within the p10-p90 spread of {spread_ms:.1f} ms"
    slower = f"{gap_ms:.1f} ms slower (spread {spread_ms:.1f} ms)"
    own_pick, own_fastest = pick.get("model_ms"), fastest.get("model_ms")
    if own_pick is not None and own_fastest is not None and own_fastest < own_pick:
        return "miss", (
            f"{slower}: with each strategy's own kernel rate the model ranks "
            f"{fastest['strategy']} first ({own_fastest:.1f} vs {own_pick:.1f} ms); the "
            "planner's one rate per pass does not"
        )
    off = max((pick, fastest), key=lambda r: abs(r.get("model_error_pct", 0.0)))
    if "model_ms" not in off:
        return "miss", f"{slower}; no model to compare"
    return "miss", (
        f"{slower}: the model prices {off['strategy']} at {off['model_ms']:.1f} ms, measured "
        f"{off['ms_median']:.1f} ms ({off['model_error_pct']:+.0f}%)"
    )


def _group_key(row: dict[str, Any]) -> tuple[str, bool, str]:
    """The rows that compete: one (model, causal, pass)."""
    return row["model"], row["causal"], row["pass"]


def _planner_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (model, causal, pass) group: the planner's pick against the fastest
    (Note [Verdicts within noise]), and a summary."""
    lines = []
    verdicts: list[str] = []
    for group in report.group_by(rows, _group_key):
        r = group[0]
        if "planner_pick" not in r:
            continue
        covered = [g for g in group if g.get("planner_candidate", "model_ms" in g)]
        fastest = min(covered, key=lambda g: g["ms_median"])
        overall = min(group, key=lambda g: g["ms_median"])
        pick = next(g for g in group if g["strategy"] == r["planner_pick"])
        verdict, why = planner_verdict(pick, fastest)
        verdicts.append(verdict)
        unmodelled = ""
        if overall is not fastest:
            unmodelled = (
                f" (non-candidate {overall['strategy']} was faster: {overall['ms_median']:.1f} ms)"
            )
        lines.append(
            f"auto ({r['model']}, causal={r['causal']}, {r['pass']}): picks {r['planner_pick']}; "
            f"measured fastest {fastest['strategy']} ({fastest['ms_median']:.1f} ms){unmodelled}"
            f"; {verdict.upper() if verdict == 'miss' else verdict}{': ' + why if why else ''}"
        )
    if verdicts:
        lines.append(
            f"planner: {verdicts.count('hit')} hit, {verdicts.count('noise')} within noise "
            f"(p10-p90), {verdicts.count('miss')} miss of {len(verdicts)} (hit: within 5% of "
            "the fastest candidate)"
        )
    return lines


_MD_COLUMNS = [
    *((key, key, "{}") for key in ("model", "causal", "strategy", "pass")),
    ("ms_median", "ms/call", "{:.1f}"),
    ("ms_p10", "p10", "{:.1f}"),
    ("ms_p90", "p90", "{:.1f}"),
    ("ms_step_fwd", "ms/step fwd", "{:.1f}"),
    ("ms_step_bwd", "ms/step bwd", "{:.1f}"),
    ("busiest_link_MB", "busiest link MB", "{:.2f}"),
    ("overlap_efficiency", "overlap", "{:.2f}"),
    ("ms_compute_only", "compute-only ms", "{:.1f}"),
    ("ms_bound", "bound ms", "{:.1f}"),
    ("pct_of_bound", "% of bound", "{:.1f}"),
    ("model_step_fwd_ms", "model ms/step fwd", "{:.1f}"),
    ("model_ms", "model ms", "{:.1f}"),
    ("model_error_pct", "vs model %", "{:.1f}"),
    ("planner_pick", "auto picks", "{}"),
    ("last_pair", "last pair", "{}"),
    ("auto_last_pair", "auto last pair", "{}"),
    ("max_error", "max err", "{:.1e}"),
    ("check", "check", "{}"),
]
"""(row key, header, format) of the markdown table's columns (``report.cell``)."""
