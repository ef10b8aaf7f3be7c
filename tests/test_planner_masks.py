"""The planner prices the call's mask (Note [Pricing the mask] in tokenring.model.planner): a
sliding window, documents and chunks, each strategy as its runtime runs it.

- A ring's predicted bytes are those of its masked schedule, counted independently from the
  float64 mask (``oracle.expected_bytes``), and its computing cells are the (q block, kv
  block) pairs in which some query sees some key.
- A collective's kernel work is the tiles its kernel computes (brute force over the mask);
  its bytes are unchanged.
- A window changes the pick; ``strategy="auto"`` runs the masked pick and matches the float64
  oracle on 3 ranks.
- Without a mask nothing changes: the same plan, bit for bit.

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    expected_bytes,
    make_inputs,
    oracle_with_grads,
    padded_rows,
    sharded_positions,
    visible_mask,
)
from tokenring import api
from tokenring.core.masks import MaskSpec
from tokenring.core.schedule import AttentionShape, Pass, Strategy
from tokenring.model import planner
from tokenring.model.costmodel import measured
from tokenring.model.simulate import (
    MASKED_TILE_ROWS,
    _tile_pairs,
    simulate_pass,
    strategy_schedule,
)
from tokenring.runtime.kernels import CpuFlashKernel, CudaFusedKernel

P = 4
RINGS = ("token_ring", "ring", "bidir_ring", "bidir_token_ring")
HEADS = dict(heads_q=4, heads_kv=2, head_dim=8)
GLOO = measured(
    forward_flops_per_s=1e11,
    backward_flops_per_s=5e10,
    link_bandwidth_bytes_per_s=1e9,
    memory_bandwidth_bytes_per_s=1e11,
    dtype="float32",
    collectives="gloo",
)
# masked calls: (layout, causal, S, documents, window, chunk)
CALLS: dict[str, tuple[str, bool, int, list[int] | None, tuple[int, int], int | None]] = {
    "window << S": ("zigzag", True, P * 64, None, (5, 0), None),
    "many documents": ("contiguous", True, P * 64, [0, 20, 50, 90, 100, 170, 200, 256], (-1, -1),
                       None),
    "chunks, uneven": ("zigzag", False, 250, [0, 120, 250], (-1, -1), 16),
}  # fmt: skip


def _mask_keywords(call: tuple[Any, ...]) -> dict[str, Any]:
    _, _, seq, docs, window, chunk = call
    return dict(cu_seqlens=docs or [0, seq], window_size=window, attention_chunk_size=chunk)


def _padded(call: tuple[Any, ...]) -> int:
    layout, _, seq, docs, *_ = call
    return padded_rows(layout, 0, P, seq, docs)[1]


@pytest.mark.parametrize("name", list(CALLS))
def test_ring_bytes_and_cells_are_the_masks(name: str) -> None:
    """explain's forward bytes per ring equal the float64 mask's count (oracle.expected_bytes:
    the rows each hop must carry, covered by one range), and the cells its schedule computes
    are the (q block, kv block) pairs with a visible pair."""
    call = CALLS[name]
    layout, causal, seq, docs, window, chunk = call
    plan = planner.explain(
        world_size=P, seq_local=_padded(call), dtype="float32", causal=causal, layout=layout,
        hardware=GLOO, strategies=list(RINGS), last_pair="return", **HEADS,
        **_mask_keywords(call),
    )  # fmt: skip
    assert "priced with its mask" in plan.reason
    visible = visible_mask(seq, causal=causal, cu_seqlens=docs, window=window, chunk=chunk)
    pos = [sharded_positions(layout, r, P, seq, docs) for r in range(P)]
    seen = {(o, j) for o in range(P) for j in range(P) if visible[pos[o]][:, pos[j]].any()}
    assert len(seen) < P * P, "the mask must empty some blocks"
    for pred in plan.predictions:
        want = expected_bytes(
            strategy=pred.strategy.value, backward=False, layout=layout, causal=causal,
            world_size=P, batch=1, elem_bytes=4, acc_bytes=4, seq_len=seq, cu_seqlens=docs,
            window=window, chunk=chunk, **HEADS,
        )  # fmt: skip
        for flow, got in (("travel", pred.travel_bytes), ("return", pred.return_bytes)):
            sent = [sum(n for (f, src, _), n in want.items() if f == flow and src == r)
                    for r in range(P)]  # fmt: skip
            assert got == max(sent), (name, pred.strategy, flow, got, sent)
        sched = strategy_schedule(
            pred.strategy, Pass.FORWARD, layout=layout, causal=causal, world_size=P,
            seq_len=seq, heads_q=4, heads_kv=2, **_mask_keywords(call),
        )  # fmt: skip
        cells = set()
        for row in sched.steps:
            for plan_rt in row:
                for pc in plan_rt.pieces:
                    q_owner = plan_rt.lane_q_owner(pc.lane)
                    cells.add((q_owner, plan_rt.kv_owners[pc.lane]))
        assert cells == seen, (name, pred.strategy, sorted(cells ^ seen))


def test_collectives_move_the_same_bytes_and_compute_the_tiles_the_mask_leaves() -> None:
    """Ulysses and all-gather K/V keep their messages; their kernel time is the FLOPs of the
    tiles of MASKED_TILE_ROWS rows in which some query sees some key (brute force over the
    mask), which is also how the default kernels cut a masked call."""
    for kernel in (CpuFlashKernel, CudaFusedKernel):
        default = inspect.signature(kernel.__init__).parameters["masked_tile_rows"].default
        assert default == MASKED_TILE_ROWS, kernel
    p, s, w = 2, 3 * MASKED_TILE_ROWS, (700, 0)
    dims = AttentionShape(heads_q=2, heads_kv=2, head_dim=8, dtype="float32")
    call: dict[str, Any] = dict(layout="contiguous", causal=True, world_size=p, seq_local=s)
    call |= dict(shape=dims, hardware=GLOO)
    visible = visible_mask(p * s, causal=True, window=w)
    t = MASKED_TILE_ROWS
    tiles = [(a, b) for a in range(0, p * s, t) for b in range(0, p * s, t)
             if visible[a : a + t, b : b + t].any()]  # fmt: skip
    pair_flops = 4 * dims.heads_q * dims.head_dim  # per (query, key) pair, forward
    for strategy in ("ulysses", "allgather_kv"):
        plain = simulate_pass(strategy, "forward", **call)
        masked = simulate_pass(strategy, "forward", **call, window_size=w)
        assert (masked.travel_bytes, masked.return_bytes) == (
            plain.travel_bytes,
            plain.return_bytes,
        )
        if strategy == "ulysses":  # every rank: all rows on its head share
            want = len(tiles) * t * t * pair_flops / p
        else:  # the last rank: its own rows against every block (tiles per block)
            want = sum(t * t * pair_flops for a, _ in tiles if a >= s)
        assert masked.compute_s == pytest.approx(want / GLOO.flops_per_s("forward", "float32"))
        assert masked.compute_s < plain.compute_s


def test_tile_pairs_is_a_brute_force_count() -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(60):
        n, m, tile = (int(x) for x in torch.randint(1, 70, (3,), generator=gen))
        tile = 1 + tile % 17
        causal = trial % 2 == 0
        left, right = (int(x) for x in torch.randint(-1, 25, (2,), generator=gen))
        docs = (0, 30, 31, 77, 100) if trial % 3 else None
        spec = MaskSpec(causal, (left, 0 if causal else right), docs)
        q_pos = torch.randint(-1, 100, (n,), generator=gen)
        if trial % 4 == 0:
            q_pos = torch.arange(n) + 3
        kv_pos = torch.randint(-1, 100, (m,), generator=gen)
        seen = spec.visible(q_pos, kv_pos)
        want = sum(
            min(tile, n - a) * min(tile, m - b)
            for a in range(0, n, tile)
            for b in range(0, m, tile)
            if seen[a : a + tile, b : b + tile].any()
        )
        assert _tile_pairs(spec, q_pos, kv_pos, tile) == want, trial


# a small call whose pick the window changes (3 ranks, float64): what auto runs below
FLIP_HW = measured(
    forward_flops_per_s=1e9,
    backward_flops_per_s=5e8,
    link_bandwidth_bytes_per_s=1e7,
    memory_bandwidth_bytes_per_s=1e10,
    latency_s=1e-4,
    dtype="float64",
    collectives="gloo",
)
FLIP = dict(world_size=3, seq_local=32, heads_q=4, heads_kv=2, head_dim=4, dtype="float64")
FLIP |= dict(causal=True, layout="contiguous", hardware=FLIP_HW, training=True)
FLIP_WINDOW = (4, 0)


def test_a_window_changes_the_pick() -> None:
    """Before: the window unpriced, bidir_ring (every block computed and sent). After: a window
    of 4 over S = 96 leaves each rank its own block and a neighbour's 4 rows, and TokenRing,
    which returns 4 rows of partials, is the fastest."""
    before = planner.explain(**FLIP)
    after = planner.explain(**FLIP, window_size=FLIP_WINDOW)
    assert before.pick is Strategy.BIDIR_RING
    assert after.pick is Strategy.TOKEN_RING
    assert planner.choose_strategy(**FLIP, window_size=FLIP_WINDOW) is Strategy.TOKEN_RING
    assert "priced with its mask (window (4, 0))" in after.reason
    old = {p.strategy: p for p in before.predictions}
    for pred in after.predictions:
        if pred.strategy.is_ring:  # fewer blocks computed and sent
            assert pred.total_s < 0.9 * old[pred.strategy].total_s, pred.strategy
        else:  # the same messages; one masked 96 x 96 tile computes more than a causal one
            assert pred.travel_bytes == old[pred.strategy].travel_bytes, pred.strategy


def test_no_mask_is_bit_identical_and_bad_masks_are_named() -> None:
    """A plain mask (no window, one document) prices exactly the plain call; each bad input
    is refused naming the argument and its value; above 64 ranks the vectorised engine
    prices the plain call and says so."""
    kw = dict(FLIP, layout=None)
    plain = planner.explain(**kw)
    for same in (
        dict(window_size=(-1, -1)),
        dict(window_size=-1, cu_seqlens=[0, 96]),
        dict(attention_chunk_size=96),
        dict(cu_seqlens=torch.tensor([0, 96])),
    ):
        assert planner.explain(**kw, **same) == plain, same
    for bad, words in (
        (dict(window_size=2.5), "window_size"),
        (dict(window_size=(3, -2)), "window_size"),
        (dict(attention_chunk_size=0), "attention_chunk_size must be an int >= 1"),
        (dict(cu_seqlens=[0, 50, 40, 96]), "cu_seqlens"),
        (dict(cu_seqlens=[0, 50, 60]), "seq_local=32"),  # 20 rows contiguous, 22 zigzag
    ):
        with pytest.raises(ValueError, match=words):
            planner.explain(**kw, **bad)
    # 90 tokens in two documents: 30 rows per rank contiguous, 32 zigzag (padded per document)
    only = planner.explain(**kw, cu_seqlens=[0, 50, 90])
    assert {p.layout.value for p in only.predictions} == {"zigzag"}
    big = dict(FLIP, world_size=65, strategies=["token_ring", "ring"])
    plan = planner.explain(**big, window_size=FLIP_WINDOW)
    assert "not priced: the vectorised engine" in plan.reason
    assert plan.predictions == planner.explain(**big).predictions


# -- auto on 3 ranks --------------------------------------------------------------------------
AUTO_CALLS: dict[str, dict[str, Any]] = {
    "window": dict(seq=96, layout="contiguous", docs=None, window=FLIP_WINDOW, chunk=None),
    "documents and chunks": dict(seq=91, layout="zigzag", docs=[0, 40, 91], window=(-1, -1),
                                 chunk=8),
}  # fmt: skip


def _auto_on_ranks() -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for name, c in AUTO_CALLS.items():
        q, k, v, dout = make_inputs(
            seed=11, batch=1, seq_global=c["seq"], heads_q=4, heads_kv=2, head_dim=4
        )
        idx = torch.tensor(sharded_positions(c["layout"], rank, world, c["seq"], c["docs"]))
        mask = visible_mask(
            c["seq"], causal=True, cu_seqlens=c["docs"], window=c["window"], chunk=c["chunk"]
        )
        ref = oracle_with_grads(q, k, v, dout, causal=True, scale=0.5, mask=mask)
        local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
        options: dict[str, Any] = dict(
            causal=True, layout=c["layout"], seq_len=c["seq"], cu_seqlens=c["docs"],
            window_size=c["window"], attention_chunk_size=c["chunk"],
        )  # fmt: skip
        pick = tokenring.resolve_strategy(
            "auto", q=local[0], k=local[1], v=local[2], comm=tokenring.get_communicator(),
            hardware=FLIP_HW, **options,
        )  # fmt: skip
        out = tokenring.sequence_parallel_attn(*local, strategy="auto", hardware=FLIP_HW, **options)
        out.backward(dout[:, idx])
        errors = [(out.detach() - ref["out"][:, idx]).abs().max().item()]
        grads = zip(local, ("dq", "dk", "dv"), strict=True)
        errors += [(x.grad - ref[g][:, idx]).abs().max().item() for x, g in grads]
        found.append({"call": name, "pick": pick.value, "error": max(errors)})
    return found


def test_auto_runs_the_masked_pick_and_matches_the_oracle() -> None:
    found = tokenring.launch(_auto_on_ranks, world_size=3, timeout_s=120)
    window = {f["pick"] for mine in found for f in mine if f["call"] == "window"}
    assert window == {"token_ring"}, found  # the masked pick (bidir_ring unmasked)
    for mine in found:
        assert [f["call"] for f in mine] == list(AUTO_CALLS)
        assert [f["pick"] for f in mine] == [f["pick"] for f in found[0]], found
        for f in mine:
            assert f["error"] < 1e-10, f


def test_auto_prices_a_batch_by_its_padded_rows_not_its_documents() -> None:
    """Documents change with every packed batch: auto's planning input (and so its cached
    plan) is the same for two batches whose documents differ but whose padded rows agree,
    while the window reaches it (Note [Pricing the mask])."""
    q, k = torch.zeros(1, 32, 4, 4), torch.zeros(1, 32, 2, 4)
    base = dict(hardware=FLIP_HW, causal=True, layout="contiguous", last_block_splits=2)
    base |= dict(window_size=(4, 0), attention_chunk_size=None, requires_grad=(True,) * 3)
    args = [
        api._planner_args(q, k, base | dict(seq_len=96, cu_seqlens=docs), world_size=3)
        for docs in ([0, 40, 96], [0, 7, 50, 96], None)
    ]
    assert args[0] == args[1] == args[2], args
    assert args[0]["window_size"] == (4, 0) and args[0]["seq_local"] == 32
    assert "cu_seqlens" not in args[0] or args[0]["cu_seqlens"] is None
