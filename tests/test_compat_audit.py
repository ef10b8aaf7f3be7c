"""Audit of ``tokenring.compat`` against the originals' documented semantics, beyond the grid
of tests/test_compat.py: arguments that differ on one rank must make every rank raise at once
(never a hang, never a silent difference)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import (
    make_inputs,
    oracle_with_grads,
    sharded_positions,
    tolerance_failures,
    visible_mask,
)
from tokenring import compat


def _outcome(call: Callable[[], Any]) -> tuple[str, str, float]:
    """(exception type or "ok", message, seconds) of ``call()``."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def llama3_causal_differs_on_one_rank() -> tuple[str, str, float]:
    """Every rank prepares its values with causal=True; the last rank calls with causal=False.
    The first document runs past rank 0's last token, so the prepared values the last rank
    checks against (causal=False) differ from what the others check against."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (torch.randn(4, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 6, 4 * world], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = compat.llama3_flash_attn_prepare_cu_seqlens(
        cu, True, rank, world
    )
    causal = rank != world - 1
    return _outcome(
        lambda: compat.llama3_flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal
        )
    )


def test_llama3_causal_that_differs_on_one_rank_raises_on_every_rank() -> None:
    per_rank = tokenring.launch(
        llama3_causal_differs_on_one_rank, world_size=3, timeout_s=120, pg_timeout_s=20
    )
    for rank, (kind, message, seconds) in enumerate(per_rank):
        assert kind == "ValueError", (rank, kind, message)
        assert "causal: rank 0 has True, rank 2 has False" in message, (rank, message)
        assert seconds < 10, (rank, seconds)


def _padded(s: int = 4) -> list[torch.Tensor]:
    return [torch.randn(1, s, h, 8, dtype=torch.float64) for h in (4, 2, 2)]


@pytest.mark.parametrize(
    "call",
    [
        lambda: compat.flash_attn_func(*_padded(), strategy="auto"),
        lambda: compat.ring_flash_attn_func(*_padded(), strategy="auto"),
        lambda: compat.zigzag_ring_flash_attn_func(*_padded(), strategy="auto"),
        lambda: compat.flash_attn_varlen_func(
            *(x[0] for x in _padded()), [0, 4], [0, 4], 4, 4, strategy="auto"
        ),
        lambda: compat.llama3_flash_attn_varlen_func(
            *(x[0] for x in _padded()), [0, 4], [0, 4], 4, 4, 1, slice(0, 4), strategy="auto"
        ),
    ],
)
def test_strategy_auto_is_refused_naming_what_the_shims_lack(
    single_rank_group: None, call: Callable[[], Any]
) -> None:
    """sequence_parallel_attn's "auto" needs hardware=, which no shim takes: the error must
    not send the user to an argument the function rejects with a TypeError."""
    with pytest.raises(ValueError, match="strategy='auto'") as info:
        call()
    assert "tokenring.sequence_parallel_attn" in str(info.value)
    assert "hardware=" in str(info.value)


def _call_shim(
    name: str, causal: bool, window: tuple[int, int], dtype: torch.dtype, heads_kv: int
) -> list[str]:
    """One shim call on this rank against the float64 oracle of its global inputs, by the
    tolerance rule of ../shared/STYLE.md (tests/oracle.py); the problems found."""
    rank, world = dist.get_rank(), dist.get_world_size()
    packed = "varlen" in name
    total = 6 * world
    bounds = [0, 5, total] if packed else [0, total]  # a document across rank 0's end
    layout = "zigzag" if name.startswith("zigzag") else "contiguous"
    q, k, v, dout = make_inputs(
        seed=total, batch=1, seq_global=total, heads_q=4, heads_kv=heads_kv, head_dim=8
    )
    mask = visible_mask(total, causal=causal, cu_seqlens=bounds, window=window)
    ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=0.3, mask=mask, dtype=dtype)
    idx = torch.tensor(sharded_positions(layout, rank, world, total, bounds))
    leaves = [x[:, idx].to(dtype).requires_grad_(True) for x in (q, k, v)]
    args: tuple[Any, ...] = ()
    if name == "llama3_flash_attn_varlen_func":
        cu = torch.tensor(bounds, dtype=torch.int32)
        prepared = compat.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        args = (*prepared[:4], heads_kv, prepared[4])  # heads_k_stride: all heads at once
    elif packed:
        cu = torch.tensor(bounds, dtype=torch.int32)
        args = (cu, cu, total, total)
    inputs = [x[0] for x in leaves] if packed else leaves
    out, lse, _ = getattr(compat, name)(
        *inputs, *args, softmax_scale=0.3, causal=causal, window_size=window,
        return_attn_probs=True,
    )  # fmt: skip
    out.backward(dout[:, idx].to(dtype)[0] if packed else dout[:, idx].to(dtype))
    got = {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad}
    got |= {"dv": leaves[2].grad}
    if packed:  # back to (B, s, H, D) and (B, H, s), as the oracle's rows
        got["out"], got["lse"] = got["out"].unsqueeze(0), got["lse"].unsqueeze(0)
    want = {n: ref[n][:, idx] for n in ("out", "dq", "dk", "dv")} | {"lse": ref["lse"][:, :, idx]}
    return tolerance_failures(
        got, want, dtype=dtype, inputs=(q, k, v, dout), reference=ref, causal=causal,
        scale=0.3, mask=mask,
    )  # fmt: skip


SHIMS = [
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "llama3_flash_attn_varlen_func",
]
# what test_compat.py's grid leaves out: causal with a window, MQA, and the half dtypes
AUDIT = [
    *((name, True, (2, 1), torch.float64, 1) for name in SHIMS),
    *((name, causal, (-1, -1), dtype, 1) for name in SHIMS for causal in (False, True)
      for dtype in (torch.float16, torch.bfloat16, torch.float32)),
]  # fmt: skip


def audit_grid() -> list[str]:
    failures = []
    for name, causal, window, dtype, heads_kv in AUDIT:
        what = f"{name} causal={causal} window={window} {dtype} heads_kv={heads_kv}"
        failures += [f"{what}: {f}" for f in _call_shim(name, causal, window, dtype, heads_kv)]
    return failures


def test_shims_match_the_oracle_in_every_dtype_with_mqa_and_causal_windows() -> None:
    per_rank = tokenring.launch(audit_grid, world_size=2, timeout_s=240)
    failures = [f"rank {r}: {f}" for r, fails in enumerate(per_rank) for f in fails]
    assert not failures, "\n".join(failures)
