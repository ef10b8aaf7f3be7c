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
