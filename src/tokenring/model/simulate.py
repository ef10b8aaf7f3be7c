"""Predict a call of every strategy on a described machine: ``tokenring simulate``.

This module owns the *clock*: it plays one pass of a schedule on a hardware description the
way the runtime executes it (segment by segment, slot by slot, flows sharing links and ports)
and returns per-rank timelines (``tokenring.runtime.comm.Event``, as the bench records them),
the call time, per-step times, bytes per flow and the % of the bound. An event-driven engine
runs up to P = 64, a vectorised one (Note [Vectorised engine]) above.

Legend: B batch, S global seq, s local seq, Hq query heads, Hkv key/value heads, D head dim,
P world size, t step, r rank, F achieved FLOP/s.

Note [Replaying the rank program]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The event engine replays each rank's own program, one action per op: the ops the executor
runs (``program_of``, Note [Rank program] in tokenring.runtime.program; ``cached_program``).
A COMPUTE is its pieces' FLOPs over F (a Ulysses rank's over its head share; then the merge or
dQ add of its own rows), a POST posts its transfers at this end, ARRIVE / SENT / SENT_ALL wait
for theirs, PASS / RETURNS / HOME wait for each and add its merge or accumulation.
Memory-bound work (DELTA, merges, adds, copies: bytes over memory bandwidth,
``costmodel.merge_bytes``) is priced where the runtime does it: on the steps of a ring program,
on all-gather K/V's one step as on a ring's (each block merged into, or its dQ added to, the
rank's own rows at once; the dK/dV partials added at RETURNS), and on a Ulysses rank's joins
(Note [Ulysses memory work]); the hybrid's all-to-alls are waits. A transfer starts once both
ends have posted it (a P2P send cannot progress before its receive is posted) and arrives
``latency`` after its last byte left.

Note [Ulysses memory work]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A Ulysses rank (``_Ulysses`` in tokenring.runtime.collective) merges no partials: it copies.
With nq, nkv its heads, S = P s gathered rows and x2 for read + write, r = 2 where causal rows
are reordered (a layout other than contiguous, P > 1), else 1::

    op        forward                            backward
    DELTA     -                                  delta = rowsum(dout * out)
    ARRIVE    r x2 S (nq D e + 2 nkv D e):       r x2 S (nq (2 D e + 2 a) + 2 nkv D e):
              q, k, v joined (torch.cat) and     q, dout, lse, delta, k, v likewise
              put in global order
    COMPUTE   the kernel; (r - 1) x2 S nq        the kernel; dk, dv cast to a (S nkv D (e + a)
              (D e + a): out, lse back to        each, where e != a); (r - 1) x2 S (nq D e +
              layout order                       2 nkv D a) back to layout order
    RETURNS   x2 s Hq (D e + a): every rank's    x2 s Hq D e: dq joined; each rank's dK/dV
              out and lse joined                 share added (as a ring's returned dK/dV)

(x B rows each.) Not priced: the GQA head map of a share that does not line up with the
groups (``expand_kv``), as the ring's zero-fills and final casts are not.

Note [Masked calls]
~~~~~~~~~~~~~~~~~~~
A window or documents (``cu_seqlens``, chunks) are priced as the runtime runs them, on the
event engine (the vectorised engine's columns hold plain masks only):

    strategy            schedule played                     kernel work of a piece
    rings (TokenRing,   ``build_schedule`` with the mask:    full / causal pieces: piece_flops;
    Ring, bidir)        empty blocks dropped, rows trimmed   masked pieces: the tiles below
    Ulysses,            the plain schedule of the padded     every piece: the tiles below
    all-gather K/V      rows (the same bytes), the mask
                        attached (``strategy_schedule``)

A masked kernel call (Note [Collectives with masks] in tokenring.runtime.collective; a ring's
masked piece likewise) runs in tiles of MASKED_TILE_ROWS x MASKED_TILE_ROWS from the call's
first row and column (the default kernels' ``masked_tile_rows``; their larger outer tiles are
multiples of it), skips a tile in which no query sees a key and computes any other whole, so a
piece costs ``piece_flops`` x (rows of its non-empty tiles) / (its rows). Under a mask Ulysses
keeps the gathered rows in rank order (no reordering copies). A kernel picked by name with
other tiles (``tiled``, ``reference``) is priced as the default. A mask that is plain (no
window, at most one document) prices the plain call: padding alone is not priced.

Note [Sharing bandwidth]
~~~~~~~~~~~~~~~~~~~~~~~~
Not max-min fair sharing (a progressive-filling pass over every flow per event) but
*bottleneck equal share*: a flow's rate is the smallest ``bandwidth / flows on it`` over its
resources, so an event updates only the flows sharing a resource with the one that started or
ended. It never exceeds max-min and equals it when the flows on a resource are alike (the
common case); otherwise only the overlap is pessimistic (the short flow ends first).

Fair sharing makes the prediction monotone in bandwidth and sequence length (more bandwidth
never slower, a longer sequence never faster: tests/test_model_audit.py) but not in FLOP/s or
latency. TokenRing posts step t's Q at the step's start and step t-1's partial after its
compute, both out of one port: the Q flies alone for one compute, then shares. A faster
kernel starts the sharing sooner, and the Q, which the next step waits for, lands later
(two equal flows of b bytes on bandwidth W: the Q lands at 2b/W - compute). So twice the
FLOP/s can predict a slower pass: up to 4% (a100-nvswitch, P = 8, s = 256, MHA, backward),
2% for bidir_token_ring on a10-pcie; a higher latency, which delays the next post the same
way, up to 5-7% faster (h100-ib-islands, P = 16, s = 2048). With max-min sharing swapped in
the FLOP/s cases come out the same to 0.1% and the latency ones 1.5-2% faster, so this is what
fair-shared links do to this schedule (a list-scheduling anomaly), not an artefact of the
sharing rule; a runtime that sent the Q first would not show it.

Note [Vectorised engine]
~~~~~~~~~~~~~~~~~~~~~~~~
For P > 64 the event engine's O(P^2) transfers get slow. The vectorised engine replays the
same program with every rank at once: the ring schedule as columns (``ring_plan``;
Note [Ring columns] in tokenring.strategies.ring), each step's ops in ``ring_step_order``, each
op one tensor operation over ranks (:class:`_Replay`). Flows are grouped in *windows* instead of
sharing bandwidth event by event: window t holds what flies during step t, its travel from the
step's start (after the forward's first segment where the host computes) and each of its
returns from its post (after its segment: ``_window_flows``), the accumulators of step t-1 from
the start; on the last step each rank's last return and Ring's last accumulators form the
exposed tail. A window's flows share each port, NIC and pair link with equal shares from their
posts (``_shared_finish``: the event engine's rule, Note [Sharing bandwidth], on one resource
at a time; the latest finish over a flow's resources). The window ends at a rank with its
travel and accumulators or its compute and merges, the ring waiting for its slowest rank
(``_price_windows``); the flows of a window that outlast it (returns posted late) then share
the next window's resources from that end. Posts and loads do not depend on the replay's
timing, so a chunk's windows are priced at once, and the many alike rows (rank, window) once.

On a physical ring (Topology.RING) a flow crosses up to P/2 hops that it shares with other
ranks' flows, which per-resource staggering does not capture: there window t holds the travel
of t and the returns and accumulators of step t-1, all starting together::

    duration = latency + max over its hops of min(load, flows_on_it * bytes) / bandwidth

(the equal-share finish time if the window's flows started together: exact for the largest
and smallest flow on a hop). Hops are loaded with range sums and read with range maxima (a
sparse table): O(log P) per flow. (Staggering them too priced TokenRing's forward on the
tests' 8-rank ring 0.70x the event engine's, against 0.79x so.) On every topology flows
outlasting their window are caught by a drain bound: a resource with work L_w in window w is
busy until at least max_w (start_w + sum_{v >= w} L_v).

How well it agrees with the event engine (the oracle; tests/test_costmodel.py and, over the
presets, P = 8..64, s = 128..4096, bf16, D = 128, MHA and GQA): Ring's forward to rounding,
its backward within ~4%; TokenRing to rounding where compute-bound and where
communication-bound 0.90-1.03x on h100-nvswitch, 0.95-1.07x on a10-pcie and 0.85-1.16x on
h100-ib-islands. Starting every flow of a window together, as it did, was 0.98-1.32x,
0.90-1.01x and 0.88-1.17x: it priced TokenRing's Q, which has a head start of one compute on
the partial that shares its port, up to 1.32x slower on h100-nvswitch (P = 64, s = 512
contiguous forward), which flipped the planner's pick to Ring between P = 64 and 65. On a
physical ring whose partials share many hops it is up to ~21% faster (the tests' 8 ranks).

Memory is linear in P: steps are walked in chunks of ``_CHUNK_CELLS // P`` columns (and the
step after, whose window the chunk prices), the drain bound is a running max, and per-pair
byte totals are kept only for the links to r-1 (every other pair carries one window's flows).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from tokenring.core.enums import parse_enum
from tokenring.core.layout import (
    Layout,
    Sharding,
    is_int,
    make_sharding,
    normalize_cu_seqlens,
    validate_seq_local,
)
from tokenring.core.masks import MaskSpec, chunk_documents, normalize_window
from tokenring.core.schedule import (
    AttentionShape,
    Flow,
    Pass,
    Payload,
    Piece,
    Schedule,
    Strategy,
    Transfer,
    piece_flops,
)
from tokenring.model.costmodel import (
    Hardware,
    Resource,
    ResourceKind,
    exposed_transfers,
    merge_bytes,
    route,
    transfer_route,
)
from tokenring.model.netlab import Topology
from tokenring.runtime.comm import Event
from tokenring.runtime.program import Op, OpKind, cached_program, program_of, ring_step_order
from tokenring.strategies import build_schedule
from tokenring.strategies.cached import CachedPlan, CachedShards
from tokenring.strategies.collective import build_collective_schedule, ulysses_heads
from tokenring.strategies.hybrid import HybridSpec, build_hybrid_schedule
from tokenring.strategies.ring import LEND_MAX_WORLD_SIZE, RingColumns, RingPlan, ring_plan

__all__ = [
    "EVENT_MAX_WORLD_SIZE",
    "MASKED_TILE_ROWS",
    "VECTORISED_STRATEGIES",
    "CallMask",
    "CallResult",
    "PassResult",
    "call_mask",
    "max_sent",
    "simulate",
    "simulate_cached",
    "simulate_pass",
    "simulate_schedule",
    "strategy_schedule",
]

EVENT_MAX_WORLD_SIZE = 64
"""mode="auto" runs the event engine up to this world size and the vectorised one above."""

EVENT_LIMIT_WORLD_SIZE = 512
"""The most ranks mode="event" takes (tens of minutes on 2 cores; world_size=20000 would run
for weeks with nothing to show)."""

VECTORISED_STRATEGIES = (Strategy.TOKEN_RING, Strategy.RING)
"""Strategies whose schedule ``ring_plan`` gives as columns; the event engine runs any."""


# -- results -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class PassResult:
    """The prediction of one pass (forward or backward) of one strategy."""

    strategy: Strategy
    pass_: Pass
    layout: Layout
    causal: bool
    world_size: int
    seq_local: int
    mode: str
    """Engine that produced it: ``event`` or ``vectorised`` (Note [Vectorised engine])."""
    call_s: float
    """Time of the pass: the last rank's end (its returns merged, its sends done)."""
    step_s: tuple[float, ...]
    """Per step: the longest any rank spent from that step's start to the next one's."""
    compute_s: float
    """Compute-only time: the block kernels of the busiest rank, no merges, no communication."""
    merge_s: float
    """Memory-bound work of the busiest rank: merges, accumulations, the backward's delta."""
    busiest_resource: str
    """The resource carrying the most bytes relative to its bandwidth (e.g. ``link3->2``)."""
    busiest_bytes: int
    """Bytes that resource carries over the pass, less the exposed transfers."""
    busiest_s: float
    """Those bytes / its bandwidth."""
    exposed_s: float
    """Transfers nothing can overlap (posted after the sender's last compute), at full rate."""
    travel_bytes: int
    """Bytes the busiest rank sends on the travel flow over the pass."""
    return_bytes: int
    """Bytes the busiest rank sends on the return flow over the pass."""
    timeline: tuple[tuple[Event, ...], ...] | None
    """Per rank, compute/merge/send events in seconds from the call's start (None: vectorised)."""

    @property
    def bound_s(self) -> float:
        """max(compute-only, busiest resource) + exposed transfers."""
        return max(self.compute_s, self.busiest_s) + self.exposed_s

    @property
    def percent_of_bound(self) -> float:
        """100 * bound / call time (100: the call runs at its bound)."""
        return 100.0 * self.bound_s / self.call_s if self.call_s > 0 else 100.0

    @property
    def steady_step_s(self) -> float:
        """A representative steady step: the median over steps 1..P-2 (all steps if P < 3)."""
        steps = sorted(self.step_s[1:-1] or self.step_s)
        return steps[len(steps) // 2] if steps else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class CallResult:
    """One call: the forward pass, the backward pass, or both one after the other."""

    strategy: Strategy
    passes: tuple[PassResult, ...]
    """In execution order."""

    @property
    def call_s(self) -> float:
        """Sum over passes."""
        return sum(p.call_s for p in self.passes)

    @property
    def bound_s(self) -> float:
        """Sum of the passes' bounds."""
        return sum(p.bound_s for p in self.passes)

    @property
    def percent_of_bound(self) -> float:
        """100 * bound / call time."""
        return 100.0 * self.bound_s / self.call_s if self.call_s > 0 else 100.0


# -- shared helpers ----------------------------------------------------------------------------
def _delta_bytes(seq_local: int, dims: AttentionShape) -> int:
    """Backward prologue: delta = rowsum(dout * out): read dout and out, write delta."""
    row_head = 2 * dims.head_dim * dims.elem_bytes + dims.acc_bytes
    return seq_local * dims.batch * dims.heads_q * row_head


def _taken_bytes(
    payload: Payload, num_rows: int, dims: AttentionShape, heads: int | None = None
) -> int:
    """Memory traffic of taking in a partial over ``num_rows`` rows and ``heads`` (None: all):
    an ``out`` merged (``merge_bytes``); a dQ, or dK and dV, added (``acc += part`` in the
    accumulation dtype: read both, write one)."""
    if payload is Payload.OUT:
        return merge_bytes(num_rows, dims, heads)
    pairs = 1 if payload is Payload.DQ else 2
    heads = heads or (dims.heads_q if pairs == 1 else dims.heads_kv)
    return num_rows * dims.batch * heads * dims.head_dim * pairs * 3 * dims.acc_bytes


# -- the kernel work of a masked collective ----------------------------------------------------
MASKED_TILE_ROWS = 1024
"""Rows of the tiles in which the default kernels compute a masked kernel call (both sides):
``masked_tile_rows`` of ``CpuFlashKernel`` and ``CudaFusedKernel`` (Note [Masked calls])."""

_VISIBLE_BATCH = 4096  # query runs compared against every kv tile at once


def _windowed(sched: Schedule) -> bool:
    """Whether ``sched`` runs under a window or documents (Note [Masked calls])."""
    return sched.mask is not None and not sched.mask.plain and sched.sharding is not None


def _kernel_flops(
    sched: Schedule, r: int, t: int, pieces: Sequence[Piece], dims: AttentionShape
) -> float:
    """The kernel FLOPs of rank ``r``'s ``pieces`` at step ``t`` of ``sched``: ``piece_flops``;
    under a window or documents the masked pieces (every piece of a collective) by the tiles
    their kernel computes (Note [Masked calls])."""
    if not _windowed(sched):
        return sum(piece_flops(pc, dims, sched.pass_) for pc in pieces)
    assert sched.sharding is not None and sched.mask is not None
    positions, gathered = _padded_positions(sched)  # gathered (P * s,): rows in rank order
    collective = sched.strategy.is_collective
    if collective:  # q: a Ulysses rank's gathered rows, an all-gather rank's own
        own = positions[r] if sched.strategy is Strategy.ALLGATHER_KV else gathered
    plan = sched.steps[r][t]
    flops = 0.0
    for pc in pieces:
        if collective:
            q_pos, kv_pos = own[slice(*pc.q_rows)], gathered[slice(*pc.kv_rows)]
        elif pc.masked:  # whose rows meet, as the ring runtime finds them
            q_owner = r if pc.kv_owner is not None else plan.lane_q_owner(pc.lane)
            kv_owner = pc.kv_owner if pc.kv_owner is not None else plan.kv_owners[pc.lane]
            q_pos = positions[q_owner][slice(*pc.q_rows)]
            kv_pos = positions[kv_owner][slice(*pc.kv_rows)]
        else:  # full or top-left causal: computed as priced without a mask
            flops += piece_flops(pc, dims, sched.pass_)
            continue
        area = pc.num_q * pc.num_kv  # > 0: pieces are trimmed runs, or whole rows
        if not collective and max(pc.num_q, pc.num_kv) <= MASKED_TILE_ROWS:
            pairs = area  # one tile, and a ring's piece is trimmed to what some query sees
        else:
            pairs = _tile_pairs(sched.mask, q_pos, kv_pos, MASKED_TILE_ROWS)
        whole = piece_flops(replace(pc, causal=False), dims, sched.pass_)  # its heads
        flops += whole * pairs / area
    return flops


def _padded_positions(sched: Schedule) -> tuple[tuple[Tensor, ...], Tensor]:
    """Each rank's padded positions (-1: padding) and all of them in rank order (the rows a
    collective gathers), kept in the schedule's memo while it lives."""
    key = ("padded positions",)
    if key not in sched._memo:
        assert sched.sharding is not None
        own = tuple(sched.sharding.padded_positions(r) for r in range(sched.world_size))
        sched._memo[key] = (own, torch.cat(own))
    return sched._memo[key]  # type: ignore[return-value]


def _tile_pairs(mask: MaskSpec, q_pos: Tensor, kv_pos: Tensor, tile: int) -> int:
    """The (query, key) pairs of the ``tile`` x ``tile`` tiles of a kernel call (rows at global
    positions ``q_pos`` against ``kv_pos``, -1: padding) in which some query sees some key:
    the tiles the kernel computes, each whole (Note [Masked calls])."""
    n, m = q_pos.numel(), kv_pos.numel()
    big = 2**62  # an unbounded side: past every position, without int64 overflow
    bounds = torch.tensor(mask.cu_seqlens or (0, big), dtype=torch.int64)
    # the queries as runs of consecutive positions of one document within one tile
    doc = torch.bucketize(q_pos, bounds[1:-1], right=True)
    rows = torch.arange(n)
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = (rows[1:] % tile == 0) | (q_pos[1:] != q_pos[:-1] + 1) | (doc[1:] != doc[:-1])
    first = starts.nonzero().flatten()
    last = torch.cat([first[1:], torch.tensor([n])]) - 1
    real = q_pos[first] >= 0
    first, last = first[real], last[real]  # none: the loop below sees no run, 0 pairs
    d = doc[first]
    left = big if mask.window[0] < 0 else min(mask.window[0], big)
    right = 0 if mask.causal else (big if mask.window[1] < 0 else min(mask.window[1], big))
    # the keys each run sees: one range of positions inside its document
    lo = torch.maximum(q_pos[first] - left, bounds[d])
    hi = torch.minimum(q_pos[last] + right, bounds[d + 1] - 1)
    # each kv tile's positions, sorted (a short last tile filled past every position)
    kv_tiles = -(-m // tile)
    filled = torch.full((kv_tiles * tile,), big, dtype=torch.int64)
    filled[:m] = kv_pos
    sorted_kv = filled.view(kv_tiles, tile).sort(dim=1).values
    seen = torch.zeros(-(-n // tile), kv_tiles, dtype=torch.int64)
    for a in range(0, first.numel(), _VISIBLE_BATCH):
        part = slice(a, a + _VISIBLE_BATCH)
        his = hi[part].unsqueeze(0).expand(kv_tiles, -1).contiguous()
        los = lo[part].unsqueeze(0).expand(kv_tiles, -1).contiguous()
        count = torch.searchsorted(sorted_kv, his, right=True)
        count -= torch.searchsorted(sorted_kv, los, right=False)  # (kv tiles, runs)
        seen.index_add_(0, first[part] // tile, (count > 0).long().T)
    q_rows = torch.full((seen.shape[0],), tile, dtype=torch.int64)
    q_rows[-1] = n - tile * (seen.shape[0] - 1)
    kv_rows = torch.full((kv_tiles,), tile, dtype=torch.int64)
    kv_rows[-1] = m - tile * (kv_tiles - 1)
    return int(((seen > 0).long() * q_rows.unsqueeze(1) * kv_rows.unsqueeze(0)).sum())


# -- event engine ------------------------------------------------------------------------------
_STEP, _POST, _COMPUTE, _MERGE, _WAIT = range(5)
_RESUME, _FLOW_DONE, _ARRIVE = range(3)
# (_STEP, t), (_POST, flows), (_WAIT, flow), (_COMPUTE or _MERGE, seconds, t, label)
_Action = tuple[Any, ...]
_Compute = Callable[[Op], list[_Action]]


class _EventEngine:
    """Replays one action list per rank over ``transfers``, once (Note [Sharing bandwidth],
    Note [Replaying the rank program])."""

    def __init__(
        self,
        transfers: Sequence[Transfer],
        world_size: int,
        num_steps: int,
        dims: AttentionShape,
        hardware: Hardware,
        pass_: Pass = Pass.FORWARD,
    ) -> None:
        self.flops_per_s = hardware.flops_per_s(pass_, dims.dtype)
        self.world_size, self.dims, self.hw = world_size, dims, hardware
        self.mem = hardware.memory_bandwidth_bytes_per_s
        self.transfers = list(transfers)
        self.fid = {tr: i for i, tr in enumerate(self.transfers)}
        pairs = dict.fromkeys((tr.src, tr.dst) for tr in self.transfers)  # in first-seen order
        routes = {pair: route(hardware, *pair, world_size) for pair in pairs}
        caps = dict(res_cap for rt in routes.values() for res_cap in rt.resources)
        self.res_index = {res: i for i, res in enumerate(caps)}
        self.res_cap = list(caps.values())
        flow_routes = [routes[tr.src, tr.dst] for tr in self.transfers]
        self.flow_res = [[self.res_index[res] for res, _ in rt.resources] for rt in flow_routes]
        self.flow_lat = [rt.latency_s for rt in flow_routes]
        self.flow_bytes = [float(tr.num_bytes(dims)) for tr in self.transfers]
        # the run: per flow its posts (it starts at 2: both ends), start, arrival, bytes left,
        # rate, last repricing and version; per rank its place in its program; pending events
        n = len(self.transfers)
        self.posted, self.version = [0] * n, [0] * n
        self.started: list[float | None] = [None] * n
        self.arrival: list[float | None] = [None] * n
        self.remaining, self.rate, self.last = list(self.flow_bytes), [0.0] * n, [0.0] * n
        self.active: list[set[int]] = [set() for _ in self.res_cap]
        self.pc = [0] * world_size
        self.waiting: dict[int, list[int]] = {}  # flow -> ranks blocked on its arrival
        self.finish = [math.nan] * world_size
        self.step_start = [[math.nan] * (num_steps + 1) for _ in range(world_size)]
        self.events: list[list[Event]] = [[] for _ in range(world_size)]
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()  # breaks ties in the heap: first pushed, first popped
        self.dirty: set[int] = set()  # resources whose flows changed since the last repricing

    def busiest(self, exposed: Sequence[Transfer] = ()) -> tuple[str, int, float]:
        """(name, bytes, seconds) of the resource of most bytes / bandwidth, less ``exposed``."""
        load = [0.0] * len(self.res_cap)
        skip = {self.fid[tr] for tr in exposed}
        for i, (ids, num) in enumerate(zip(self.flow_res, self.flow_bytes, strict=True)):
            if i in skip:
                continue
            for index in ids:
                load[index] += num
        candidates = [
            (str(res), int(load[i]), load[i] / self.res_cap[i]) for res, i in self.res_index.items()
        ]
        return max([("none", 0, 0.0), *candidates], key=lambda c: c[2])  # the first of equals

    def _program(
        self,
        ops: Sequence[Op],
        r: int,
        dims: AttentionShape,
        ring_steps: range,
        compute: _Compute,
        joins: _Compute | None = None,
    ) -> list[_Action]:
        """Rank ``r``'s actions for ``ops`` (Note [Replaying the rank program]): ``compute``
        prices a COMPUTE or DELTA; partials are merged or added on ``ring_steps`` only;
        ``joins`` prices what an op does with what it waited for (Note [Ulysses memory work])."""
        prog: list[_Action] = []
        for op in ops:
            kind = op.kind
            if kind in (OpKind.STEP, OpKind.END):
                prog.append((_STEP, op.step))
            elif kind is OpKind.POST:
                ends = tuple(self.fid[tr] for tr in op.transfers if r in (tr.src, tr.dst))
                prog.append((_POST, ends))  # its sends and receives
            elif kind in (OpKind.COMPUTE, OpKind.DELTA):
                prog += compute(op)
            else:  # ARRIVE, SENT, SENT_ALL wait; PASS, RETURNS, HOME add what they waited for
                for tr in op.transfers:
                    prog.append((_WAIT, self.fid[tr]))
                    if kind in (OpKind.PASS, OpKind.RETURNS, OpKind.HOME) and tr.step in ring_steps:
                        prog.append(self._added(tr, dims))
                prog += joins(op) if joins is not None else []
        return prog

    def _actions(self, sched: Schedule, r: int) -> list[_Action]:
        """The actions of rank ``r``'s ``program_of`` (Note [Replaying the rank program])."""
        if sched.strategy is Strategy.ULYSSES:
            return self._ulysses(sched, r)
        # the hybrid's outer ring merges its own heads (Note [Hybrid rank program])
        inner = getattr(sched, "inner", 1)
        dims = replace(
            self.dims, heads_q=self.dims.heads_q // inner, heads_kv=self.dims.heads_kv // inner
        )
        forward, mem = sched.pass_ is Pass.FORWARD, self.mem
        # merges and adds are priced on the steps of a ring program, and on all-gather K/V's
        # one step, whose runtime merges and adds like a ring's (Note [Replaying the rank
        # program]); the hybrid's all-to-alls are waits
        n = sched.num_steps
        ring_steps = range(1, n - 1) if sched.strategy is Strategy.HYBRID else range(n)

        def compute(op: Op) -> list[_Action]:
            t = op.step
            if op.kind is OpKind.DELTA:
                delta = _delta_bytes(inner * sched.seq_local, dims) / mem
                return [(_MERGE, delta, t, "delta")] if t in ring_steps else []
            plan = sched.steps[r][t]
            segment = plan.segments[op.index]
            flops = _kernel_flops(sched, r, t, segment.pieces, dims)
            actions = [(_COMPUTE, flops / self.flops_per_s, t, "attn" if forward else "attn_bwd")]
            if plan.q_owner == r and t in ring_steps:  # own rows merged (dQ added) at once
                rows = segment.q_rows[1] - segment.q_rows[0]
                own = _taken_bytes(Payload.OUT if forward else Payload.DQ, rows, dims)
                actions.append((_MERGE, own / mem, t, "merge" if forward else "dq_add"))
            return actions

        program = program_of(sched, r, host_computes=self.hw.host_computes)
        return self._program(program, r, dims, ring_steps, compute)

    def _ulysses(self, sched: Schedule, r: int) -> list[_Action]:
        """The actions of Ulysses rank ``r``'s ``program_of``: its kernel over its head share,
        and the copies and adds of Note [Ulysses memory work]."""
        dims, mem, p, s = self.dims, self.mem, sched.world_size, sched.seq_local
        b, d, e, a = dims.batch, dims.head_dim, dims.elem_bytes, dims.acc_bytes
        shares = ulysses_heads(world_size=p, heads_q=dims.heads_q, heads_kv=dims.heads_kv)
        nq, nkv, rows = shares[r].num_q, shares[r].num_kv, p * s * b  # gathered rows (x B)
        forward = sched.pass_ is Pass.FORWARD
        # under a window or documents (``strategy_schedule`` attaches them to the plain
        # schedule) the rows stay in rank order (Note [Collectives with masks])
        masked = _windowed(sched)
        reordered = sched.causal and sched.layout is not Layout.CONTIGUOUS and p > 1 and not masked
        q_side = nq * d * e if forward else nq * (2 * d * e + 2 * a)  # q; or q, dout, lse, delta
        gathered = rows * (q_side + 2 * nkv * d * e)  # (B, S, nq or nkv, D) fields, (B, nq, S)
        if forward:
            results = rows * nq * (d * e + a)  # out, lse
            cast = 0
        else:  # dq; dk, dv after the cast to the accumulation dtype
            results = rows * (nq * d * e + 2 * nkv * d * a)
            cast = 2 * rows * nkv * d * (e + a) if e != a else 0

        def compute(op: Op) -> list[_Action]:
            if op.kind is OpKind.DELTA:
                return [(_MERGE, _delta_bytes(s, dims) / mem, 0, "delta")]
            segment = sched.steps[r][0].segments[op.index]
            flops = _kernel_flops(sched, r, 0, segment.pieces, dims)
            seconds = flops * (nq / dims.heads_q) / self.flops_per_s  # pieces cover its heads
            actions = [(_COMPUTE, seconds, 0, "attn" if forward else "attn_bwd")]
            actions += [(_MERGE, cast / mem, 0, "cast")] if cast else []
            actions += [(_MERGE, 2 * results / mem, 0, "reorder")] if reordered else []
            return actions

        def joins(op: Op) -> list[_Action]:
            if op.kind is OpKind.ARRIVE and nq > 0:  # joined, then in global order
                return [(_MERGE, 2 * gathered * (2 if reordered else 1) / mem, 0, "join")]
            if op.kind is not OpKind.RETURNS:
                return []
            if forward:  # out and lse of every head joined
                return [(_MERGE, 2 * s * b * dims.heads_q * (d * e + a) / mem, 0, "join")]
            dkv = sum(_taken_bytes(Payload.DKV, s, dims, sh.num_kv) for sh in shares if sh.num_q)
            dq = 2 * s * b * dims.heads_q * d * e
            return [(_MERGE, dq / mem, 0, "join"), (_MERGE, dkv / mem, 0, "dkv_add")]

        program = program_of(sched, r, host_computes=self.hw.host_computes)
        return self._program(program, r, dims, range(0), compute, joins)

    def _added(self, tr: Transfer, dims: AttentionShape) -> _Action:
        """The merge or accumulation of a partial (out, dQ or dK/dV) once it has arrived."""
        heads = tr.heads[1] - tr.heads[0] if tr.heads is not None else None
        cost = _taken_bytes(tr.payload, tr.num_rows, dims, heads) / self.mem
        what = {Payload.OUT: "merge", Payload.DQ: "dq_add"}.get(tr.payload, "dkv_add")
        return (_MERGE, cost, tr.step, what)

    def _cached_program(self, plan: CachedPlan, shards: CachedShards, r: int) -> list[Any]:
        """The actions of rank ``r``'s ``cached_program`` (each partial merged as it returns)."""

        def compute(op: Op) -> list[_Action]:
            o, j = plan.computes[r][op.step][op.index]
            actions = [(_COMPUTE, self._block_s(shards, o, j), op.step, "attn")]
            if plan.merges(r, o):
                merge = merge_bytes(shards.q_rows[o], self.dims) / self.mem
                actions.append((_MERGE, merge, op.step, "merge"))
            return actions

        return self._program(cached_program(plan, r), r, self.dims, range(plan.num_rounds), compute)

    def _block_s(self, shards: CachedShards, q_owner: int, kv_owner: int) -> float:
        """Kernel time of one (Q block, K/V shard) pair: the roofline of its FLOPs (masked
        scores too) and bytes, plus ``kernel_call_s`` per call (Note [Cached attention call]
        in tokenring.inference)."""
        dims = self.dims
        hq, hkv, d, e = dims.heads_q, dims.heads_kv, dims.head_dim, dims.elem_bytes
        flops = num_bytes = 0.0
        calls = 0
        for t, (full, stop) in zip(
            shards.q_seq_rows[q_owner], shards.split(q_owner, kv_owner), strict=True
        ):
            if stop == 0 or t == 0:
                continue
            flops += 4.0 * hq * d * t * stop
            num_bytes += stop * 2 * hkv * d * e + 2 * t * hq * d * e
            calls += (full > 0) + (stop > full)
        roofline = max(flops / self.flops_per_s, num_bytes / self.mem)
        return roofline + calls * self.hw.kernel_call_s

    def push(self, time_s: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.heap, (time_s, next(self.seq), kind, a, b))

    def maybe_start(self, i: int, now: float) -> None:
        """Start flow ``i`` once both ends have posted it."""
        if self.posted[i] < 2:
            return
        self.started[i] = self.last[i] = now
        for res in self.flow_res[i]:  # every route has a resource: it is repriced with them
            self.active[res].add(i)
            self.dirty.add(res)

    def advance(self, r: int, now: float) -> None:
        """Play rank ``r``'s program from where it stopped until it computes or waits."""
        prog, pc = self.programs[r], self.pc
        while pc[r] < len(prog):
            action = prog[pc[r]]
            kind = action[0]
            if kind == _STEP:
                self.step_start[r][action[1]] = now
            elif kind == _POST:
                for i in action[1]:
                    self.posted[i] += 1
                    self.maybe_start(i, now)
            elif kind in (_COMPUTE, _MERGE) and (duration := action[1]) > 0:
                ev_kind = "compute" if kind == _COMPUTE else "merge"
                self.events[r].append(Event(ev_kind, action[3], action[2], now, now + duration))
                pc[r] += 1
                self.push(now + duration, _RESUME, r)
                return
            elif kind == _WAIT and self.arrival[action[1]] is None:
                self.waiting.setdefault(action[1], []).append(r)
                return
            pc[r] += 1
        self.finish[r] = now

    def arrive(self, i: int, now: float) -> None:
        """Flow ``i`` has arrived: log it at both ends and wake the ranks waiting for it."""
        self.arrival[i] = now
        tr, start = self.transfers[i], self.started[i]
        assert start is not None
        num, what = int(self.flow_bytes[i]), tr.payload.value
        self.events[tr.src].append(Event("send", what, tr.step, start, now, tr.dst, num))
        self.events[tr.dst].append(Event("recv", what, tr.step, start, now, tr.src, num))
        for r in self.waiting.pop(i, ()):
            self.pc[r] += 1
            self.advance(r, now)

    def reprice(self, now: float) -> None:
        """New rates for the flows whose resources changed (Note [Sharing bandwidth])."""
        active, remaining, rate = self.active, self.remaining, self.rate
        touched = {i for res in self.dirty for i in active[res]}
        self.dirty.clear()
        for i in sorted(touched):  # all still moving bytes: finished flows left `active`
            remaining[i] -= rate[i] * (now - self.last[i])
            self.last[i] = now
            rate[i] = min(self.res_cap[res] / len(active[res]) for res in self.flow_res[i])
            self.version[i] += 1
            self.push(now + max(remaining[i], 0.0) / rate[i], _FLOW_DONE, i, self.version[i])

    def flow_done(self, i: int, now: float) -> None:
        """Flow ``i`` has sent its last byte: it leaves its resources, arrives after latency."""
        self.remaining[i] = 0.0
        for res in self.flow_res[i]:
            self.active[res].discard(i)
            self.dirty.add(res)
        if self.flow_lat[i] > 0:
            self.push(now + self.flow_lat[i], _ARRIVE, i)
        else:
            self.arrive(i, now)

    def run(self, programs: list[list[_Action]]) -> None:
        """Play every rank's program: per rank its ``finish``, ``step_start`` and ``events``."""
        self.programs = programs
        p, heap = self.world_size, self.heap
        for r in range(p):
            self.advance(r, 0.0)
        self.reprice(0.0)
        while heap:
            now = heap[0][0]
            horizon = now + 1e-12 + 1e-9 * now  # batch events this close (symmetric ranks)
            while heap and heap[0][0] <= horizon:
                _, _, kind, a, b = heapq.heappop(heap)
                if kind == _RESUME:
                    self.advance(a, now)
                elif kind == _FLOW_DONE and b == self.version[a]:  # else repriced since
                    self.flow_done(a, now)
                elif kind == _ARRIVE:
                    self.arrive(a, now)
            self.reprice(now)
        stuck = [r for r in range(p) if math.isnan(self.finish[r])]
        assert not stuck, f"simulation deadlocked on ranks {stuck}"

    def busy_s(self, *kinds: str) -> float:
        """The busiest rank's seconds in events of ``kinds``."""
        return max(sum(ev.end_s - ev.start_s for ev in e if ev.kind in kinds) for e in self.events)

    def timeline(self) -> tuple[tuple[Event, ...], ...]:
        return tuple(tuple(sorted(e, key=lambda ev: (ev.start_s, ev.end_s))) for e in self.events)


def max_sent(transfers: Sequence[Transfer], p: int, dims: AttentionShape) -> tuple[int, int]:
    """The most bytes one rank sends on the travel flow, and on the return flow."""
    sent = {Flow.TRAVEL: [0] * p, Flow.RETURN: [0] * p}
    for tr in transfers:
        sent[tr.payload.flow][tr.src] += tr.num_bytes(dims)
    return max(sent[Flow.TRAVEL]), max(sent[Flow.RETURN])


def simulate_cached(
    plan: CachedPlan, shards: CachedShards, *, shape: AttentionShape, hardware: Hardware
) -> tuple[float, float, float, tuple[tuple[Event, ...], ...]]:
    """Predict a cached inference plan (``shape``: batch 1, the plan's rows hold every
    sequence) with the event engine: ``(call_s, compute_s, wire_s, timeline)``, the last
    rank's end, the busiest rank's kernels and merges, the busiest link or port's bytes over
    its bandwidth, and per rank its events.

    Raises:
        ValueError: a dtype the hardware has no FLOP/s for.
    """
    engine = _EventEngine(plan.transfers, plan.world_size, plan.num_rounds, shape, hardware)
    engine.run([engine._cached_program(plan, shards, r) for r in range(plan.world_size)])
    compute_s = engine.busy_s("compute", "merge")
    return max(engine.finish), compute_s, engine.busiest()[2], engine.timeline()


# -- vectorised engine -------------------------------------------------------------------------
class _Batch(NamedTuple):
    """The flows ``(W, P, G)`` of one :meth:`_Network.price` call: window, sender, receiver,
    bytes of every flow (``xa``) and of the window's own (``xo``; 0: no flow), starts, whether
    between islands; the ``(W, 7, P)`` work the resource families fill, and whether the bytes
    count towards the pass totals (``counted``)."""

    win: Tensor
    src: Tensor
    dst: Tensor
    xa: Tensor
    xo: Tensor
    start: Tensor
    inter: Tensor
    work: Tensor
    counted: bool


class _Network:
    """Prices flows laid out as ``(W, P, G)`` tensors (window, sending rank, slot) on the
    resources of ``costmodel.route``; Note [Vectorised engine]."""

    def __init__(self, hardware: Hardware, world_size: int) -> None:
        self.p = p = world_size
        net = hardware.interconnect
        self.ring = net.topology is Topology.RING
        self.link, self.lat, self.dpn = net.link_bandwidth_bytes_per_s, net.latency_s, None
        self.inter_link, self.inter_lat = self.link, self.lat
        if (inter := hardware.inter) is not None:  # islands (Note [Topologies] in costmodel)
            self.dpn, self.inter_link = hardware.devices_per_node, inter.link_bandwidth_bytes_per_s
            self.inter_lat = inter.latency_s
        f64 = torch.float64
        # Only the pair (r, r - 1) carries flows of more than one window: no (P, P) table.
        self.down_totals = torch.zeros(p, dtype=f64)  # pair (r, r - 1)
        self.other_best: tuple[float, int, float] = (-1.0, -1, 0.0)  # (seconds, src*P+dst, bytes)
        # Ports (intra) and NICs (inter): (inter?, bandwidth, [out, in] byte totals per rank,
        # their first family in price()'s work, their resource kinds).
        self.ports: list[tuple[bool, float, Tensor, int, tuple[ResourceKind, ...]]] = []
        if (port := net.port_bandwidth_bytes_per_s) is not None:
            kinds = (ResourceKind.PORT_OUT, ResourceKind.PORT_IN)
            self.ports.append((False, port, torch.zeros(2, p, dtype=f64), 1, kinds))
        if inter is not None and (nic := inter.port_bandwidth_bytes_per_s) is not None:
            kinds = (ResourceKind.NIC_OUT, ResourceKind.NIC_IN)
            self.ports.append((True, nic, torch.zeros(2, p, dtype=f64), 3, kinds))
        self.hop_totals = torch.zeros(2, p, dtype=f64)  # [up, down] per origin rank
        # drain(): per family and rank, the work so far and max of (window start - work before)
        self.work_before = torch.zeros(7, p, dtype=f64)
        self.best_start = torch.full((7, p), -math.inf, dtype=f64)

    def _across(self, src: Tensor, dst: Tensor) -> Tensor:
        """Whether each flow from ``src`` to ``dst`` runs between islands."""
        if self.dpn is None:
            return torch.zeros(src.shape, dtype=torch.bool)
        return (src // self.dpn) != (dst // self.dpn)

    def _pair_cap(self, src: Tensor, dst: Tensor) -> Tensor:
        """Each pair's link (one number, 0-d, where there are no islands)."""
        if self.dpn is None:
            return torch.tensor(self.link, dtype=torch.float64)
        cap = torch.full(src.shape, self.link, dtype=torch.float64)
        return torch.where(self._across(src, dst), self.inter_link, cap)

    def price(
        self,
        x: Tensor,
        dst: Tensor,
        *,
        start: Tensor,
        count: bool = True,
        own: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Per flow ``(W, P, G)``: latency + the time from its start to its last byte, the
        flows of its window sharing each resource equally from their starts (the latest
        finish over its resources); per window ``(W, 7, P)``: the seconds of work of each
        resource family (for :meth:`drain`). ``x``: bytes (0: no flow) sent by rank r to
        ``dst``, ``start``: when, in seconds from the window's start; ``count``: add them to
        the pass totals (False for the exposed transfers); ``own``: the window's own flows
        (None: all), the others only share its resources. A ring's hops are priced as if
        their flows started together (Note [Vectorised engine]: there every start is 0)."""
        w_count, p, _ = x.shape
        src = torch.arange(p).view(1, p, 1).expand_as(dst)
        win = torch.arange(w_count).view(w_count, 1, 1).expand_as(dst)
        active = x > 0
        xa = torch.where(active, x, 0.0)
        xo = xa if own is None else torch.where(own, xa, 0.0)
        inter = self._across(src, dst)
        lat = torch.where(inter, self.inter_lat, torch.full(x.shape, self.lat, dtype=torch.float64))
        # families: link to r-1, port out, port in, NIC out, NIC in, ring hop up, hop down
        work = torch.zeros(w_count, 7, p, dtype=torch.float64)
        flows = _Batch(win, src, dst, xa, xo, start, inter, work, count)
        finish = torch.maximum(start, self._price_pairs(flows))
        finish = torch.maximum(finish, self._price_ports(flows))
        hops = torch.ones(x.shape, dtype=torch.long)
        if self.ring:  # no islands on a ring (Hardware): every flow is intra
            hop_s, hops = self._price_hops(flows)
            finish = torch.maximum(finish, start + hop_s)
        return torch.where(active, finish - start + lat * hops, 0.0), work

    def _price_pairs(self, b: _Batch) -> Tensor:
        """Per flow when its last byte leaves its pair's link or path; fills family 0."""
        if self.ring:
            return torch.zeros(b.xa.shape, dtype=torch.float64)
        src, dst, xo = b.src, b.dst, b.xo
        mine = xo > 0
        pair_cap = self._pair_cap(src, dst)
        down = dst == (src - 1) % self.p
        b.work[:, 0] = torch.where(down, xo / pair_cap, 0.0).sum(-1)
        if b.counted:
            self.down_totals.index_add_(0, src[down], xo[down])
            self._count_other_pairs(src[~down & mine], dst[~down & mine], xo[~down & mine])
        g = b.xa.shape[-1]  # a pair's flows are in one row (same sender): its link is shared
        rows = (_rows(v, g) for v in (b.start, b.xa, pair_cap, (dst - src) % self.p))
        begin, size, cap, label = rows
        finish = _shared_finish(begin, size, cap, torch.tensor(math.inf), label)
        return finish.view(b.xa.shape)

    def _price_ports(self, b: _Batch) -> Tensor:
        """Per flow when its last byte leaves its ports (intra) or NICs (inter), each flow
        no faster than its link; fills families 1 to 4."""
        win, dst, xa, start = b.win, b.dst, b.xa, b.start
        w_count, p, g = xa.shape
        finish = torch.zeros(xa.shape, dtype=torch.float64)
        flow_cap = self._pair_cap(b.src, dst)
        by_dst = _grouped(win * p + dst, xa > 0)  # the flows into each port, as rows
        index = by_dst[0]
        into = [_table(v, by_dst) if v.dim() else v for v in (start, flow_cap)]
        for across, cap, totals, family, _ in self.ports:
            mask = b.inter if across else ~b.inter
            xm = xa * mask
            rows = [_rows(v, g) for v in (start, xm, flow_cap)]
            out_finish = _shared_finish(rows[0], rows[1], torch.tensor(cap), rows[2])
            in_finish = _shared_finish(into[0], _table(xm, by_dst), torch.tensor(cap), into[1])
            finish = torch.maximum(finish, out_finish.view(xa.shape))
            flat = finish.view(-1)
            flat[index] = torch.maximum(flat[index], in_finish[by_dst[1], by_dst[2]])
            xm = b.xo * mask
            out_load = xm.sum(-1)  # (W, P) by src
            in_load = torch.zeros(w_count, p, dtype=torch.float64).index_put(
                (win, dst), xm, accumulate=True
            )
            b.work[:, family], b.work[:, family + 1] = out_load / cap, in_load / cap
            if b.counted:
                totals[0] += out_load.sum(0)
                totals[1] += in_load.sum(0)
        return finish

    def _price_hops(self, b: _Batch) -> tuple[Tensor, Tensor]:
        """Per flow its seconds on its busiest ring hop and its hops (at least 1), the
        window's own flows only; fills families 5 and 6."""
        win, src, xa = b.win, b.src, b.xo
        w_count, p, _ = xa.shape
        worst = torch.zeros(xa.shape, dtype=torch.float64)
        forward = (b.dst - src) % p
        up = forward <= p - forward
        hops = torch.where(up, forward, p - forward)
        first = torch.where(up, src, (src - hops + 1) % p)  # origin of the first hop
        for direction, mask in ((0, up), (1, ~up)):
            sel = mask & (xa > 0) & (hops > 0)
            if not bool(sel.any()):
                continue
            wi, st, h, xs = win[sel], first[sel], hops[sel], xa[sel]
            load = _range_add(w_count, p, wi, st, h, xs)  # (W, P) per hop origin
            flows = _range_add(w_count, p, wi, st, h, torch.ones_like(xs))
            b.work[:, 5 + direction] = load / self.link
            if b.counted:
                self.hop_totals[direction] += load.sum(0)
            max_load = _range_max(torch.cat([load, load], 1), wi, st, h)
            max_flows = _range_max(torch.cat([flows, flows], 1), wi, st, h)
            worst[sel] = torch.minimum(max_load, max_flows * xs) / self.link
        return worst, hops.clamp(min=1)

    def _count_other_pairs(self, src: Tensor, dst: Tensor, xa: Tensor) -> None:
        """Fold the flows of pairs other than (r, r - 1) into the busiest such pair."""
        if not src.numel():
            return
        keys, inverse = torch.unique(src * self.p + dst, return_inverse=True)  # sorted
        totals = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, inverse, xa)
        seconds = totals / self._pair_cap(keys // self.p, keys % self.p)
        i = int(torch.argmax(seconds))  # the first of equals: the smallest pair index
        best = (float(seconds[i]), int(keys[i]), float(totals[i]))
        if (best[0], -best[1]) > (self.other_best[0], -self.other_best[1]):
            self.other_best = best

    def add_windows(self, work: Tensor, window_start: Tensor) -> None:
        """Fold the work ``(W, 7, P)`` of consecutive windows starting at ``window_start``
        ``(W,)`` into :meth:`drain`."""
        before = self.work_before + work.cumsum(0) - work  # (W, 7, P): work before window w
        start = torch.where(work > 0, window_start.view(-1, 1, 1) - before, -math.inf)
        self.best_start = torch.maximum(self.best_start, start.amax(0))
        self.work_before = self.work_before + work.sum(0)

    def drain(self) -> float:
        """The drain bound of Note [Vectorised engine]; window starts never decrease, so
        sum_{v>=w} L_v = total - work before w and no (W, P) table is kept."""
        busy = torch.where(self.best_start > -math.inf, self.work_before + self.best_start, 0.0)
        return float(busy.max())

    def busiest(self) -> tuple[str, float, float]:
        """(name, bytes, seconds) of the resource with the largest bytes / bandwidth."""
        p = self.p
        candidates: list[tuple[str, float, float]] = []
        if not self.ring:
            ranks = torch.arange(p)
            seconds = self.down_totals / self._pair_cap(ranks, (ranks - 1) % p)
            j = int(torch.argmax(seconds))  # the first of equals: the smallest pair index
            down = (float(seconds[j]), j * p + (j - 1) % p, float(self.down_totals[j]))
            best = max(down, self.other_best, key=lambda c: (c[0], -c[1]))
            name = str(Resource(ResourceKind.LINK, divmod(best[1], p)))
            candidates.append((name, best[2], best[0]))
        for _, cap, totals, _, kinds in self.ports:
            i = int(torch.argmax(totals.reshape(-1)))
            side, rank = divmod(i, p)
            num = float(totals.reshape(-1)[i])
            candidates.append((str(Resource(kinds[side], (rank,))), num, num / cap))
        if self.ring:
            i = int(torch.argmax(self.hop_totals.reshape(-1)))
            direction, origin = divmod(i, p)
            num = float(self.hop_totals.reshape(-1)[i])
            step = 1 if direction == 0 else -1
            name = str(Resource(ResourceKind.LINK, (origin, (origin + step) % p)))
            candidates.append((name, num, num / self.link))
        return max(candidates, key=lambda c: c[2], default=("none", 0.0, 0.0))


def _range_add(
    num_windows: int, size: int, window: Tensor, start: Tensor, length: Tensor, value: Tensor
) -> Tensor:
    """(W, size): per window, the sum of ``value`` over circular ranges [start, start+length)."""
    diff = torch.zeros(num_windows, 2 * size + 1, dtype=torch.float64)
    diff.index_put_((window, start), value, accumulate=True)
    diff.index_put_((window, start + length), -value, accumulate=True)
    cum = torch.cumsum(diff, 1)
    return cum[:, :size] + cum[:, size : 2 * size]


def _range_max(values: Tensor, window: Tensor, start: Tensor, length: Tensor) -> Tensor:
    """max(values[window, start : start + length]) per query (length >= 1): a sparse table."""
    out = torch.empty(start.shape, dtype=torch.float64)
    level = torch.floor(torch.log2(length.double())).long()
    table = values
    for k in range(int(level.max()) + 1):
        if k > 0:
            span = 1 << (k - 1)
            table = torch.maximum(table[:, :-span], table[:, span:])
        sel = level == k
        if bool(sel.any()):
            wi, st, ln = window[sel], start[sel], length[sel]
            out[sel] = torch.maximum(table[wi, st], table[wi, st + ln - (1 << k)])
    return out


def _shared_finish(
    begin: Tensor, size: Tensor, cap: Tensor, flow_cap: Tensor, group: Tensor | None = None
) -> Tensor:
    """:func:`_played_finish` of the distinct rows only (``group`` ``(N, G)``: the flows of a
    row with equal labels share the resource, None: all): a ring's ranks and windows repeat
    a handful of rows (found by a hash of each row, checked exactly), and playing every row
    took P = 1024's ``tokenring simulate`` from 2.5 to 12 CPU seconds."""
    active = size > 0
    if not bool(active.any()):
        return begin.clone()
    n, g = size.shape
    parts = [torch.where(active, begin, 0.0), size]
    parts += [v.expand(n, g).double() for v in (cap, flow_cap, group) if v is not None and v.dim()]
    weights = torch.rand(
        len(parts), g, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    key = sum(part @ w for part, w in zip(parts, weights, strict=True))
    _, inverse = torch.unique(key, return_inverse=True)  # equal rows, equal keys
    first = torch.full((int(inverse.max()) + 1,), n, dtype=torch.int64)
    first = first.scatter_reduce(0, inverse, torch.arange(n), "amin")
    if not all(torch.equal(part[first][inverse], part) for part in parts):
        first, inverse = torch.arange(n), torch.arange(n)  # two rows' keys collided: play all
    b, x, c, f = (v if v.dim() == 0 else v[first] for v in (parts[0], size, cap, flow_cap))
    same = None if group is None else group[first].unsqueeze(-1) == group[first].unsqueeze(-2)
    finish = _played_finish(b, x, c, f, same)[inverse]
    return torch.where(active, finish, begin)


def _played_finish(
    begin: Tensor, size: Tensor, cap: Tensor, flow_cap: Tensor, same: Tensor | None = None
) -> Tensor:
    """When each flow's last byte leaves a resource it shares with other flows of its row
    (``(N, G)``; ``same`` ``(N, G, G)``: which of them share it, None: all): from ``begin``
    it moves at min(``flow_cap``, ``cap`` / flows moving), as the event engine shares
    bandwidth (Note [Sharing bandwidth]) on this resource alone. A flow of ``size`` 0 is none
    (its finish is its begin). Rows are played at once, one round per start or end: 2G."""
    done = size <= 0
    left, finish = size.clone(), begin.clone()
    now = torch.where(done, math.inf, begin).amin(-1, keepdim=True)
    for _ in range(4 * size.shape[-1] + 2):  # 2G events; ties that rounding splits take more
        moving = (begin <= now) & ~done
        waiting = (begin > now) & ~done
        if not bool(waiting.any() or moving.any()):
            break
        shares = moving.unsqueeze(-2) if same is None else same & moving.unsqueeze(-2)
        n = shares.sum(-1)
        rate = torch.where(moving, torch.minimum(flow_cap, cap / n.clamp(min=1)), 0.0)
        to_end = torch.where(moving, left / rate, math.inf).amin(-1, keepdim=True)
        next_start = torch.where(waiting, begin, math.inf).amin(-1, keepdim=True)
        starts = next_start - now <= to_end
        dt = torch.where(starts, next_start - now, to_end)
        left = left - rate * torch.where(torch.isinf(dt), 0.0, dt)
        now = torch.where(starts, next_start, now + dt)  # exactly the next start
        ended = moving & (left <= 1e-12 * size)
        finish = torch.where(ended, now, finish)
        done = done | ended
    assert bool(done.all()), "shared-bandwidth rounds did not end every flow"
    return finish


def _grouped(key: Tensor, active: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """The ``active`` flows (flat indices) of ``(..., G)`` grouped by ``key`` as rows of a
    table: (index, row, column, rows, columns). Where no two flows of a slot share a key
    (a ring's flows of a slot go to distinct ranks), row = key and column = slot: no sort,
    and alike rows for ``_shared_finish`` to merge."""
    index = active.flatten().nonzero().squeeze(1)
    g, flat = key.shape[-1], key.flatten()
    slot = index % g
    spots = torch.zeros(int(flat.max()) + 1 if flat.numel() else 0, g, dtype=torch.int64)
    spots.index_put_((flat[index], slot), torch.ones_like(index), accumulate=True)
    if not bool((spots > 1).any()):
        return index, flat[index], slot, spots.shape[0], g
    sorted_key, order = torch.sort(key.flatten()[index], stable=True)
    index = index[order]
    new = torch.ones(index.numel(), dtype=torch.bool)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    row = torch.cumsum(new, 0) - 1
    first = torch.nonzero(new).squeeze(1)
    column = torch.arange(index.numel()) - first[row]
    width = int(column.max()) + 1 if index.numel() else 0
    return index, row, column, first.numel(), width


def _rows(values: Tensor, g: int) -> Tensor:
    """``values`` ``(..., G)`` as rows ``(N, G)``; a 0-d tensor (one value for all) as is."""
    return values.reshape(-1, g) if values.dim() else values


def _table(values: Tensor, groups: tuple[Tensor, Tensor, Tensor, int, int]) -> Tensor:
    """``values`` of the grouped flows as their rows (0 where a row has fewer)."""
    index, row, column, rows, width = groups
    out = torch.zeros(rows, width, dtype=torch.float64)
    out[row, column] = values.flatten()[index].double()
    return out


_CHUNK_CELLS = 1 << 19  # (rank, step) cells the vectorised engine holds at once


class _Replay:
    """The vectorised engine's clock: ``ring_step_order`` step by step, one op for all ranks
    at once, times as ``(P,)`` tensors (Note [Vectorised engine])."""

    def __init__(self, plan: RingPlan, dims: AttentionShape, hardware: Hardware) -> None:
        p, mem = plan.world_size, hardware.memory_bandwidth_bytes_per_s
        self.plan, self.p = plan, p
        self.backward = plan.pass_ is Pass.BACKWARD
        self.host_computes = hardware.host_computes
        self.ranks = torch.arange(p)
        self.up = (self.ranks + plan.direction) % p  # where the travelling blocks go
        scale = 4.0 * dims.batch * dims.head_dim * (2.5 if self.backward else 1.0)
        self.kernel_per_pair = scale / hardware.flops_per_s(plan.pass_, dims.dtype)
        partial = Payload.DQ if self.backward else Payload.OUT
        self.own_merge_per_row = _taken_bytes(partial, 1, dims) / mem
        # a returned partial's merge or dQ add
        self.return_merge_per_row_head = _taken_bytes(partial, 1, dims, 1) / mem
        self.dkv_add = _taken_bytes(Payload.DKV, plan.seq_local, dims) / mem
        zeros = torch.zeros(p, dtype=torch.float64)
        delta = _delta_bytes(plan.seq_local, dims) / mem if self.backward else 0.0
        self.now, self.kernel_s, self.memory_s = zeros + delta, zeros.clone(), zeros + delta
        self.send_done, self.travel_in, self.own_travel = zeros.clone(), zeros, zeros
        self.returned: dict[int, list[tuple[Tensor, Tensor]]] = {}  # by receiver
        self.own_returns: dict[int, Tensor] = {}  # per step: when r's returns arrived
        self.passing = (zeros, zeros)  # accumulators to pass on: (arrival, has) by receiver
        self.home = (torch.full((p,), -math.inf, dtype=torch.float64), zeros.clone())  # (A, C)
        self.starts: list[float] = []  # per step: the earliest rank's start
        self.step_s: list[float] = []
        self.zeros = zeros

    def _arrive(self, dst: Tensor, num_bytes: Tensor, dur: Tensor) -> tuple[Tensor, Tensor]:
        """Flows posted now by every rank to ``dst`` (both ends post in this op): (arrival,
        has) by sender; counts the sends towards SENT_ALL."""
        has = num_bytes > 0
        arrival = torch.where(has, torch.maximum(self.now, self.now[dst]) + dur, 0.0)
        self.send_done = torch.maximum(self.send_done, arrival)
        return arrival, has

    def _received(
        self, dst: Tensor, arrival: Tensor, has: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(arrival, value >= 0) by receiver of flows reaching each receiver at most once."""
        at = self.zeros.scatter_reduce(0, dst, torch.where(has, arrival, 0.0), "amax")
        return at, self.zeros.scatter_reduce(0, dst, torch.where(has, value, 0.0), "amax")

    def load(self, col: RingColumns, num_steps: int) -> None:
        """Read a chunk's first ``num_steps`` columns: each segment's kernel and own merge
        (``work`` (P, T, K) seconds), and each step's segments and slots."""
        kernel, merge = self.segment_work(col, num_steps)
        self.kernel_s += kernel.sum((1, 2))
        self.memory_s += merge.sum((1, 2))
        self.work = kernel + merge
        self.num_segments = (col.segment_rows[:, :num_steps] > 0).sum(-1).amax(0).tolist()
        self.sends_dkv = (col.dkv_rows[:, :num_steps] > 0).any(0).tolist()

    def segment_work(self, col: RingColumns, num_steps: int | None = None) -> tuple[Tensor, Tensor]:
        """(P, T, K) seconds of each segment's kernel and own merge (dQ add) over the first
        ``num_steps`` columns (None: all): COMPUTE t k."""
        rows = col.segment_rows[:, :num_steps].double()
        kernel = col.segment_pairs[:, :num_steps] * self.kernel_per_pair
        own = (col.q_owner[:, :num_steps] == self.ranks.unsqueeze(1)).unsqueeze(-1)
        return kernel, torch.where(own, rows * self.own_merge_per_row, 0.0)

    def returned_merges(self, col: RingColumns) -> Tensor:
        """(P, T) seconds each rank spends merging (adding) the partials returned to it
        from each column of ``col`` (TokenRing; 0 for Ring)."""
        cost = (col.return_rows * col.segment_heads).sum(-1).double()
        cost = cost * self.return_merge_per_row_head * self.plan.strategy.passes_q
        return torch.zeros_like(cost).scatter_add_(0, col.q_owner, cost)

    def run(
        self, col: RingColumns, steps: range, dur: Tensor, tail: Tensor, *, together: bool
    ) -> None:
        """Replay a chunk's ``steps`` (``dur[j]``, ``tail``: as ``_step_durations`` takes them)."""
        self.load(col, len(steps))
        for j, t in enumerate(steps):
            self.step(t, col, j, _step_durations(dur, tail, col, t, j, together=together))

    def step(self, t: int, col: RingColumns, j: int, dur: dict[str, Tensor]) -> None:
        """Step ``t`` (column ``j``); ``dur``: ``travel`` (P,), ``returns`` (P, K), ``dkv`` (P,)."""
        self.starts.append(float(self.now.min()))
        self.travel_in = self.own_travel = self.zeros
        num, work = self.num_segments[j], self.work[:, j]
        slots = {0} if t < self.p - 1 else set()
        slots |= set(range(1, num + 1)) if self.plan.strategy.passes_q and t >= 1 else set()
        slots |= {max(1, num)} if self.sends_dkv[j] else set()
        start = self.now.clone()
        lead = t == 0 and self.host_computes
        order = ring_step_order(
            num, slots, backward=self.backward, returns=t >= 2, compute_first=lead
        )
        for kind, index in order:
            if kind is OpKind.POST:
                self._post(t, col, j, index, num, dur)
            elif kind is OpKind.COMPUTE:
                self.now = self.now + work[:, index]
            elif kind is OpKind.PASS:
                self._add(*self.passing, self.dkv_add)
                self.passing = (self.zeros, self.zeros)
            elif kind is OpKind.RETURNS:
                for arrival, cost in self.returned.pop(t - 2, []):
                    self._add(arrival, cost > 0, cost)
            elif kind is OpKind.ARRIVE:
                self.now = torch.maximum(self.now, self.travel_in)
            elif kind is OpKind.SENT:
                sent = self.own_returns.pop(t - 2, self.zeros)
                self.now = torch.maximum(self.now, torch.maximum(self.own_travel, sent))
        self.step_s.append(float((self.now - start).max()))

    def _post(
        self, t: int, col: RingColumns, j: int, after: int, num: int, dur: dict[str, Tensor]
    ) -> None:
        """POST t ``after``: 0 the travelling block, k+1 TokenRing's partial of segment k,
        max(1, n) Ring's accumulator (Note [Rank program])."""
        plan = self.plan
        if after == 0:
            arrival, has = self._arrive(self.up, col.travel_rows[:, j], dur["travel"])
            self.own_travel = arrival
            self.travel_in, _ = self._received(self.up, arrival, has, arrival)
        if plan.strategy.passes_q and 1 <= after <= num:
            k, dst = after - 1, col.q_owner[:, j]
            rows = col.return_rows[:, j, k].double()
            arrival, has = self._arrive(dst, rows, dur["returns"][:, k])
            cost = rows * col.segment_heads[:, j, k] * self.return_merge_per_row_head
            self.returned.setdefault(t, []).append(self._received(dst, arrival, has, cost))
            mine = self.own_returns.get(t, self.zeros)
            self.own_returns[t] = torch.maximum(mine, arrival)
        if plan.return_payload is Payload.DKV and after == max(1, num):
            dst, home = col.dkv_dst[:, j], col.dkv_home[:, j]
            arrival, has = self._arrive(dst, col.dkv_rows[:, j], dur["dkv"])
            self.passing = self._received(dst, arrival, has & ~home, (has & ~home).double())
            at, got = self._received(dst, arrival, has & home, (has & home).double())
            reach, total = self.home  # HOME takes them in step order: fold max(x, a) + c
            got_home = got > 0
            self.home = (
                torch.where(got_home, torch.maximum(reach, at) + self.dkv_add, reach),
                torch.where(got_home, total + self.dkv_add, total),
            )

    def _add(self, arrival: Tensor, has: Tensor, cost: Tensor | float) -> None:
        """Wait for what arrives where ``has``, then merge or add it (``cost`` seconds)."""
        has = has > 0
        cost = torch.where(has, cost, 0.0)
        self.now = torch.where(has, torch.maximum(self.now, arrival), self.now) + cost
        self.memory_s += cost

    def end(self) -> Tensor:
        """END, the RETURNS of the last two steps, HOME and SENT_ALL: each rank's end."""
        for t in sorted(self.returned):
            for arrival, cost in self.returned.pop(t):
                self._add(arrival, cost > 0, cost)
        reach, total = self.home
        self.memory_s += total
        self.now = torch.maximum(self.now + total, reach)
        return torch.maximum(self.now, self.send_done)


def _flow_bytes(
    plan: RingPlan, col: RingColumns, dims: AttentionShape
) -> tuple[Tensor, Tensor, Tensor]:
    """Bytes of each step's flows: travel (P, T), returns (P, T, K), accumulators (P, T)."""
    travel = col.travel_rows.double() * dims.row_bytes(plan.travel_payload)
    ret_payload = plan.return_payload
    per_head = dims.row_bytes(ret_payload, 1) if plan.strategy.passes_q and ret_payload else 0
    returns = (col.return_rows * col.segment_heads).double() * per_head
    dkv = col.dkv_rows.double() * dims.row_bytes(Payload.DKV)
    return travel, returns, dkv


def _window_flows(
    plan: RingPlan,
    col: RingColumns,
    flows: tuple[Tensor, Tensor, Tensor],
    windows: range,
    posted: Tensor | None = None,
    *,
    computes_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``flows`` (``_flow_bytes``) of ``windows`` as ``(W, P, G)`` bytes, receivers and
    starts (seconds from the window's start), and ``(P, 2)`` the exposed ones of the last
    step. Slots: 0 the travel of step w, at the start (after segment 0 on step 0 where the
    forward ``computes_first``: ``ring_step_order``); 1..K the returns of step w, each after
    its segment (``posted[:, j, k]``: its step's work up to it), but on the last step each
    rank's last; K+1 the accumulators of step w-1, posted as step w starts.

    Without ``posted``, on a physical ring (Note [Vectorised engine]), every flow starts with
    its window and the slots are: 0 the travel of step w, 1..K the returns of step w-1,
    K+1..2K those of the last step but each rank's last (window P-1), 2K+1 the accumulators
    of step w-1."""
    p, first = plan.world_size, col.steps.start
    travel, returns, dkv = flows
    k = returns.shape[2]
    together = posted is None
    g = 2 * k + 2 if together else k + 2
    x = torch.zeros(len(windows), p, g, dtype=torch.float64)
    start = torch.zeros_like(x)
    dst = ((torch.arange(p) + plan.direction) % p).view(1, p, 1).repeat(len(windows), 1, g)
    for i, w in enumerate(windows):
        j = w - first
        x[i, :, 0] = travel[:, j]
        if (jr := j - together) >= 0:  # the column whose returns fly in this window
            x[i, :, 1 : k + 1], dst[i, :, 1 : k + 1] = returns[:, jr], col.q_owner[:, jr, None]
        if posted is not None:
            start[i, :, 1 : k + 1] = posted[:, j]
        if j >= 1:
            x[i, :, -1], dst[i, :, -1] = dkv[:, j - 1], col.dkv_dst[:, j - 1]
    exposed = torch.zeros(p, 2, dtype=torch.float64)
    if windows and windows.start == 0 and computes_first and posted is not None:
        start[0, :, 0] = posted[:, 0, 0]
    if windows and windows[-1] == p - 1:
        j, lo = p - 1 - first, 1 + k * together
        last = _last_segment(col, j)  # (P, K): each rank's last return is exposed
        x[-1, :, lo : lo + k] = torch.where(last, 0.0, returns[:, j])
        dst[-1, :, lo : lo + k] = col.q_owner[:, j, None]
        exposed[:, 0] = torch.where(last, returns[:, j], 0.0).sum(-1)
        exposed[:, 1] = dkv[:, j]
    return x, dst, start, exposed


def _last_segment(col: RingColumns, j: int) -> Tensor:
    """(P, K) bool: segment k is the last of rank r's segments at column j."""
    num = (col.segment_rows[:, j] > 0).sum(-1, keepdim=True)
    return torch.arange(col.segment_rows.shape[2]) == num - 1


_Flows = tuple[Tensor, Tensor, Tensor]
"""``(W, P, G)`` flows: bytes (0: none), receivers, starts in seconds from their window's."""


def _price_used(
    net: _Network, x: Tensor, dst: Tensor, start: Tensor, own: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:meth:`_Network.price` of the slots that hold a flow in some window (0 elsewhere)."""
    used = (x > 0).flatten(0, 1).any(0)
    dur = torch.zeros_like(x)
    mine = None if own is None else own[:, :, used]
    dur[:, :, used], work = net.price(
        x[:, :, used], dst[:, :, used], start=start[:, :, used], own=mine
    )
    return dur, work


def _price_windows(
    net: _Network, flows: _Flows, step_work: Tensor, before: _Flows | None
) -> tuple[Tensor, Tensor, _Flows]:
    """Durations ``(W, P, G)`` and work ``(W, 7, P)`` of consecutive windows' ``flows``, each
    window's sharing with those of the window before that are still in flight
    (``before``: that of the first, None for window 0; the third value is the last's, for
    the next call). A window ends at each rank with its travel, as priced alone, in and out,
    or its ``step_work`` ``(W, P)`` (Note [Vectorised engine])."""
    x, dst, start = flows
    alone, _ = net.price(x, dst, start=start, count=False)
    g = x.shape[-1]
    ends = start + alone  # the travel and the accumulators end in their window:
    confined = torch.maximum(ends[:, :, 0], ends[:, :, g - 1])
    step = torch.maximum(confined, step_work).amax(-1, keepdim=True)  # the ring waits for all
    ended = (x, dst, start - step.unsqueeze(-1))  # from the end of their window
    if before is None:
        before = (torch.zeros_like(x[:1]), torch.zeros_like(dst[:1]), torch.zeros_like(start[:1]))
    x, dst, start = (
        torch.cat([torch.cat([b, e[:-1]]), v], -1)
        for b, e, v in zip(before, ended, flows, strict=True)
    )
    own = torch.zeros(x.shape, dtype=torch.bool)
    own[:, :, g:] = True
    dur, work = _price_used(net, x, dst, start, own)
    return dur[:, :, g:], work, tuple(v[-1:] for v in ended)  # type: ignore[return-value]


def _step_durations(
    dur: Tensor, tail: Tensor, col: RingColumns, t: int, j: int, *, together: bool
) -> dict[str, Tensor]:
    """Durations of step t's flows (window t is ``dur[j]``): its travel and returns fly in
    window t (its returns in window t + 1 if ``together``: ``_window_flows`` without
    ``posted``), its accumulators in window t + 1; the last step's last returns and
    accumulators, exposed, in ``tail``."""
    k = col.segment_rows.shape[2]
    returns = dur[j + together, :, 1 : k + 1] if t < col.q_owner.shape[0] - 1 else None
    if returns is not None:
        dkv = dur[j + 1, :, -1]
    else:
        left = dur[j, :, k + 1 : 2 * k + 1] if together else dur[j, :, 1 : k + 1]
        returns = torch.where(_last_segment(col, j), tail[:, :1], left)
        dkv = tail[:, 1]
    return {"travel": dur[j, :, 0], "returns": returns, "dkv": dkv}


def _last_merge_s(plan: RingPlan, col: RingColumns, replay: _Replay, c0: int) -> float:
    """The merge or add of the exposed tail (``col``: the last chunk's, from step ``c0``)."""
    last = _last_segment(col, plan.world_size - 1 - c0)
    exposed_rows = torch.where(last, col.return_rows[:, -1] * col.segment_heads[:, -1], 0)
    last_merge = float(exposed_rows.sum(-1).max()) * replay.return_merge_per_row_head
    if plan.return_payload is Payload.DKV and plan.world_size > 1:
        last_merge += replay.dkv_add
    return last_merge


def _price_chunk(
    plan: RingPlan,
    hardware: Hardware,
    net: _Network,
    replay: _Replay,
    col: RingColumns,
    flows: tuple[Tensor, Tensor, Tensor],
    windows: range,
    before: _Flows | None,
    merged_before: Tensor,
) -> tuple[Tensor, Tensor, Tensor, _Flows | None, Tensor]:
    """A chunk's ``windows``: durations, work, the exposed tail's bytes, and for the next chunk
    its last window's flows and the returns merged on its last step (``before`` and
    ``merged_before``: this chunk's, from the chunk before). Each flow starts at its post
    (``_window_flows``, ``_price_windows``), or on a physical ring with its window
    (Note [Vectorised engine])."""
    if net.ring:
        x, dst, start, tail_x = _window_flows(plan, col, flows, windows)
        return (*_price_used(net, x, dst, start), tail_x, before, merged_before)
    c0 = col.steps.start
    kernel, merge = replay.segment_work(col)
    posted = (kernel + merge).cumsum(-1)  # (P, T, K): the work up to segment k
    lead = hardware.host_computes and plan.pass_ is Pass.FORWARD
    x, dst, start, tail_x = _window_flows(plan, col, flows, windows, posted, computes_first=lead)
    merges = torch.cat([merged_before, replay.returned_merges(col)], 1)  # from c0 - 1
    dur, work = torch.zeros_like(x), torch.zeros(0, 7, plan.world_size)
    if windows:  # each window's work: its segments, the returns of two steps before merged
        step_work = torch.stack(
            [posted[:, w - c0, -1] + merges[:, w - c0 - 1] * (w >= 2) for w in windows]
        )
        dur, work, before = _price_windows(net, (x, dst, start), step_work, before)
    return dur, work, tail_x, before, merges[:, -2:-1]


def _simulate_vectorised(
    plan: RingPlan, layout: Layout, causal: bool, dims: AttentionShape, hardware: Hardware
) -> PassResult:
    """Note [Vectorised engine]: price each chunk's windows (``_Network.price``; the exposed
    tail's with the last), then replay its steps."""
    p = plan.world_size
    net, replay = _Network(hardware, p), _Replay(plan, dims, hardware)
    chunk = max(1, _CHUNK_CELLS // p)
    travel_sent, return_sent = replay.zeros.clone(), replay.zeros.clone()
    last_window: Tensor | None = None  # durations of the previous chunk's last window
    before: _Flows | None = None  # its flows, from its estimated end (_price_windows)
    merged_before = torch.zeros(p, 1, dtype=torch.float64)  # returns merged, step c0 - 1
    tail, tail_work = torch.zeros(1, p, 2, dtype=torch.float64), torch.zeros(1, 7, p)
    for c0 in range(0, p, chunk):
        c1 = min(p, c0 + chunk)
        col = plan.columns(range(c0, min(p, c1 + 1)))  # and the step after: its window
        windows = range(0 if c0 == 0 else c0 + 1, min(p, c1 + 1))
        flows = _flow_bytes(plan, col, dims)
        dur, work, tail_x, before, merged_before = _price_chunk(
            plan, hardware, net, replay, col, flows, windows, before, merged_before
        )
        if windows and windows[-1] == p - 1:  # and the exposed tail: the last returns, uncounted
            tail_dst = torch.stack([col.q_owner[:, -1], col.dkv_dst[:, -1]], 1).unsqueeze(0)
            tail_x = tail_x.unsqueeze(0)
            tail, tail_work = net.price(
                tail_x, tail_dst, start=torch.zeros_like(tail_x), count=False
            )
        dur = dur if last_window is None else torch.cat([last_window, dur])
        last_window = dur[-1:]
        travel, returns, dkv = flows
        travel_sent += travel[:, : c1 - c0].sum(1)
        return_sent += returns[:, : c1 - c0].sum((1, 2)) + dkv[:, : c1 - c0].sum(1)
        replay.run(col, range(c0, c1), dur, tail[0], together=net.ring)
        if windows:  # the last chunk's may be priced already (the chunk before looked ahead)
            starts = replay.starts[windows.start :] + [float(replay.now.min())] * (c1 < p)
            net.add_windows(work, torch.tensor(starts, dtype=torch.float64))
    net.add_windows(tail_work, replay.now.min().view(1))
    call_s = max(float(replay.end().max()), net.drain() + _last_merge_s(plan, col, replay, c0))
    busiest_name, busiest_bytes, busiest_s = net.busiest()
    return PassResult(
        strategy=plan.strategy,
        pass_=plan.pass_,
        layout=layout,
        causal=causal,
        world_size=p,
        seq_local=plan.seq_local,
        mode="vectorised",
        call_s=call_s,
        step_s=tuple(replay.step_s),
        compute_s=float(replay.kernel_s.max()),
        merge_s=float(replay.memory_s.max()),
        busiest_resource=busiest_name,
        busiest_bytes=int(busiest_bytes),
        busiest_s=busiest_s,
        exposed_s=float(tail.max()),
        travel_bytes=int(travel_sent.max()),
        return_bytes=int(return_sent.max()),
        timeline=None,
    )


# -- public entry points -----------------------------------------------------------------------
def simulate_schedule(sched: Schedule, *, shape: AttentionShape, hardware: Hardware) -> PassResult:
    """Predict one pass of any strategy's schedule with the event engine, which replays
    ``program_of`` of each rank (Note [Replaying the rank program]).

    Raises:
        ValueError: a dtype the hardware has no FLOP/s for.
    """
    p = sched.world_size
    engine = _EventEngine(sched.transfers, p, sched.num_steps, shape, hardware, sched.pass_)
    engine.run([engine._actions(sched, r) for r in range(p)])
    step_start = engine.step_start
    exposed = exposed_transfers(sched)
    busiest_name, busiest_bytes, busiest_s = engine.busiest(exposed)
    routes = [(tr.num_bytes(shape), transfer_route(hardware, sched, tr)) for tr in exposed]
    exposed_s = max((n / rt.flow_cap_bytes_per_s + rt.latency_s for n, rt in routes), default=0.0)
    travel_bytes, return_bytes = max_sent(sched.transfers, p, shape)
    return PassResult(
        strategy=sched.strategy,
        pass_=sched.pass_,
        layout=sched.layout,
        causal=sched.causal,
        world_size=p,
        seq_local=sched.seq_local,
        mode="event",
        call_s=max(engine.finish),
        step_s=tuple(
            max(step_start[r][t + 1] - step_start[r][t] for r in range(p))
            for t in range(sched.num_steps)
        ),
        compute_s=engine.busy_s("compute"),
        merge_s=engine.busy_s("merge"),
        busiest_resource=busiest_name,
        busiest_bytes=busiest_bytes,
        busiest_s=busiest_s,
        exposed_s=exposed_s,
        travel_bytes=travel_bytes,
        return_bytes=return_bytes,
        timeline=engine.timeline(),
    )


def simulate_pass(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    shape: AttentionShape,
    hardware: Hardware,
    last_block_splits: int = 2,
    mode: str = "auto",
    hybrid: HybridSpec | None = None,
    lend_last_pair: bool = False,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> PassResult:
    """Predict one pass of one strategy.

    Args:
        strategy, pass_, layout, causal, world_size, seq_local, last_block_splits,
            lend_last_pair: as ``tokenring.strategies.build_schedule``.
        shape: batch, heads, head dim and dtype.
        hardware: the machine (``costmodel.PRESETS`` or ``measured(...)``).
        mode: ``event``, ``vectorised``, or ``auto`` (event up to EVENT_MAX_WORLD_SIZE ranks).
        hybrid: inner size and outer strategy of ``Strategy.HYBRID`` (required for it).
        cu_seqlens, window_size, attention_chunk_size: the call's mask, as
            ``sequence_parallel_attn``'s (Note [Mask classes] in tokenring.core.masks);
            ``cu_seqlens`` ends at S, which ``world_size`` ranks of ``seq_local`` padded rows
            hold. A window or documents are priced as the runtime runs them (Note [Masked
            calls]); none (or one document) prices the plain call, padding unpriced.

    Raises:
        ValueError: unknown strategy/pass/layout/mode, mode="event" above
            EVENT_LIMIT_WORLD_SIZE ranks, a seq_local the layout cannot split,
            a dtype the hardware has no FLOP/s for, a hybrid without (a fitting) ``hybrid``,
            a ``shape``, ``hardware`` or ``hybrid`` of the wrong type, a non-bool
            ``lend_last_pair``; bad ``cu_seqlens``, ``window_size`` or
            ``attention_chunk_size``, or documents the layout does not shard into
            ``seq_local`` rows per rank.
        NotImplementedError: the vectorised engine (``mode``, or ``auto`` above
            EVENT_MAX_WORLD_SIZE) for a strategy not in VECTORISED_STRATEGIES, for a
            TokenRing schedule that lends its last pair, or for a window or documents.
    """
    strategy = Strategy.parse(strategy)
    pass_ = parse_enum(Pass, pass_, "pass_")
    layout = Layout.parse(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    validate_seq_local(seq_local, layout)
    _check_types(shape=shape, hardware=hardware, hybrid=hybrid, lend_last_pair=lend_last_pair)
    masked = call_mask(
        layout=layout, causal=causal, world_size=world_size, seq_local=seq_local,
        cu_seqlens=cu_seqlens, window_size=window_size, attention_chunk_size=attention_chunk_size,
    )  # fmt: skip
    mode = _engine(mode, strategy, world_size)
    hardware.flops_per_s(pass_, shape.dtype)  # a dtype it has FLOP/s for, before the schedule
    call: dict[str, Any] = dict(layout=layout, causal=causal, world_size=world_size)
    call |= dict(seq_local=seq_local, heads_q=shape.heads_q, heads_kv=shape.heads_kv)
    call["last_block_splits"] = last_block_splits
    if masked is not None:  # Note [Masked calls]: the event engine, on the masked schedule
        _check_masked_engine(mode, world_size)
        call |= dict(seq_local=None, seq_len=masked.seq_len, **masked.keywords)
    lends = strategy is Strategy.TOKEN_RING and lend_last_pair
    if mode == "event" or (lends and world_size <= LEND_MAX_WORLD_SIZE):
        sched = strategy_schedule(
            strategy, pass_, hybrid=hybrid, lend_last_pair=lend_last_pair, **call
        )
        if mode == "event":
            return simulate_schedule(sched, shape=shape, hardware=hardware)
        _check_plain_tail(sched)
    return _simulate_vectorised(ring_plan(strategy, pass_, **call), layout, causal, shape, hardware)


def _check_masked_engine(mode: str, world_size: int) -> None:
    """NotImplementedError unless the event engine prices a masked call (Note [Masked calls])."""
    if mode != "event":
        raise NotImplementedError(
            "the vectorised engine replays the columns of a plain causal or full mask; a "
            f"window or documents need the event engine (mode='event', up to "
            f"{EVENT_LIMIT_WORLD_SIZE} ranks); got world_size={world_size}, mode={mode!r}"
        )


def _check_plain_tail(sched: Schedule) -> None:
    """NotImplementedError where TokenRing's ``sched`` lends its last pair, which the
    vectorised engine's columns do not."""
    if any(tr.payload is Payload.KV for tr in sched.transfers):
        raise NotImplementedError(
            "the vectorised engine's columns have TokenRing's plain tail, and this "
            "schedule lends its last pair (Note [Borrowed last pair] in "
            "tokenring.strategies.ring): use mode='event', or lend_last_pair=False"
        )


@dataclass(frozen=True, slots=True)
class CallMask:
    """A call's window or documents as the schedule builders take them (:func:`call_mask`)."""

    seq_len: int
    """S: the tokens of the call (the ranks hold ``sharding.seq_local`` padded rows each)."""
    sharding: Sharding
    """The call's sharding of S, documents included."""
    mask: MaskSpec
    """Its mask (not plain: a window or documents)."""
    cu_seqlens: tuple[int, ...] | None
    window_size: tuple[int, int]
    attention_chunk_size: int | None

    @property
    def keywords(self) -> dict[str, Any]:
        """``cu_seqlens``, ``window_size``, ``attention_chunk_size`` for the builders."""
        names = ("cu_seqlens", "window_size", "attention_chunk_size")
        return {name: getattr(self, name) for name in names}

    def describe(self) -> str:
        """A few words: the window, the documents, the chunks."""
        words = []
        if self.window_size != (-1, -1) and self.window_size != (-1, 0):
            words.append(f"window {self.window_size}")
        if self.cu_seqlens is not None and len(self.cu_seqlens) > 2:
            words.append(f"{len(self.cu_seqlens) - 1} documents")
        if self.attention_chunk_size is not None:
            words.append(f"chunks of {self.attention_chunk_size}")
        return ", ".join(words) or "its mask"


def call_mask(
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> CallMask | None:
    """A call's mask, checked as ``sequence_parallel_attn`` checks it, or None where it is plain
    (no window, at most one document: the call is priced as before; Note [Masked calls]).

    Raises:
        ValueError: a bad ``window_size``, ``attention_chunk_size`` or ``cu_seqlens`` (each
            named, with its value), or documents that ``layout`` does not shard into
            ``seq_local`` rows per rank.
    """
    layout = Layout.parse(layout)
    window = normalize_window(window_size, causal=causal)
    if attention_chunk_size is not None and not (
        is_int(attention_chunk_size) and int(attention_chunk_size) >= 1
    ):
        raise ValueError(
            f"attention_chunk_size must be an int >= 1 or None; got {attention_chunk_size!r}"
        )
    seq_len = world_size * seq_local
    bounds = None
    if cu_seqlens is not None:
        try:  # its last value is S; normalize_cu_seqlens names what else is wrong
            items = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
        except TypeError:
            items = []
        if items and is_int(items[-1]):
            seq_len = int(items[-1])
        bounds = normalize_cu_seqlens(cu_seqlens, seq_len)
    sharding = make_sharding(
        layout=layout, world_size=world_size, seq_len=seq_len, cu_seqlens=bounds
    )
    if sharding.seq_local != seq_local:
        raise ValueError(
            f"cu_seqlens must describe the call whose {world_size} ranks hold seq_local="
            f"{seq_local} rows each; got cu_seqlens ending at {seq_len} ({sharding.num_docs} "
            f"documents), which layout '{layout.value}' shards into {sharding.seq_local} padded "
            f"rows per rank"
        )
    chunk = None if attention_chunk_size is None else int(attention_chunk_size)
    docs = chunk_documents(sharding.cu_seqlens, chunk)
    mask = MaskSpec(causal, window, docs if len(docs) > 2 else None)
    if mask.plain:
        return None
    return CallMask(
        seq_len=seq_len,
        sharding=sharding,
        mask=mask,
        cu_seqlens=None if bounds is None else sharding.cu_seqlens,
        window_size=window,
        attention_chunk_size=chunk,
    )


def _check_types(
    *, shape: object, hardware: object, hybrid: object, lend_last_pair: object
) -> None:
    """ValueError naming an argument of :func:`simulate_pass` that has the wrong type (a
    truthy ``lend_last_pair="no"`` would lend)."""
    for name, value, kind, expected in (
        ("shape", shape, AttentionShape, "an AttentionShape"),
        ("hardware", hardware, Hardware, "a Hardware (costmodel.preset(name) for a preset)"),
        ("hybrid", hybrid, HybridSpec | None, "a HybridSpec or None"),
        ("lend_last_pair", lend_last_pair, bool, "a bool"),
    ):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be {expected}; got {value!r}")


def _engine(mode: str, strategy: Strategy, world_size: int) -> str:
    """The engine ``mode`` asks for: ``event`` or ``vectorised`` (``auto`` by world size)."""
    if mode not in ("auto", "event", "vectorised"):
        raise ValueError(f"mode must be one of 'auto', 'event', 'vectorised'; got {mode!r}")
    if mode == "auto":
        mode = "event" if world_size <= EVENT_MAX_WORLD_SIZE else "vectorised"
    if mode == "event" and world_size > EVENT_LIMIT_WORLD_SIZE:
        raise ValueError(
            f"mode='event' replays every message of every rank: world_size={world_size} is "
            f"above its limit of {EVENT_LIMIT_WORLD_SIZE} (its time grows as about P**3: 64 "
            "ranks take seconds, 256 a few minutes); use mode='auto' or 'vectorised'"
        )
    if mode == "vectorised" and strategy not in VECTORISED_STRATEGIES:
        raise NotImplementedError(
            f"the vectorised engine replays the columns of "
            f"{', '.join(s.value for s in VECTORISED_STRATEGIES)}; got strategy "
            f"{strategy.value!r} (the event engine runs it up to {EVENT_MAX_WORLD_SIZE} ranks)"
        )
    return mode


def strategy_schedule(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int | None = None,
    heads_q: int,
    heads_kv: int,
    last_block_splits: int = 2,
    hybrid: HybridSpec | None = None,
    seq_len: int | None = None,
    lend_last_pair: bool = False,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> Schedule:
    """The schedule of one pass of any strategy (``build_schedule``, or the collective or
    hybrid builder): what the event engine plays and bench reads.

    Give ``seq_local`` (every rank holds s tokens) or ``seq_len`` (any S, as ``tokenring.shard``
    splits it: the collectives get the padded buffer they run on, the hybrid its padded outer
    shards split evenly over the inner ranks, approximate when P_in does not divide them).
    ``cu_seqlens``, ``window_size``, ``attention_chunk_size``: the mask, as ``build_schedule``
    (and the hybrid's builder) take it; a collective gets its plain schedule of the padded
    rows with a window or documents attached as ``sharding`` and ``mask``, which is how its
    runtime runs them (Note [Masked calls]).

    Raises:
        ValueError: as the builders; a hybrid without ``hybrid``; both or neither of
            ``seq_local`` and ``seq_len``.
    """
    strategy = Strategy.parse(strategy)
    pass_ = Pass(pass_)
    if (seq_local is None) == (seq_len is None):
        raise ValueError(
            f"give exactly one of seq_local and seq_len; got seq_local={seq_local}, "
            f"seq_len={seq_len}"
        )
    common: dict[str, Any] = dict(layout=layout, causal=causal, world_size=world_size)
    common |= dict(heads_q=heads_q, heads_kv=heads_kv)
    masking: dict[str, Any] = dict(cu_seqlens=cu_seqlens, window_size=window_size)
    masking["attention_chunk_size"] = attention_chunk_size
    given = any(value is not None for value in masking.values())
    if strategy.is_ring:
        common |= dict(last_block_splits=last_block_splits, lend_last_pair=lend_last_pair)
        return build_schedule(
            strategy, pass_, seq_local=seq_local, seq_len=seq_len, **common, **masking
        )
    if strategy is Strategy.HYBRID:  # its builder takes a mask with seq_len
        if seq_len is not None and not given:
            seq_local, seq_len = _hybrid_rows(layout, world_size, seq_len, hybrid), None
        if hybrid is None:
            raise ValueError(
                "hybrid must give the inner size and outer strategy for strategy 'hybrid' "
                "(a tokenring.strategies.hybrid.HybridSpec); got None"
            )
        return build_hybrid_schedule(
            pass_, spec=hybrid, last_block_splits=last_block_splits, seq_local=seq_local,
            seq_len=seq_len, **common, **masking,
        )  # fmt: skip
    if seq_len is not None:  # the collective's padded buffer
        sharding = make_sharding(
            layout=layout, world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
        )
        seq_local = sharding.seq_local
    assert seq_local is not None
    sched = build_collective_schedule(strategy.value, pass_, seq_local=seq_local, **common)
    if not given:
        return sched
    if masking["cu_seqlens"] is None and seq_len is not None:  # S, padding included
        masking["cu_seqlens"] = (0, seq_len)
    masked = call_mask(
        layout=layout, causal=causal, world_size=world_size, seq_local=seq_local, **masking
    )
    if masked is None:  # plain: as without the keywords
        return sched
    return replace(sched, sharding=masked.sharding, mask=masked.mask)


def _hybrid_rows(
    layout: Layout | str, world_size: int, seq_len: int, hybrid: HybridSpec | None
) -> int:
    """The rows each hybrid rank holds of S = ``seq_len`` tokens: about 1/P_in of its padded
    outer shard, as the layout splits it."""
    inner = hybrid.inner if hybrid is not None else 1
    outer = make_sharding(layout=layout, world_size=max(1, world_size // inner), seq_len=seq_len)
    rows = -(-outer.seq_local // inner)
    return rows + 1 if Layout.parse(layout) is Layout.ZIGZAG and inner * rows % 2 else rows


_FORWARD, _BACKWARD = (Pass.FORWARD,), (Pass.BACKWARD,)
_PASSES = {"forward": _FORWARD, "backward": _BACKWARD, "both": _FORWARD + _BACKWARD}


def simulate(
    strategy: Strategy | str,
    *,
    passes: str = "forward",
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    shape: AttentionShape,
    hardware: Hardware,
    last_block_splits: int = 2,
    mode: str = "auto",
    hybrid: HybridSpec | None = None,
    lend_last_pair: bool = False,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> CallResult:
    """Predict a call: ``passes`` is ``forward``, ``backward`` or ``both`` (training).

    See :func:`simulate_pass` for the other arguments and errors.
    """
    options = {name: value for name, value in locals().items() if name != "passes"}
    if passes not in _PASSES:
        raise ValueError(f"passes must be one of {sorted(_PASSES)}; got {passes!r}")
    options["strategy"] = Strategy.parse(strategy)
    return CallResult(
        strategy=options["strategy"],
        passes=tuple(simulate_pass(pass_=pass_, **options) for pass_ in _PASSES[passes]),
    )
