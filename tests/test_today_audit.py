"""Audit of the replicated-value sketch (tokenring.core.sketch, runtime.comm, diffusers).

- Non-finite values: the same NaN or inf on every rank agrees (a single process returns NaN
  as attention does); a NaN on one rank alone, at another place or of another kind differs.
  Before, every NaN or inf made the K sums NaN and every rank raised "ranks disagree" for
  text that was the same everywhere.
- float64 values near the largest (1e300) overflowed the float64 sums to inf or NaN: the same
  text raised "ranks disagree".
- ``torch.compile`` of a function that sketches (joint_attn, cross_attn): dynamo traced the
  signs' 65536-step Python loop for minutes (a compiled joint_attn on 2 ranks did not finish
  in 300 s); it runs eagerly now.
- A NaN query row seeing fewer than 16 keys per block (PyTorch's fused CPU op returns out 0
  and lse 0 there): the rings returned 0 for it where attention returns NaN.

One 2-rank launch; float64 against attention over the whole sequence in one process.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F

import tokenring
from tokenring import diffusers as tr_diffusers
from tokenring.core.sketch import replicated_rtol, sketch

T, IMAGE, HEADS, D = 3, 4, 2, 8  # text rows, image rows per rank
NAN_STRATEGIES = ("token_ring", "ring", "bidir_ring", "allgather_kv", "ulysses")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, n, H, D) attention over every key, in q's dtype."""
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    return out.transpose(1, 2)


def _inputs(world_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (2, T + P * IMAGE, H, D) float64 q, k, v: text rows first."""
    gen = torch.Generator().manual_seed(3)
    shape = (2, T + world_size * IMAGE, HEADS, D)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    return q, k, v


def _local(x: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's joint rows: all the text, then its image shard."""
    return torch.cat([x[:, :T], x[:, T + rank * IMAGE : T + (rank + 1) * IMAGE]], dim=1)


def _nan_image(q: torch.Tensor) -> torch.Tensor:
    """q with a NaN in rank 0's second image row (batch 0, head 0)."""
    out = q.clone()
    out[0, T + 1, 0, 0] = float("nan")
    return out


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except ValueError as exc:
        return f"ValueError: {exc}"


def _ranks() -> dict[str, Any]:
    comm = tokenring.get_communicator()
    rank = comm.rank
    q, k, v = _inputs(comm.world_size)
    nan_q = q.clone()
    nan_q[0, 0, 0, 0] = float("nan")  # a text query: its own output row alone is NaN
    huge_v = v.clone()
    huge_v[:, :T] *= 1e300  # text values near float64's largest; the outputs stay finite

    def joint(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        local = (_local(x, rank) for x in (a, b, c))
        return tr_diffusers.joint_attn(*local, num_text=T, text="replicated", group=comm)

    inf_k = k[:, :5].clone()
    inf_k[1, 2, 1, 3] = float("inf")
    kv_q = _local(q, rank)
    result: dict[str, Any] = {
        "nan alike": _outcome(lambda: joint(nan_q, k, v)),
        "huge alike": _outcome(lambda: joint(q, k, huge_v)),
        "nan one rank": _outcome(lambda: joint(nan_q if rank == 1 else q, k, v)),
        "cross inf alike": _outcome(
            lambda: tr_diffusers.cross_attn(kv_q, inf_k, v[:, :5], kv="replicated", group=comm)
        ),
    }
    for strategy in NAN_STRATEGIES:  # blocks of 4 keys: the CPU op's NaN rows (kernels.py)
        local = (x[:, T + rank * IMAGE : T + (rank + 1) * IMAGE] for x in (_nan_image(q), k, v))
        result[f"nan {strategy}"] = _outcome(
            lambda local=tuple(local), strategy=strategy: tokenring.sequence_parallel_attn(
                *local, strategy=strategy, layout="contiguous", group=comm
            )
        )
    start = time.monotonic()
    # aot_eager: the defect was dynamo tracing the sketch's loop, which any backend shows;
    # inductor's C++ build of the little around the eager calls was most of this test's time
    compiled = torch.compile(joint, backend="aot_eager")
    result["compiled"] = _outcome(lambda: compiled(q, k, v))
    result["compile s"] = time.monotonic() - start
    result["eager"] = joint(q, k, v)
    return result


def test_non_finite_and_huge_replicated_values_on_two_ranks() -> None:
    per_rank = tokenring.launch(_ranks, world_size=2, timeout_s=240)
    q, k, v = _inputs(2)
    for rank, got in enumerate(per_rank):
        nan_q = q.clone()
        nan_q[0, 0, 0, 0] = float("nan")
        want = _local(_attention(nan_q, k, v), rank)
        assert isinstance(got["nan alike"], torch.Tensor), got["nan alike"]
        assert want[0, 0, 0].isnan().all()  # the NaN query's own row and head, as attention
        torch.testing.assert_close(got["nan alike"], want, rtol=0, atol=1e-10, equal_nan=True)
        image = slice(T, T + 2 * IMAGE)
        want = _attention(*(x[:, image] for x in (_nan_image(q), k, v)))
        want = want[:, rank * IMAGE : (rank + 1) * IMAGE]
        assert want[0, 1, 0].isnan().all() == (rank == 0)
        for strategy in NAN_STRATEGIES:  # the ring strategies returned 0 for the NaN row
            found = got[f"nan {strategy}"]
            assert isinstance(found, torch.Tensor), (strategy, found)
            torch.testing.assert_close(found, want, rtol=0, atol=1e-10, equal_nan=True)
        huge_v = v.clone()
        huge_v[:, :T] *= 1e300
        assert isinstance(got["huge alike"], torch.Tensor), got["huge alike"]
        want = _local(_attention(q, k, huge_v), rank)
        torch.testing.assert_close(got["huge alike"], want, rtol=1e-10, atol=1e-10)
        assert "rank 1 differs from rank 0 in its NaN or inf" in str(got["nan one rank"])
        assert isinstance(got["cross inf alike"], torch.Tensor), got["cross inf alike"]
        assert isinstance(got["compiled"], torch.Tensor), got["compiled"]
        torch.testing.assert_close(got["compiled"], got["eager"], rtol=0, atol=1e-12)
        assert got["compile s"] < 60, got["compile s"]  # was past 300 s


def test_sketch_of_non_finite_and_huge_values() -> None:
    """Note [Non-finite values in a sketch]: exact on NaN/inf places and kinds; float64
    values near the largest keep finite sums and the tolerance."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 3, 16, generator=gen, dtype=torch.float64)
    rtol = replicated_rtol(x.dtype)

    def with_value(index: tuple[int, ...], value: float) -> torch.Tensor:
        y = x.clone()
        y[index] = value
        return y

    nan = sketch(with_value((0, 1, 2, 3), math.nan), rtol=rtol)
    assert nan.distance(sketch(with_value((0, 1, 2, 3), math.nan), rtol=rtol)) == 0
    assert all(math.isfinite(s) for s in nan.values)
    for other in (
        x,  # no NaN
        with_value((0, 1, 2, 4), math.nan),  # another place
        with_value((0, 1, 2, 3), math.inf),  # another kind
        with_value((0, 1, 2, 3), -math.inf),
    ):
        assert nan.distance(sketch(other, rtol=rtol)) == math.inf
    inf = sketch(with_value((1, 0, 0, 0), math.inf), rtol=rtol)
    assert inf.distance(sketch(with_value((1, 0, 0, 0), -math.inf), rtol=rtol)) == math.inf
    # the finite values still count beside a NaN
    assert nan.distance(sketch(with_value((0, 1, 2, 3), math.nan) * 2, rtol=rtol)) > 0.1
    huge = x * 1e300
    base = sketch(huge, rtol=rtol)
    assert all(math.isfinite(s) for s in base.values)
    assert base.distance(sketch(huge.clone(), rtol=rtol)) == 0
    ulp = torch.nextafter(huge, torch.tensor(math.inf, dtype=torch.float64))
    assert 0 < base.distance(sketch(ulp, rtol=rtol)) <= rtol
    assert base.distance(sketch(huge.flip(1), rtol=rtol)) > 0.1
    # bool and integer values sketch as numbers
    assert sketch(x > 0, rtol=0).distance(sketch((x > 0).double(), rtol=0)) == 0
