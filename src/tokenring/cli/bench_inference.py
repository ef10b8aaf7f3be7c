"""``tokenring bench --mode decode|prefill-cached``: attention against a sharded KV cache.

Fills a ``DistributedKVCache`` with C cached tokens per sequence on ``--world-size`` ranks (or
torchrun's), appends T new ones, and times the new tokens' attention (``tokenring.inference``)
with every cached strategy, per model, C and T: ms per call (median, p10, p90; max over
ranks), per decode step or per prefill chunk; bytes sent per flow (travel: Q or K/V; return:
partials), checked against the plan on every rank; the simulator's prediction
(``predict_cached``) on this run's own calibration and the strategy ``"auto"`` picks among
the strategies run (``--cached-strategies``); the max error against float64 attention. One
layer, forward only.

Legend: B sequences, C cached and T new tokens per sequence, Hq / Hkv heads, D head dim,
P world size.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator
from tokenring.cli import (
    ArgumentAdder,
    int_at_least,
    int_list,
    mem_available_bytes,
    options,
    ranks,
    report,
    split_list,
)
from tokenring.cli.console import make_table, print_table
from tokenring.cli.models import BENCH_MODELS, DTYPES, checked, models_from_args
from tokenring.cli.reference import per_rank_reference, tile_bytes
from tokenring.core.schedule import AttentionShape, Flow, dtype_name
from tokenring.inference import attend_cached
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import Hardware
from tokenring.model.planner import (
    calibrate,
    choose_cached_strategy,
    pass_q_threshold,
    predict_cached,
)
from tokenring.runtime.comm import Communicator
from tokenring.runtime.kernels import BlockKernel, select_kernel
from tokenring.strategies.cached import (
    CachedShards,
    CachedStrategy,
    CacheStep,
    build_cached_plan,
)

__all__ = [
    "InferenceBenchConfig",
    "add_arguments",
    "check_args",
    "estimate_rank_bytes",
    "run",
    "run_rank",
]

MODES = ("decode", "prefill-cached")
_PROBE_BYTES, _PROBE_REPEATS = 8 << 20, 3
"""The calibration's link probe: bytes per message and timed repeats (each probe adds one
warm-up), one way then both ways round the ring."""
_DEFAULT_NEW = {"decode": "1,16,128", "prefill-cached": "256,1024,4096"}


@dataclass(frozen=True, kw_only=True, slots=True)
class InferenceBenchConfig:
    """Everything one inference benchmark run measures; the same object goes to every rank."""

    mode: str
    """``decode`` or ``prefill-cached`` (labels; both time the same call)."""
    batch: int = 1
    """B."""
    cached: tuple[int, ...] = (4096,)
    """C values."""
    new: tuple[int, ...] = (1,)
    """T values."""
    models: dict[str, AttentionShape] = field(default_factory=lambda: dict(BENCH_MODELS))
    """Attention shapes to run, by the label of their rows (their heads and head dim)."""
    dtype: str = "float32"
    """Input dtype name."""
    strategies: tuple[CachedStrategy, ...] = tuple(CachedStrategy)
    """Strategies to compare."""
    block_size: int = 64
    """Cache placement block."""
    warmup: int = 2
    """Untimed calls per row."""
    iters: int = 10
    """Timed calls per row."""
    tolerance: float | None = None
    """Max abs error against float64; None: by dtype."""
    topology: str | None = None
    """The emulated links' topology (``--link``), which the calibration takes as it is; None:
    the calibration's guess from its probes."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}")
        if self.batch < 1 or self.block_size < 1:
            raise ValueError(
                f"batch and block_size must be >= 1; got {self.batch}, {self.block_size}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if any(c < 0 for c in self.cached) or any(t < 1 for t in self.new):
            raise ValueError(f"cached must be >= 0 and new >= 1; got {self.cached}, {self.new}")
        if not (self.cached and self.new and self.models and self.strategies):
            raise ValueError("cached, new, models and strategies must each be non-empty")
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"warmup must be >= 0 and iters >= 1; got {self.warmup}, {self.iters}")


def _oracle_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Float64 causal attention of the queries at ``positions`` of one sequence (global
    ``q`` ``(S, Hq, D)``, ``k``/``v`` ``(S, Hkv, D)``): ``(len(positions), Hq, D)``, in score
    tiles (Note [Per-rank reference] in tokenring.cli.reference), never (Hq, rows, S)."""
    (out,) = per_rank_reference(
        q[None], k[None], v[None], None, positions, causal=True, scale=scale, grads=False
    )
    return out[0]


def _random_sequences(
    batch: int, total: int, model: AttentionShape, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Seeded global q ``(C + T, Hq, D)``, k and v ``(C + T, Hkv, D)`` of each sequence, the
    same on every rank."""
    gen = torch.Generator().manual_seed(1234)

    def randn(heads: int) -> torch.Tensor:
        drawn = torch.randn(total, heads, model.head_dim, generator=gen, dtype=torch.float64)
        return drawn.to(dtype)

    hq, hkv = model.heads_q, model.heads_kv
    return [(randn(hq), randn(hkv), randn(hkv)) for _ in range(batch)]


def _filled_cache(
    config: InferenceBenchConfig,
    comm: Communicator,
    seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    cached: int,
    new: int,
    device: torch.device,
) -> tuple[DistributedKVCache, CacheStep]:
    """A one-layer cache of this rank's K/V of ``seqs`` after C cached then T new tokens, and
    the step of the new ones."""
    _, hkv, d = seqs[0][1].shape
    cache = DistributedKVCache(
        num_layers=1,
        batch=config.batch,
        heads_kv=hkv,
        head_dim=d,
        dtype=seqs[0][1].dtype,
        device=device,
        block_size=config.block_size,
        group=comm,
        zigzag_first_prefill=False,
    )
    step = None
    for count in ([cached] * config.batch, [new] * config.batch):
        if not any(count):
            continue
        step = cache.begin_step(count)
        mine = step.new_positions[comm.rank]
        k, v = (torch.cat([s[i][p] for s, p in zip(seqs, mine, strict=True)]) for i in (1, 2))
        cache.append(0, k.to(device), v.to(device))
    assert step is not None
    return cache, step


def _timed_calls(
    config: InferenceBenchConfig,
    comm: Communicator,
    q: torch.Tensor,
    cache: DistributedKVCache,
    strategy: CachedStrategy,
    kernel: BlockKernel,
) -> tuple[torch.Tensor, list[float]]:
    """The output and the seconds of each timed call of ``strategy`` (after the warm-up; a
    barrier before each call, whose bytes the counter then holds)."""
    times = []
    out = q
    for i in range(config.warmup + config.iters):
        comm.counter.reset()
        comm.barrier(label="bench_inference")
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out, _ = attend_cached(q, cache=cache, layer=0, strategy=strategy, kernel=kernel)
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= config.warmup:
            times.append(time.perf_counter() - start)
    return out, times


def _case_rows(
    config: InferenceBenchConfig,
    comm: Communicator,
    hardware: Hardware,
    kernel: BlockKernel,
    device: torch.device,
    *,
    name: str,
    cached: int,
    new: int,
) -> Iterator[dict[str, Any]]:
    """This rank's rows of one (model, C, T): each strategy timed, counted and verified."""
    model = config.models[name]
    hq, hkv, d = model.heads_q, model.heads_kv, model.head_dim
    seqs = _random_sequences(config.batch, cached + new, model, DTYPES[config.dtype])
    cache, step = _filled_cache(config, comm, seqs, cached=cached, new=new, device=device)
    mine = step.new_positions[comm.rank]
    q = torch.cat([s[0][p] for s, p in zip(seqs, mine, strict=True)]).to(device)
    want = torch.cat(
        [_oracle_rows(s[0], s[1], s[2], p, d**-0.5) for s, p in zip(seqs, mine, strict=True)]
    )
    shards = CachedShards.from_step(step)
    shape: dict[str, Any] = {"heads_q": hq, "heads_kv": hkv, "head_dim": d, "dtype": config.dtype}
    # among the rows run, as the attention bench's planner: a pick not run has no time to
    # score (it read MISS against the fastest of the others)
    pick = choose_cached_strategy(
        shards, **shape, hardware=hardware, candidates=config.strategies
    ).pick
    dims = dataclasses.replace(model, batch=1, dtype=dtype_name(q.dtype))
    for strategy in config.strategies:
        plan = build_cached_plan(strategy, shards)
        predicted = predict_cached(plan, shards, **shape, hardware=hardware)
        out, times = _timed_calls(config, comm, q, cache, strategy, kernel)
        sent = {f.value: 0 for f in Flow}
        for (flow, _peer), num in comm.counter.sent_bytes.items():
            sent[flow] += num
        planned: Counter[tuple[str, int]] = Counter()  # per (flow, dst): what the counter shows
        for tr in (tr for tr in plan.transfers if tr.src == comm.rank):
            planned[tr.payload.flow.value, tr.dst] += tr.num_bytes(dims)
        yield {
            "model": name,
            "cached": cached,
            "new": new,
            "strategy": strategy.value,
            "call_s": times,
            "sent_bytes": sent,
            "pair_bytes": max(comm.counter.sent_bytes.values(), default=0),
            "bytes_match_plan": dict(planned) == dict(comm.counter.sent_bytes),
            "max_error": (out.double().cpu() - want).abs().max().item() if out.numel() else 0.0,
            "model_s": predicted.total_s,
            "model_travel_bytes": predicted.travel_bytes,
            "model_return_bytes": predicted.return_bytes,
            "model_bound_by": predicted.bound_by,
            "pick": pick.value,
        }


def run_rank(config: InferenceBenchConfig, progress_path: str | None = None) -> dict[str, Any]:
    """Run the whole inference benchmark on this rank (inside an initialised process group)."""
    comm = get_communicator()
    device = ranks.rank_device()
    dtype = DTYPES[config.dtype]
    probe: dict[str, Any] = dict(probe_bytes=_PROBE_BYTES, repeats=_PROBE_REPEATS)
    probe["topology"] = config.topology
    hardware = calibrate(comm, dtype=dtype, device=device, **probe)  # once, for every row
    kernel = select_kernel(device, dtype)
    rows = []
    for name, cached, new in itertools.product(config.models, config.cached, config.new):
        case = _case_rows(config, comm, hardware, kernel, device, name=name, cached=cached, new=new)
        for row in case:
            rows.append(row)
            ranks.row_done(progress_path)
    return {
        "rank": comm.rank,
        "rows": rows,
        "backend": str(dist.get_backend()),
        "device": str(device),
        "calibration": {
            "forward_flops_per_s": hardware.forward_flops_per_s,
            "link_bytes_per_s": hardware.interconnect.link_bandwidth_bytes_per_s,
            "latency_s": hardware.interconnect.latency_s,
            "memory_bytes_per_s": hardware.memory_bandwidth_bytes_per_s,
            "topology": hardware.interconnect.topology.value,
            "kernel_call_s": hardware.kernel_call_s,
        },
    }


def aggregate(per_rank: list[dict[str, Any]], config: InferenceBenchConfig) -> list[dict[str, Any]]:
    """One dict per row: the max over ranks of each rank's statistic."""
    results = []
    for rows in zip(*(r["rows"] for r in per_rank), strict=True):
        first = rows[0]
        median_s, model_s = max(statistics.median(r["call_s"]) for r in rows), first["model_s"]
        model = config.models[first["model"]]
        threshold = pass_q_threshold(
            heads_q=model.heads_q,
            heads_kv=model.heads_kv,
            head_dim=model.head_dim,
            elem_bytes=DTYPES[config.dtype].itemsize,
            acc_bytes=8 if config.dtype == "float64" else 4,
        )
        results.append(
            {
                "mode": config.mode,
                "model": first["model"],
                "batch": config.batch,
                "cached": first["cached"],
                "new": first["new"],
                "new_fraction": first["new"] / (first["new"] + first["cached"]),
                "pass_q_threshold": threshold,
                "strategy": first["strategy"],
                **report.call_ms([r["call_s"] for r in rows]),
                "travel_bytes_per_rank": max(r["sent_bytes"]["travel"] for r in rows),
                "return_bytes_per_rank": max(r["sent_bytes"]["return"] for r in rows),
                "busiest_pair_bytes": max(r["pair_bytes"] for r in rows),
                "bytes_match_plan": all(r["bytes_match_plan"] for r in rows),
                "model_ms": 1e3 * model_s,
                "model_error_pct": 100 * (median_s / model_s - 1) if model_s > 0 else None,
                "model_travel_bytes": first["model_travel_bytes"],
                "model_return_bytes": first["model_return_bytes"],
                "model_bound_by": first["model_bound_by"],
                "auto_pick": first["pick"],
                **checked((r["max_error"] for r in rows), config.dtype, config.tolerance),
            }
        )
    for group in report.group_by(results, _case_key):  # the measured fastest, to score the pick
        fastest = min(group, key=lambda r: r["ms_median"])
        picked = next((r for r in group if r["strategy"] == group[0]["auto_pick"]), None)
        hit = picked is not None and picked["ms_median"] <= 1.1 * fastest["ms_median"]
        for row in group:
            row["fastest"] = fastest["strategy"]
            row["pick_within_10pct"] = hit
    return results


def _case_key(row: dict[str, Any]) -> tuple[str, int, int]:
    return row["model"], row["cached"], row["new"]


# -- size guard (before any rank starts) --------------------------------------------------------
def _most_rows(num_tokens: int, world_size: int, block_size: int) -> int:
    """At most how many of ``num_tokens`` consecutive positions one rank owns: block-cyclic
    (Note [Placement] in tokenring.strategies.cached), one block more for a run that starts
    inside a block."""
    return min(num_tokens, (math.ceil(num_tokens / (block_size * world_size)) + 1) * block_size)


def estimate_rank_bytes(
    config: InferenceBenchConfig, world_size: int
) -> tuple[dict[str, int], tuple[str, int, int]]:
    """About how many bytes one rank of :func:`run_rank` holds at its peak, by part, for the
    (model, C, T) that needs the most, and that case:

    - ``inputs``: every sequence's seeded global q, k, v (every rank draws them all) and the
      float64 draw of one of them;
    - ``reference``: K and V of one sequence in float64, the float64 rows of the rank's new
      tokens (and their error) and score tiles (:func:`_oracle_rows`);
    - ``cache``: the rank's K/V shard, and a copy as it grows or is appended;
    - ``run``: what the strategy that needs the most holds in its calls: every Q block (direct,
      tree), accumulators and partials of every owner, three K/V shards (pass_kv: its own, a
      visiting one, one in flight), a position mask, the kernel's tiles, the calibration's
      probe messages;
    - ``process``: the interpreter, torch and the process group.

    With NCCL ``cache`` and ``run`` live on the GPU, the rest on the host.
    """
    elem = DTYPES[config.dtype].itemsize
    acc = 8 if config.dtype == "float64" else 4
    b, bs = config.batch, config.block_size
    best: dict[str, int] = {}
    worst = next(iter(config.models)), config.cached[0], config.new[0]
    for (name, model), cached, new in itertools.product(
        config.models.items(), config.cached, config.new
    ):
        hq, hkv, d = model.heads_q, model.heads_kv, model.head_dim
        seq = cached + new
        q_rows = _most_rows(new, world_size, bs)  # of one sequence
        kv_rows = _most_rows(seq, world_size, bs)
        tile = 4 * hq * min(q_rows, 1024) * min(kv_rows, 1024) * acc  # the kernel's
        parts = {
            "inputs": b * seq * (hq + 2 * hkv) * d * elem + seq * max(hq, hkv) * d * 8,
            "reference": 2 * seq * hkv * d * 8
            + 3 * b * q_rows * hq * d * 8
            + 2 * tile_bytes(1, hq, seq),
            "cache": 2 * b * kv_rows * 2 * hkv * d * elem,
            "run": b * new * hq * d * elem  # every Q block
            + 2 * b * new * hq * (d + 1) * acc  # accumulators, partials
            + 3 * b * kv_rows * 2 * hkv * d * elem  # K/V shards
            + q_rows * kv_rows  # a position mask (bool)
            + tile
            + 4 * _PROBE_BYTES,
            "process": ranks.PROCESS_BYTES,
        }
        if sum(parts.values()) > sum(best.values()):
            best, worst = parts, (name, cached, new)
    return best, worst


# -- CLI (hooked into tokenring bench) -----------------------------------------------------------
def add_arguments(parser: ArgumentAdder) -> None:
    """The inference options of ``tokenring bench`` (``--mode`` selects them)."""
    add = parser.add_argument
    add("--cached", default="4096", help="cached tokens per sequence, comma-separated")
    new_help = (
        "new tokens per sequence per call, comma-separated (default: decode "
        f"{_DEFAULT_NEW['decode']}; prefill-cached {_DEFAULT_NEW['prefill-cached']})"
    )
    add("--new", help=new_help)
    names = ",".join(s.value for s in CachedStrategy)
    add("--cached-strategies", default=names, help="comma-separated cached strategies to compare")
    add("--block-size", type=int_at_least(1), default=64, help="KV cache block size in tokens")


def config_from_args(args: argparse.Namespace) -> InferenceBenchConfig:
    """The run the arguments describe. Raises ValueError naming the flag that is wrong."""
    names = ", ".join(s.value for s in CachedStrategy)
    return InferenceBenchConfig(
        **options(args, "mode", "batch", "dtype", "block_size", "warmup", "iters", "tolerance"),
        cached=int_list(args.cached, "--cached", 0),
        new=int_list(args.new or _DEFAULT_NEW[args.mode], "--new", 1),
        models=models_from_args(args),
        topology=args.topology if args.link is not None else None,
        strategies=split_list(
            args.cached_strategies, "--cached-strategies", CachedStrategy.parse, names
        ),
    )


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before a rank starts; ValueError naming the argument. Keeps the
    config on ``args`` for :func:`run`."""

    config = config_from_args(args)
    world = ranks.world_size_of(args)
    if args.link is not None:
        # the calibration's probes alone cross each link r -> r-1 (1 + repeats) times each
        num_bytes = 2 * (1 + _PROBE_REPEATS) * _PROBE_BYTES if world > 1 else 0
        moved = "the calibration alone moves {MB} over each link"
        ranks.check_link_time(args, world, num_bytes, moved)
    parts, (name, cached, new) = estimate_rank_bytes(config, world)
    on_gpu = ranks.under_torchrun() and torch.cuda.is_available()  # NCCL
    ranks.check_rank_memory(
        parts,
        run=(
            f"--mode {config.mode} at --cached {cached} --new {new} --batch {config.batch} "
            f"({name}) on {world} ranks"
        ),
        available=mem_available_bytes(),
        ranks_here=ranks.ranks_here(args),
        gpu_parts=("cache", "run") if on_gpu else (),
        lower_host="Lower --cached, --new, --batch or the number of ranks per machine",
        lower_gpu="Lower --cached, --new or --batch, or add ranks",
    )
    args._config = config


def run(args: argparse.Namespace) -> int:
    """``tokenring bench --mode decode|prefill-cached``."""
    config: InferenceBenchConfig = args._config
    num_rows = len(config.models) * len(config.cached) * len(config.new) * len(config.strategies)
    title = f"bench {config.mode}: {num_rows} rows on {args.world_size} ranks"
    per_rank = ranks.collect_per_rank(run_rank, config, args, num_rows=num_rows, title=title)
    if per_rank is None:
        return 0
    rows = aggregate(per_rank, config)
    lab = args._lab
    settings = {
        "world_size": args.world_size,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "backend": per_rank[0]["backend"],
        "device": per_rank[0]["device"],
        "torch": torch.__version__,
        "git_sha": ranks.git_sha(),
        "lab": lab,
        "calibration": per_rank[0]["calibration"],
        "warmup": config.warmup,
        "iters": config.iters,
    }
    report.write_records([{**settings, **row} for row in rows], args)
    unit = "ms/step" if config.mode == "decode" else "ms/chunk"
    headers = [unit if key == "ms_median" else title for key, title, _ in _COLUMNS]
    title, cells, lines = _title(settings, config), [_cells(row) for row in rows], _pick_lines(rows)
    ok = [row["verified"] and row["bytes_match_plan"] for row in rows]
    why = "error above tolerance or bytes different from the plan"
    if not args.json:
        table = make_table("tokenring bench " + title, [*headers, "check"])
        for row_cells, row_ok in zip(cells, ok, strict=True):
            table.add_row(*row_cells, "ok" if row_ok else "[bold red]WRONG[/]")
        print_table(table)
        for line in lines:
            print(line)
    if args.markdown:  # with the check of every row, as the terminal table
        note = report.timing_note(
            settings,
            " One attention layer, forward; bytes are what the busiest rank sent on each flow "
            "(equal to the plan's on every rank in every row).",
        )
        checked = [[*c, report.check_cell(row_ok)] for c, row_ok in zip(cells, ok, strict=True)]
        table_md = [[*headers, "check"], *checked]
        end = [*lines, *report.failed_line(ok, why)]
        report.write_markdown(args.markdown, title, args.argv, note, table_md, end)
    return report.exit_status(ok, why, args)


def _title(settings: dict[str, Any], config: InferenceBenchConfig) -> str:
    cal = settings["calibration"]
    return (
        f"{config.mode}: P={settings['world_size']} {settings['backend']} {settings['device']} "
        f"B={config.batch} {settings['dtype']} bs={settings['block_size']}, "
        f"{report.link_text(settings['lab'])}; calibrated "
        f"{cal['link_bytes_per_s'] / 1e6:.0f} MB/s, {1e6 * cal['latency_s']:.0f} us latency, "
        f"{cal['forward_flops_per_s'] / 1e9:.1f} GFLOP/s, "
        f"{1e6 * cal['kernel_call_s']:.0f} us per kernel call"
    )


_COLUMNS = [
    ("model", "model", "{}"),
    ("cached", "C", "{}"),
    ("new", "T", "{}"),
    ("new_fraction", "T/(T+C)", "{:.3f}"),
    ("pass_q_threshold", "pass-Q below", "{:.3f}"),
    ("strategy", "strategy", "{}"),
    ("ms_median", "ms/call", "{:.2f}"),
    ("ms_p10", "p10", "{:.2f}"),
    ("ms_p90", "p90", "{:.2f}"),
    ("travel_MB_per_rank", "MB travel/rank", "{:.3f}"),
    ("return_MB_per_rank", "MB return/rank", "{:.3f}"),
    ("model_ms", "model ms", "{:.2f}"),
    ("model_error_pct", "vs model %", "{:+.0f}"),
    ("auto_pick", "auto picks", "{}"),
    ("fastest", "fastest", "{}"),
    ("max_error", "max err", "{:.1e}"),
]
"""(row key, header, format) of the table's columns (``report.cell``)."""


def _cells(row: dict[str, Any]) -> list[str]:
    mb = {f"{f}_MB_per_rank": row[f"{f}_bytes_per_rank"] / 1e6 for f in ("travel", "return")}
    return report.cells({**row, **mb}, _COLUMNS)


def _pick_lines(rows: list[dict[str, Any]]) -> list[str]:
    return [
        f"auto ({r['model']}, C={r['cached']}, T={r['new']}): picks {r['auto_pick']}; measured "
        f"fastest {r['fastest']}; {'hit' if r['pick_within_10pct'] else 'MISS'} (within 10%)"
        for r, *_ in report.group_by(rows, _case_key)
    ]
