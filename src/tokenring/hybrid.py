"""2-D sequence parallelism: Ulysses inside a fast island, a ring strategy across islands.

This module is the public face of the hybrid (USP-like) strategy (Note [Hybrid schedule] in
``tokenring.strategies.hybrid``): the mesh, the layout of a rank's shard (Note [Hybrid
layout]), and :func:`hybrid_attn`, which validates, plans and runs a call
(``tokenring.runtime.hybrid``).

Legend: B batch, S global seq, s local seq, Hq / Hkv heads, D head dim, P_out outer ranks,
P_in inner ranks, nq = Hq / P_in and nkv = Hkv / P_in (heads of one inner rank).

Note [Hybrid layout]
~~~~~~~~~~~~~~~~~~~~
The outer axis shards the sequence in the caller's layout over P_out ranks; inside an outer
shard the P_in inner ranks hold consecutive slices, so the inner all-to-all gives every inner
rank the whole outer shard for Hq / P_in heads: what the ring expects. P_out = P_in = 2,
zigzag, 8 chunks::

    outer rank 0 shard: c0 c7   ->  inner 0: first half of (c0 c7) = c0,  inner 1: c7
    outer rank 1 shard: c1 c6   ->  inner 0: c1,                          inner 1: c6

    after the inner all-to-all, each rank of outer rank 0 holds (c0 c7) for half the heads

Any length and packed documents follow the same rule (Note [Documents and padding] in
``tokenring.core.layout``): each outer shard of L_o tokens is cut into P_in consecutive slices
of near-equal length, longer first, and the inner all-to-all has uneven splits. Documents
d0 = 5, d1 = 6 tokens, P_out = P_in = 2, zigzag::

    outer rank 0 shard (L_0 = 6): d0[0:2] d1[0:2] | d0[4:5] d1[5:6]  ->  inner 0: 3 rows, 1: 3
    outer rank 1 shard (L_1 = 5): d0[2:3] d1[2:4] | d0[3:4] d1[4:5]  ->  inner 0: 3 rows, 1: 2

Hq and Hkv must both be divisible by P_in, else NotImplementedError (``ulysses_attn`` splits
heads unevenly).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import (
    _bounds_digest,
    _validate,
    get_communicator,
    last_block_splits_for,
    refuse_tangents,
)
from tokenring.core.layout import (
    Layout,
    Sharding,
    _check_seq_dim,
    check_int,
    global_length,
    make_sharding,
)
from tokenring.core.masks import chunk_documents, normalize_window
from tokenring.core.schedule import Pass, Strategy
from tokenring.runtime.hybrid import HybridPlan, hybrid_attention
from tokenring.runtime.kernels import BlockKernel, select_kernel
from tokenring.strategies.hybrid import (
    _OUTER_NAMES,
    HybridSchedule,
    HybridSpec,
    build_hybrid_schedule,
    inner_slices,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridMesh:
    """The two process groups of a 2-D sequence-parallel mesh: every inner group holds ranks
    of one outer rank, every outer group ranks of one inner rank (as a 2-D grid's rows and
    columns; ``hybrid_attn`` checks it with ``check_ranks``)."""

    outer: dist.ProcessGroup
    """Across islands: the ring strategy runs here."""
    inner: dist.ProcessGroup
    """Inside an island: the all-to-all runs here."""

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> HybridMesh:
        """The groups of a 2-D ``DeviceMesh`` ``(outer, inner)``, e.g.
        ``world_mesh["sp_outer", "sp_inner"]``.

        Raises:
            ValueError: not a DeviceMesh of 2 dimensions.
        """
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            got = f"ndim={mesh.ndim}" if isinstance(mesh, DeviceMesh) else type(mesh).__name__
            raise ValueError(f"mesh must be a 2-D DeviceMesh (outer, inner); got {got}")
        return cls(outer=mesh.get_group(0), inner=mesh.get_group(1))

    @property
    def outer_size(self) -> int:
        return dist.get_world_size(self.outer)

    @property
    def inner_size(self) -> int:
        return dist.get_world_size(self.inner)


def hybrid_mesh(outer: int, inner: int, *, device_type: str = "cpu") -> HybridMesh:
    """The groups of the default group, rank = outer_rank * inner + inner_rank (inner ranks are
    neighbours, e.g. one node's GPUs). Collective.

    Args:
        outer, inner: the mesh's sizes; outer * inner is the world size.
        device_type: of the ``DeviceMesh`` built over the default group (``"cpu"``,
            ``"cuda"``).

    Raises:
        ValueError: outer * inner differs from the world size, or a size < 1.
    """
    for name, size in (("outer", outer), ("inner", inner)):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{name} must be an int; got {size!r}")
    world = dist.get_world_size()
    if outer < 1 or inner < 1 or outer * inner != world:
        raise ValueError(
            f"outer x inner must equal the world size {world} with both >= 1; got {outer} x {inner}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (outer, inner), mesh_dim_names=("outer", "inner"))
    return HybridMesh(outer=mesh.get_group("outer"), inner=mesh.get_group("inner"))


def _outer_lengths(
    layout: Layout | str,
    outer: int,
    inner: int,
    seq_local: int | None,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
) -> Sharding:
    """The outer sharding (over P_out ranks), from exactly one of ``seq_local`` (every rank
    holds that many tokens) and ``seq_len``."""
    layout = Layout.parse(layout)
    seq_len = global_length(outer, seq_local, seq_len, layout, inner=inner)
    if seq_local is not None and cu_seqlens is not None:
        raise ValueError("cu_seqlens needs seq_len (the global length it ends at)")
    return make_sharding(layout=layout, world_size=outer, seq_len=seq_len, cu_seqlens=cu_seqlens)


def hybrid_positions(
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    layout: Layout | str,
    seq_local: int | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Global positions of one rank's shard (Note [Hybrid layout]), e.g. for RoPE. Give
    ``seq_local`` (S = P_out * P_in * s) or ``seq_len`` (any S; optionally ``cu_seqlens``),
    as :func:`hybrid_attn` will get them.

    Returns:
        int64 ``(s_r,)``, this rank's number of tokens.

    Raises:
        ValueError: ranks or sizes out of range; both or neither of seq_local and seq_len;
            a seq_local the outer layout cannot split; bad cu_seqlens.
    """
    if outer < 1 or inner < 1 or not (0 <= outer_rank < outer and 0 <= inner_rank < inner):
        raise ValueError(
            f"need 0 <= outer_rank < outer and 0 <= inner_rank < inner; got outer_rank="
            f"{outer_rank}, outer={outer}, inner_rank={inner_rank}, inner={inner}"
        )
    sharding = _outer_lengths(layout, outer, inner, seq_local, seq_len, cu_seqlens)
    lo, hi = inner_slices(sharding.local_len(outer_rank), inner)[inner_rank]
    return sharding.positions(outer_rank)[lo:hi]


def hybrid_shard(
    x: torch.Tensor,
    *,
    outer_rank: int,
    inner_rank: int,
    outer: int,
    inner: int,
    layout: Layout | str,
    seq_dim: int = 1,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's shard of a global ``(B, S, H, D)`` tensor (Note [Hybrid layout]). Any S;
    unless ``P_out * P_in`` (zigzag: twice that) divides S and there are no documents,
    :func:`hybrid_attn` needs ``seq_len=S`` (and the same ``cu_seqlens``).

    Args:
        x: the global tensor.
        outer_rank, inner_rank: this rank's place on the mesh (``outer_rank * inner +
            inner_rank``, as :func:`hybrid_mesh` numbers the ranks).
        outer, inner: the mesh's sizes.
        layout: the outer axis' layout, as :func:`hybrid_attn`'s.
        seq_dim: the sequence dimension of ``x``.
        cu_seqlens: document boundaries ``(0, ..., S)`` of a packed sequence.

    Returns:
        ``(B, s_r, H, D)``, contiguous.
    """
    _check_seq_dim(x, seq_dim)
    index = hybrid_positions(
        outer_rank=outer_rank,
        inner_rank=inner_rank,
        outer=outer,
        inner=inner,
        layout=layout,
        seq_len=x.shape[seq_dim],
        cu_seqlens=cu_seqlens,
    )
    return x.index_select(seq_dim, index.to(x.device)).contiguous()


@functools.lru_cache(maxsize=64)
def _schedules(spec: HybridSpec, **options: Any) -> tuple[HybridSchedule, HybridSchedule]:
    """The forward and backward schedules of a call, built once per call shape."""
    forward, backward = (build_hybrid_schedule(p, spec=spec, **options) for p in Pass)
    return forward, backward


@torch.compiler.disable  # not compiled yet: runs eagerly after a graph break (README)
def hybrid_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: HybridMesh,
    outer_strategy: Strategy | str = Strategy.TOKEN_RING,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: Layout | str = Layout.CONTIGUOUS,
    return_lse: bool = False,
    kernel: str | BlockKernel | None = None,
    last_block_splits: int | None = None,
    check_ranks: bool = True,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded on a 2-D mesh (Note [Hybrid layout]).

    Args:
        q: ``(B, s, Hq, D)``; k, v: ``(B, s, Hkv, D)``: this rank's hybrid shard
            (:func:`hybrid_shard`).
        mesh: the outer and inner groups (:func:`hybrid_mesh`).
        outer_strategy: ring strategy across the outer axis: one whose ``Strategy.is_ring`` holds.
        layout: the outer axis' layout (zigzag balances causal work).
        check_ranks: agree on the call first, on the inner then the outer group.
        seq_len: the global length S when the ranks' lengths differ; None: S = P * s.
        cu_seqlens: document boundaries ``(0, ..., S)`` (needs seq_len).
        causal, softmax_scale, return_lse: as :func:`tokenring.sequence_parallel_attn`.
        kernel, last_block_splits, window_size, attention_chunk_size: as
            :func:`tokenring.sequence_parallel_attn` (masks over global positions; None
            ``last_block_splits``: what the outer group's communicator path takes).

    Returns:
        out ``(B, s, Hq, D)``, or ``(out, lse)`` with lse ``(B, Hq, s)``, which carries its
        gradient (Note [Gradient of lse] in tokenring.runtime.op).

    Raises:
        NotImplementedError: Hq or Hkv not divisible by the inner size; a collective strategy
            on the outer axis.
        ValueError: a mesh that is not a HybridMesh; a local length that is not this rank's
            share (see hybrid_shard); ranks that disagree; as
            :func:`tokenring.sequence_parallel_attn` (with check_ranks, every rank raises).
    """
    options = {
        name: value
        for name, value in locals().items()
        if name not in ("q", "k", "v", "mesh", "return_lse", "check_ranks")
    }  # what _prepare validates
    if not isinstance(mesh, HybridMesh):  # no groups to tell the peers on
        raise ValueError(
            "mesh must be a HybridMesh (tokenring.hybrid.hybrid_mesh, or "
            f"HybridMesh.from_device_mesh for a 2-D DeviceMesh); got {type(mesh).__name__}"
        )
    refuse_tangents({"q": q, "k": k, "v": v}, before_exchange=True)  # Note [Forward-mode AD]
    flags = {"check_ranks": check_ranks, "return_lse": return_lse}
    out, lse = hybrid_attention(_agreed_plan(q, k, v, mesh, flags, options), q, k, v)
    return (out, lse) if return_lse else out


def _agreed_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: HybridMesh,
    flags: dict[str, Any],
    options: dict[str, Any],
) -> HybridPlan:
    """This rank's plan of the call, once the ranks agree (unless ``check_ranks`` is False;
    one that is not a bool is an error the peers learn, as a bad ``return_lse``)."""
    plan: HybridPlan | None = None
    signature: dict[str, Any] | None = None
    problem: Exception | None = None
    check_ranks = flags["check_ranks"] is not False
    # built first, in one order on every rank: a communicator's first build makes process
    # groups, which every rank must make in the same order (else they wait for each other)
    communicators = {"outer": get_communicator(mesh.outer), "inner": get_communicator(mesh.inner)}
    try:
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool; got {flag!r}")
        plan, signature = _prepare(q, k, v, mesh, **options)
    except (ValueError, NotImplementedError) as exc:
        problem = exc
    # the mesh too: an outer ring must pair the ranks that hold the same heads (one inner rank
    # per outer group, one outer rank per inner group), else it mixes heads silently
    same = (
        ("inner", {"outer rank (one per inner group)": dist.get_rank(mesh.outer)}),
        ("outer", {"inner rank (one per outer group)": dist.get_rank(mesh.inner)}),
    )
    for group, rank in same if check_ranks else ():
        mine = None if signature is None else signature | rank
        try:  # together: every rank
            communicators[group].agree(mine, problem, what="hybrid attention call")
        except (ValueError, NotImplementedError) as exc:  # the outer group learns it too
            # (agree re-raises this rank's own problem, of either type: a group of one rank
            # raises it without an exchange, and the outer group must still hear of it)
            problem, signature = problem or exc, None
    if problem is not None:
        raise problem
    assert plan is not None
    return plan


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: HybridMesh,
    *,
    outer_strategy: Strategy | str,
    causal: bool,
    softmax_scale: float | None,
    layout: Layout | str,
    kernel: str | BlockKernel | None,
    last_block_splits: int | None,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
    window_size: Sequence[int] | int | None,
    attention_chunk_size: int | None,
) -> tuple[HybridPlan, dict[str, Any]]:
    """Validate and plan one rank's call; its signature (what the ranks compare). No
    communication."""
    p_in = mesh.inner_size
    outer = get_communicator(mesh.outer)
    strategy = _checked(q, k, v, p_in, outer_strategy, causal, softmax_scale, last_block_splits)
    if last_block_splits is None:  # Note [Last block slices] in tokenring.api
        last_block_splits = last_block_splits_for(outer.path(q.device))
    layout = Layout.parse(layout)
    window = normalize_window(window_size, causal=causal)
    chunk_documents((0, 1), attention_chunk_size)  # validates it
    sharding = _outer_sharding(q, mesh, layout, seq_len, cu_seqlens)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    plan = HybridPlan(
        schedules=_schedules(
            HybridSpec(inner=p_in, outer_strategy=strategy),
            layout=layout,
            causal=causal,
            world_size=p_in * mesh.outer_size,
            heads_q=q.shape[2],
            heads_kv=k.shape[2],
            last_block_splits=last_block_splits,
            seq_len=sharding.seq_len,
            cu_seqlens=sharding.cu_seqlens,
            window_size=window,
            attention_chunk_size=attention_chunk_size,
        ),
        inner=get_communicator(mesh.inner),
        outer=outer,
        kernel=select_kernel(q.device, q.dtype, kernel, seq_local=sharding.seq_local),
        scale=scale,
        heads=(q.shape[2], k.shape[2]),
    )
    options = {
        "causal": causal,
        "layout": layout.value,
        "outer_strategy": strategy.value,
        "softmax_scale": float(scale).hex(),
        "window_size": list(window),
        "cu_seqlens": _bounds_digest(sharding.cu_seqlens if seq_len is not None else ()),
        "attention_chunk_size": attention_chunk_size,
        "last_block_splits": last_block_splits,
    }
    return plan, _signature(q, k, v, seq_len, options, plan)


def _signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int | None,
    options: dict[str, Any],
    plan: HybridPlan,
) -> dict[str, Any]:
    """What the ranks compare: shapes, dtype, device, ``options``, kernel, needs grad."""
    return {
        "batch": q.shape[0],
        ("seq_len" if seq_len is not None else "seq_local"): seq_len or q.shape[1],
        "heads_q": q.shape[2],
        "heads_kv": k.shape[2],
        "head_dim": q.shape[3],
        "dtype": str(q.dtype),
        "device type": q.device.type,
        **options,
        "kernel": plan.kernel.name,
        # every rank builds the backward, or none does (its all-to-alls need every rank)
        "needs grad": torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)),
    }


def _checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p_in: int,
    outer_strategy: Strategy | str,
    causal: bool,
    softmax_scale: float | None,
    last_block_splits: int | None,
) -> Strategy:
    """The outer strategy, once it and the tensors (no forward-mode tangent), causal and
    last_block_splits (None, or an int >= 1 for a pass-Q outer strategy) are checked."""
    refuse_tangents({"q": q, "k": k, "v": v})  # Note [Forward-mode AD] in tokenring.api
    strategy = Strategy.parse(outer_strategy)
    if not strategy.is_ring:
        raise NotImplementedError(
            f"outer_strategy must be a ring strategy ({_OUTER_NAMES}); got {strategy.value!r}"
        )
    _validate(q, k, v, softmax_scale)  # tensors, dims, dtypes, devices, heads, scale
    for name, x in (("q", q), ("k", k)):
        if x.shape[2] % p_in:
            raise NotImplementedError(
                f"{name} heads must be divisible by the inner size {p_in} for hybrid_attn; "
                f"got shape {tuple(x.shape)} (ulysses_attn splits heads unevenly)"
            )
    if strategy is Strategy.BIDIR_TOKEN_RING and q.shape[2] < 2 * p_in:
        raise NotImplementedError(
            "outer_strategy 'bidir_token_ring' sends half of an inner rank's Hq / P_in query "
            f"heads each way round the ring and needs Hq >= 2 * P_in; got Hq={q.shape[2]} with "
            f"inner size P_in={p_in} (use 'token_ring')"
        )
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool; got {causal!r}")
    if last_block_splits is None:
        return strategy
    if isinstance(last_block_splits, bool) or not isinstance(last_block_splits, int):
        raise ValueError(f"last_block_splits must be an int >= 1; got {last_block_splits!r}")
    if last_block_splits < 1:
        raise ValueError(f"last_block_splits must be >= 1; got {last_block_splits}")
    if not strategy.passes_q:
        raise ValueError(
            f"last_block_splits is read only by the pass-Q outer strategies ('token_ring', "
            f"'bidir_token_ring'); got last_block_splits={last_block_splits} with "
            f"outer_strategy={strategy.value!r} (leave it None)"
        )
    return strategy


def _outer_sharding(
    q: torch.Tensor,
    mesh: HybridMesh,
    layout: Layout,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
) -> Sharding:
    """The outer sharding of the call, with this rank's length checked against ``q``'s."""
    p_in = mesh.inner_size
    inner_rank, outer_rank = dist.get_rank(mesh.inner), dist.get_rank(mesh.outer)
    if seq_len is not None:
        check_int("seq_len", seq_len, 0)
    seq_local = q.shape[1] if seq_len is None else None  # None: S = P * s
    sharding = _outer_lengths(layout, mesh.outer_size, p_in, seq_local, seq_len, cu_seqlens)
    lo, hi = inner_slices(sharding.local_len(outer_rank), p_in)[inner_rank]
    if q.shape[1] != hi - lo:  # always equal without seq_len
        raise ValueError(
            f"q.shape[1] must be {hi - lo} on outer rank {outer_rank}, inner "
            f"rank {inner_rank}: its share of seq_len={seq_len} (see "
            f"tokenring.hybrid_shard); got {q.shape[1]}"
        )
    return sharding
