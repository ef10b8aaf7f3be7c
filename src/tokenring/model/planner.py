"""Choosing a strategy: ``strategy="auto"``, ``explain(...)`` and calibration.

This module owns the *decision*: it predicts every strategy (and layout) with the simulator on
a hardware description, picks the fastest and says why; :func:`calibrate` measures the local
machine and agrees the numbers across ranks, so every rank picks the same strategy.

Legend: B batch, s local seq, Hq query heads, Hkv key/value heads, D head dim, P world size.

Note [Choosing]
~~~~~~~~~~~~~~~
For every candidate (strategy, layout) the simulator predicts the forward pass, and the
backward too when training; the pick is the smallest predicted total. Ties (within a relative
1e-9) go to the earlier candidate in ``Strategy`` then ``Layout`` declaration order, so equal
inputs give equal picks everywhere. Where the links set the pace, the busiest direction
carries per row and step::

    TokenRing   Hq*D*e + Hq*4   (partial out + lse; q alone is Hq*D*e)
    Ring        2*Hkv*D*e       (k and v)

so TokenRing wins comm-bound MHA (ratio ~1/2) and Ring wins comm-bound GQA with Hq/Hkv > 2;
compute-bound shapes tie on kernel time and the rest (exposed last return, merges) decides.
TokenRing enters as the faster of lending its last pair (Note [Borrowed last pair] in
tokenring.strategies.ring) or not: ``last_pair="auto"``.

Note [Which candidates]
~~~~~~~~~~~~~~~~~~~~~~~
- Ulysses and all-gather K/V are candidates only where the model of their collectives was
  checked against measurements: ``Hardware.collectives`` GLOO (the lab;
  benchmarks/results/README.md); with DIRECT (NCCL) they are skipped with that reason.
- The hybrid needs its factorisation and a 2-D mesh (``tokenring.hybrid_attn``):
  :func:`explain` predicts it given a ``hybrid`` spec; :func:`choose_strategy` never picks it.

Note [Pricing the mask]
~~~~~~~~~~~~~~~~~~~~~~~
A call's window, documents (``cu_seqlens``) and chunks are priced as each strategy runs them
(Note [Masked calls] in tokenring.model.simulate): the rings on their masked schedules (blocks
nobody sees are neither computed nor sent, rows trimmed to what is seen), Ulysses and
all-gather K/V on their unchanged messages with the kernel tiles their mask leaves. So a
sliding window of w << S prices each ring at its neighbours' blocks, not at S^2, and the pick
can differ from the plain call's (tests/test_planner_masks.py). The plain call is priced,
bit for bit as without the keywords, where the mask is plain (no window, one document:
padding alone is not priced) and where the vectorised engine runs (world_size above
EVENT_MAX_WORLD_SIZE with mode "auto", or mode "vectorised": its columns hold plain masks);
the reason says which. The inputs are the call's agreed signature (window, documents' digest,
chunk size, seq_len), so every rank prices the same call.

``strategy="auto"`` and ``last_pair="auto"`` price a call's window and chunks, which a model
fixes, but not its documents, which change with every packed batch: a plan is cached per
distinct input, and pricing each batch's documents would replan every step (0.14 s on 8
ranks of 4096 rows and 16 documents, 1.4 s on 32 ranks, first call). They price the padded
rows every rank holds, as before; ``explain(cu_seqlens=...)`` prices one batch's documents.

Note [Calibration probe]
~~~~~~~~~~~~~~~~~~~~~~~~
All ranks run the same probe through the caller's ``Communicator``::

    probe       every rank sends                      measures
    kernel      (local) block forward and backward     FLOP/s per pass
    merge       (local) merge_into of a block          memory bandwidth, as the model prices it
    one-way     probe_bytes to r-1 (travel group)      link bandwidth per direction
    two-way     to r-1 (travel) and r+1 (return)       whether flows share a device port
    ping        a few bytes to r-1                     latency

then one ``all_reduce(MAX)`` over (-rates, +latency) gives every rank the slowest rank's
numbers. Two-way flows at under 3/4 of the one-way rate mean a shared port (SWITCH, port =
2 x two-way rate); otherwise MESH. A RING looks like a MESH to neighbour probes: pass
``topology="ring"`` when you know it is one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tokenring.core.enums import parse_enum
from tokenring.core.layout import Layout, is_int
from tokenring.core.merge import merge_into
from tokenring.core.schedule import (
    AttentionShape,
    Pass,
    Payload,
    Piece,
    Strategy,
    Transfer,
    dtype_name,
    piece_flops,
)
from tokenring.model.costmodel import (
    PRESETS,
    CollectiveRouting,
    Hardware,
    Topology,
    measured,
    merge_bytes,
    preset,
)
from tokenring.model.simulate import (
    EVENT_MAX_WORLD_SIZE,
    CallMask,
    call_mask,
    max_sent,
    simulate,
    simulate_cached,
    simulate_pass,
    strategy_schedule,
)
from tokenring.runtime.comm import Communicator, TrafficCounter
from tokenring.runtime.kernels import BlockKernel, row_delta, select_kernel
from tokenring.strategies.cached import (
    CachedPlan,
    CachedShards,
    CachedStrategy,
    build_cached_plan,
    uniform_shards,
)
from tokenring.strategies.hybrid import HybridSpec

__all__ = [
    "CachedChoice",
    "CachedPrediction",
    "Plan",
    "Prediction",
    "calibrate",
    "choose_cached_strategy",
    "choose_strategy",
    "choose_zigzag_prefill",
    "explain",
    "explain_cached",
    "lends_last_pair",
    "pass_q_threshold",
    "predict_cached",
]

_log = logging.getLogger(__name__)
_VALIDATED_ROUTINGS = frozenset({CollectiveRouting.GLOO})
_UNVALIDATED = (
    "not validated: the model of the {routing!r} collective routing has not been checked "
    "against measurements (only 'gloo' has, on the lab), so auto does not pick it"
)
_NO_SPEC = (
    "needs a 2-D mesh and its factorisation: pass hybrid=HybridSpec(inner=..., "
    "outer_strategy=...) to explain, and run it with tokenring.hybrid_attn"
)
_TIE = 1e-9
# last_pair -> lend TokenRing's last pair or not; "auto" keeps the faster (ties: not lending)
_LENDS = {"return": (False,), "lend": (True,), "auto": (False, True)}
LAST_PAIRS = tuple(_LENDS)
"""The values of ``last_pair`` (``sequence_parallel_attn``, :func:`explain`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """The predicted time of one candidate."""

    strategy: Strategy
    layout: Layout
    forward_s: float
    backward_s: float
    """0 when not training."""
    bound_by: str
    """``compute`` or ``comm (<busiest resource>)`` for the forward pass."""
    mode: str
    """Simulator engine: ``event`` or ``vectorised``."""
    hybrid: HybridSpec | None = None
    """The factorisation, for ``Strategy.HYBRID``."""
    lends_last_pair: bool = False
    """TokenRing: predicted with its last pair lent (Note [Borrowed last pair])."""
    travel_bytes: int = 0
    """Forward: the most bytes one rank sends on the travel flow (Q or K/V)."""
    return_bytes: int = 0
    """Forward: the most bytes one rank sends on the return flow (partials)."""

    @property
    def total_s(self) -> float:
        """Forward plus backward."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The planner's comparison as data (what ``explain`` returns)."""

    pick: Strategy
    """The fastest strategy for ``layout``."""
    layout: Layout
    """The layout the pick is for (the caller's, or the fastest when none was given)."""
    predictions: tuple[Prediction, ...]
    """Every candidate, in the fixed candidate order."""
    skipped: tuple[tuple[Strategy, str], ...]
    """Candidates the simulator cannot predict here, with the reason (also logged)."""
    reason: str
    """One sentence: times, ratio and what bounds the loser."""
    hardware: str
    """Name of the hardware description used."""
    world_size: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data."""
        return {
            "pick": self.pick.value,
            "layout": self.layout.value,
            "reason": self.reason,
            "hardware": self.hardware,
            "skipped": [{"strategy": s.value, "reason": why} for s, why in self.skipped],
            "predictions": [
                {
                    "strategy": p.strategy.value,
                    "layout": p.layout.value,
                    "forward_s": p.forward_s,
                    "backward_s": p.backward_s,
                    "total_s": p.total_s,
                    "bound_by": p.bound_by,
                    "mode": p.mode,
                    "hybrid": p.hybrid.label(self.world_size) if p.hybrid else None,
                    "lends_last_pair": p.lends_last_pair,
                    "travel_bytes": p.travel_bytes,
                    "return_bytes": p.return_bytes,
                }
                for p in self.predictions
            ],
        }


def _check_sizes(**sizes: int) -> None:
    """ValueError naming the first size that is not an int >= 1. Checked before the cached
    :func:`_plan`: 4.0 == 4 and True == 1 hash alike, so an unchecked float or bool would get
    the cached plan of its int (or the simulator's error on a cold cache)."""
    for name, value in sizes.items():
        if not is_int(value):
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1; got {value}")


@functools.lru_cache(maxsize=256)
def _plan(
    layouts: tuple[Layout, ...],
    strategies: tuple[Strategy, ...],
    hybrid: HybridSpec | None,
    last_pair: str,
    mask_note: str = "",
    **call: Any,
) -> Plan:
    """:func:`explain`'s comparison of ``simulate(**call)`` per candidate, cached per distinct
    input (Note [Choosing]); ``mask_note``: how the call's mask was priced ("": none given)."""
    predictions = []
    skipped: list[tuple[Strategy, str]] = []
    hardware = call["hardware"]
    for strategy in strategies:
        if strategy.is_collective and hardware.collectives not in _VALIDATED_ROUTINGS:
            skipped.append((strategy, _UNVALIDATED.format(routing=hardware.collectives.value)))
            continue
        if strategy is Strategy.HYBRID and hybrid is None:
            skipped.append((strategy, _NO_SPEC))
            continue
        spec = hybrid if strategy is Strategy.HYBRID else None
        lends = _LENDS[last_pair] if strategy is Strategy.TOKEN_RING else (False,)
        predictions += _predict(strategy, layouts, lends, skipped, hybrid=spec, **call)
    if not predictions:
        reasons = "; ".join(reason for _, reason in skipped)
        raise NotImplementedError(f"no candidate strategy can be predicted here: {reasons}")
    best = _fastest(predictions)
    reason = _reason(best, predictions, call) + mask_note
    _log.info("tokenring planner: %s", reason)
    for strategy, why in skipped:
        _log.info("tokenring planner: %s not predicted: %s", strategy.value, why)
    return Plan(
        pick=best.strategy,
        layout=best.layout,
        predictions=tuple(predictions),
        skipped=tuple(skipped),
        reason=reason,
        hardware=hardware.name,
        world_size=call["world_size"],
    )


def _predict(
    strategy: Strategy,
    layouts: tuple[Layout, ...],
    lends: tuple[bool, ...],
    skipped: list[tuple[Strategy, str]],
    **call: Any,
) -> list[Prediction]:
    """Per layout, the faster of ``strategy``'s variants (``simulate(**call)`` lending TokenRing's
    last pair or not); ``skipped``: the first reason for none."""
    predictions = []
    for layout in layouts:
        variants: list[Prediction] = []
        for lend in lends:
            try:
                result = simulate(strategy, layout=layout, lend_last_pair=lend, **call)
            except NotImplementedError as exc:
                if layout is layouts[0] and not variants:
                    skipped.append((strategy, str(exc)))
                continue
            fwd = result.passes[0]
            comm = f"comm ({fwd.busiest_resource})"
            variants.append(
                Prediction(
                    strategy=strategy,
                    layout=layout,
                    forward_s=fwd.call_s,
                    backward_s=sum((p.call_s for p in result.passes[1:]), 0.0),
                    bound_by="compute" if fwd.compute_s >= fwd.busiest_s else comm,
                    mode=fwd.mode,
                    hybrid=call["hybrid"],
                    lends_last_pair=lend,
                    travel_bytes=fwd.travel_bytes,
                    return_bytes=fwd.return_bytes,
                )
            )
        if variants:
            predictions.append(_fastest(variants))
    return predictions


_P = TypeVar("_P", "Prediction", "CachedPrediction")


def _fastest(predictions: Sequence[_P]) -> _P:
    """The fastest prediction, ties to the earlier (Note [Choosing])."""
    best = predictions[0]
    for cand in predictions[1:]:
        if cand.total_s < best.total_s * (1 - _TIE):
            best = cand
    return best


def _reason(best: Prediction, predictions: list[Prediction], call: dict[str, Any]) -> str:
    """One sentence on why ``best`` is the pick (``call``: the simulated call)."""
    shape, hardware = call["shape"], call["hardware"]
    others = [p for p in predictions if p is not best and p.layout is best.layout]
    if others:
        runner = min(others, key=lambda p: p.total_s)
        ratio = runner.total_s / best.total_s if best.total_s > 0 else 1.0
        reason = (
            f"{best.strategy.value} ({best.layout.value}) predicted {1e3 * best.total_s:.4g} ms"
            f" vs {runner.strategy.value} {1e3 * runner.total_s:.4g} ms ({ratio:.2f}x) on "
            f"{hardware.name}, P={call['world_size']}, s={call['seq_local']}; "
            f"{runner.strategy.value} is bound "
            f"by {runner.bound_by}; busiest-direction bytes per row: token_ring "
            f"{shape.row_bytes(Payload.OUT)}, ring {shape.row_bytes(Payload.KV)} "
            f"(Hq/(2*Hkv) = {shape.heads_q / (2 * shape.heads_kv):.2f})"
        )
    else:
        reason = (
            f"{best.strategy.value} ({best.layout.value}) is the only candidate: "
            f"{1e3 * best.total_s:.4g} ms on {hardware.name}"
        )
    if best.lends_last_pair:
        reason += "; TokenRing lends its last pair (Note [Borrowed last pair])"
    return reason


def explain(
    *,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    causal: bool,
    hardware: Hardware | str,
    layout: Layout | str | None = None,
    training: bool = False,
    batch: int = 1,
    strategies: Sequence[Strategy | str] | None = None,
    last_block_splits: int = 2,
    mode: str = "auto",
    hybrid: HybridSpec | None = None,
    last_pair: str = "auto",
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> Plan:
    """Predict every candidate strategy (and layout) and pick the fastest; see Note [Choosing],
    Note [Which candidates] and Note [Pricing the mask].

    Args:
        world_size, seq_local, heads_q, heads_kv, head_dim, dtype, causal, batch: the call.
        hardware: a preset or its name (``costmodel.PRESETS``), ``measured(...)`` or
            :func:`calibrate`'s.
        layout: the caller's layout; None compares every layout ``seq_local`` allows.
        training: also predict the backward pass (the pick minimises forward + backward).
        strategies: candidates (default: every ``Strategy``), kept in ``Strategy`` order.
        last_block_splits: as ``sequence_parallel_attn``.
        mode: simulator engine (``auto``, ``event``, ``vectorised``).
        hybrid: the factorisation to predict ``Strategy.HYBRID`` with (``strategies`` must
            include the hybrid); None: skipped.
        last_pair: TokenRing's last pair: ``"return"``, ``"lend"``
            (Note [Borrowed last pair]) or ``"auto"`` (the faster, as lends_last_pair says).
        window_size, attention_chunk_size, cu_seqlens: the call's mask, as
            ``sequence_parallel_attn``'s (Note [Pricing the mask]); ``cu_seqlens`` ends at the
            call's S, and the layout must shard it into ``seq_local`` (padded) rows per rank
            (None ``layout``: the layouts that do are compared).

    Returns:
        A :class:`Plan`; logged once at INFO per distinct input.

    Raises:
        ValueError: non-positive sizes, heads_kv not dividing heads_q, an unknown strategy,
            layout, ``last_pair`` or hardware preset, a non-bool ``causal`` or ``training``,
            a seq_local the layout cannot split, a dtype the hardware has no FLOP/s for,
            a ``hybrid`` that does not fit or that ``strategies`` leaves out, a bad
            ``window_size``, ``attention_chunk_size`` or ``cu_seqlens``, or ``cu_seqlens``
            that no candidate layout shards into ``seq_local`` rows per rank.
    """
    if last_pair not in _LENDS:
        raise ValueError(f"last_pair must be one of {LAST_PAIRS}; got {last_pair!r}")
    for name, flag in (("causal", causal), ("training", training)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool; got {flag!r}")
    hardware = _hardware(hardware)
    sizes = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, batch=batch)
    _check_sizes(world_size=world_size, seq_local=seq_local, **sizes)
    shape = AttentionShape(dtype=str(dtype), **sizes)
    hardware.flops_per_s("forward", shape.dtype)
    layouts, ordered = _candidates(layout, seq_local, strategies)
    if hybrid is not None:
        _check_hybrid(hybrid, ordered, world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)
    masking = dict(
        cu_seqlens=cu_seqlens, window_size=window_size, attention_chunk_size=attention_chunk_size
    )
    layouts, masked = _masked_layouts(layouts, causal, world_size, seq_local, masking)
    call = dict(causal=causal, world_size=world_size, seq_local=seq_local, shape=shape, mode=mode)
    call |= dict(hardware=hardware, last_block_splits=last_block_splits)
    call["passes"] = "both" if training else "forward"
    if masked is None:  # no window, at most one document: as before
        return _plan(layouts, ordered, hybrid, last_pair, **call)
    if mode == "event" or (mode == "auto" and world_size <= EVENT_MAX_WORLD_SIZE):
        note = f"; priced with its mask ({masked.describe()})"
        return _plan(layouts, ordered, hybrid, last_pair, note, **call, **masked.keywords)
    note = (
        f"; its mask ({masked.describe()}) not priced: the vectorised engine (mode "
        f"{mode!r}, world_size={world_size}) replays plain masks (Note [Pricing the mask])"
    )
    return _plan(layouts, ordered, hybrid, last_pair, note, **call)


def _masked_layouts(
    layouts: tuple[Layout, ...],
    causal: bool,
    world_size: int,
    seq_local: int,
    masking: dict[str, Any],
) -> tuple[tuple[Layout, ...], CallMask | None]:
    """The layouts that shard the call's documents into ``seq_local`` rows per rank (all
    without ``cu_seqlens``) and the call's mask (None: plain); ValueError (the first layout's)
    where none does or the mask is bad."""
    if all(value is None for value in masking.values()):
        return layouts, None
    kept: list[Layout] = []
    masks: list[CallMask | None] = []
    first_error: ValueError | None = None
    for lay in layouts:
        try:
            masks.append(call_mask(layout=lay, causal=causal, world_size=world_size,
                                   seq_local=seq_local, **masking))  # fmt: skip
        except ValueError as exc:
            first_error = first_error or exc
            continue
        kept.append(lay)
    if not kept:
        assert first_error is not None
        raise first_error
    return tuple(kept), masks[0]  # plain or not alike for every layout (same documents)


def _check_hybrid(
    hybrid: HybridSpec, ordered: Sequence[Strategy], *, world_size: int, heads_q: int, heads_kv: int
) -> None:
    """ValueError unless ``hybrid`` is a spec that fits the call and one of ``ordered``."""
    if not isinstance(hybrid, HybridSpec):
        raise ValueError(f"hybrid must be a HybridSpec or None; got {hybrid!r}")
    if Strategy.HYBRID not in ordered:
        raise ValueError(
            "strategies must include 'hybrid' when hybrid= is given (the spec only prices "
            f"that candidate); got strategies={[s.value for s in ordered]}, hybrid={hybrid!r}"
        )
    hybrid.check(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)


def _hardware(hardware: Hardware | str) -> Hardware:
    """``hardware`` itself, or the preset it names; ValueError for anything else."""
    if isinstance(hardware, str):
        return preset(hardware)
    if not isinstance(hardware, Hardware):
        raise ValueError(
            f"hardware must be a Hardware or a preset name (one of {sorted(PRESETS)}); got "
            f"{hardware!r}"
        )
    return hardware


def _check_strategies(
    strategies: Sequence[Strategy | CachedStrategy | str] | None, name: str = "strategies"
) -> None:
    """ValueError for a lone name or strategy where a sequence of them belongs ("ring" would be
    read as the names 'r', 'i', 'n', 'g')."""
    if isinstance(strategies, str | Strategy | CachedStrategy):
        raise ValueError(
            f"{name} must be a sequence of strategies or None; got {strategies!r} (use "
            f"[{strategies!r}])"
        )


def _candidates(
    layout: Layout | str | None, seq_local: int, strategies: Sequence[Strategy | str] | None
) -> tuple[tuple[Layout, ...], tuple[Strategy, ...]]:
    """The layouts and strategies to predict, each in declaration order (Note [Choosing])."""
    _check_strategies(strategies)
    if layout is None:
        layouts = tuple(m for m in Layout if m is not Layout.ZIGZAG or seq_local % 2 == 0)
    else:
        layouts = (Layout.parse(layout),)
    chosen = {Strategy.parse(s) for s in strategies} if strategies is not None else set(Strategy)
    if not chosen:
        raise ValueError("strategies must name at least one strategy; got none")
    return layouts, tuple(s for s in Strategy if s in chosen)


def choose_strategy(
    *,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    causal: bool,
    layout: Layout | str,
    training: bool,
    hardware: Hardware | str,
    batch: int = 1,
    last_block_splits: int = 2,
    strategies: Sequence[Strategy | str] | None = None,
    last_pair: str = "auto",
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> Strategy:
    """The strategy ``strategy="auto"`` runs: :func:`explain`'s pick for the caller's layout,
    never the hybrid. Deterministic given the same ``hardware`` on every rank.

    Args:
        strategies: the candidates (default: every strategy).
        last_pair: how TokenRing is predicted (:func:`explain`).
        window_size, attention_chunk_size, cu_seqlens: the call's mask (:func:`explain`).

    Raises:
        ValueError: as :func:`explain`; candidates that leave nothing to pick.
    """
    call = {name: value for name, value in locals().items() if name != "strategies"}
    _check_strategies(strategies)
    given = list(Strategy if strategies is None else strategies)
    candidates = [s for s in given if Strategy.parse(s) is not Strategy.HYBRID]
    if not candidates:
        raise ValueError(
            "strategies must name at least one strategy other than 'hybrid' (auto never picks "
            f"the hybrid); got {[Strategy.parse(s).value for s in given]}"
        )
    return explain(**call, strategies=candidates).pick


def lends_last_pair(
    *,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    causal: bool,
    layout: Layout | str,
    training: bool,
    hardware: Hardware | str,
    batch: int = 1,
    last_block_splits: int = 2,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> bool:
    """Whether TokenRing should lend its last pair (Note [Borrowed last pair]), as
    ``last_pair="auto"`` decides: True when predicted faster with it (ties: not lending);
    the mask as :func:`explain` prices it.

    Raises:
        ValueError: as :func:`explain`.
    """
    plan = explain(**locals(), strategies=[Strategy.TOKEN_RING], last_pair="auto")
    return plan.predictions[0].lends_last_pair


# -- calibration -------------------------------------------------------------------------------
def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _probe(
    comm: Communicator, num_bytes: int, device: torch.device, *, two_way: bool, repeats: int
) -> float:
    """Median seconds for every rank to move ``num_bytes`` to r-1 (and r+1 when two_way)."""
    r, p = comm.rank, comm.world_size
    down, up = (r - 1) % p, (r + 1) % p
    payload = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    fields: list[tuple[tuple[int, ...], torch.dtype]] = [((num_bytes,), torch.uint8)]

    def transfer(kind: Payload, src: int, dst: int) -> Transfer:
        return Transfer(
            payload=kind, src=src, dst=dst, owner=src, rows=(0, num_bytes), step=0, after_segments=0
        )

    sends = [(transfer(Payload.Q, r, down), [payload])]
    recvs = [(transfer(Payload.Q, up, r), fields)]
    if two_way:
        sends.append((transfer(Payload.OUT, r, up), [payload]))
        recvs.append((transfer(Payload.OUT, down, r), fields))

    def once() -> None:
        pending = comm.exchange(sends, recvs, device=device)
        for rec in pending.values():
            rec.wait()
        comm.wait_sends()

    once()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        comm.barrier(label="probe")
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_rates(
    block: BlockKernel, dims: AttentionShape, device: torch.device, n: int, repeats: int
) -> tuple[float, float, float, float]:
    """This rank's forward and backward FLOP/s and merge bytes/s on one non-causal n x n
    block (batch 1), and the seconds of one small call (the fixed cost per call)."""
    dtype, acc = dims.torch_dtype, dims.acc_dtype
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    hq, hkv, d = dims.heads_q, dims.heads_kv, dims.head_dim
    q, dout = rand(1, n, hq, d), rand(1, n, hq, d)
    k, v = rand(1, n, hkv, d), rand(1, n, hkv, d)
    scale = d**-0.5
    out, lse = block.forward(q, k, v, causal=False, scale=scale)
    delta = row_delta(dout, out, acc)  # (B, Hq, n)
    piece = Piece((0, n), (0, n), False)
    fwd_s = _median_time(lambda: block.forward(q, k, v, causal=False, scale=scale), device, repeats)
    bwd = functools.partial(block.backward, dout, q, k, v, lse, delta, causal=False, scale=scale)
    bwd_s = _median_time(bwd, device, repeats)
    out_acc = torch.zeros(q.shape, dtype=acc, device=device)  # (B, n, Hq, D)
    lse_acc = torch.full(lse.shape, float("-inf"), dtype=acc, device=device)  # (B, Hq, n)
    merge_s = _median_time(lambda: merge_into(out_acc, lse_acc, (0, n), out, lse), device, repeats)
    q1, k16 = rand(1, 1, 8, 64), rand(1, 16, 8, 64)  # a decode block: the fixed cost per call
    small = functools.partial(block.forward, q1, k16, k16, causal=False, scale=0.125)
    call_s = _median_time(small, device, 10)
    return (
        piece_flops(piece, dims, Pass.FORWARD) / fwd_s,
        piece_flops(piece, dims, Pass.BACKWARD) / bwd_s,
        merge_bytes(n, dims) / merge_s,
        call_s,
    )


def calibrate(
    comm: Communicator,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    heads_q: int = 8,
    heads_kv: int | None = None,
    head_dim: int = 64,
    block_rows: int = 1024,
    probe_bytes: int = 8 << 20,
    repeats: int = 3,
    topology: Topology | str | None = None,
    kernel: str | BlockKernel | None = None,
) -> Hardware:
    """Measure this machine as a ``measured`` hardware description: a collective, every rank
    gets the slowest rank's rates and the largest latency (Note [Calibration probe]).

    Args:
        comm: the communicator the strategies will use (its ranks form the ring).
        dtype: input dtype the FLOP/s are measured for (the description holds only for it).
        device: where tensors live; default CUDA's current device for NCCL, else CPU.
        heads_q, heads_kv, head_dim, block_rows: the representative non-causal block
            (block_rows x block_rows); heads_kv defaults to heads_q.
        probe_bytes, repeats: bytes per probe message (above ~1 MiB: bandwidth dominates);
            timed repetitions (median) of every measurement.
        topology, kernel: use this topology instead of the guess; the block kernel, as
            ``sequence_parallel_attn``'s ``kernel``.

    Raises:
        ValueError: non-positive sizes or repeats, heads_kv not dividing heads_q.
    """
    heads_kv = heads_q if heads_kv is None else heads_kv
    sizes = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim)
    _check_sizes(**sizes, block_rows=block_rows, probe_bytes=probe_bytes, repeats=repeats)
    if heads_q % heads_kv:
        raise ValueError(
            f"heads_kv must divide heads_q; got heads_q={heads_q}, heads_kv={heads_kv}"
        )
    if device is None:
        nccl = comm.backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    device = torch.device(device)
    block = select_kernel(device, dtype, kernel)
    dims = AttentionShape(dtype=dtype_name(dtype), **sizes)
    local = _kernel_rates(block, dims, device, block_rows, repeats)
    agreed = _measure(comm, local, device, probe_bytes, repeats)
    fwd, bwd, mem, link, two_way, latency, call_s = agreed
    topo, port = _topology(topology, link, two_way, comm.world_size)
    return measured(
        forward_flops_per_s=fwd,
        backward_flops_per_s=bwd,
        link_bandwidth_bytes_per_s=link,
        memory_bandwidth_bytes_per_s=mem,
        dtype=dtype,
        topology=topo,
        port_bandwidth_bytes_per_s=port,
        latency_s=max(latency, 0.0),
        collectives=CollectiveRouting.for_backend(comm.backend),
        kernel_call_s=call_s,
        host_computes=device.type == "cpu",
    )


def _measure(
    comm: Communicator, mine: Sequence[float], device: torch.device, probe_bytes: int, repeats: int
) -> list[float]:
    """The slowest rank's rates, the largest latency and call seconds (``mine``: this rank's
    :func:`_kernel_rates`): identical on every rank. The one-way and two-way bytes/s to the
    ring neighbours (inf alone) and the latency (0 alone) leave the communicator's counter and
    timeline untouched."""
    *local, call_s = mine
    link = two_way = float("inf")
    latency = 0.0
    if comm.world_size > 1:
        saved = comm.counter, comm.timeline  # the probe's traffic is not the caller's
        comm.counter, comm.timeline = TrafficCounter(), None
        try:
            link = probe_bytes / _probe(comm, probe_bytes, device, two_way=False, repeats=repeats)
            two_way = probe_bytes / _probe(comm, probe_bytes, device, two_way=True, repeats=repeats)
            latency = _probe(comm, 8, device, two_way=False, repeats=repeats)
        finally:
            comm.counter, comm.timeline = saved
    rates, most = [*local, link, two_way], [latency, call_s]
    agreed = torch.tensor([-x for x in rates] + most, dtype=torch.float64, device=device)
    comm.all_reduce(agreed, op=dist.ReduceOp.MAX, label="calibration").wait()
    values = [float(x) for x in agreed.cpu()]
    return [-x for x in values[: len(rates)]] + values[len(rates) :]


def _topology(
    given: Topology | str | None, link: float, two_way: float, world_size: int
) -> tuple[Topology, float | None]:
    """The topology and its port bandwidth (None: no shared port): ``given``, else the guess
    of Note [Calibration probe] from the one-way and two-way bytes/s."""
    if given is not None:
        topo = Topology.parse(given)
        port = 2 * two_way if world_size > 1 else link
        return topo, port if topo is Topology.SWITCH else None
    if world_size > 1 and two_way < 0.75 * link:
        return Topology.SWITCH, 2 * two_way
    return Topology.MESH, None


# -- cached plans: their price and the pick -------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CachedPrediction:
    """The simulator's price of one plan (:func:`predict_cached`)."""

    strategy: CachedStrategy
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
        """``compute`` or ``comm``, whichever of compute_s and wire_s is larger."""
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
    """Price ``plan`` with ``simulate.simulate_cached`` (``hardware.kernel_call_s`` per call).

    Raises:
        ValueError: bad head counts, an unknown dtype, or one the hardware has no FLOP/s for.
    """
    dims = AttentionShape(
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype_name(dtype)
    )
    total_s, compute_s, wire_s, _ = simulate_cached(plan, shards, shape=dims, hardware=hardware)
    travel, returned = max_sent(plan.transfers, plan.world_size, dims)
    return CachedPrediction(
        strategy=plan.strategy,
        total_s=total_s,
        compute_s=compute_s,
        wire_s=wire_s,
        travel_bytes=travel,
        return_bytes=returned,
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
    """Predict every candidate plan (:func:`predict_cached`) and pick the fastest; ties
    (within a relative 1e-9) go to the earlier in ``CachedStrategy`` order.

    Raises:
        ValueError: bad sizes, no candidates, or a dtype the hardware has no FLOP/s for.
    """
    _check_strategies(candidates, "candidates")
    given = CachedStrategy if candidates is None else candidates  # "auto" is not a candidate
    chosen = {parse_enum(CachedStrategy, s, "each of candidates") for s in given}
    if not chosen:
        raise ValueError("candidates must name at least one strategy; got none")
    heads: dict[str, Any] = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim)
    plans = [build_cached_plan(s, shards) for s in CachedStrategy if s in chosen]
    predictions = tuple(
        predict_cached(plan, shards, dtype=dtype, hardware=hardware, **heads) for plan in plans
    )
    best = _fastest(predictions)
    dims = AttentionShape(dtype=dtype_name(dtype), **heads)
    total = sum(shards.kv_rows)
    fraction = sum(shards.q_rows) / total if total else 1.0
    threshold = pass_q_threshold(elem_bytes=dims.elem_bytes, acc_bytes=dims.acc_bytes, **heads)
    times = ", ".join(f"{p.strategy.value} {1e3 * p.total_s:.3g} ms" for p in predictions)
    reason = (
        f"{best.strategy.value} predicted fastest on {hardware.name} ({times}); new-token "
        f"fraction T/(T+C) = {fraction:.3f} vs pass-Q threshold {threshold:.3f} "
        f"(2*Hkv*D*e / (Hq*(D*e+a))); {best.strategy.value} is {best.bound_by}-bound"
    )
    return CachedChoice(pick=best.strategy, predictions=predictions, reason=reason)


# the cached strategies of a zigzag first prefill and the ring strategy each runs as
_ZIGZAG_PREFILL = (
    (CachedStrategy.PASS_Q, Strategy.TOKEN_RING),
    (CachedStrategy.PASS_KV, Strategy.RING),
)


def choose_zigzag_prefill(
    *,
    world_size: int,
    seq_local: int,
    batch: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: str | torch.dtype,
    hardware: Hardware,
    last_block_splits: int = 2,
) -> CachedChoice:
    """The pick for a first prefill the cache placed in the zigzag layout (B sequences of
    ``world_size * seq_local`` tokens): it runs on the ordinary path (Note [Cached attention
    call] in tokenring.inference), pass_q as TokenRing returning its last pair in
    ``last_block_splits`` slices, pass_kv as Ring, causal, forward only; each is priced so
    (ties: pass_q).

    Raises:
        ValueError: as :func:`explain`.
    """
    _check_sizes(world_size=world_size, seq_local=seq_local, batch=batch)
    dims = AttentionShape(
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype_name(dtype), batch=batch
    )
    call: dict[str, Any] = dict(
        layout=Layout.ZIGZAG, causal=True, world_size=world_size, seq_local=seq_local
    )
    call["last_block_splits"] = last_block_splits
    predictions = []
    for cached, strategy in _ZIGZAG_PREFILL:
        fwd = simulate_pass(strategy, Pass.FORWARD, shape=dims, hardware=hardware, **call)
        heads: dict[str, Any] = dict(heads_q=heads_q, heads_kv=heads_kv)
        sched = strategy_schedule(strategy, Pass.FORWARD, **heads, **call)
        travel, returned = max_sent(sched.transfers, world_size, dims)
        predictions.append(
            CachedPrediction(
                strategy=cached,
                total_s=fwd.call_s,
                compute_s=fwd.compute_s + fwd.merge_s,
                wire_s=fwd.busiest_s,
                travel_bytes=travel,
                return_bytes=returned,
            )
        )
    best = _fastest(predictions)
    times = ", ".join(f"{p.strategy.value} {1e3 * p.total_s:.3g} ms" for p in predictions)
    reason = (
        f"{best.strategy.value} predicted fastest on {hardware.name} ({times}) for a zigzag "
        f"first prefill, which runs on the ordinary path (pass_q: token_ring returning its "
        f"last pair, pass_kv: ring); {best.strategy.value} is {best.bound_by}-bound"
    )
    return CachedChoice(pick=best.strategy, predictions=tuple(predictions), reason=reason)


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
    kernel_call_s: float | None = None,
    zigzag_first_prefill: bool = True,
) -> CachedChoice:
    """The pick for B sequences of ``cached`` tokens each adding ``new`` (placed as the cache
    places them: block-cyclic, or a first prefill in the zigzag layout) on ``hardware`` (a
    ``Hardware`` or a preset name), as ``cached_attn``'s ``"auto"`` picks it.

    Args:
        world_size: P, the ranks the cache is sharded over.
        cached, new: tokens per sequence already cached, and added by this step.
        heads_q, heads_kv, head_dim: Hq, Hkv, D of the attention.
        hardware: a ``Hardware`` or a preset name (``costmodel.PRESETS``).
        batch: B, the number of sequences.
        dtype: of q, k, v and the cache.
        block_size: the cache's placement block, in tokens.
        candidates: the cached strategies to compare (default: every ``CachedStrategy``).
        kernel_call_s: the fixed cost of one kernel call, in place of the hardware's
            ``kernel_call_s``; None: the hardware's.
        zigzag_first_prefill: as ``DistributedKVCache``'s: a first prefill (``cached=0``)
            whose ``new`` 2P divides is placed in the zigzag layout and runs on the ordinary
            path, pass_q or pass_kv (:func:`choose_zigzag_prefill`, 2 slices).

    Raises:
        ValueError: as ``uniform_shards`` and :func:`choose_cached_strategy`, an unknown
            preset, a negative ``kernel_call_s``, a non-bool ``zigzag_first_prefill``, or
            ``candidates`` with a zigzag first prefill (it runs pass_q or pass_kv).
    """
    hw = _hardware(hardware)
    if kernel_call_s is not None:
        hw = dataclasses.replace(hw, kernel_call_s=kernel_call_s)
    if not isinstance(zigzag_first_prefill, bool):
        raise ValueError(f"zigzag_first_prefill must be a bool; got {zigzag_first_prefill!r}")
    shards = uniform_shards(
        world_size=world_size, batch=batch, cached=cached, new=new, block_size=block_size
    )
    heads = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim)
    if zigzag_first_prefill and cached == 0 and new > 0 and new % (2 * world_size) == 0:
        if candidates is not None:  # as the cache: this step runs pass_q or pass_kv
            raise ValueError(
                "candidates cannot be chosen for a zigzag first prefill (it runs pass_q or "
                f"pass_kv on the ordinary path); got candidates={candidates!r} with cached=0, "
                f"new={new}, world_size={world_size} (pass zigzag_first_prefill=False)"
            )
        return choose_zigzag_prefill(
            world_size=world_size, seq_local=new // world_size, batch=batch, dtype=dtype,
            hardware=hw, **heads,
        )  # fmt: skip
    return choose_cached_strategy(shards, dtype=dtype, hardware=hw, candidates=candidates, **heads)
