"""The drop-in shims of ``tokenring.compat`` on real gloo ranks, against the float64 oracle.

The shims must keep the originals' parameters (checked against their signatures, transcribed
below from ring-flash-attention and flash-attn 2) and compute what the originals define: each
rank's rows of attention over the global sequence. One launch per world size; inside the
ranks every shim call is made as the original's users write it, compared bitwise with the
same call through ``tokenring.sequence_parallel_attn`` and, for out, lse and the gradients of
q, k, v, with full attention in float64 from the same seeded global tensors (within 1e-10).
``llama3_flash_attn_prepare_cu_seqlens`` is checked against its definition, written here
without the searches of the original.
"""

from __future__ import annotations

import inspect
import itertools
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import make_inputs, oracle_with_grads, sharded_positions, visible_mask
from tokenring import compat

FP64 = 1e-10
HQ, HKV, D = 4, 2, 8  # GQA: every shim must pass K/V heads through unrepeated

# The originals' parameters, in order, with defaults (ring-flash-attention at
# zhuzilin/ring-flash-attention ring_flash_attn/{ring,zigzag_ring}_flash_attn.py and
# llama3_flash_attn_varlen.py; flash-attn 2 at flash_attn/flash_attn_interface.py).
REQUIRED = inspect.Parameter.empty
RING = [
    ("q", REQUIRED),
    ("k", REQUIRED),
    ("v", REQUIRED),
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
    ("group", None),
]
ORIGINALS: dict[str, list[tuple[str, Any]]] = {
    "ring_flash_attn_func": RING,
    "zigzag_ring_flash_attn_func": RING,
    "llama3_flash_attn_varlen_func": [
        *RING[:3],
        *((name, REQUIRED) for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q")),
        *((name, REQUIRED) for name in ("max_seqlen_k", "heads_k_stride", "local_k_slice")),
        *RING[3:],
    ],
    "llama3_flash_attn_prepare_cu_seqlens": [
        ("cu_seqlens", REQUIRED),
        ("causal", REQUIRED),
        ("rank", REQUIRED),
        ("world_size", REQUIRED),
    ],
    "flash_attn_func": [
        *RING[:7],
        ("softcap", 0.0),
        *RING[7:10],
    ],
    "flash_attn_varlen_func": [
        *RING[:3],
        *((name, REQUIRED) for name in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q")),
        ("max_seqlen_k", REQUIRED),
        *RING[3:7],
        ("softcap", 0.0),
        *RING[7:10],
        ("block_table", None),
    ],
}


@pytest.mark.parametrize("name", sorted(ORIGINALS))
def test_signature_is_the_originals_plus_keyword_only_extras(name: str) -> None:
    params = list(inspect.signature(getattr(compat, name)).parameters.values())
    original = ORIGINALS[name]
    got = [(p.name, p.default) for p in params[: len(original)]]
    assert got == original
    kinds = {p.kind for p in params[: len(original)]}
    assert kinds == {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    extras = params[len(original) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), extras
    assert all(p.default is not REQUIRED for p in extras), extras


def _prepare_by_definition(
    bounds: list[int], causal: bool, rank: int, world_size: int
) -> tuple[list[int], list[int], int, int, tuple[int, int]]:
    """What the original's docstring-level definition says, with sets instead of searches:
    the documents that meet rank's tokens [lo, hi), cut to them for q; for k from the start of
    the first to hi (causal) or to the end of the last document."""
    total = bounds[-1]
    length = total // world_size
    lo, hi = rank * length, (rank + 1) * length
    inner = sorted({b for b in bounds if lo < b < hi})
    k_start = max(b for b in bounds if b <= lo)
    k_stop = hi if causal else min(b for b in bounds if b >= hi)
    cu_q = [0, *(b - lo for b in inner), length]
    cu_k = [0, *(b - k_start for b in inner), k_stop - k_start]
    longest_q = max(b - a for a, b in itertools.pairwise(cu_q))
    longest_k = max(b - a for a, b in itertools.pairwise(cu_k))
    return cu_q, cu_k, longest_q, longest_k, (k_start, k_stop)


def test_prepare_cu_seqlens_matches_its_definition() -> None:
    rng = random.Random(0)
    cases = [([0, 8, 8, 16], 2), ([0, 3, 4, 12], 4), ([0, 12], 3)]  # empty doc; tiny ranks
    for _ in range(200):
        world_size = rng.randint(1, 5)
        total = world_size * rng.randint(1, 7)
        inner = rng.sample(range(total + 1), rng.randint(0, min(total, 6)))
        inner += [world_size and (total // world_size)] * rng.randint(0, 1)  # at a rank edge
        cases.append(([0, *sorted(inner), total], world_size))
    for bounds, world_size in cases:
        cu = torch.tensor(bounds, dtype=torch.int32)
        for rank, causal in itertools.product(range(world_size), (False, True)):
            cu_q, cu_k, max_q, max_k, k_slice = compat.llama3_flash_attn_prepare_cu_seqlens(
                cu, causal, rank, world_size
            )
            want_q, want_k, want_max_q, want_max_k, want_slice = _prepare_by_definition(
                bounds, causal, rank, world_size
            )
            where = f"bounds={bounds} P={world_size} rank={rank} causal={causal}"
            assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, where
            # the original keeps empty documents (repeated boundaries); the definition has none
            assert sorted(set(cu_q.tolist())) == want_q, where
            assert sorted(set(cu_k.tolist())) == want_k, where
            assert (max_q, max_k) == (want_max_q, want_max_k), where
            assert type(max_q) is int and type(max_k) is int, where
            assert (k_slice.start, k_slice.stop) == want_slice, where


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.tensor([0, 5]), True, 0, 2), "positive multiple of world_size=2; got 5"),
        ((torch.tensor([0, 4]), True, 2, 2), r"rank must be an int in \[0, 2\); got 2"),
        ((torch.tensor([0, 3, 2, 4]), True, 0, 2), "cu_seqlens must be non-decreasing"),
        ((torch.tensor([0.0, 4.0]), True, 0, 2), "cu_seqlens must be a 1-D integer tensor"),
        (([0, 4], True, 0, 2), "cu_seqlens must be a 1-D integer tensor; got list"),
    ],
)
def test_prepare_cu_seqlens_rejects(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compat.llama3_flash_attn_prepare_cu_seqlens(*args)


def _qkv(b: int = 1, s: int = 4) -> list[torch.Tensor]:
    return [torch.randn(b, s, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV)]


def _packed(t: int = 4) -> list[torch.Tensor]:
    return [x[0] for x in _qkv(1, t)]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: compat.flash_attn_func(*_qkv(), 0.1), NotImplementedError, "dropout_p must be 0"),
        (lambda: compat.flash_attn_func(*_qkv(), dropout_p=1.5), ValueError, r"in \[0, 1\]"),
        (
            lambda: compat.ring_flash_attn_func(*_qkv(), alibi_slopes=torch.ones(HQ)),
            NotImplementedError,
            "alibi_slopes is not supported",
        ),
        (
            lambda: compat.flash_attn_func(*_qkv(), softcap=30.0),
            NotImplementedError,
            "softcap is not supported",
        ),
        (
            lambda: compat.zigzag_ring_flash_attn_func(*_qkv(), deterministic=1),
            ValueError,
            "deterministic must be a bool; got 1",
        ),
        (
            lambda: compat.zigzag_ring_flash_attn_func(*_qkv(s=5), causal=True),
            ValueError,
            "must be even for layout 'zigzag'",
        ),
        (
            lambda: compat.flash_attn_varlen_func(*_packed(), [0, 4], [0, 4], 4, 4, block_table=1),
            NotImplementedError,
            "block_table",
        ),
        (
            lambda: compat.flash_attn_varlen_func(*_packed(), [0, 4], [0, 2, 4], 4, 4),
            NotImplementedError,
            "cu_seqlens_k must equal cu_seqlens_q",
        ),
        (
            lambda: compat.flash_attn_varlen_func(*_packed(), [0, 1, 4], [0, 1, 4], 2, 3),
            ValueError,
            r"max_seqlen_q must be an int >= the longest document \(3\); got 2",
        ),
        (
            lambda: compat.flash_attn_varlen_func(*_packed(5), [0, 4], [0, 4], 4, 4),
            ValueError,
            r"q.shape\[0\] must be 4 on rank 0",
        ),
        (
            lambda: compat.flash_attn_varlen_func(*_qkv(), [0, 4], [0, 4], 4, 4),
            ValueError,
            r"q must be a packed \(tokens, heads, head_dim\) tensor",
        ),
        (
            lambda: compat.llama3_flash_attn_varlen_func(
                *_packed(), [0, 4], [0, 4], 4, 4, 3, slice(0, 4)
            ),
            ValueError,
            "heads_k_stride must divide heads_kv=2; got 3",
        ),
        (
            lambda: compat.llama3_flash_attn_varlen_func(
                *_packed(), [0, 3], [0, 3], 4, 4, 1, slice(0, 4)
            ),
            ValueError,
            r"cu_seqlens_q must run from 0 to q.shape\[0\]=4",
        ),
        (
            lambda: compat.llama3_flash_attn_varlen_func(
                *_packed(), [0, 1, 4], [0, 2, 4], 3, 3, 1, slice(0, 4)
            ),
            ValueError,
            r"rank 0 passed cu_seqlens_q \[0, 1, 4\] \(expected \[0, 2, 4\]\)",
        ),
    ],
)
def test_bad_calls_raise_naming_the_argument(
    single_rank_group: None, call: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


# -- on launched ranks ---------------------------------------------------------------------------


class _Checker:
    """Compares one call's local results with the oracle's rows; collects failures."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.num_checked = 0

    def close(self, what: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.num_checked += 1
        if got.shape != want.shape:
            self.failures.append(f"{what}: {name} shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        err = (got.double() - want).abs().max().item() if got.numel() else 0.0
        if not err <= FP64:
            self.failures.append(f"{what}: {name} max error {err:.3g} > {FP64}")

    def same(self, what: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.num_checked += 1
        if not torch.equal(got, want):
            self.failures.append(f"{what}: {name} differs from sequence_parallel_attn")


def _run(
    fn: Any, local: list[torch.Tensor], dout: torch.Tensor, args: tuple[Any, ...], kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    leaves = [x.clone().requires_grad_(True) for x in local]
    result = fn(*leaves, *args, **kwargs)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is None, type(result)
    out, lse, _ = result
    out.backward(dout)
    return out.detach(), lse, [x.grad for x in leaves]


def _padded_cases(check: _Checker, rank: int, world: int) -> None:
    """(B, s, H, D) shims: each called as its original's users call it."""
    calls = [
        # name, layout, extra keywords, the strategy it runs, positional style
        ("ring_flash_attn_func", "contiguous", {}, "ring", False),
        ("zigzag_ring_flash_attn_func", "zigzag", {}, "ring", True),
        ("zigzag_ring_flash_attn_func", "zigzag", {"strategy": "token_ring"}, "token_ring", False),
        ("flash_attn_func", "contiguous", {}, "token_ring", True),
        ("flash_attn_func", "zigzag", {"layout": "zigzag"}, "token_ring", False),
    ]
    masks = [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))]  # window: both sides
    grid = ((call, causal, window) for call in calls for causal, window in masks)
    for seed, ((name, layout, extra, strategy, positional), causal, window) in enumerate(grid):
        seq = 6 * world
        q, k, v, dout = make_inputs(
            seed=seed, batch=2, seq_global=seq, heads_q=HQ, heads_kv=HKV, head_dim=D
        )
        scale = 0.3
        mask = visible_mask(seq, causal=causal, window=window)
        ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=scale, mask=mask)
        idx = torch.tensor(sharded_positions(layout, rank, world, seq))
        local = [x[:, idx] for x in (q, k, v)]
        fn = getattr(compat, name)
        if positional and name == "flash_attn_func":  # dropout_p .. return_attn_probs
            args: tuple[Any, ...] = (0.0, scale, causal, window, 0.0, None, False, True)
            kwargs: dict[str, Any] = extra
        elif positional:  # dropout_p .. group
            args = (0.0, scale, causal, window, None, True, True, None)
            kwargs = extra
        else:
            args = ()
            kwargs = {
                "softmax_scale": scale,
                "causal": causal,
                "window_size": window,
                "return_attn_probs": True,
                **extra,
            }
        what = f"{name}{extra} causal={causal} window={window}"
        out, lse, grads = _run(fn, local, dout[:, idx], args, kwargs)
        check.close(what, "out", out, ref["out"][:, idx])
        check.close(what, "lse (B, Hq, s)", lse, ref["lse"][:, :, idx])
        for g, name_g in zip(grads, ("dq", "dk", "dv"), strict=True):
            check.close(what, name_g, g, ref[name_g][:, idx])

        options = {"strategy": strategy, "causal": causal, "softmax_scale": scale}
        options |= {"layout": layout, "window_size": window}
        out2, lse2, grads2 = _run(_direct, local, dout[:, idx], (), options)
        for name_t, a, b in zip(
            ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out2, lse2, *grads2), strict=True
        ):
            check.same(what, name_t, a, b)


def _direct(*qkv: torch.Tensor, **options: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The same call through tokenring's own signature, returned as the shims return it."""
    out, lse = tokenring.sequence_parallel_attn(*qkv, return_lse=True, **options)
    return out, lse, None


def _llama3_bounds(world: int, length: int) -> list[int]:
    """Documents that cross rank edges, one that starts exactly at rank 1's first token, and
    an empty one."""
    total = world * length
    inner = {3, length, length + 4, 2 * length + 5, total - 2}
    return [0, 3, *sorted(b for b in inner if 3 <= b < total), total]


def _varlen_cases(check: _Checker, rank: int, world: int) -> None:
    """Packed (tokens, H, D) shims on packed documents."""
    for name, layout, causal in itertools.product(
        ("flash_attn_varlen_func", "llama3_flash_attn_varlen_func"),
        ("contiguous", "zigzag"),
        (False, True),
    ):
        if name.startswith("llama3"):
            if layout == "zigzag":
                continue
            length = 7
            total = world * length
            bounds = _llama3_bounds(world, length)
        else:
            total = 7 * world + 3  # uneven shards: any length works here
            bounds = [0, 5, 5 + (total - 5) // 3, total]
        q, k, v, dout = make_inputs(
            seed=total + causal, batch=1, seq_global=total, heads_q=HQ, heads_kv=HKV, head_dim=D
        )
        mask = visible_mask(total, causal=causal, cu_seqlens=sorted(set(bounds)))
        ref = oracle_with_grads(q, k, v, dout, causal=causal, scale=D**-0.5, mask=mask)
        idx = torch.tensor(sharded_positions(layout, rank, world, total, sorted(set(bounds))))
        local = [x[0, idx] for x in (q, k, v)]  # (t, H, D)
        cu = torch.tensor(bounds, dtype=torch.int32)
        longest = max(b - a for a, b in itertools.pairwise(bounds))
        what = f"{name} layout={layout} causal={causal} bounds={bounds}"
        if name.startswith("llama3"):
            cu_q, cu_k, max_q, max_k, k_slice = compat.llama3_flash_attn_prepare_cu_seqlens(
                cu, causal, rank, world
            )
            args: tuple[Any, ...] = (cu_q, cu_k, max_q, max_k, 1, k_slice)
            fn = compat.llama3_flash_attn_varlen_func
            strategies = ("allgather_kv", "token_ring")
        else:
            args = (cu, cu, longest, longest)
            fn = compat.flash_attn_varlen_func
            strategies = ("token_ring",)
        for strategy in strategies:
            kwargs: dict[str, Any] = {"causal": causal, "return_attn_probs": True}
            if name.startswith("flash"):
                kwargs["layout"] = layout
            if strategy != strategies[0]:
                kwargs["strategy"] = strategy
            out, lse, grads = _run(fn, local, dout[0, idx], args, kwargs)
            check.close(what + f" {strategy}", "out", out, ref["out"][0, idx])
            check.close(what + f" {strategy}", "lse (Hq, t)", lse, ref["lse"][0, :, idx])
            for g, name_g in zip(grads, ("dq", "dk", "dv"), strict=True):
                check.close(what + f" {strategy}", name_g, g, ref[name_g][0, idx])


def _expect_raise(check: _Checker, what: str, call: Any, error: type, pattern: str) -> None:
    start = time.monotonic()
    try:
        call()
    except Exception as exc:
        elapsed_s = time.monotonic() - start
        if type(exc) is not error or pattern not in str(exc):
            check.failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
        elif elapsed_s > 10:
            check.failures.append(f"{what}: took {elapsed_s:.1f} s to raise")
        return
    check.failures.append(f"{what}: did not raise")


def _error_cases(check: _Checker, rank: int, world: int) -> None:
    """One rank's bad argument fails on every rank at once, naming the rank."""
    q, k, v = _qkv(b=1, s=6)
    bad = world - 1
    dropout = 0.5 if rank == bad else 0.0
    _expect_raise(
        check,
        "dropout on one rank",
        lambda: compat.flash_attn_func(q, k, v, dropout_p=dropout),
        NotImplementedError if rank == bad else ValueError,
        "dropout_p must be 0" if rank == bad else f"rank {bad} cannot run this attention call",
    )
    packed = [x[0] for x in (q, k, v)]
    bounds = torch.tensor([0, 4, 6 * world])  # document 1 runs from rank 0 into rank 1
    cu_q, cu_k, max_q, max_k, k_slice = compat.llama3_flash_attn_prepare_cu_seqlens(
        bounds, True, rank, world
    )
    stride = 3 if rank == bad else 1
    _expect_raise(
        check,
        "heads_k_stride on one rank",
        lambda: compat.llama3_flash_attn_varlen_func(
            *packed, cu_q, cu_k, max_q, max_k, stride, k_slice, causal=True
        ),
        ValueError,
        "heads_k_stride must divide" if rank == bad else f"rank {bad} cannot run this attention",
    )
    # prepared for causal attention, called without: the keys of rank 0's last document end
    # at its last token instead of the document's end
    _expect_raise(
        check,
        "llama3 prepared for causal=True, called with causal=False",
        lambda: compat.llama3_flash_attn_varlen_func(
            *packed, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=False
        ),
        ValueError,
        "rank 0 passed cu_seqlens_k",
    )


def compat_grid() -> tuple[list[str], int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    check = _Checker()
    _padded_cases(check, rank, world)
    _varlen_cases(check, rank, world)
    if world > 1:
        _error_cases(check, rank, world)
    return check.failures, check.num_checked


NUM_CHECKS = 15 * 10 + 8 * 5  # padded calls x (5 oracle + 5 bitwise) + varlen calls x 5 oracle


def test_shims_match_the_oracle_on_one_rank(single_rank_group: None) -> None:
    failures, num_checked = compat_grid()
    assert not failures, "\n".join(failures)
    assert num_checked == NUM_CHECKS


@pytest.mark.parametrize("world_size", [2, 3])
def test_shims_match_the_oracle_on_ranks(world_size: int) -> None:
    per_rank = tokenring.launch(compat_grid, world_size=world_size, timeout_s=240)
    failures = [f"rank {r}: {f}" for r, (fails, _) in enumerate(per_rank) for f in fails]
    assert not failures, "\n".join(failures)
    assert [num for _, num in per_rank] == [NUM_CHECKS] * world_size


def test_readme_recipe_imports_exist() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    names = re.findall(r"^from tokenring\.compat import (.+)$", readme, flags=re.MULTILINE)
    imported = {n.strip() for line in names for n in line.split(",")}
    assert len(imported) >= 3, imported
    assert imported <= set(compat.__all__), imported - set(compat.__all__)
