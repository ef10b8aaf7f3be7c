"""Ulysses and all-gather K/V: pure schedules, and real gloo ranks against the float64 oracle.

Pure tests (milliseconds): the head split, every needed (query, key) pair computed exactly once,
and the schedules' bytes per (flow, src, dst) against a closed form written here from the
algorithms' definitions.
Distributed tests: one launch per world size (world size 1 in the pytest process), both
strategies and the grid looped inside the ranks; each rank checks out, lse and dq, dk, dv of
its shard against full attention in float64 (tests/oracle.py), and its counted bytes against
both the closed form and the schedule's transfers (the runtime posts the schedule's own
messages through the communicator, which counts them).

Tolerances (../shared/STYLE.md): float64 within 1e-10; float32 with ``assert_close``
defaults; bf16/fp16 within twice the error of plain single-process attention in that dtype
plus one rounding step at the tensor's magnitude.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    DTYPES,
    covered_pairs,
    make_inputs,
    multiset_mismatch,
    oracle_with_grads,
    owned_positions,
    tolerance_failures,
)
from tokenring.core.layout import Layout
from tokenring.core.schedule import AttentionShape, Pass
from tokenring.runtime.collective import collective_pass
from tokenring.runtime.kernels import select_kernel
from tokenring.strategies.collective import build_collective_schedule, ulysses_heads

# MHA, GQA (groups of 3), MQA, 3 kv heads (uneven on 2 and 4 ranks), fewer q heads than ranks.
HEADS = [(4, 4), (6, 2), (4, 1), (6, 3), (2, 1)]
STRATEGIES = ("ulysses", "allgather_kv")
BATCH, HEAD_DIM = 2, 8

# -- closed forms, from the definitions -----------------------------------------------------


def _q_heads(heads_q: int, world_size: int) -> list[list[int]]:
    """Query heads of each rank: ceil shares to the first Hq % P ranks, in head order."""
    counts = [
        heads_q // world_size + (1 if r < heads_q % world_size else 0) for r in range(world_size)
    ]
    starts = [sum(counts[:r]) for r in range(world_size)]
    return [list(range(start, start + n)) for start, n in zip(starts, counts, strict=True)]


def expected_collective_bytes(
    *,
    strategy: str,
    backward: bool,
    world_size: int,
    seq_local: int,
    heads_q: int,
    heads_kv: int,
    batch: int,
    head_dim: int,
    elem_bytes: int,
    acc_bytes: int,
) -> dict[tuple[str, int, int], int]:
    """Bytes per ``(flow, src, dst)`` of one pass.

    Ulysses, rank r to rank j != r, s rows each: forward, q of j's heads and k, v of the kv
    heads those use (travel), then out of r's heads with their lse (return); backward, q, dout,
    lse and delta of j's heads with the k, v those use (travel), then dq of r's heads and dk,
    dv of r's kv heads in the accumulation dtype (return). All-gather K/V (its rounds are
    point-to-point messages, not the backend's all-gather): k and v of all kv heads to
    every other rank (travel), in both passes (the forward keeps nothing); backward, also dk
    and dv of the destination's rows in the accumulation dtype (return).
    """
    p, s, d = world_size, seq_local, head_dim
    q_heads = _q_heads(heads_q, p)
    group = heads_q // heads_kv
    kv_heads = [{h // group for h in heads} for heads in q_heads]
    total: dict[tuple[str, int, int], int] = {}

    def add(flow: str, src: int, dst: int, per_row: int) -> None:
        if per_row:
            key = (flow, src, dst)
            total[key] = total.get(key, 0) + batch * s * per_row

    for r, j in itertools.product(range(p), range(p)):
        if r == j:
            continue
        nq_r, nkv_r = len(q_heads[r]), len(kv_heads[r])
        nq_j, nkv_j = len(q_heads[j]), len(kv_heads[j])
        if strategy == "ulysses" and not backward:
            add("travel", r, j, nq_j * d * elem_bytes + 2 * nkv_j * d * elem_bytes)
            add("return", r, j, nq_r * (d * elem_bytes + acc_bytes))
        elif strategy == "ulysses":  # q, dout, lse, delta of j's heads; the k, v they use
            add(
                "travel", r, j, 2 * nq_j * (d * elem_bytes + acc_bytes) + 2 * nkv_j * d * elem_bytes
            )
            add("return", r, j, nq_r * d * elem_bytes + 2 * nkv_r * d * acc_bytes)
        else:  # every pass needs every owner's K/V: each rank's block to each other rank
            add("travel", r, j, 2 * heads_kv * d * elem_bytes)
            if backward:  # gathered again; dk, dv of j's rows back to j
                add("return", r, j, 2 * heads_kv * d * acc_bytes)
    return total


def schedule_bytes(
    strategy: str,
    backward: bool,
    layout: str,
    causal: bool,
    p: int,
    s: int,
    dims: AttentionShape,
) -> dict[tuple[str, int, int], int]:
    sched = build_collective_schedule(
        strategy,
        "backward" if backward else "forward",
        layout=layout,
        causal=causal,
        world_size=p,
        seq_local=s,
        heads_q=dims.heads_q,
        heads_kv=dims.heads_kv,
    )
    total: dict[tuple[str, int, int], int] = {}
    for tr in sched.transfers:
        key = (tr.payload.flow.value, tr.src, tr.dst)
        total[key] = total.get(key, 0) + tr.num_bytes(dims)
    return total


# -- pure tests ------------------------------------------------------------------------------


def test_ulysses_head_split() -> None:
    failures = []
    for world_size, (heads_q, heads_kv) in itertools.product(
        (1, 2, 3, 4, 5, 8), (*HEADS, (8, 2), (32, 8), (1, 1))
    ):
        shares = ulysses_heads(world_size=world_size, heads_q=heads_q, heads_kv=heads_kv)
        want = _q_heads(heads_q, world_size)
        group = heads_q // heads_kv
        for rank, (share, heads) in enumerate(zip(shares, want, strict=True)):
            got_q, got_kv = list(range(*share.q)), set(range(*share.kv))
            if got_q != heads or got_kv != {h // group for h in heads}:
                failures.append(
                    f"P={world_size} H={heads_q}/{heads_kv} rank {rank}: q {got_q} kv {got_kv}; "
                    f"want q {heads} kv { ({h // group for h in heads}) }"
                )
    assert not failures, "\n".join(failures)


def test_ulysses_head_split_example_of_the_note() -> None:
    shares = ulysses_heads(world_size=4, heads_q=6, heads_kv=3)
    assert [sh.q for sh in shares] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [sh.kv for sh in shares] == [(0, 1), (1, 2), (2, 3), (2, 3)]


PURE_GRID = list(itertools.product(("contiguous", "zigzag"), (False, True), (1, 2, 3, 4, 5)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_needed_pair_computed_exactly_once(strategy: str) -> None:
    s, hq = 6, 6
    failures = []
    for (layout, causal, p), pass_ in itertools.product(PURE_GRID, ("forward", "backward")):
        name = f"{layout} causal={causal} P={p} {pass_}"
        seq = p * s
        sched = build_collective_schedule(
            strategy,
            pass_,
            layout=layout,
            causal=causal,
            world_size=p,
            seq_local=s,
            heads_q=hq,
            heads_kv=2,
        )
        if sched.num_steps != 1:
            failures.append(f"{name}: {sched.num_steps} steps, want 1")
        computed: dict[int, list[tuple[int, int]]] = {h: [] for h in range(hq)}
        shares = ulysses_heads(world_size=p, heads_q=hq, heads_kv=2)
        for r in range(p):
            plan = sched.steps[r][0]
            if strategy == "ulysses":  # rows of the gathered sequence in global order
                qpos = kpos = list(range(seq))
                heads = range(*shares[r].q)
            else:  # own local rows; kv rows of the gathered K/V, owner j's row i at j * s + i
                qpos = owned_positions(layout, r, p, seq)
                kpos = [owned_positions(layout, j, p, seq)[i] for j in range(p) for i in range(s)]
                heads = range(hq)
            for piece in plan.pieces:
                for i, j in itertools.product(range(*piece.q_rows), range(*piece.kv_rows)):
                    if piece.causal and j - piece.kv_rows[0] > i - piece.q_rows[0]:
                        continue
                    for h in heads:
                        computed[h].append((qpos[i], kpos[j]))
            if strategy == "allgather_kv":
                failures += [
                    f"{name} rank {r}: {f}"
                    for f in _allgather_round_failures(sched, r, pass_ == "backward")
                ]
        want = covered_pairs(layout, causal, p, s)
        for h in range(hq):
            if mismatch := multiset_mismatch(computed[h], want):
                failures.append(f"{name} head {h}: {mismatch}")
    assert not failures, "\n".join(failures[:20])


def _allgather_round_failures(sched: Any, r: int, backward: bool) -> list[str]:
    """Rank r computes round by round: its own block first, then owner r+1, r+2, ... (kv rows
    of owner j are [j*s, (j+1)*s)); round k's K/V come from r+k, which sends them to r in the
    all-to-all in which r sends its own to r-k. Forward: round k is posted while round k-1
    is computed (two rounds in flight), so after the segments of rounds < k-1; backward: one
    round in flight, posted after rounds < k (round 1 while the own block is computed), and
    round k's dK/dV go back to owner r+k right after round k, before round k+1 is posted."""
    p, s = sched.world_size, sched.seq_local
    failures = []
    segments = sched.steps[r][0].segments
    rounds = [(piece.kv_rows[0] // s - r) % p for seg in segments for piece in seg.pieces]
    if rounds[0] != 0 or rounds != sorted(rounds):
        failures.append(f"rounds {rounds}: want the own block first, then rounds in order")
    for seg in segments:
        for piece in seg.pieces:
            owner = piece.kv_rows[0] // s
            if not owner * s <= piece.kv_rows[0] < piece.kv_rows[1] <= (owner + 1) * s:
                failures.append(f"piece {piece} spans two owners")

    def done_before(k: int) -> int:  # segments of rounds < k
        return sum(1 for x in rounds if x < k)

    want = set()
    for k in range(1, p):
        gather_after = done_before(k - 1) if not backward else (0 if k == 1 else done_before(k))
        want.add(("kv", (r - k) % p, r, (0, s), gather_after))
        if backward:
            want.add(("dkv", (r + k) % p, (r + k) % p, (0, s), done_before(k + 1)))
    got = {
        (tr.payload.value, tr.dst, tr.owner, tr.rows, tr.after_segments) for tr in sched.sends(r, 0)
    }
    if got != want:
        failures.append(f"sends (payload, dst, owner, rows, after) {sorted(got)} != {sorted(want)}")
    return failures


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_schedule_bytes_match_closed_form(strategy: str) -> None:
    """The collectives move whole shards whatever the layout and mask: the bytes of the four
    (layout, causal) schedules are equal, and equal the closed form once per (world size,
    pass, heads)."""
    failures = []
    for p, backward, (heads_q, heads_kv) in itertools.product(
        (1, 2, 3, 4, 5), (False, True), (*HEADS, (32, 8))
    ):
        name = f"P={p} backward={backward} H={heads_q}/{heads_kv}"
        dims = AttentionShape(
            batch=2,
            heads_q=heads_q,
            heads_kv=heads_kv,
            head_dim=16,
            dtype="bfloat16",
        )
        got = {
            (layout, causal): schedule_bytes(strategy, backward, layout, causal, p, 6, dims)
            for layout, causal in itertools.product(("contiguous", "zigzag"), (False, True))
        }
        first = got["contiguous", False]
        for (layout, causal), other in got.items():
            if other != first:
                failures.append(
                    f"{name}: {layout} causal={causal} sends {other}, contiguous non-causal {first}"
                )
        want = expected_collective_bytes(
            strategy=strategy,
            backward=backward,
            world_size=p,
            seq_local=6,
            heads_q=heads_q,
            heads_kv=heads_kv,
            batch=2,
            head_dim=16,
            elem_bytes=2,
            acc_bytes=4,
        )
        if first != want:
            failures.append(f"{name}: schedule {first} != closed form {want}")
    assert not failures, "\n".join(failures[:20])


def test_bad_arguments_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="strategy_name must be one of 'ulysses'"):
        build_collective_schedule(
            "ring",
            "forward",
            layout="contiguous",
            causal=False,
            world_size=2,
            seq_local=4,
            heads_q=2,
            heads_kv=2,
        )
    with pytest.raises(ValueError, match="heads_kv must be >= 1 and divide heads_q"):
        ulysses_heads(world_size=2, heads_q=6, heads_kv=4)
    with pytest.raises(ValueError, match="must be even for layout 'zigzag'"):
        build_collective_schedule(
            "ulysses",
            "forward",
            layout="zigzag",
            causal=True,
            world_size=2,
            seq_local=5,
            heads_q=2,
            heads_kv=2,
        )
    with pytest.raises(ValueError, match="strategy_name must be one of"):
        collective_pass(
            "ring",
            Pass.FORWARD,
            tuple(torch.zeros(1, 2, 1, 4) for _ in range(3)),
            causal=False,
            scale=1.0,
            layout=Layout.CONTIGUOUS,
            comm=None,  # type: ignore[arg-type]  # never reached: the name is checked first
            kernel=select_kernel(torch.device("cpu"), torch.float32),
        )


# -- real ranks ------------------------------------------------------------------------------


def _check_config(
    strategy: str, layout: str, causal: bool, heads: tuple[int, int], dtype_name: str
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[dtype_name]
    seq_local = 5 if layout == "contiguous" else 6  # odd where the layout allows it
    seq = seq_local * world
    hq, hkv = heads
    q, k, v, dout = make_inputs(
        seed=zlib.crc32(repr((layout, causal, heads)).encode()),
        batch=BATCH,
        seq_global=seq,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=HEAD_DIM,
    )
    scale = HEAD_DIM**-0.5
    ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=scale, dtype=dtype)
    idx = torch.tensor(owned_positions(layout, rank, world, seq))
    local = [x[:, idx].to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
    comm = tokenring.get_communicator()
    comm.counter.reset()
    out, lse = tokenring.sequence_parallel_attn(
        *local,
        strategy=strategy,
        causal=causal,
        softmax_scale=scale,
        layout=layout,
        group=comm,
        kernel=select_kernel(q.device, dtype),
        check_ranks=False,
        return_lse=True,
    )
    counted = [dict(comm.counter.sent_bytes), dict(comm.counter.recv_bytes)]
    comm.counter.reset()
    out.backward(dout[:, idx].to(dtype))
    counted_bwd = [dict(comm.counter.sent_bytes), dict(comm.counter.recv_bytes)]
    got = {
        "out": out.detach(),
        "lse": lse,
        "dq": local[0].grad,
        "dk": local[1].grad,
        "dv": local[2].grad,
    }
    want = {
        "out": ref["out"][:, idx],
        "lse": ref["lse"][:, :, idx],
        "dq": ref["dq"][:, idx],
        "dk": ref["dk"][:, idx],
        "dv": ref["dv"][:, idx],
    }
    errors = {name: (got[name].double() - want[name]).abs().max().item() for name in got}
    failures = tolerance_failures(
        got, want, dtype=dtype, inputs=(q, k, v, dout), reference=ref, causal=causal, scale=scale
    )
    if not lse.requires_grad:  # Note [Gradient of lse] in tokenring.runtime.op
        failures.append("lse carries no gradient")
    dims = AttentionShape(
        batch=BATCH,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=HEAD_DIM,
        dtype=dtype,
    )
    for backward, (sent, recv) in ((False, counted), (True, counted_bwd)):
        closed = expected_collective_bytes(
            strategy=strategy,
            backward=backward,
            world_size=world,
            seq_local=seq_local,
            heads_q=hq,
            heads_kv=hkv,
            batch=BATCH,
            head_dim=HEAD_DIM,
            elem_bytes=dims.elem_bytes,
            acc_bytes=dims.acc_bytes,
        )
        planned = schedule_bytes(strategy, backward, layout, causal, world, seq_local, dims)
        mine_sent = {(f, peer): n for (f, src, peer), n in closed.items() if src == rank}
        mine_recv = {(f, src): n for (f, src, dst), n in closed.items() if dst == rank}
        planned_sent = {(f, peer): n for (f, src, peer), n in planned.items() if src == rank}
        which = "backward" if backward else "forward"
        if sent != mine_sent:
            failures.append(f"{which} sent bytes {sent} != closed form {mine_sent}")
        if sent != planned_sent:
            failures.append(f"{which} sent bytes {sent} != schedule {planned_sent}")
        if recv != mine_recv:
            failures.append(f"{which} received bytes {recv} != closed form {mine_recv}")
    return {
        "config": (strategy, layout, causal, heads, dtype_name),
        "errors": errors,
        "failures": failures,
    }


def _grid() -> list[dict[str, Any]]:
    """Both strategies. Every layout, mask and head shape in float64 (exact: a schedule bug
    shows as ~0.1); the lower precisions on a causal zigzag GQA case and a non-causal
    contiguous MQA case. All-gather K/V never splits heads, so it skips the head shapes only
    Ulysses splits oddly."""
    rows = []
    for strategy in STRATEGIES:
        heads_grid = HEADS if strategy == "ulysses" else [(4, 4), (6, 2), (4, 1)]
        configs = [
            (layout, causal, heads, "float64")
            for layout, causal, heads in itertools.product(
                ("contiguous", "zigzag"), (False, True), heads_grid
            )
        ]
        for dtype_name in ("float32", "bfloat16", "float16"):
            configs += [
                ("zigzag", True, (6, 3), dtype_name),
                ("contiguous", False, (4, 1), dtype_name),
            ]
        rows += [_check_config(strategy, *config) for config in configs]
    return rows


def _assert_no_failures(per_rank: list[list[dict[str, Any]]]) -> None:
    failures = []
    for rank, grid in enumerate(per_rank):
        for row in grid:
            failures += [f"rank {rank} {row['config']}: {f}" for f in row["failures"]]
    assert not failures, "\n".join(failures)


def test_matches_oracle_and_counted_bytes_on_one_rank(single_rank_group: None) -> None:
    """World size 1 in the pytest process (no launch to pay for)."""
    _assert_no_failures([_grid()])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_oracle_and_counted_bytes(world_size: int) -> None:
    """One launch per world size; both strategies and the whole grid inside the ranks."""
    _assert_no_failures(tokenring.launch(_grid, world_size=world_size, timeout_s=300))
