"""Test oracle: full attention in float64 on one process, and index code for the layouts.

Written independently of ``tokenring.layout`` and ``tokenring.schedule`` on purpose: the
positions of each rank are spelled out from the layout's definition, not imported.

Legend: B batch, S global seq, s local seq, H heads, D head dim, P world size.
"""

from __future__ import annotations

import torch

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def owned_positions(layout: str, rank: int, world_size: int, seq_global: int) -> list[int]:
    """Global positions of rank's shard, in local order, straight from the definitions."""
    if layout == "contiguous":
        s = seq_global // world_size
        return list(range(rank * s, rank * s + s))
    assert layout == "zigzag"
    c = seq_global // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return list(range(rank * c, rank * c + c)) + list(range(late * c, late * c + c))


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention over the whole sequence.

    Args:
        q: ``(B, S, Hq, D)``; k, v: ``(B, S, Hkv, D)``.

    Returns:
        out ``(B, S, Hq, D)`` and lse ``(B, Hq, S)``, float64.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.double().permute(0, 2, 1, 3)
    kh = k.double().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    vh = v.double().permute(0, 2, 1, 3).repeat_interleave(groups, dim=1)
    scores = qh @ kh.transpose(-1, -2) * scale  # (B, Hq, S, S)
    if causal:
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
) -> dict[str, torch.Tensor]:
    """Out, lse and dq, dk, dv of full attention; inputs rounded to ``dtype`` first, math in
    float64 (so the oracle sees exactly the values the ranks see)."""
    leaves = [x.detach().to(dtype).double().clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = full_attention(*leaves, causal=causal, scale=scale)
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
        qh, kh, vh, is_causal=causal, scale=scale
    )
    out = out.transpose(1, 2)
    out.backward(dout.to(dtype))
    got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return {name: (got[name].double() - reference[name]).abs().max().item() for name in got}


# -- traffic -------------------------------------------------------------------------------
# Expected bytes per directed pair, derived from the layouts' positions and the strategies'
# definitions (Q or K/V travel "down": rank r -> r-1; partials go straight to their owner),
# not from tokenring.schedule.


def _needed_q_rows(
    layout: str, causal: bool, p: int, s: int, q_owner: int, kv_owner: int
) -> set[int]:
    """Local rows of q_owner's Q that see at least one key of kv_owner."""
    seq = s * p
    qpos = owned_positions(layout, q_owner, p, seq)
    kpos = owned_positions(layout, kv_owner, p, seq)
    if not causal:
        return set(range(s))
    return {i for i, pos in enumerate(qpos) if min(kpos) <= pos}


def _needed_kv_rows(
    layout: str, causal: bool, p: int, s: int, q_owner: int, kv_owner: int
) -> set[int]:
    """Local rows of kv_owner's K/V seen by at least one query of q_owner."""
    seq = s * p
    qpos = owned_positions(layout, q_owner, p, seq)
    kpos = owned_positions(layout, kv_owner, p, seq)
    if not causal:
        return set(range(s))
    return {j for j, pos in enumerate(kpos) if pos <= max(qpos)}


def expected_bytes(
    *,
    strategy: str,
    backward: bool,
    layout: str,
    causal: bool,
    world_size: int,
    seq_local: int,
    batch: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    elem_bytes: int,
    acc_bytes: int,
) -> dict[tuple[str, int, int], int]:
    """Bytes per ``(flow, src, dst)`` of one pass.

    A travelling block of ``owner`` visits ranks owner-1, owner-2, ... (mod P); the hop into a
    rank carries the rows still needed there or further along the route. A row counts once
    (a set), so sending a covering range wider than the union shows up as a difference.
    """
    p, s = world_size, seq_local
    q_row = batch * heads_q * head_dim * elem_bytes
    kv_row = 2 * batch * heads_kv * head_dim * elem_bytes
    per_head = batch * heads_q * acc_bytes
    total: dict[tuple[str, int, int], int] = {}

    def add(flow: str, src: int, dst: int, num: int) -> None:
        if num:
            total[(flow, src, dst)] = total.get((flow, src, dst), 0) + num

    if strategy == "bidir_ring":
        # Two rings on disjoint halves: kv heads [0, H/2) go down and [H/2, H) go up; with a
        # single kv head, rows [0, s/2) go down and [s/2, s) go up.
        if heads_kv >= 2:
            half = heads_kv // 2
            lanes = [(-1, half, set(range(s))), (+1, heads_kv - half, set(range(s)))]
        else:
            lanes = [(-1, 1, set(range(s // 2))), (+1, 1, set(range(s // 2, s)))]
    else:
        lanes = [(-1, heads_kv, set(range(s)))]
    for owner in range(p):
        for direction, lane_heads, lane_rows in lanes:
            lane_kv_row = kv_row * lane_heads // heads_kv
            route = [(owner + direction * h) % p for h in range(p)]  # route[0]: the owner
            for h in range(1, p):
                ahead = route[h:]
                if strategy == "token_ring":
                    rows = set().union(
                        *(_needed_q_rows(layout, causal, p, s, owner, r) for r in ahead)
                    )
                    row_bytes = (2 * q_row + 2 * per_head) if backward else q_row
                else:
                    rows = set().union(
                        *(
                            _needed_kv_rows(layout, causal, p, s, r, owner) & lane_rows
                            for r in ahead
                        )
                    )
                    row_bytes = lane_kv_row
                add("travel", route[h - 1], route[h], len(rows) * row_bytes)
            if strategy != "token_ring" and backward:
                # The fp32 dK/dV accumulator is created by the first rank the block visits and
                # follows it; the last visitor sends it home: P-1 hops of the lane's rows.
                dkv_row = 2 * batch * lane_heads * head_dim * acc_bytes
                for h in range(1, p):
                    add("return", route[h], route[(h + 1) % p], len(lane_rows) * dkv_row)
        if strategy == "token_ring":
            for r in range(p):
                if r != owner:
                    rows = _needed_q_rows(layout, causal, p, s, owner, r)
                    add("return", r, owner, len(rows) * (q_row if backward else q_row + per_head))
    return total


def covered_pairs(
    layout: str, causal: bool, world_size: int, seq_local: int
) -> list[tuple[int, int]]:
    """Every (query position, key position) pair full attention must compute."""
    seq = world_size * seq_local
    return [(i, j) for i in range(seq) for j in range(seq) if not causal or j <= i]


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
) -> float:
    """Max abs lse error of one block-kernel call over the whole sequence in ``dtype`` on one
    process: the yardstick for lse (SDPA does not return it). The CPU flash kernel's lse of
    bf16/fp16 inputs is off by a few 1e-5 once a block has more than a handful of keys, so
    float32 ``assert_close`` defaults only hold for small blocks."""
    from tokenring.kernels import select_kernel

    kernel = select_kernel(q.device, dtype)
    _, lse = kernel.forward(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, scale=scale)
    return (lse.double() - want_lse).abs().max().item()


def tolerance_failures(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    reference: dict[str, torch.Tensor],
    causal: bool,
    scale: float,
) -> list[str]:
    """Check out, lse and dq, dk, dv of one rank against the float64 oracle.

    float64: within 1e-10. float32: ``assert_close`` defaults. bf16/fp16: within twice the
    error of plain single-process attention in that dtype plus one rounding step at the
    tensor's magnitude (lse: twice one kernel call's lse error plus one float32 rounding).

    Args:
        got / want: this rank's tensors and the oracle's rows, by name.
        inputs: the global (q, k, v, dout) in float64; reference: ``oracle_with_grads`` of them.
    """
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    errors = {name: (got[name].double() - want[name]).abs().max().item() for name in got}
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
        q, k, v, dout, reference, causal=causal, scale=scale, dtype=dtype
    )
    plain["lse"] = plain_lse_error(
        q, k, v, reference["lse"], causal=causal, scale=scale, dtype=dtype
    )
    for name in got:
        eps = torch.finfo(torch.float32 if name == "lse" else dtype).eps
        bound = 2 * plain[name] + eps * want[name].abs().max().item()
        if errors[name] > bound:
            failures.append(
                f"{name}: {errors[name]:.3g} > bound {bound:.3g} (plain {plain[name]:.3g})"
            )
    return failures
