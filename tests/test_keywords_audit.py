"""Every keyword of every public attention entry point, one rank at a time: a keyword either
reaches the ranks' agreed signature and the schedule, or is rejected (Note [Rank agreement] in
tokenring.api).

The tables below list, per entry point, every keyword of its signature (read by
``inspect.signature``: a keyword added later without a row fails
:func:`test_every_keyword_has_a_row`) with three values:

- ``one``: a legal value given on rank 1 only. Every rank must either raise within a few
  seconds naming the keyword (the ranks disagree), or return the float64 oracle's answer for
  its own inputs (a keyword that does not concern the other ranks).
- ``legal``: a legal value given on every rank: the answer is the oracle's for that value (or
  the documented refusal, on every rank).
- ``bad``: a wrong type or an out-of-range value on rank 1 (on every rank where a rank alone
  has no group to tell): an error naming the keyword and the value on that rank, and an error
  on every other rank within a few seconds.

The entry points are read from the modules' ``__all__``
(:func:`test_every_public_entry_point_has_a_table`). All cases run in one launch of two gloo
ranks (communicators with a 3 s timeout, so a wait for it shows); each rank returns what
happened to it, and a case that left a communicator failed is followed by new ones.

Legend: B batch, S global seq, s local seq, T text tokens, H heads, D head dim, P world size.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import full_attention, sharded_positions, visible_mask
from tokenring import compat, diffusers
from tokenring.inference import cached_attn

WORLD = 2
S, HQ, HKV, D = 16, 4, 2, 8
TIMEOUT_S = 3.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 2.0  # what "at once" means here (the agreement takes milliseconds)
ORACLE_TOL = 1e-10  # float64
DOCS = [0, 5, 16]


class Skip:
    """A mode a keyword cannot have, and why."""

    def __init__(self, why: str) -> None:
        self.why = why


@dataclasses.dataclass(frozen=True)
class Dyn:
    """A value built on the rank (a tensor, a group, a cache): ``fn(ctx)``."""

    fn: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Refused:
    """A legal-typed value that the entry documents as unsupported: every rank raises ``error``
    naming the keyword."""

    value: Any
    error: str = "NotImplementedError"


@dataclasses.dataclass(frozen=True)
class Row:
    """One keyword: its values per mode (Skip: not applicable, with the reason)."""

    keyword: str
    one: Any
    legal: Any
    bad: Any
    bad_everywhere: bool = False  # the bad value cannot reach the peers: give it to every rank
    base: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the row needs besides
    names: tuple[str, ...] = ()  # other words an error may name the keyword by
    or_refused: bool = False  # legal: the oracle's answer, or a refusal naming the keyword


# -- the entry points' runners: (rank's options) -> (result, oracle) ------------------------------
@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    comm: Any  # an explicit Communicator over the world (timeout 3 s)
    mesh: Any  # HybridMesh outer=P, inner=1
    mesh_inner: Any  # HybridMesh outer=1, inner=P
    q: torch.Tensor  # (1, S, HQ, D) float64, the same on every rank
    k: torch.Tensor
    v: torch.Tensor


def _oracle(ctx: Ctx, o: dict[str, Any], seq: int, rows: list[int], *, d: int = D) -> Any:
    """Out and lse rows ``rows`` of float64 attention over the first ``seq`` tokens with the
    sequence_parallel_attn options ``o``."""
    window = o.get("window_size")
    if window is None:
        window = (-1, -1)
    elif isinstance(window, int):
        window = (window, window)
    mask = visible_mask(
        seq,
        causal=bool(o.get("causal", False)),
        cu_seqlens=list(o["cu_seqlens"]) if o.get("cu_seqlens") is not None else None,
        window=tuple(window),
        chunk=o.get("attention_chunk_size"),
    )
    scale = o.get("softmax_scale") or d**-0.5
    q, k, v = (x[:, :seq, :, :d] for x in (ctx.q, ctx.k, ctx.v))
    out, lse = full_attention(q, k, v, causal=False, scale=scale, mask=mask)
    return out[:, rows], lse[:, :, rows]


def _layout_name(layout: Any) -> str:
    return layout if isinstance(layout, str) else layout.value


def _ring_rows(ctx: Ctx, o: dict[str, Any], layout: str = "contiguous") -> tuple[int, list[int]]:
    seq = o.get("seq_len") or S
    docs = o.get("cu_seqlens")
    rows = sharded_positions(_layout_name(o.get("layout", layout)), ctx.rank, ctx.world, seq, docs)
    return seq, rows


def _split(result: Any, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if return_lse:
        out, lse = result
        return out, lse
    return result, None


def run_spa(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    seq, rows = _ring_rows(ctx, shape)
    q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
    result = tokenring.sequence_parallel_attn(q, k, v, **o)
    return _split(result, o.get("return_lse") is True), _oracle(ctx, shape, seq, rows)


def run_module(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    seq, rows = _ring_rows(ctx, shape)
    q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
    out = tokenring.SequenceParallelAttention(**o)(q, k, v)
    return (out, None), _oracle(ctx, shape, seq, rows)


def _hybrid_rows(ctx: Ctx, o: dict[str, Any], inner: bool) -> tuple[int, list[int]]:
    seq = o.get("seq_len") or S
    layout = _layout_name(o.get("layout", "contiguous"))
    if not inner:  # outer P x inner 1: the outer layout's shard
        return seq, sharded_positions(layout, ctx.rank, ctx.world, seq, o.get("cu_seqlens"))
    whole = sharded_positions(layout, 0, 1, seq, o.get("cu_seqlens"))  # outer 1: everything
    sizes = [len(whole) // ctx.world + (1 if i < len(whole) % ctx.world else 0) for i in range(2)]
    start = sum(sizes[: ctx.rank])
    return seq, whole[start : start + sizes[ctx.rank]]


def run_hybrid(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    inner = shape.get("mesh") is ctx.mesh_inner
    seq, rows = _hybrid_rows(ctx, shape, inner)
    q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
    o = {"mesh": ctx.mesh} | o
    result = tokenring.hybrid_attn(q, k, v, **o)
    return _split(result, o.get("return_lse") is True), _oracle(ctx, shape, seq, rows)


def _cache(ctx: Ctx, **options: Any) -> tokenring.DistributedKVCache:
    sizes = dict(num_layers=2, batch=1, heads_kv=HKV, head_dim=D, dtype=torch.float64)
    return tokenring.DistributedKVCache(**(sizes | dict(block_size=4) | options))


def _cached_rows(cache: Any, rank: int) -> list[int]:
    """The global positions of ``rank``'s new rows in the cache's current step."""
    return [int(p) for p in cache.step.positions(rank)]


def run_cached(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """A prefill of S tokens into a fresh cache (or the row's), then one layer's call."""
    o = {"cache": _cache(ctx), "layer": 0, "strategy": "direct"} | o
    cache = o["cache"] if isinstance(o["cache"], tokenring.DistributedKVCache) else _cache(ctx)
    cache.begin_step([S])
    rows = _cached_rows(cache, ctx.rank)
    q, k, v = (x[0, rows] for x in (ctx.q, ctx.k, ctx.v))  # (n, H, D)
    with torch.no_grad():
        result = cached_attn(q, k, v, **o)
    (out, lse) = _split(result, o.get("return_lse") is True)
    want_out, want_lse = _oracle(ctx, shape | {"causal": True}, S, rows)
    return (out.unsqueeze(0), None if lse is None else lse.unsqueeze(0)), (want_out, want_lse)


def run_kvcache(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """A cache built with ``o``: a prefill of S tokens per sequence, every layer's call."""
    cache = _cache(ctx, **o)
    shape = {"num_layers": 2, "batch": 1, "heads_kv": HKV, "head_dim": D} | shape
    batch, heads_kv, d = shape["batch"], shape["heads_kv"], shape["head_dim"]
    cache.begin_step([S] * batch)
    step = cache.step
    outs, wants = [], []
    for layer in range(shape["num_layers"]):
        qs, ks, vs, want = [], [], [], []
        for b in range(batch):
            rows = [int(p) for p in step.new_positions[ctx.rank][b]]
            scale = 1.0 / (b + 1)  # another sequence: scaled inputs
            qs.append(ctx.q[0, rows, :, :d] * scale)
            ks.append(ctx.k[0, rows, :heads_kv, :d] * scale)
            vs.append(ctx.v[0, rows, :heads_kv, :d] * scale)
            qb = ctx.q[:, :, :, :d] * scale
            kb, vb = (x[:, :, :heads_kv, :d] * scale for x in (ctx.k, ctx.v))
            ref, _ = full_attention(qb, kb, vb, causal=True, scale=d**-0.5)
            want.append(ref[0, rows])
        dtype = cache.dtype
        q, k, v = (torch.cat(x).to(dtype) for x in (qs, ks, vs))
        with torch.no_grad():
            out = cached_attn(q, k, v, cache=cache, layer=layer, strategy="direct")
        outs.append(out.double())
        wants.append(torch.cat(want))
    return (torch.stack(outs), None), (torch.stack(wants), None)


def run_begin_step(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    cache = _cache(ctx, num_layers=1)
    o = {"new": [S]} | o
    cache.begin_step(**o)
    rows = _cached_rows(cache, ctx.rank)
    q, k, v = (x[0, rows] for x in (ctx.q, ctx.k, ctx.v))
    with torch.no_grad():
        out = cached_attn(q, k, v, cache=cache, layer=0, strategy="direct")
    return (out.unsqueeze(0), None), _oracle(ctx, {"causal": True}, S, rows)


def _flash_result(result: Any, o: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if o.get("return_attn_probs") is True:
        out, lse, probs = result
        assert probs is None
        return out, lse
    return result, None


def _run_flash(
    fn: Callable[..., Any], layout: str, ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]
) -> Any:
    seq, rows = _ring_rows(ctx, shape, layout)
    q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
    result = fn(q, k, v, **o)
    return _flash_result(result, o), _oracle(ctx, shape, seq, rows)


def run_flash(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    return _run_flash(compat.flash_attn_func, "contiguous", ctx, o, shape)


def run_ring_flash(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    return _run_flash(compat.ring_flash_attn_func, "contiguous", ctx, o, shape)


def run_zigzag_flash(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    return _run_flash(compat.zigzag_ring_flash_attn_func, "zigzag", ctx, o, shape)


def _packed(result: Any, o: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    out, lse = _flash_result(result, o)
    return out.unsqueeze(0), None if lse is None else lse.unsqueeze(0)


def run_varlen(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    docs = shape.get("docs", DOCS)
    cu = torch.tensor(docs, dtype=torch.int32)
    o = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11, max_seqlen_k=11) | o
    layout = _layout_name(shape.get("layout", "contiguous"))
    rows = sharded_positions(layout, ctx.rank, ctx.world, docs[-1], docs)
    q, k, v = (x[0, rows] for x in (ctx.q, ctx.k, ctx.v))
    result = compat.flash_attn_varlen_func(q, k, v, **o)
    return _packed(result, o), _oracle(ctx, shape | {"cu_seqlens": docs}, docs[-1], rows)


def _llama3_args(ctx: Ctx, causal: bool, docs: list[int] = DOCS) -> dict[str, Any]:
    cu = torch.tensor(docs, dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = compat.llama3_flash_attn_prepare_cu_seqlens(
        cu, causal, ctx.rank, ctx.world
    )
    return dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        local_k_slice=k_slice,
        heads_k_stride=1,
    )


def run_llama3(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    o = _llama3_args(ctx, shape.get("causal", False) is True) | o
    length = S // ctx.world
    rows = list(range(ctx.rank * length, (ctx.rank + 1) * length))
    q, k, v = (x[0, rows] for x in (ctx.q, ctx.k, ctx.v))
    result = compat.llama3_flash_attn_varlen_func(q, k, v, **o)
    return _packed(result, o), _oracle(ctx, shape | {"cu_seqlens": DOCS}, S, rows)


TEXT = 4  # joint attention's text tokens


def run_joint(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """Global sequence [text (T), image (S - T)]; image contiguous shards."""
    text = shape.get("text", "replicated")
    image = list(range(TEXT, S))
    per = len(image) // ctx.world
    mine = image[ctx.rank * per : (ctx.rank + 1) * per]
    if _layout_name(text) == "sharded":
        t = TEXT // ctx.world
        texts = list(range(ctx.rank * t, (ctx.rank + 1) * t))
    else:
        texts = list(range(TEXT))
    rows = texts + mine
    o = {"num_text": len(texts), "text": "replicated"} | o
    q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
    out = diffusers.joint_attn(q, k, v, **o)
    return (out, None), _oracle(ctx, shape, S, rows)


SKV = 6  # cross-attention keys: the last SKV tokens of the global k, v


def run_cross(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    per = S // ctx.world
    rows = list(range(ctx.rank * per, (ctx.rank + 1) * per))
    keys = list(range(S - SKV, S))
    if _layout_name(shape.get("kv", "replicated")) == "sharded":
        parts = [keys[:2], keys[2:]]  # uneven parts in rank order
        mine = parts[ctx.rank]
    else:
        mine = keys
    o = {"kv": "replicated"} | o
    q = ctx.q[:, rows]
    k, v = (x[:, mine] for x in (ctx.k, ctx.v))
    out = diffusers.cross_attn(q, k, v, **o)
    scale = shape.get("softmax_scale") or D**-0.5
    want, _ = full_attention(q, ctx.k[:, keys], ctx.v[:, keys], causal=False, scale=scale)
    return (out, None), (want, None)


# -- the tables -----------------------------------------------------------------------------------
def _hardware(name: str = "float64 machine") -> Any:
    """A hardware that prices float64 calls (the presets price bf16 and fp16 only)."""
    from tokenring.model.costmodel import measured

    rates = dict(forward_flops_per_s=1e12, backward_flops_per_s=1e12)
    links = dict(link_bandwidth_bytes_per_s=1e10, memory_bandwidth_bytes_per_s=1e11)
    return measured(**rates, **links, dtype="float64", name=name)


HW = Dyn(lambda ctx: _hardware())
HW_OTHER = Dyn(lambda ctx: _hardware("another machine"))
AUTO = {"strategy": "auto", "hardware": HW}


NOT_SHARED = Skip("q, k and v are positional tensors, not options")


def _spa_rows(module: bool = False) -> list[Row]:
    """sequence_parallel_attn's keywords (the module's constructor takes the same)."""
    return [
        Row("strategy", "ring", "ulysses", "nope"),
        Row("causal", True, True, 1),
        Row("softmax_scale", 0.3, 0.3, -1.0),
        Row(
            "group",
            Skip("each rank's group is another communicator: no channel to compare on"),
            Dyn(lambda ctx: ctx.comm),
            "world",
            bad_everywhere=True,  # a rank without a group has nobody to tell
        ),
        Row("layout", "zigzag", "zigzag", "diagonal"),
        Row(
            "return_lse",
            Skip("refused by the constructor: that rank never calls") if module else True,
            Refused(True, "ValueError") if module else True,
            "yes",
        ),
        Row("kernel", "reference", "tiled", "fastest"),
        Row("last_block_splits", 3, 3, 0),
        Row("last_pair", "lend", "lend", "maybe"),
        Row("check_ranks", False, False, "yes"),
        Row("hardware", HW_OTHER, HW, "nosuchhardware", base=AUTO),
        Row("seq_len", 14, 14, -1),
        Row("cu_seqlens", [0, 7, 16], DOCS, [0, 20, 16]),
        Row("window_size", (3, 3), (2, 1), (-2, 0)),
        Row("attention_chunk_size", 4, 4, 0),
    ]


def _hybrid_rows_table() -> list[Row]:
    return [
        Row(
            "mesh",
            Skip("a mesh of other groups on one rank: no shared channel to compare on"),
            Dyn(lambda ctx: ctx.mesh_inner),
            "mesh",
            bad_everywhere=True,
        ),
        Row("outer_strategy", "ring", "bidir_ring", "ulysses"),
        Row("causal", True, True, "no"),
        Row("softmax_scale", 0.3, 0.3, float("nan")),
        Row("layout", "zigzag", "zigzag", "diagonal"),
        Row("return_lse", True, True, 0),
        Row("kernel", "reference", "tiled", "fastest"),
        Row("last_block_splits", 3, 3, -2),
        Row("check_ranks", False, False, None),
        Row("seq_len", 14, 14, -3),
        Row("cu_seqlens", [0, 7, 16], DOCS, [0, 9, 5, 16], base={"seq_len": S}),
        Row("window_size", (3, 3), (2, 1), "wide"),
        Row("attention_chunk_size", 4, 4, -4),
    ]


def _flash_rows(*, softcap: bool, extra: list[Row]) -> list[Row]:
    rows = [
        Row("dropout_p", Refused(0.1), Refused(0.1), 2.0),
        Row("softmax_scale", 0.3, 0.3, 0.0),
        Row("causal", True, True, "yes"),
        Row("window_size", (3, 3), (2, 1), (-3, 0)),
        Row(
            "alibi_slopes",
            Refused(Dyn(lambda ctx: torch.ones(HQ))),
            Refused(Dyn(lambda ctx: torch.ones(HQ))),
            "slopes",
        ),
        Row("deterministic", True, True, "yes"),
        Row("return_attn_probs", True, True, 2),
        Row(
            "group",
            Skip("each rank's group is another communicator: no channel to compare on"),
            Dyn(lambda ctx: ctx.comm),
            3,
            bad_everywhere=True,
        ),
        Row("strategy", "token_ring", "bidir_ring", "auto"),
    ]
    if softcap:
        rows.append(Row("softcap", Refused(1.0), Refused(1.0), -1.0))
    return rows + extra


_CU = Dyn(lambda ctx: torch.tensor(DOCS, dtype=torch.int32))
_CU_OTHER = Dyn(lambda ctx: torch.tensor([0, 7, 16], dtype=torch.int32))


def _llama3_value(name: str, causal: bool = False) -> Dyn:
    return Dyn(lambda ctx: _llama3_args(ctx, causal)[name])


TABLES: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[Row]]] = {
    "sequence_parallel_attn": (tokenring.sequence_parallel_attn, run_spa, _spa_rows()),
    "SequenceParallelAttention": (
        tokenring.SequenceParallelAttention,
        run_module,
        _spa_rows(module=True),
    ),
    "hybrid_attn": (tokenring.hybrid_attn, run_hybrid, _hybrid_rows_table()),
    "cached_attn": (
        cached_attn,
        run_cached,
        [
            Row(
                "cache",
                Dyn(lambda ctx: _cache(ctx, block_size=8)),
                Dyn(lambda ctx: _cache(ctx, block_size=8)),
                "cache",
                bad_everywhere=True,  # not a cache: no group to tell the peers on
            ),
            Row("layer", 1, 1, 2),
            Row("strategy", "pass_kv", "tree", "sideways"),
            Row("softmax_scale", 0.3, 0.3, math.inf),
            Row("hardware", HW_OTHER, HW, "nosuchhardware", base=AUTO),
            Row("kernel", "reference", "tiled", "fastest"),
            Row("return_lse", True, True, "no"),
            Row("check_ranks", False, False, 1),
        ],
    ),
    "DistributedKVCache": (
        tokenring.DistributedKVCache,
        run_kvcache,
        [
            Row("num_layers", 3, 3, 0),
            Row("batch", Skip("the inputs' batch follows it"), 2, -1),
            Row("heads_kv", Skip("the inputs' heads follow it"), 1, 3.0),
            Row("head_dim", Skip("the inputs' head_dim follows it"), 4, True),
            Row("dtype", Skip("the inputs' dtype follows it"), Skip("float64 only"), torch.int32),
            Row("device", Dyn(lambda ctx: torch.device("cpu")), "cpu", "nosuchdevice"),
            Row("block_size", 2, 8, 0),
            Row("budget_bytes", 10**9, 10**9, -5),
            Row(
                "group",
                Skip("each rank's group is another communicator: no channel to compare on"),
                Dyn(lambda ctx: ctx.comm),
                "world",
                bad_everywhere=True,
            ),
            Row(
                "rank",
                Skip("bookkeeping only: no group"),
                Refused(0, "ValueError"),
                5,
                bad_everywhere=True,
                base={"world_size": WORLD, "group": None},
            ),
            Row(
                "world_size",
                Skip("bookkeeping only: no group"),
                Refused(WORLD, "ValueError"),
                0,
                bad_everywhere=True,
                base={"rank": 0},
            ),
            Row("zigzag_first_prefill", False, False, "no"),
        ],
    ),
    "DistributedKVCache.begin_step": (
        tokenring.DistributedKVCache.begin_step,
        run_begin_step,
        [
            Row("self", NOT_SHARED, NOT_SHARED, NOT_SHARED),
            Row("new", [S - 2], Skip("the runner passes it"), [-1]),
            Row("check_ranks", False, False, "no"),
        ],
    ),
    "compat.flash_attn_func": (
        compat.flash_attn_func,
        run_flash,
        _flash_rows(
            softcap=True,
            extra=[
                Row("layout", "zigzag", "zigzag", "diagonal"),
                Row("seq_len", 14, 14, 3.5),
            ],
        ),
    ),
    "compat.ring_flash_attn_func": (
        compat.ring_flash_attn_func,
        run_ring_flash,
        _flash_rows(softcap=False, extra=[]),
    ),
    "compat.zigzag_ring_flash_attn_func": (
        compat.zigzag_ring_flash_attn_func,
        run_zigzag_flash,
        _flash_rows(softcap=False, extra=[]),
    ),
    "compat.flash_attn_varlen_func": (
        compat.flash_attn_varlen_func,
        run_varlen,
        _flash_rows(
            softcap=True,
            extra=[
                Row("cu_seqlens_q", _CU_OTHER, Skip("the shards follow it"), [0, 20, 16]),
                Row("cu_seqlens_k", _CU_OTHER, Refused(_CU_OTHER), "bounds"),
                Row("max_seqlen_q", 16, 16, 3),
                Row("max_seqlen_k", 16, 16, "11"),
                Row(
                    "block_table",
                    Refused(Dyn(lambda ctx: torch.zeros(1, 1, dtype=torch.int32))),
                    Refused(Dyn(lambda ctx: torch.zeros(1, 1, dtype=torch.int32))),
                    "table",
                ),
                Row("layout", "zigzag", "zigzag", "diagonal"),
            ],
        ),
    ),
    "compat.llama3_flash_attn_varlen_func": (
        compat.llama3_flash_attn_varlen_func,
        run_llama3,
        [
            *_flash_rows(softcap=False, extra=[]),
            Row(
                "cu_seqlens_q",
                _llama3_value("cu_seqlens_q", True),
                Skip("prepared per rank"),
                [0, 3],
            ),
            Row(
                "cu_seqlens_k",
                _llama3_value("cu_seqlens_k", True),
                Skip("prepared per rank"),
                "bounds",
            ),
            Row("max_seqlen_q", 16, 16, 0),
            Row("max_seqlen_k", 16, 16, -1),
            Row("heads_k_stride", 2, 2, 3),
            Row("local_k_slice", Dyn(lambda ctx: slice(0, 16)), Skip("prepared per rank"), (0, 8)),
        ],
    ),
    "diffusers.joint_attn": (
        diffusers.joint_attn,
        run_joint,
        [
            Row("num_text", 2, Skip("the inputs follow it"), -1),
            Row("text", "sharded", "sharded", "both"),
            Row(
                "group",
                Skip("each rank's group is another communicator: no channel to compare on"),
                Dyn(lambda ctx: ctx.comm),
                "world",
                bad_everywhere=True,
            ),
            Row("strategy", "ring", "ulysses", "nope"),
            Row("softmax_scale", 0.3, 0.3, -2.0),
            Row("hardware", HW_OTHER, HW, "nosuchhardware", base=AUTO),
        ],
    ),
    "diffusers.cross_attn": (
        diffusers.cross_attn,
        run_cross,
        [
            Row("kv", "sharded", "sharded", "everywhere"),
            Row(
                "group",
                Skip("each rank's group is another communicator: no channel to compare on"),
                Dyn(lambda ctx: ctx.comm),
                "world",
                bad_everywhere=True,
            ),
            Row("softmax_scale", 0.3, 0.3, -2.0),
        ],
    ),
}


def _run_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
        seq, rows = _ring_rows(ctx, shape)
        q, k, v = (x[:, rows] for x in (ctx.q, ctx.k, ctx.v))
        result = fn(q, k, v, **o)
        return _split(result, o.get("return_lse") is True), _oracle(ctx, shape, seq, rows)

    return run


def _wrapper_rows() -> list[Row]:
    """A strategy's own function passes sequence_parallel_attn's options through (one and bad
    are sequence_parallel_attn's rows): each legal value is applied, or refused by name where
    the strategy does not take it (a window for Ulysses, last_pair for Ring)."""
    through = Skip("as sequence_parallel_attn: the options pass through")
    rows = []
    for row in _spa_rows():
        if row.keyword == "strategy":
            rows.append(Row("strategy", through, Skip("fixed by the function"), through))
        else:
            base = {n: x for n, x in row.base.items() if n != "strategy"}
            rows.append(
                dataclasses.replace(row, one=through, bad=through, or_refused=True, base=base)
            )
    return rows


for _name in (
    "token_ring_attn",
    "ring_attn",
    "bidir_ring_attn",
    "bidir_token_ring_attn",
    "ulysses_attn",
    "allgather_kv_attn",
):
    _fn = getattr(tokenring, _name)
    TABLES[_name] = (_fn, _run_wrapper(_fn), _wrapper_rows())

POSITIONAL = {"q", "k", "v", "self"}  # tensors and the bound object
# constructors: a bad value raises where the object is built, before any call; a rank that
# raised there never calls (its program ends, and its peers learn it from its exit)
BUILT_LOCALLY = {"SequenceParallelAttention", "DistributedKVCache"}


def _keywords(fn: Callable[..., Any]) -> set[str]:
    """A public entry point's keywords (``**options``: sequence_parallel_attn's)."""
    params = inspect.signature(fn).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        names |= _keywords(tokenring.sequence_parallel_attn)
    return names - POSITIONAL


# The public callables that are no attention entry point: local functions (no group, no
# call to agree on), collectives whose arguments are checked where they are used, and
# classes of values. Every other public callable needs a table.
NOT_ENTRY_POINTS = {
    "tokenring": {
        "CachedStrategy", "Communicator", "HybridMesh", "KVCacheBudgetError", "Layout",
        "Sharding", "Strategy", "close_communicators", "explain", "explain_cached",
        "get_communicator", "global_positions", "hybrid_mesh", "hybrid_shard",
        "init_distributed", "launch", "make_sharding", "position_ids", "resolve_strategy",
        "shard", "unshard",
    },
    "tokenring.compat": {"llama3_flash_attn_prepare_cu_seqlens"},  # local arithmetic
    # the Flux processor is a diffusers model's (test_diffusers); the enums are values
    "tokenring.diffusers": {"FluxSequenceParallelProcessor", "KVPlacement", "TextPlacement"},
    "tokenring.inference": {"attend_cached", "resolve_cached_strategy", "run_cached_plan"},
}  # fmt: skip


def test_every_public_entry_point_has_a_table() -> None:
    """Read from the modules' ``__all__``: a new public attention function needs a table."""
    import importlib

    covered = {name.split(".")[-1] for name in TABLES} | {"DistributedKVCache"}
    for module_name, exempt in NOT_ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        public = {n for n in module.__all__ if callable(getattr(module, n))}
        assert public - exempt <= covered, (module_name, sorted(public - exempt - covered))


def test_every_keyword_has_a_row() -> None:
    """The tables cover each entry point's keywords exactly (a new keyword needs a row)."""
    for name, (fn, _, rows) in TABLES.items():
        covered = {row.keyword for row in rows} - POSITIONAL
        assert covered == _keywords(fn), name


# -- the cases -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    entry: str
    keyword: str
    mode: str  # "one", "legal" or "bad"


def _cases() -> list[Case]:
    found = []
    for entry, (_, _, rows) in TABLES.items():
        for row in rows:
            for mode in ("one", "legal", "bad"):
                if not isinstance(getattr(row, mode), Skip):
                    found.append(Case(entry, row.keyword, mode))
    return found


CASES = _cases()


def _value(x: Any, ctx: Ctx) -> Any:
    x = x.value if isinstance(x, Refused) else x
    return x.fn(ctx) if isinstance(x, Dyn) else x


def _row(case: Case) -> Row:
    return next(r for r in TABLES[case.entry][2] if r.keyword == case.keyword)


def _options(case: Case, ctx: Ctx) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's keyword arguments, and the options its inputs and its oracle follow."""
    row = _row(case)
    everywhere = row.bad_everywhere or case.entry in BUILT_LOCALLY
    given = case.mode == "legal" or ctx.rank == 1 or (case.mode == "bad" and everywhere)
    options = {name: _value(x, ctx) for name, x in row.base.items()}
    if given:
        options[case.keyword] = _value(getattr(row, case.mode), ctx)
    shape = options if case.mode != "bad" else {n: _value(x, ctx) for n, x in row.base.items()}
    if case.entry == "hybrid_attn" and case.keyword != "mesh" and "mesh" not in shape:
        shape = shape | {"mesh": ctx.mesh}
    return options, shape


def _distance(got: Any, want: Any) -> float:
    (out, lse), (want_out, want_lse) = got, want
    err = (out.double() - want_out).abs().max().item()
    if lse is not None:
        err = max(err, (lse.double() - want_lse).abs().max().item())
    return err


def _run_case(case: Case, ctx: Ctx) -> dict[str, Any]:
    runner = TABLES[case.entry][1]
    options, shape = _options(case, ctx)
    return timed_result(lambda: runner(ctx, options, shape), _distance)


def timed_result(
    run: Callable[[], tuple[Any, Any]], distance: Callable[[Any, Any], float]
) -> dict[str, Any]:
    """What a case did: ``ok`` with the ``distance`` of ``run()``'s (got, want), or the type
    and text of its error; and how long it took."""
    start = time.monotonic()
    result: dict[str, Any] = {}
    try:
        got, want = run()
        result.update(ok=True, err=distance(got, want))
    except Exception as exc:
        result.update(ok=False, type=type(exc).__name__, error=str(exc)[:600])
    result["elapsed_s"] = time.monotonic() - start
    return result


def _fresh(ctx: Ctx) -> None:
    """After a case that left a communicator failed on some rank: new ones on every rank."""
    tokenring.close_communicators()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    ctx.comm = tokenring.Communicator(None, timeout_s=TIMEOUT_S)


def _broken(ctx: Ctx) -> bool:
    comms = [ctx.comm, tokenring.get_communicator(None)]
    comms += [
        tokenring.get_communicator(g)
        for m in (ctx.mesh, ctx.mesh_inner)
        for g in (m.outer, m.inner)
    ]
    return any(c._broken is not None for c in comms)


def _all_cases(cases: list[Case]) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV, HKV))
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    ctx = Ctx(
        rank=rank,
        world=world,
        comm=tokenring.Communicator(None, timeout_s=TIMEOUT_S),
        mesh=tokenring.hybrid_mesh(world, 1),
        mesh_inner=tokenring.hybrid_mesh(1, world),
        q=q,
        k=k,
        v=v,
    )
    for m in (ctx.mesh, ctx.mesh_inner):
        for g in (m.outer, m.inner):
            tokenring.get_communicator(g, timeout_s=TIMEOUT_S)
    results = []
    for case in cases:
        results.append(_run_case(case, ctx))
        flags = [None] * world
        dist.all_gather_object(flags, _broken(ctx))
        if any(flags):
            _fresh(ctx)
            for m in (ctx.mesh, ctx.mesh_inner):
                for g in (m.outer, m.inner):
                    tokenring.get_communicator(g, timeout_s=TIMEOUT_S)
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[Case, list[dict[str, Any]]]:
    per_rank = tokenring.launch(_all_cases, CASES, world_size=WORLD, timeout_s=300, pg_timeout_s=60)
    return {case: [per_rank[r][i] for r in range(WORLD)] for i, case in enumerate(CASES)}


def _names_it(row: Row, message: str) -> bool:
    """Whether ``message`` names the row's keyword as a word (kv, not heads_kv)."""
    words = (row.keyword, *row.names)
    return any(
        re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", message) for w in words
    )


def broken_rule(
    row: Row, mode: str, results: list[dict[str, Any]], tol: float = ORACLE_TOL
) -> str | None:
    """Why ``results`` (every rank's) break the rule of ``mode`` for ``row``; None if they
    keep it (also test_hf_keywords_audit's rule)."""
    slow = [r for r, x in enumerate(results) if x["elapsed_s"] > FAST_S]
    if slow:
        return f"slow on ranks {slow}: {results}"
    raised = [not x["ok"] for x in results]
    spec = getattr(row, mode)
    if mode == "one":
        if not any(raised):
            bad = [x["err"] for x in results if x["err"] > tol]
            return f"silently off the oracle: {results}" if bad else None
        if not all(raised):
            return f"only some ranks raised: {results}"
        if isinstance(spec, Refused):
            return None  # rank 1's refusal, told to the others
        missing = [x for x in results if not _names_it(row, x["error"])]
        return f"an error that does not name {row.keyword}: {missing}" if missing else None
    if mode == "legal":
        if isinstance(spec, Refused):
            want = spec.error
            wrong = [x for x in results if x["ok"] or x["type"] != want]
            if wrong:
                return f"expected {want} on every rank: {results}"
            missing = [x for x in results if not _names_it(row, x["error"])]
            return f"an error that does not name {row.keyword}: {missing}" if missing else None
        if row.or_refused and all(raised):
            wrong = [x for x in results if x["type"] not in ("ValueError", "NotImplementedError")]
            missing = [x for x in results if not _names_it(row, x["error"])]
            return (
                f"a refusal that does not name {row.keyword}: {results}"
                if wrong or missing
                else None
            )
        if any(raised):
            return f"a legal value raised: {results}"
        bad = [x["err"] for x in results if x["err"] > tol]
        return f"off the oracle: {results}" if bad else None
    # bad
    if not all(raised):
        return f"a bad value was accepted (or raised on some ranks only): {results}"
    mine = results[1]
    if mine["type"] not in ("ValueError", "TypeError", "NotImplementedError"):
        return f"the bad rank raised {mine['type']}: {mine}"
    if not _names_it(row, mine["error"]):
        return f"the error does not name {row.keyword}: {mine}"
    return None


@pytest.mark.parametrize("mode", ["one", "legal", "bad"])
def test_keywords(outcomes: dict[Case, list[dict[str, Any]]], mode: str) -> None:
    assert_rules_kept(outcomes, mode, lambda case: (_row(case), ORACLE_TOL))


def assert_rules_kept(
    outcomes: dict[Any, list[dict[str, Any]]], mode: str, rule: Callable[[Any], tuple[Row, float]]
) -> None:
    """Every case of ``mode`` in ``outcomes`` keeps its rule (``rule``: its row, tolerance)."""
    failures = []
    for case, results in outcomes.items():
        if case.mode != mode:
            continue
        row, tol = rule(case)
        why = broken_rule(row, mode, results, tol)
        if why is not None:
            failures.append(f"{case.entry}({case.keyword}=...): {why}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
