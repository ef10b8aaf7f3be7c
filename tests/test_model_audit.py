"""Audit of the public model functions (tokenring.model): every keyword takes effect or is
refused naming it, the planner's numbers are the simulator's, and the pricing is monotone where
the physics is (more bandwidth never slower, a longer sequence never faster).

Expected values come from the functions' own contracts (the docstrings, Note [Choosing]) and
from the simulator called directly, never from numbers copied out of the code.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any

import pytest

from tokenring.core.schedule import AttentionShape, Strategy
from tokenring.model.costmodel import PRESETS, Hardware, measured
from tokenring.model.planner import choose_strategy, explain, explain_cached
from tokenring.model.simulate import simulate_pass
from tokenring.strategies.hybrid import HybridSpec

CALL: dict[str, Any] = dict(
    seq_local=256, heads_q=8, heads_kv=8, head_dim=64, dtype="bfloat16", causal=True
)
LAB = measured(  # a gloo lab: every 1-D strategy is a candidate (Note [Which candidates])
    forward_flops_per_s=2e11,
    backward_flops_per_s=1.5e11,
    link_bandwidth_bytes_per_s=12.5e6,
    memory_bandwidth_bytes_per_s=5e9,
    dtype="bfloat16",
    latency_s=1e-4,
    collectives="gloo",
    name="lab",
)
RATES = dict(
    forward_flops_per_s=1e12,
    backward_flops_per_s=1e12,
    link_bandwidth_bytes_per_s=1e9,
    memory_bandwidth_bytes_per_s=1e11,
    dtype="bfloat16",
)


# -- refused, not priced -------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "int_value"), [(4.0, 4), (True, 1), (2.0, 2)])
def test_explain_refuses_a_non_int_world_size_even_after_its_int_was_planned(
    value: object, int_value: int
) -> None:
    """explain caches its plans per input, and 4.0 == 4 (True == 1) hash alike: once the int
    was planned, the float got that plan back instead of the error it gets on a cold cache."""
    kw: dict[str, Any] = dict(hardware="a10-pcie", strategies=["token_ring", "ring"], **CALL)
    explain(world_size=int_value, **kw)  # warm the cache
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1; got {value!r}"):
        explain(world_size=value, **kw)
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1; got {value!r}"):
        choose_strategy(world_size=value, layout="zigzag", training=False, **kw)
    with pytest.raises(ValueError, match=r"seq_local must be an int >= 1; got 256\.0"):
        explain(world_size=int_value, **{**kw, "seq_local": 256.0})


def test_choose_strategy_refuses_candidates_that_leave_nothing() -> None:
    """strategies=[] used to mean every strategy (``[] or Strategy``), and ["hybrid"] said
    "got none"; a lone name was read letter by letter ("got 'r'")."""
    kw: dict[str, Any] = dict(
        world_size=4, hardware="a10-pcie", layout="zigzag", training=False, **CALL
    )
    with pytest.raises(ValueError, match=r"other than 'hybrid'.*; got \[\]"):
        choose_strategy(strategies=[], **kw)
    with pytest.raises(ValueError, match=r"other than 'hybrid'.*; got \['hybrid'\]"):
        choose_strategy(strategies=["hybrid"], **kw)
    assert choose_strategy(strategies=["ring"], **kw) is Strategy.RING
    for lone in ("ring", Strategy.RING):
        with pytest.raises(ValueError, match=r"strategies must be a sequence .*; got "):
            choose_strategy(strategies=lone, **kw)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"strategies must be a sequence .*; got "):
            explain(world_size=4, hardware="a10-pcie", strategies=lone, **CALL)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["forward_flops_per_s", "backward_flops_per_s", "memory_bandwidth_bytes_per_s"]
)
def test_hardware_refuses_infinite_compute_and_memory_rates(name: str) -> None:
    """An infinite FLOP/s or memory bandwidth priced compute or merges as free."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0; got inf"):
        measured(**{**RATES, name: math.inf})
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0; got nan"):
        measured(**{**RATES, name: math.nan})


def test_an_infinite_link_is_still_a_free_link() -> None:
    """What planner.calibrate measures on one rank (no link to probe): transfers cost 0."""
    hw = measured(**{**RATES, "link_bandwidth_bytes_per_s": math.inf})
    shape = AttentionShape(heads_q=8, heads_kv=8, head_dim=64)
    kw: dict[str, Any] = dict(layout="zigzag", causal=False, world_size=4, seq_local=256)
    result = simulate_pass("ring", "forward", shape=shape, hardware=hw, mode="event", **kw)
    assert math.isfinite(result.call_s) and result.busiest_s == 0.0


@pytest.mark.parametrize("value", ["no", "False", 1, None])
def test_hardware_refuses_a_non_bool_host_computes(value: object) -> None:
    """host_computes="False" was truthy: priced as a CPU rank computing on its own thread."""
    with pytest.raises(ValueError, match=f"host_computes must be a bool; got {value!r}"):
        measured(**RATES, host_computes=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"host_computes must be a bool; got {value!r}"):
        dataclasses.replace(PRESETS["a10-pcie"], host_computes=value)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("lend_last_pair", "no", "lend_last_pair must be a bool; got 'no'"),
        ("lend_last_pair", 0, "lend_last_pair must be a bool; got 0"),
        ("shape", {"heads_q": 8}, "shape must be an AttentionShape; got"),
        ("hardware", "a10-pcie", "hardware must be a Hardware .*; got 'a10-pcie'"),
        ("hybrid", 2, "hybrid must be a HybridSpec or None; got 2"),
        ("pass_", "fwd", "pass_ must be one of 'forward', 'backward'; got 'fwd'"),
    ],
)
def test_simulate_pass_refuses_arguments_of_the_wrong_type(
    name: str, value: object, message: str
) -> None:
    """lend_last_pair="no" used to lend (truthy); the others failed with an AttributeError or
    "'fwd' is not a valid Pass", naming no argument."""
    kw: dict[str, Any] = dict(
        pass_="forward",
        layout="zigzag",
        causal=True,
        world_size=4,
        seq_local=256,
        shape=AttentionShape(heads_q=8, heads_kv=8, head_dim=64),
        hardware=PRESETS["a10-pcie"],
    )
    with pytest.raises(ValueError, match=message):
        simulate_pass("token_ring", **{**kw, name: value})


def test_explain_cached_refuses_a_hardware_that_is_neither_name_nor_hardware() -> None:
    kw: dict[str, Any] = dict(world_size=4, cached=1000, new=1, heads_q=8, heads_kv=2, head_dim=64)
    with pytest.raises(ValueError, match="hardware must be a Hardware or a preset name"):
        explain_cached(hardware=3, **kw)  # type: ignore[arg-type]
    assert explain_cached(hardware="h100-nvswitch", **kw) == explain_cached(
        hardware=PRESETS["h100-nvswitch"], **kw
    )


def test_sizes_that_would_run_out_of_memory_or_for_weeks_are_refused_at_once() -> None:
    """Before: explain_cached(cached=10**9) ran out of memory (every token's position kept);
    explain/simulate_pass with mode="event" at 20000 ranks ran for days (the CLI guarded the
    vectorised engine only). Each is refused within a second, naming the argument."""
    kw: dict[str, Any] = dict(heads_q=8, heads_kv=2, head_dim=64, hardware="h100-nvswitch")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"batch \* \(cached \+ new\) must be at most 134217728"):
        explain_cached(world_size=4, cached=10**9, new=1, **kw)
    with pytest.raises(ValueError, match="got batch=2, cached=67108864, new=1"):
        explain_cached(world_size=4, cached=2**26, new=1, batch=2, **kw)
    event = "mode='event' replays every message of every rank: world_size=20000 is above"
    with pytest.raises(ValueError, match=event):
        explain(world_size=20000, seq_local=64, dtype="bfloat16", causal=True, mode="event", **kw)
    shape = AttentionShape(heads_q=8, heads_kv=2, head_dim=64)
    with pytest.raises(ValueError, match=event):
        simulate_pass(
            "ring", "forward", layout="contiguous", causal=True, world_size=20000, seq_local=64,
            shape=shape, hardware=PRESETS["a10-pcie"], mode="event",
        )  # fmt: skip
    assert time.monotonic() - start < 5


# -- the planner's numbers are the simulator's ----------------------------------------------------
@pytest.mark.parametrize("hardware", [PRESETS["a10-pcie"], PRESETS["h100-ib-islands"], LAB])
def test_explain_reports_what_simulate_pass_predicts_and_picks_the_cheapest(
    hardware: Hardware,
) -> None:
    """Every prediction of explain is simulate_pass's call time for that candidate (forward,
    and backward when training), and the pick is the cheapest of them (Note [Choosing])."""
    grid = itertools.product([1, 3, 4], [(8, 8), (8, 2)], [True, False], [False, True])
    for world_size, (hq, hkv), causal, training in grid:
        call: dict[str, Any] = dict(world_size=world_size, seq_local=64, causal=causal)
        shape = AttentionShape(heads_q=hq, heads_kv=hkv, head_dim=64, dtype="bfloat16")
        heads: dict[str, Any] = dict(heads_q=hq, heads_kv=hkv, head_dim=64, dtype="bfloat16")
        plan = explain(hardware=hardware, training=training, **heads, **call)
        cheapest = min(p.total_s for p in plan.predictions)
        pick = (plan.pick, plan.layout)
        (picked,) = [p for p in plan.predictions if (p.strategy, p.layout) == pick]
        assert picked.total_s <= cheapest * (1 + 1e-9), (world_size, hq, hkv, causal, training)
        for p in plan.predictions:
            kw: dict[str, Any] = dict(layout=p.layout, shape=shape, hardware=hardware, **call)
            kw["lend_last_pair"] = p.lends_last_pair
            assert p.forward_s == simulate_pass(p.strategy, "forward", **kw).call_s
            backward = simulate_pass(p.strategy, "backward", **kw).call_s if training else 0.0
            assert p.backward_s == backward


# -- monotone where the physics is -----------------------------------------------------------------
def _faster_links(hw: Hardware, factor: float) -> Hardware:
    def scaled(net: Any) -> Any:
        if net is None:
            return None
        port = net.port_bandwidth_bytes_per_s
        return dataclasses.replace(
            net,
            link_bandwidth_bytes_per_s=net.link_bandwidth_bytes_per_s * factor,
            port_bandwidth_bytes_per_s=None if port is None else port * factor,
        )

    return dataclasses.replace(hw, interconnect=scaled(hw.interconnect), inter=scaled(hw.inter))


@pytest.mark.parametrize("name", ["a10-pcie", "h100-nvswitch", "ascend910b-hccs", "lab"])
def test_faster_links_and_shorter_sequences_are_never_slower(name: str) -> None:
    """Twice the bandwidth never predicts a slower pass, twice the sequence never a faster one,
    for every 1-D strategy (the event engine). FLOP/s and latency are not monotone here:
    Note [Sharing bandwidth] in tokenring.model.simulate."""
    hw = LAB if name == "lab" else PRESETS[name]
    fast = _faster_links(hw, 2.0)
    grid = itertools.product(
        [s for s in Strategy if s is not Strategy.HYBRID],
        [3, 4],
        [(8, 8), (8, 2)],
        [True, False],
        ["forward", "backward"],
    )
    for strategy, world_size, (hq, hkv), causal, pass_ in grid:
        if strategy.is_collective and name != "lab":
            continue
        shape = AttentionShape(heads_q=hq, heads_kv=hkv, head_dim=64, dtype="bfloat16")
        kw: dict[str, Any] = dict(layout="zigzag", causal=causal, world_size=world_size)
        kw |= dict(shape=shape, mode="event")
        base = simulate_pass(strategy, pass_, seq_local=512, hardware=hw, **kw).call_s
        case = (strategy.value, world_size, hq, hkv, causal, pass_)
        assert simulate_pass(strategy, pass_, seq_local=512, hardware=fast, **kw).call_s <= (
            base * (1 + 1e-12)
        ), case
        longer = simulate_pass(strategy, pass_, seq_local=1024, hardware=hw, **kw).call_s
        assert longer >= base * (1 - 1e-12), case


def test_hybrid_spec_type_is_checked_in_simulate_pass_not_only_explain() -> None:
    """explain refused hybrid=2 but simulate_pass, which the CLI calls, ignored it for a ring
    strategy; a real spec still prices the hybrid."""
    kw: dict[str, Any] = dict(
        layout="zigzag",
        causal=True,
        world_size=4,
        seq_local=256,
        shape=AttentionShape(heads_q=8, heads_kv=8, head_dim=64),
        hardware=PRESETS["a10-pcie"],
    )
    with pytest.raises(ValueError, match="hybrid must be a HybridSpec or None; got 'ring'"):
        simulate_pass("ring", "forward", hybrid="ring", **kw)  # type: ignore[arg-type]
    spec = HybridSpec(inner=2, outer_strategy="ring")
    assert simulate_pass("hybrid", "forward", hybrid=spec, **kw).call_s > 0
