"""Public entry points (``sequence_parallel_attn``, one function per strategy, the
``SequenceParallelAttention`` module): validation at the boundary, the ranks' agreement, and the
custom operators that autograd and torch.compile see (Note [The attention operator]).

Legend: B batch, s local seq, Hq query heads, Hkv kv heads, D head dim, P world size.
"""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import math
import numbers
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

from tokenring.core.layout import Layout, Sharding, make_sharding, validate_seq_local
from tokenring.core.masks import MaskSpec, chunk_documents, normalize_window
from tokenring.core.schedule import Pass, Strategy
from tokenring.model import planner
from tokenring.model.costmodel import Hardware, preset
from tokenring.runtime import op
from tokenring.runtime.comm import (
    Communicator,
    check_timeout_s,
    clear_group_defaults,
    destroy_idle_groups,
    forget_destroyed_groups,
)
from tokenring.runtime.kernels import BlockKernel, accumulation_dtype, select_kernel
from tokenring.strategies import build_schedule

__all__ = [
    "SequenceParallelAttention",
    "allgather_kv_attn",
    "bidir_ring_attn",
    "bidir_token_ring_attn",
    "close_communicators",
    "get_communicator",
    "resolve_strategy",
    "ring_attn",
    "sequence_parallel_attn",
    "token_ring_attn",
    "ulysses_attn",
]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

# Note [Communicator cache]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A Communicator passed as ``group=`` is used as it is, never cached. For a ProcessGroup (a
# mesh: its group; None: the default group) ``get_communicator`` keeps one Communicator per
# group in ``_COMMUNICATORS``, so its channel groups (Note [Channel pool] in
# tokenring.runtime.comm) and timeout are built once. Who fills it:
#
#     get_communicator(group)     every attention, KV-cache and hybrid call, and you
#     init_distributed()          the default group's, with its timeout (and returns it)
#     launch's ranks              the default group's, with pg_timeout_s, before fn runs
#
# An entry is released (closed, its channel groups pooled, dropped):
#
#     1. by the first get_communicator call after destroy_process_group destroyed its group
#        (torch.distributed has no destruction hook; until then the Communicator refuses
#        every call: ``group_alive`` is False);
#     2. by close_communicators() (every entry; launch runs it before destroying its groups);
#     3. at interpreter exit (atexit runs close_communicators).
#
# Released channel groups are pooled, never destroyed while the world lives (Note [Group
# names] in tokenring.runtime.comm); at exit destroy_idle_groups destroys them.
_COMMUNICATORS: dict[dist.ProcessGroup, Communicator] = {}

GroupLike = Any  # ProcessGroup | DeviceMesh (1-D) | Communicator | None


def get_communicator(group: GroupLike = None, *, timeout_s: float | None = None) -> Communicator:
    """The communicator for ``group``: a ProcessGroup, a 1-D DeviceMesh, a Communicator (used
    as is) or None (the default group); built once per group (Note [Communicator cache]).

    Args:
        group: ProcessGroup, 1-D DeviceMesh, Communicator, or None (default group).
        timeout_s: the limit of any transfer or collective of it from now on (default 300 s
            when it is built here), a Communicator's too.

    Raises:
        ValueError: a DeviceMesh with more than one dimension, or an unsupported object;
            timeout_s not a number of seconds > 0 (below 1e7).
        RuntimeError: torch.distributed is not initialised.
    """
    if timeout_s is not None:
        check_timeout_s(timeout_s)
    if isinstance(group, Communicator):
        if timeout_s is not None:
            group.timeout = timedelta(seconds=timeout_s)
        return group
    group = check_group(group)
    for cached in [c for c in _COMMUNICATORS.values() if not c.group_alive]:
        del _COMMUNICATORS[cached.group]
        cached.close()
    if group is not None:
        op.remember_group(group)  # a compiled call names its group (Note [Handles] in op)
    comm = _cached(group)
    if comm is None:
        comm = Communicator(group, timeout_s=timeout_s if timeout_s is not None else 300.0)
        _COMMUNICATORS[comm.group] = comm
    elif timeout_s is not None:
        comm.timeout = timedelta(seconds=timeout_s)
    return comm


def check_group(group: GroupLike) -> dist.ProcessGroup | Communicator | None:
    """``group`` as a process group (a 1-D DeviceMesh's) or the Communicator it is, without
    building a communicator.

    Raises:
        ValueError: a DeviceMesh with more than one dimension, an unsupported object, or a
            group this rank is not in.
    """
    if isinstance(group, Communicator):
        return group
    group = _mesh_group(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"group must contain this rank; got the group that dist.new_group returns on a rank "
            f"outside its ranks (GroupMember.NON_GROUP_MEMBER) on global rank "
            f"{dist.get_rank()}: call attention with a group only on its own ranks"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            "group must be a ProcessGroup, a 1-D DeviceMesh, a Communicator or None; "
            f"got {type(group).__name__}"
        )
    return group


def check_softmax_scale(softmax_scale: float | None) -> None:
    """ValueError unless ``softmax_scale`` is None or a finite number > 0 (not a bool, not a
    tensor that requires grad: no gradient flows to it)."""
    if isinstance(softmax_scale, torch.Tensor) and softmax_scale.requires_grad:
        raise ValueError(
            "softmax_scale must be a number: no gradient flows to it, so it may not be a tensor "
            f"that requires grad; got {softmax_scale!r}"
        )
    if isinstance(softmax_scale, torch.Tensor) and (
        softmax_scale.numel() != 1 or softmax_scale.is_complex()
    ):  # its truth value would raise a RuntimeError, or compare complex numbers
        raise ValueError(
            "softmax_scale must be a finite number > 0 or None; got a tensor of "
            f"{softmax_scale.numel()} elements of dtype {softmax_scale.dtype}"
        )
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real | torch.Tensor)  # "x" > 0: a TypeError
        or not (softmax_scale > 0 and math.isfinite(softmax_scale))
    ):
        raise ValueError(f"softmax_scale must be a finite number > 0 or None; got {softmax_scale}")


def check_flags(**flags: object) -> None:
    """ValueError naming the first of ``flags`` (name -> value) that is not a bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool; got {flag!r}")


def _cached(group: dist.ProcessGroup | None) -> Communicator | None:
    """The cached communicator of ``group`` (None: the default group), if any."""
    key = group if group is not None else dist.group.WORLD  # None: not initialised
    return _COMMUNICATORS.get(key) if key is not None else None


def close_communicators() -> None:
    """Close and forget every communicator ``get_communicator`` built (never the caller's
    groups). Their channel groups wait for the next communicators over the same ranks; at exit
    they are destroyed (Note [Group names] in tokenring.runtime.comm). Call it before
    ``destroy_process_group()``; it also runs at exit (Note [Clean exit] in tokenring.launch).
    """
    cached = list(_COMMUNICATORS.values())
    _COMMUNICATORS.clear()
    for comm in cached:
        comm.close()
    forget_destroyed_groups()
    clear_group_defaults()


@atexit.register
def _close_at_exit() -> None:
    close_communicators()
    destroy_idle_groups()


def _mesh_group(group: GroupLike) -> GroupLike:
    """A DeviceMesh's process group (ValueError unless the mesh is 1-D); else ``group``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim != 1:
        raise ValueError(
            f"group must be a 1-D DeviceMesh; got a mesh with ndim={group.ndim} "
            "(pass mesh[dim_name] for the sequence-parallel dimension)"
        )
    return group.get_group()


# Note [Calibration is passed in]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# strategy="auto" plans for the hardware= the caller passes: a preset name or a Hardware
# measured once with tokenring.model.planner.calibrate (a collective of a few seconds).
# The library never measures behind a call (that would hide a multi-second collective in
# every forward), so strategy="auto" with hardware=None raises ValueError on every rank.
# Loops that own their calls (tokenring.tinylm.generate, tokenring.hf.generate) measure
# once per loop when given no hardware.
AUTO_NEEDS_HARDWARE = (
    "strategy='auto' needs hardware=: a preset name (tokenring.model.costmodel.PRESETS) or a "
    "Hardware measured once with tokenring.model.planner.calibrate(comm, dtype=..., "
    "device=...) (a collective; every rank gets the same numbers); got hardware=None"
)


_schedule = functools.lru_cache(maxsize=256)(build_schedule)  # pure: one build per shape


def check_hardware_use(strategy: Any, hardware: Hardware | str | None) -> None:
    """ValueError for a ``hardware`` given with a strategy other than ``"auto"`` (only
    ``"auto"`` prices on it): resolve_strategy's and the cached entry points' check."""
    if hardware is not None and strategy != "auto":
        raise ValueError(
            f"hardware is only used with strategy='auto'; got hardware={hardware!r} with "
            f"strategy={strategy!r}"
        )


def resolve_strategy(
    strategy: Strategy | str,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    layout: Layout,
    comm: Communicator,
    hardware: Hardware | str | None = None,
    last_block_splits: int | None = None,
    training: bool | None = None,
    last_pair: str = "auto",
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> Strategy:
    """``strategy`` itself, or for ``"auto"`` the planner's pick: a pure function of the
    call's shape and ``hardware``, so every rank picks the same (logged once at INFO).

    Args:
        strategy: a ``Strategy`` or its name, or ``"auto"``.
        q, k: the call's ``(B, s, Hq, D)`` and ``(B, s, Hkv, D)`` shards (their shapes and
            dtype are what ``"auto"`` prices).
        causal, layout: the call's, as :func:`sequence_parallel_attn`.
        comm: the call's communicator (its world size, and its path for
            ``last_block_splits=None``).
        hardware: for ``"auto"``: a ``Hardware`` or a preset name (Note [Calibration is
            passed in]).
        training: whether a backward follows; None: grad mode is on and q, k or v (where
            given) requires grad, as the call decides it (Note [Training is priced]).
        last_block_splits: as :func:`sequence_parallel_attn` (None: what the call would take
            through ``comm``).
        last_pair: how ``"auto"`` prices TokenRing (``tokenring.model.planner.explain``).
        seq_len, cu_seqlens: as :func:`sequence_parallel_attn`: uneven shards are priced by
            the padded rows every rank holds, so every rank picks the same.
        v: the call's ``(B, s, Hkv, D)`` values, read only for ``training=None`` (a v that
            requires grad makes the call run a backward).
        window_size, attention_chunk_size: as :func:`sequence_parallel_attn`; with
            documents they are the mask ``"auto"`` prices (Note [Pricing the mask] in
            tokenring.model.planner).

    Raises:
        ValueError: ``"auto"`` without ``hardware``, or ``hardware`` with another strategy
            (as :func:`sequence_parallel_attn`); for ``"auto"``, q and k that
            :func:`sequence_parallel_attn` refuses.
    """
    if strategy != "auto":
        fixed = Strategy.parse(strategy)
        check_hardware_use(fixed.value, hardware)
        return fixed
    if hardware is None:
        raise ValueError(AUTO_NEEDS_HARDWARE)
    _validate(q, k, k if v is None else v, None)  # the shapes priced (v's do not change it)
    if training is None:
        grads = (x is not None and x.requires_grad for x in (q, k, v))
        training = torch.is_grad_enabled() and any(grads)
    if last_block_splits is None:
        last_block_splits = last_block_splits_for(comm.path(q.device))
    # the arguments by name; layout as given: the planner checks it after the sizes and dtype
    args = _planner_args(q, k, locals(), world_size=comm.world_size, training=training)
    return planner.choose_strategy(**args, last_pair=last_pair)


def _planner_args(
    q: torch.Tensor,
    k: torch.Tensor,
    options: dict[str, Any],
    *,
    world_size: int,
    training: bool | None = None,
) -> dict[str, Any]:
    """The planner's description of a call: q's and k's shapes, ``options``' hardware,
    causal, layout and last_block_splits, the padded rows of their seq_len and cu_seqlens
    where given, and their window_size and attention_chunk_size (None ``training``: an
    operator's requires_grad, Note [Training is priced]; the mask: Note [Pricing the mask] in
    tokenring.model.planner)."""
    batch, _, heads_q, head_dim = (int(x) for x in q.shape)  # traced: specialises
    sharding = _call_sharding(options, world_size)
    # the padded rows every rank holds, not this rank's tokens: uneven shards price the same
    # call on every rank, so every rank picks the same (Note [Documents and padding])
    seq_local = int(q.shape[1]) if sharding is None else sharding.seq_local
    hardware = options["hardware"]
    call = {name: options[name] for name in ("causal", "layout", "last_block_splits")}
    shape = dict(batch=batch, seq_local=seq_local, heads_q=heads_q, heads_kv=int(k.shape[2]))
    # the mask's window and chunks (in the agreed signature); not its documents, which change
    # with every batch (Note [Pricing the mask] in tokenring.model.planner)
    mask = {name: options.get(name) for name in ("window_size", "attention_chunk_size")}
    return dict(
        shape,
        head_dim=head_dim,
        dtype=q.dtype,
        hardware=preset(hardware) if isinstance(hardware, str) else hardware,
        world_size=world_size,
        training=any(options["requires_grad"]) if training is None else training,
        **call,
        **mask,
    )


# Note [Training is priced]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# "auto" (and last_pair="auto") price the backward too when one follows: when any of q, k, v
# requires grad in grad mode, the operator's backward runs (a v alone needs dv from every
# rank). That is the signature's "needs grad", so ranks that agree on the call price the same
# passes and pick the same. Pricing q and k alone once let rank 0 (q requiring grad) pick
# bidir_token_ring and rank 1 (v alone) ring for the same agreed call: each waited for a
# message the other never sent, until the communicator's timeout.


def _call_sharding(options: dict[str, Any], world_size: int) -> Sharding | None:
    """The call's sharding where ``options`` give seq_len or cu_seqlens (the same on every
    rank; pure); None: every rank holds the same number of tokens."""
    seq_len, cu_seqlens = options.get("seq_len"), options.get("cu_seqlens")
    if seq_len is None:
        if cu_seqlens is None:
            return None
        seq_len = int(cu_seqlens[-1])  # a valid call's: _sharding checks it is P * s
    return make_sharding(
        layout=options["layout"], world_size=world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
    )


def _lends_last_pair(
    strategy: Strategy, q: torch.Tensor, k: torch.Tensor, options: dict[str, Any], world_size: int
) -> bool:
    """Whether the call's TokenRing lends its last pair (Note [Borrowed last pair] in
    tokenring.strategies.ring): ``last_pair`` "lend", or "auto" and the model says so."""
    if strategy is not Strategy.TOKEN_RING:
        return False
    policy = _last_pair_policy(options)
    if policy != "auto":
        return policy == "lend"
    return planner.lends_last_pair(**_planner_args(q, k, options, world_size=world_size))


def _last_pair_policy(options: dict[str, Any]) -> str:
    """``last_pair`` as given, or for None: "auto" with ``strategy="auto"``, else "return"."""
    if options["last_pair"] is not None:
        return str(options["last_pair"])
    return "auto" if options["strategy"] == "auto" else "return"


def _validate(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None
) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (batch, seq_local, heads, head_dim); got shape "
                f"{tuple(x.shape)}"
            )
        if x.dtype not in _DTYPES:
            raise ValueError(
                f"{name}.dtype must be one of float64, float32, bfloat16, float16; got {x.dtype}"
            )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(
                f"{name}.dtype must equal q.dtype ({q.dtype}); got {x.dtype}"
                + autocast_hint(q.device)
            )
        if x.device != q.device:
            raise ValueError(f"{name}.device must equal q.device ({q.device}); got {x.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(
            f"k must have shape (batch={b}, seq_local={s}, heads_kv, head_dim={d}) to match q; "
            f"got {tuple(k.shape)}"
        )
    if hq < 1:
        raise ValueError(f"q.shape[2] (heads_q) must be >= 1; got shape {tuple(q.shape)}")
    hkv = k.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"heads_kv must divide heads_q; got heads_q={hq}, heads_kv={hkv}")
    if b < 1 or d < 1:
        raise ValueError(
            f"q.shape[0] (batch) and q.shape[3] (head_dim) must be >= 1; got q.shape "
            f"{tuple(q.shape)}"
        )
    check_softmax_scale(softmax_scale)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Call:
    """One rank's validated attention call: everything the schedule and the kernels need."""

    layout: Layout
    sharding: Sharding
    mask: MaskSpec
    kernel: BlockKernel
    scale: float


def _prepare_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    comm: Communicator,
    options: dict[str, Any],
    splits_given: bool,
) -> tuple[_Call, dict[str, Any]]:
    """Validate one rank's call (``options``: the operator's, :func:`_merged`, with
    ``last_block_splits`` resolved; ``splits_given``: the caller passed it) and build the
    signature the ranks compare (Note [Rank agreement]); no communication."""
    if op.UNSUPPORTED in options:  # Note [Values a graph cannot keep]
        raise NotImplementedError(options[op.UNSUPPORTED])
    check_flags(check_ranks=options["check_ranks"])
    layout = Layout.parse(options["layout"])
    _validate(q, k, v, options["softmax_scale"])
    requested = _requested_strategy(q, options, splits_given)
    sharding = _sharding(q, comm, layout, options["seq_len"], options["cu_seqlens"])
    window = normalize_window(options["window_size"], causal=options["causal"])
    mask_docs = chunk_documents(sharding.cu_seqlens, options["attention_chunk_size"])
    mask = MaskSpec(options["causal"], window, mask_docs if len(mask_docs) > 2 else None)
    if q.shape[1] != sharding.local_len(comm.rank):
        raise ValueError(
            f"q.shape[1] must be {sharding.local_len(comm.rank)} on rank {comm.rank}: its share "
            f"of seq_len={sharding.seq_len} under layout '{layout.value}'"
            + (" and the given cu_seqlens" if sharding.num_docs > 1 else "")
            + f" (see tokenring.shard); got {q.shape[1]}"
        )
    block_kernel = select_kernel(
        q.device, q.dtype, options["block_kernel"], seq_local=sharding.seq_local
    )
    scale = options["softmax_scale"] or q.shape[-1] ** -0.5  # checked: None or > 0
    seq_len, seq_len_given = options["seq_len"], options["seq_len"] is not None
    signature: dict[str, Any] = {
        "batch": q.shape[0],
        ("seq_len" if seq_len_given else "seq_local"): seq_len if seq_len_given else q.shape[1],
        "seq_len given": seq_len_given,
        "heads_q": q.shape[2],
        "heads_kv": k.shape[2],
        "head_dim": q.shape[3],
        "dtype": str(q.dtype),
        "device type": q.device.type,
        "causal": options["causal"],
        "layout": layout.value,
        "strategy": requested,
        "hardware": None if options["hardware"] is None else repr(options["hardware"]),
        "softmax_scale": float(scale).hex(),
        "window_size": list(window),
        # one document's bounds (0, S) say no more than seq_len / seq_local: their digest
        # only listed a cu_seqlens nobody passed beside ranks' different local lengths
        "cu_seqlens": _bounds_digest(sharding.cu_seqlens) if sharding.num_docs > 1 else None,
        "attention_chunk_size": options["attention_chunk_size"],
        "last_block_splits": options["last_block_splits"],
        "last_pair": options["last_pair"],
        "kernel": block_kernel.name,
        "needs grad": any(options["requires_grad"]),  # inside the operator grad mode is off
    }
    call = _Call(layout=layout, sharding=sharding, mask=mask, kernel=block_kernel, scale=scale)
    return call, signature


def _sharding(
    q: torch.Tensor,
    comm: Communicator,
    layout: Layout,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
) -> Sharding:
    """The sharding of the call's global sequence (None seq_len: P equal shares of q's)."""
    if seq_len is None:
        if layout is Layout.ZIGZAG and q.shape[1] % 2:
            raise ValueError(
                f"q.shape[1] (seq_local) must be even for layout 'zigzag' when every rank holds "
                f"the same number of tokens; got {q.shape[1]} (pass seq_len= for any length)"
            )
        validate_seq_local(q.shape[1], layout, name="q.shape[1] (seq_local)")
        seq_len = q.shape[1] * comm.world_size
    return make_sharding(  # raises for a seq_len that is not an int >= 0
        layout=layout, world_size=comm.world_size, seq_len=seq_len, cu_seqlens=cu_seqlens
    )


def _bounds_digest(bounds: Sequence[int]) -> list[int]:
    """Document boundaries as a signature field: their count and CRC-32."""
    return [len(bounds), zlib.crc32(struct.pack(f"<{len(bounds)}q", *bounds))]


def _requested_strategy(q: torch.Tensor, options: dict[str, Any], splits_given: bool) -> str:
    """The strategy asked for ("auto" or a Strategy's value); checks the options that go
    with it (a ``last_block_splits`` given only to a strategy that slices its last block)."""
    last_block_splits = options["last_block_splits"]
    check_flags(causal=options["causal"], return_lse=options.get("return_lse", False))
    if isinstance(last_block_splits, bool) or not isinstance(last_block_splits, int):
        raise ValueError(f"last_block_splits must be an int >= 1; got {last_block_splits!r}")
    if last_block_splits < 1:
        raise ValueError(f"last_block_splits must be >= 1; got {last_block_splits}")
    strategy, hardware = options["strategy"], options["hardware"]
    requested = "auto" if strategy == "auto" else Strategy.parse(strategy).value
    if requested == Strategy.HYBRID.value:
        raise ValueError(
            "strategy 'hybrid' runs on a 2-D mesh, not one group: call "
            "tokenring.hybrid_attn(q, k, v, mesh=tokenring.hybrid_mesh(outer, inner), "
            "outer_strategy=...) instead"
        )
    if splits_given and requested != "auto" and not Strategy(requested).passes_q:
        raise ValueError(
            f"last_block_splits is read only by the pass-Q strategies ('token_ring', "
            f"'bidir_token_ring') and 'auto'; got last_block_splits={last_block_splits} with "
            f"strategy={requested!r} (leave it None)"
        )
    if requested == Strategy.BIDIR_TOKEN_RING.value and q.shape[2] < 2:
        raise NotImplementedError(
            "strategy 'bidir_token_ring' sends half of the query heads each way round the "
            f"ring and needs heads_q >= 2; got q.shape[2]={q.shape[2]} (use 'token_ring')"
        )
    last_pair = options["last_pair"]
    if last_pair is not None and last_pair not in planner.LAST_PAIRS:
        raise ValueError(
            f"last_pair must be None or one of {planner.LAST_PAIRS}; got {last_pair!r}"
        )
    if last_pair is not None and requested not in ("auto", Strategy.TOKEN_RING.value):
        raise ValueError(
            f"last_pair is TokenRing's (Note [Borrowed last pair]); got last_pair={last_pair!r} "
            f"with strategy={requested!r}"
        )
    planned = requested == "auto" or last_pair == "auto"
    if hardware is not None and not planned:
        raise ValueError(
            f"hardware is only used with strategy='auto' or last_pair='auto'; got "
            f"hardware={hardware!r} with strategy={requested!r}"
        )
    if hardware is None and planned:
        what = "strategy='auto'" if requested == "auto" else "last_pair='auto'"
        raise ValueError(AUTO_NEEDS_HARDWARE.replace("strategy='auto'", what))
    return requested


# Note [Rank agreement]
# ~~~~~~~~~~~~~~~~~~~~~
# Every argument that changes the schedule, the message sizes or the numbers is in a call's
# signature (``_prepare_call``); a rank that fails validation sends the reason instead. The
# ranks exchange these before any transfer of the call:
#
#   rank 0: valid, sig A     rank 1: invalid: "q.shape[1] must be 6 ..."     rank 2: valid, sig A
#      -> rank 1 raises its own ValueError; ranks 0 and 2 raise "rank 1 cannot run ...: ..."
#   rank 0: sig A            rank 1: sig A'  (last_block_splits 4 vs 2)
#      -> every rank raises "ranks disagree on this attention call: last_block_splits: ..."
#   rank 2 frozen or dead before the call
#      -> ranks 0 and 1 raise within the communicator's timeout, naming rank 2
#
# ``Communicator.agreed`` runs the checks and exchanges the results point-to-point on the
# control group (CPU, gloo; or the shared-memory inboxes) within the communicator's timeout;
# an attention call's exchange completes before its first transfer, while the rank plans and
# computes its first segment (Note [Deferred agreement] in tokenring.runtime.comm). The
# message headers (Note [Message header] in tokenring.runtime.comm) catch what
# check_ranks=False lets by.


# Note [The attention operator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every call, eager or compiled, goes through two custom operators:
#
#     sequence_parallel_attn     arguments -> primitives and handles (_op_options); traced
#       tokenring::attention     _plan: validation, the ranks' agreement (Note [Rank
#                                agreement]), the schedules; then op.forward -> [out, lse,
#                                *residuals] (Note [Residuals] in tokenring.runtime.op)
#       tokenring::attention_backward
#                                _plan without the agreement, then op.backward
#
# torch.compile traces only the first line and sees each operator as one call shaped by its
# fake implementation; everything that validates or communicates runs inside the operator,
# so fullgraph=True works and bad input fails as it does eagerly, on every rank. A value not
# of its primitive's type (causal=1, a kernel instance, a cu_seqlens tensor) travels as it is
# in a record behind the ``raw`` handle, so validation sees what the caller passed.


# the operators' keyword arguments: sequence_parallel_attn's options as primitives
_OPTIONS_SCHEMA = (
    "str group, str strategy, bool causal, float? softmax_scale, str layout, "
    "str? block_kernel, int? last_block_splits, str? last_pair, bool check_ranks, "
    "str? hardware, int? seq_len, int[]? cu_seqlens, int[]? window_size, "
    "int? attention_chunk_size, bool[] requires_grad, str? raw, bool return_lse=False"
)


@torch.library.custom_op(
    "tokenring::attention",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, *, {_OPTIONS_SCHEMA}) -> Tensor[]",
)
@torch.compiler.disable  # run eagerly after a graph break: dynamo must not trace into it
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> list[torch.Tensor]:
    plan = _plan(q, k, v, options, backward=False)
    with plan.comm.settled_on_error():  # Note [Deferred agreement] in tokenring.runtime.comm
        out, lse, residuals = op.forward(plan, q, k, v)
        plan.comm.settle()  # done at its first transfer; here if it made none
    # tensors of their own, not views of a kernel's buffer (the CPU kernel's (B, Hq, s, D)
    # transposed): autograd refuses an in-place change of an operator's output that is a view
    # ("a view created inside a custom Function"), so out.mul_(2) used to raise at once for
    # the ring strategies alone; now, as for the others and PyTorch's attention, it raises in
    # the backward, which reads the saved out, and works where no backward follows
    return [out.contiguous().detach(), lse.contiguous().detach(), *residuals]


@_attention.register_fake
def _attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> list[torch.Tensor]:
    if k.device != q.device or v.device != q.device:  # meta among real tensors lands here
        _validate(q, k, v, None)  # raises, naming the device
    if q.dim() != 4 or k.dim() != 4:  # the operator raises when it runs, on every rank
        return [torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(0)]
    b, s, hq, _ = q.shape
    lse = torch.empty((b, hq, s), dtype=accumulation_dtype(q.dtype), device=q.device)
    try:
        fields = _residual_fields(q, k, options)
    except (ValueError, TypeError):  # likewise: raised by the operator, after the agreement
        fields = []
    residuals = [torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in fields]
    return [torch.empty(q.shape, dtype=q.dtype, device=q.device), lse, *residuals]


@torch.library.custom_op(
    "tokenring::attention_backward",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"Tensor[] residuals, Tensor? dlse, *, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)",
)
@torch.compiler.disable
def _attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    residuals: list[torch.Tensor],
    dlse: torch.Tensor | None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan(q, k, v, options, backward=True)
    grads = op.backward(plan, dout, q, k, v, out, lse, residuals, dlse)
    dq, dk, dv = (x.contiguous() for x in grads)
    return dq, dk, dv


@_attention_backward.register_fake
def _attention_backward_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    return dq, dk, dv


@torch.compiler.disable
def _attention_setup(
    ctx: Any,
    inputs: tuple[torch.Tensor, ...],
    keyword_only_inputs: dict[str, Any],
    output: list[torch.Tensor],
) -> None:
    q, k, v = inputs
    out, lse, *residuals = output
    options = keyword_only_inputs
    # the backward runs the forward's strategy and last pair, without a second agreement
    merged, _, world_size = _traced(options, q.device)
    strategy = _strategy_of(q, k, merged, world_size)
    lend = _lends_last_pair(strategy, q, k, merged, world_size)
    last_pair = ("lend" if lend else "return") if strategy is Strategy.TOKEN_RING else None
    ctx.options = {**options, "strategy": strategy.value, "last_pair": last_pair}
    # the registry holds objects weakly (Note [Handles] in tokenring.runtime.op)
    ctx.referents = [op.resolve_group(options["group"]), op.resolve_object(options["raw"])]
    ctx.save_for_backward(q, k, v, out, lse, *residuals)
    # lse reaches the caller only with return_lse (Note [Gradient of lse] in runtime.op)
    ctx.mark_non_differentiable(*([] if options.get("return_lse") else [lse]), *residuals)
    ctx.set_materialize_grads(False)  # an output the loss does not use: None, not zeros


def _attention_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse, *residuals = ctx.saved_tensors
    dout, dlse = grads[0], grads[1]
    if dout is None:  # the loss uses lse alone
        dout = torch.zeros_like(out)
    return _attention_backward(dout, q, k, v, out, lse, residuals, dlse, **ctx.options)


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def _no_double_backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
    """The backward operator's own backward: refused, naming what is not supported (torch's
    message told the caller to register an autograd formula for tokenring's operator)."""
    raise NotImplementedError(
        "tokenring's attention has no double backward: a gradient taken with "
        "create_graph=True is right, but differentiating it again (a gradient penalty, "
        "Hessian-vector products) is not supported"
    )


def _no_double_backward_setup(ctx: Any, inputs: Any, keyword_only_inputs: Any, output: Any) -> None:
    pass


_attention_backward.register_autograd(_no_double_backward, setup_context=_no_double_backward_setup)


def _merged(options: dict[str, Any]) -> dict[str, Any]:
    """An operator's options with the values of its ``raw`` record put back."""
    raw = op.resolve_object(options["raw"])
    return options if raw is None else {**options, **raw.values}


# Note [Last block slices]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# TokenRing returns its last block's partial in ``last_block_splits`` slices so that a slice
# travels while the next is computed, which hides most of the exposed last return on a link.
# Through shared memory the sender copies each message into its segment itself, on the thread
# that computes: a slice's transfer cannot overlap the next slice, and each slice costs a
# kernel call, a message and a merge more. So None (the default) means 2, or 1 where the
# communicator's path for the tensors is gloo-shm (the same on every rank: the transport is
# agreed when the communicator is built). Measured on 4 ranks sharing 2 cores, S = 4096, bf16
# forward: 1 slice 63.9-66.5 ms against 2 slices 66.9-68.5 (Ring 63.3-64.7). The resolved
# value is in the call's signature and its schedules; an int given is used as it is. The same
# rule (``last_block_splits_for``) serves hybrid_attn's outer ring, resolve_strategy's pricing
# and ``tokenring bench``'s model rows (from the path its ranks report).
#
# The operator's fake and its autograd setup run where no communicator may be built (while
# torch.compile traces): they read the communicator the forward built (``_built``), and
# without one (tracing before any call) take 2. Only "auto"'s picks read the value there,
# and none of them can change an answer: the fake's pick only validates Ulysses' head split
# (the residuals depend on padding alone, not on the strategy), and the setup's picks, the
# backward's strategy and last pair, schedule the same gradients of the same out and lse.
def last_block_splits_for(path: str | None) -> int:
    """TokenRing's default ``last_block_splits`` for a communicator path
    (``Communicator.path``; None: not known yet): Note [Last block slices]."""
    return 1 if path == "gloo-shm" else 2


def _with_splits(
    options: dict[str, Any], comm: Communicator | None, device: torch.device
) -> dict[str, Any]:
    """``options`` with ``last_block_splits`` None resolved for ``comm`` and ``device``
    (no communicator: 2)."""
    if options["last_block_splits"] is not None:
        return options
    path = None if comm is None else comm.path(device)
    return {**options, "last_block_splits": last_block_splits_for(path)}


def _traced(options: dict[str, Any], device: torch.device) -> tuple[dict[str, Any], int, int]:
    """An operator's options as its fake and its autograd setup see them (merged, with the
    slice count of the communicator the forward built, never building one), and this rank and
    the world size of its group."""
    group = op.resolve_group(options["group"])
    built: Communicator | None = group
    if isinstance(group, Communicator):
        rank, world_size = group.rank, group.world_size
    else:
        built = _cached(_mesh_group(group))
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return _with_splits(_merged(options), built, device), rank, world_size


def _strategy_of(
    q: torch.Tensor, k: torch.Tensor, options: dict[str, Any], world_size: int
) -> Strategy:
    """The strategy an operator call runs; pure."""
    if options["strategy"] != "auto":
        return Strategy.parse(options["strategy"])
    if options["hardware"] is None:
        raise ValueError(AUTO_NEEDS_HARDWARE)
    return planner.choose_strategy(
        **_planner_args(q, k, options, world_size=world_size),
        last_pair=_last_pair_policy(options),
    )


def _residual_fields(
    q: torch.Tensor, k: torch.Tensor, options: dict[str, Any]
) -> list[op.FieldSpec]:
    """The residuals' shapes of an operator call (Note [Residuals] in tokenring.runtime.op)."""
    options, rank, world_size = _traced(options, q.device)
    strategy = _strategy_of(q, k, options, world_size)
    sharding = _call_sharding(options, world_size)
    seq_local, padded = (
        (q.shape[1], False) if sharding is None else (sharding.seq_local, sharding.padded)
    )
    return op.residual_fields(
        strategy,
        # heads decide Ulysses' shares, so they are specialised when traced as dynamic
        q_shape=(q.shape[0], q.shape[1], int(q.shape[2]), q.shape[3]),
        heads_kv=int(k.shape[2]),
        dtype=q.dtype,
        seq_local=seq_local,
        padded=padded,
        world_size=world_size,
        rank=rank,
    )


def sequence_parallel_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    strategy: Strategy | str = Strategy.TOKEN_RING,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: GroupLike = None,
    layout: Layout | str = Layout.CONTIGUOUS,
    return_lse: bool = False,
    kernel: str | BlockKernel | None = None,
    last_block_splits: int | None = None,
    last_pair: str | None = None,
    check_ranks: bool = True,
    hardware: Hardware | str | None = None,
    seq_len: int | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    window_size: Sequence[int] | int | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded across the ranks of ``group``: every rank passes its
    shard and gets its shard of full attention over the global sequence.

    Args:
        q: ``(B, s, Hq, D)`` this rank's queries.
        k, v: ``(B, s, Hkv, D)``; Hkv divides Hq (GQA/MQA, never repeated on the wire).
        strategy: ``"token_ring"`` (pass-Q), ``"ring"`` (pass-KV), ``"bidir_ring"``,
            ``"bidir_token_ring"`` (needs Hq >= 2), ``"ulysses"``, ``"allgather_kv"``, or
            ``"auto"``: the cost model's pick (:func:`resolve_strategy`).
        causal: causal mask over *global* positions.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        group: ProcessGroup, 1-D DeviceMesh, Communicator, or None (default group).
        layout: how the sequence is sharded: ``"contiguous"`` or ``"zigzag"``.
        return_lse: also return lse ``(B, Hq, s)`` (float32; float64 for float64 inputs),
            with its gradient: a loss may use it (Note [Gradient of lse] in
            tokenring.runtime.op).
        kernel: block kernel name or instance; None picks one for the device and dtype.
        last_block_splits: TokenRing returns its last block in this many slices, so the
            first slices travel while the rest is computed; at most one per K/V head (or per
            query head with one K/V head, or per row of a single unmasked piece): a larger
            value gives the same slices (Note [Last block by heads] in
            tokenring.strategies.ring). None: 2, or 1 where the communicator moves messages
            through shared memory (Note [Last block slices]). Only the pass-Q strategies and
            ``"auto"`` take an int; the others take only None.
        last_pair: TokenRing's last pair (Note [Borrowed last pair] in
            tokenring.strategies.ring): ``"return"``, ``"lend"`` or ``"auto"`` (the cost model
            decides on ``hardware``). None: ``"auto"`` with ``strategy="auto"``, else
            ``"return"``; other strategies take only None.
        check_ranks: exchange a small signature first and raise a ValueError naming the
            difference on every rank if ranks disagree (Note [Rank agreement]).
        hardware: needed by ``"auto"``: a ``Hardware`` or a preset name (Note [Calibration is
            passed in]).
        seq_len: the global length S of uneven shards (each rank passes the ``s_r`` tokens
            ``tokenring.shard`` gives it); None: S = P * s.
        cu_seqlens: document boundaries ``(0, ..., S)`` of a packed sequence (list or 1-D int
            tensor, the same for every batch row); shard with ``tokenring.shard(...,
            cu_seqlens=...)`` (zigzag: per document).
        window_size: sliding window ``(left, right)`` as in flash-attention (-1: unbounded; an
            int w means (w, w)); with ``causal`` right is 0.
        attention_chunk_size: chunked attention (Llama 4): a query sees only the keys of its
            chunk of this many tokens, counted from its document's start.

    Returns:
        out ``(B, s, Hq, D)`` in q's dtype, or ``(out, lse)`` with ``return_lse``.

    Raises:
        ValueError: mismatched shapes, dtypes or devices; a local length the layout or
            seq_len does not give this rank; bad cu_seqlens, window_size,
            attention_chunk_size, strategy, layout, kernel or last_pair; "auto" without
            hardware, or hardware without "auto"; ranks that disagree.
        NotImplementedError: under torch.compile, an option given as a tensor or a NumPy
            value (softmax_scale, cu_seqlens, window_size), on every rank.
        RuntimeError: under torch.compile, a ProcessGroup not seen eagerly (call
            ``get_communicator(group)`` once first).
    """
    # return_lse is checked inside the operator, with the ranks' agreement, as every option
    values = {n: x for n, x in locals().items() if n not in ("q", "k", "v", "group")}
    values["block_kernel"] = values.pop("kernel")  # the operator's name for it
    _check_tensors(q, k, v, group, check_ranks)
    options, record = _op_options(values)
    handle = _group_handle(group)
    requires_grad = [torch.is_grad_enabled() and x.requires_grad for x in (q, k, v)]
    out, lse, *_ = _attention(q, k, v, group=handle, requires_grad=requires_grad, **options)
    del record  # held through the call: the registry holds it weakly
    return (out, lse) if return_lse else out


def autocast_hint(device: torch.device) -> str:
    """What a dtype error adds under torch.autocast (the caller may not have chosen the dtypes:
    a model's layers under autocast hand attention bfloat16 and float32 tensors); else ""."""
    if not torch.is_autocast_enabled(device.type):
        return ""
    return (
        " (torch.autocast does not cast them for tokenring's attention, which computes in its "
        "inputs' dtype: Note [Autocast] in tokenring.runtime.executor)"
    )


def _check_tensors(q: Any, k: Any, v: Any, group: GroupLike, check_ranks: object) -> None:
    """ValueError unless q, k and v are dense tensors with data (what the operator's real
    implementation, which runs the rank check, takes), NotImplementedError for a dual one
    (Note [Forward-mode AD]); the peers learn it from the rank check (Note [Rank agreement]),
    so they do not wait for this rank."""
    found = _tensor_problem(q, k, v)
    if found is None:
        return
    problem: Exception = found

    def fail() -> tuple[None, None]:
        raise problem

    transformed = _functorch_active()  # the exchange's own tensors would be wrapped
    if check_ranks is not False and not torch.compiler.is_compiling() and not transformed:
        get_communicator(group).agreed(fail, what="attention call")
    raise problem


def _functorch_active() -> bool:
    """Whether a torch.func transform (jvp, grad, vmap) is running (Note [Forward-mode AD])."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def _tensor_problem(q: Any, k: Any, v: Any) -> ValueError | NotImplementedError | None:
    """Why q, k, v cannot reach the operator's real implementation: not tensors; sparse or
    nested (the dispatcher would raise before the rank check); on the meta device (the fake
    implementation would answer, or raise, without the rank check, while the peers wait in
    it); carrying a forward-mode tangent (Note [Forward-mode AD])."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, x in tensors:
        if not isinstance(x, torch.Tensor):
            return ValueError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.is_nested or x.layout != torch.strided:
            got = "a nested tensor" if x.is_nested else f"layout {x.layout}"
            return ValueError(f"{name} must be a dense (strided) tensor; got {got}")
    dual = _tangent_problem(dict(tensors))
    if dual is not None:
        return dual
    meta = [name for name, x in tensors if x.device.type == "meta"]
    if not meta or torch.compiler.is_compiling():
        return None
    try:
        _validate(q, k, v, None)  # devices that differ: named as the operator names them
    except ValueError as exc:
        return exc
    return ValueError(
        f"{meta[0]} is on the meta device: an attention call exchanges its data with the "
        "other ranks, so q, k and v must hold data (for shapes alone, trace under "
        "torch.compile or FakeTensorMode)"
    )


# Note [Forward-mode AD]
# ~~~~~~~~~~~~~~~~~~~~~~
# The operator registers a backward only (torch.library has no forward-mode rule for a custom
# operator), and PyTorch runs it under forward-mode AD without a word: the output carries no
# tangent, so torch.autograd.forward_ad's unpack_dual gave None and torch.func.jvp a tangent of
# zeros, for any input tangent. A dual input is therefore refused (NotImplementedError, as
# PyTorch's own attention kernels raise), on every rank through the rank check; inside a
# torch.func transform the check's exchange cannot run (the transform wraps every tensor the
# communicator makes: "Cannot access data pointer"), so each rank refuses on its own there,
# and a rank that called without the transform waits for the others up to the timeout.
#
# The other entry points that run attention (tokenring.hybrid_attn, cached_attn, joint_attn,
# cross_attn) refuse a dual input alike with :func:`refuse_tangents`, in their own rank check
# and, inside a transform, before it. They used to run: hybrid_attn gave torch's "You must
# implement the jvp function" after its exchanges (on the dual ranks alone), and under
# torch.func.jvp "Cannot access data pointer"; cached_attn failed inside its plan (the fused CPU
# kernel has no forward-mode rule), which left its communicator unusable for every later call.
def _has_tangent(x: torch.Tensor) -> bool:
    """Whether ``x`` is a dual tensor of the current forward-mode AD level."""
    return fwAD.unpack_dual(x).tangent is not None


def _tangent_problem(tensors: dict[str, Any]) -> NotImplementedError | None:
    """The error for the first of ``tensors`` (name -> tensor or None) that carries a
    forward-mode tangent (Note [Forward-mode AD]); None if none does."""
    if torch.compiler.is_compiling():
        return None
    dual = [n for n, x in tensors.items() if isinstance(x, torch.Tensor) and _has_tangent(x)]
    if not dual:
        return None
    return NotImplementedError(
        f"{dual[0]} carries a forward-mode tangent (torch.autograd.forward_ad or "
        "torch.func.jvp/jacfwd): tokenring's attention has no forward-mode derivative, and "
        "its output would carry no tangent (a silent zero); use reverse mode "
        "(backward() or torch.autograd.grad)"
    )


def refuse_tangents(tensors: dict[str, Any], *, before_exchange: bool = False) -> None:
    """NotImplementedError naming the first of ``tensors`` that carries a forward-mode tangent
    (Note [Forward-mode AD]). An entry point calls it inside its rank check, so every rank
    raises; and first with ``before_exchange``, which raises only inside a torch.func
    transform, where that check's exchange cannot run (each rank raises on its own)."""
    if before_exchange and not _functorch_active():
        return
    problem = _tangent_problem(tensors)
    if problem is not None:
        raise problem


# name -> (its primitive's type, the placeholder while the value travels in the raw record)
_PRIMITIVES: dict[str, tuple[type, Any]] = {
    "strategy": (str, ""),
    "causal": (bool, False),
    "softmax_scale": (float, None),
    "layout": (str, ""),
    "block_kernel": (str, None),
    "last_block_splits": (int, None),
    "last_pair": (str, None),
    "check_ranks": (bool, False),
    "hardware": (str, None),
    "seq_len": (int, None),
    "attention_chunk_size": (int, None),
    "return_lse": (bool, False),
}


def _op_options(values: dict[str, Any]) -> tuple[dict[str, Any], op.Record | None]:
    """The operator's keyword arguments, ``raw`` the handle of a record of those not of their
    primitive's type, and that record where the caller must hold it (eager). Traced by
    dynamo, so it never validates (Note [The attention operator])."""
    options: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for name, value in values.items():
        if (name, type(value)) in (("strategy", Strategy), ("layout", Layout)):
            value = value.value
        if name == "window_size" and _is_int64(value) and value >= -1:
            # w means (w, w); as a list an int that dynamo traces as dynamic stays an input
            # (in the record it cannot be a constant); a bad one is refused as it was passed
            value = [value, value]
        if name in ("cu_seqlens", "window_size"):
            ints = isinstance(value, list | tuple) and all(_is_int64(x) for x in value)
            primitive = list(value) if ints else None  # a list or tuple of ints as a list
            if primitive is None and value is not None:
                raw[name] = value
            options[name] = primitive
        else:
            kind, placeholder = _PRIMITIVES[name]
            fits = _is_int64(value) if kind is int else type(value) is kind
            if fits or (value is None and placeholder is None):
                options[name] = value
            else:
                raw[name] = value
                options[name] = placeholder
    if not raw:
        return {**options, "raw": None}, None
    if torch.compiler.is_compiling():  # a record for the life of the graph
        # a list or tuple that holds one: dynamo cannot pass it to pinned_handle as a constant
        tensors = [n for n, x in raw.items() if isinstance(x, list | tuple) and op.graph_input(x)]
        if tensors:  # Note [Values a graph cannot keep]; dynamo cannot pass them on
            raw = {op.UNSUPPORTED: op.graph_input_message(tensors[0])}
        return {**options, "raw": op.pinned_handle(tuple(raw), *raw.values())}, None
    record = op.Record(raw)
    return {**options, "raw": op.object_handle(record)}, record


# Note [Values a graph cannot keep]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A value that travels in the raw record is baked into the compiled graph with the record
# (Note [Handles] in tokenring.runtime.op), and dynamo guards on none of it. A tensor (or a
# NumPy scalar, which dynamo traces as a tensor) is an input of the graph: a later call with
# another value would run with the value the graph was traced with (seen: softmax_scale
# torch.tensor(0.7), then 0.1: the answer of 0.7). So such a value is refused, and not while
# tracing, on this rank alone (its peers would wait in the rank check until the timeout): the
# record carries the refusal (``op.UNSUPPORTED``) and the operator raises it on every rank in
# the rank check (Note [Rank agreement]). ``op.pinned_handle`` finds them among the values it is
# given; a list or tuple that holds a tensor is found here, before dynamo (which cannot pass it
# to ``pinned_handle`` as a constant) sees it.
def _is_int64(value: object) -> bool:
    """Whether ``value`` is a Python int the schema's ``int`` holds (int64; a larger one travels
    in the raw record, so validation sees it as passed)."""
    return type(value) is int and -(2**63) <= value < 2**63


def _group_handle(group: GroupLike) -> str:
    """The operator's name for ``group`` (Note [Handles] in tokenring.runtime.op); traced. An
    unsupported group raises here: without a group there is no one to agree with."""
    if group is None:
        return op.DEFAULT_GROUP
    if isinstance(group, Communicator):
        return op.object_handle(group)
    group = _mesh_group(group)  # raises for a mesh of more dimensions, naming the fix
    if not isinstance(group, dist.ProcessGroup):
        get_communicator(group)  # raises, naming what a group may be
    return op.group_handle(group)


def _plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any], *, backward: bool
) -> op.Plan:
    """Validate an operator call (``options``: its keyword arguments), agree across ranks and
    plan it. The ``backward`` skips the agreement and runs the forward's strategy."""
    options = _merged(options)  # the values that are not of their primitive's type
    if backward:  # no second agreement; no second pick
        options = {**options, "check_ranks": False, "hardware": None}
    comm = get_communicator(op.resolve_group(options["group"]))
    # checked once, by the forward (the backward runs the strategy "auto" may have picked)
    splits_given = options["last_block_splits"] is not None and not backward
    options = _with_splits(options, comm, q.device)

    validate = functools.partial(
        _prepare_call, q, k, v, comm=comm, options=options, splits_given=splits_given
    )
    # a check_ranks that is not a bool is checked by validate: its rank tells the others;
    # so is every error of validate, whatever its type (a rank that raised alone would leave
    # the others waiting in the rank check)
    check_ranks = options["check_ranks"] is not False
    call = comm.agreed(
        validate,
        what="attention call",
        check_ranks=check_ranks,
        errors=(Exception,),
        deferred=True,
    )
    with comm.settled_on_error():
        return _planned(q, k, options, comm, call)


def _planned(
    q: torch.Tensor, k: torch.Tensor, options: dict[str, Any], comm: Communicator, call: _Call
) -> op.Plan:
    """The plan of a validated call (``call``: what ``_prepare_call`` returned)."""
    strategy = _strategy_of(q, k, options, comm.world_size)
    lend = _lends_last_pair(strategy, q, k, options, comm.world_size)
    sharding = call.sharding
    schedules = None
    if not strategy.is_collective:
        key = dict(
            layout=call.layout,
            causal=options["causal"],
            world_size=comm.world_size,
            seq_len=sharding.seq_len,
            cu_seqlens=sharding.cu_seqlens,
            window_size=call.mask.window,
            last_block_splits=options["last_block_splits"],
            heads_kv=k.shape[2],
            attention_chunk_size=options["attention_chunk_size"],
            heads_q=q.shape[2],
            lend_last_pair=lend,
        )
        forward, backward = (_schedule(strategy, p, **key) for p in (Pass.FORWARD, Pass.BACKWARD))
        schedules = (forward, backward)
    return op.Plan(
        strategy=strategy,
        comm=comm,
        kernel=call.kernel,
        scale=call.scale,
        layout=call.layout,
        causal=options["causal"],
        sharding=sharding,
        mask=call.mask,
        schedules=schedules,
        padding=sharding.padding(comm.rank, q.device),
    )


# One function per strategy: sequence_parallel_attn with the strategy fixed.


def token_ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """TokenRing (pass-Q): Q blocks travel the ring, partial (out, lse) return straight to
    their owner on the other direction (Note [TokenRing step table] in
    tokenring.strategies.ring; the loop is ``tokenring.runtime.ring.run_forward``). As
    :func:`sequence_parallel_attn`.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.TOKEN_RING, **options)


def ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ring attention (pass-KV): K/V blocks travel, queries stay. As
    :func:`sequence_parallel_attn`.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.RING, **options)


def bidir_ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pass-KV on two counter-rotating rings, each with half of the kv heads (one kv head: half
    of the rows). As :func:`sequence_parallel_attn`.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.BIDIR_RING, **options)


def bidir_token_ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pass-Q on two counter-rotating rings, each with half of the query heads
    (Note [Bidirectional TokenRing] in tokenring.strategies.ring). As
    :func:`sequence_parallel_attn`; one query head raises NotImplementedError.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.BIDIR_TOKEN_RING, **options)


def ulysses_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ulysses: all-to-all from sequence to head shards (uneven heads: ceil/floor shares),
    local attention, all-to-all back. As :func:`sequence_parallel_attn`.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.ULYSSES, **options)


def allgather_kv_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """All-gather K/V (Llama-3 style) while the local block computes; the backward
    reduce-scatters dK/dV. As :func:`sequence_parallel_attn`.

    Args:
        q, k, v, options: as :func:`sequence_parallel_attn`, with this strategy fixed.
    """
    return sequence_parallel_attn(q, k, v, strategy=Strategy.ALLGATHER_KV, **options)


class SequenceParallelAttention(torch.nn.Module):
    """``nn.Module``: ``forward(q, k, v) -> out`` with :func:`sequence_parallel_attn`'s
    options fixed at build time.

    Args:
        strategy, causal, softmax_scale, group, layout: as :func:`sequence_parallel_attn`.
        options: any other keyword of :func:`sequence_parallel_attn` (``return_lse`` only
            False).

    Raises:
        ValueError: ``return_lse`` other than False (forward returns ``out`` only; call
            :func:`sequence_parallel_attn` for ``(out, lse)``); ``group`` a DeviceMesh of
            more than one dimension.
        TypeError: an option that :func:`sequence_parallel_attn` does not take.
    """

    def __init__(
        self,
        *,
        strategy: Strategy | str = Strategy.TOKEN_RING,
        causal: bool = False,
        softmax_scale: float | None = None,
        group: GroupLike = None,
        layout: Layout | str = Layout.CONTIGUOUS,
        **options: Any,
    ) -> None:
        super().__init__()
        known = inspect.signature(sequence_parallel_attn).parameters
        unknown = sorted(name for name in options if name not in known or name in ("q", "k", "v"))
        if unknown:
            raise TypeError(
                f"SequenceParallelAttention got options that sequence_parallel_attn does not "
                f"take: {', '.join(unknown)}"
            )
        if options.get("return_lse", False) is not False:
            raise ValueError(
                "return_lse must be False for SequenceParallelAttention (forward returns out "
                "only; call sequence_parallel_attn(..., return_lse=True) for (out, lse)); got "
                f"{options['return_lse']!r}"
            )
        self.strategy: Strategy | str = "auto" if strategy == "auto" else Strategy.parse(strategy)
        self.layout = Layout.parse(layout)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.group = group
        self.options = options
        # so that a compiled forward can name its group (Note [Handles] in runtime/op.py): a
        # ProcessGroup or a 1-D DeviceMesh's (mesh["sp"]; a mesh of more dims raises here)
        named = _mesh_group(group)
        if isinstance(named, dist.ProcessGroup):
            op.remember_group(named)

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallelAttention:
        # A copy (an EMA model: torch.optim.swa_utils.AveragedModel, copy.deepcopy(model))
        # attends over the same group: a ProcessGroup or Communicator is a handle to the
        # ranks, not state, and copying one raised "cannot pickle ProcessGroup".
        memo.setdefault(id(self.group), self.group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fixed = ("strategy", "causal", "softmax_scale", "group", "layout")
        options = {name: getattr(self, name) for name in fixed} | self.options
        return cast(torch.Tensor, sequence_parallel_attn(q, k, v, **options))

    def extra_repr(self) -> str:
        name = self.strategy if isinstance(self.strategy, str) else self.strategy.value
        return f"strategy={name}, causal={self.causal}, layout={self.layout.value}"
