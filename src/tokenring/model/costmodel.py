"""Cost model: hardware descriptions, and what every strategy costs on them.

This module owns the *price list*: how fast a device computes attention, how its links, ports
and NICs are wired (``Topology``), which resources a transfer loads (:func:`route`), and what a
transfer or a merge weighs, read from the :class:`~tokenring.core.schedule.Schedule` the runtime
executes. Timing a call is ``tokenring.model.simulate``'s job; the closed forms per step are
test oracles (``tests/closed_forms.py``).

Legend: B batch, s local seq (rows per rank), c = s // 2 (zigzag chunk), Hq query heads,
Hkv key/value heads, D head dim, P world size, e bytes per element, a bytes per accumulator
element (4; 8 for float64), t step, r rank, o q owner, j kv owner.

Note [Topologies]
~~~~~~~~~~~~~~~~~
A transfer from ``src`` to ``dst`` is a *flow*. It loads a set of directed resources, each
with a bandwidth shared by the flows on it, and never goes faster than
``link_bandwidth_bytes_per_s``::

    topology  resources of src -> dst                         latency
    MESH      link (src, dst)                                 1 x latency_s
    RING      every hop (a, a+-1) on the shortest way round    hops x latency_s
              (ties go towards src + 1, as in tokenring.model.netlab)
    SWITCH    the pair's path (src, dst) at link bandwidth,   1 x latency_s
              port out of src, port in of dst

``port_bandwidth_bytes_per_s`` (one port per device and direction, shared by all its flows)
is required for SWITCH and optional for MESH and RING. A multi-node machine
(``devices_per_node`` and ``inter``) is islands of the intra topology; a flow between islands
is routed by ``inter`` (a non-blocking SWITCH whose ports are one NIC per device). Collectives
are point-to-point messages too (Note [Collective routing] in
``tokenring.strategies.collective``); how flows share a resource is the simulator's Note.

Note [Bytes per step]
~~~~~~~~~~~~~~~~~~~~~
Per row (x B) the payloads weigh (``AttentionShape.row_bytes``)::

    payload   flow     bytes per row            strategy / pass
    q         travel   Hq*D*e                   TokenRing forward
    q_grad    travel   2*Hq*D*e + 2*Hq*a        TokenRing backward (q, dout, lse, delta)
    out       return   Hq*D*e + Hq*a            TokenRing forward (partial out + lse)
    dq        return   Hq*D*e                   TokenRing backward
    kv        travel   2*Hkv*D*e                Ring forward and backward
    dkv       return   2*Hkv*D*a                Ring backward (same direction as kv)

so TokenRing forward's busiest direction carries about Hq / (2*Hkv) times Ring's bytes (half
for MHA, twice for Llama-3-8B's 32/8). Travel posted at the start of step t overlaps step t's
compute; returns overlap the rest of their step and the next; what is posted after the last
segment of the last step overlaps nothing (:func:`exposed_transfers`).
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tokenring.core.enums import parse_enum
from tokenring.core.layout import check_size
from tokenring.core.schedule import AttentionShape, Flow, Pass, Schedule, Transfer, dtype_name
from tokenring.model.netlab import Topology

__all__ = [
    "PRESETS",
    "CollectiveRouting",
    "Hardware",
    "Interconnect",
    "Resource",
    "ResourceKind",
    "Route",
    "Topology",
    "exposed_transfers",
    "measured",
    "merge_bytes",
    "preset",
    "resource_bytes",
    "ring_path",
    "route",
    "transfer_route",
]


def _check_number(name: str, value: object, *, finite: bool = True, zero: bool = False) -> float:
    """``value`` as a float; ValueError unless it is a real number (an int, a float or a NumPy
    scalar: not a bool, a str or a tensor) > 0 (>= 0 with ``zero``) and, with ``finite``,
    finite (NaN never passes)."""
    bound = f"{'>=' if zero else '>'} 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a {'finite ' if finite else ''}number {bound}; got {value!r}"
        )
    number = float(value)
    if not (number >= 0 if zero else number > 0) or (finite and not math.isfinite(number)):
        raise ValueError(
            f"{name} must be {'a finite number ' if finite else ''}{bound}; got {number}"
        )
    return number


def _set_number(obj: object, name: str, **bounds: bool) -> None:
    """Check the field ``name`` of a frozen dataclass (:func:`_check_number`) and keep it as
    a float (a NumPy or int rate prints and compares as one)."""
    object.__setattr__(obj, name, _check_number(name, getattr(obj, name), **bounds))


# -- hardware ----------------------------------------------------------------------------------
class CollectiveRouting(enum.Enum):
    """Which backend's collectives a machine runs. Both price alike; ``auto`` picks the
    collective strategies only on routings checked against measurements
    (Note [Which candidates] in ``tokenring.model.planner``)."""

    DIRECT = "direct"
    """NCCL and the other backends: not measured yet."""
    GLOO = "gloo"
    """gloo: measured on the lab."""

    @classmethod
    def for_backend(cls, backend: str) -> CollectiveRouting:
        """GLOO for a ``torch.distributed`` backend named gloo, else DIRECT."""
        return cls.GLOO if str(backend).lower() == "gloo" else cls.DIRECT

    @classmethod
    def parse(cls, value: CollectiveRouting | str) -> CollectiveRouting:
        """Accept a member or its value; raise ValueError naming the options."""
        return parse_enum(cls, value, "collectives")


@dataclass(frozen=True, kw_only=True, slots=True)
class Interconnect:
    """How the devices of one island (or the islands) are wired; see Note [Topologies]."""

    topology: Topology
    """MESH, RING or SWITCH."""
    link_bandwidth_bytes_per_s: float
    """Per direction: a direct link or RING hop, or the most one flow reaches (SWITCH); inf
    prices transfers as free (what ``planner.calibrate`` measures on one rank: no link)."""
    port_bandwidth_bytes_per_s: float | None = None
    """Per device and direction, shared by its flows (switch port, PCIe slot, NIC). Required
    for SWITCH; None on MESH/RING: no limit beyond the links."""
    latency_s: float = 0.0
    """Per message and hop: the time before the first byte arrives."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "topology", Topology.parse(self.topology))
        _set_number(self, "link_bandwidth_bytes_per_s", finite=False)
        if self.port_bandwidth_bytes_per_s is not None:
            _set_number(self, "port_bandwidth_bytes_per_s", finite=False)
        elif self.topology is Topology.SWITCH:
            raise ValueError(
                "port_bandwidth_bytes_per_s must be given for topology 'switch' (each device's "
                "port is what its flows share); got None"
            )
        _set_number(self, "latency_s", zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """A machine: what one device computes and how the devices are connected."""

    name: str
    """Preset name or a label such as ``measured``."""
    interconnect: Interconnect
    """Inside an island (the whole machine when ``devices_per_node`` is None)."""
    forward_flops_per_s: float
    """Achieved FLOP/s of the block kernel, forward (FLOPs as ``piece_flops`` counts them);
    this and the other rates are finite and > 0."""
    backward_flops_per_s: float
    """Achieved FLOP/s of the block kernel, backward."""
    memory_bandwidth_bytes_per_s: float
    """Achieved device memory bandwidth, for merges and accumulations."""
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    """Input dtypes the FLOP/s figures hold for; others raise instead of guessing."""
    devices_per_node: int | None = None
    """Devices per island; None: one island of any size."""
    inter: Interconnect | None = None
    """Between islands (SWITCH: one NIC per device). Given exactly when devices_per_node is."""
    collectives: CollectiveRouting = CollectiveRouting.DIRECT
    """Whose collectives; decides only whether ``auto`` may pick Ulysses and all-gather K/V."""
    kernel_call_s: float = 0.0
    """Fixed cost of one block-kernel call, charged per kernel call of a cached plan;
    ``planner.calibrate`` measures it, the presets leave it 0 (large blocks)."""
    host_computes: bool = False
    """Whether a rank's own thread runs the block kernel (CPU ranks), so it posts nothing while
    it computes; a GPU's kernels run beside the host. Decides the forward's first step
    (Note [Rank program] in tokenring.runtime.program)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a str; got {self.name!r}")
        for field_name, optional in (("interconnect", False), ("inter", True)):
            net = getattr(self, field_name)
            if not (isinstance(net, Interconnect) or (optional and net is None)):
                what = "an Interconnect or None" if optional else "an Interconnect"
                raise ValueError(f"{field_name} must be {what}; got {net!r}")
        object.__setattr__(self, "collectives", CollectiveRouting.parse(self.collectives))
        _set_number(self, "kernel_call_s", zero=True)
        # inf would price compute or merges as free (a link may be inf: Interconnect)
        for name in ("forward_flops_per_s", "backward_flops_per_s", "memory_bandwidth_bytes_per_s"):
            _set_number(self, name)
        if not isinstance(self.host_computes, bool):  # "no" would be truthy: a CPU rank
            raise ValueError(f"host_computes must be a bool; got {self.host_computes!r}")
        if isinstance(self.dtypes, str) or not isinstance(self.dtypes, Sequence):
            raise ValueError(  # a lone name would be read letter by letter
                f"dtypes must be a sequence of dtype names; got {self.dtypes!r} (use "
                f"({self.dtypes!r},))"
            )
        if not self.dtypes:
            raise ValueError("dtypes must name at least one dtype; got ()")
        object.__setattr__(self, "dtypes", tuple(dtype_name(d) for d in self.dtypes))
        if (self.devices_per_node is None) != (self.inter is None):
            raise ValueError(
                "devices_per_node and inter must be given together; got "
                f"devices_per_node={self.devices_per_node}, inter={self.inter}"
            )
        if self.devices_per_node is not None and self.inter is not None:
            check_size("devices_per_node", self.devices_per_node, 1)
            if self.inter.topology is not Topology.SWITCH:
                raise ValueError(
                    "inter.topology must be 'switch' (one NIC per device into a non-blocking "
                    f"fabric); got {self.inter.topology.value!r}"
                )
            if self.interconnect.topology is Topology.RING:
                raise ValueError(
                    "interconnect.topology 'ring' inside islands is not modelled; use 'mesh' "
                    "or 'switch' with devices_per_node"
                )

    def flops_per_s(self, pass_: Pass | str, dtype: str | torch.dtype) -> float:
        """Achieved attention FLOP/s for ``pass_`` with inputs of ``dtype``.

        Raises:
            ValueError: ``dtype`` is not one this description has figures for.
        """
        name = dtype_name(dtype)
        if name not in self.dtypes:
            raise ValueError(
                f"hardware {self.name!r} has attention FLOP/s for {', '.join(self.dtypes)}; got "
                f"dtype {name!r} (calibrate for it or describe it with measured(...))"
            )
        forward = Pass(pass_) is Pass.FORWARD
        return self.forward_flops_per_s if forward else self.backward_flops_per_s


_GB = 1e9
_TFLOPS = 1e12


def _switch(link_gb_per_s: float, port_gb_per_s: float, latency_s: float) -> Interconnect:
    return Interconnect(
        topology=Topology.SWITCH,
        link_bandwidth_bytes_per_s=link_gb_per_s * _GB,
        port_bandwidth_bytes_per_s=port_gb_per_s * _GB,
        latency_s=latency_s,
    )


def _preset(
    name: str, net: Interconnect, forward_tflops: float, backward_tflops: float, memory_gb: float
) -> Hardware:
    return Hardware(
        name=name,
        interconnect=net,
        forward_flops_per_s=forward_tflops * _TFLOPS,
        backward_flops_per_s=backward_tflops * _TFLOPS,
        memory_bandwidth_bytes_per_s=memory_gb * _GB,
    )


# Peaks are datasheet numbers (dense); "achieved" is what a fused attention kernel reaches at
# D = 128 on long blocks. 8x H100 SXM5 behind NVSwitch: 989 TFLOP/s fp16 peak, FA2 ~350 and
# FA3 ~600-750 forward -> 500 / 400; NVLink 4 450 GB/s per direction, NCCL ~370; HBM3 85%.
_H100_NVSWITCH = _preset("h100-nvswitch", _switch(370, 370, 8e-6), 500, 400, 0.85 * 3350)

KERNEL_RATES_DIR = Path(__file__).parent / "kernel_rates"
"""Measured block-kernel rates, one JSON file per preset (``benchmarks/kernel_rates.py``)."""


def load_kernel_rates(path: str | Path) -> dict[str, Any]:
    """Kernel rates as ``benchmarks/kernel_rates.py`` writes them: ``rates[dtype][block]``
    (block ``"full"`` or ``"causal"``) with ``forward_tflops`` and ``backward_tflops``.

    Raises:
        ValueError: the file is not such a record (naming what is missing).
    """
    with open(path) as f:
        record = json.load(f)
    rates = record.get("rates") if isinstance(record, dict) else None
    if not isinstance(rates, dict) or not rates:
        raise ValueError(f"{path}: expected a JSON object with non-empty 'rates'")
    for dtype, blocks in rates.items():
        for block in ("full", "causal"):
            entry = blocks.get(block) if isinstance(blocks, dict) else None
            if not isinstance(entry, dict) or not all(
                _is_rate(entry.get(key)) for key in ("forward_tflops", "backward_tflops")
            ):
                raise ValueError(
                    f"{path}: rates[{dtype!r}][{block!r}] must give forward_tflops and "
                    f"backward_tflops as finite numbers > 0; got {entry!r}"
                )
    return record


def _is_rate(value: object) -> bool:
    """A finite number > 0 (JSON's ``true`` and ``Infinity`` are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def _with_measured_rates(hardware: Hardware) -> Hardware:
    """``hardware`` with its measured bfloat16 full-block rates (KERNEL_RATES_DIR ships them)."""
    path = KERNEL_RATES_DIR / f"{hardware.name}.json"
    rates = load_kernel_rates(path)["rates"]
    assert "bfloat16" in rates, f"{path}: the presets' dtype"
    full = rates["bfloat16"]["full"]
    return replace(
        hardware,
        forward_flops_per_s=full["forward_tflops"] * _TFLOPS,
        backward_flops_per_s=full["backward_tflops"] * _TFLOPS,
    )


_HCCS = Interconnect(
    topology=Topology.MESH, link_bandwidth_bytes_per_s=0.85 * 28 * _GB, latency_s=1e-5
)

# _preset(name, interconnect, forward TFLOP/s, backward TFLOP/s, memory GB/s)
PRESETS: dict[str, Hardware] = {
    hardware.name: hardware
    for hardware in (
        # 4x A10 (150 W) on PCIe 4.0 x16 into the host bridge (a SWITCH): the seeds' box. 125
        # TFLOP/s peak; FA2 at 55% forward, 45% backward under the power cap. The bandwidths
        # are read off the seeds' own timings (Note [A10 reproduction] in
        # tests/test_costmodel.py): 13.5 GB/s per flow, ~22 GB/s per port. GDDR6 600 GB/s at
        # 80%; ~10 us per P2P message.
        _preset("a10-pcie", _switch(13.5, 22.0, 10e-6), 0.55 * 125, 0.45 * 125, 0.8 * 600),
        # 8x A100 SXM4 behind NVSwitch: FA2 ~220 / ~180 TFLOP/s at D = 128 (FA2 paper); NVLink
        # 3 300 GB/s per direction, NCCL ~240, one flow can use the whole port; HBM2e 85%.
        _preset("a100-nvswitch", _switch(240, 240, 8e-6), 220, 180, 0.85 * 2039),
        _H100_NVSWITCH,
        # 8x H200: NVLink 4 as the H100, HBM3e 4.8 TB/s at 85%; compute as measured by
        # scripts/device_check.sh (kernel_rates/h200-nvswitch.json, shipped; it replaces the
        # H100's estimate given here).
        _with_measured_rates(
            _preset("h200-nvswitch", _H100_NVSWITCH.interconnect, 500, 400, 0.85 * 4800)
        ),
        # 8x Ascend 910B (Atlas 800T A2): HCCS full mesh, 28 GB/s per direction per link at
        # 85%; fp16 peak ~350 TFLOP/s, fused attention at ~50%; HBM2e 1.6 TB/s at 80%.
        _preset("ascend910b-hccs", _HCCS, 175, 140, 0.8 * 1600),
        # Islands of 8 H100 (as h100-nvswitch) on 400 Gb/s NDR InfiniBand, one NIC per GPU
        # (non-blocking fat tree): 50 GB/s per direction at ~90%; ~12 us per message.
        replace(
            _H100_NVSWITCH, name="h100-ib-islands", devices_per_node=8, inter=_switch(45, 45, 12e-6)
        ),
    )
}


def preset(name: str) -> Hardware:
    """The hardware preset called ``name`` (see ``PRESETS``).

    Raises:
        ValueError: unknown name.
    """
    if name not in PRESETS:
        raise ValueError(f"hardware must be one of {sorted(PRESETS)}; got {name!r}")
    return PRESETS[name]


def measured(
    *,
    forward_flops_per_s: float,
    backward_flops_per_s: float,
    link_bandwidth_bytes_per_s: float,
    memory_bandwidth_bytes_per_s: float,
    dtype: str | torch.dtype,
    topology: Topology | str = Topology.MESH,
    port_bandwidth_bytes_per_s: float | None = None,
    latency_s: float = 0.0,
    name: str = "measured",
    collectives: CollectiveRouting | str = CollectiveRouting.DIRECT,
    kernel_call_s: float = 0.0,
    host_computes: bool = False,
) -> Hardware:
    """A hardware description from calibration numbers (``planner.calibrate``).

    Args:
        dtype: the input dtype the FLOP/s were measured with (the only one they hold for).
        Others: see :class:`Hardware` and :class:`Interconnect`.

    Raises:
        ValueError: a non-positive or NaN rate (an infinite FLOP/s or memory bandwidth
            too), a non-bool host_computes, or SWITCH without a port bandwidth.
    """
    return Hardware(
        name=name,
        interconnect=Interconnect(
            topology=Topology.parse(topology),
            link_bandwidth_bytes_per_s=link_bandwidth_bytes_per_s,
            port_bandwidth_bytes_per_s=port_bandwidth_bytes_per_s,
            latency_s=latency_s,
        ),
        forward_flops_per_s=forward_flops_per_s,
        backward_flops_per_s=backward_flops_per_s,
        memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s,
        dtypes=(dtype_name(dtype),),
        collectives=CollectiveRouting.parse(collectives),
        kernel_call_s=kernel_call_s,
        host_computes=host_computes,
    )


# -- routing -----------------------------------------------------------------------------------
class ResourceKind(enum.Enum):
    """A directed, shared piece of the network."""

    LINK = "link"  # (a, b): a direct link or one ring hop, a -> b
    PORT_OUT = "port_out"  # (r,): what device r sends into the fabric
    PORT_IN = "port_in"  # (r,): what device r receives from the fabric
    NIC_OUT = "nic_out"  # (r,): device r's NIC towards other islands
    NIC_IN = "nic_in"  # (r,): device r's NIC from other islands


@dataclass(frozen=True, slots=True)
class Resource:
    """One directed, shared piece of the network (a dict key)."""

    kind: ResourceKind
    ends: tuple[int, ...]
    """``(a, b)`` for a link from a to b, ``(r,)`` for device r's port or NIC."""

    def __str__(self) -> str:
        return f"{self.kind.value}{'->'.join(map(str, self.ends))}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """What one flow from ``src`` to ``dst`` loads and how fast it can go at best."""

    resources: tuple[tuple[Resource, float], ...]
    """Each resource with its bandwidth in bytes/s (shared by every flow on it)."""
    flow_cap_bytes_per_s: float
    """The most this flow reaches alone: the smallest bandwidth on its route."""
    latency_s: float
    """Time before the first byte arrives (latency per hop x hops)."""
    hops: int
    """Links crossed (1 except on RING)."""


def ring_path(src: int, dst: int, world_size: int) -> list[int]:
    """Ranks from ``src`` to ``dst`` along the shortest way round a ring (ties: src + 1)."""
    forward = (dst - src) % world_size
    step = 1 if forward <= world_size - forward else -1
    hops = min(forward, world_size - forward)
    return [(src + step * i) % world_size for i in range(hops + 1)]


def route(hardware: Hardware, src: int, dst: int, world_size: int) -> Route:
    """The resources a transfer from ``src`` to ``dst`` loads; see Note [Topologies].

    Raises:
        ValueError: src or dst outside [0, world_size), or src == dst.
    """
    for name, rank in (("src", src), ("dst", dst)):
        if not 0 <= rank < world_size:
            raise ValueError(f"{name} must be in [0, {world_size}); got {rank}")
    if src == dst:
        raise ValueError(f"src and dst must differ; got {src} -> {dst}")
    dpn = hardware.devices_per_node
    net = hardware.interconnect
    out_kind, in_kind = ResourceKind.PORT_OUT, ResourceKind.PORT_IN
    if dpn is not None and hardware.inter is not None and src // dpn != dst // dpn:
        net = hardware.inter
        out_kind, in_kind = ResourceKind.NIC_OUT, ResourceKind.NIC_IN
    path = ring_path(src, dst, world_size) if net.topology is Topology.RING else [src, dst]
    link = net.link_bandwidth_bytes_per_s
    resources = [(Resource(ResourceKind.LINK, hop), link) for hop in itertools.pairwise(path)]
    hops = len(resources)
    if (port := net.port_bandwidth_bytes_per_s) is not None:
        resources += [(Resource(out_kind, (src,)), port), (Resource(in_kind, (dst,)), port)]
    return Route(
        resources=tuple(resources),
        flow_cap_bytes_per_s=min(cap for _, cap in resources),
        latency_s=net.latency_s * hops,
        hops=hops,
    )


def transfer_route(hardware: Hardware, schedule: Schedule, tr: Transfer) -> Route:
    """:func:`route` of one transfer of ``schedule``."""
    return route(hardware, tr.src, tr.dst, schedule.world_size)


# -- costs read from the schedule --------------------------------------------------------------
def merge_bytes(num_rows: int, dims: AttentionShape, num_heads: int | None = None) -> int:
    """Device memory traffic of ``merge_into`` a partial of ``num_rows`` rows: scale the
    accumulator (read + write), add the part (read it, read + write the accumulator) and update
    lse: D * (4*a + e) + 6*a bytes per row and head.

    Args:
        num_heads: the partial's query heads (a lane's share); None: all of them.
    """
    d, e, a = dims.head_dim, dims.elem_bytes, dims.acc_bytes
    heads = dims.heads_q if num_heads is None else num_heads
    return num_rows * dims.batch * heads * (d * (4 * a + e) + 6 * a)


def resource_bytes(
    schedule: Schedule, dims: AttentionShape, hardware: Hardware, *, step: int | None = None
) -> dict[Resource, int]:
    """Bytes each physical resource carries (relayed flows count on every hop they cross).

    Args:
        step: only the transfers posted at this step; None: the whole pass.
    """
    load: dict[Resource, int] = {}
    for tr in schedule.transfers:
        if step is not None and tr.step != step:
            continue
        n = tr.num_bytes(dims)
        for res, _ in transfer_route(hardware, schedule, tr).resources:
            load[res] = load.get(res, 0) + n
    return load


def exposed_transfers(schedule: Schedule) -> tuple[Transfer, ...]:
    """Returns posted after their sender's last compute of the pass: nothing overlaps them
    (TokenRing's last slice, Ring backward's dK/dV hop home). Travel is never exposed: its
    receiver computes with it."""
    last = schedule.num_steps - 1
    return tuple(
        tr
        for r in range(schedule.world_size)
        for tr in schedule.sends(r, last)
        if tr.payload.flow is Flow.RETURN
        and tr.after_segments >= max(1, len(schedule.steps[r][last].segments))
    )
