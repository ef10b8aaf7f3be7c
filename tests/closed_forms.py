"""Closed forms that tests hold the schedules and the simulator to (oracles, not library code).

``step_costs`` reads FLOPs per rank and bytes per directed pair of every step off a schedule;
``steady_step`` is the back-of-envelope balance of one steady step of TokenRing or Ring, from
the strategies' definitions alone (it does not read the schedule).

Legend: s local seq, c = s // 2, Hq / Hkv heads, D head dim, P world size, t step, r rank.
"""

from __future__ import annotations

from dataclasses import dataclass

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
