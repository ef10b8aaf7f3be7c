"""Any length, packed documents, sliding windows and chunked attention on real gloo ranks,
against the oracle.

One launch per world size runs every (strategy, dtypes) entry of that size; the grid (length,
documents, window, chunk, layout, causal, heads, dtype) is looped inside the ranks. Every rank
checks its tokens' out, lse and dq, dk, dv against float64 full attention under
``oracle.visible_mask``, and its counted bytes per link against ``oracle.expected_bytes`` (ring
strategies): blocks no window or document reaches are neither computed nor sent. Ulysses and
all-gather K/V run the same cases under explicit masks. Shards come from
``oracle.sharded_positions``, not from tokenring.core.layout.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    expected_bytes,
    make_inputs,
    oracle_with_grads,
    sharded_positions,
    tolerance_failures,
    visible_mask,
)
from tokenring.core.masks import normalize_window

CASES = [  # (seq_len, cu_seqlens, window (left, right), attention_chunk_size); right is
    # ignored when causal. Chunks of 4 from each document's start cut the documents and the
    # zigzag pieces (the sharding follows the documents only).
    (1, None, (-1, -1), None),
    (7, None, (-1, -1), None),
    (29, [0, 3, 11, 11, 29], (-1, -1), None),
    (26, None, (3, 2), None),
    (31, [0, 14, 31], (4, 6), None),
    (30, [0, 13, 30], (2, 1), 4),
]
HEADS = [(4, 4), (4, 1)]


Case = tuple[int, list[int] | None, tuple[int, int], int | None]


@functools.cache
def _reference(
    key: tuple[int, tuple[int, ...] | None, tuple[int, int], int | None],
    layout: str,
    causal: bool,
    heads: tuple[int, int],
    dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, dict[str, torch.Tensor]]:
    """The seeded global inputs, the mask and the oracle of one case (``key``: the case with
    its documents as a tuple): the strategies of a launch share them (the S = 1001 oracle is
    most of that case's time), and nobody writes to them."""
    seq_len, docs, (left, right), chunk = key
    cu_seqlens = None if docs is None else list(docs)
    case = (seq_len, cu_seqlens, (left, right), chunk)  # the seed hashes the case as listed
    window = (left, 0 if causal else right)
    hq, hkv = heads
    inputs = make_inputs(
        seed=zlib.crc32(repr((case, layout, causal, heads)).encode()),
        batch=2,
        seq_global=seq_len,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=8,
    )
    mask = visible_mask(seq_len, causal=causal, cu_seqlens=cu_seqlens, window=window, chunk=chunk)
    ref = oracle_with_grads(*inputs, causal=causal, scale=8**-0.5, dtype=dtype, mask=mask)
    return inputs, mask, ref


def _check(
    strategy: str,
    case: Case,
    layout: str,
    causal: bool,
    heads: tuple[int, int],
    dtype: torch.dtype,
) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len, cu_seqlens, (left, right), chunk = case
    window = (left, 0 if causal else right)
    hq, hkv = heads
    key = (seq_len, None if cu_seqlens is None else tuple(cu_seqlens), (left, right), chunk)
    (q, k, v, dout), mask, ref = _reference(key, layout, causal, heads, dtype)
    scale = 8**-0.5
    idx = torch.tensor(
        sharded_positions(layout, rank, world, seq_len, cu_seqlens), dtype=torch.long
    )
    local = [x[:, idx].to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
    comm = tokenring.get_communicator()
    comm.counter.reset()
    strategy, _, lend = strategy.partition("+")  # "token_ring+lend": last_pair="lend"
    out, lse = tokenring.sequence_parallel_attn(
        *local,
        strategy=strategy,
        last_pair="lend" if lend else None,
        causal=causal,
        layout=layout,
        return_lse=True,
        seq_len=seq_len,
        cu_seqlens=cu_seqlens,
        window_size=window,
        attention_chunk_size=chunk,
    )
    counted = [dict(comm.counter.sent_bytes)]
    comm.counter.reset()
    out.backward(dout[:, idx].to(dtype))
    counted.append(dict(comm.counter.sent_bytes))
    got = {"out": out.detach(), "lse": lse, "dq": local[0].grad, "dk": local[1].grad}
    got["dv"] = local[2].grad
    want = {
        "out": ref["out"][:, idx],
        "lse": ref["lse"][:, :, idx],
        "dq": ref["dq"][:, idx],
        "dk": ref["dk"][:, idx],
        "dv": ref["dv"][:, idx],
    }
    failures = tolerance_failures(
        got,
        want,
        dtype=dtype,
        inputs=(q, k, v, dout),
        reference=ref,
        causal=causal,
        scale=scale,
        mask=mask,
    )
    if strategy in ("ulysses", "allgather_kv"):
        return [f"{(case, layout, causal, heads, dtype)}: {f}" for f in failures]
    for backward, sent in zip((False, True), counted, strict=True):
        formula = expected_bytes(
            strategy=strategy,
            lend=bool(lend),
            backward=backward,
            layout=layout,
            causal=causal,
            world_size=world,
            seq_len=seq_len,
            cu_seqlens=cu_seqlens,
            window=window,
            chunk=chunk,
            batch=2,
            heads_q=hq,
            heads_kv=hkv,
            head_dim=8,
            elem_bytes=torch.empty((), dtype=dtype).element_size(),
            acc_bytes=8 if dtype == torch.float64 else 4,
        )
        mine = {(flow, dst): n for (flow, src, dst), n in formula.items() if src == rank}
        sent_by_peer = {(flow, peer): n for (flow, peer), n in sent.items() if n}
        if sent_by_peer != mine:
            failures.append(f"{'bwd' if backward else 'fwd'} bytes {sent_by_peer} != {mine}")
    return [f"{(case, layout, causal, heads, dtype)}: {f}" for f in failures]


def run_grid(strategy: str, dtypes: list[str], full: bool) -> list[str]:
    """The grid on this rank; ``full``: every layout x causal x heads, else the two pairings
    that matter (zigzag causal, contiguous non-causal) with GQA."""
    failures = []
    ran = set()
    for case, layout, causal, heads, dtype_name in itertools.product(
        CASES, ("contiguous", "zigzag"), (False, True), HEADS, dtypes
    ):
        if not full and ((layout == "zigzag") != causal or heads != HEADS[-1]):
            continue
        if full and dtype_name != "float64" and heads != HEADS[0]:
            continue  # low precision on the full grid: MHA only (the short grid's is GQA)
        dtype = getattr(torch, dtype_name)
        if case[0] == 1 and dtype_name in ("bfloat16", "float16"):
            # One token: dq and dk are exactly 0 (softmax over one key), so the rule's bound
            # is 0, while any flash-style backward computes delta = rowsum(dout * out) from
            # out rounded to the dtype and is off by that rounding (flash-attn too). Covered
            # in float64/float32.
            continue
        failures += _check(strategy, case, layout, causal, heads, dtype)
        ran.add(dtype_name)
    failures += [f"{strategy}: no case ran in {d}" for d in dtypes if d not in ran]
    return failures


# (strategy, world size, dtypes, full grid): each ring strategy on the full grid at P = 4 and
# on the two pairings that matter at a second size; the collectives on the short grid.
ENTRIES = [
    ("token_ring", 4, ["float64", "bfloat16"], True),
    ("ring", 4, ["float64", "float32"], True),
    ("bidir_ring", 4, ["float64", "float16"], True),
    ("token_ring", 3, ["float64"], False),
    ("token_ring+lend", 3, ["float64"], False),
    ("ring", 2, ["float64"], False),
    ("bidir_ring", 3, ["float64"], False),
    ("bidir_token_ring", 4, ["float64", "float32"], True),
    ("bidir_token_ring", 3, ["float64"], False),
    ("ulysses", 4, ["float64", "bfloat16"], False),
    ("allgather_kv", 3, ["float64", "float32"], False),
]
LONG_ODD_STRATEGIES = [
    "token_ring",
    "ring",
    "bidir_ring",
    "bidir_token_ring",
    "ulysses",
    "allgather_kv",
]
LONG_ODD_WORLD_SIZE = 4


def run_long_odd(strategies: list[str]) -> list[str]:
    """S = 1001 (no layout divides it) with every strategy, float32, forward and backward."""
    failures = []
    for strategy, (layout, causal) in itertools.product(
        strategies, (("zigzag", True), ("contiguous", False))
    ):
        case = (1001, None, (-1, -1), None)
        failures += _check(strategy, case, layout, causal, (2, 1), torch.float32)
    return failures


def run_world(
    entries: list[tuple[str, list[str], bool]], long_odd: list[str]
) -> dict[str, list[str]]:
    """Every entry of this world size, then the long odd length for ``long_odd``."""
    found = {}
    for strategy, dtypes, full in entries:
        found[f"{strategy} {dtypes}"] = run_grid(strategy, dtypes, full)
    found["long odd"] = run_long_odd(long_odd)
    return found


@functools.cache
def _per_rank(world_size: int) -> tuple[dict[str, list[str]], ...]:
    """One launch per world size, shared by the tests that read it."""
    entries = [(st, dtypes, full) for st, p, dtypes, full in ENTRIES if p == world_size]
    long_odd = LONG_ODD_STRATEGIES if world_size == LONG_ODD_WORLD_SIZE else []
    return tuple(
        tokenring.launch(run_world, entries, long_odd, world_size=world_size, timeout_s=600)
    )


@pytest.mark.parametrize("world_size", sorted({p for _, p, _, _ in ENTRIES}))
def test_documents_windows_any_length(world_size: int) -> None:
    failures = [
        f"rank {r} {name}: {f}"
        for r, found in enumerate(_per_rank(world_size))
        for name, fs in found.items()
        if name != "long odd"
        for f in fs
    ]
    assert not failures, "\n".join(failures[:20])


def test_odd_length_1001_every_strategy() -> None:
    per_rank = _per_rank(LONG_ODD_WORLD_SIZE)
    failures = [f"rank {r}: {f}" for r, found in enumerate(per_rank) for f in found["long odd"]]
    assert not failures, "\n".join(failures[:20])


def test_window_size_takes_integers_only() -> None:
    """A float window is not rounded (2.9 used to run as 2); ints of any kind pass."""
    assert normalize_window(None, causal=False) == (-1, -1)
    assert normalize_window(3, causal=True) == (3, 0)
    assert normalize_window((torch.tensor(2), 1), causal=False) == (2, 1)
    assert normalize_window(torch.tensor([4, -1]), causal=False) == (4, -1)
    for bad in ((2.9, 0), 2.5, (2,), (True, 1), "ab", (-2, 0)):
        with pytest.raises(ValueError, match="window_size must be"):
            normalize_window(bad, causal=False)  # type: ignore[arg-type]
