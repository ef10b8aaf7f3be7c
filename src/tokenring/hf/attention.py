"""Hugging Face transformers integration: tokenring as a model's attention implementation.

Owns the bridge between transformers' registries (``AttentionInterface``,
``AttentionMaskInterface``, the losses of ``LOSS_MAPPING``) and
:func:`tokenring.sequence_parallel_attn`, and a training loop's helpers: sharding a batch
(labels shifted over the *global* sequence), gathering logits, the token-weighted loss over the
ranks and the gradient sum. transformers is imported only by :func:`register`.

Legend: B batch, S global seq, s local seq, H heads, D head dim, V vocab, P world size.

Note [How a model call reaches the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    register()                          names "tokenring", "tokenring_<strategy>", "tokenring_auto"
    from_pretrained(..., attn_implementation=name) (or from_config, set_attn_implementation)
    model(input_ids=local_ids,          (B, s): this rank's shard (shard_batch)
          position_ids=local_pos,       (1, s): global / in-document positions, for RoPE
          sequence_parallel=sp)         handed down to every attention call
      create_*_mask -> our mask function -> None for plain causal (a local causal mask is
          wrong for a zigzag shard) unless the config has a sliding_window, else a _ModelMask
          read from transformers' mask_function (Note [Model masks]), or NotImplementedError
      LlamaAttention -> our attention function -> sequence_parallel_attn(q, k, v, strategy
          from the name, mask from the _ModelMask or is_causal / sliding_window, rest from sp)
      labels= -> the model's loss function -> ours with sequence_parallel: labels shifted over
          the global sequence, the token-weighted global mean
    generate(sp, model, ids)            over a ShardedKVCache: attention gets
                                        sequence_parallel_cache= (tokenring.hf.generation)

Note [Model masks]
~~~~~~~~~~~~~~~~~~
A shard cannot use transformers' ``mask_function`` (it is over local rows), so
:func:`_model_mask` reads it back into the library's mask, recognising the pieces of
``transformers.masking_utils`` by their code objects, never by names::

    causal_mask_function              causal
    bidirectional_mask_function       not causal
    sliding_window_overlay(w)         window (w - 1, .)   keys i - w < j
    sliding_window_bidirectional(w)   window (w, w)       |i - j| <= w
    chunked_overlay(c, left_padding)  attention_chunk_size=c (left padding must be 0)
    and_masks(...)                    all of them at once
    remap_positions_for_packed_sequence, packed_sequence_mask_function
                                      ignored: documents come from SequenceParallel.cu_seqlens
    or_masks(...) (or_mask_function, block_sequence_ids), and_mask_function of the model,
    anything else                     NotImplementedError naming it

A sliding window under 1 (no key at all: Qwen2-MoE's "no window", in a mask that none of its
full-attention layers gets) becomes a _RefusedMask, raised by the attention call it reaches.
The mask function also raises for a config the attention call would refuse (Note [Layers that
mix tokens], encoder-decoder models): a model may read its mask before attention (DeepSeek
V3.2's indexer slices it), and would fail on ours with a TypeError.

A plain causal mask is None, as transformers' SDPA mask is, except for a config with a
``sliding_window``: then it is a _ModelMask too, so that a layer passing ``sliding_window=``
with a plain causal mask (OLMoE's attention passes config.sliding_window, its mask has none)
raises in the attention call. transformers' eager and SDPA attention follow the mask there,
flash-attention the keyword; a None mask could not be told from no mask (the keyword alone,
as flash-attention reads it) and the window was silently applied.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn, cast

import torch
import torch.nn.functional as F

from tokenring import _older_than
from tokenring.api import (
    GroupLike,
    SequenceParallelAttention,
    get_communicator,
    sequence_parallel_attn,
)
from tokenring.core.layout import (
    Layout,
    Sharding,
    check_int,
    make_sharding,
    normalize_cu_seqlens,
    position_ids,
    shard,
    unshard,
)
from tokenring.core.schedule import Strategy
from tokenring.model.costmodel import Hardware
from tokenring.runtime.comm import Communicator

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "LocalBatch",
    "SequenceParallel",
    "all_reduce_gradients",
    "broadcast_batch",
    "causal_lm_loss",
    "check_model",
    "data_parallel_loss",
    "gather_sequence",
    "register",
    "shard_batch",
    "shift_labels",
]

# The oldest transformers this integration is checked on: tests/test_hf*.py pass on 5.24 and
# 5.25; on 5.23 and older the mask functions and the cache layers have other signatures
# (create_causal_mask's cache keyword, get_mask_sizes, get_max_cache_shape), and on 5.20 and
# older a Llama 4 chunked model with packed documents gave other logits than one process.
MIN_TRANSFORMERS = "5.24"


def _check_transformers(installed: str) -> None:
    """Raise ImportError naming both versions when ``installed`` is older than
    MIN_TRANSFORMERS."""
    if _older_than(installed, MIN_TRANSFORMERS):
        raise ImportError(
            f"tokenring.hf needs transformers >= {MIN_TRANSFORMERS}; transformers {installed} "
            f"is installed (pip install 'transformers>={MIN_TRANSFORMERS}'): older versions "
            "build masks and caches through other signatures"
        )


ATTN_IMPLEMENTATIONS: Mapping[str, str] = MappingProxyType(
    {
        "tokenring": Strategy.TOKEN_RING.value,
        # the hybrid needs a 2-D mesh (tokenring.hybrid_attn), not one group
        **{f"tokenring_{s.value}": s.value for s in Strategy if s is not Strategy.HYBRID},
        "tokenring_auto": "auto",
    }
)
"""``attn_implementation`` name -> ``strategy`` of :func:`tokenring.sequence_parallel_attn`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallel:
    """How a model's sequence is split over the ranks of a group: pass it to the model's
    forward as ``sequence_parallel=`` and to this module's helpers."""

    group: GroupLike = None
    """ProcessGroup, 1-D DeviceMesh, ``tokenring.Communicator``, or None (default group)."""
    layout: Layout | str = Layout.ZIGZAG
    """How the sequence is sharded: ``"zigzag"`` (balances causal work) or ``"contiguous"``."""
    seq_len: int | None = None
    """S, the global length; None: S = P * s. Needed for shards of unequal length."""
    cu_seqlens: Sequence[int] | torch.Tensor | None = None
    """Document boundaries ``(0, ..., S)`` of a packed sequence, for every batch row: attention
    never crosses them, RoPE positions restart at each. Needs ``seq_len``."""
    hardware: Hardware | str | None = None
    """For ``"tokenring_auto"`` (needed by it): a ``Hardware`` or preset name
    (:func:`tokenring.resolve_strategy`); ``tokenring.hf.generate`` measures it when None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        check_int("seq_len", self.seq_len, 1, optional=True)
        if self.cu_seqlens is not None:
            if self.seq_len is None:
                raise ValueError("cu_seqlens needs seq_len (the global length it ends at)")
            cu = normalize_cu_seqlens(self.cu_seqlens, self.seq_len)
            object.__setattr__(self, "cu_seqlens", cu)

    @property
    def communicator(self) -> Communicator:
        """The group's communicator (built on first use; a collective on every rank)."""
        return get_communicator(self.group)


def refuse_padding(mask: Any, hint: str = "") -> None:
    """NotImplementedError (with ``hint``) when a padding ``attention_mask`` has zeros."""
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        suffix = f"; {hint}" if hint else ""
        raise NotImplementedError(
            f"a padding attention_mask is not supported under sequence parallelism{suffix}"
        )


def as_sequence_parallel(value: Any, name: str = "sequence_parallel") -> SequenceParallel:
    """``value``; ValueError naming ``name`` when it is not a :class:`SequenceParallel`."""
    if not isinstance(value, SequenceParallel):
        raise ValueError(
            f"{name} must be a tokenring.hf.SequenceParallel; got {type(value).__name__}"
        )
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalBatch:
    """This rank's share of a global causal-LM batch (from :func:`shard_batch`)."""

    input_ids: torch.Tensor
    """``(B, s)`` token ids."""
    position_ids: torch.Tensor
    """``(1, s)`` int64: global positions, or in-document ones with ``cu_seqlens`` (RoPE)."""
    shift_labels: torch.Tensor | None
    """``(B, s)``: the *next* global token's label (shifted before sharding)."""


def register() -> tuple[str, ...]:
    """Register every name of :data:`ATTN_IMPLEMENTATIONS` with transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``, and wrap every loss of
    ``LOSS_MAPPING``: unchanged without ``sequence_parallel=``; with it the causal-LM loss is
    :func:`causal_lm_loss` over the global sequence and other losses raise
    ``NotImplementedError``. Idempotent.

    Returns:
        The registered names.

    Raises:
        ImportError: transformers is missing or older than :data:`MIN_TRANSFORMERS`.
    """
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.loss.loss_utils import LOSS_MAPPING
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "tokenring.hf needs transformers>="
            f"{MIN_TRANSFORMERS} (AttentionInterface, AttentionMaskInterface): "
            "pip install 'tokenring-attention[hf]'"
        ) from exc
    _check_transformers(transformers.__version__)
    for name, strategy in ATTN_IMPLEMENTATIONS.items():
        AttentionInterface.register(
            name, functools.partial(_attention_forward, strategy=strategy, name=name)
        )
        AttentionMaskInterface.register(name, _global_mask)
    losses: dict[str, Any] = LOSS_MAPPING
    for loss_type, loss_fn in list(losses.items()):
        if not isinstance(loss_fn, _SequenceParallelLoss):
            losses[loss_type] = _SequenceParallelLoss(loss_type, loss_fn)
    model_class: Any = transformers.PreTrainedModel
    if not getattr(model_class.__call__, "_tokenring_counts", False):
        model_class.__call__ = _counting_call(model_class.__call__)
    output_class: Any = transformers.utils.ModelOutput
    if not getattr(output_class.to_tuple, "_tokenring_names", False):
        output_class.to_tuple = _naming_to_tuple(output_class.to_tuple)
    return tuple(ATTN_IMPLEMENTATIONS)


# Note [A forward that calls no tokenring attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A model whose forward takes **kwargs accepts sequence_parallel= whether or not it hands it
# to an attention call. Mamba, RWKV, xLSTM (recurrences), FNet (Fourier mixing), OpenAI GPT,
# DeBERTa, XLNet (attention in their own code), a hybrid without attention layers: no tokenring
# code ran in their forward, so each rank computed over its own shard alone, silently (0.04 to
# 19 off one process on 2 ranks), and neither the mask function nor the attention call could
# see it. register() wraps transformers' PreTrainedModel.__call__: the outermost model call
# given sequence_parallel= counts the tokenring attention calls it makes (a _Forward in a
# context variable); none on more than one rank raises NotImplementedError after the forward,
# on every rank (each runs the same model), with check_model's reason where it finds one. One
# rank computes the whole sequence: nothing to refuse. The same record keeps the position_ids
# tensors checked in this forward (_check_positions: once per forward on every rank alike).
# Before the forward, the same wrapper refuses a sharding that leaves a rank without a token
# (_refuse_empty_shards, from sp alone: every rank alike). The record also carries sp to the
# mask function, which transformers calls without it (Note [Padding on one rank's shard]),
# and after the forward the outputs are checked for values pooled over the sequence (Note
# [Outputs that pool over the sequence]). Its first tokenring attention call runs the
# forward's one rank check (Note [The forward's rank check]).
@dataclass(slots=True)
class _Forward:
    """The outermost model call running with sequence_parallel= (Note [A forward that calls
    no tokenring attention])."""

    sp: SequenceParallel
    cached: bool = False
    """A step of tokenring.hf.generate (sequence_parallel_cache=): its hooks own the mask and
    the logits."""
    attention_calls: int = 0
    seq_local: int | None = None
    """s: the query rows of the forward's first tokenring attention call."""
    positions_checked: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)
    """position_ids tensors that passed _check_positions, with their _version then."""
    logits_to_keep: Any = 0
    """The model call's logits_to_keep keyword (Note [Outputs that pool over the sequence])."""
    checked: bool = False
    """The forward's rank check ran (Note [The forward's rank check])."""
    labels: tuple[str, ...] = ()
    """The label keywords the model call was given (:func:`_label_keywords`; Note [A loss the
    model computes itself])."""
    global_losses: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)
    """What the losses of ``LOSS_MAPPING`` that ran under this forward with
    ``sequence_parallel=`` returned, with its _version then."""
    tuple_names: tuple[tuple[Any, ...], tuple[str, ...]] | None = None
    """The last ModelOutput turned into a tuple during the forward (return_dict=False) and its
    field names (Note [Outputs that pool over the sequence])."""

    def positions_passed(self, given: torch.Tensor) -> bool:
        return any(t is given and v == given._version for t, v in self.positions_checked)


_FORWARD: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar(
    "tokenring_forward", default=None
)
"""The outermost model call running with sequence_parallel=; None outside one."""


def _counting_call(call: Any) -> Any:
    """``call`` (a model's ``__call__``), counting its tokenring attention calls when given
    ``sequence_parallel=`` (Note [A forward that calls no tokenring attention])."""

    @functools.wraps(call)
    def counted(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        sp = kwargs.get("sequence_parallel")
        begun = None if sp is None else _begin_forward(model, sp, args, kwargs)
        if begun is None:  # no sequence_parallel=, or inside the outermost model call
            return call(model, *args, **kwargs)
        forward, token = begun
        try:
            try:
                result = call(model, *args, **kwargs)
            finally:
                _end_forward(token)
        except Exception as exc:  # Note [A forward that fails on one rank]
            _post_failure(forward, exc)
            raise
        _check_outputs(model, forward, result)
        return result

    counted._tokenring_counts = True  # type: ignore[attr-defined]
    return counted


# Note [The attention function under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What tokenring.hf adds to a model call is host code: the forward's record (_Forward, in a
# context variable), the rank checks (exchanges), the mask analysis, reading the callers'
# frames. Under torch.compile dynamo traced it, breaking the graph at each context-variable
# read, frame walk and exchange: a 2-layer Llama's first compiled forward compiled 209 frames
# (12 s with backend="eager"), recompiled some at the second and third calls (the second
# layer's attention met the forward's check done: a guard on _Forward.checked), and guarded
# code on the record's fields. So the attention function, the mask function and the model
# call's bookkeeping run eagerly (torch.compiler.disable): the graph breaks at each of them
# and nothing of theirs is traced (40 frames, 3 s, nothing compiled at the second call); the
# layers around them compile. fullgraph=True raises naming this. The communicator runs
# eagerly wherever it is called from (Note [Communication runs eagerly] in
# tokenring.runtime.comm).
_EAGER = (
    "tokenring.hf runs its rank checks, mask analysis and attention call eagerly (the graph "
    "breaks at the model call given sequence_parallel= and at each attention layer): compile "
    "with fullgraph=False (Note [The attention function under torch.compile])"
)


@torch.compiler.disable(reason=_EAGER)
def _begin_forward(
    model: torch.nn.Module, sp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_Forward, contextvars.Token[_Forward | None]] | None:
    """The record of the outermost model call given ``sp`` and its context token, or None
    inside one (Note [A forward that calls no tokenring attention])."""
    if _FORWARD.get() is not None:
        return None
    sp = as_sequence_parallel(sp)
    _refuse_empty_shards(sp, f"{type(model).__name__}'s forward")
    given = _call_arguments(model, args, kwargs)
    forward = _Forward(
        sp=sp,
        cached=given.get("sequence_parallel_cache") is not None,
        logits_to_keep=given.get("logits_to_keep", 0),
        labels=_label_keywords(given),
    )
    return forward, _FORWARD.set(forward)


def _call_arguments(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A model call's arguments by name: ``args`` bound to its forward's parameters, beside
    ``kwargs``. A label or logits_to_keep passed by position (``BertForMaskedLM(ids, mask,
    ..., labels)``) was read from the keywords alone: the forward's rank check never saw it,
    so one rank computed a loss its peers did not (Note [The forward's rank check]). A
    signature that cannot bind them leaves them unnamed (the forward raises its own
    TypeError)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named |= value
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


@torch.compiler.disable(reason=_EAGER)
def _end_forward(token: contextvars.Token[_Forward | None]) -> None:
    _FORWARD.reset(token)


@torch.compiler.disable(reason=_EAGER)
def _check_outputs(model: torch.nn.Module, forward: _Forward, result: Any) -> None:
    """After the outermost model call: no tokenring attention, outputs pooled over the
    sequence, or a loss the model computed itself, raise (Notes [A forward that calls no
    tokenring attention], [Outputs that pool over the sequence], [A loss the model computes
    itself])."""
    if forward.attention_calls == 0:
        _refuse_no_attention(model, forward.sp)
        return
    comm = forward.sp.communicator
    seq_local = forward.seq_local
    if forward.cached or seq_local is None or comm.world_size == 1:
        return
    fields = _output_fields(forward, result)

    def validate() -> tuple[None, dict[str, Any]]:  # Note [The outputs' rank check]
        _refuse_pooled_outputs(model, forward.sp, fields, seq_local)
        _refuse_own_loss(model, forward.sp, forward, fields)
        tensors = [(name, v.dim()) for name, v in fields if isinstance(v, torch.Tensor)]
        return None, {"outputs (name, dims)": tensors}

    comm.agreed(validate, what=OUTPUTS_CHECK)


@torch.compiler.disable(reason=_EAGER)
def _post_failure(forward: _Forward, exc: Exception) -> None:
    """Tell the peers that this rank's outermost forward raised ``exc``, at the rank check
    they meet next (Note [A forward that fails on one rank]); the caller raises ``exc``."""
    comm = forward.sp.communicator
    if forward.cached or comm.world_size == 1 or comm.raised_on_every_rank(exc):
        return  # generate's steps: ShardedKVCache.fail
    comm.tell(exc, what=OUTPUTS_CHECK if forward.checked else FORWARD_CHECK)


# Note [A forward that fails on one rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The ranks' forwards run code of their own between the exchanges: the embeddings, the
# layers' norms and MLPs, the final norm, the head, a loss, a user's forward hook. One that
# raised on one rank alone left its peers waiting for the timeout (300 s by default) in the
# exchange they met next, with an error naming no cause ("rank(s) [1] did not arrive"): the
# forward's rank check before the first attention call, the next attention call's check, and
# after the last one the outputs' rank check (Note [The outputs' rank check]; before it
# existed they returned, and the failing rank alone raised). The failing rank knows where its
# peers meet it next, from the exchanges it has made::
#
#     before the forward's rank check          the forward's rank check (FORWARD_CHECK): the
#       (_Forward.checked unset)               first exchange of every forward, whatever path
#                                              it takes (Note [The forward's rank check]); a
#                                              forward that makes no tokenring attention call
#                                              refuses itself there too
#     after it                                 the outputs' rank check (OUTPUTS_CHECK), or, where
#                                              it failed between the attention calls, the next
#                                              one's check: "ranks are in different calls"
#                                              on every rank, naming the failure
#
# So it posts its error there (Communicator.agree) and raises it: every rank raises at once,
# naming it ("rank 1 cannot run this model forward outputs check: ..."). An error every rank
# raised in a rank check (a verdict), or of a failed communicator, reached the peers already
# and is not posted again (Note [Errors every rank raised] in tokenring.runtime.comm); an
# error raised alike by every rank's own code is posted by each, and the ranks meet in the
# check: the communicator stays usable. tokenring.hf.generate's steps have their own protocol
# (Note [A step that fails on one rank] in tokenring.hf.generation). Not reached: peers in a
# collective of another library (FSDP's all-gathers, a user's all_reduce in the forward); the
# failing rank waits for them at most TELL_WITHIN_S (1 s: Communicator.tell), then raises
# with its communicator failed and its error in the store (a peer that reaches the check
# later reads it there), where before it waited out the communicator's timeout.


# Note [The outputs' rank check]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward's outputs are checked after it returns (Notes [Outputs that pool over the
# sequence], [A loss the model computes itself]), and what each rank finds may differ: a
# pooled (B, C, X) output passes as per-token on a rank whose shard holds C rows and raises
# on the others (uneven shards); a head that computes a loss from input_ids alone (a
# mask token in some ranks' shards only, no label keyword to compare before) returns one on
# some ranks. Such a rank raised after its forward while its peers returned their outputs
# (or met it later, in another call's check, for the timeout). So after the outermost
# forward over several ranks (not tokenring.hf.generate's steps), every rank posts its
# verdict and its tensor outputs' names and dims to one exchange: every rank raises the
# first rank's error, or the outputs that differ, or returns. One small exchange per forward,
# beside the forward's rank check and the attention calls'.
OUTPUTS_CHECK = "model forward outputs check"


def _naming_to_tuple(to_tuple: Any) -> Any:
    """``ModelOutput.to_tuple`` that records, during a forward given ``sequence_parallel=``,
    the tuple it made and its field names (Note [Outputs that pool over the sequence])."""

    @functools.wraps(to_tuple)
    def named(output: Any) -> Any:
        values = to_tuple(output)
        if torch.compiler.is_compiling():  # any model's compiled forward (fullgraph too):
            return values  # nothing recorded, so a 2-D entry of the tuple raises as unnamed
        forward = _FORWARD.get()
        if forward is not None:
            forward.tuple_names = (values, tuple(str(k) for k in output))
        return values

    named._tokenring_names = True  # type: ignore[attr-defined]
    return named


# transformers' own rule for a model's label keywords (transformers.utils.find_labels, which
# the Trainer reads for label_names): every keyword with "label" in its name, and a question-
# answering head's span positions
_SPAN_LABELS = ("start_positions", "end_positions")


def _is_label(keyword: str) -> bool:
    return "label" in keyword or keyword in _SPAN_LABELS


def _label_keywords(kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """The label keywords given (not None) in a model call's ``kwargs``, sorted."""
    return tuple(sorted(k for k, v in kwargs.items() if v is not None and _is_label(k)))


def _output_fields(forward: _Forward, result: Any) -> list[tuple[str, Any]]:
    """``result``'s top-level fields, named: a ModelOutput's (or a dict's) keys, a tuple's
    from the ModelOutput it was made of (return_dict=False), else ``output[i]``."""
    if isinstance(result, Mapping):
        return [(str(k), v) for k, v in result.items()]
    if not isinstance(result, tuple):
        return []
    made = forward.tuple_names
    if made is not None and made[0] is result:
        return list(zip(made[1], result, strict=True))
    return [(_UNNAMED.format(i), v) for i, v in enumerate(result)]


_UNNAMED = "output[{}] (return_dict=False)"


def _refuse_empty_shards(sp: SequenceParallel, what: str) -> None:
    """ValueError naming ``what`` when ``sp``'s sharding leaves a rank without a token
    (decided from ``sp`` and the world size alone: on every rank alike, before any exchange).

    A transformers forward cannot run over no tokens (IndexError in its packed-sequence
    detection, a reshape of 0 elements): that rank raised at once while the others waited for
    it in their first attention call for the process group's timeout. ``seq_len`` None: S is
    P * s, every rank holds s tokens."""
    if sp.seq_len is None:
        return
    world_size = sp.communicator.world_size
    sharding = make_sharding(
        layout=sp.layout, world_size=world_size, seq_len=sp.seq_len, cu_seqlens=sp.cu_seqlens
    )
    tokens = [sharding.local_len(rank) for rank in range(world_size)]
    empty = [rank for rank, count in enumerate(tokens) if count == 0]
    if not empty:
        return
    layout = Layout.parse(sp.layout)
    if sp.seq_len < world_size:
        fix = f"seq_len must be at least the world size ({world_size})"
    else:  # zigzag documents shorter than 2 * P go to the first ranks
        fix = "layout='contiguous' gives every rank a token (or longer documents, fewer ranks)"
    cu = None if sp.cu_seqlens is None else tuple(int(b) for b in sp.cu_seqlens)
    raise ValueError(
        f"{what}: SequenceParallel(layout={layout.value!r}, seq_len={sp.seq_len}, "
        f"cu_seqlens={cu}) leaves rank(s) {empty} of {world_size} without a token (tokens per "
        f"rank: {tokens}); a transformers model cannot run its forward over no tokens: "
        f"{fix}"
    )


# Note [Outputs that pool over the sequence]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A sequence-parallel forward's outputs are per-token shards (B, s, ...), gathered with
# gather_sequence. A head that reduces over the sequence sees this rank's shard alone:
#
#     XForSequenceClassification (decoder)   logits (B, L) of the last non-pad token of
#                                            each rank's shard (rank 1 of 2: 1.67 off)
#     BERT-style pooler_output, ...ForSequenceClassification and ...ForMultipleChoice on
#       encoders, BertForPreTraining's       the first token of each rank's shard (0.42 off;
#       seq_relationship_logits (B, 2)       seq_relationship_logits 0.008 to 0.012)
#     logits_to_keep=k (k > 0)               the last k rows of each rank's shard
#
# Each rank's value differed and none raised. A pooled output's row count is a constant of the
# model (2, L, C), which may equal s: on every rank (shards of 2 rows: seq_relationship_logits
# passed as per-token, silently) or on some ranks alone (uneven shards of 3, 2 and 2 rows:
# rank 0 raised, ranks 1 and 2 returned). So after the outermost forward every top-level
# tensor output with dims is per-token only if it has 3 or more dims and s rows (B, s, ...),
# or is a question-answering head's span scores (start_logits, end_logits: (B, s), 2-D only:
# SplinterForPreTraining's (B, Q, s) scores each question token of this rank's shard); any
# other 2-D output (B, X) cannot be told from a pooled one by its shape and raises, as does
# pooler_output: NotImplementedError on every rank (the rule reads the names and the dims,
# which are every rank's alike). A 3-D output's rows are compared with each rank's s, which
# uneven shards make differ: the verdicts are exchanged (Note [The outputs' rank check]). A
# pooled 3-D output of a name no rule knows, whose row count equals every rank's s (even
# shards), cannot be told from a per-token one and passes: the real transformers heads with
# 3-D outputs that are not per-token (LUKE's entity states, Perceiver's latents, XLNet's
# num_predict rows, Funnel's pooled rows) call no tokenring attention and are refused for
# that, and Splinter's are refused by their masks (or by the span rule). A tuple
# (return_dict=False) takes its names from the ModelOutput it was made of (register() wraps
# ModelOutput.to_tuple to record them); a tuple the model built itself is unnamed, and its 2-D
# entries raise. logits_to_keep is decided from the option, not from the rows it left: with
# uneven shards a rank holding exactly k rows passed the row check while its peers raised. It
# is refused in the forward's rank check (Note [The forward's rank check]) when k is below some
# rank's shard length (k >= every rank's s keeps every row: per-token), negative, or a tensor
# of row indices, on every rank at once.
# Losses are global (the causal-LM loss) or refused (Note [A loss the model computes
# itself]); hidden states are each rank's shard. tokenring.hf.generate's steps keep their own
# rows (its hooks gather them) and are not checked.
_SPAN_OUTPUTS = frozenset({"start_logits", "end_logits"})


def _is_loss(name: str) -> bool:
    return name in ("loss", _UNNAMED.format(0)) or name.endswith("_loss")


def _refuse_pooled_outputs(
    model: torch.nn.Module, sp: SequenceParallel, fields: list[tuple[str, Any]], seq_local: int
) -> None:
    """NotImplementedError naming the first output of ``fields`` that is not a per-token
    shard of ``seq_local`` rows (Note [Outputs that pool over the sequence])."""
    if sp.communicator.world_size == 1:
        return
    for name, value in fields:
        if not isinstance(value, torch.Tensor) or (value.dim() == 0 and _is_loss(name)):
            continue
        rows = value.dim() >= 2 and value.shape[1] == seq_local
        # span scores are (B, s); a 3-D start_logits (SplinterForPreTraining's (B, Q, s),
        # scores of each question token gathered from this rank's shard) is not per-token
        span = name in _SPAN_OUTPUTS
        per_token = rows and (value.dim() == 2 if span else value.dim() >= 3)
        if name == "pooler_output" or (value.dim() > 0 and not per_token):
            raise NotImplementedError(
                f"{type(model).__name__}'s output {name} of shape {tuple(value.shape)} is not "
                f"each rank's per-token shard (B, {seq_local}, ...): it pools over the "
                "sequence (a classification head's last or first token, a pooler_output, "
                "logits_to_keep), which saw this rank's shard alone, or its shape cannot tell "
                "it from such an output; under sequence_parallel= take the per-token outputs "
                "(AutoModel, add_pooling_layer=False, logits_to_keep=0) and pool over "
                "hf.gather_sequence's global sequence"
            )


def _refuse_no_attention(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """NotImplementedError for a forward given ``sp`` over several ranks that called no
    tokenring attention (Note [A forward that calls no tokenring attention]), on every rank
    through the forward's rank check, where a peer whose forward failed posts its error
    (Note [A forward that fails on one rank])."""
    if sp.communicator.world_size == 1:
        return

    def validate() -> tuple[None, None]:
        _no_attention_reason(model)

    sp.communicator.agreed(validate, what=FORWARD_CHECK)


def _no_attention_reason(model: torch.nn.Module) -> NoReturn:
    """Raise _refuse_no_attention's NotImplementedError, with check_model's reason where it
    finds one."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name not in ATTN_IMPLEMENTATIONS:
        raise NotImplementedError(
            f"{type(model).__name__} ran its forward with sequence_parallel= but with "
            f"attn_implementation={name!r}, which attended over this rank's shard alone; build "
            f"it with one of tokenring's: {sorted(ATTN_IMPLEMENTATIONS)}"
        )
    check_model(model)  # its reason, where it has one
    raise NotImplementedError(
        f"{type(model).__name__} ran its forward with sequence_parallel= but called no tokenring "
        f"attention (attn_implementation={name!r}): its layers mix tokens in their own code "
        "(a recurrence, a convolution, a Fourier transform or attention of its own), which "
        "saw this rank's shard alone; it cannot run sequence-parallel"
    )


@dataclass(frozen=True, slots=True)
class _ModelMask:
    """The mask a model asked for, over global positions (Note [Model masks]): our mask
    function's result, handed to the layer's attention calls as ``attention_mask``."""

    causal: bool
    window_size: tuple[int, int]
    """flash-attention's ``(left, right)``, -1 unbounded."""
    attention_chunk_size: int | None


_PLAIN_CAUSAL = _ModelMask(causal=True, window_size=(-1, 0), attention_chunk_size=None)
"""What the attention call does without a mask."""


@dataclass(frozen=True, slots=True)
class _RefusedMask:
    """A mask the model built but tokenring attention cannot express, refused by the attention
    call that receives it: a model may build a mask no layer uses (Qwen2-MoE builds a sliding
    mask of window 0, its "no window", beside the causal one its full-attention layers get)."""

    reason: str


class _UnusableMask(NotImplementedError):
    """:func:`_model_mask`'s error for a mask to refuse only where a layer uses it."""


@torch.compiler.disable(reason=_EAGER)
def _global_mask(
    *,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    config: Any = None,
    **_: Any,
) -> _ModelMask | _RefusedMask | None:
    """The ``AttentionMaskInterface`` function: None for plain causal (unless ``config`` has a
    ``sliding_window``), else a :class:`_ModelMask` (Note [Model masks]), or a
    :class:`_RefusedMask` for a window under 1; a padding mask, a model the attention call
    would refuse (:func:`check_model`'s reasons but a Conv1d) raise."""
    _refuse_padding_on_every_rank(attention_mask)
    alibi = (
        getattr(config, "alibi", None),
        getattr(getattr(config, "attn_config", None), "alibi", None),
    )
    if True in alibi:  # Falcon's config.alibi, MPT's config.attn_config.alibi
        raise NotImplementedError(
            f"ALiBi position biases (model_type {getattr(config, 'model_type', None)!r}, "
            "alibi=True) are not supported by tokenring attention: the model adds them to "
            "a mask it expects as a tensor"
        )
    name = getattr(config, "_attn_implementation", None) or "tokenring"
    # the layers' own checks (_check_options), here too: a model may use its mask before any
    # attention call (DeepSeek V3.2's indexer slices it: a TypeError on ours)
    _refuse_encoder_decoder(name, config)
    reason = _unsupported_layers(config)
    modeling = type(config).__module__.replace(".configuration_", ".modeling_")
    if reason is None and _module_routes_attention(modeling) is False:  # Bloom, MPT, XGLM
        reason = (
            f"no module of {modeling} calls attention through transformers' AttentionInterface "
            "(it computes attention in its own code, which would see this rank's shard alone)"
        )
    if reason is not None:
        _refuse_layers(name, config, reason)
    if mask_function is None:
        return None
    try:
        mask = _model_mask(mask_function, model=getattr(config, "model_type", None))
    except _UnusableMask as exc:
        return _RefusedMask(str(exc))
    if mask == _PLAIN_CAUSAL and getattr(config, "sliding_window", None) is None:
        return None
    return mask


# Note [Padding on one rank's shard]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A padding attention_mask is refused, but its zeros may lie in one rank's shard alone (right
# padding on the last rank of contiguous shards, left padding on the first). That rank raised
# in the mask function, before any attention call, while the others went on into their first
# attention call: its rank check waited out the communicator's timeout, or paired with the
# raising rank's next forward. transformers calls the mask function without the forward's
# keywords, so the verdict travels through the record of the outermost forward (_Forward.sp):
# a rank whose mask function finds padding posts its error to the forward's rank check and
# raises; its peers meet it there, in their first attention call (Note [The forward's rank
# check]). tokenring.hf.generate's steps take the mask off before the model runs (and refuse
# it themselves); they exchange nothing here.
PADDING_HINT = (
    "pack the sequences (SequenceParallel(cu_seqlens=...)) or pad at the end and set "
    "the padded labels to ignore_index"
)


def _refuse_padding_on_every_rank(attention_mask: Any) -> None:
    """NotImplementedError for a padding ``attention_mask`` with zeros, or a tensor that is
    not a 2-D padding mask: on every rank when a forward with sequence_parallel= is running
    (Note [Padding on one rank's shard])."""
    forward = _FORWARD.get()
    try:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() != 2:
            raise NotImplementedError(
                f"attention_mask of shape {tuple(attention_mask.shape)} is not a 2-D (batch, "
                "seq) padding mask, the only kind tokenring attention reads (a 4-D mask is "
                "refused as a prepared mask)"
            )
        if attention_mask is not None:
            refuse_padding(attention_mask, PADDING_HINT)
    except NotImplementedError as exc:
        if forward is not None and not forward.cached and not forward.checked:
            forward.checked = True
            forward.sp.communicator.agree(None, exc, what=FORWARD_CHECK)  # raises exc
        raise


# Note [The forward's rank check]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One exchange per outermost model forward given sequence_parallel= over several ranks,
# posted by its first tokenring attention call before that call's own checks (position_ids,
# the attention call's): the first exchange of the forward on every rank, whatever path its
# mask took::
#
#     padding in the mask function          that rank posts its error here and raises (it
#                                           never reaches attention)
#     a prepared mask (a 4-D tensor, a      transformers hands it to the layers as is (no
#       BlockMask) reaches attention        mask function runs): posted here, refused
#     logits_to_keep (in the signature)     refused here unless it keeps every rank's rows
#                                           (Note [Outputs that pool over the sequence])
#     the mask refused by the mask          posted here (a config's verdict: every rank
#       function (_RefusedMask)             alike, unless the ranks differ)
#     the first call's attention options    posted here: output_attentions=True, dropout,
#       (_check_options)                    an attention option it cannot honour
#     the label keywords given (in the      so that a loss the model computes itself is
#       signature; by keyword or by         refused on every rank alike (Note [A loss the
#       position: _call_arguments)          model computes itself])
#
# A prepared mask on one rank used to raise in that rank's attention call with nothing
# exchanged, while its peers waited out the timeout in the mask function's padding exchange;
# output_attentions=True on one rank alike (its peers waited in their position_ids check);
# ranks given different logits_to_keep, or uneven shards one of which held exactly k rows,
# raised on some ranks after the forward while the others returned; start_positions= on one
# rank raised there in the loss while its peers returned. The forward's keywords reach every
# layer alike, so the first call's options stand for the forward's; each call still checks
# its own. tokenring.hf.generate's steps (cached) have their own checks; one rank has
# nothing to agree with.
FORWARD_CHECK = "model forward check"


def _check_forward(
    name: str,
    forward: _Forward,
    module: torch.nn.Module,
    attention_mask: Any,
    options: dict[str, Any],
    seq_local: int,
) -> None:
    """The forward's rank check (Note [The forward's rank check]): raises on every rank for
    a prepared or refused ``attention_mask``, or attention ``options`` the first call cannot
    honour, on any rank, a logits_to_keep that pools, or ranks given different logits_to_keep
    or label keywords."""
    forward.checked = True

    def validate() -> tuple[None, dict[str, Any]]:
        _refuse_mask(name, module, attention_mask)
        _check_options(name, module, options)
        keep = _kept_logits(forward, seq_local)
        labels = "labels" in forward.labels  # named first where the ranks differ in it
        return None, {
            "logits_to_keep": keep,
            "labels": labels,
            "label keywords": list(forward.labels),
        }

    forward.sp.communicator.agreed(validate, what=FORWARD_CHECK)


def _refuse_mask(name: str, module: Any, attention_mask: Any) -> _ModelMask | None:
    """``attention_mask`` as the mask function gave it; NotImplementedError for one it
    refused or a prepared one (the attention takes only what the mask function gives)."""
    if isinstance(attention_mask, _RefusedMask):
        raise NotImplementedError(
            f"attn_implementation={name!r}: the mask of {type(module).__name__}: "
            f"{attention_mask.reason}"
        )
    if attention_mask is not None and not isinstance(attention_mask, _ModelMask):
        raise NotImplementedError(_prepared_mask(name, attention_mask))
    return attention_mask


def _prepared_mask(name: str, attention_mask: Any) -> str:
    return (
        f"attn_implementation={name!r} does not take a prepared attention mask; got one of "
        f"shape {tuple(getattr(attention_mask, 'shape', ()))} ({type(attention_mask).__name__})"
    )


def _kept_logits(forward: _Forward, seq_local: int) -> Any:
    """The forward's logits_to_keep as the ranks compare it; NotImplementedError unless it
    keeps every row of every rank's shard (0, or k >= the longest shard)."""
    keep = forward.logits_to_keep
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and keep == 0):
        return 0
    sharding = _sharding(forward.sp, seq_local)
    longest = max(sharding.local_len(rank) for rank in range(sharding.world_size))
    if isinstance(keep, int) and not isinstance(keep, bool) and keep >= longest:
        return keep  # every row of every shard
    shown = f"a tensor of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else keep
    raise NotImplementedError(
        f"logits_to_keep={shown} keeps rows of each rank's shard (shards of up to {longest} "
        "rows), not of the sequence: it pools over the sequence, which saw this rank's shard "
        "alone; under sequence_parallel= pass logits_to_keep=0 and take the rows from "
        "hf.gather_sequence's global sequence"
    )


@functools.lru_cache(maxsize=1)
def _mask_pieces() -> dict[Any, str]:
    """Code object -> name of each piece of ``transformers.masking_utils`` this version has."""
    from transformers import masking_utils

    mu: Any = masking_utils  # its pieces differ between versions; a missing one is skipped

    ids = torch.zeros(1, 1, dtype=torch.int64)
    makers = {
        "and": lambda: mu.and_masks(mu.causal_mask_function),
        "or": lambda: mu.or_masks(mu.causal_mask_function),
        "remap": lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, ids),
        "packed": lambda: mu.packed_sequence_mask_function(ids),
        "sliding": lambda: mu.sliding_window_overlay(1),
        "sliding_bidirectional": lambda: mu.sliding_window_bidirectional_overlay(1),
        "chunked": lambda: mu.chunked_overlay(1, ids[0]),
        "chunked_without_padding": lambda: mu.chunked_overlay(1),  # transformers < 4.54
        "blockwise": lambda: mu.blockwise_overlay(ids),
        "padding": lambda: mu.padding_mask_function(ids.bool()),
        "causal": lambda: mu.causal_mask_function,
        "bidirectional": lambda: mu.bidirectional_mask_function,
    }
    pieces = {}
    for name, make in makers.items():
        try:
            pieces[make().__code__] = name.removesuffix("_without_padding")
        except (AttributeError, TypeError):  # not in this transformers version, or not so
            continue
    return pieces


def _closure(fn: Any) -> dict[str, Any]:
    """The variables a closure captured, by name."""
    return dict(inspect.getclosurevars(fn).nonlocals)


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _model_mask(mask_function: Any, *, model: str | None = None) -> _ModelMask:
    """Read ``mask_function`` into the library's mask, or raise naming a piece it cannot
    express (Note [Model masks])."""
    pieces = _mask_pieces()
    where = f" (model_type {model!r})" if model else ""
    causal = False
    left = right = float("inf")
    chunks: set[int] = set()
    pending = [mask_function]  # pieces that must all hold (and)
    while pending:
        fn = pending.pop()
        kind = pieces.get(getattr(fn, "__code__", None))
        if kind == "and":
            pending += list(_closure(fn)["mask_functions"])
        elif kind == "remap":
            pending.append(_closure(fn)["mask_function"])
        elif kind in ("packed", "bidirectional"):
            continue  # packed: documents come from SequenceParallel.cu_seqlens
        elif kind == "causal":
            causal = True
        elif kind in ("sliding", "sliding_bidirectional"):
            w = int(_closure(fn)["sliding_window"])
            if w < 1:  # no key at all; refused where a layer uses it (_RefusedMask)
                raise _UnusableMask(f"sliding_window must be >= 1{where}; got {w}")
            if kind == "sliding":  # keys i - w < j: w keys up to the query itself
                left = min(left, w - 1)
            else:  # |i - j| <= w
                left, right = min(left, w), min(right, w)
        elif kind == "chunked":
            captured = _closure(fn)
            if bool(torch.as_tensor(captured.get("left_padding", 0)).ne(0).any()):
                raise NotImplementedError(
                    f"chunked attention with left padding{where} is not supported by tokenring "
                    "attention; pack the sequences (SequenceParallel(cu_seqlens=...))"
                )
            chunks.add(int(captured["chunk_size"]))
        else:
            raise _unsupported_piece(fn, kind, pieces, where)
    if len(chunks) > 1:
        raise NotImplementedError(
            f"the model's mask{where} asks for chunks of several sizes at once: {sorted(chunks)}"
        )
    window = (
        -1 if left == float("inf") else int(left),
        0 if causal else (-1 if right == float("inf") else int(right)),
    )
    return _ModelMask(
        causal=causal, window_size=window, attention_chunk_size=chunks.pop() if chunks else None
    )


def _unsupported_piece(
    fn: Any, kind: str | None, pieces: dict[Any, str], where: str
) -> NotImplementedError:
    """The error for a mask piece the library cannot express (Note [Model masks])."""
    cannot = (
        "which tokenring attention cannot express (it takes causal, a sliding window, "
        "documents and chunked attention)"
    )
    if kind == "or":
        functions = _closure(fn)["mask_functions"]
        extra = [_describe(f) for f in functions[1:]]
        blockwise = any(pieces.get(getattr(f, "__code__", None)) == "blockwise" for f in functions)
        option = "block_sequence_ids" if blockwise else "or_mask_function"
        return NotImplementedError(
            f"the model's {option}{where} widens its mask with {extra}, {cannot}"
        )
    if kind == "padding":
        return NotImplementedError(
            f"a padding attention_mask{where} is not supported by tokenring attention"
        )
    return NotImplementedError(
        f"the model's mask{where} uses the mask function {_describe(fn)} (an "
        f"and_mask_function or a mask piece tokenring does not know), {cannot}"
    )


# Note [Layers that mix tokens]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Only attention exchanges tokens across the sequence split. Any other layer that mixes tokens
# (a convolution over the sequence, a state-space or linear-attention block, a recurrence)
# would see only this rank's shard and silently compute something else, so a model with one
# raises. What is read:
#
#     config.layer_types, layers_block_type,   full_attention, sliding_attention,
#       block_types (what transformers calls     chunked_attention, attention, and the MLP
#       each layer)                              kinds dense, sparse, moe, mlp pass; any other
#                                                kind raises (conv, linear_attention, hybrid,
#                                                recurrent, indexed_attention, ...)
#     config fields mamba_* or ssm_*, or        state-space blocks in every layer (Falcon-H1,
#       state_size with conv_kernel              Jamba, Bamba, Mamba): raise
#     config.trigram_input (MobileBERT's        embeddings that concatenate each token's with
#       default)                                 its neighbours' (a width-3 convolution in
#                                                tensor code, no Conv1d): raise
#     a torch.nn.Conv1d of kernel > 1           raises (check_model only: it sees the modules)
#
# The attention function checks its module's config on every call; check_model (run by the
# Trainer, generate and all_reduce_gradients) also catches models that never call attention.
_TOKENWISE_LAYERS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention"}
    | {"dense", "sparse", "moe", "mlp"}
)


def _unsupported_layers(config: Any) -> str | None:
    """Why a model of ``config`` cannot be split over the sequence (Note [Layers that mix
    tokens]), or None when every layer that mixes tokens is attention."""
    for field in ("layer_types", "layers_block_type", "block_types"):
        kinds = {str(kind) for kind in getattr(config, field, None) or ()}
        if kinds - _TOKENWISE_LAYERS:
            return f"its {field} include {sorted(kinds - _TOKENWISE_LAYERS)}"
    fields = set(getattr(config, "__dict__", {}))
    ssm = sorted(name for name in fields if name.startswith(("mamba_", "ssm_")))
    if ssm or {"state_size", "conv_kernel"} <= fields:
        return f"it has state-space blocks ({', '.join(ssm[:2] or ['state_size', 'conv_kernel'])})"
    if getattr(config, "trigram_input", False):
        return (
            "its embeddings concatenate each token's embedding with its two neighbours' "
            "(trigram_input=True, a convolution of width 3 over the sequence)"
        )
    return None


def _refuse_encoder_decoder(name: str, config: Any) -> None:
    """NotImplementedError for an encoder-decoder model or the decoder of one (its config
    has ``is_encoder_decoder`` or ``decoder_layers``): BART, mBART, Pegasus, M2M-100, Marian
    and Whisper count each position embedding over the rows they are given (they take no
    position_ids, or drop them), so a shard gets positions 0..s-1 whatever its place in the
    sequence; Whisper's encoder also convolves over it and T5 adds a relative bias."""
    if not getattr(config, "is_encoder_decoder", False) and not hasattr(config, "decoder_layers"):
        return
    model = getattr(config, "model_type", None)
    raise NotImplementedError(
        f"attn_implementation={name!r} does not support encoder-decoder models or their "
        f"decoders (model_type {model!r}): they count position embeddings over this rank's "
        "shard alone (BART, Pegasus, M2M-100, Marian and Whisper take no position_ids), so "
        "each rank's positions would silently restart at 0"
    )


def check_model(model: torch.nn.Module) -> None:
    """Raise NotImplementedError for an encoder-decoder model or the decoder of one (BART,
    Whisper, T5: positions counted over the shard), if a layer of ``model`` mixes tokens
    other than by attention (Note [Layers that mix tokens]), or if no module hands its
    attention to transformers' ``AttentionInterface`` (in transformers 5.24 Bloom, GPT-Neo,
    MPT, Falcon, XGLM: ``attn_implementation`` never reaches tokenring there) or is a
    :class:`tokenring.SequenceParallelAttention`: a shard would not see the rest of the
    sequence.

    Raises:
        ValueError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    config = getattr(model, "config", None)
    _refuse_encoder_decoder(getattr(config, "_attn_implementation", None) or "tokenring", config)
    reason = _unsupported_layers(config)
    for path, module in model.named_modules() if reason is None else ():
        if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
            reason = f"its module {path!r} is a convolution over the sequence"
            break
    sharded = (SequenceParallelAttention,)  # a model of one's own (under DDP, say)
    if reason is None and not any(
        _routes_attention(m) or isinstance(m, sharded) for m in model.modules()
    ):
        reason = (
            f"no module of {type(model).__name__} calls attention through transformers' "
            "AttentionInterface or is a tokenring.SequenceParallelAttention (it computes "
            "attention in its own code, which would see this rank's shard alone)"
        )
    if reason is not None:
        _refuse_layers(getattr(config, "_attn_implementation", None) or "tokenring", config, reason)


def _routes_attention(module: torch.nn.Module | type) -> bool:
    """Whether ``module``'s (or a module class's) forward dispatches on transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (the registry of ``attn_implementation`` names), read from its
    code's global names, or hands over to a base class's forward that does (``super().forward``:
    a subclass of a model's attention class that logs or wraps it routes through the base's;
    tokenring.hf.generate reads the attention layers by this rule: Note [Layers without
    attention] in tokenring.hf.generation)."""
    for cls in (module if isinstance(module, type) else type(module)).__mro__:
        forward = vars(cls).get("forward")
        if forward is None:
            continue
        code = getattr(inspect.unwrap(forward), "__code__", None)
        if code is None:
            return False
        if "ALL_ATTENTION_FUNCTIONS" in code.co_names:
            return True
        if not {"super", "forward"} <= set(code.co_names):
            return False  # a forward of its own, which does not call the base's
    return False


@functools.cache
def _module_routes_attention(name: str) -> bool | None:
    """Whether a module class of the loaded Python module ``name`` (a model's modeling file;
    its classes and the ones it imports) routes attention (:func:`_routes_attention`); None
    when no such module is loaded."""
    found = sys.modules.get(name)
    if found is None:
        return None
    return any(
        isinstance(obj, type) and issubclass(obj, torch.nn.Module) and _routes_attention(obj)
        for obj in vars(found).values()
    )


def _refuse_layers(name: str, config: Any, reason: str) -> None:
    """The error of :func:`check_model` and of the attention function for ``reason``."""
    model = getattr(config, "model_type", None)
    which = f"model_type {model!r}" if model else "this model"
    raise NotImplementedError(
        f"attn_implementation={name!r} cannot split {which} over the sequence: {reason}. "
        "Only attention layers see the other ranks' tokens; any "
        "other layer that mixes tokens (convolution, state-space, linear attention, "
        "recurrence) would see this rank's shard alone"
    )


# local packing (flash-attention's varlen); ours is global: SequenceParallel(cu_seqlens=...)
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# what models hand every attention call besides the attention's own options: bookkeeping of
# the forward and the loss (transformers' TransformersKwargs), none of it changes attention;
# position_ids are checked against the shard (_check_positions). Any other keyword that is
# set (not None, not False) is an option tokenring cannot honour: T5's position_bias, sinks
_INERT_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "deterministic", "num_items_in_batch"}
    | {"labels", "shift_labels", "output_hidden_states", "return_dict"}
)


@torch.compiler.disable(reason=_EAGER)
def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: _ModelMask | _RefusedMask | torch.Tensor | None,
    *,
    strategy: str,
    name: str,
    scaling: float | None = None,
    sequence_parallel: SequenceParallel | None = None,
    sequence_parallel_cache: Any = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``(B, H, s, D)`` in, ``(B, s, Hq, D)`` out, no
    weights. Every argument reaches the attention call or raises."""
    forward = _FORWARD.get()
    if forward is not None:  # Note [A forward that calls no tokenring attention]
        forward.attention_calls += 1
        if forward.seq_local is None:
            forward.seq_local = query.shape[2]  # (B, H, s, D)
    cache = sequence_parallel_cache
    if sequence_parallel is None:
        raise ValueError(
            f"attn_implementation={name!r} needs sequence_parallel=tokenring.hf.SequenceParallel"
            "(...) passed to the model's forward (it says which group and layout the shards use)."
            " If it was passed, this model does not hand its forward's keyword arguments down "
            "to its attention layers (StableLM, for one) and cannot run sequence-parallel"
        )
    sp = as_sequence_parallel(sequence_parallel)
    if (
        forward is not None
        and not forward.cached
        and not forward.checked
        and forward.sp.communicator.world_size > 1
    ):
        _check_forward(name, forward, module, attention_mask, kwargs, query.shape[2])
    model_mask = _refuse_mask(name, module, attention_mask)
    _check_options(name, module, kwargs)
    if cache is None:
        _check_sharded_call(name, strategy, sp, query, key, kwargs.get("position_ids"))
    mask = _layer_mask(module, model_mask, is_causal, sliding_window)
    if cache is not None:  # a step of tokenring.hf.generate
        out = cache.attention(module, query, key, value, scaling=scaling, mask=mask)
        return out, None  # (1, n, Hq, D)
    _check_temperature_tuning(module, sp, query.shape[2])
    v_dim = value.shape[-1]
    query, key, value, scaling = _operator_inputs(query, key, value, scaling)
    out = sequence_parallel_attn(
        query.transpose(1, 2),  # (B, s, Hq, D)
        key.transpose(1, 2),  # (B, s, Hkv, D)
        value.transpose(1, 2),
        strategy=strategy,
        softmax_scale=scaling,
        **_fields(sp),  # group, layout, seq_len, cu_seqlens, hardware
        **_fields(mask),  # causal, window_size, attention_chunk_size
    )
    return cast(torch.Tensor, out)[..., :v_dim], None  # (B, s, Hq, Dv)


def _operator_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
    """``(B, H, s, D)`` q, k, v and the scale as the operator takes them: in the autocast
    dtype under autocast, and of one head dim."""
    if torch.is_autocast_enabled(query.device.type):
        # as the model's own SDPA under autocast: q, k, v in the autocast dtype (RoPE hands
        # attention float32 q and k beside a bfloat16 v); the operator itself never casts
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    # DeepSeek's multi-head latent attention: V's head dim differs from Q's and K's. Zeros
    # appended to V add zero output channels (dropped by the caller); appended to Q and K,
    # zero to every score (the scale stays the model's, or Q's own head dim's)
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if qk_dim != v_dim:
        scaling = qk_dim**-0.5 if scaling is None else scaling
        width = max(qk_dim, v_dim)
        query, key = (F.pad(x, (0, width - qk_dim)) for x in (query, key))  # (B, H, s, width)
        value = F.pad(value, (0, width - v_dim))
    return query, key, value, scaling


def _check_sharded_call(
    name: str, strategy: str, sp: SequenceParallel, query: Any, key: Any, positions: Any
) -> None:
    """What a call outside ``tokenring.hf.generate`` must not carry: a KV cache, position_ids
    of another shard (:func:`_check_positions`), a model forward given none (Note [Positions
    the model was given]), hardware without "auto"."""
    if key.shape[2] != query.shape[2]:  # (B, H, s, D)
        raise NotImplementedError(
            f"attn_implementation={name!r} takes no KV cache but tokenring.hf.generate's; got "
            f"{query.shape[2]} query and {key.shape[2]} key rows (pass use_cache=False, or "
            "generate with tokenring.hf.generate)"
        )
    _check_positions(name, sp, positions, query.shape[2])
    model = _model_positions()
    if model is not None:
        _check_positions(name, sp, model[1], query.shape[2], given_to=model[0])
    if sp.hardware is not None and strategy != "auto":
        raise ValueError(
            f"SequenceParallel.hardware only chooses the strategy of "
            f"attn_implementation='tokenring_auto'; got it with {name!r}"
        )


def _check_options(name: str, module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise NotImplementedError for a layer kind (Note [Layers that mix tokens]) or an
    attention option in ``kwargs`` the call cannot honour."""
    config = getattr(module, "config", None)
    _refuse_encoder_decoder(name, config)
    reason = _unsupported_layers(config)
    if reason is not None:
        _refuse_layers(name, config, reason)
    dropout = kwargs.get("dropout", 0.0)
    if dropout > 0:
        raise NotImplementedError(f"attention dropout is not supported; got dropout={dropout}")
    if kwargs.get("output_router_logits"):
        raise NotImplementedError(
            f"attn_implementation={name!r} does not support output_router_logits=True: the "
            "model's router load-balancing loss (aux_loss, added to the loss with labels) would "
            "average over this rank's shard only; pass output_router_logits=False (or set "
            "config.output_router_logits=False)"
        )
    packing = " (local packing; pass SequenceParallel(cu_seqlens=...))"
    for option, unsupported in (
        ("softcap", kwargs.get("softcap") is not None),
        ("attention sinks (s_aux)", kwargs.get("s_aux") is not None),
        ("output_attentions", kwargs.get("output_attentions", False)),
        *((k + packing, kwargs.get(k) is not None) for k in _PACKING_KWARGS),
    ):
        if unsupported:
            raise NotImplementedError(f"attn_implementation={name!r} does not support {option}")
    handled = {"dropout", "output_router_logits", "softcap", "s_aux", "output_attentions"}
    handled |= set(_PACKING_KWARGS)
    for key, value in kwargs.items():
        if key in handled or key in _INERT_KWARGS or value is None or value is False:
            continue
        if _is_label(key):  # Note [A loss the model computes itself]
            continue
        shown = f" (a tensor of shape {tuple(value.shape)})" if hasattr(value, "shape") else ""
        raise NotImplementedError(
            f"attn_implementation={name!r} does not support the attention option "
            + (f"{key}{shown}" if shown else f"{key}={value!r}")
            + f" that {type(module).__name__} passes (tokenring attention would ignore it)"
        )


def _check_positions(
    name: str, sp: SequenceParallel, given: Any, seq_local: int, *, given_to: str = "attention"
) -> None:
    """Raise NotImplementedError, on every rank, unless ``given`` ``(B, s)`` position_ids are
    each rank's positions under ``sp`` (``shard_batch``'s) up to one offset per row (RoBERTa's)
    that is the same on every rank. transformers reads restarts in position_ids as packed
    documents; the attention masks documents from ``sp.cu_seqlens`` alone, so positions of
    other documents or another shard would be silently ignored (contiguous shards each counted
    from 0 differ from the global positions by one offset per rank). One exchange of the
    ranks' verdicts per tensor and model forward (a tensor passed in this forward is not read
    again: Note [A forward that calls no tokenring attention]; outside a model forward, every
    call), so every rank raises or none does, and every rank exchanges alike.

    ``given_to`` a model's class name: ``given`` is what its forward was given
    (:func:`_model_positions`, Note [Positions the model was given]); None (or _NO_POSITIONS)
    there raises too, unless the rank's own count from 0 is right (one rank, one document)."""
    if given_to != "attention" and (given is None or given is _NO_POSITIONS):
        _check_missing_positions(name, sp, given_to, given, seq_local)
        return
    if not isinstance(given, torch.Tensor) or given.dim() != 2:
        return  # (3, B, s) multimodal positions carry no documents
    forward = _FORWARD.get()
    if forward is not None and forward.positions_passed(given):
        return
    comm = sp.communicator
    expected = _sharding(sp, seq_local).doc_positions(comm.rank).to(given.device)  # (s,)
    verdict: tuple[str, Any] = ("skip", None)  # the attention call names the length to hold
    if expected.numel() == given.shape[1]:
        offset = given - expected  # (B, s)
        if bool((offset == offset[:, :1]).all()):
            verdict = ("offsets", offset[:, 0].tolist())
        else:
            token = int((offset != offset[:, :1]).any(0).nonzero()[0])
            verdict = ("token", (token, given[0, token].item(), expected[token].item()))
    verdicts = _exchange_verdicts(name, sp, verdict)
    _raise_missing(name, sp, verdicts)
    _raise_wrong_positions(name, sp, verdicts)
    if forward is not None:
        forward.positions_checked.append((given, given._version))


def _raise_wrong_positions(
    name: str, sp: SequenceParallel, verdicts: list[tuple[str, Any]]
) -> None:
    """NotImplementedError when a rank's position_ids are not its positions up to one
    offset per row, or the offsets differ between ranks (:func:`_check_positions`)."""
    under = (
        f"SequenceParallel(layout={Layout.parse(sp.layout).value!r}, seq_len={sp.seq_len}, "
        f"cu_seqlens={sp.cu_seqlens})"
    )
    fix = (
        "packed documents need SequenceParallel(seq_len=..., cu_seqlens=...), and position_ids "
        "from tokenring.hf.shard_batch"
    )
    for rank, (kind, found) in enumerate(verdicts):
        if kind == "token":
            token, got, want = found
            raise NotImplementedError(
                f"attn_implementation={name!r}: position_ids are not rank {rank}'s positions "
                f"under {under} (its token {token}: got {got} where the shard holds position "
                f"{want} of its document, other tokens at another offset); {fix}"
            )
    offsets = {rank: found for rank, (kind, found) in enumerate(verdicts) if kind == "offsets"}
    if len({tuple(found) for found in offsets.values()}) > 1:
        raise NotImplementedError(
            f"attn_implementation={name!r}: position_ids differ from each rank's positions "
            f"under {under} by another offset per rank (offsets of the rows, by rank: "
            f"{offsets}); the offset must be the same on every rank (position_ids counted from "
            f"0 on each rank's shard are not the global ones); {fix}"
        )


# Note [Positions the model was given]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A model that hands position_ids to its attention has them checked there (_check_positions).
# One that does not (BERT, RoBERTa, DistilBERT, ModernBERT, GPTBigCode, Persimmon: absolute
# embeddings or RoPE computed outside attention) counts its shard from 0 when it is given none
# (its position buffer or cache_position), which no attention call could see. So each
# attention call outside tokenring.hf.generate also reads what the *outermost* transformers
# model forward on the Python stack was given: a frame running a ``forward`` of a class of its
# ``self``, a PreTrainedModel (the head model: BertForMaskedLM, not BertModel, whose own
# position_ids it hands down; a base model called alone may have set its local from
# cache_position, which is then checked as any tensor is)::
#
#     position_ids a tensor       _check_positions (once per tensor and forward)
#     None (not given, as a       raise on every rank (one exchange, as _check_positions'),
#       parameter or in its       unless one rank counting from 0 is right: one rank
#       **kwargs), or no way to   without documents; the error says which of the two
#       take them
#     no such frame               nothing: gradient checkpointing's recomputation in the
#                                 backward (the forward was checked), a module of one's own
#
# Under torch.compile the attention call is not traced (the graph breaks at it: Note [The
# attention function under torch.compile]), so the frames are Python's; a frame dynamo
# rewrote keeps its locals.
_NO_POSITIONS = object()
"""What :func:`_model_positions` gives for a forward that takes no position_ids."""


def _model_positions() -> tuple[str, Any] | None:
    """``(class name, position_ids)`` of the outermost transformers model forward on the
    stack (Note [Positions the model was given]), or None when there is none."""
    from transformers import PreTrainedModel  # loaded: only transformers calls attention

    found = None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" and "forward" in code.co_name:
            owner = frame.f_locals.get("self")
            if isinstance(owner, PreTrainedModel) and _is_forward(cast(Any, type(owner)), code):
                found = (type(owner).__name__, _given_positions(frame.f_locals, code))
        frame = frame.f_back  # type: ignore[assignment]
    return found


@functools.cache
def _is_forward(cls: type, code: Any) -> bool:
    """Whether ``code`` is a ``forward`` of ``cls`` or one of its bases (not a decorator's
    wrapper, whose ``self`` is the model too), or dynamo's rewrite of one (same name, same
    first line)."""
    for base in cls.__mro__:
        forward = vars(base).get("forward")
        own = getattr(inspect.unwrap(forward), "__code__", None) if forward else None
        if own is not None and (
            own is code
            or (own.co_filename == code.co_filename and own.co_firstlineno == code.co_firstlineno)
        ):
            return True
    return False


def _given_positions(local: Mapping[str, Any], code: Any) -> Any:
    """The position_ids of a forward's frame: its local, or its ``**kwargs``' entry (None
    when they hold none: it takes them, it was given none), or _NO_POSITIONS when it takes
    neither."""
    if "position_ids" in code.co_varnames:
        return local.get("position_ids")
    if code.co_flags & inspect.CO_VARKEYWORDS:
        extra = code.co_argcount + code.co_kwonlyargcount
        extra += 1 if code.co_flags & inspect.CO_VARARGS else 0
        kwargs = local.get(code.co_varnames[extra])
        return kwargs.get("position_ids") if isinstance(kwargs, Mapping) else None
    return _NO_POSITIONS


def _exchange_verdicts(
    name: str, sp: SequenceParallel, verdict: tuple[str, Any]
) -> list[tuple[str, Any]]:
    """Every rank's position_ids verdict (one exchange; none on one rank)."""
    comm = sp.communicator
    if comm.world_size == 1:
        return [verdict]
    return list(comm.all_gather_object(verdict, what=f"{name} position_ids check"))


def _check_missing_positions(
    name: str, sp: SequenceParallel, model: str, given: Any, seq_local: int
) -> None:
    """A model forward given no position_ids (or taking none): raise on every rank unless the
    rank's own count from 0 is its positions (one rank, one document)."""
    comm = sp.communicator
    if comm.world_size == 1:
        counted = _sharding(sp, seq_local).doc_positions(0)
        if torch.equal(counted, torch.arange(counted.numel(), device=counted.device)):
            return
    verdict = ("missing", (model, given is None))
    _raise_missing(name, sp, _exchange_verdicts(name, sp, verdict))


def _raise_missing(name: str, sp: SequenceParallel, verdicts: list[tuple[str, Any]]) -> None:
    """NotImplementedError when a rank's model forward had no position_ids."""
    missing = {rank: found for rank, (kind, found) in enumerate(verdicts) if kind == "missing"}
    if not missing:
        return
    ranks = sorted(missing)
    model, passed_none = missing[ranks[0]]
    counts = (
        "so each rank counts positions over its own shard (from 0 or the model's offset: its "
        f"buffer or cache_position), not the shard's positions under SequenceParallel(layout="
        f"{Layout.parse(sp.layout).value!r}, seq_len={sp.seq_len}, cu_seqlens={sp.cu_seqlens}):"
        " its output would be silently wrong"
    )
    if not passed_none:
        raise NotImplementedError(
            f"attn_implementation={name!r}: {model}.forward takes no position_ids (rank(s) "
            f"{ranks}), {counts}; this model cannot be split over the sequence"
        )
    raise NotImplementedError(
        f"attn_implementation={name!r}: {model}.forward was given no position_ids on rank(s) "
        f"{ranks}, {counts}; pass position_ids=batch.position_ids from "
        "tokenring.hf.shard_batch (plus the model's own offset: RoBERTa counts from "
        "pad_token_id + 1)"
    )


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, not copied (unlike ``dataclasses.asdict``)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _layer_mask(
    module: torch.nn.Module,
    attention_mask: _ModelMask | None,
    is_causal: bool | None,
    sliding_window: int | None,
) -> _ModelMask:
    """The model's mask (``is_causal``, ``sliding_window`` must agree), or else theirs."""
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    left = -1 if sliding_window is None else sliding_window - 1  # keys up to the query itself
    window_size = (left, 0 if causal else left)
    if attention_mask is None:
        return _ModelMask(causal=causal, window_size=window_size, attention_chunk_size=None)
    given = "is_causal" if is_causal is not None else "the attention module's is_causal"
    if causal != attention_mask.causal:
        raise NotImplementedError(
            f"the model's mask is {'' if attention_mask.causal else 'not '}causal but "
            f"{given} is {causal}; tokenring attention cannot tell which one holds"
        )
    if sliding_window is not None and window_size != attention_mask.window_size:
        raise NotImplementedError(
            f"the model's mask has window_size={attention_mask.window_size} but its attention "
            f"passes sliding_window={sliding_window} (window_size={window_size}): "
            "transformers' eager and SDPA attention follow the mask, flash-attention the "
            "sliding_window; tokenring attention cannot tell which one holds"
        )
    return attention_mask


def _check_temperature_tuning(
    module: torch.nn.Module, sp: SequenceParallel, seq_local: int
) -> None:
    """Llama 4's NoPE query scale uses the local row index as the position: raise where that
    differs from the global one (from the layout alone: every rank raises or none does)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    floor_scale = int(module.floor_scale)  # type: ignore[arg-type]
    sharding = _sharding(sp, seq_local)
    seq_len = sharding.seq_len
    if seq_len < floor_scale:  # every position, local or global, gets the scale of 1
        return
    for rank in range(sharding.world_size):
        positions = sharding.positions(rank)
        local = torch.arange(positions.numel())
        if not torch.equal((positions + 1) // floor_scale, (local + 1) // floor_scale):
            raise NotImplementedError(
                "attn_temperature_tuning (Llama 4's query scale on NoPE layers) uses the local "
                f"row index as the position: wrong on rank {rank}'s shard for seq_len={seq_len} "
                f">= floor_scale={floor_scale}; not supported by tokenring attention"
            )


def _sharding(sp: SequenceParallel, seq_local: int) -> Sharding:
    """The sharding of a call with ``seq_local`` rows on this rank (None sp.seq_len: P * s)."""
    world_size = sp.communicator.world_size
    seq_len = sp.seq_len if sp.seq_len is not None else seq_local * world_size
    return make_sharding(
        layout=sp.layout, world_size=world_size, seq_len=seq_len, cu_seqlens=sp.cu_seqlens
    )


def shift_labels(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token labels ``(B, S)`` over the global ``labels`` ``(B, S)``: ``out[:, t] =
    labels[:, t + 1]`` (shift *before* sharding), ``ignore_index`` at the end of the sequence
    and of every document."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a tensor of shape (batch, seq); got {shape}")
    _check_ignore_index(ignore_index)
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        bounds = normalize_cu_seqlens(cu_seqlens, labels.shape[1])
        out[:, [end - 1 for end in bounds[1:-1]]] = ignore_index
    return out


_shift_global = shift_labels  # for the loss, whose transformers argument is named shift_labels


def _check_ignore_index(ignore_index: object) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int; got {ignore_index!r}")


def shard_batch(
    sp: SequenceParallel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
) -> LocalBatch:
    """This rank's :class:`LocalBatch` of ``input_ids`` ``(B, S)`` (the same on every rank)
    and ``labels`` ``(B, S)`` (``ignore_index`` where not counted) or None.

    Raises:
        ValueError: input_ids not 2-D, labels of another shape, S != sp.seq_len, uneven
            shards without sp.seq_len, or a rank left without a token.
    """
    sp = as_sequence_parallel(sp, "sp")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = (
            tuple(input_ids.shape)
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(f"input_ids must be a tensor of shape (batch, seq); got {shape}")
    _check_ignore_index(ignore_index)
    seq_len = input_ids.shape[1]
    if sp.seq_len is not None and sp.seq_len != seq_len:
        raise ValueError(f"input_ids has {seq_len} tokens per row but sp.seq_len={sp.seq_len}")
    if labels is not None and (
        not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape
    ):
        raise ValueError(
            f"labels must have the shape of input_ids {tuple(input_ids.shape)}; got "
            f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
        )
    comm = sp.communicator
    rank, world_size, cu_seqlens = comm.rank, comm.world_size, sp.cu_seqlens
    layout = Layout.parse(sp.layout)
    num_chunks = world_size * (2 if layout is Layout.ZIGZAG else 1)
    if sp.seq_len is None and seq_len % num_chunks != 0:
        raise ValueError(
            f"input_ids has {seq_len} tokens per row, which the {layout.value} layout cannot "
            f"cut into {num_chunks} equal chunks; pass SequenceParallel(seq_len={seq_len}) for "
            "uneven shards"
        )
    _refuse_empty_shards(sp, "shard_batch")
    positions = position_ids(
        rank=rank, world_size=world_size, layout=layout, seq_len=seq_len, cu_seqlens=cu_seqlens
    )
    shifted = None
    if labels is not None:
        shifted = _local(sp, shift_labels(labels, ignore_index=ignore_index, cu_seqlens=cu_seqlens))
    return LocalBatch(
        input_ids=_local(sp, input_ids),
        position_ids=positions.to(input_ids.device).unsqueeze(0),
        shift_labels=shifted,
    )


def _local(sp: SequenceParallel, x: torch.Tensor) -> torch.Tensor:
    """This rank's shard ``(B, s)`` of ``x`` ``(B, S)``."""
    comm = sp.communicator
    return shard(
        x, rank=comm.rank, world_size=comm.world_size, layout=sp.layout, cu_seqlens=sp.cu_seqlens
    )


def broadcast_batch(
    sp: SequenceParallel, batch: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The batch of the group's first rank on every rank (a data loader gives each rank its
    own; the others' are dropped), exactly (a sum with zeros).

    Args:
        batch: name -> tensor (e.g. ``input_ids``, ``labels`` ``(B, S)``), the same names on
            every rank (the first rank's shapes and dtypes are taken).

    Returns:
        name -> the first rank's tensor, on this rank's device for that name.

    Raises:
        ValueError: on every rank, when a value is not a tensor or the names differ.
    """
    sp = as_sequence_parallel(sp, "sp")
    if not isinstance(batch, Mapping):  # told to the peers below, as a tensor's error is
        wrong = [f"batch must be a mapping of names to tensors; got {type(batch).__name__}"]
        batch = {}
    else:
        wrong = [
            f"batch[{name!r}] must be a tensor; got {type(value).__name__}"
            for name, value in batch.items()
            if not isinstance(value, torch.Tensor)
        ]
    comm = sp.communicator
    if comm.world_size == 1:
        if wrong:
            raise ValueError(wrong[0])
        return dict(batch)
    mine = (
        {"error": wrong[0]}
        if wrong
        else {"tensors": {n: (t.shape, t.dtype) for n, t in batch.items()}}
    )
    # every rank learns every rank's error: all raise, none waits
    rows = comm.all_gather_object(mine, what="broadcast_batch")
    errors = [f"rank {r}: {row['error']}" for r, row in enumerate(rows) if "error" in row]
    if errors:
        raise ValueError("; ".join(errors))
    names = [sorted(row["tensors"]) for row in rows]
    if any(n != names[0] for n in names):
        raise ValueError(f"every rank must give the same batch names; got {names} by rank")
    out = {}
    for name in names[0]:
        shape, dtype = rows[0]["tensors"][name]
        wire = torch.int64 if dtype == torch.bool else dtype  # gloo sums no bool
        if comm.rank == 0:
            t = batch[name].to(wire).clone()
        else:
            t = torch.zeros(shape, dtype=wire, device=batch[name].device)
        comm.all_reduce(t, label=f"broadcast_batch {name}").wait()
        out[name] = t.to(dtype)
    return out


def gather_sequence(sp: SequenceParallel, x: torch.Tensor, *, seq_dim: int = 1) -> torch.Tensor:
    """Every rank's shard ``x`` ``(B, s, ...)`` (along ``seq_dim``) put back in global order
    ``(B, S, ...)`` on every rank, without gradient.

    Raises:
        ValueError: on every rank, when a rank's ``x`` is not a tensor or ``seq_dim`` not one
            of its dims, or the ranks differ in ``seq_dim``, in ``x``'s other dims or dtype,
            or in ``sp``'s sharding (the shards would not be pieces of one tensor).
    """
    sp = as_sequence_parallel(sp, "sp")
    comm = sp.communicator

    def validate() -> tuple[int, dict[str, Any]]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a tensor; got {type(x).__name__}")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int):
            raise ValueError(f"seq_dim must be an int; got {seq_dim!r}")
        if not -x.dim() <= seq_dim < x.dim():
            raise ValueError(f"seq_dim must be a dim of x (shape {tuple(x.shape)}); got {seq_dim}")
        dim = seq_dim % x.dim()
        others = [n for d, n in enumerate(x.shape) if d != dim]
        # the ranks' shards are gathered as raw bytes: they must be pieces of one tensor
        return dim, {
            "seq_dim": dim,
            "x dims": x.dim(),
            "x shape besides seq_dim": others,
            "x dtype": str(x.dtype),
            **_plan_signature(sp),
        }

    dim = comm.agreed(validate, what="gather_sequence call", deferred=True)
    x = x.detach().contiguous()
    if comm.world_size == 1:
        comm.settle()
        return x
    seq_dim = dim
    sizes = comm.all_gather_int(x.shape[seq_dim], x.device, label="gather_sequence lengths")
    padded_shape = list(x.shape)
    padded_shape[seq_dim] = max(sizes)
    padded = x.new_zeros(padded_shape)
    padded.narrow(seq_dim, 0, x.shape[seq_dim]).copy_(x)
    gathered = comm.all_gather(padded, label="gather_sequence", shapes_agreed=True)
    shards = [g.narrow(seq_dim, 0, n) for g, n in zip(gathered, sizes, strict=True)]
    return unshard(shards, layout=sp.layout, seq_dim=seq_dim, cu_seqlens=sp.cu_seqlens)


def _plan_signature(sp: SequenceParallel) -> dict[str, Any]:
    """What the ranks' shards follow: the layout, S and the documents."""
    cu = sp.cu_seqlens
    return {
        "layout": Layout.parse(sp.layout).value,
        "seq_len": sp.seq_len,
        "cu_seqlens": None if cu is None else [int(b) for b in cu],
    }


def _check_num_items(num_items_in_batch: object) -> int | None:
    """``num_items_in_batch`` as an int (None stays None), or ValueError naming it."""
    if num_items_in_batch is None:
        return None
    value = num_items_in_batch
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        found = value.item()  # a count: an integral value of any dtype
        value = int(found) if float(found).is_integer() else found
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        shown = (
            f"a tensor of shape {tuple(num_items_in_batch.shape)} and dtype "
            f"{num_items_in_batch.dtype}"
            if isinstance(num_items_in_batch, torch.Tensor)
            else repr(num_items_in_batch)
        )
        raise ValueError(
            "num_items_in_batch must be an int >= 0 (or a one-element tensor holding one) or None; "
            f"got {shown}"
        )
    return value


def causal_lm_loss(
    sp: SequenceParallel,
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``(B, s, V)`` against ``shift_labels`` ``(B, s)`` (from
    :func:`shard_batch`), averaged over every counted token of every rank: the global mean on
    every rank (0 when no token counts), whose gradient is this rank's share (summed by
    :func:`all_reduce_gradients`). With ``num_items_in_batch`` (transformers' count of the
    labels of every micro-batch a step accumulates), the sum over every rank's tokens divided
    by it instead (by 1 when it is 0).

    Raises:
        ValueError: on every rank, when a rank's logits and shift_labels do not agree, or
            ignore_index or num_items_in_batch is not an int, or the ranks differ in them (the
            sum over the ranks would mix the counts of different rules).
    """
    sp = as_sequence_parallel(sp, "sp")
    comm = sp.communicator

    def validate() -> tuple[int | None, dict[str, Any]]:
        for name, value in (("logits", logits), ("shift_labels", shift_labels)):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{name} must be a tensor; got {type(value).__name__}")
        if logits.dim() != 3 or logits.shape[:2] != shift_labels.shape:
            raise ValueError(
                f"logits (B, s, V) and shift_labels (B, s) must agree; got "
                f"{tuple(logits.shape)} and {tuple(shift_labels.shape)}"
            )
        _check_ignore_index(ignore_index)
        items = _check_num_items(num_items_in_batch)
        return items, {"ignore_index": ignore_index, "num_items_in_batch": items}

    num_items = comm.agreed(validate, what="causal_lm_loss call", deferred=True)
    acc = torch.promote_types(logits.dtype, torch.float32)
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(acc),
        shift_labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    totals = torch.stack(
        [local_sum.detach().double(), (shift_labels != ignore_index).sum().double()]
    )
    if comm.world_size > 1:
        comm.all_reduce(totals, label="causal_lm_loss totals").wait()
    else:
        comm.settle()
    global_sum, num_tokens = totals.to(acc).unbind()
    if num_items is not None:
        num_tokens = torch.tensor(num_items, device=totals.device, dtype=acc)
    num_tokens = num_tokens.clamp(min=1)
    # the same value on every rank; the gradient only through this rank's local_sum
    return global_sum / num_tokens + (local_sum - local_sum.detach()) / num_tokens


def data_parallel_loss(sp: SequenceParallel, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` (a scalar from :func:`causal_lm_loss`) to back-propagate under DDP, FSDP or
    accelerate over every rank: the same value, the gradient times ``sp.group``'s size
    (Note [Trainer ranks and gradient scale] in tokenring.hf.trainer)."""
    sp = as_sequence_parallel(sp, "sp")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss must be a tensor; got {type(loss).__name__}")
    scale = sp.communicator.world_size
    return loss + (scale - 1) * (loss - loss.detach())  # the added term is exactly 0


def all_reduce_gradients(
    sp: SequenceParallel, parameters: Iterable[torch.nn.Parameter] | torch.nn.Module
) -> None:
    """Sum every ``.grad`` over the group in place, in float32 or wider (with
    :func:`causal_lm_loss`, the full gradient; under DDP or FSDP, which average, use
    :func:`data_parallel_loss` instead). Every rank must hold the same parameters' gradients.
    A DTensor gradient (FSDP2's ``fully_shard`` over the data-parallel ranks alone) is summed
    as its local shard, which every rank of the group holds alike (Note [Sharded gradients]).

    Raises:
        NotImplementedError: given a model, as :func:`check_model`.
        ValueError: on every rank, when a rank's ``parameters`` are not parameters, the
            ranks' gradients differ in number, shapes, dtypes or (DTensors) placements and
            mesh coordinates (their sum would add one parameter's gradient to another's, or
            abort the process in the backend), or a DTensor gradient is spread over ranks of
            the group (Note [Sharded gradients]).
    """
    sp = as_sequence_parallel(sp, "sp")
    comm = sp.communicator

    def validate() -> tuple[list[torch.Tensor], dict[str, Any]]:
        params: Any = parameters
        if isinstance(params, torch.nn.Module):
            check_model(params)
            params = params.named_parameters()
        elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
            raise ValueError(
                "parameters must be a torch.nn.Module or an iterable of tensors; got "
                f"{type(params).__name__}"
            )
        else:
            params = ((f"parameters[{i}]", p) for i, p in enumerate(params))
        named = list(params)
        wrong = [(n, p) for n, p in named if not isinstance(p, torch.Tensor)]
        if wrong:
            name, value = wrong[0]
            raise ValueError(f"parameters must be tensors; got {name}={value!r}")
        found = [_local_gradient(name, p.grad, comm) for name, p in named if p.grad is not None]
        shapes = [signature for _, signature in found]
        digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:16]
        grads = [g for g, _ in found]
        return grads, {"gradients": len(found), "gradients' shapes and dtypes sha1": digest}

    grads = comm.agreed(validate, what="all_reduce_gradients call")
    if comm.world_size == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        flat = torch.cat([g.reshape(-1) for g in group]).to(
            torch.promote_types(dtype, torch.float32)
        )
        comm.all_reduce(flat, label=f"all_reduce_gradients {dtype}").wait()
        for g, summed in zip(group, flat.split([g.numel() for g in group]), strict=True):
            g.copy_(summed.view_as(g))


# Note [Sharded gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# FSDP2 (torch.distributed.fsdp.fully_shard) leaves DTensor gradients, which the group's
# collective cannot take ("c10d.allreduce_ does not have a sharding strategy"). Over the
# data-parallel ranks alone (fully_shard(model, mesh=mesh["dp"])) the ranks of one
# sequence-parallel group sit at the same place of their dp meshes, so each holds the same
# rows of a parameter: the sum of their local shards is the sum of their shares, as for
# plain tensors. The placements and the mesh coordinate join the gradients' signature, so
# ranks holding other rows raise. A mesh that holds other ranks of the group
# (fully_shard over the flattened dp x sp ranks, or HSDP over the 2-D mesh) has already
# averaged their shares in the backward, and its shards are different rows on each: a sum
# would add one parameter's rows to another's. That raises, naming the cure: back-propagate
# data_parallel_loss and let FSDP average over every rank.
def _local_gradient(name: str, grad: torch.Tensor, comm: Communicator) -> tuple[torch.Tensor, Any]:
    """The tensor to sum for ``grad`` (a DTensor's local shard) and its signature."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad, [str(grad.dtype), *grad.shape]
    mesh = grad.device_mesh
    mesh_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    me = torch.distributed.get_rank()
    shared = sorted(set(mesh_ranks) & set(comm.global_ranks) - {me})
    if shared:
        raise ValueError(
            f"the gradient of {name} is a DTensor over global ranks {mesh_ranks}, which holds "
            f"rank(s) {shared} of the sequence-parallel group besides this rank {me} (FSDP over "
            "a mesh that includes the sp dimension: it already averaged their shares, and its "
            "shards are different rows on each); back-propagate hf.data_parallel_loss(sp, loss) "
            "and let FSDP average over every rank, or shard over the dp dimension alone"
        )
    local = grad.to_local()
    placements = [str(p) for p in grad.placements]
    return local, [str(local.dtype), *local.shape, placements, mesh.get_coordinate()]


class _SequenceParallelLoss:
    """A loss of ``LOSS_MAPPING`` aware of ``sequence_parallel=`` (see :func:`register`)."""

    def __init__(self, loss_type: str, original: Any) -> None:
        self.loss_type = loss_type
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sp = kwargs.pop("sequence_parallel", None)
        if sp is None:
            return self.original(*args, **kwargs)
        if self.loss_type != "ForCausalLM":
            raise NotImplementedError(
                f"transformers' {self.loss_type} loss under sequence_parallel would average over "
                "this rank's shard only; compute the loss from the logits (for a causal LM: "
                "tokenring.hf.causal_lm_loss)"
            )
        loss = _labels_loss(sp, *args, **kwargs)
        forward = _FORWARD.get()
        if forward is not None:  # Note [A loss the model computes itself]
            forward.global_losses.append((loss, loss._version))
        return loss


# Note [A loss the model computes itself]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# register() wraps LOSS_MAPPING, which a model reaches through self.loss_function(...,
# **kwargs): given sequence_parallel= the causal-LM loss is global and the others raise. Many
# heads compute their loss in their own code instead (BertForMaskedLM's and
# BertForTokenClassification's CrossEntropyLoss(), BertForQuestionAnswering's over the span
# positions, GPT2DoubleHeadsModel's mc_loss, a loss_function called without the forward's
# kwargs): each rank returned the loss over its own shard (BERT masked LM on 2 ranks: 4.1755
# and 4.2285 against 4.2020 in one process; BERT question answering, its positions clamped
# to the shard's length, nan on every rank), without an error. So after the outermost forward
# given sequence_parallel= over several ranks, a loss in its output raises
# NotImplementedError, on every rank, unless it is the very tensor a wrapped loss returned
# under this forward, unchanged since (``loss += coef * aux_loss``, a local term added in
# place, changes its _version): a scalar ``loss`` (or a tuple's first entry, return_dict=
# False) and every ``*_loss`` output. The label keywords given (transformers' own rule,
# _label_keywords: "label" in the name, start_positions, end_positions) are part of the
# forward's rank check (Note [The forward's rank check]), so the ranks decide alike: the same
# model given the same label keywords returns the same losses. Label keywords reach the
# attention call as forward bookkeeping (_check_options lets them pass).


def _refuse_own_loss(
    model: torch.nn.Module, sp: SequenceParallel, forward: _Forward, fields: list[tuple[str, Any]]
) -> None:
    """NotImplementedError naming the losses in ``fields`` that no wrapped loss computed over
    the group (Note [A loss the model computes itself])."""
    if sp.communicator.world_size == 1:
        return
    own = [
        name
        for name, value in fields
        if isinstance(value, torch.Tensor)
        and value.dim() == 0
        and _is_loss(name)
        and not any(value is t and value._version == v for t, v in forward.global_losses)
    ]
    if not own:
        return
    given = ", ".join(f"{k}=" for k in forward.labels) or "no label keyword"
    raise NotImplementedError(
        f"{type(model).__name__} computed its loss from labels= in its own code (its output "
        f"{', '.join(own)}, given {given}), over this rank's shard alone (not through "
        "transformers' loss functions, which tokenring.hf makes global for a causal LM); under "
        "sequence_parallel= call it without label keywords (a loss it computes without any: "
        "take it out of the model) and compute the loss from the per-token outputs over the "
        "group (for a causal LM: tokenring.hf.causal_lm_loss)"
    )


def _labels_loss(
    sp: SequenceParallel,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    """``model(..., labels=..., sequence_parallel=sp).loss``: labels shifted globally."""
    sp = as_sequence_parallel(sp)
    comm = sp.communicator
    b = logits.shape[0]

    def validate() -> tuple[None, dict[str, Any]]:  # on every rank: a bad one raises on all
        if num_items_in_batch is not None:
            raise NotImplementedError(
                "num_items_in_batch is not supported with sequence_parallel: the loss already is "
                "the mean over every rank's counted tokens (scale it yourself for gradient "
                "accumulation)"
            )
        if shift_labels is None and (labels is None or labels.dim() != 2 or labels.shape[0] != b):
            shape = None if labels is None else tuple(labels.shape)
            raise ValueError(f"labels must have shape (batch={b}, seq); got {shape}")
        return None, {"shifted": shift_labels is not None}

    comm.agreed(validate, what="labels loss", deferred=True)
    if shift_labels is not None:
        return causal_lm_loss(sp, logits, shift_labels, ignore_index=ignore_index)
    assert labels is not None
    # the global (B, S) labels: labels, or every rank's shard of them gathered
    sharding = _sharding(sp, logits.shape[1])
    seq_len = sharding.seq_len
    lengths = [labels.shape[1]]
    if comm.world_size > 1:
        lengths = comm.all_gather_int(labels.shape[1], logits.device, label="labels lengths")
    shards = [sharding.local_len(r) for r in range(comm.world_size)]
    whole = [seq_len] * comm.world_size
    if lengths not in (whole, shards):
        raise ValueError(
            f"labels must be every rank's shard (lengths {shards}) or the global labels (length "
            f"{seq_len} on every rank); got lengths {lengths} over the ranks"
        )
    if lengths != whole:
        labels = gather_sequence(sp, labels)
    shifted = _shift_global(labels, ignore_index=ignore_index, cu_seqlens=sp.cu_seqlens)
    local = _local(sp, shifted).to(logits.device)
    return causal_lm_loss(sp, logits, local, ignore_index=ignore_index)
