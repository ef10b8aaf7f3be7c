"""Drop-in functions with the signatures and returns of ring-flash-attention and flash-attn.

This module owns only the translation (parameter names, defaults, return tuples, lse shapes)
onto :func:`tokenring.sequence_parallel_attn`, which does the work and the validation::

    # from ring_flash_attn import zigzag_ring_flash_attn_func
    from tokenring.compat import zigzag_ring_flash_attn_func

Legend: B batch, S global seq, s local seq, T packed tokens of the whole group, t packed tokens
of this rank, Hq query heads, Hkv kv heads, D head dim, P world size.

Note [Shim mapping]
~~~~~~~~~~~~~~~~~~~
Each function keeps the original's parameters (names, order, defaults) and adds keyword-only
ones after them (``strategy``; the flash-attn pair also ``group`` and ``layout``). A
ring-flash-attention shim defaults to the algorithm it replaces, so the traffic stays::

    function                        tensors          layout               default strategy
    ring_flash_attn_func            (B, s, H, D)     contiguous           ring (pass-KV)
    zigzag_ring_flash_attn_func     (B, s, H, D)     zigzag               ring (pass-KV)
    llama3_flash_attn_varlen_func   (T/P, H, D)      contiguous, packed   allgather_kv
    flash_attn_func                 (B, s, H, D)     layout= (contig.)    token_ring
    flash_attn_varlen_func          (t, H, D)        layout= (contig.)    token_ring

Returns: ``out``, or with ``return_attn_probs=True`` ``(out, softmax_lse, None)``; softmax_lse
is ``(B, Hq, s)`` (padded) or ``(Hq, t)`` (varlen), float32 (float64 for float64 inputs), the
lse over the *global* sequence, with its gradient (Note [Gradient of lse] in
tokenring.runtime.op; flash-attn's own backward drops it). ``dropout_p != 0``, ``alibi_slopes`` and
``softcap > 0`` raise ``NotImplementedError``; ``deterministic`` is accepted (the backward is
deterministic anyway). ``strategy="auto"`` raises ``ValueError``: it needs ``hardware=``,
which only :func:`tokenring.sequence_parallel_attn` takes. A rank whose arguments fail tells
its peers through the attention call's rank check (Note [Rank agreement] in
``tokenring.api``), so no rank waits for it.

``cu_seqlens`` of ``flash_attn_varlen_func`` are the *global* boundaries ``(0, ..., T)`` on
every rank, with this rank's shard of the tokens (``tokenring.shard(x, ..., seq_dim=0,
cu_seqlens=...)``), self-attention only. ``llama3_flash_attn_varlen_func`` takes the *local*
values of ``llama3_flash_attn_prepare_cu_seqlens`` for rank r's slice ``[r*T/P, (r+1)*T/P)``;
the global boundaries are rebuilt from every rank's values (one small exchange) and values it
would not give (another rank, another ``causal``) raise ``ValueError`` on every rank.
``heads_k_stride`` must divide Hkv and is otherwise unused.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenring.api import (
    GroupLike,
    check_flags,
    get_communicator,
    refuse_tangents,
    sequence_parallel_attn,
)
from tokenring.core.layout import Layout, check_int, make_sharding, normalize_cu_seqlens
from tokenring.core.schedule import Strategy
from tokenring.runtime.comm import Communicator

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
]

Result = torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]


# -- checks shared by every shim -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _FlashOptions:
    """The flash-attention options that have no counterpart here, in the originals' order."""

    dropout_p: float
    softcap: float
    alibi_slopes: torch.Tensor | None
    deterministic: bool
    return_attn_probs: bool

    def check(self) -> None:
        """Raise unless the options that have no counterpart are off."""
        dropout_p, softcap = self.dropout_p, self.softcap
        for name, value, want, valid in (
            ("dropout_p", dropout_p, "a number in [0, 1]", lambda x: 0 <= x <= 1),
            ("softcap", softcap, "a number >= 0 (0: off)", lambda x: math.isfinite(x) and x >= 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be {want}; got {value!r}")
            if not valid(value):
                raise ValueError(f"{name} must be {want}; got {value}")
        if dropout_p != 0:
            raise NotImplementedError(
                f"dropout_p must be 0: attention dropout is not supported; got {dropout_p}"
            )
        if softcap > 0:
            raise NotImplementedError(f"softcap is not supported (pass 0.0); got {softcap}")
        if self.alibi_slopes is not None:
            raise NotImplementedError("alibi_slopes is not supported (pass None)")
        check_flags(deterministic=self.deterministic, return_attn_probs=self.return_attn_probs)


def _check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must be a packed (tokens, heads, head_dim) tensor; got {shape}"
            )
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            "q, k and v must hold the same tokens (self-attention); got q.shape[0]="
            f"{q.shape[0]}, k.shape[0]={k.shape[0]}, v.shape[0]={v.shape[0]}"
        )


def _attend(
    comm: Communicator,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    flash: _FlashOptions,
    call: tuple[bool, float | None, Sequence[int]],
    strategy: Strategy | str,
    layout: Layout | str,
    *,
    packed: bool = False,
    check: Callable[[], dict[str, Any]] = dict,
    **options: Any,
) -> Result:
    """Check ``flash`` and run ``check()`` (the shim's checks, returning the options they
    decide) inside the attention call's rank check, then the call with ``call = (causal,
    softmax_scale, window_size)``."""

    def validate() -> tuple[dict[str, Any], None]:
        flash.check()
        if isinstance(strategy, str) and strategy == "auto":
            raise ValueError(
                "strategy='auto' needs hardware=, which these drop-in functions do not take: "
                "name a strategy, or call tokenring.sequence_parallel_attn(q, k, v, "
                "strategy='auto', hardware=...)"
            )
        return check(), None  # no signature: the attention call's check compares them

    options |= comm.agreed(validate, what="attention call")  # sequence_parallel_attn's check
    causal, softmax_scale, window_size = call
    options |= {"strategy": strategy, "causal": causal, "softmax_scale": softmax_scale}
    options |= {"layout": layout, "window_size": window_size}
    q, k, v = (x.unsqueeze(0) for x in qkv) if packed else qkv
    result = sequence_parallel_attn(q, k, v, group=comm, return_lse=True, **options)
    assert isinstance(result, tuple)
    out, lse = result  # (B, s, Hq, D), (B, Hq, s)
    if packed:
        out, lse = out[0], lse[0]  # (t, Hq, D), (Hq, t)
    return (out, lse, None) if flash.return_attn_probs else out


# -- ring-flash-attention ------------------------------------------------------------------------
def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: GroupLike = None,
    *,
    strategy: Strategy | str = Strategy.RING,
) -> Result:
    """ring-flash-attention's ``ring_flash_attn_func``: rank r holds the contiguous tokens
    ``[r*s, (r+1)*s)``. See Note [Shim mapping].

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``.
        strategy: not in the original; see :func:`tokenring.sequence_parallel_attn`.

    Returns:
        out ``(B, s, Hq, D)``, or ``(out, softmax_lse (B, Hq, s), None)``.

    Raises:
        NotImplementedError: dropout_p != 0 or alibi_slopes; ValueError: as
            :func:`tokenring.sequence_parallel_attn`.
    """
    flash = _FlashOptions(dropout_p, 0.0, alibi_slopes, deterministic, return_attn_probs)
    call = (causal, softmax_scale, window_size)
    return _attend(get_communicator(group), (q, k, v), flash, call, strategy, Layout.CONTIGUOUS)


def zigzag_ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: GroupLike = None,
    *,
    strategy: Strategy | str = Strategy.RING,
) -> Result:
    """ring-flash-attention's ``zigzag_ring_flash_attn_func``: rank r holds chunks r and
    2P-1-r of 2P (``layout="zigzag"``); ``causal=False`` works too. As
    :func:`ring_flash_attn_func`, with s even (ValueError otherwise).
    """
    flash = _FlashOptions(dropout_p, 0.0, alibi_slopes, deterministic, return_attn_probs)
    call = (causal, softmax_scale, window_size)
    return _attend(get_communicator(group), (q, k, v), flash, call, strategy, Layout.ZIGZAG)


def llama3_flash_attn_prepare_cu_seqlens(
    cu_seqlens: torch.Tensor, causal: bool, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, int, int, slice]:
    """ring-flash-attention's ``llama3_flash_attn_prepare_cu_seqlens``: the local arguments of
    :func:`llama3_flash_attn_varlen_func` for ``rank``, which holds the packed tokens
    ``[rank*L, (rank+1)*L)``, L = T / world_size.

    Args:
        cu_seqlens: ``(num_docs + 1,)`` integer tensor, the global boundaries ``(0, ..., T)``.
        causal: whether the keys of the last document end at this rank's last token.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: the
        documents cut to this rank's tokens (0 to L, cu_seqlens' dtype and device), the same
        from the first document's start to the keys' end, the longest of each, and the
        keys' global token range.

    Raises:
        ValueError: cu_seqlens not a 1-D integer tensor from 0, non-decreasing; T not a
            multiple of world_size (or 0); rank not in [0, world_size).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor; got {type(cu_seqlens).__name__}"
        )
    check_flags(causal=causal)
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
    raw = _int_list("cu_seqlens", cu_seqlens)  # keeps empty documents, as the original does
    total = raw[-1] if raw else 0
    normalize_cu_seqlens(raw, total, name="cu_seqlens")  # from 0, non-decreasing
    if total < world_size or total % world_size:
        raise ValueError(
            f"cu_seqlens[-1] (the packed length) must be a positive multiple of world_size="
            f"{world_size}; got {total}"
        )
    length = total // world_size
    lo, hi = rank * length, (rank + 1) * length
    first = bisect.bisect_left(raw, lo)  # first boundary at or after this rank's start
    if raw[first] != lo:
        first -= 1  # the document that runs into this rank starts before it
    last = bisect.bisect_left(raw, hi)  # first boundary at or after this rank's end
    docs = raw[first : last + 1]  # the boundaries of every document this rank's tokens touch
    k_start = docs[0]
    k_stop = hi if causal else docs[-1]
    cu_q = [0, *(b - lo for b in docs[1:-1]), length]
    cu_k = [0, *(b - k_start for b in docs[1:-1]), k_stop - k_start]

    q_bounds, k_bounds = (
        torch.tensor(b, dtype=cu_seqlens.dtype, device=cu_seqlens.device) for b in (cu_q, cu_k)
    )
    return q_bounds, k_bounds, _longest(cu_q), _longest(cu_k), slice(k_start, k_stop)


def _longest(bounds: Sequence[int]) -> int:
    """The longest document of boundaries ``(0, ..., T)``."""
    return max(b - a for a, b in itertools.pairwise(bounds))


def _int_list(name: str, x: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor; got dtype {x.dtype}, shape {tuple(x.shape)}"
            )
        return [int(b) for b in x.tolist()]
    try:
        return [operator.index(b) for b in x]
    except TypeError:
        raise ValueError(
            f"{name} must be a 1-D integer tensor or a list of ints; got {x!r}"
        ) from None


def _llama3_global_cu_seqlens(
    comm: Communicator, mine: dict[str, Any], problem: Exception | None, causal: bool
) -> tuple[int, ...]:
    """The global boundaries ``(0, ..., T)`` from every rank's prepared values (``mine``, or
    ``{"invalid": why}``); every rank raises when a rank's are wrong (the failing rank its own
    error)."""
    rows = comm.all_gather_object(mine, what="the llama3 boundaries")
    if problem is not None:
        raise problem
    invalid = [(r, row["invalid"]) for r, row in enumerate(rows) if "invalid" in row]
    if invalid:
        raise ValueError(
            "; ".join(f"rank {r} cannot run this attention call: {why}" for r, why in invalid)
        )
    causals = [row["causal"] for row in rows]
    if len(set(causals)) != 1:  # each rank would check the others' values with its own
        differ = ", ".join(f"rank {r} has {c}" for r, c in enumerate(causals) if c != causals[0])
        raise ValueError(
            f"ranks disagree on this attention call: causal: rank 0 has {causals[0]}, {differ}"
        )
    lengths = {row["length"] for row in rows}
    if len(lengths) != 1:
        raise ValueError(
            "every rank must hold the same number of tokens (q.shape[0]) for "
            f"llama3_flash_attn_varlen_func; got {[row['length'] for row in rows]} by rank"
        )
    length = lengths.pop()
    total = length * comm.world_size
    # each boundary is a key start or an inner boundary of the rank whose tokens hold it
    found = {0, total}
    for row in rows:
        start = row["k_start"]
        found |= {start} | {start + b for b in row["cu_k"][1:-1]}
    bounds = tuple(sorted(b for b in found if 0 <= b <= total))
    _check_prepared(rows, bounds, causal)
    return bounds


def _check_prepared(rows: list[dict[str, Any]], bounds: tuple[int, ...], causal: bool) -> None:
    """Raise ValueError when a rank's ``rows`` are not what
    :func:`llama3_flash_attn_prepare_cu_seqlens` gives it for ``bounds``."""
    world_size = len(rows)
    cu = torch.tensor(bounds, dtype=torch.int64)
    for r, row in enumerate(rows):
        cu_q, cu_k, _, _, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, causal, r, world_size)
        expected = _prepared(cu_q.tolist(), cu_k.tolist(), k_slice.start, k_slice.stop)
        got = _prepared(row["cu_q"], row["cu_k"], row["k_start"], row["k_stop"])
        diffs = [
            f"{n} {got[n]} (expected {want})" for n, want in expected.items() if got[n] != want
        ]
        if diffs:
            raise ValueError(
                f"rank {r} passed " + ", ".join(diffs) + " : not what "
                f"llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal={causal}, rank={r}, "
                f"world_size={world_size}) gives for the document boundaries the ranks "
                f"hold together, {list(bounds)} (prepared for another rank, world size or "
                "causal?)"
            )


def _prepared(cu_q: list[int], cu_k: list[int], k_start: int, k_stop: int) -> dict[str, list[int]]:
    """The values :func:`_check_prepared` compares (repeats of empty documents dropped)."""
    return {
        "cu_seqlens_q": sorted(set(cu_q)),
        "cu_seqlens_k": sorted(set(cu_k)),
        "local_k_slice": [k_start, k_stop],
    }


def llama3_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    heads_k_stride: int,
    local_k_slice: slice,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: GroupLike = None,
    *,
    strategy: Strategy | str = Strategy.ALLGATHER_KV,
) -> Result:
    """ring-flash-attention's ``llama3_flash_attn_varlen_func``: rank r holds the packed
    tokens ``[r*L, (r+1)*L)`` of T = P*L. See Note [Shim mapping].

    Args:
        q: ``(L, Hq, D)``; k, v: ``(L, Hkv, D)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice: as
            :func:`llama3_flash_attn_prepare_cu_seqlens` returns them (max lengths: upper
            bounds).
        heads_k_stride: must divide Hkv; unused otherwise.
        strategy: not in the original; see :func:`tokenring.sequence_parallel_attn`.

    Returns:
        out ``(L, Hq, D)``, or ``(out, softmax_lse (Hq, L), None)`` with ``return_attn_probs``.

    Raises:
        NotImplementedError: dropout_p != 0 or alibi_slopes given.
        ValueError: on every rank: local values that do not fit together; ranks holding
            different numbers of tokens; and as :func:`tokenring.sequence_parallel_attn`.
    """
    # inside a torch.func transform the boundaries' exchange cannot run (Note [Forward-mode
    # AD] in tokenring.api): it raised "Cannot access data pointer"
    refuse_tangents({"q": q, "k": k, "v": v}, before_exchange=True)
    comm = get_communicator(group)
    flash = _FlashOptions(dropout_p, 0.0, alibi_slopes, deterministic, return_attn_probs)
    cu_seqlens, max_seqlen = (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)
    try:
        flash.check()
        mine = _llama3_local(q, k, v, cu_seqlens, max_seqlen, heads_k_stride, local_k_slice, causal)
        problem = None
    except (ValueError, NotImplementedError) as exc:
        mine, problem = {"invalid": str(exc)}, exc
    bounds = _llama3_global_cu_seqlens(comm, mine, problem, causal)
    call = (causal, softmax_scale, window_size)
    layout = Layout.CONTIGUOUS
    return _attend(comm, (q, k, v), flash, call, strategy, layout, packed=True, cu_seqlens=bounds)


def _llama3_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor],
    max_seqlen: tuple[int, int],
    heads_k_stride: int,
    local_k_slice: slice,
    causal: bool,
) -> dict[str, Any]:
    """This rank's arguments of :func:`llama3_flash_attn_varlen_func`, checked."""
    cu_seqlens_q, cu_seqlens_k = cu_seqlens
    max_seqlen_q, max_seqlen_k = max_seqlen
    _check_packed(q, k, v)
    check_flags(causal=causal)
    hkv = k.shape[1]
    if isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int):
        raise ValueError(f"heads_k_stride must be an int dividing heads_kv; got {heads_k_stride!r}")
    if heads_k_stride < 1 or hkv % heads_k_stride:
        raise ValueError(f"heads_k_stride must divide heads_kv={hkv}; got {heads_k_stride}")
    if not (
        isinstance(local_k_slice, slice)
        and all(isinstance(x, int) for x in (local_k_slice.start, local_k_slice.stop))
        and local_k_slice.step in (None, 1)
    ):
        raise ValueError(
            f"local_k_slice must be a slice(start, stop) of ints; got {local_k_slice!r}"
        )
    cu_q = _int_list("cu_seqlens_q", cu_seqlens_q)
    cu_k = _int_list("cu_seqlens_k", cu_seqlens_k)
    if len(cu_q) < 2 or cu_q[0] != 0 or cu_q[-1] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must run from 0 to q.shape[0]={q.shape[0]} (this rank's tokens); "
            f"got {cu_q}"
        )
    if len(cu_k) != len(cu_q):
        raise ValueError(
            f"cu_seqlens_k must have as many entries as cu_seqlens_q ({len(cu_q)}); got {cu_k}"
        )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, cu_q, " of cu_seqlens_q")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, cu_k, " of cu_seqlens_k")
    start, stop = local_k_slice.start, local_k_slice.stop
    row = {"length": q.shape[0], "cu_q": cu_q, "cu_k": cu_k, "k_start": start, "k_stop": stop}
    return row | {"causal": causal}


def _check_max_seqlen(name: str, bound: object, bounds: Sequence[int], of: str = "") -> None:
    """ValueError unless ``bound`` is an int at least the longest document of ``bounds``."""
    longest = _longest(bounds)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < longest:
        raise ValueError(
            f"{name} must be an int >= the longest document{of} ({longest}); got {bound!r}"
        )


# -- flash-attn ----------------------------------------------------------------------------------
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    group: GroupLike = None,
    layout: Layout | str = Layout.CONTIGUOUS,
    strategy: Strategy | str = Strategy.TOKEN_RING,
    seq_len: int | None = None,
) -> Result:
    """flash-attn's ``flash_attn_func`` over a sequence sharded across ``group``. See
    Note [Shim mapping].

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``.
        group, layout, strategy, seq_len: not in the original; see
            :func:`tokenring.sequence_parallel_attn`.

    Returns:
        out ``(B, s, Hq, D)``, or ``(out, softmax_lse (B, Hq, s), None)``.

    Raises:
        NotImplementedError: dropout_p != 0, softcap > 0 or alibi_slopes; ValueError: as
            :func:`tokenring.sequence_parallel_attn`.
    """
    flash = _FlashOptions(dropout_p, softcap, alibi_slopes, deterministic, return_attn_probs)
    call = (causal, softmax_scale, window_size)
    return _attend(
        get_communicator(group), (q, k, v), flash, call, strategy, layout, seq_len=seq_len
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    group: GroupLike = None,
    layout: Layout | str = Layout.CONTIGUOUS,
    strategy: Strategy | str = Strategy.TOKEN_RING,
) -> Result:
    """flash-attn's ``flash_attn_varlen_func`` over packed documents sharded across ``group``:
    ``cu_seqlens_q`` (equal to ``cu_seqlens_k``) holds the *global* boundaries (Note [Shim
    mapping]).

    Args:
        q: ``(t, Hq, D)``; k, v: ``(t, Hkv, D)``.
        max_seqlen_q, max_seqlen_k: at least the longest document.
        group, layout, strategy: not in the original; see
            :func:`tokenring.sequence_parallel_attn`.

    Returns:
        out ``(t, Hq, D)``, or ``(out, softmax_lse (Hq, t), None)`` with ``return_attn_probs``.

    Raises:
        NotImplementedError: dropout_p != 0, softcap > 0, alibi_slopes or block_table given;
            cu_seqlens_k different from cu_seqlens_q (cross-attention).
        ValueError: malformed cu_seqlens; max_seqlen below the longest document; a t that is
            not this rank's share; and as :func:`tokenring.sequence_parallel_attn`.
    """
    comm = get_communicator(group)

    def check() -> dict[str, Any]:  # the global documents, and this rank's share of them
        if block_table is not None:
            raise NotImplementedError("block_table (a paged KV cache) is not supported (pass None)")
        _check_packed(q, k, v)
        bounds = _varlen_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        sharding = make_sharding(
            layout=layout, world_size=comm.world_size, seq_len=bounds[-1], cu_seqlens=bounds
        )
        expected = sharding.local_len(comm.rank)
        if q.shape[0] != expected:
            raise ValueError(
                f"q.shape[0] must be {expected} on rank {comm.rank}: its share of the "
                f"{bounds[-1]} packed tokens of cu_seqlens_q under layout "
                f"'{sharding.layout.value}' (see tokenring.shard with seq_dim=0); got "
                f"{q.shape[0]}"
            )
        return {"seq_len": bounds[-1], "cu_seqlens": bounds}

    flash = _FlashOptions(dropout_p, softcap, alibi_slopes, deterministic, return_attn_probs)
    call = (causal, softmax_scale, window_size)
    return _attend(comm, (q, k, v), flash, call, strategy, layout, packed=True, check=check)


def _varlen_bounds(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int
) -> tuple[int, ...]:
    """The global document boundaries of :func:`flash_attn_varlen_func`, checked."""
    cu_q = _int_list("cu_seqlens_q", cu_seqlens_q)
    cu_k = _int_list("cu_seqlens_k", cu_seqlens_k)
    if cu_q != cu_k:
        raise NotImplementedError(
            "cu_seqlens_k must equal cu_seqlens_q (self-attention over the same packed "
            f"documents); got {cu_q} and {cu_k}"
        )
    bounds = normalize_cu_seqlens(cu_q, max(cu_q[-1], 0) if cu_q else 0, name="cu_seqlens_q")
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, bounds)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, bounds)
    return bounds
