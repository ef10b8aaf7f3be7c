"""Audit of ``strategy="auto"`` and ``last_pair="auto"``: every rank picks the same for an
agreed call, the pick runs what the planner priced, and its answer is the picked strategy's.

- Grad flags: a backward follows when any of q, k, v requires grad (the signature's "needs
  grad"); the planner must price that on every rank, whichever input requires grad where.
- Ranks that differ (hardware=, grad mode) raise on every rank at once, naming the field.
- auto against the strategy it picked, called directly with the same last pair: bitwise the
  same out, lse and gradients, and the float64 oracle's, for each 1-D strategy (hardware
  descriptions chosen so that every one of them is picked) with GQA, batch 2, uneven shards,
  documents and a window.
- cached_attn's zigzag first prefill prices TokenRing as it runs it (Note [Cached attention
  call] in tokenring.inference).

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import functools
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    full_attention,
    make_inputs,
    oracle_with_grads,
    padded_rows,
    sharded_positions,
    visible_mask,
)
from tokenring.api import last_block_splits_for
from tokenring.core.schedule import AttentionShape
from tokenring.inference import resolve_cached_strategy
from tokenring.model import planner
from tokenring.model.costmodel import Hardware, measured, preset
from tokenring.model.simulate import simulate_pass
from tokenring.strategies.cached import CachedStrategy

WORLD = 3
TIMEOUT_S = 5.0  # the communicators': a case that waits for it is a defect
FAST_S = 2.0  # what "at once" means (the agreement takes milliseconds)
TOL = 1e-10  # float64
D = 4
SCALE = D**-0.5


def _hw(
    flops: float, link: float, latency_s: float, collectives: str, topology: str = "mesh"
) -> Hardware:
    """A float64 description; a switch's port runs at the link's rate."""
    port = link if topology == "switch" else None
    return measured(
        forward_flops_per_s=flops,
        backward_flops_per_s=flops / 2,
        link_bandwidth_bytes_per_s=link,
        memory_bandwidth_bytes_per_s=1e10,
        dtype="float64",
        latency_s=latency_s,
        collectives=collectives,
        topology=topology,
        port_bandwidth_bytes_per_s=port,
    )


# -- grad flags: one call, priced alike on every rank ----------------------------------------------
# P = 3, S = 12, MHA 4/4, causal zigzag: forward alone bidir_ring, with the backward
# bidir_token_ring (checked by test_ranks_price_the_backward_whichever_input_requires_grad)
FLIP_HW = _hw(1e9, 1e6, 0.0, "gloo")
FLIP_CALL: dict[str, Any] = dict(S=12, heads_q=4, heads_kv=4)


def _flip_picks() -> tuple[tokenring.Strategy, tokenring.Strategy]:
    """The planner's pick for FLIP_CALL without and with the backward."""
    kw: dict[str, Any] = dict(
        world_size=WORLD, seq_local=FLIP_CALL["S"] // WORLD, heads_q=4, heads_kv=4, head_dim=D,
        dtype=torch.float64, causal=True, layout="zigzag", hardware=FLIP_HW,
        last_block_splits=2,
    )  # fmt: skip
    forward, both = (planner.choose_strategy(training=t, **kw) for t in (False, True))
    return forward, both


def _grad_flags(comm: tokenring.Communicator) -> dict[str, Any]:
    """auto where rank r's requires-grad input differs ("mixed": q, v, k on ranks 0, 1, 2) or
    is v alone on every rank: the error of out and of that input's gradient, the seconds the
    call took, and resolve_strategy's pick for the same tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = FLIP_CALL["S"]
    q, k, v, dout = make_inputs(seed=3, batch=1, seq_global=seq, heads_q=4, heads_kv=4, head_dim=D)
    idx = torch.tensor(sharded_positions("zigzag", rank, world, seq))
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=SCALE)
    found: dict[str, Any] = {}
    for name, which in (("mixed", (0, 2, 1)[rank]), ("v only", 2)):
        local = [x[:, idx].clone() for x in (q, k, v)]
        local[which].requires_grad_(True)
        pick = tokenring.resolve_strategy(
            "auto", q=local[0], k=local[1], v=local[2], causal=True,
            layout=tokenring.Layout.ZIGZAG, comm=comm, hardware=FLIP_HW,
        )  # fmt: skip
        start = time.monotonic()
        try:
            out = tokenring.sequence_parallel_attn(
                *local, strategy="auto", causal=True, layout="zigzag", hardware=FLIP_HW,
                group=comm,
            )  # fmt: skip
            out.backward(dout[:, idx])
            grad = local[which].grad
            assert grad is not None
            want = ref[("dq", "dk", "dv")[which]][:, idx]
            errors = [(out.detach() - ref["out"][:, idx]).abs().max().item()]
            errors.append((grad - want).abs().max().item())
            found[name] = {"pick": pick.value, "errors": errors}
        except Exception as exc:  # a defect: reported with its time, the test names it
            found[name] = {"pick": pick.value, "error": f"{type(exc).__name__}: {exc}"}
            comm = tokenring.Communicator(shared_memory=False, timeout_s=TIMEOUT_S)
        found[name]["seconds"] = time.monotonic() - start
    found["comm"] = comm
    return found


def _disagreements(comm: tokenring.Communicator) -> dict[str, Any]:
    """Rank 1 passes another hardware; rank 0 calls in no_grad mode: what each rank raised
    and how long it took."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = make_inputs(seed=4, batch=1, seq_global=12, heads_q=4, heads_kv=4, head_dim=D)
    idx = torch.tensor(sharded_positions("zigzag", rank, world, 12))
    other = _hw(2e9, 1e6, 0.0, "gloo") if rank == 1 else FLIP_HW
    cases = {
        "hardware": (other, torch.enable_grad),
        "grad mode": (FLIP_HW, torch.no_grad if rank == 0 else torch.enable_grad),
    }
    found = {}
    for name, (hardware, mode) in cases.items():
        local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
        start = time.monotonic()
        try:
            with mode():
                tokenring.sequence_parallel_attn(
                    *local, strategy="auto", causal=True, layout="zigzag", hardware=hardware,
                    group=comm,
                )  # fmt: skip
            found[name] = ("no error", "", time.monotonic() - start)
        except Exception as exc:
            found[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
            if not isinstance(exc, ValueError):  # the communicator may have failed
                comm = tokenring.Communicator(shared_memory=False, timeout_s=TIMEOUT_S)
    return found


# -- auto against the strategy it picked, per strategy ------------------------------------------
# hardware rows (FLOP/s, link bytes/s, latency s, collectives, topology) under which the
# planner picks each 1-D strategy for the call (test_auto_is_the_picked_strategy checks that
# every strategy was picked, so a change of the model that moves a pick shows)
PICK_CALLS: dict[str, dict[str, Any]] = {
    # uneven shards of two documents, zigzag, causal, MHA, batch 2
    "mha": dict(
        S=17, heads_q=4, heads_kv=4, batch=2, layout="zigzag", causal=True,
        cu_seqlens=[0, 11, 17], window=(-1, -1),
        rows=[
            (1e9, 1e6, 0.0, "gloo", "mesh"),
            (1e9, 1e6, 0.0, "gloo", "switch"),
            (1e9, 1e6, 1e-3, "gloo", "mesh"),
            (1e9, 1e9, 1e-3, "gloo", "mesh"),
            (1e9, 1e9, 1e-3, "direct", "mesh"),
            (1e9, 1e9, 1e-3, "direct", "switch"),
        ],
    ),
    # a sliding window, contiguous, not causal, GQA 4/1
    "gqa window": dict(
        S=18, heads_q=4, heads_kv=1, batch=1, layout="contiguous", causal=False,
        cu_seqlens=None, window=(2, 3),
        rows=[
            (1e9, 1e6, 0.0, "gloo", "mesh"),
            (1e9, 1e6, 0.0, "gloo", "switch"),
            (1e9, 1e6, 0.0, "direct", "switch"),
            (1e9, 1e9, 0.0, "gloo", "mesh"),  # priced with its window: bidir_token_ring
        ],
    ),
}  # fmt: skip


def _oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, mask: torch.Tensor
) -> list[torch.Tensor]:
    """out, lse and the gradients of q, k, v of the loss sum(out * dout) + sum(lse), float64."""
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = full_attention(*leaves, causal=False, scale=SCALE, mask=mask)
    ((out * dout).sum() + lse.sum()).backward()
    return [out.detach(), lse.detach(), *(x.grad for x in leaves)]


def _auto_against_direct() -> list[dict[str, Any]]:
    """Per call and hardware row: the pick, whether TokenRing lent its last pair, whether auto
    and the direct call gave bitwise the same out, lse, dq, dk, dv (loss: sum(out * dout) +
    sum(lse)), and auto's largest error against the float64 oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tokenring.Communicator(shared_memory=False, timeout_s=TIMEOUT_S)  # 2 slices
    found = []
    for name, call in PICK_CALLS.items():
        seq, hq, hkv, batch = call["S"], call["heads_q"], call["heads_kv"], call["batch"]
        docs, window = call["cu_seqlens"], call["window"]
        q, k, v, dout = make_inputs(
            seed=7, batch=batch, seq_global=seq, heads_q=hq, heads_kv=hkv, head_dim=D
        )
        idx = torch.tensor(sharded_positions(call["layout"], rank, world, seq, docs))
        mask = visible_mask(seq, causal=call["causal"], cu_seqlens=docs, window=window)
        ref = _oracle(q, k, v, dout, mask)
        want = [ref[0][:, idx], ref[1][:, :, idx], *(x[:, idx] for x in ref[2:])]
        _, padded = padded_rows(call["layout"], rank, world, seq, docs)  # what every rank prices
        options: dict[str, Any] = dict(
            causal=call["causal"], layout=call["layout"], seq_len=seq, cu_seqlens=docs,
            window_size=list(window), group=comm, return_lse=True,
        )  # fmt: skip
        for row in call["rows"]:
            hardware = _hw(*row)
            priced: dict[str, Any] = dict(
                world_size=world, seq_local=padded, heads_q=hq, heads_kv=hkv, head_dim=D,
                dtype=torch.float64, causal=call["causal"], layout=call["layout"],
                training=True, hardware=hardware, batch=batch, last_block_splits=2,
                cu_seqlens=docs or [0, seq], window_size=window,  # the mask auto prices
            )  # fmt: skip
            pick = planner.choose_strategy(**priced)
            lend = pick is tokenring.Strategy.TOKEN_RING and planner.lends_last_pair(**priced)
            runs: dict[str, dict[str, Any]] = {
                "auto": dict(strategy="auto", hardware=hardware),
                "direct": dict(strategy=pick.value),
            }
            if pick is tokenring.Strategy.TOKEN_RING:
                runs["direct"]["last_pair"] = "lend" if lend else "return"
            got = {}
            for how, chosen in runs.items():
                local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
                out, lse = tokenring.sequence_parallel_attn(*local, **options, **chosen)
                ((out * dout[:, idx]).sum() + lse.sum()).backward()
                got[how] = [out.detach(), lse.detach(), *(x.grad for x in local)]
            same = all(torch.equal(a, b) for a, b in zip(got["auto"], got["direct"], strict=True))
            error = max((a - b).abs().max().item() for a, b in zip(got["auto"], want, strict=True))
            found.append(
                {"call": name, "row": row, "pick": pick.value, "lend": lend, "same": same,
                 "error": error}
            )  # fmt: skip
    return found


def _audit() -> dict[str, Any]:
    comm = tokenring.Communicator(shared_memory=False, timeout_s=TIMEOUT_S)
    flags = _grad_flags(comm)
    comm = flags.pop("comm")
    return {
        "grad flags": flags,
        "disagreements": _disagreements(comm),
        "auto vs direct": _auto_against_direct(),
    }


@functools.cache
def _per_rank() -> tuple[dict[str, Any], ...]:
    """Every multi-rank case of this file, one launch of WORLD ranks."""
    return tuple(tokenring.launch(_audit, world_size=WORLD, timeout_s=120))


def test_ranks_price_the_backward_whichever_input_requires_grad() -> None:
    """A backward follows when any of q, k, v requires grad, and the ranks agree on that
    ("needs grad"). The planner priced q and k alone: with rank 0's q and rank 1's v
    requiring grad, rank 0 picked bidir_token_ring and rank 1 bidir_ring, and each waited
    out the timeout for the other's messages ("receive of 'q' ... failed"). With v alone on
    every rank the call ran a backward the pick had not priced."""
    forward, both = _flip_picks()
    assert forward is not both, "FLIP_HW must make the backward change the pick"
    for rank, found in enumerate(_per_rank()):
        for name in ("mixed", "v only"):
            case = found["grad flags"][name]
            assert "error" not in case, (rank, name, case)
            assert max(case["errors"]) < TOL, (rank, name, case)
            assert case["seconds"] < FAST_S, (rank, name, case)
            assert case["pick"] == both.value, (rank, name, case)


def test_ranks_that_differ_in_hardware_or_grad_mode_fail_at_once_naming_it() -> None:
    for rank, found in enumerate(_per_rank()):
        for name, field in (("hardware", "hardware:"), ("grad mode", "needs grad:")):
            kind, message, seconds = found["disagreements"][name]
            assert kind == "ValueError", (rank, name, kind, message)
            assert "ranks disagree" in message and field in message, (rank, name, message)
            assert seconds < FAST_S, (rank, name, seconds)


def test_auto_is_the_picked_strategy() -> None:
    """auto's out, lse and gradients (a loss of out and lse) are bitwise those of the strategy
    it picked called directly (TokenRing with the last pair the model chose), for every 1-D
    strategy, and the float64 oracle's."""
    found = [mine["auto vs direct"] for mine in _per_rank()]
    rows = found[0]
    for rank, mine in enumerate(found):
        picks = [(r["call"], r["row"], r["pick"], r["lend"]) for r in mine]
        assert picks == [(r["call"], r["row"], r["pick"], r["lend"]) for r in rows], rank
        for r in mine:
            assert r["same"], (rank, r)
            assert r["error"] < TOL, (rank, r)
    picked = {r["pick"] for r in rows}
    one_d = {s.value for s in tokenring.Strategy if s is not tokenring.Strategy.HYBRID}
    assert picked == one_d, f"PICK_CALLS' rows no longer cover every strategy: {rows}"
    assert any(r["lend"] for r in rows), "no row made TokenRing lend its last pair"


# -- in-process -----------------------------------------------------------------------------------
def test_resolve_strategy_prices_a_backward_for_v_alone() -> None:
    """resolve_strategy's training=None reads v too (as the call does)."""
    comm: Any = types.SimpleNamespace(world_size=WORLD, path=lambda device: "gloo")
    shape = (1, FLIP_CALL["S"] // WORLD, 4, D)
    q, k = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    kw: dict[str, Any] = dict(q=q, k=k, causal=True, layout="zigzag", comm=comm)
    forward, both = _flip_picks()
    assert tokenring.resolve_strategy("auto", v=v, hardware=FLIP_HW, **kw) is both
    assert tokenring.resolve_strategy("auto", hardware=FLIP_HW, **kw) is forward
    with torch.no_grad():
        assert tokenring.resolve_strategy("auto", v=v, hardware=FLIP_HW, **kw) is forward


def _cached_pick(
    hardware: Hardware | str,
    path: str,
    world_size: int,
    new: int,
    heads: tuple[int, int, int] = (4, 4, 8),
    zigzag_first_prefill: bool = True,
) -> Any:
    """cached_attn's auto pick for a first prefill of ``new`` tokens (one sequence, bfloat16,
    heads (Hq, Hkv, D)) through a communicator whose path is ``path``."""
    hq, hkv, d = heads
    cache = tokenring.DistributedKVCache(
        num_layers=1, batch=1, heads_kv=hkv, head_dim=d, dtype=torch.bfloat16, device="cpu",
        rank=0, world_size=world_size, zigzag_first_prefill=zigzag_first_prefill,
    )  # fmt: skip
    step = cache.plan_step([new])
    assert step.zigzag is zigzag_first_prefill
    comm: Any = types.SimpleNamespace(rank=0, world_size=world_size, path=lambda device: path)
    return resolve_cached_strategy(
        "auto", step=step, comm=comm, heads_q=hq, heads_kv=hkv, head_dim=d,
        dtype=torch.bfloat16, device=torch.device("cpu"), hardware=hardware,
    )  # fmt: skip


def test_cached_zigzag_prefill_prices_tokenring_as_it_runs_it() -> None:
    """A zigzag first prefill runs TokenRing returning its last pair, in the slices of the
    communicator's path (1 through shared memory, else 2). Its pick priced TokenRing lending
    the pair and in 2 slices: pass_q where the run is slower than pass_kv by the model's own
    numbers."""

    def bf16(flops: float, link: float, latency_s: float) -> Hardware:
        return measured(
            forward_flops_per_s=flops, backward_flops_per_s=flops / 2,
            link_bandwidth_bytes_per_s=link, memory_bandwidth_bytes_per_s=1e10,
            dtype="bfloat16", latency_s=latency_s, collectives="gloo",
        )  # fmt: skip

    cases = [  # (hardware, path, P, rows per rank): where lending or the slices decide
        (bf16(1e9, 1e7, 1e-4), "gloo", 4, 8),
        (bf16(1e9, 1e8, 0.0), "gloo-shm", 2, 4),
        (bf16(1e9, 1e8, 0.0), "gloo", 2, 4),
    ]
    decided = False
    for hardware, path, world_size, rows in cases:
        kw: dict[str, Any] = dict(
            world_size=world_size, seq_local=rows, heads_q=4, heads_kv=4, head_dim=8,
            dtype="bfloat16", causal=True, layout="zigzag", hardware=hardware,
            strategies=("token_ring", "ring"),
        )  # fmt: skip
        splits = last_block_splits_for(path)
        runs = planner.explain(last_pair="return", last_block_splits=splits, **kw).pick
        old = planner.explain(**kw).pick  # lending allowed, 2 slices
        decided |= runs is not old
        want = (
            CachedStrategy.PASS_Q
            if runs is tokenring.Strategy.TOKEN_RING
            else CachedStrategy.PASS_KV
        )
        assert _cached_pick(hardware, path, world_size, rows * world_size) is want, path
    assert decided, "no case where pricing what runs changes the pick"


def test_explain_cached_reports_the_pick_cached_attn_makes() -> None:
    """A first prefill that 2P divides is placed in the zigzag layout and runs pass_q or pass_kv
    on the ordinary path; explain_cached priced block-cyclic plans for it and reported their
    pick (P = 4, 128 tokens, h100-nvswitch, 8/2 x 64: pass_q, where cached_attn ran
    pass_kv). Now it prices what runs, with simulate_pass's numbers, and zigzag_first_prefill=
    False (as the cache's) gives the block-cyclic pick."""
    heads: dict[str, Any] = dict(heads_q=8, heads_kv=2, head_dim=64)
    case: dict[str, Any] = dict(world_size=4, cached=0, new=128, hardware="h100-nvswitch", **heads)
    choice = planner.explain_cached(**case)
    assert choice.pick is _cached_pick("h100-nvswitch", "gloo", 4, 128, (8, 2, 64))
    shape = AttentionShape(**heads, dtype="bfloat16")
    for prediction, strategy in zip(choice.predictions, ("token_ring", "ring"), strict=True):
        forward = simulate_pass(
            strategy, "forward", layout="zigzag", causal=True, world_size=4, seq_local=32,
            shape=shape, hardware=preset("h100-nvswitch"),
        )  # fmt: skip
        assert prediction.total_s == forward.call_s, strategy
    plain = planner.explain_cached(**case, zigzag_first_prefill=False)
    assert plain.pick is _cached_pick("h100-nvswitch", "gloo", 4, 128, (8, 2, 64), False)
    assert {p.strategy for p in plain.predictions} == set(CachedStrategy)
    with pytest.raises(ValueError, match="candidates cannot be chosen for a zigzag first"):
        planner.explain_cached(**case, candidates=["direct"])
    with pytest.raises(ValueError, match="zigzag_first_prefill must be a bool; got 'no'"):
        planner.explain_cached(**case, zigzag_first_prefill="no")  # type: ignore[arg-type]
