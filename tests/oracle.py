"""Test oracle: full attention in float64 on one process, and index code for the layouts.

Written independently of ``tokenring.core.layout`` and ``tokenring.core.schedule`` on purpose: the
positions of each rank are spelled out from the layout's definition, not imported.

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def owned_positions(layout: str, rank: int, world_size: int, seq_global: int) -> list[int]:
    """Global positions of rank's shard, in local order (equal shards: the layout's chunk
    count divides ``seq_global``)."""
    assert seq_global % (world_size * (2 if layout == "zigzag" else 1)) == 0
    return sharded_positions(layout, rank, world_size, seq_global)


def sharded_positions(
    layout: str, rank: int, world_size: int, seq_len: int, cu_seqlens: list[int] | None = None
) -> list[int]:
    """Global positions of rank's tokens for any length and packed documents, from the
    definitions: near-equal pieces with the longer ones first; contiguous: P pieces of the
    whole sequence; zigzag: 2P pieces of every document, rank r taking piece r and piece
    2P-1-r of each, all early pieces (document order) before all late ones."""

    def pieces(start: int, length: int, count: int) -> list[list[int]]:
        out, at = [], start
        for i in range(count):
            n = length // count + (1 if i < length % count else 0)
            out.append(list(range(at, at + n)))
            at += n
        return out

    if layout == "contiguous":
        return pieces(0, seq_len, world_size)[rank]
    assert layout == "zigzag"
    # plain ints: a tensor's 0-d elements would be advanced in place by pieces' ``at += n``
    bounds = [int(x) for x in cu_seqlens] if cu_seqlens is not None else [0, seq_len]
    early: list[int] = []
    late: list[int] = []
    for a, b in itertools.pairwise(bounds):
        doc = pieces(a, b - a, 2 * world_size)
        early += doc[rank]
        late += doc[2 * world_size - 1 - rank]
    return early + late


def visible_mask(
    seq_len: int,
    *,
    causal: bool,
    cu_seqlens: list[int] | None = None,
    window: tuple[int, int] = (-1, -1),
    chunk: int | None = None,
) -> torch.Tensor:
    """(S, S) bool, True where query i may see key j: same document, j <= i when causal,
    i - left <= j <= i + right for a window (-1: unbounded), flash-attention's convention,
    and with ``chunk`` the same chunk: (position - its document's start) // chunk."""
    i = torch.arange(seq_len).view(-1, 1)
    j = torch.arange(seq_len).view(1, -1)
    doc = torch.zeros(seq_len, dtype=torch.int64)
    doc_start = torch.zeros(seq_len, dtype=torch.int64)
    for boundary in (cu_seqlens or [0, seq_len])[1:-1]:
        doc[boundary:] += 1
        doc_start[boundary:] = boundary
    ok = doc.view(-1, 1) == doc.view(1, -1)
    if chunk is not None:
        chunk_of = (torch.arange(seq_len) - doc_start) // chunk
        ok &= chunk_of.view(-1, 1) == chunk_of.view(1, -1)
    if causal:
        ok &= j <= i
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention over the whole sequence.

    Args:
        q: ``(B, S, Hq, D)``; k, v: ``(B, S, Hkv, D)``.
        mask: optional ``(S, S)`` bool from :func:`visible_mask` (replaces ``causal``).

    Returns:
        out ``(B, S, Hq, D)`` and lse ``(B, Hq, S)``, float64.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.double().permute(0, 2, 1, 3)
    kh = k.double().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    vh = v.double().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale  # (B, Hq, S, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:
        n = scores.shape[-1]
        i = torch.arange(n).view(-1, 1)
        j = torch.arange(n).view(1, -1)
        scores = scores.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vh
    return out.permute(0, 2, 1, 3), lse


def make_inputs(
    *, seed: int, batch: int, seq_global: int, heads_q: int, heads_kv: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded global q, k, v and an upstream gradient, float64, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_global, heads_q, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seq_global, heads_kv, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seq_global, heads_kv, head_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, seq_global, heads_q, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def oracle_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dtype: torch.dtype = torch.float64,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Out, lse and dq, dk, dv of full attention; inputs rounded to ``dtype`` first, math in
    float64 (so the oracle sees exactly the values the ranks see)."""
    leaves = [x.detach().to(dtype).double().clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = full_attention(*leaves, causal=causal, scale=scale, mask=mask)
    out.backward(dout.to(dtype).double())
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
    }


def same_dtype_attention_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    reference: dict[str, torch.Tensor],
    *,
    causal: bool,
    scale: float,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """Max abs error against the fp64 oracle of plain single-process attention in ``dtype``
    (PyTorch SDPA, math on the CPU), for out and each gradient: the yardstick of the
    tolerance rule for bf16/fp16."""
    groups = q.shape[2] // k.shape[2]
    leaves = [x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
    qh = leaves[0].transpose(1, 2)
    kh = leaves[1].transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = leaves[2].transpose(1, 2).repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal and mask is None, scale=scale
    )
    out = out.transpose(1, 2)
    out.backward(dout.to(dtype))
    got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return {name: (got[name].double() - reference[name]).abs().max().item() for name in got}


# -- traffic -------------------------------------------------------------------------------
# Expected bytes per directed pair, derived from the layouts' positions and the strategies'
# definitions (Q or K/V travel "down": rank r -> r-1; partials go straight to their owner),
# not from tokenring.core.schedule.


def padded_rows(
    layout: str, rank: int, world_size: int, seq_len: int, cu_seqlens: list[int] | None = None
) -> tuple[list[int], int]:
    """Row of rank's padded buffer for each of its tokens (in ``sharded_positions`` order),
    and the buffer size, from the definitions: contiguous pieces fill rows from 0 in a buffer
    of ceil(S / P) rows; zigzag reserves ceil(L / 2P) rows per document of length L, early
    pieces from row 0 and late pieces from the middle, documents in order."""
    p = world_size
    if layout == "contiguous":
        n = len(sharded_positions(layout, rank, p, seq_len, cu_seqlens))
        return list(range(n)), max(1, -(-seq_len // p))
    bounds = cu_seqlens if cu_seqlens is not None else [0, seq_len]
    lengths = [b - a for a, b in itertools.pairwise(bounds) if b > a]
    widths = [-(-n // (2 * p)) for n in lengths]
    half = sum(widths)
    early, late = [], []
    for d, n in enumerate(lengths):
        offset = sum(widths[:d])
        count = [n // (2 * p) + (1 if i < n % (2 * p) else 0) for i in range(2 * p)]
        early += [offset + i for i in range(count[rank])]
        late += [half + offset + i for i in range(count[2 * p - 1 - rank])]
    return early + late, max(2 * half, 2)


def _needed_rows(
    visible: torch.Tensor, rows: dict[int, list[int]], pos: dict[int, list[int]], a: int, b: int
) -> set[int]:
    """Rows of rank a's tokens that see (a as queries) or are seen by (a as keys, pass the
    transposed mask) at least one token of rank b."""
    if not pos[a] or not pos[b]:
        return set()
    seen = visible[pos[a]][:, pos[b]].any(dim=1).tolist()
    return {rows[a][i] for i, sees in enumerate(seen) if sees}


def _cover(rows: set[int]) -> int:
    """Rows in the single range covering ``rows`` (what one message sends)."""
    return max(rows) - min(rows) + 1 if rows else 0


def expected_bytes(
    *,
    strategy: str,
    backward: bool,
    layout: str,
    causal: bool,
    world_size: int,
    seq_local: int | None = None,
    batch: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    elem_bytes: int,
    acc_bytes: int,
    seq_len: int | None = None,
    cu_seqlens: list[int] | None = None,
    window: tuple[int, int] = (-1, -1),
    chunk: int | None = None,
    lend: bool = False,
) -> dict[tuple[str, int, int], int]:
    """Bytes per ``(flow, src, dst)`` of one pass (``lend``: TokenRing lends its last pairs
    where they pay, Note [Borrowed last pair]).

    A travelling block of ``owner`` visits ranks owner-1, owner-2, ... (mod P) (Ring on the
    contiguous causal layout: owner+1, owner+2, ...); the hop into a
    rank carries the range of rows covering those still needed there or further along the
    route (rows of the padded buffer, ``padded_rows``). Partials go straight to their owner,
    covering the rows that saw something. Pass-KV's dK/dV accumulator of a block leaves its
    owner, follows the block to the last visitor that computes with it, which sends it
    straight home.
    """
    p = world_size
    seq = seq_len if seq_len is not None else p * (seq_local or 0)
    visible = visible_mask(seq, causal=causal, cu_seqlens=cu_seqlens, window=window, chunk=chunk)
    pos = {r: sharded_positions(layout, r, p, seq, cu_seqlens) for r in range(p)}
    rows = {}
    for r in range(p):
        rows[r], s = padded_rows(layout, r, p, seq, cu_seqlens)
    q_row = batch * heads_q * head_dim * elem_bytes
    kv_row = 2 * batch * heads_kv * head_dim * elem_bytes
    per_head = batch * heads_q * acc_bytes
    total: dict[tuple[str, int, int], int] = {}

    def add(flow: str, src: int, dst: int, num: int) -> None:
        if num:
            total[(flow, src, dst)] = total.get((flow, src, dst), 0) + num

    # each pair is asked for many times (once per hop that passes it): computed once
    @functools.cache
    def q_needed(owner: int, r: int) -> frozenset[int]:
        return frozenset(_needed_rows(visible, rows, pos, owner, r))

    @functools.cache
    def kv_needed(q_owner: int, owner: int) -> frozenset[int]:
        return frozenset(_needed_rows(visible.T, rows, pos, owner, q_owner))

    if strategy == "bidir_token_ring":
        # Two rings on the query heads: those of kv heads [0, Hkv/2) go down, the rest up;
        # with a single kv head, query heads [0, Hq/2) down and the rest up. Each partial
        # goes straight home, carrying its lane's heads.
        groups = heads_q // heads_kv
        down = (heads_kv // 2) * groups if heads_kv >= 2 else heads_q // 2
        for owner in range(p):
            for direction, lane_heads in ((-1, down), (+1, heads_q - down)):
                route = [(owner + direction * h) % p for h in range(p)]
                travel_row = (2 * q_row + 2 * per_head) if backward else q_row
                for h in range(1, p):
                    need = set().union(*(q_needed(owner, r) for r in route[h:]))
                    add(
                        "travel",
                        route[h - 1],
                        route[h],
                        _cover(need) * travel_row * lane_heads // heads_q,
                    )
                    ret_row = q_row if backward else q_row + per_head
                    ret = _cover(q_needed(owner, route[h])) * ret_row * lane_heads // heads_q
                    add("return", route[h], owner, ret)
        return total
    if strategy == "bidir_ring":
        # Two rings on disjoint halves: kv heads [0, H/2) go down and [H/2, H) go up; with a
        # single kv head, rows [0, s/2) go down and [s/2, s) go up (one ring when s = 1).
        if heads_kv >= 2:
            half = heads_kv // 2
            lanes = [(-1, half, set(range(s))), (+1, heads_kv - half, set(range(s)))]
        elif s >= 2:
            lanes = [(-1, 1, set(range(s // 2))), (+1, 1, set(range(s // 2, s)))]
        else:
            lanes = [(-1, 1, set(range(s)))]
    elif strategy == "ring" and causal and layout == "contiguous":
        lanes = [(+1, heads_kv, set(range(s)))]  # only higher ranks see a shard's keys
    else:
        lanes = [(-1, heads_kv, set(range(s)))]
    lent = _lent_pairs(p, backward, heads_q, heads_kv, q_needed, kv_needed) if lend else set()
    for owner in range(p):
        for direction, lane_heads, lane_rows in lanes:
            lane_kv_row = kv_row * lane_heads // heads_kv
            route = [(owner + direction * h) % p for h in range(p)]  # route[0]: the owner
            for h in range(1, p):
                ahead = route[h:]
                if strategy == "token_ring":
                    kept = [r for r in ahead if r not in lent or (r - 1) % p != owner]
                    need = set().union(*(q_needed(owner, r) for r in kept))
                    row_bytes = (2 * q_row + 2 * per_head) if backward else q_row
                else:
                    need = set().union(*(kv_needed(r, owner) & lane_rows for r in ahead))
                    row_bytes = lane_kv_row
                add("travel", route[h - 1], route[h], _cover(need) * row_bytes)
            if strategy != "token_ring" and backward:
                dkv_row = 2 * batch * lane_heads * head_dim * acc_bytes
                lane_bytes = _cover(lane_rows) * dkv_row
                # the accumulator leaves the owner with its own dK/dV, is passed along the
                # route up to the last visitor that needs the block, and goes home from there
                computing = [h for h in range(1, p) if kv_needed(route[h], owner) & lane_rows]
                if computing:
                    last = computing[-1]
                    for h in range(last):
                        add("return", route[h], route[h + 1], lane_bytes)
                    add("return", route[last], owner, lane_bytes)
        if strategy == "token_ring":
            for r in range(p):
                if r in lent and owner == (r - 1) % p:  # its K/V rows come here instead
                    kv_rows = _cover(kv_needed(owner, r))
                    add("travel", r, owner, kv_rows * kv_row)
                    if backward:  # and their dK/dV go home in the accumulation dtype
                        add("return", owner, r, kv_rows * kv_row * acc_bytes // elem_bytes)
                elif r != owner:
                    need = q_needed(owner, r)
                    add(
                        "return", r, owner, _cover(need) * (q_row if backward else q_row + per_head)
                    )
    return total


def _lent_pairs(
    p: int,
    backward: bool,
    heads_q: int,
    heads_kv: int,
    q_needed: Callable[[int, int], frozenset[int]],
    kv_needed: Callable[[int, int], frozenset[int]],
) -> set[int]:
    """TokenRing: the ranks r whose last pair (the Q of owner r - 1 against r's K/V) is
    computed by the owner on r's K/V rows, sent to it in parts (one a step, steps 0 .. u-1;
    u = P - 1 forward, 1 backward): when those rows cost no more than the Q rows and the
    partial they save, and each part fits beside the link's own Q hop of that step under the
    step's busiest hop (in elements of D per row: Q Hq, Q and dout 2 Hq, K and V 2 Hkv)."""
    if p < (3 if backward else 2):
        return set()
    travel_heads = 2 * heads_q if backward else heads_q
    steps = 1 if backward else p - 1
    load: dict[tuple[int, int, int], int] = {}  # (src, dst, step): the Q hop's elements
    for owner in range(p):
        route = [(owner - h) % p for h in range(p)]
        for h in range(1, p):
            need = set().union(*(q_needed(owner, r) for r in route[h:]))
            load[(route[h - 1], route[h], h - 1)] = _cover(need) * travel_heads
    busiest = [max(n for (_, _, t), n in load.items() if t == u) for u in range(p - 1)]
    lent = set()
    for r in range(p):
        owner = (r - 1) % p
        q_rows, kv_rows = _cover(q_needed(owner, r)), _cover(kv_needed(owner, r))
        if not q_rows:
            continue
        part = 2 * heads_kv * kv_rows / steps
        fits = all(load[(r, owner, u)] + part <= busiest[u] for u in range(steps))
        if 2 * heads_kv * kv_rows <= (travel_heads + heads_q) * q_rows and fits:
            lent.add(r)
    return lent


def schedule_bytes_per_link(sched: Any, dims: Any) -> dict[tuple[str, int, int], int]:
    """What a schedule sends, per (flow, src, dst): the tally that ``expected_bytes`` is
    compared with (not an oracle itself: it reads the schedule under test)."""
    got: dict[tuple[str, int, int], int] = {}
    for tr in sched.transfers:
        key = (tr.payload.flow.value, tr.src, tr.dst)
        got[key] = got.get(key, 0) + tr.num_bytes(dims)
    return got


def covered_pairs(
    layout: str, causal: bool, world_size: int, seq_local: int
) -> list[tuple[int, int]]:
    """Every (query position, key position) pair full attention must compute."""
    seq = world_size * seq_local
    return [(i, j) for i in range(seq) for j in range(seq) if not causal or j <= i]


def multiset_mismatch(computed: list[Any], want: list[Any], *, show: int = 3) -> str:
    """What ``computed`` lacks and what it holds beyond ``want`` (a duplicate counts as
    beyond), as counts with a few examples; "" when the two are equal as multisets."""
    have, need = collections.Counter(computed), collections.Counter(want)
    missing, extra = sorted((need - have).elements()), sorted((have - need).elements())
    if not missing and not extra:
        return ""
    return (
        f"{len(missing)} missing (e.g. {missing[:show]}), "
        f"{len(extra)} extra or repeated (e.g. {extra[:show]})"
    )


# -- the tolerance rule (../shared/STYLE.md) --------------------------------------------------


def plain_lse_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    want_lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> float:
    """Max abs lse error of one block-kernel call over the whole sequence in ``dtype`` on one
    process: the yardstick for lse (SDPA does not return it). The CPU flash kernel's lse of
    bf16/fp16 inputs is off by a few 1e-5 once a block has more than a handful of keys, so
    float32 ``assert_close`` defaults only hold for small blocks."""
    from tokenring.runtime.kernels import select_kernel

    kernel = select_kernel(q.device, dtype)
    _, lse = kernel.forward(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        causal=causal and mask is None,
        scale=scale,
        mask=mask,
    )
    return (lse.double() - want_lse).abs().max().item()


def _max_abs(x: torch.Tensor) -> float:
    """Largest magnitude in ``x``; 0 for an empty tensor (a rank may hold no token)."""
    return x.abs().max().item() if x.numel() else 0.0


def tolerance_failures(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    reference: dict[str, torch.Tensor],
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> list[str]:
    """Check out, lse and dq, dk, dv of one rank against the float64 oracle.

    float64: within 1e-10. float32: ``assert_close`` defaults. bf16/fp16: within twice the
    error of plain single-process attention in that dtype plus one rounding step at the
    tensor's magnitude (lse: twice one kernel call's lse error plus one float32 rounding).

    Args:
        got / want: this rank's tensors and the oracle's rows, by name.
        inputs: the global (q, k, v, dout) in float64; reference: ``oracle_with_grads`` of them.
        mask: the (S, S) ``visible_mask`` the reference was computed with, if any.
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    errors = {name: _max_abs(got[name].double() - want[name]) for name in got}
    failures = [
        f"{name} has dtype {got[name].dtype}"
        for name in got
        if got[name].dtype != (acc if name == "lse" else dtype)
    ]
    if dtype == torch.float64:
        return failures + [f"{n}: {e:.3g} > 1e-10" for n, e in errors.items() if e > 1e-10]
    if dtype == torch.float32:
        for name in got:
            try:
                torch.testing.assert_close(got[name], want[name].to(got[name].dtype))
            except AssertionError as exc:
                failures.append(f"{name}: {str(exc).splitlines()[0]} (max {errors[name]:.3g})")
        return failures
    q, k, v, dout = inputs
    plain = same_dtype_attention_error(
        q, k, v, dout, reference, causal=causal, scale=scale, dtype=dtype, mask=mask
    )
    plain["lse"] = plain_lse_error(
        q, k, v, reference["lse"], causal=causal, scale=scale, dtype=dtype, mask=mask
    )
    for name in got:
        eps = torch.finfo(torch.float32 if name == "lse" else dtype).eps
        bound = 2 * plain[name] + eps * _max_abs(want[name])
        if errors[name] > bound:
            failures.append(
                f"{name}: {errors[name]:.3g} > bound {bound:.3g} (plain {plain[name]:.3g})"
            )
    return failures


def error_of(call: Any) -> str:
    """What ``call()`` raised, as ``"Type: message"`` (the type is part of what tests check),
    or ``"no error"``."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
