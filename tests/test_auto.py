"""``strategy="auto"``: the same pick on every rank, and the answer of the strategy it picked."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

import tokenring
from oracle import (
    expected_bytes,
    make_inputs,
    oracle_with_grads,
    owned_positions,
    padded_rows,
    sharded_positions,
    visible_mask,
)
from tokenring.core.schedule import AttentionShape
from tokenring.model import planner
from tokenring.model.costmodel import measured
from tokenring.model.planner import calibrate
from tokenring.model.simulate import simulate


def auto_on_ranks(hardware: object) -> tuple[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = make_inputs(
        seed=5, batch=1, seq_global=8 * world, heads_q=4, heads_kv=4, head_dim=8
    )
    idx = torch.tensor(owned_positions("zigzag", rank, world, 8 * world))
    local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
    comm = tokenring.get_communicator()
    if hardware is None:  # this machine, measured once (the caller's calibration)
        hardware = calibrate(comm, dtype=torch.float64)
    pick = tokenring.resolve_strategy(
        "auto",
        q=local[0],
        k=local[1],
        causal=True,
        layout=tokenring.Layout.ZIGZAG,
        comm=comm,
        hardware=hardware,
    )
    out = tokenring.sequence_parallel_attn(
        *local, strategy="auto", causal=True, layout="zigzag", hardware=hardware
    )
    out.backward(dout[:, idx])
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5)
    error = max(
        (out.detach() - ref["out"][:, idx]).abs().max().item(),
        (local[0].grad - ref["dq"][:, idx]).abs().max().item(),
    )
    return pick.value, error


def _described() -> Any:
    return measured(
        forward_flops_per_s=1e10,
        backward_flops_per_s=1e10,
        link_bandwidth_bytes_per_s=1e7,
        memory_bandwidth_bytes_per_s=1e10,
        dtype="float64",
    )


def _latency_bound() -> Any:
    return measured(
        forward_flops_per_s=1e12,
        backward_flops_per_s=1e12,
        link_bandwidth_bytes_per_s=1e10,
        memory_bandwidth_bytes_per_s=1e12,
        latency_s=1e-3,
        dtype="float64",
        collectives="gloo",
    )


def auto_cases(hardware: dict[str, Any], last_pair_hardware: dict[str, Any]) -> dict[str, Any]:
    """strategy="auto" on each description, then TokenRing's last_pair="auto" on each of
    ``last_pair_hardware`` (:func:`last_pair_on_ranks`, under "last_pair")."""
    found: dict[str, Any] = {name: auto_on_ranks(hw) for name, hw in hardware.items()}
    found["last_pair"] = last_pair_on_ranks(last_pair_hardware)
    return found


def _last_pair_hardware() -> dict[str, Any]:
    return {"link-bound": _described(), "compute-bound": _compute_bound()}


@functools.cache
def _per_rank() -> tuple[dict[str, Any], ...]:
    """A description, this machine measured (hardware None: planner.calibrate on the ranks),
    and a latency-bound description: all three on the same 3 ranks, one launch, which also
    runs test_last_pair_auto_lends_where_links_set_the_pace's calls."""
    hardware = {"described": _described(), "measured": None, "latency_bound": _latency_bound()}
    launched = tokenring.launch(
        auto_cases, hardware, _last_pair_hardware(), world_size=3, timeout_s=300
    )
    return tuple(launched)


def test_auto_picks_the_same_strategy_on_every_rank_and_is_exact() -> None:
    for name in ("described", "measured"):
        results = [found[name] for found in _per_rank()]
        picks = {pick for pick, _ in results}
        assert len(picks) == 1, f"{name}: ranks disagree: {results}"
        assert picks <= {s.value for s in tokenring.Strategy}, name
        assert max(error for _, error in results) < 1e-10, name


def test_auto_can_pick_and_run_a_collective_on_gloo() -> None:
    """Latency-bound (1 ms per message; links and kernels fast), 3 ranks, training, gloo's
    routing (measured, so the collectives are candidates). Messages one after the other on the
    critical path: Ulysses 2 all-to-alls forward (q, k, v out; out back) + 2 backward (the
    re-gather with dout; the gradients back) = 4; all-gather K/V, which gathers in rounds (Note
    [All-gather K/V rounds]), P-1 = 2 rounds forward + 2 rounds backward each followed by its
    dK/dV return = 6; every ring strategy P-1 = 2 steps each way plus at least one message that
    waits for the last step (TokenRing's last return, Ring's dK/dV home) = 5 or more. So auto
    must pick Ulysses, on every rank, and its answer must be exact."""
    results = [found["latency_bound"] for found in _per_rank()]
    assert {pick for pick, _ in results} == {"ulysses"}
    assert max(error for _, error in results) < 1e-10


def test_auto_follows_the_byte_ratio_on_a_comm_bound_mesh() -> None:
    """MHA: TokenRing's busiest direction carries about half of Ring's bytes; 32/8 GQA: twice.
    On a slow mesh the planner must not pick Ring for MHA nor TokenRing for GQA."""
    slow_mesh = measured(
        forward_flops_per_s=1e15,
        backward_flops_per_s=1e15,
        link_bandwidth_bytes_per_s=1e9,
        memory_bandwidth_bytes_per_s=1e12,
        dtype="bfloat16",
    )
    common = {
        "world_size": 4,
        "seq_local": 4096,
        "head_dim": 128,
        "dtype": "bfloat16",
        "causal": True,
        "layout": "zigzag",
        "training": False,
        "hardware": slow_mesh,
        "strategies": ["token_ring", "ring"],
    }
    assert tokenring.explain(heads_q=32, heads_kv=32, **common).pick.value == "token_ring"
    assert tokenring.explain(heads_q=32, heads_kv=8, **common).pick.value == "ring"


def auto_without_hardware() -> list[str]:
    """Every public call that plans "auto" raises without hardware, on every rank, before
    anything is measured or sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(
        seed=5, batch=1, seq_global=4 * world, heads_q=4, heads_kv=4, head_dim=8
    )
    local = [x[:, 4 * rank : 4 * (rank + 1)].clone() for x in (q, k, v)]
    comm = tokenring.get_communicator()
    before = comm.counter.total_sent()
    cache = tokenring.DistributedKVCache(
        num_layers=1,
        batch=1,
        heads_kv=4,
        head_dim=8,
        dtype=torch.float64,
        device="cpu",
        block_size=2,
        group=comm,
    )
    cache.begin_step([4 * world])
    rows = cache.step.num_rows(rank)
    calls = {
        "sequence_parallel_attn": lambda: tokenring.sequence_parallel_attn(*local, strategy="auto"),
        "module": lambda: tokenring.SequenceParallelAttention(strategy="auto")(*local),
        "resolve_strategy": lambda: tokenring.resolve_strategy(
            "auto", q=local[0], k=local[1], causal=False, layout="contiguous", comm=comm
        ),
        "cached_attn": lambda: tokenring.cached_attn(
            *(x[0, :rows] for x in local), cache=cache, layer=0
        ),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
            messages.append(f"{name}: no error")
        except ValueError as exc:
            messages.append(f"{name}: {exc}")
    assert comm.counter.total_sent() == before  # nothing measured, nothing sent
    return messages


def test_auto_without_hardware_raises_on_every_rank() -> None:
    """Note [Calibration is passed in]: no call measures the machine behind the caller's back."""
    for messages in tokenring.launch(auto_without_hardware, world_size=2, timeout_s=120):
        assert len(messages) == 4
        for message in messages:
            assert "strategy='auto' needs hardware=" in message, message
            assert "planner.calibrate(comm" in message and "got hardware=None" in message, message


def _compute_bound() -> Any:
    return measured(
        forward_flops_per_s=1e9,
        backward_flops_per_s=1e9,
        link_bandwidth_bytes_per_s=1e12,
        memory_bandwidth_bytes_per_s=1e12,
        dtype="float64",
    )


LAST_PAIR_CALL: dict[str, Any] = dict(  # 3 ranks, s = 8, MHA 4 x 8, float64, causal zigzag
    world_size=3, seq_local=8, heads_q=4, heads_kv=4, head_dim=8, causal=True, layout="zigzag"
)


def last_pair_on_ranks(hardware: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """TokenRing with last_pair="auto" on each description: what the planner said, the bytes
    each pass sent per link, and the error against the float64 oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = LAST_PAIR_CALL["seq_local"] * world
    q, k, v, dout = make_inputs(seed=9, batch=1, seq_global=seq, heads_q=4, heads_kv=4, head_dim=8)
    idx = torch.tensor(owned_positions("zigzag", rank, world, seq))
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5)
    comm = tokenring.get_communicator()
    found = {}
    for name, hw in hardware.items():
        lends = planner.lends_last_pair(
            **LAST_PAIR_CALL, dtype=torch.float64, training=True, hardware=hw
        )
        local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
        sent = []
        comm.counter.reset()
        out = tokenring.token_ring_attn(
            *local, causal=True, layout="zigzag", last_pair="auto", hardware=hw
        )
        sent.append(dict(comm.counter.sent_bytes))
        comm.counter.reset()
        out.backward(dout[:, idx])
        sent.append(dict(comm.counter.sent_bytes))
        got = [out.detach(), *(x.grad for x in local)]
        want = [ref[key][:, idx] for key in ("out", "dq", "dk", "dv")]
        error = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
        bytes_ = [{(flow, rank, peer): n for (flow, peer), n in x.items() if n} for x in sent]
        found[name] = {"lends": lends, "bytes": bytes_, "error": error}
    return found


def _last_pair_bytes(lend: bool, backward: bool) -> dict[tuple[str, int, int], int]:
    formula = expected_bytes(
        strategy="token_ring",
        lend=lend,
        backward=backward,
        batch=1,
        elem_bytes=8,
        acc_bytes=8,
        **LAST_PAIR_CALL,
    )
    return {key: n for key, n in formula.items() if n}


def test_last_pair_auto_lends_where_links_set_the_pace() -> None:
    """last_pair="auto" (Note [Borrowed last pair]): on a link-bound description the model
    lends TokenRing's last pair, on a compute-bound one it does not (the faster of its two
    predictions); the ranks run exactly that schedule, forward and backward (their bytes per
    link are ``expected_bytes`` with or without the lent pairs, which differ here), and the
    answer is exact either way."""
    hardware = _last_pair_hardware()
    per_rank = [found["last_pair"] for found in _per_rank()]  # 3 ranks, with the auto cases
    shape = AttentionShape(heads_q=4, heads_kv=4, head_dim=8, dtype="float64")
    sim = {k: v for k, v in LAST_PAIR_CALL.items() if k not in ("heads_q", "heads_kv", "head_dim")}
    for backward in (False, True):
        assert _last_pair_bytes(True, backward) != _last_pair_bytes(False, backward)
    for name, lend in (("link-bound", True), ("compute-bound", False)):
        times = [
            simulate(
                "token_ring",
                passes="both",
                shape=shape,
                hardware=hardware[name],
                lend_last_pair=x,
                **sim,
            ).call_s
            for x in (False, True)
        ]
        assert (times[1] < times[0]) is lend, (name, times)
        for backward in (False, True):
            got: dict = {}
            for found in per_rank:
                got |= found[name]["bytes"][backward]
            assert got == _last_pair_bytes(lend, backward), (name, backward)
        for found in per_rank:
            assert found[name]["lends"] is lend, name
            assert found[name]["error"] < 1e-10, name


def test_resolve_strategy_checks_the_layout_where_the_planner_does() -> None:
    """``resolve_strategy`` hands its ``layout`` to the planner as given: with an unknown
    layout and a dtype the hardware has no FLOP/s for, the dtype is named first (as the
    planner checks them), and an unknown layout alone is named."""
    import types

    import pytest

    # all that the pick reads of it: its size and its path (for last_block_splits)
    comm: Any = types.SimpleNamespace(world_size=2, path=lambda device: "gloo")
    k = torch.zeros(1, 8, 2, 16, dtype=torch.float16)

    def pick(dtype: torch.dtype, layout: str) -> tokenring.Strategy:
        q = torch.zeros(1, 8, 4, 16, dtype=dtype)
        return tokenring.resolve_strategy(
            "auto",
            q=q,
            k=k.to(dtype),
            causal=True,
            layout=layout,  # type: ignore[arg-type]
            comm=comm,
            hardware="a10-pcie",
            training=True,
        )

    with pytest.raises(ValueError, match="has attention FLOP/s for float16, bfloat16"):
        pick(torch.float32, "zz")
    with pytest.raises(ValueError, match="layout must be one of 'contiguous', 'zigzag'; got 'zz'"):
        pick(torch.float16, "zz")
    assert pick(torch.float16, "zigzag") is pick(torch.float16, tokenring.Layout.ZIGZAG)


def _splits_priced(shared: bool) -> dict[str, Any]:
    """The ``last_block_splits`` the planner was handed by ``resolve_strategy`` (left to the
    transport, as the operator leaves it) and by an operator call with ``strategy="auto"``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(
        seed=5, batch=1, seq_global=8 * world, heads_q=4, heads_kv=4, head_dim=8
    )
    idx = torch.tensor(owned_positions("zigzag", rank, world, 8 * world))
    local = [x[:, idx] for x in (q, k, v)]
    comm = tokenring.Communicator(shared_memory=shared, timeout_s=60)
    priced: list[int] = []
    real = planner.choose_strategy

    def recorded(**kwargs: Any) -> Any:
        priced.append(kwargs["last_block_splits"])
        return real(**kwargs)

    planner.choose_strategy = recorded
    try:
        tokenring.resolve_strategy(
            "auto", q=local[0], k=local[1], causal=True, layout=tokenring.Layout.ZIGZAG,
            comm=comm, hardware=_described(),
        )  # fmt: skip
        by_resolve = list(priced)
        tokenring.sequence_parallel_attn(
            *local, strategy="auto", causal=True, layout="zigzag", hardware=_described(), group=comm
        )
    finally:
        planner.choose_strategy = real
        comm.close()
    return {
        "path": comm.path(q.device),
        "resolve": by_resolve,
        "operator": priced[len(by_resolve) :],
    }


def test_resolve_strategy_prices_the_slices_the_call_takes() -> None:
    """``resolve_strategy`` with ``last_block_splits`` left out prices TokenRing's last block in
    the slices the operator resolves for the same communicator (Note [Last block slices] in
    tokenring.api): 1 through shared memory, 2 over sockets."""
    for shared, want in ((True, 1), (False, 2)):
        for found in tokenring.launch(_splits_priced, shared, world_size=2):
            assert found["resolve"] == [want], (shared, found)
            assert found["operator"] and set(found["operator"]) == {want}, (shared, found)


# 24 tokens, three documents, zigzag per document over 3 ranks: the ranks hold 9, 8 and 7
UNEVEN_SEQ_LEN, UNEVEN_DOCS = 24, [0, 21, 23, 24]


def _uneven_auto() -> dict[str, Any]:
    """strategy="auto" and TokenRing's last_pair="auto" on uneven shards (seq_len and
    cu_seqlens): the seq_local each planner call priced, the picks and the errors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = make_inputs(
        seed=9, batch=1, seq_global=UNEVEN_SEQ_LEN, heads_q=4, heads_kv=2, head_dim=8
    )
    idx = torch.tensor(sharded_positions("zigzag", rank, world, UNEVEN_SEQ_LEN, UNEVEN_DOCS))
    mask = visible_mask(UNEVEN_SEQ_LEN, causal=True, cu_seqlens=UNEVEN_DOCS)
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5, mask=mask)
    shards = dict(seq_len=UNEVEN_SEQ_LEN, cu_seqlens=UNEVEN_DOCS)
    priced: list[int] = []
    real = (planner.choose_strategy, planner.lends_last_pair)

    def recorded(what: Any) -> Any:
        def call(**kwargs: Any) -> Any:
            priced.append(kwargs["seq_local"])
            return what(**kwargs)

        return call

    planner.choose_strategy, planner.lends_last_pair = (recorded(f) for f in real)
    errors: list[float] = []
    try:
        pick = tokenring.resolve_strategy(
            "auto", q=q[:, idx], k=k[:, idx], causal=True, layout=tokenring.Layout.ZIGZAG,
            comm=tokenring.get_communicator(), hardware=_described(), **shards,
        )  # fmt: skip
        for options in ({"strategy": "auto"}, {"strategy": "token_ring", "last_pair": "auto"}):
            local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
            out = tokenring.sequence_parallel_attn(
                *local, causal=True, layout="zigzag", hardware=_described(), **shards, **options
            )
            out.backward(dout[:, idx])
            got = (out.detach(), *(x.grad for x in local))
            want = (ref[name][:, idx] for name in ("out", "dq", "dk", "dv"))
            errors += [(a - b).abs().max().item() for a, b in zip(got, want, strict=True)]
    finally:
        planner.choose_strategy, planner.lends_last_pair = real
    return {"held": len(idx), "priced": priced, "pick": pick.value, "errors": errors}


def test_auto_prices_uneven_shards_by_the_rows_every_rank_holds() -> None:
    """With seq_len and cu_seqlens the ranks hold 9, 8 and 7 tokens, but the planner must be
    handed the same call on every rank: the padded rows of the sharding, not the rank's own
    count (which gave ranks different picks, and an odd zigzag count raised on one rank
    while the others went on)."""
    _, padded = padded_rows("zigzag", 0, 3, UNEVEN_SEQ_LEN, UNEVEN_DOCS)  # the same on every rank
    found = tokenring.launch(_uneven_auto, world_size=3, timeout_s=300)
    assert sorted(f["held"] for f in found) == [7, 8, 9]
    assert len({f["pick"] for f in found}) == 1, found
    for f in found:
        assert f["priced"] and set(f["priced"]) == {padded}, found
        assert max(f["errors"]) < 1e-10, found
