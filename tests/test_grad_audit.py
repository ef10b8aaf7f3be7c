"""An audit of the gradients of the public attention entry points against float64 autograd.

The table tests (test_attention, test_collective, test_masks, test_random_calls) check dq, dk
and dv of contiguous leaves with ``out.backward(dout)``. This file checks how a user's graph
reaches the operator: inputs that are views (transposed, strided), only some of q, k, v
requiring grad, a backward run twice (``retain_graph``: the grads double), an upstream
gradient that is strided or has zero or infinite rows, losses that use lse (Note [Gradient of
lse] in tokenring.runtime.op: its gradient used to be dropped without a word, 0.7-2.3 off in
dq and dk), and block kernels cut into 2-row tiles, so that the stand-in out of Note [Backward
from delta] and the tile accumulators run in every strategy. Every strategy (the pass-Q
options too), every dtype, both layouts, masks, GQA/MQA and batch 2, on 1 to 4 ranks; the
cases of one world size run in one launch, each kind of case on some strategies (taken in
turn, to stay fast).

Tolerances as ../shared/STYLE.md (``oracle.tolerance_failures``).

Legend: B batch, S global seq, Hq query heads, Hkv kv heads, D head dim, P world size.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    DTYPES,
    full_attention,
    make_inputs,
    oracle_with_grads,
    sharded_positions,
    tolerance_failures,
    visible_mask,
)
from test_random_calls import _hardware  # the random calls' hardware for auto
from tokenring.runtime.kernels import CpuFlashKernel, TiledKernel

STRATEGIES: dict[str, dict[str, Any]] = {
    "token_ring": {},
    "token_ring+lend": {"strategy": "token_ring", "last_pair": "lend"},
    "token_ring+splits3": {"strategy": "token_ring", "last_block_splits": 3},
    "token_ring+splits1": {"strategy": "token_ring", "last_block_splits": 1},
    "ring": {},
    "bidir_ring": {},
    "bidir_token_ring": {},
    "ulysses": {},
    "allgather_kv": {},
    "auto": {},
}


def _options(name: str, dtype: str) -> dict[str, Any]:
    options = {"strategy": name, **STRATEGIES[name]}
    if options["strategy"] == "auto":
        options["hardware"] = _hardware(dtype)
    return options


def _case(**over: Any) -> dict[str, Any]:
    case = {
        "strategy": "token_ring",
        "dtype": "float64",
        "layout": "zigzag",
        "causal": True,
        "heads": (4, 2),
        "batch": 2,
        "head_dim": 8,
        "seq_len": None,  # None: 4 tokens a rank (zigzag: 2 chunks of 2)
        "docs": None,
        "window": None,
        "chunk": None,
        "grad": "qkv",  # which of q, k, v require grad
        "view": "plain",  # plain | transposed | strided
        "dout": "plain",  # plain | strided | zero_rows | nonfinite_rows | none (not in the loss)
        "lse_loss": False,  # the loss also uses lse
        "twice": False,  # backward twice with retain_graph: the grads double
        "kernel": None,  # None | "tiles" (a CpuFlashKernel cut in tiny tiles) | "reference"
    }
    case.update(over)
    return case


def _leaf(x: torch.Tensor, view: str, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, what the call gets): ``x`` (B, s, H, D) as a leaf and a view of it as asked."""
    if view == "plain":
        leaf = x.clone().requires_grad_(needs_grad)
        return leaf, leaf
    if view == "transposed":  # a (B, H, s, D) leaf, the call gets its transpose
        leaf = x.transpose(1, 2).contiguous().requires_grad_(needs_grad)
        return leaf, leaf.transpose(1, 2)
    assert view == "strided"  # every other element of a wider head dim
    wide = torch.stack([x, torch.full_like(x, 7.0)], dim=-1).flatten(-2)  # (B, s, H, 2D)
    leaf = wide.requires_grad_(needs_grad)
    return leaf, leaf[..., ::2]


def _grad_of(leaf: torch.Tensor, view: str) -> torch.Tensor | None:
    """The leaf's grad seen as (B, s, H, D); None if it has none."""
    g = leaf.grad
    if g is None:
        return None
    if view == "transposed":
        return g.transpose(1, 2)
    if view == "strided":
        return g[..., ::2]
    return g


def run_case(case: dict[str, Any]) -> list[str]:
    """One configuration on this rank: its failures (empty: it matched the oracle)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[case["dtype"]]
    hq, hkv = case["heads"]
    chunks = world * (2 if case["layout"] == "zigzag" else 1)
    seq_len = case["seq_len"] or 4 * world
    even = case["seq_len"] is None and case["docs"] is None and seq_len % chunks == 0
    seed = zlib.crc32(repr(sorted(case.items())).encode())
    q, k, v, dout = make_inputs(
        seed=seed, batch=case["batch"], seq_global=seq_len, heads_q=hq, heads_kv=hkv,
        head_dim=case["head_dim"],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    dlse = torch.randn(case["batch"], hq, seq_len, generator=gen, dtype=torch.float64)
    if case["dout"] == "zero_rows":  # every third query row gets no upstream gradient
        dout[:, ::3] = 0.0
    window = case["window"] or (-1, -1)
    mask = visible_mask(
        seq_len, causal=case["causal"], cu_seqlens=case["docs"], window=window,
        chunk=case["chunk"],
    )  # fmt: skip
    scale = case["head_dim"] ** -0.5
    pos = torch.tensor(
        sharded_positions(case["layout"], rank, world, seq_len, case["docs"]), dtype=torch.int64
    )
    needs = [name in case["grad"] for name in "qkv"]
    leaves, args = [], []
    for x, need, view in zip((q, k, v), needs, (case["view"],) * 3, strict=True):
        leaf, arg = _leaf(x[:, pos].to(dtype), view, need)
        leaves.append(leaf)
        args.append(arg)
    options = _options(case["strategy"], case["dtype"])
    kernel: Any = None
    if case["kernel"] == "tiles":
        kernel = CpuFlashKernel(tile_rows=2, masked_tile_rows=2)
    elif case["kernel"] == "reference":
        kernel = TiledKernel(tile_rows=2)
    out, lse = tokenring.sequence_parallel_attn(
        *args, causal=case["causal"], layout=case["layout"], return_lse=True,
        seq_len=None if even else seq_len, cu_seqlens=case["docs"], window_size=case["window"],
        attention_chunk_size=case["chunk"], kernel=kernel, **options,
    )  # fmt: skip
    dout_local = dout[:, pos].to(dtype)
    if case["dout"] == "strided":  # a view with strides of its own
        dout_local = torch.stack([dout_local, dout_local], dim=-1)[..., 0]
    if case["dout"] == "nonfinite_rows" and dout_local.shape[1]:
        dout_local = dout_local.clone()
        dout_local[:, 0, 0, 0] = float("inf")
    loss = (out * dout_local).sum() if case["dout"] != "none" else out.new_zeros(())
    if case["lse_loss"]:
        loss = loss + (lse * dlse[:, :, pos].to(lse.dtype)).sum()
    failures: list[str] = []
    runs = 2 if case["twice"] else 1
    for i in range(runs):
        loss.backward(retain_graph=i + 1 < runs)
    # the oracle: float64 autograd of the same loss over the whole sequence
    ref_leaves = [x.to(dtype).double().requires_grad_(True) for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_leaves, causal=case["causal"], scale=scale, mask=mask)
    ref_dout = dout.to(dtype).double()
    if case["dout"] == "nonfinite_rows":
        for r in range(world):  # every rank's first token, as each rank set its own
            firsts = sharded_positions(case["layout"], r, world, seq_len, case["docs"])[:1]
            ref_dout[:, firsts, 0, 0] = float("inf")
        return _nonfinite_failures(case, leaves, pos, ref_leaves, (ref_out * ref_dout).sum())
    ref_loss = (ref_out * ref_dout).sum() if case["dout"] != "none" else ref_out.new_zeros(())
    if case["lse_loss"]:
        seen = torch.isfinite(ref_lse)
        ref_loss = ref_loss + (ref_lse.where(seen, 0.0) * dlse.to(lse.dtype).double()).sum()
    grads = torch.autograd.grad(ref_loss, ref_leaves, allow_unused=True)  # v: lse alone
    got: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for name, leaf, need, g in zip(("dq", "dk", "dv"), leaves, needs, grads, strict=True):
        mine = _grad_of(leaf, case["view"])
        if not need:
            if mine is not None:
                failures.append(f"{name}: a grad for an input that does not require grad")
            continue
        if mine is None:
            failures.append(f"{name}: no grad")
            continue
        got[name] = mine / runs
        want[name] = torch.zeros_like(mine) if g is None else g[:, pos]
        if case["view"] == "strided" and bool((leaf.grad[..., 1::2] != 0).any()):
            failures.append(f"{name}: gradient in the elements the call never read")
    if not got or out.shape[1] == 0:
        return failures
    reference = oracle_with_grads(
        q, k, v, dout, causal=case["causal"], scale=scale, dtype=dtype, mask=mask
    )
    return failures + tolerance_failures(
        got, want, dtype=dtype, inputs=(q, k, v, dout), reference=reference,
        causal=case["causal"], scale=scale, mask=mask,
    )  # fmt: skip


def _nonfinite_failures(
    case: dict[str, Any],
    leaves: list[torch.Tensor],
    pos: torch.Tensor,
    ref_leaves: list[torch.Tensor],
    ref_loss: torch.Tensor,
) -> list[str]:
    """An upstream gradient with an inf in one row per rank (float64): dq of every other query
    row stays finite and within 1e-10 of float64 autograd, and that row's is not finite (a
    non-finite value leaking into other rows through a merge, a travelling block or a
    stand-in out, or vanishing, fails). dK and dV are not compared: there 0 * inf makes NaN
    for keys the row cannot see in any fused kernel (PyTorch's SDPA too), where autograd
    through a masked_fill gives 0."""
    (want,) = torch.autograd.grad(ref_loss, ref_leaves[:1])
    mine, want = _grad_of(leaves[0], case["view"]), want[:, pos]
    assert mine is not None
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(mine), finite):
        wrong = int((torch.isfinite(mine) != finite).sum())
        return [f"dq: {wrong} elements differ in being finite ({int((~finite).sum())} non-finite)"]
    if finite.any() and (mine[finite] - want[finite]).abs().max().item() > 1e-10:
        return ["dq: finite elements off by more than 1e-10"]
    return []


def run_cases(cases: list[dict[str, Any]]) -> list[list[str]]:
    """Each case's failures on this rank (the same list on every rank)."""
    return [[f"{_label(case)}: {f}" for f in run_case(case)] for case in cases]


def _label(case: dict[str, Any]) -> str:
    default = _case()
    return ", ".join(f"{k}={v}" for k, v in case.items() if default.get(k) != v or k == "strategy")


def _cases(name: str, *, lse: bool) -> list[dict[str, Any]]:
    """The audit's cases of strategy ``name``: how autograd reaches the operator, or (``lse``)
    losses that use lse (Note [Gradient of lse] in tokenring.runtime.op)."""
    if lse:
        return [
            _case(strategy=name, lse_loss=True),
            _case(strategy=name, lse_loss=True, dout="none"),  # lse alone: dout is None
            _case(strategy=name, lse_loss=True, dout="zero_rows", kernel="tiles"),
            _case(strategy=name, lse_loss=True, dtype="float32", kernel="tiles"),
            _case(strategy=name, lse_loss=True, dtype="bfloat16", heads=(4, 1)),
            _case(strategy=name, lse_loss=True, seq_len=11, docs=[0, 4, 11], grad="k"),
            _case(strategy=name, lse_loss=True, layout="contiguous", window=(2, 1), causal=False),
        ]
    return [
        _case(strategy=name, view="transposed", grad="qv"),
        _case(strategy=name, view="strided", dout="strided", layout="contiguous", causal=False),
        _case(strategy=name, grad="k", heads=(6, 2), twice=True),
        _case(strategy=name, dout="zero_rows", kernel="tiles", dtype="bfloat16"),
        _case(strategy=name, kernel="tiles", dtype="float16", heads=(4, 1), grad="v"),
        _case(strategy=name, kernel="tiles", seq_len=11, docs=[0, 3, 11], window=(4, 0)),
        _case(strategy=name, kernel="reference", seq_len=11, window=(4, 0), chunk=5),
        _case(strategy=name, dout="nonfinite_rows", kernel="tiles", layout="contiguous"),
    ]


def _rotated(*, lse: bool, per_strategy: int, offset: int = 0) -> list[dict[str, Any]]:
    """``per_strategy`` cases of every strategy, the kinds taken in turn, so that the
    strategies together cover every kind of :func:`_cases` (kept short: one launch each)."""
    picked = []
    for i, name in enumerate(STRATEGIES):
        kinds = _cases(name, lse=lse)
        picked += [kinds[(per_strategy * i + j + offset) % len(kinds)] for j in range(per_strategy)]
    return picked


def _assert_clean(per_rank: list[list[list[str]]]) -> None:
    bad = [f"rank {rank}: {f}" for rank, cases in enumerate(per_rank) for c in cases for f in c]
    assert not bad, f"{len(bad)} failures:\n" + "\n".join(bad[:40])


def test_gradients_on_one_rank(single_rank_group: None) -> None:
    """World size 1 in the pytest process: every strategy on its own block."""
    cases = _rotated(lse=False, per_strategy=1, offset=3) + _rotated(lse=True, per_strategy=1)
    _assert_clean([run_cases(cases)])


def test_gradients_on_three_ranks() -> None:
    """Two cases of each kind on 3 ranks (odd: no power-of-two shortcut), one launch."""
    cases = _rotated(lse=False, per_strategy=2) + _rotated(lse=True, per_strategy=2)
    _assert_clean(tokenring.launch(run_cases, cases, world_size=3, timeout_s=300))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_on_two_and_four_ranks(world_size: int) -> None:
    """A case per strategy (other kinds than on 3 ranks), one launch."""
    cases = _rotated(lse=False, per_strategy=1, offset=world_size)
    cases += _rotated(lse=True, per_strategy=1, offset=world_size)
    _assert_clean(tokenring.launch(run_cases, cases, world_size=world_size, timeout_s=300))


def lse_used_on_rank_zero_only(strategy: str) -> tuple[str, float]:
    """A backward whose loss uses lse on rank 0 only: (the error, its seconds)."""
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = tokenring.sequence_parallel_attn(
        q, k, v, causal=True, strategy=strategy, return_lse=True
    )
    loss = out.sum() + (lse.sum() if dist.get_rank() == 0 else 0)
    start = time.perf_counter()
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error), time.perf_counter() - start
    return "", time.perf_counter() - start


@pytest.mark.parametrize("strategy", ["token_ring", "ring"])
def test_lse_used_on_one_rank_fails_fast_on_every_rank(strategy: str) -> None:
    """Only the ranks whose loss uses lse widen their backward (Note [Gradient of lse]): the
    ranks then move messages of other sizes, which every rank's header check refuses at once
    (no rank waits out the timeout)."""
    per_rank = tokenring.launch(lse_used_on_rank_zero_only, strategy, world_size=2, timeout_s=60)
    for rank, (error, seconds) in enumerate(per_rank):
        assert error, f"rank {rank} ran a backward the other rank widened"
        assert seconds < 10, f"rank {rank} failed after {seconds:.1f} s: {error}"
