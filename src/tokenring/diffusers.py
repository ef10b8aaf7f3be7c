"""Diffusion transformers: joint text+image attention, cross-attention and a diffusers processor.

This module owns the attention patterns of diffusion transformers under sequence parallelism:
:func:`joint_attn` (MMDiT joint text+image attention, text replicated or sharded),
:func:`cross_attn` (K/V of another length, replicated or sharded) and
:class:`FluxSequenceParallelProcessor` for diffusers' ``FluxTransformer2DModel`` (diffusers is
imported only when the processor runs: ``pip install "tokenring-attention[diffusers]"``).
Image tokens are always sharded contiguously, with their own position ids (RoPE per token).

Legend: B batch, T text tokens (global), t text tokens on this rank, S image tokens (global),
s image tokens on this rank, Skv cross-attention keys, H heads, D head dim, C hidden size,
P world size.

Note [Joint attention with replicated text]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank holds the whole text and its image shard, and gives the ring ``[text (T), image
shard (s)]``, so the ring sees every text key P times::

    rank:            0              1         ...        P-1
    local seq:   [T | img_0]    [T | img_1]   ...    [T | img_P-1]
    keys seen:   P copies of each text key, one copy of each image key

P copies of a key with logit z weigh as one of logit z + log P, so one extra head channel
biases each text key by -log P (q gets c, a text key -log(P) / (scale * c), an image key 0,
v 0; that output channel is dropped; c = 2**m near sqrt(log(P) / scale), so that a small
scale does not overflow float16, and the product is the same rounded bias as with c = 1)::

    logit(q, k_text) = scale * (q . k + c * (-log P / (scale * c))) = scale * q . k - log P
    sum over the P copies: P * exp(scale * q . k - log P) = exp(scale * q . k)

so the result is exactly attention over T + S keys, forward and backward by
``sequence_parallel_attn`` (splitting the call and merging by lse would cost a backward with
lse's gradient: Note [Gradient of lse] in tokenring.runtime.op). Costs: head dim D + 8
(bias and 7 zeros, keeping D % 8 == 0 for the fused GPU kernels; D + 1 otherwise) and the
text in every travelling block. Gradients of replicated tensors are partial per rank (their
sum is the gradient); in bf16/fp16 the rounded bias costs a logit error up to about
log(P) * 2**-8.

Note [Which text placement is cheaper]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Sharded text: rank r passes ``[text_r, image_r]`` to one non-causal call (token order does not
matter without a causal mask). Per rank, per layer::

                      keys per query    tokens per travelling block    text rows computed
    sharded           T + S             (T + S) / P                    T / P
    replicated        P * T + S         T + S / P                      T (every rank)

Sharded is never more attention work but needs T and S divisible by P; replicated is
negligibly dearer when T << S / P and keeps the text stream whole on every rank, with any T.

Note [Cross-attention with K/V of another length]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ring step pairs equal blocks, so :func:`cross_attn` does not go round the ring::

    kv="replicated"   every rank has all Skv keys: local attention, no communication
    kv="sharded"      rank r has its Skv_r keys (any lengths): all-gather K/V, then local
                      attention; the backward sums the K/V gradients over the ranks and
                      keeps this rank's rows
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenring.api import (
    AUTO_NEEDS_HARDWARE,
    GroupLike,
    check_group,
    check_softmax_scale,
    get_communicator,
    refuse_tangents,
    sequence_parallel_attn,
)
from tokenring.core.enums import parse_enum
from tokenring.core.schedule import Strategy
from tokenring.core.sketch import Sketch, replicated_rtol, sketch
from tokenring.model.costmodel import Hardware
from tokenring.runtime.comm import Communicator
from tokenring.runtime.executor import outside_autocast

__all__ = [
    "FluxSequenceParallelProcessor",
    "KVPlacement",
    "TextPlacement",
    "cross_attn",
    "joint_attn",
]


class TextPlacement(enum.Enum):
    """Where the text part of a joint sequence lives (Note [Which text placement is cheaper])."""

    REPLICATED = "replicated"
    """Every rank holds all T text tokens."""
    SHARDED = "sharded"
    """Rank r holds its contiguous shard of the text, like the image."""

    @classmethod
    def parse(cls, value: object) -> TextPlacement:
        return parse_enum(cls, value, "text")


class KVPlacement(enum.Enum):
    """Where cross-attention K/V live (Note [Cross-attention with K/V of another length])."""

    REPLICATED = "replicated"
    """Every rank holds all Skv keys and values."""
    SHARDED = "sharded"
    """Rank r holds a part of them; the parts in rank order are the whole."""

    @classmethod
    def parse(cls, value: object) -> KVPlacement:
        return parse_enum(cls, value, "kv")


# The ring pairs equal blocks: ranks whose t + s differ (S, or sharded T, not divisible by P)
# are named here, in the joint check, rather than by the attention call's seq_local
ROWS_FIELD = "rows t + s (the same on every rank: S, and sharded T, split evenly)"
# Replicated inputs ride in the rank check by a sketch of their values, compared up to rounding
# (Note [Replicated values agreed by sketch] in tokenring.core.sketch); the field names the
# argument and what to do
_OWN_TEXT = (
    "a rank given its own prompt or seed wants the same on every rank, its shard of the text "
    "text='sharded'"
)
JOINT_TEXT_FIELD = f"text rows of q, k, v (replicated: the same on every rank; {_OWN_TEXT})"
FLUX_TEXT_FIELD = (
    "text: encoder_hidden_states, or hidden_states' first text_seq_len rows, and their "
    f"image_rotary_emb rows (replicated: the same on every rank; {_OWN_TEXT})"
)
# The ranks' attention calls pair up in order: a rank at another layer (a cache hook that skips
# blocks by each rank's own tokens, such as diffusers' FirstBlockCache) or with other weights
# attended with its peers' tokens of another layer, unnoticed while the shapes agree
LAYER_FIELD = (
    "layer (the signs of its query projection's first 32 weights: every rank at the same "
    "attention layer, with the same weights; a cache hook that skips blocks by each rank's own "
    "tokens, such as diffusers' FirstBlockCache, or a model built from another seed breaks it)"
)
# Which attention layer of the model, by its name there (Note [The Flux model's own check]):
# layers with the same query weights (zero-initialised, LoRA-like frozen copies) have the same
# signs, and ranks at two of them went on unnoticed
LAYER_NAME_FIELD = (
    "layer name (every rank at the same attention layer of the model; a cache hook that skips "
    "blocks by each rank's own tokens, such as diffusers' FirstBlockCache, breaks it)"
)
# The model call's replicated inputs (Note [The Flux model's own check]), each a field of its
# own; named "model call" to sort after the layer fields in a disagreement's message
CONDITIONING = ("timestep", "guidance", "pooled_projections")
CONDITIONING_FIELD = (
    "model call: {} (the same on every rank: each rank runs the same denoising step of the "
    "same prompt)"
)
CONDITIONING_SHAPES_FIELD = "model call: shapes of timestep, guidance, pooled_projections"
CROSS_KV_FIELD = (
    "k/v (replicated: the same on every rank; a rank given its own K/V or seed wants the same "
    "on every rank, its part of them kv='sharded')"
)


def _values_sketch(*tensors: torch.Tensor) -> Sketch:
    """The tensors' values as a signature field the ranks compare up to rounding (Note
    [Replicated values agreed by sketch] in tokenring.core.sketch)."""
    return sketch(*tensors, rtol=replicated_rtol(tensors[0].dtype))


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_len: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, seq, H, D); got {shape}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(
                f"{name} must have q's dtype and device ({q.dtype} on {q.device}); got "
                f"{x.dtype} on {x.device}"
            )
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"k must be (B={q.shape[0]}, seq, heads dividing {q.shape[2]}, D={q.shape[3]}); "
            f"got {tuple(k.shape)}"
        )
    if same_len and k.shape[1] != q.shape[1]:
        raise ValueError(
            f"k must have q's length {q.shape[1]} in joint attention; got {k.shape[1]}"
        )


def joint_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_text: int,
    text: TextPlacement | str,
    group: GroupLike = None,
    strategy: str = "token_ring",
    softmax_scale: float | None = None,
    hardware: Hardware | str | None = None,
) -> torch.Tensor:
    """Non-causal joint attention over text and image tokens, image tokens sharded.

    Args:
        q, k, v: ``(B, t + s, H, D)``: this rank's text rows (all T with ``text="replicated"``)
            then its image shard; k/v may have fewer heads (GQA).
        num_text: t, the number of text rows at the start of the local sequence.
        text: ``"replicated"`` or ``"sharded"`` (Note [Which text placement is cheaper]).
        group, strategy, hardware: as for :func:`tokenring.sequence_parallel_attn`.
        softmax_scale: default ``D ** -0.5``.

    Returns:
        ``(B, t + s, H, D)`` in q's dtype: each row attended to all T + S keys.

    Raises:
        ValueError: on every rank: a rank's bad shapes, dtypes, ``num_text`` outside
            ``[0, t + s]``, unknown ``text`` or softmax_scale that is not a finite number > 0
            (with replicated text, also one so small that the text keys' bias overflows q's
            dtype); ranks that differ in ``text``, with replicated text in ``num_text`` or in
            the values of the text rows of q, k, v beyond rounding (a sketch of them: Note
            [Replicated values agreed by sketch] in tokenring.core.sketch), or in their rows
            t + s.
    """
    refuse_tangents({"q": q, "k": k, "v": v}, before_exchange=True)  # Note [Forward-mode AD]
    comm = get_communicator(group)
    validate = functools.partial(
        _joint_checked, q, k, v, num_text, text, softmax_scale, comm.world_size
    )
    # every rank's placement (and replicated num_text) checked with the others' before the
    # attention call's own check: a rank that fails here does not leave its peers waiting
    placement = comm.agreed(validate, what="joint attention call", deferred=True)
    options: dict[str, Any] = {"strategy": strategy, "hardware": hardware}
    options["softmax_scale"] = softmax_scale
    return _joint(q, k, v, num_text=num_text, text=placement, comm=comm, **options)


def _joint_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_text: Any,
    text: Any,
    softmax_scale: float | None,
    world_size: int,
) -> tuple[TextPlacement, dict[str, Any]]:
    """:func:`joint_attn`'s own checks; the placement and what the ranks must agree on."""
    placement = TextPlacement.parse(text)
    _check_qkv(q, k, v, same_len=True)
    refuse_tangents({"q": q, "k": k, "v": v})  # Note [Forward-mode AD] in tokenring.api
    check_softmax_scale(softmax_scale)  # the replicated text's key bias divides by it
    if isinstance(num_text, bool) or not isinstance(num_text, int):
        raise ValueError(f"num_text must be an int; got {num_text!r}")
    if not 0 <= num_text <= q.shape[1]:
        raise ValueError(f"num_text must be in [0, {q.shape[1]}] (q.shape[1]); got {num_text}")
    replicated = placement is TextPlacement.REPLICATED
    if replicated and num_text and world_size > 1 and q.dtype.is_floating_point:
        _check_bias_range(world_size, softmax_scale, q)
    # the bias is applied to the first num_text keys of each rank: all the same T
    signature: dict[str, Any] = {"text": placement.value}
    signature["num_text"] = num_text if replicated else None
    if replicated and num_text and world_size > 1:  # the same T rows, by value
        text_rows = (x[:, :num_text] for x in (q, k, v))
        signature[JOINT_TEXT_FIELD] = _values_sketch(*text_rows)
    return placement, signature | {ROWS_FIELD: q.shape[1]}


def _joint(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_text: int,
    text: TextPlacement,
    comm: Communicator,
    strategy: str,
    softmax_scale: float | None = None,
    hardware: Hardware | str | None = None,
) -> torch.Tensor:
    """:func:`joint_attn` once the ranks agree on ``text`` (and replicated, ``num_text``)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    options: dict[str, Any] = {"strategy": strategy, "hardware": hardware, "softmax_scale": scale}
    options |= {"group": comm, "causal": False, "layout": "contiguous"}
    if text is TextPlacement.SHARDED or comm.world_size == 1 or num_text == 0:
        return cast(torch.Tensor, sequence_parallel_attn(q, k, v, **options))  # no return_lse
    # the bias channel (Note [Joint attention with replicated text]): E = 8 when 8 divides D
    b, n, d = q.shape[0], q.shape[1], q.shape[3]
    extra = 8 if d % 8 == 0 else 1
    q_unit, k_bias = _bias_factors(-math.log(comm.world_size) / scale)
    q_extra = q.new_zeros(b, n, q.shape[2], extra)  # (B, t + s, Hq, E)
    q_extra[..., 0] = q_unit
    k_extra = k.new_zeros(b, n, k.shape[2], extra)  # (B, t + s, Hkv, E)
    k_extra[:, :num_text, :, 0] = k_bias
    out = sequence_parallel_attn(
        torch.cat([q, q_extra], dim=-1),  # (B, t + s, Hq, D + E)
        torch.cat([k, k_extra], dim=-1),
        torch.cat([v, v.new_zeros(b, n, v.shape[2], extra)], dim=-1),
        **options,
    )
    return cast(torch.Tensor, out)[..., :d]  # (B, t + s, Hq, D)


def _bias_factors(bias: float) -> tuple[float, float]:
    """``(2**m, bias / 2**m)``: the text keys' bias split between q's and k's extra channel by
    a power of two, so that neither exceeds about sqrt(|bias|). Their product is the rounded
    bias exactly (a power of two scales without rounding), the same as ``(1, bias)``, but a
    small softmax_scale no longer overflows float16: bias = -log(2) / 1e-5 = -69315 was inf
    there, which gave the text keys no weight at all (0.36 off on 2 ranks)."""
    m = max(0, math.ceil(math.log2(abs(bias)) / 2)) if bias else 0
    return 2.0**m, bias / 2.0**m


def _check_bias_range(world_size: int, softmax_scale: float | None, q: torch.Tensor) -> None:
    """ValueError where the replicated text's bias channel overflows q's dtype even split by
    :func:`_bias_factors` (float16 with softmax_scale below about log(P) * 2**-32)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    factors = _bias_factors(-math.log(world_size) / scale)
    if max(abs(x) for x in factors) > torch.finfo(q.dtype).max:
        raise ValueError(
            f"softmax_scale={softmax_scale!r} is too small for replicated text in {q.dtype} "
            f"on {world_size} ranks: its key bias -log({world_size}) / scale = "
            f"{-math.log(world_size) / scale:.3g} overflows {q.dtype}; pass a larger "
            "softmax_scale, another dtype or text='sharded'"
        )


class _GatherSequence(torch.autograd.Function):
    """All-gather of (B, n_r, H, D) along the sequence over a Communicator; the backward sums
    the gathered gradient over the ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, lengths: list[int]) -> torch.Tensor:
        longest = max(lengths)
        padded = F.pad(x, (0, 0, 0, 0, 0, longest - x.shape[1]))  # (B, max n_r, H, D)
        blocks = comm.all_gather(padded, label="cross-attention K/V", shapes_agreed=True)
        ctx.comm, ctx.lengths = comm, lengths
        return torch.cat([blk[:, :n] for blk, n in zip(blocks, lengths, strict=True)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()  # (B, Skv, H, D)
        ctx.comm.all_reduce(grad, label="cross-attention K/V gradient").wait()
        start = sum(ctx.lengths[: ctx.comm.rank])
        return grad[:, start : start + ctx.lengths[ctx.comm.rank]], None, None


def cross_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv: KVPlacement | str,
    group: GroupLike = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Cross-attention (no mask): this rank's queries attend to all Skv keys.

    Args:
        q: ``(B, s, Hq, D)``: this rank's query rows (any sharding).
        k, v: ``(B, Skv, Hkv, D)`` with ``kv="replicated"`` (the same on every rank), or
            ``(B, Skv_r, Hkv, D)``, this rank's part in rank order, with ``kv="sharded"``
            (Note [Cross-attention with K/V of another length]).
        softmax_scale: default ``D ** -0.5``.

    Returns:
        ``(B, s, Hq, D)`` in q's dtype. Gradients of replicated K/V are partial on each rank
        (their sum over the ranks is the gradient); of sharded K/V, complete.

    Raises:
        ValueError: bad shapes or dtypes, an unknown ``kv``, a softmax_scale that is not a
            finite number > 0, a group that is not one, or no key at all; on every rank of a
            group (replicated K/V too: one small exchange), also where one rank's call is bad
            or the ranks differ in ``kv`` or their K/V in batch, heads, head dim, dtype or
            device type, and with replicated K/V in length and in their values beyond
            rounding (Note [Replicated values agreed by sketch] in tokenring.core.sketch),
            with sharded K/V in whether they need a gradient.
    """
    refuse_tangents({"q": q, "k": k, "v": v}, before_exchange=True)  # Note [Forward-mode AD]
    if group is None and not dist.is_initialized():  # one process: nobody to agree with
        _cross_checked(q, k, v, kv, softmax_scale, 1)
        placement = KVPlacement.parse(kv)
        if placement is KVPlacement.SHARDED:
            comm = get_communicator(group)  # raises: not initialised
    else:
        # every rank's checks and placement agreed, replicated K/V too (which need no
        # exchange): a rank with sharded K/V would wait for its peers in the gather, and a
        # rank's bad call would fail there alone (Note [Rank agreement] in tokenring.api);
        # sharded K/V's shapes before the gather, which a rank that differs would make
        # mismatch (abort, or hang in the backward's all-reduce)
        comm = get_communicator(group)  # raises for a bad group, on this rank alone
        validate = functools.partial(_cross_checked, q, k, v, kv, softmax_scale, comm.world_size)
        comm.agreed(validate, what="cross-attention call")
        placement = KVPlacement.parse(kv)
    if placement is KVPlacement.SHARDED:
        lengths = comm.all_gather_int(k.shape[1], k.device, label="cross-attention K/V lengths")
        if sum(lengths) == 0:  # every rank raises: they all see the same lengths
            raise ValueError("k and v must hold at least one key on some rank; got none on any")
        k = _GatherSequence.apply(k.contiguous(), comm, lengths)  # (B, Skv, Hkv, D)
        v = _GatherSequence.apply(v.contiguous(), comm, lengths)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, seq, D)
    # in q's dtype under autocast too, as every tokenring attention (Note [Autocast] in
    # tokenring.runtime.executor): autocast ran it in bfloat16 and returned bfloat16
    with outside_autocast():
        out = F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)  # (B, s, Hq, D)


def _cross_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: Any,
    softmax_scale: float | None,
    world_size: int,
) -> tuple[None, dict[str, Any]]:
    """:func:`cross_attn`'s own checks; what the ranks' K/V must agree on (sharded K/V are
    gathered, and their gradients all-reduced, over every rank)."""
    placement = KVPlacement.parse(kv)
    _check_qkv(q, k, v, same_len=False)
    refuse_tangents({"q": q, "k": k, "v": v})  # Note [Forward-mode AD] in tokenring.api
    check_softmax_scale(softmax_scale)
    if placement is KVPlacement.REPLICATED and k.shape[1] == 0:
        raise ValueError(f"k must hold at least one key; got shape {tuple(k.shape)}")
    signature: dict[str, Any] = {
        "kv": placement.value,
        "batch": k.shape[0],
        "heads_kv": k.shape[2],
        "head_dim": k.shape[3],
        "dtype": str(k.dtype),
        "device type": k.device.type,
    }
    if placement is KVPlacement.REPLICATED:  # nothing gathered: the same K/V on every rank
        # (a rank passing its own part, or other K/V, attended to them alone, unnoticed):
        # their length, and their values (Note [Replicated values agreed by sketch])
        signature["Skv (replicated: every rank's K/V)"] = k.shape[1]
        if world_size > 1:
            signature[CROSS_KV_FIELD] = _values_sketch(k, v)
        return None, signature
    grad = torch.is_grad_enabled()
    return None, signature | {
        "k needs grad": grad and k.requires_grad,
        "v needs grad": grad and v.requires_grad,
    }


# -- diffusers --------------------------------------------------------------------------------

# Note [The Flux model's own check]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A processor sees one attention layer, but three mistakes live at the model and gave numbers
# that match no model, with no error:
#
#   mistake                                   what the ranks did                off 1 process
#   the processor on some layers only         the others attend to this rank's  0.10
#   (block.attn.set_processor(...))           shard alone
#   text="sharded", one rank given another    nothing replicated reaches the    0.08-0.9
#   timestep / guidance / pooled_projections  attention: each its own step
#   ranks at different layers whose query     the layer check by weight signs   (another
#   weights agree (zero-init, frozen copies)  saw the same signs                layer's tokens)
#
# (tests/test_diffusers_audit3.py's tiny float64 Flux, 2 ranks.)
# So the model holds a forward pre-hook (installed at the processor's first call: diffusers'
# set_attn_processor tells the processor nothing, so it finds the model whose call it is in
# from the caller's frames, ``Module._call_impl``'s, and checks that call with its arguments
# there). Per model call it names every attention layer (its name in the model rides in each
# layer's check: LAYER_NAME_FIELD) and leaves one pending check on the layers: the layers
# without the processor, and the timestep, guidance and pooled_projections. The first layer
# with the processor takes it into its own rank check, so the model adds no exchange (a
# separate one would pair, on a rank that a cache hook sent to the next call early, with its
# peer's layer check: "ranks are in different calls", naming no layer). Each of the three
# rides as a sketch of its own (Note [Agreement by digest] in tokenring.runtime.comm), so a
# disagreement names the argument (with replicated text the text too: its rows reaching the
# attention are modulated by the conditioning). They are the caller's inputs, which no rank
# computes, not the library's replicated outputs whose last bits each rank's merge rounds
# its own way: so they are compared within float32's rounding at most (_input_sketch), not
# replicated_rtol's 0.25 of half precision, which let a bfloat16 pipeline's ranks a tenth of
# a denoising step apart (its timestep is cast to the latents' dtype) return numbers 0.52 off
# one process (tests/test_review_audit.py). Not checked: a model called through
# ``model.forward`` (no hooks run) or one whose processor is only ever called outside a model
# call.

# Note [A Flux model call that fails on one rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Between its attention layers a model runs code of its own (embeddings, norms, MLPs, the
# output projection, a user's hook): one that raised on one rank left its peers waiting out the
# timeout in the next layer's check, "rank(s) [1] did not arrive", naming no cause (a hook on
# the second joint block of the tiny Flux, 2 ranks, 4 s timeout: 4.0 s). So the model also
# holds a forward hook that runs when its forward raises (``always_call``): an error of this
# rank's own (not a rank check's verdict, nor of a failed communicator: Note [Errors every
# rank raised] in tokenring.runtime.comm) is told to the peers at the check they meet next
# (Communicator.tell; the next layer's, or after the last layer the next model call's first),
# and every rank raises naming it. The model's first call is not covered: the hooks are
# installed by its first attention layer, and torch reads a module's hooks as its call starts.


LAYER_CHECK = "Flux attention layer"
"""The rank check of each attention layer of FluxSequenceParallelProcessor."""


@dataclass(eq=False)
class _ModelCheck:
    """The model call's pending check (Note [The Flux model's own check])."""

    model: str
    """The model's class name."""
    layers: int
    """Its attention layers."""
    missing: list[str]
    """The names of those without a FluxSequenceParallelProcessor."""
    conditioning: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """The call's replicated inputs among CONDITIONING that its forward takes."""
    pending: bool = True
    """Not yet taken by a layer's check."""


@functools.cache
def _forward_signature(cls: Any) -> inspect.Signature:
    """The model class's forward signature (its arguments bound by name per call)."""
    return inspect.signature(cls.forward)


def _model_pre_hook(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Name the model's attention layers and leave the call's check on them (Note [The Flux
    model's own check]); nothing where no layer has the processor (one process again)."""
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "set_processor")]
    carriers = [
        isinstance(getattr(m, "processor", None), FluxSequenceParallelProcessor) for _, m in layers
    ]
    check = None
    if any(carriers):
        missing = [n for (n, _), has in zip(layers, carriers, strict=True) if not has]
        check = _ModelCheck(type(model).__name__, len(layers), missing)
        forward: inspect.Signature = _forward_signature(cast(Any, type(model)))
        try:
            bound = forward.bind_partial(model, *args, **kwargs)
        except TypeError:  # the model's own call raises for it
            bound = None
        if bound is not None:
            for name in CONDITIONING:
                if name in forward.parameters:
                    x = bound.arguments.get(name)
                    check.conditioning[name] = x if isinstance(x, torch.Tensor) else None
    prefix = type(model).__name__
    for name, m in layers:
        m._tokenring_layer = f"{prefix}.{name}"
        m._tokenring_call = check


@torch.compiler.disable  # reads the caller's frames
def _bind_model(attn: Any) -> None:
    """Find the model call ``attn`` runs in (the nearest ``Module._call_impl`` frame of a
    diffusers model holding it), hook the model and check this call (Note [The Flux model's
    own check]). Nothing where there is none (the processor called on its own)."""
    call = torch.nn.Module._call_impl.__code__
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code is call:
            local = frame.f_locals
            model: Any = local.get("self")
            if (
                model is not attn
                and isinstance(model, torch.nn.Module)
                and hasattr(model, "attn_processors")
                and any(m is attn for m in model.modules())
            ):
                if not getattr(model, "_tokenring_hooked", False):
                    model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
                    model.register_forward_hook(_model_failed_hook, always_call=True)
                    setattr(model, "_tokenring_hooked", True)  # noqa: B010 (a Module's attribute)
                _model_pre_hook(model, tuple(local.get("args", ())), dict(local.get("kwargs", {})))
                return
        frame = frame.f_back


@torch.compiler.disable  # a failure's path (hooks do not run under compile on one)
def _model_failed_hook(model: Any, args: Any, result: Any) -> None:
    """Where the model's forward raised on this rank alone, tell the peers (Note [A Flux
    model call that fails on one rank]); nothing where it returned."""
    exc = sys.exc_info()[1]
    if not isinstance(exc, Exception) or not _raised_by_call(model, exc):
        return  # returned (or KeyboardInterrupt: not exchanged)
    processor = next(
        (
            m.processor
            for m in model.modules()
            if isinstance(getattr(m, "processor", None), FluxSequenceParallelProcessor)
        ),
        None,
    )
    if processor is None:
        return
    comm = get_communicator(processor.group)
    if not comm.raised_on_every_rank(exc):
        comm.tell(exc, what=LAYER_CHECK)


def _raised_by_call(model: Any, exc: Exception) -> bool:
    """Whether ``exc`` is the error of the model call whose always-called forward hook runs
    now. torch runs such a hook after a forward that returned too, where ``sys.exc_info()`` is
    whatever its caller handles (a model call inside an ``except`` block, a retry after a
    failed call): that error is not this call's. A call's own error was caught by the nearest
    frame of this model's ``Module._call_impl``, which runs the hook from its handler: the
    error's traceback starts at that frame (after a forward that returned, the nearest frame of
    the model is the closure that runs the forward and its hooks)."""
    tb = exc.__traceback__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and tb is not None:
        if frame.f_locals.get("self") is model:
            return frame is tb.tb_frame
        frame = frame.f_back
    return False


def _take_model_check(attn: Any) -> _ModelCheck | None:
    """The model call's check where this is its first layer with the processor, else None."""
    if not hasattr(attn, "_tokenring_call"):  # the first call: the model is not hooked yet
        _bind_model(attn)
    check = getattr(attn, "_tokenring_call", None)
    if check is None or not check.pending:
        return None
    check.pending = False
    return check


def _model_signature(check: _ModelCheck, world_size: int) -> dict[str, Any]:
    """The model call's check (raises where layers lack the processor), as signature fields."""
    if check.missing:
        shown = ", ".join(check.missing[:8]) + (
            f" and {len(check.missing) - 8} more" if len(check.missing) > 8 else ""
        )
        raise ValueError(
            f"FluxSequenceParallelProcessor is set on {check.layers - len(check.missing)} of "
            f"the {check.layers} attention layers of this {check.model}; {shown} would attend "
            "to this rank's tokens alone: set it on every layer with "
            "model.set_attn_processor(FluxSequenceParallelProcessor(...))"
        )
    if world_size == 1:
        return {}
    shapes = {n: None if x is None else list(x.shape) for n, x in check.conditioning.items()}
    signature: dict[str, Any] = {CONDITIONING_SHAPES_FIELD: shapes}
    for name, x in check.conditioning.items():
        if x is not None and x.numel():
            signature[CONDITIONING_FIELD.format(name)] = _input_sketch(x)
    return signature


def _input_sketch(x: torch.Tensor) -> Sketch:
    """A model call's input as a signature field: compared within float32's rounding at
    most, whatever its dtype (Note [The Flux model's own check])."""
    return sketch(x, rtol=min(replicated_rtol(x.dtype), replicated_rtol(torch.float32)))


@dataclass(frozen=True, kw_only=True, slots=True)
class FluxSequenceParallelProcessor:
    """diffusers' ``FluxAttnProcessor`` (0.42) with its attention split over a group.

    ``model.set_attn_processor(FluxSequenceParallelProcessor(group=...))``, then call the
    model on this rank's image shard (``hidden_states``, ``img_ids``) and the text (all of it,
    or with ``text="sharded"`` its shard). With replicated text pass
    ``joint_attention_kwargs={"text_seq_len": T}`` for the single-stream blocks; with sharded
    text it is optional, and checks that the ranks' text rows add up to T. With replicated
    text, every layer checks that the ranks' text (and its rotary rows) is the same up to
    rounding (Note [Replicated values agreed by sketch] in tokenring.core.sketch): a rank given
    its own prompt, or its shard of the text, raises on every rank; every layer also checks
    that the ranks are at the same layer (by its name in the model), with the same weights (a
    cache hook that skips blocks on some ranks only, a model from another seed). Each model
    call's first layer also checks that every attention layer of the model has the processor
    and that the ranks' ``timestep``, ``guidance`` and ``pooled_projections`` agree (Note [The
    Flux model's own check]: the processor hooks its model at its first call). Attention masks,
    IP-adapter inputs and an attention other than diffusers' ``FluxAttention`` raise
    NotImplementedError.

    Raises:
        ValueError: when made, an unknown ``text`` or ``strategy``, ``"hybrid"``, hardware
            without ``"auto"`` or ``"auto"`` without hardware, or a group that is not one.
    """

    group: GroupLike = None
    """The sequence-parallel group (ProcessGroup, 1-D DeviceMesh, Communicator or None)."""
    text: TextPlacement | str = TextPlacement.REPLICATED
    """Where the text lives (Note [Which text placement is cheaper])."""
    strategy: str = "token_ring"
    """A tokenring strategy, or "auto" with ``hardware``."""
    hardware: Hardware | str | None = None
    """For ``strategy="auto"``: a preset name or a Hardware."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", TextPlacement.parse(self.text))
        check_group(self.group)  # here, not at the model's first attention layer
        if self.strategy != "auto":
            strategy = Strategy.parse(self.strategy).value
            if strategy == Strategy.HYBRID.value:
                raise ValueError(
                    "strategy 'hybrid' runs on a 2-D mesh, not one group; "
                    "FluxSequenceParallelProcessor takes a one-group strategy or 'auto'"
                )
            if self.hardware is not None:
                raise ValueError(
                    f"hardware is only used with strategy='auto'; got hardware="
                    f"{self.hardware!r} with strategy={strategy!r}"
                )
            object.__setattr__(self, "strategy", strategy)
        elif self.hardware is None:
            raise ValueError(AUTO_NEEDS_HARDWARE)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        text_seq_len: int | None = None,
        ip_hidden_states: Any = None,
        ip_adapter_masks: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One attention layer: ``hidden_states`` ``(B, s, C)`` (single-stream blocks:
        ``(B, t + s, C)``, text first), ``encoder_hidden_states`` ``(B, t, C)`` or None.
        Returns what ``FluxAttnProcessor`` returns: ``(image (B, s, C), text (B, t, C))`` with
        ``encoder_hidden_states``, else ``(B, t + s, C)``."""
        try:
            from diffusers.models.embeddings import apply_rotary_emb
            from diffusers.models.transformers.transformer_flux import FluxAttention
        except ImportError as exc:
            raise ImportError(
                "tokenring.diffusers needs diffusers for its processor: "
                'pip install "tokenring-attention[diffusers]"'
            ) from exc
        comm = get_communicator(self.group)
        text = TextPlacement.parse(self.text)
        flux = isinstance(attn, FluxAttention)
        check = _take_model_check(attn) if flux else None  # Note [The Flux model's own check]
        validate = functools.partial(
            _layer_checked,
            check,
            attn if flux else None,
            type(attn).__name__,
            hidden_states,
            encoder_hidden_states,
            text,
            text_seq_len,
            (attention_mask, ip_hidden_states, ip_adapter_masks),
            image_rotary_emb,
            comm.world_size,
        )
        # every rank's checks, placement and text rows agreed before any collective: a rank
        # that raised alone left the others waiting in the next exchange (the model call's
        # first layer also the model's: Note [The Flux model's own check])
        num_text = comm.agreed(validate, what=LAYER_CHECK, deferred=True)
        sharded = text is TextPlacement.SHARDED and encoder_hidden_states is not None
        if sharded and text_seq_len is not None:  # the ranks' text rows must add up to T
            _check_sharded_text_len(text_seq_len, num_text, comm)
        query, key, value = _joint_qkv(attn, hidden_states, encoder_hidden_states)
        if image_rotary_emb is not None:  # (cos, sin), each (t + s, D), from the local ids
            rotary: Any = image_rotary_emb  # diffusers annotates it as a 1-tuple
            rotate: Any = apply_rotary_emb  # (its return type admits a tuple: not for these)
            query, key = (rotate(x, rotary, sequence_dim=1) for x in (query, key))
        options: dict[str, Any] = dict(comm=comm, strategy=self.strategy, hardware=self.hardware)
        out = _joint(query, key, value, num_text=num_text, text=text, **options)
        out = out.flatten(2, 3).to(query.dtype)  # (B, t + s, H, D) -> (B, t + s, C)
        if encoder_hidden_states is None:
            return out
        text_out, image_out = out.split_with_sizes([num_text, out.shape[1] - num_text], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def _layer_checked(
    check: _ModelCheck | None,
    attn: Any,
    attn_name: str,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    text: TextPlacement,
    text_seq_len: Any,
    refused: tuple[Any, Any, Any],
    rotary: Any,
    world_size: int,
) -> tuple[int, dict[str, Any]]:
    """One layer's checks (``attn``: None when not a ``FluxAttention``; ``check``: the model
    call's, at its first layer with the processor): the number of text rows ``t`` among this
    rank's, and what the ranks must agree on."""
    if attn is None:  # another model's projections, norms, outputs
        raise NotImplementedError(
            "FluxSequenceParallelProcessor runs diffusers' FluxAttention (Flux and the "
            f"models built on its blocks); got {attn_name}"
        )
    _refuse_inputs(*refused)
    for name, x in (
        ("hidden_states", hidden_states),
        ("encoder_hidden_states", encoder_hidden_states),
    ):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 3):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a tensor of shape (B, seq, C); got {shape}")
    rows = hidden_states.shape[1] + (
        0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
    )
    _check_rotary(rotary, rows, attn.head_dim)
    num_text = _text_rows(attn, hidden_states, encoder_hidden_states, text, text_seq_len)
    signature: dict[str, Any] = {}
    if world_size > 1:  # which layer, by its weights and name: the ranks' calls pair up in order
        signature[LAYER_FIELD] = _layer_signs(attn)
        signature[LAYER_NAME_FIELD] = getattr(attn, "_tokenring_layer", None)
    text_sketched = text is TextPlacement.REPLICATED and num_text and world_size > 1
    if check is not None:
        signature |= _model_signature(check, world_size)
    if text_sketched:  # by value too
        text_rows = [hidden_states[:, :num_text]]
        if encoder_hidden_states is not None:
            text_rows = [encoder_hidden_states]
        text_rows += [x[:num_text] for x in rotary or ()]  # the text rows' (cos, sin)
        signature[FLUX_TEXT_FIELD] = _values_sketch(*text_rows)
    return num_text, signature | {
        "text": text.value,
        "block": "single-stream" if encoder_hidden_states is None else "joint",
        "text_seq_len": text_seq_len,
        # the replicated text's key bias needs the same T on every rank
        "num_text": num_text if text is TextPlacement.REPLICATED else None,
        # rotary embeddings on some ranks' rows only would attend rotated against plain
        "image_rotary_emb": rotary is not None,
        ROWS_FIELD: rows,
    }


def _text_rows(
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    text: TextPlacement,
    text_seq_len: Any,
) -> int:
    """The number of text rows among this rank's joint rows, ``text_seq_len`` checked."""
    if encoder_hidden_states is not None:
        if attn.added_kv_proj_dim is None:
            raise NotImplementedError(
                "encoder_hidden_states given to an attention without added K/V "
                "projections (added_kv_proj_dim=None): not a Flux joint block"
            )
        num_text = int(encoder_hidden_states.shape[1])
        if text_seq_len is not None and text is TextPlacement.REPLICATED:
            _check_text_len(text_seq_len, num_text)
        elif text_seq_len is not None:  # sharded: the rows add up to it (checked after)
            _check_count(text_seq_len)
        return num_text
    if text is TextPlacement.SHARDED:
        return 0  # the local joint sequence is one block of the ring
    # text rows at the start of a single-stream block's local rows
    return _check_text_len(text_seq_len, hidden_states.shape[1], at_most=True)


def _check_rotary(rotary: Any, rows: int, head_dim: int) -> None:
    """``image_rotary_emb``: None, or ``(cos, sin)``, each ``(rows, head_dim)``: this rank's
    joint rows, text first (made from its own ``txt_ids`` and ``img_ids``)."""
    if rotary is None:
        return
    ok = isinstance(rotary, (tuple, list)) and len(rotary) == 2
    if ok and all(
        isinstance(x, torch.Tensor) and tuple(x.shape) == (rows, head_dim) for x in rotary
    ):
        return
    shown = (
        [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in rotary]
        if ok
        else type(rotary).__name__
    )
    raise ValueError(
        f"image_rotary_emb must be (cos, sin), each of shape (rows={rows}, head_dim={head_dim}) "
        f"for this rank's joint rows, text first; got {shown}"
    )


def _joint_qkv(
    attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's query, key and value ``(B, t + s, H, D)``, text rows first."""
    query, key, value = _projections(attn, hidden_states, added=False)  # (B, s, H, D)
    if encoder_hidden_states is not None:
        eq, ek, ev = _projections(attn, encoder_hidden_states, added=True)  # (B, t, H, D)
        query = torch.cat([eq, query], dim=1)  # (B, t + s, H, D)
        key = torch.cat([ek, key], dim=1)
        value = torch.cat([ev, value], dim=1)
    return query, key, value


def _layer_signs(attn: Any) -> str | None:
    """The layer by the signs of the first 32 weights of the projection ``_projections`` makes
    q with (``to_qkv`` stacks q's rows first: the same fused or not), as hex: other layers'
    (random at init, trained apart) differ, rounding does not flip a sign. None for weights
    not materialised here (on the meta device until an offloading hook moves them)."""
    fused = getattr(attn, "fused_projections", False)
    weight = (attn.to_qkv if fused else attn.to_q).weight
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta" or weight.dim() != 2:
        return None
    # read once per version of the weight (an optimizer step bumps it): on a GPU the read
    # synchronises, which every layer of every denoising step would pay
    version = None if weight.is_inference() else weight._version
    cached = getattr(attn, "_tokenring_layer_signs", None)
    if version is not None and cached is not None and cached[0] is weight and cached[1] == version:
        return cached[2]
    signs = (weight.detach()[0, :32] > 0).tolist()
    value = hex(sum(int(bit) << i for i, bit in enumerate(signs)))
    attn._tokenring_layer_signs = (weight, version, value)
    return value


def _refuse_inputs(attention_mask: Any, ip_hidden_states: Any, ip_adapter_masks: Any) -> None:
    """Raise for the inputs of ``FluxAttnProcessor`` the processor does not take."""
    if attention_mask is not None:
        shown = (
            f"a tensor of shape {tuple(attention_mask.shape)}"
            if isinstance(attention_mask, torch.Tensor)
            else f"a {type(attention_mask).__name__}"
        )
        raise NotImplementedError(
            f"FluxSequenceParallelProcessor does not support attention_mask (got {shown}); "
            "Flux passes none"
        )
    if ip_hidden_states is not None or ip_adapter_masks is not None:  # else dropped silently
        raise NotImplementedError(
            "FluxSequenceParallelProcessor does not support IP-adapter inputs "
            "(ip_hidden_states / ip_adapter_masks); got "
            f"ip_hidden_states={type(ip_hidden_states).__name__}, "
            f"ip_adapter_masks={type(ip_adapter_masks).__name__}"
        )


def _projections(attn: Any, x: torch.Tensor, *, added: bool) -> tuple[Any, Any, Any]:
    """``FluxAttnProcessor``'s q, k, v ``(B, n, H, D)`` of ``x`` ``(B, n, C)`` (fused or not; q
    and k RMS-normed); ``added``: the text stream's projections of a joint block."""
    if getattr(attn, "fused_projections", False):
        q, k, v = (attn.to_added_qkv if added else attn.to_qkv)(x).chunk(3, dim=-1)
    elif added:
        q, k, v = attn.add_q_proj(x), attn.add_k_proj(x), attn.add_v_proj(x)
    else:
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    norm_q, norm_k = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    heads = (-1, attn.head_dim)
    return norm_q(q.unflatten(-1, heads)), norm_k(k.unflatten(-1, heads)), v.unflatten(-1, heads)


def _check_count(text_seq_len: Any) -> None:
    if isinstance(text_seq_len, bool) or not isinstance(text_seq_len, int) or text_seq_len < 0:
        raise ValueError(f"text_seq_len must be an int >= 0; got {text_seq_len!r}")


def _check_sharded_text_len(text_seq_len: int, num_text: int, comm: Communicator) -> None:
    """With sharded text, ``text_seq_len`` is T: the ranks' text rows must add up to it (the
    whole text on every rank would count each text key P times). A collective."""
    held = comm.all_gather_int(num_text, torch.device("cpu"), label="text rows per rank")
    if sum(held) != text_seq_len:
        raise ValueError(
            f"text_seq_len must be the ranks' text rows added up with text='sharded' ({held} "
            f"sum to {sum(held)}); got {text_seq_len} (a rank holding the whole text wants "
            "text='replicated')"
        )


def _check_text_len(text_seq_len: Any, expected: int, *, at_most: bool = False) -> int:
    """``text_seq_len`` checked against the text rows of a joint block (``expected``) or the
    joint length of a single-stream block (``at_most``)."""
    if text_seq_len is None:  # only a single-stream block calls with None
        raise ValueError(
            "text_seq_len is required with text='replicated' in a single-stream "
            "block (the text rows are not told apart there): pass "
            "joint_attention_kwargs={'text_seq_len': T} to the model; got None"
        )
    _check_count(text_seq_len)
    if (text_seq_len > expected) if at_most else (text_seq_len != expected):
        want = f"at most the joint length {expected}" if at_most else f"{expected}"
        raise ValueError(
            f"text_seq_len must be {want} (the text rows this rank holds); got {text_seq_len}"
        )
    return text_seq_len
