"""Audit of the attention operator under torch.compile: options that change between calls of
one compiled function, and a rank whose compiled call cannot run (Note [Values a graph cannot
keep] in tokenring.api).

One rank in-process: a value baked into the graph's raw record (a tensor or NumPy
softmax_scale, a window of tensors) used to be kept from the first call (softmax_scale
torch.tensor(0.7) then 0.1: the answer of 0.7, off by 0.73); it now raises naming the argument,
and the values a graph may keep (floats, ints, an int window traced as dynamic) still match the
float64 oracle on every call. Two ranks: a rank whose compiled call is refused (cu_seqlens as a
tensor) used to raise while tracing, alone, and its peer waited in the rank check until the
communicator's timeout; both now raise at once.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, visible_mask

SEQ = 8


def _qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, SEQ, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3)]


def _oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: Any = (-1, -1)
) -> torch.Tensor:
    mask = visible_mask(SEQ, causal=False, window=window)
    return full_attention(q, k, v, causal=False, scale=scale, mask=mask)[0]


def _compile(fn: Any) -> Any:
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


def _scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Any) -> torch.Tensor:
    return tokenring.ring_attn(q, k, v, softmax_scale=scale)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Any) -> torch.Tensor:
    return tokenring.ring_attn(q, k, v, window_size=window)


@pytest.mark.parametrize(
    "scale",
    [
        lambda x: torch.tensor(x, dtype=torch.float64),
        np.float64,
    ],
    ids=["tensor", "numpy"],
)
def test_a_scale_the_graph_would_keep_raises(single_rank_group: None, scale: Any) -> None:
    q, k, v = _qkv()
    compiled = _compile(_scaled)
    for value in (0.7, 0.1):  # the second call used to get the first one's answer
        with pytest.raises(NotImplementedError, match=r"softmax_scale as a tensor under torch"):
            compiled(q, k, v, scale(value))
    assert torch.equal(_scaled(q, k, v, scale(0.1)), _scaled(q, k, v, 0.1))  # eager: fine


def test_a_window_of_tensors_raises(single_rank_group: None) -> None:
    q, k, v = _qkv()
    compiled = _compile(_windowed)
    for window in ((torch.tensor(2), torch.tensor(2)), (np.int64(3), np.int64(1))):
        with pytest.raises(NotImplementedError, match=r"window_size as a tensor under torch"):
            compiled(q, k, v, window)


def test_values_the_graph_may_keep_follow_every_call(single_rank_group: None) -> None:
    q, k, v = _qkv()
    compiled = _compile(_scaled)
    for value in (0.5, 0.25, 0.125):
        got = compiled(q, k, v, value)
        assert (got - _oracle(q, k, v, scale=value)).abs().max().item() < 1e-12, value
    compiled = _compile(_windowed)
    # an int traced as dynamic from the second call on (it used to fail to compile)
    for window in (2, 3, (3, 1), 5):
        sides = (window, window) if isinstance(window, int) else window
        want = _oracle(q, k, v, scale=0.5, window=sides)
        assert (compiled(q, k, v, window) - want).abs().max().item() < 1e-12, window


# -- two ranks ---------------------------------------------------------------------------------


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Any) -> torch.Tensor:
    return tokenring.ring_attn(q, k, v, cu_seqlens=docs)


def refused_on_one_rank() -> list[str]:
    """Rank 1's compiled call passes cu_seqlens as a tensor, rank 0's as a list: what each
    raised and how long it took."""
    rank = dist.get_rank()
    tokenring.get_communicator(timeout_s=60)
    q, k, v = (x[:, 4 * rank : 4 * rank + 4] for x in _qkv())  # views: this rank's shard
    compiled = _compile(_packed)
    docs = [0, 3, SEQ]
    start = time.monotonic()
    try:
        compiled(q, k, v, docs if rank == 0 else torch.tensor(docs))
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}", f"{time.monotonic() - start:.1f}"]
    return ["no error", f"{time.monotonic() - start:.1f}"]


def test_a_rank_whose_compiled_call_is_refused_fails_every_rank_at_once() -> None:
    per_rank = tokenring.launch(refused_on_one_rank, world_size=2, timeout_s=120)
    for rank, (error, seconds) in enumerate(per_rank):
        assert "cu_seqlens as a tensor under torch.compile" in error, (rank, error)
        assert float(seconds) < 30, (rank, seconds)  # the timeout is 60 s
    assert per_rank[0][0].startswith("ValueError: rank 1 cannot run this attention call")
    assert per_rank[1][0].startswith("NotImplementedError")
