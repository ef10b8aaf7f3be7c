"""``tokenring simulate``: the simulator's command line (``tokenring.model.simulate``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenring.cli import (
    check_unique,
    given,
    int_at_least,
    mem_available_bytes,
    output_path,
    report,
)
from tokenring.cli.console import make_table, print_table, progress, rich_modules
from tokenring.cli.models import KNOWN_MODELS, add_hybrid_arguments, check_read
from tokenring.cli.plot import curves_figure, pyplot, timeline_figure, write_figure, write_trace
from tokenring.core.layout import Layout
from tokenring.core.schedule import AttentionShape, Pass, Strategy
from tokenring.model.costmodel import PRESETS, Hardware
from tokenring.model.simulate import (
    _PASSES,
    EVENT_MAX_WORLD_SIZE,
    VECTORISED_STRATEGIES,
    CallResult,
    PassResult,
    _check_plain_tail,
    _engine,
    simulate,
    strategy_schedule,
)
from tokenring.runtime.comm import Event
from tokenring.strategies.hybrid import HybridSpec
from tokenring.strategies.ring import LEND_MAX_WORLD_SIZE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokenring simulate``."""
    call = parser.add_argument_group("the call: model, sizes, strategies")
    add = call.add_argument
    add("--model", choices=sorted(KNOWN_MODELS), default="llama2-7b", help="attention shape preset")
    seq_help = "global sequence length(s) S in tokens (default: 131072)"
    add("--seq", type=int_at_least(1), nargs="+", default=[131072], help=seq_help)
    add("--world-size", type=int_at_least(1), nargs="+", default=[8], help="ranks P (default: 8)")
    rings, names = [s.value for s in Strategy if s.is_ring], [s.value for s in Strategy]
    strategies_help = "strategies to predict (default: the ring strategies)"
    add("--strategies", nargs="+", default=rings, choices=names, help=strategies_help)
    inner_help = "ranks per island of the hybrid (default: the hardware's devices per node)"
    add_hybrid_arguments(call, help=inner_help)
    dtype_help = "input dtype; the presets' FLOP/s are for 16-bit inputs"
    add("--dtype", default="bfloat16", choices=["float16", "bfloat16"], help=dtype_help)
    pass_help = "forward, backward, or both = training"
    add("--pass", dest="passes", choices=sorted(_PASSES), default="forward", help=pass_help)
    layout_help = "auto: zigzag for causal models, contiguous otherwise"
    add("--layout", choices=["auto", *(m.value for m in Layout)], default="auto", help=layout_help)
    add("--batch", type=int_at_least(1), default=1, help="batch size B")
    add("--splits", type=int_at_least(1), default=2, help="TokenRing last_block_splits")
    lend_help = (
        "TokenRing lends its last pair to the q owner (last_pair='lend'; Note [Borrowed last pair])"
    )
    add("--lend-last-pair", action="store_true", help=lend_help)
    add = parser.add_argument_group("the machine and the simulator").add_argument
    add("--hardware", choices=sorted(PRESETS), default="h100-nvswitch", help="machine preset")
    mode_help = f"simulator engine; auto: event up to {EVENT_MAX_WORLD_SIZE} ranks, else vectorised"
    add("--mode", choices=["auto", "event", "vectorised"], default="auto", help=mode_help)
    add = parser.add_argument_group("output").add_argument
    add("--json", action="store_true", help="print one JSON object per row instead of a table")
    for flag, text in {
        "--plot": "PNG of time per call vs sequence length (or world size) per strategy; at one "
        "point, bars relative to the best strategy",
        "--timeline": "PNG of the simulated per-rank timelines (first P and S; event engine)",
        "--trace": "the --timeline as a Chrome/Perfetto trace JSON (chrome://tracing, "
        "ui.perfetto.dev)",
    }.items():
        add(flag, type=output_path, metavar="PATH", help=text)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Config:
    """The CLI's arguments, validated."""

    model: str  # a key of KNOWN_MODELS
    hardware: Hardware
    shape: AttentionShape
    layout: Layout
    causal: bool  # the model's
    points: tuple[tuple[int, int, int], ...]  # (P, S rounded down to what the layout splits, S)
    hybrid: HybridSpec | None = None  # when the hybrid is requested
    notes: tuple[str, ...] = ()  # said before the rows: what the run changed of the request


def _config(args: argparse.Namespace) -> _Config:
    model = KNOWN_MODELS[args.model]
    layout = Layout.parse(
        args.layout if args.layout != "auto" else ("zigzag" if model.causal else "contiguous")
    )
    parts = {p: p * (2 if layout is Layout.ZIGZAG else 1) for p in args.world_size}
    points = [(p, seq // parts[p] * parts[p], seq) for p in args.world_size for seq in args.seq]
    hybrid = None
    if Strategy.HYBRID.value in args.strategies:
        inner = args.hybrid_inner or PRESETS[args.hardware].devices_per_node
        if inner is None:
            raise ValueError(
                f"--hybrid-inner must be given for the hybrid on {args.hardware!r} (it has no "
                "islands to default to)"
            )
        hybrid = HybridSpec(inner=inner, outer_strategy=args.hybrid_outer)
    for world_size, seq, requested in points:
        if seq < 1:
            raise ValueError(
                f"--seq must be at least {parts[world_size]} for layout '{layout.value}' with "
                f"world size {world_size}; got {requested}"
            )
    return _Config(
        hybrid=hybrid,
        model=args.model,
        hardware=PRESETS[args.hardware],
        shape=dataclasses.replace(model.shape, batch=args.batch, dtype=args.dtype),
        layout=layout,
        causal=model.causal,
        points=tuple(points),
    )


def _row(
    cfg: _Config, args: argparse.Namespace, seq: int, requested: int, result: CallResult
) -> dict[str, Any]:
    first = result.passes[0]
    strategy = result.strategy.value
    if result.strategy is Strategy.HYBRID and cfg.hybrid is not None:
        strategy = f"hybrid {cfg.hybrid.label(first.world_size)}"
    return {
        "strategy": strategy,
        "model": cfg.model,
        "hardware": cfg.hardware.name,
        "world_size": first.world_size,
        "seq": seq,
        "seq_requested": requested,
        "layout": cfg.layout.value,
        "causal": cfg.causal,
        "dtype": cfg.shape.dtype,
        "batch": cfg.shape.batch,
        "pass": args.passes,
        "mode": first.mode,
        "call_ms": 1e3 * result.call_s,
        "steady_step_ms": _per_pass(result, lambda p: 1e3 * p.steady_step_s),
        "compute_only_ms": 1e3 * sum(p.compute_s for p in result.passes),
        "merge_ms": 1e3 * sum(p.merge_s for p in result.passes),
        "busiest_resource": _per_pass(result, lambda p: p.busiest_resource),
        "busiest_gb": sum(p.busiest_bytes for p in result.passes) / 1e9,
        "exposed_ms": 1e3 * sum(p.exposed_s for p in result.passes),
        "travel_gb_per_rank": sum(p.travel_bytes for p in result.passes) / 1e9,
        "return_gb_per_rank": sum(p.return_bytes for p in result.passes) / 1e9,
        "bound_ms": 1e3 * result.bound_s,
        "percent_of_bound": result.percent_of_bound,
        "lend_last_pair": _lends_at(args, result.strategy.value, first.world_size),
        "bound_by": _bound_by(result),
        "step_ms": _per_pass(result, lambda p: [1e3 * x for x in p.step_s]),
        "transfer_ms": _per_pass(result, _transfer_ms),
    }


def _per_pass(result: CallResult, value: Callable[[PassResult], Any]) -> Any:
    """``value`` of the call's one pass, or ``{pass: value}`` for each of its passes
    (``--pass both``: the forward's alone was given for the whole call)."""
    if len(result.passes) == 1:
        return value(result.passes[0])
    return {p.pass_.value: value(p) for p in result.passes}


def _bound_by(result: CallResult) -> str:
    """What bounds each pass of the call (``bound_ms`` is the sum of the passes' bounds): one
    word when every pass says the same, else each pass's (``--pass both``: a comm-bound
    forward and a compute-bound backward were said "comm" from the forward alone)."""

    def one(p: PassResult) -> str:
        return "compute" if p.compute_s >= p.busiest_s else f"comm ({p.busiest_resource})"

    said = [one(p) for p in result.passes]
    if len(set(said)) == 1:
        return said[0]
    return ", ".join(f"{p.pass_.value} {word}" for p, word in zip(result.passes, said, strict=True))


def _transfer_ms(result: PassResult) -> dict[str, list[float]] | None:
    """Per payload, per step: the longest transfer of that step (start to arrival), in ms. A
    pass has ``len(step_s)`` steps, which is not the world size for the hybrid (its inner
    all-to-alls' steps beside the outer ring's)."""
    if result.timeline is None:
        return None
    longest: dict[str, list[float]] = {}
    for events in result.timeline:
        for ev in events:
            if ev.kind == "send":
                steps = longest.setdefault(ev.label, [0.0] * len(result.step_s))
                steps[ev.step] = max(steps[ev.step], 1e3 * (ev.end_s - ev.start_s))
    return longest


def _predict(
    cfg: _Config, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[CallResult], list[str]]:
    """Rows, results, and one note per (strategy, point) the simulator cannot predict."""
    jobs = [(p, s, r, name) for p, s, r in cfg.points for name in args.strategies]
    rows: list[dict[str, Any]] = []
    results: list[CallResult] = []
    notes: list[str] = []
    bar = None if args.json else progress(len(jobs), "simulating")
    with bar or contextlib.nullcontext():
        for world_size, seq, requested, name in jobs:
            if bar is not None:
                bar.update(bar.task_ids[0], description=f"P={world_size} S={seq} {name}")
            try:  # a hybrid that does not fit this world size: ValueError, a note
                result = simulate(
                    name,
                    passes=args.passes,
                    layout=cfg.layout,
                    causal=cfg.causal,
                    world_size=world_size,
                    seq_local=seq // world_size,
                    shape=cfg.shape,
                    hardware=cfg.hardware,
                    last_block_splits=args.splits,
                    mode=args.mode,
                    hybrid=cfg.hybrid,
                    lend_last_pair=args.lend_last_pair,
                )
            except (NotImplementedError, ValueError) as exc:
                if isinstance(exc, ValueError) and name != Strategy.HYBRID.value:
                    raise
                notes.append(f"{name} at P={world_size} not predicted: {exc}")
            else:
                results.append(result)
                rows.append(_row(cfg, args, seq, requested, result))
            if bar is not None:
                bar.advance(bar.task_ids[0])
    return rows, results, notes


_COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("world_size", "P", "{}"),
    ("seq", "S (tokens)", "{}"),
    ("call_ms", "call (ms)", "{:.4g}"),
    ("steady", "steady step (ms)", "{}"),
    ("compute_only_ms", "compute only (ms)", "{:.4g}"),
    ("merge_ms", "merges (ms)", "{:.3g}"),
    ("gb", "travel / return (GB/rank)", "{}"),
    ("bound_ms", "bound (ms)", "{:.4g}"),
    ("percent_of_bound", "% of bound", "{:.1f}"),
    ("bound_by", "bound by", "{}"),
]
"""(row key, header, format) of the table's columns (``report.cell``)."""


def _print_table(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    engines = ", ".join(sorted({r["mode"] for r in rows}))
    title = (
        f"{first['model']} on {first['hardware']}: {first['dtype']}, {first['layout']}, "
        f"causal={first['causal']}, pass={first['pass']}, engine={engines}"
    )
    headers = [header for _, header, _ in _COLUMNS]
    table = make_table(title, headers, right=headers[1:-1])
    for row in rows:
        gb = f"{row['travel_gb_per_rank']:.3g} / {row['return_gb_per_rank']:.3g}"
        steady = row["steady_step_ms"]  # --pass both: forward / backward
        each = steady.values() if isinstance(steady, dict) else [steady]
        steady = " / ".join(f"{ms:.4g}" for ms in each)
        table.add_row(*report.cells({**row, "gb": gb, "steady": steady}, _COLUMNS))
    print_table(table)
    rounded = sorted({(r["seq_requested"], r["seq"], r["world_size"]) for r in rows})
    for requested, seq, world_size in rounded:
        if requested != seq:
            print(
                f"S={requested} rounded down to {seq}, a multiple the layout "
                f"'{first['layout']}' splits over {world_size} ranks"
            )
    if any(r["mode"] == "vectorised" for r in rows):
        print(
            "engine 'vectorised': the rank programs, every rank at once "
            f"(P > {EVENT_MAX_WORLD_SIZE} or --mode vectorised), no per-event timeline"
        )


def _timeline_panels(results: list[CallResult]) -> list[tuple[str, list[list[Event]]]]:
    """Every pass at the first (P, S), for ``--timeline`` and ``--trace``."""
    first = results[0].passes[0]
    panels = []
    for res in results:
        for res_pass in res.passes:
            if (res_pass.world_size, res_pass.seq_local) != (first.world_size, first.seq_local):
                continue
            if res_pass.timeline is None:
                raise ValueError(
                    f"--timeline and --trace need the event engine (world size <= "
                    f"{EVENT_MAX_WORLD_SIZE} and --mode auto or event)"
                )
            title = (
                f"{res_pass.strategy.value} {res_pass.pass_.value} (simulated): "
                f"{1e3 * res_pass.call_s:.3f} ms, {res_pass.percent_of_bound:.0f}% of bound"
            )
            panels.append((title, [list(events) for events in res_pass.timeline]))
    return panels


_VECTORISED = {s.value for s in VECTORISED_STRATEGIES}
_EVENT_BYTES_PER_CELL = 5 << 10
"""Memory of the event engine per (rank, step) of one pass: the Schedule's pieces and
transfers and the timeline's events (measured for a TokenRing forward pass)."""


def _check_something_predictable(cfg: _Config, args: argparse.Namespace) -> None:
    """Raise ValueError when no (strategy, world size) can be predicted for a reason known
    before simulating: a hybrid that does not fit, an engine that cannot run the strategy
    (one that can is predicted; one that cannot at some world sizes only gets a note)."""
    reasons = []
    for (world_size, _, _), name in itertools.product(cfg.points, args.strategies):
        try:
            if name == Strategy.HYBRID.value:
                assert cfg.hybrid is not None
                heads = dict(heads_q=cfg.shape.heads_q, heads_kv=cfg.shape.heads_kv)
                cfg.hybrid.check(world_size=world_size, **heads)
            if _engine(args.mode, Strategy.parse(name), world_size) == "vectorised":
                _check_vectorised_lending(cfg, args, name, world_size)
        except (ValueError, NotImplementedError) as exc:
            reasons.append(f"{name} at P={world_size}: {exc}")
        else:
            return
    raise ValueError(
        f"--strategies {' '.join(args.strategies)} cannot be predicted at --world-size "
        f"{' '.join(map(str, args.world_size))} under --mode {args.mode}: " + "; ".join(reasons)
    )


def _check_vectorised_lending(
    cfg: _Config, args: argparse.Namespace, name: str, world_size: int
) -> None:
    """NotImplementedError where the vectorised engine would be asked for a TokenRing that
    lends its last pair (whether it lends is the schedule's choice, by heads: Note [Borrowed
    last pair]); found here, so that the run is refused before simulating anything."""
    if _lends_at(args, name, world_size):
        _check_plain_tail(
            strategy_schedule(
                name,
                Pass.FORWARD,
                layout=cfg.layout,
                causal=cfg.causal,
                world_size=world_size,
                seq_local=max(1, cfg.points[0][1] // world_size),
                heads_q=cfg.shape.heads_q,
                heads_kv=cfg.shape.heads_kv,
                last_block_splits=args.splits,
                lend_last_pair=True,
            )
        )


def _last_block_slices(cfg: _Config, name: str, world_size: int, seq: int, splits: int) -> int:
    """The most slices one lane's last block of ``name`` has with ``last_block_splits=splits``
    (the library slices by K/V head, by query head with one K/V head, or by row of a single
    unmasked piece, Note [Last block by heads]: fewer than asked where it runs out). Counted in
    the forward schedule, at ``world_size`` or, beyond the event engine's sizes, at the
    smallest the strategy runs on (the heads of a slice do not depend on P)."""
    p = world_size
    if p > EVENT_MAX_WORLD_SIZE:
        p = 2 * cfg.hybrid.inner if cfg.hybrid is not None and name == "hybrid" else 2
    sched = strategy_schedule(
        name,
        Pass.FORWARD,
        layout=cfg.layout,
        causal=cfg.causal,
        world_size=p,
        seq_local=seq // world_size,
        heads_q=cfg.shape.heads_q,
        heads_kv=cfg.shape.heads_kv,
        last_block_splits=splits,
        hybrid=cfg.hybrid,
    )
    per_lane: Counter[tuple[int, int, int]] = Counter()  # (rank, step, lane) -> segments
    for steps in sched.steps:
        for plan in steps:
            for segment in plan.segments:
                for lane in {piece.lane for piece in segment.pieces}:
                    per_lane[plan.rank, plan.step, lane] += 1
    return max(per_lane.values(), default=1)


def _check_splits(cfg: _Config, args: argparse.Namespace, slicers: list[str]) -> tuple[str, ...]:
    """Notes for the strategies that slice their last block in fewer than ``--splits`` slices
    (a larger value gives the same slices); ValueError when none of them takes the value."""
    most: dict[str, int] = {}
    for name, (p, seq, _) in itertools.product(slicers, cfg.points):
        try:  # a point the strategy cannot run is said elsewhere (a note, or refused)
            n = _last_block_slices(cfg, name, p, seq, args.splits)
        except (ValueError, NotImplementedError):
            continue
        most[name] = max(most.get(name, 0), n)
    fewer = {name: n for name, n in most.items() if n < args.splits}
    if not fewer:  # (or nothing predictable: refused by _check_something_predictable)
        return ()
    said = ", ".join(f"{name} {n}" for name, n in fewer.items())
    why = (
        f"{cfg.model} has {cfg.shape.heads_kv} K/V and {cfg.shape.heads_q} query heads; "
        "the last block is sliced by head (Note [Last block by heads])"
    )
    if len(fewer) == len(most):
        raise ValueError(
            f"--splits {args.splits} is more slices than the last block has (at most: {said}; "
            f"per lane of a two-way ring): {why}; a larger value gives the same slices"
        )
    return tuple(
        f"--splits {args.splits}: {name} slices its last block in at most {n} (per lane), "
        f"predicted with {n}; {why}"
        for name, n in fewer.items()
    )


def _lends_at(args: argparse.Namespace, name: str, world_size: int) -> bool:
    """Whether the row of ``name`` at ``world_size`` is predicted lending TokenRing's last pair
    (the runtime lends up to LEND_MAX_WORLD_SIZE ranks: Note [Borrowed last pair])."""
    lends = args.lend_last_pair and name == Strategy.TOKEN_RING.value
    return lends and world_size <= LEND_MAX_WORLD_SIZE


def _check_lending(args: argparse.Namespace) -> tuple[str, ...]:
    """A note for the world sizes beyond those TokenRing lends its last pair at (predicted
    with the plain tail); ValueError when that is every one of them."""
    beyond = [p for p in args.world_size if p > LEND_MAX_WORLD_SIZE]
    if not beyond:
        return ()
    why = (
        f"TokenRing lends its last pair up to {LEND_MAX_WORLD_SIZE} ranks and returns it "
        "beyond (Note [Borrowed last pair])"
    )
    if len(beyond) == len(args.world_size):
        raise ValueError(
            f"--lend-last-pair changes nothing at --world-size {' '.join(map(str, beyond))}: {why}"
        )
    return (
        f"--lend-last-pair: at --world-size {' '.join(map(str, beyond))} predicted returning "
        f"the last pair: {why}",
    )


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before simulating; ValueError naming the argument (Note [Bad
    input at the command line] in tokenring.cli). Keeps the config on ``args`` for run."""
    for flag in ("--seq", "--world-size", "--strategies"):
        check_unique(flag, getattr(args, flag[2:].replace("-", "_")))
    cfg = _config(args)
    pass_q = [s.value for s in (Strategy.TOKEN_RING, Strategy.BIDIR_TOKEN_RING)]
    if given(args, "hybrid_inner", "hybrid_outer"):
        check_read("--hybrid-inner/--hybrid-outer", args.strategies, [Strategy.HYBRID.value])
    if given(args, "splits"):  # the hybrid's outer ring slices too when it passes Q
        hybrid = [Strategy.HYBRID.value] if args.hybrid_outer in pass_q else []
        check_read("--splits", args.strategies, pass_q + hybrid)
    if given(args, "lend_last_pair"):
        check_read("--lend-last-pair", args.strategies, [Strategy.TOKEN_RING.value])
    _check_something_predictable(cfg, args)
    if given(args, "splits"):
        slicers = [name for name in args.strategies if name in pass_q + hybrid]
        cfg = dataclasses.replace(cfg, notes=_check_splits(cfg, args, slicers))
    if args.lend_last_pair:
        cfg = dataclasses.replace(cfg, notes=(*cfg.notes, *_check_lending(args)))
    first = args.world_size[0]
    why = "--mode vectorised" if args.mode == "vectorised" else None
    if args.mode == "auto" and first > EVENT_MAX_WORLD_SIZE:
        why = f"--world-size {first} > {EVENT_MAX_WORLD_SIZE} under --mode auto"
    for flag in ("--plot", "--timeline"):  # drawn after simulating
        path = getattr(args, flag[2:])
        if path is not None:
            try:
                pyplot()
            except ImportError as exc:
                raise ValueError(f"{flag} {path}: {exc}") from None
    if (args.timeline or args.trace) and why:
        raise ValueError(
            f"--timeline and --trace need the event engine; got {why}: use --mode event or "
            "a smaller first --world-size"
        )
    # The event engine's memory grows with P^2 and every result keeps its timeline; the
    # vectorised engine's is linear in P (Note [Vectorised engine]).
    event_points = [
        p for p, _, _ in cfg.points if args.mode == "event" or p <= EVENT_MAX_WORLD_SIZE
    ]
    passes = len(_PASSES[args.passes])
    need = sum(p * p for p in event_points) * passes * len(args.strategies) * _EVENT_BYTES_PER_CELL
    available = mem_available_bytes()
    if available is not None and need > available:
        biggest = max(event_points)
        raise ValueError(
            f"--mode event at --world-size {biggest} needs about {need / 2**30:.3g} GiB "
            f"(~{_EVENT_BYTES_PER_CELL >> 10} KiB per rank and step, {passes} pass(es), "
            f"{len(args.strategies)} strategies); MemAvailable is {available / 2**30:.3g} GiB. "
            "Use --mode auto or vectorised (memory linear in P) for large world sizes"
        )
    _check_vectorised_work(cfg, args, passes)
    args._config = cfg


_VECTORISED_MAX_CELLS = 1 << 28
"""The most (rank, step) cells, over every vectorised point, strategy and pass, that a run may
replay: the vectorised engine's time grows with P^2 (about 4 us per cell on two CPU cores,
so ~20 minutes here); --world-size 100000 (1e10 cells) ran for hours with nothing to show."""


def _check_vectorised_work(cfg: _Config, args: argparse.Namespace, passes: int) -> None:
    """ValueError when the vectorised engine would replay more than _VECTORISED_MAX_CELLS."""
    points = [p for p, _, _ in cfg.points if args.mode == "vectorised" or p > EVENT_MAX_WORLD_SIZE]
    vectorised = [name for name in args.strategies if Strategy.parse(name).value in _VECTORISED]
    cells = sum(p * p for p in points) * passes * len(vectorised)
    if cells > _VECTORISED_MAX_CELLS:
        raise ValueError(
            f"--world-size {max(points)} is about {cells:.3g} (rank, step) cells for the "
            f"vectorised engine ({', '.join(vectorised)}, {passes} pass(es), P^2 per world "
            f"size); at most {_VECTORISED_MAX_CELLS:.3g} (~{_VECTORISED_MAX_CELLS >> 20}M, "
            "minutes of replay): lower --world-size, or predict fewer sizes or strategies"
        )


def run(args: argparse.Namespace) -> int:
    """Run ``tokenring simulate``; returns the exit status.

    Raises:
        ValueError: bad sizes (sequence lengths are rounded down to what the layout splits).
        ImportError: rich (the table) missing, naming the extra (check_args refuses --plot and
            --timeline without matplotlib).

    No requested strategy predicted at these world sizes (``check_args`` refuses what it can
    know before simulating, a lent last pair under ``--mode vectorised`` included): the notes,
    then status 1.
    """
    cfg: _Config = args._config
    if not args.json:
        rich_modules()  # fail before any work when the table cannot be printed
    rows, results, notes = _predict(cfg, args)
    for note in [*cfg.notes, *notes]:  # never drop a strategy or a value silently
        print(note, file=sys.stderr if args.json else sys.stdout)
    if not rows:
        print("tokenring simulate: error: no strategy could be predicted", file=sys.stderr)
        return 1
    if args.json:
        for row in rows:
            print(report.json_line(row, sort_keys=True))
    else:
        _print_table(rows)
    if args.plot:
        write_figure(curves_figure(rows), args.plot, dpi=120)
    if args.timeline:
        first = results[0].passes[0]
        title = f"P={first.world_size}, {first.seq_local} tokens per rank, {cfg.hardware.name}"
        write_figure(timeline_figure(_timeline_panels(results), title), args.timeline)
    if args.trace:
        write_trace(_timeline_panels(results), args.trace)
    for path in (args.plot, args.timeline, args.trace):
        if path and not args.json:
            print(f"wrote {path}")
    return 0
