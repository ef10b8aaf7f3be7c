"""Closed forms that tests hold the schedules and the simulator to (oracles, not library code).

``step_costs`` reads FLOPs per rank and bytes per directed pair of every step off a schedule;
``steady_step`` is the back-of-envelope balance of one steady step of TokenRing or Ring, from
the strategies' definitions alone (it does not read the schedule); ``schedule_arrays`` the
TokenRing and Ring schedules per (rank, step) as closed forms on tensors.

Legend: s local seq, c = s // 2, Hq / Hkv heads, D head dim, P world size, t step, r rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenring.core.layout import Layout, validate_seq_local
from tokenring.core.schedule import (
    AttentionShape,
    Flow,
    Pass,
    Payload,
    Schedule,
    Strategy,
    piece_flops,
)
from tokenring.model.costmodel import Hardware, Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """What one step of a schedule costs, for every rank; see Note [Bytes per step]."""

    step: int
    """t."""
    flops: tuple[float, ...]
    """Matmul FLOPs each rank computes at this step, indexed by rank."""
    pair_bytes: dict[tuple[int, int], int]
    """Bytes posted at this step per directed pair (src, dst) of endpoints."""
    travel_bytes: tuple[int, ...]
    """Per rank: bytes of the travel flow it posts at the start of the step (overlaps this
    step's compute)."""
    return_bytes: tuple[int, ...]
    """Per rank: bytes of return-flow transfers it posts during the step (after segments)."""


def step_costs(schedule: Schedule, dims: AttentionShape) -> tuple[StepCost, ...]:
    """FLOPs per rank and bytes per directed pair of every step, read from ``schedule``."""
    p = schedule.world_size
    costs = []
    for t in range(schedule.num_steps):
        flops = tuple(
            sum(piece_flops(piece, dims, schedule.pass_) for piece in schedule.steps[r][t].pieces)
            for r in range(p)
        )
        pair: dict[tuple[int, int], int] = {}
        travel = [0] * p
        ret = [0] * p
        for r in range(p):
            for tr in schedule.sends(r, t):
                n = tr.num_bytes(dims)
                pair[(tr.src, tr.dst)] = pair.get((tr.src, tr.dst), 0) + n
                if tr.payload.flow is Flow.TRAVEL:
                    travel[r] += n
                else:
                    ret[r] += n
        costs.append(
            StepCost(
                step=t,
                flops=flops,
                pair_bytes=pair,
                travel_bytes=tuple(travel),
                return_bytes=tuple(ret),
            )
        )
    return tuple(costs)


@dataclass(frozen=True, kw_only=True, slots=True)
class SteadyStep:
    """The balance of one steady step (1 <= t <= P-2, worst rank) in closed form."""

    compute_s: float
    """Kernel time of the step on the busiest rank."""
    wire_s: float
    """Bytes on the busiest resource during the step / its bandwidth."""
    latency_s: float
    """Latency of the step's longest path (hops x latency on a ring)."""
    busiest: str
    """Which resource that is: ``link``, ``port`` or ``ring hops``."""
    travel_bytes: int
    """Bytes of the travel block forwarded at this step (worst rank)."""
    return_bytes: int
    """Bytes returning during this step (worst rank): TokenRing's partial of the previous
    step, Ring backward's dK/dV accumulator."""

    @property
    def comm_s(self) -> float:
        """Wire time plus latency."""
        return self.wire_s + self.latency_s

    @property
    def step_s(self) -> float:
        """max(compute, comm): the step time when everything overlaps."""
        return max(self.compute_s, self.comm_s)

    @property
    def comm_bound(self) -> bool:
        """Whether the links, not the kernel, set the pace."""
        return self.comm_s > self.compute_s


def steady_step(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    shape: AttentionShape,
    hardware: Hardware,
    step: int | None = None,
) -> SteadyStep:
    """Closed-form compute and communication time of step ``step`` (default: the middle one).

    Worst rank: every block row count is the largest any rank has at a steady step (s rows of
    the travel block, s rows returned; zigzag computes s*c score entries, contiguous causal
    s*s on the busiest rank). Flows during step t: the travel block of step t, and the return
    posted at the end of step t-1 (TokenRing: t-1 >= 1, to the owner at distance t-1; Ring
    backward: the accumulator to r-1, on the same link as K/V). Per topology::

        MESH    max over links: travel and return use different links unless they share dst
        SWITCH  the sender's port carries both: (travel + return) / port, each <= link
        RING    a return at distance d crosses h = min(d, P-d) hops; each hop of that
                direction carries h returns (plus the travel block if it goes r -> r-1)

    Raises:
        ValueError: world_size < 2 (no steady step), or step outside [1, P-1].
        NotImplementedError: a strategy without closed forms.
    """
    strategy = Strategy.parse(strategy)
    pass_ = Pass(pass_)
    layout = Layout.parse(layout)
    if strategy not in (Strategy.TOKEN_RING, Strategy.RING):
        raise NotImplementedError(f"closed forms cover token_ring and ring; got {strategy}")
    p, s = world_size, seq_local
    if p < 2:
        raise ValueError(f"world_size must be >= 2 for a steady step; got {p}")
    validate_seq_local(s, layout)
    t = step if step is not None else min(p - 1, max(1, p // 2))
    if not 1 <= t <= p - 1:
        raise ValueError(f"step must be in [1, {p - 1}]; got {t}")
    pairs = s * (s // 2) if causal and layout is Layout.ZIGZAG else s * s
    flops = 4.0 * shape.batch * shape.heads_q * shape.head_dim * pairs
    if pass_ is Pass.BACKWARD:
        flops *= 2.5
    compute_s = flops / hardware.flops_per_s(pass_, shape.dtype)

    travel_payload = {
        (Strategy.TOKEN_RING, Pass.FORWARD): Payload.Q,
        (Strategy.TOKEN_RING, Pass.BACKWARD): Payload.Q_GRAD,
        (Strategy.RING, Pass.FORWARD): Payload.KV,
        (Strategy.RING, Pass.BACKWARD): Payload.KV,
    }[(strategy, pass_)]
    travel = s * shape.row_bytes(travel_payload) if t <= p - 2 else 0
    if strategy is Strategy.TOKEN_RING:
        ret_payload = Payload.OUT if pass_ is Pass.FORWARD else Payload.DQ
        ret = s * shape.row_bytes(ret_payload) if t >= 2 else 0
        distance = t - 1
    else:
        # the accumulator leaves home after step 0 (Note [Backward] in tokenring.strategies.ring)
        ret = s * shape.row_bytes(Payload.DKV) if pass_ is Pass.BACKWARD else 0
        distance = p - 1  # the accumulator goes to r - 1, like K/V

    net = hardware.interconnect
    if hardware.devices_per_node is not None:
        raise NotImplementedError("steady_step models one island; simulate islands instead")
    link, lat = net.link_bandwidth_bytes_per_s, net.latency_s
    same_link = distance % p == p - 1  # the return goes to r - 1, like the travel block
    hops = 1
    if net.topology is Topology.RING and ret and not same_link:
        hops = min(distance, p - distance)
        down = distance > p - distance  # the return goes r -> r-1 -> ..., like travel
        wire_s, busiest = (hops * ret + (travel if down else 0)) / link, "ring hops"
        if travel / link > wire_s:
            wire_s, busiest = travel / link, "link"
    elif same_link:
        wire_s, busiest = (travel + ret) / link, "link"
    else:
        wire_s, busiest = max(travel, ret) / link, "link"
    if net.port_bandwidth_bytes_per_s is not None:
        port_s = (travel + ret) / net.port_bandwidth_bytes_per_s
        if port_s > wire_s:
            wire_s, busiest = port_s, "port"
    latency_s = lat * hops if travel or ret else 0.0
    return SteadyStep(
        compute_s=compute_s,
        wire_s=wire_s,
        latency_s=latency_s,
        busiest=busiest,
        travel_bytes=travel,
        return_bytes=ret,
    )


# -- the ring schedules per (rank, step), from the layouts' block table --------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleArrays:
    """A schedule's sizes as ``(P, P)`` int64/float64 tensors indexed ``[rank, step]``.

    Closed forms of ``build_schedule`` from Note [Causal blocks per layout] alone (the
    simulator's vectorised engine read them until it replayed the schedule's own columns,
    ``tokenring.strategies.ring.ring_plan``); tests hold both to them entry by entry.
    """

    strategy: Strategy
    """Which strategy."""
    pass_: Pass
    """Which pass."""
    world_size: int
    """P."""
    seq_local: int
    """s."""
    q_owner: torch.Tensor
    """o of the block computed at [r, t]."""
    kv_owner: torch.Tensor
    """j of the block computed at [r, t]."""
    q_rows: torch.Tensor
    """Rows of the q block computed at [r, t] (0: nothing computed)."""
    kv_rows: torch.Tensor
    """Rows of the kv block computed at [r, t]."""
    diagonal: torch.Tensor
    """bool: the block is a shard against itself (causal mask, q_rows*(q_rows+1)/2 pairs)."""
    pairs: torch.Tensor
    """float64: score entries computed (FLOPs = pairs * 4*B*Hq*D, x2.5 backward)."""
    slices: torch.Tensor
    """(P, T, K) int64: rows of each compute segment (K = last_block_splits; 0-padded)."""
    travel_rows: torch.Tensor
    """Rows of the travel transfer rank r posts at step t to r - 1 (0: none)."""
    travel_payload: Payload
    """What travels."""
    return_payload: Payload | None
    """What returns after each segment (OUT/DQ to the q owner for TokenRing; DKV to r - 1
    for Ring backward; None for Ring forward)."""
    dkv_rows: torch.Tensor
    """Rows of the dK/dV accumulator rank r sends to r - 1 after step t (Ring backward)."""

    def return_rows(self) -> torch.Tensor:
        """(P, T, K): rows of the return posted after each segment (TokenRing, t >= 1)."""
        if self.strategy is not Strategy.TOKEN_RING:
            return torch.zeros_like(self.slices)
        mine = self.q_owner == torch.arange(self.world_size).unsqueeze(1)
        return torch.where(mine.unsqueeze(-1), 0, self.slices)


def _split_sizes(rows: torch.Tensor, parts: int) -> torch.Tensor:
    """(..., parts) sizes of ``rows`` split like ``schedule._split_rows`` (0 for empty)."""
    n = rows.unsqueeze(-1)
    k = torch.clamp(torch.minimum(n, torch.full_like(n, parts)), min=1)
    i = torch.arange(parts + 1)
    bounds = (n * i.clamp(max=k)) // k  # bounds[i] = n*i//k for i <= k, then n
    sizes = bounds[..., 1:] - bounds[..., :-1]
    return sizes


def _block_rows(
    q_owner: torch.Tensor, kv_owner: torch.Tensor, *, layout: Layout, causal: bool, s: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of q and of kv that meet in the block of (q_owner, kv_owner), and whether it is
    a diagonal block (Note [Causal blocks per layout] in tokenring.core.schedule)."""
    diagonal = q_owner == kv_owner
    full = torch.full(q_owner.shape, s, dtype=torch.long)
    if not causal:
        return full, full.clone(), torch.zeros_like(diagonal)
    if layout is Layout.CONTIGUOUS:
        q_rows = torch.where((kv_owner < q_owner) | diagonal, s, 0)
        return q_rows, q_rows.clone(), diagonal
    c = s // 2
    below = kv_owner < q_owner  # j < o: q whole, kv [0, c); j > o: q [c, s), kv whole
    return torch.where(diagonal | below, s, s - c), torch.where(diagonal | ~below, s, c), diagonal


def _payloads(strategy: Strategy, pass_: Pass) -> tuple[Payload, Payload | None]:
    """What travels and what returns (None: nothing) in a TokenRing or Ring pass."""
    if strategy is Strategy.TOKEN_RING:
        return (Payload.Q, Payload.OUT) if pass_ is Pass.FORWARD else (Payload.Q_GRAD, Payload.DQ)
    return Payload.KV, (Payload.DKV if pass_ is Pass.BACKWARD else None)


def _travel_rows(
    strategy: Strategy,
    *,
    layout: Layout,
    causal: bool,
    visitor: torch.Tensor,
    step: torch.Tensor,
    s: int,
) -> torch.Tensor:
    """Rows the block held at ``step`` forwards: what the ranks ahead still need.

    Derivation (Note [Causal blocks per layout] in tokenring.core.schedule): the block of
    owner o held at step t by rank o - t visits kv owners (TokenRing) or q owners (Ring)
    o-t-1, ..., 0, P-1, ..., o+1 at the steps ahead. One of them is below o iff o >= t + 1
    and one is above o iff o < P - 1, which decides whether the whole block or one chunk
    (or nothing) is forwarded.
    """
    p, c = visitor.shape[0], s // 2
    any_below = visitor >= step + 1
    any_above = visitor < p - 1
    if not causal:
        travel = torch.full(visitor.shape, s, dtype=torch.long)
    elif layout is Layout.CONTIGUOUS:
        # TokenRing: kv j < o needs all q rows; Ring: q owner above j needs all kv rows.
        needs = any_below if strategy is Strategy.TOKEN_RING else any_above
        travel = torch.where(needs, s, 0)
    elif strategy is Strategy.TOKEN_RING:
        travel = torch.where(any_below, s, s - c)  # j < o: q [0, s); only j > o: q [c, s)
    else:
        travel = torch.where(any_below, s, c)  # a q owner below j needs kv [0, s); else [0, c)
    return torch.where(step < p - 1, travel, 0)


def schedule_arrays(
    strategy: Strategy | str,
    pass_: Pass | str,
    *,
    layout: Layout | str,
    causal: bool,
    world_size: int,
    seq_local: int,
    last_block_splits: int = 2,
) -> ScheduleArrays:
    """Closed forms of ``build_schedule(...)`` (same arguments) per rank and step.

    Travel rows: see ``_travel_rows``.

    Raises:
        ValueError: as ``build_schedule``.
        NotImplementedError: a strategy other than TokenRing and Ring.
    """
    strategy = Strategy.parse(strategy)
    pass_ = Pass(pass_)
    layout = Layout.parse(layout)
    _closed_form_strategy(strategy)
    if strategy is Strategy.RING and causal and layout is Layout.CONTIGUOUS:
        raise NotImplementedError(
            "closed forms do not cover Ring on the contiguous causal layout (its K/V travel "
            "up the ring there); simulate its schedule with the event engine instead"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    validate_seq_local(seq_local, layout)
    if last_block_splits < 1:
        raise ValueError(f"last_block_splits must be >= 1; got {last_block_splits}")
    p, s = world_size, seq_local
    columns = torch.arange(p)
    num = p
    rank = torch.arange(p).unsqueeze(1)  # (P, 1)
    step = columns.unsqueeze(0)  # (1, T)
    visitor = (rank + step) % p  # owner of the block that travelled to r by step t
    if strategy is Strategy.TOKEN_RING:
        q_owner, kv_owner = visitor, rank.expand(p, num)
    else:
        q_owner, kv_owner = rank.expand(p, num), visitor
    q_rows, kv_rows, diagonal = _block_rows(q_owner, kv_owner, layout=layout, causal=causal, s=s)
    full = torch.full((p, num), s, dtype=torch.long)
    pairs = torch.where(
        diagonal,
        q_rows.double() * (q_rows.double() + 1) / 2,
        q_rows.double() * kv_rows.double(),
    )
    # Segments: one per non-empty block; TokenRing splits a single full (non-diagonal) piece
    # of its last step (from step 1: there is a return to hide) into last_block_splits row
    # slices. A schedule built with the heads slices by heads instead (Note [Last block by
    # heads] in tokenring.strategies.ring): the same bytes and FLOPs when the heads split
    # evenly, which is what these rows count.
    k = last_block_splits
    slices = torch.zeros((p, num, k), dtype=torch.long)
    slices[..., 0] = q_rows
    if strategy is Strategy.TOKEN_RING and k > 1:
        split = (step == p - 1) & (step > 0) & ~diagonal & (q_rows > 0)  # (P, T): last blocks
        slices = torch.where(split.unsqueeze(-1), _split_sizes(q_rows, k), slices)
    travel = _travel_rows(strategy, layout=layout, causal=causal, visitor=visitor, step=step, s=s)
    travel_payload, return_payload = _payloads(strategy, pass_)
    # Ring backward: the accumulator of a K/V block leaves home after step 0 and moves on
    # after every step, the last visitor sending it home (none when P = 1).
    ring_backward = strategy is Strategy.RING and pass_ is Pass.BACKWARD
    dkv_rows = full.clone() if ring_backward and p > 1 else torch.zeros((p, num), dtype=torch.long)
    return ScheduleArrays(
        strategy=strategy,
        pass_=pass_,
        world_size=p,
        seq_local=s,
        q_owner=q_owner.contiguous(),
        kv_owner=kv_owner.contiguous(),
        q_rows=q_rows,
        kv_rows=kv_rows,
        diagonal=diagonal,
        pairs=pairs,
        slices=slices,
        travel_rows=travel,
        travel_payload=travel_payload,
        return_payload=return_payload,
        dkv_rows=dkv_rows,
    )


def _closed_form_strategy(strategy: Strategy) -> None:
    if strategy not in (Strategy.TOKEN_RING, Strategy.RING):
        raise NotImplementedError(
            f"closed forms cover 'token_ring' and 'ring'; got strategy {strategy.value!r} "
            "(simulate its schedule with the event engine instead)"
        )
