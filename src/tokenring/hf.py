"""Hugging Face transformers integration: tokenring as a model's attention implementation.

This module owns the bridge between transformers' public registries (``AttentionInterface``
for the attention function, ``AttentionMaskInterface`` for the mask the model builds) and
:func:`tokenring.sequence_parallel_attn`, and the helpers a training loop needs around it:
sharding a batch (labels shifted over the *global* sequence first), gathering logits, the
token-count-weighted loss over the ranks and the gradient sum.

transformers is imported only by :func:`register` (``pip install tokenring[hf]``).

Note [How a model call reaches the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    register()                          names "tokenring", "tokenring_<strategy>", "tokenring_auto"
    from_pretrained(..., attn_implementation=name) (or from_config, set_attn_implementation)
    model(input_ids=local_ids,          (B, s): this rank's shard (shard_batch)
          position_ids=local_pos,       (1, s): global / in-document positions, for RoPE
          sequence_parallel=sp)         the SequenceParallel below; transformers hands model
                                        kwargs down to every attention call
      create_causal_mask -> our mask function -> None: the model builds no local mask (a
          local causal mask is wrong for a zigzag shard); causality is over global positions
      LlamaAttention -> our attention function -> sequence_parallel_attn(q, k, v,
          strategy from the name, causal, group/layout/seq_len/cu_seqlens from sp)

Legend: B batch, S global seq, s local seq, H heads, D head dim, V vocab, P world size.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenring.api import GroupLike, get_communicator, sequence_parallel_attn
from tokenring.comm import Communicator
from tokenring.costmodel import Hardware
from tokenring.layout import Layout, normalize_cu_seqlens, position_ids, shard, unshard
from tokenring.schedule import Strategy

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "LocalBatch",
    "SequenceParallel",
    "all_reduce_gradients",
    "causal_lm_loss",
    "gather_sequence",
    "register",
    "shard_batch",
    "shift_labels",
]

MIN_TRANSFORMERS = "4.53"
"""The first release with ``AttentionMaskInterface`` (masking_utils) and model kwargs passed
down to the attention function."""

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
    """How a model's sequence is split over the ranks of a group.

    Pass it to the model's forward as ``sequence_parallel=`` (transformers hands it to every
    attention call) and to the helpers of this module. One per global batch shape: it is
    small and immutable.
    """

    group: GroupLike = None
    """ProcessGroup, 1-D DeviceMesh, ``tokenring.Communicator``, or None (default group)."""
    layout: Layout | str = Layout.ZIGZAG
    """How the sequence is sharded: ``"zigzag"`` (balances causal work) or ``"contiguous"``."""
    seq_len: int | None = None
    """S, the global length. None: every rank holds the same s tokens and S = P * s. Needed
    when the shards differ in length (S not divisible by the layout's chunk count, or
    ``cu_seqlens``)."""
    cu_seqlens: Sequence[int] | torch.Tensor | None = None
    """Global document boundaries ``(0, ..., S)`` of a packed sequence, the same for every
    batch row (kept as a tuple): attention never crosses them, RoPE positions restart at each,
    and the layout is applied per document. Needs ``seq_len``."""
    hardware: Hardware | str | None = None
    """For ``"tokenring_auto"``: a ``tokenring.costmodel.Hardware`` or preset name; None
    measures this machine once per group (see :func:`tokenring.resolve_strategy`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 or None; got {self.seq_len}")
        if self.cu_seqlens is not None:
            if self.seq_len is None:
                raise ValueError("cu_seqlens needs seq_len (the global length it ends at)")
            cu = normalize_cu_seqlens(self.cu_seqlens, self.seq_len)
            object.__setattr__(self, "cu_seqlens", cu)

    @property
    def communicator(self) -> Communicator:
        """The group's communicator (built on first use; a collective on every rank)."""
        return get_communicator(self.group)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalBatch:
    """This rank's share of a global causal-LM batch (from :func:`shard_batch`)."""

    input_ids: torch.Tensor
    """``(B, s)`` token ids."""
    position_ids: torch.Tensor
    """``(1, s)`` int64: each token's position in the global sequence, or inside its
    document with ``cu_seqlens`` (RoPE)."""
    shift_labels: torch.Tensor | None
    """``(B, s)``: the label of each local token, i.e. the *next* global token's label
    (shifted before sharding); ``ignore_index`` where there is none."""


def register() -> tuple[str, ...]:
    """Register tokenring with transformers' ``AttentionInterface`` and
    ``AttentionMaskInterface``; idempotent.

    After this, ``attn_implementation=name`` works for every name of
    :data:`ATTN_IMPLEMENTATIONS`: ``"tokenring"`` (TokenRing), ``"tokenring_<strategy>"``
    for each :class:`tokenring.Strategy`, and ``"tokenring_auto"``.

    Returns:
        The registered names.

    Raises:
        ImportError: transformers is missing or older than :data:`MIN_TRANSFORMERS`.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "tokenring.hf needs transformers>="
            f"{MIN_TRANSFORMERS} (AttentionInterface, AttentionMaskInterface): "
            "pip install tokenring[hf]"
        ) from exc
    for name, strategy in ATTN_IMPLEMENTATIONS.items():
        AttentionInterface.register(
            name, functools.partial(_attention_forward, strategy=strategy, name=name)
        )
        AttentionMaskInterface.register(name, _no_local_mask)
    return tuple(ATTN_IMPLEMENTATIONS)


def _no_local_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """The mask function for ``AttentionMaskInterface``: no mask tensor at all.

    A causal mask over a rank's local rows is wrong for sharded sequences; the attention call
    masks over global positions (and documents) itself. A padding mask with zeros cannot be
    honoured, so it raises instead of being dropped.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(
            "tokenring attention does not take a padding attention_mask; pack the sequences "
            "(SequenceParallel(cu_seqlens=...)) or pad at the end and set the padded labels "
            "to ignore_index"
        )
    return None


def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    strategy: str,
    name: str,
    scaling: float | None = None,
    dropout: float = 0.0,
    sequence_parallel: SequenceParallel | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    output_attentions: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: transformers' ``(B, H, s, D)`` in,
    ``(B, s, Hq, D)`` out (and no attention weights)."""
    if sequence_parallel is None:
        raise ValueError(
            f"attn_implementation={name!r} needs sequence_parallel=tokenring.hf.SequenceParallel"
            "(...) passed to the model's forward (it says which group and layout the shards use)"
        )
    if attention_mask is not None:
        raise NotImplementedError(
            f"attn_implementation={name!r} does not take a prepared attention mask; got one of "
            f"shape {tuple(attention_mask.shape)}"
        )
    if key.shape[2] != query.shape[2]:
        raise NotImplementedError(
            f"attn_implementation={name!r} does not support a KV cache (generation); got "
            f"{query.shape[2]} query and {key.shape[2]} key rows (pass use_cache=False)"
        )
    if dropout > 0:
        raise NotImplementedError(f"attention dropout is not supported; got dropout={dropout}")
    for option, unsupported in (
        ("softcap", softcap is not None),
        ("attention sinks (s_aux)", s_aux is not None),
        ("output_attentions", output_attentions),
    ):
        if unsupported:
            raise NotImplementedError(f"attn_implementation={name!r} does not support {option}")
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    window_size = None
    if sliding_window is not None:
        # transformers' window holds sliding_window keys up to and including the query itself:
        # flash-attention's window_size=(sliding_window - 1, 0) when causal.
        window_size = (sliding_window - 1, 0 if causal else sliding_window - 1)
    sp = sequence_parallel
    out = sequence_parallel_attn(
        query.transpose(1, 2),  # (B, s, Hq, D)
        key.transpose(1, 2),  # (B, s, Hkv, D)
        value.transpose(1, 2),
        strategy=strategy,
        causal=causal,
        softmax_scale=scaling,
        group=sp.group,
        layout=sp.layout,
        hardware=sp.hardware,
        seq_len=sp.seq_len,
        cu_seqlens=sp.cu_seqlens,
        window_size=window_size,
    )
    assert isinstance(out, torch.Tensor)
    return out, None  # (B, s, Hq, D)


def shift_labels(
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token labels over the global sequence: ``out[:, t] = labels[:, t + 1]``.

    Shift *before* sharding: after it, a rank's last token needs the first token of another
    rank's shard. The last position, and with ``cu_seqlens`` the last token of every document
    (its next token starts another document), get ``ignore_index``.

    Args:
        labels: ``(B, S)`` global labels (usually the input ids).

    Returns:
        ``(B, S)``.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape (batch, seq); got {tuple(labels.shape)}")
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        bounds = normalize_cu_seqlens(cu_seqlens, labels.shape[1])
        out[:, [end - 1 for end in bounds[1:-1]]] = ignore_index
    return out


def shard_batch(
    sp: SequenceParallel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
) -> LocalBatch:
    """This rank's share of a global batch: input ids, RoPE positions, shifted labels.

    Args:
        sp: the split; ``sp.seq_len``, when set, must equal S.
        input_ids: ``(B, S)`` global token ids, the same on every rank.
        labels: ``(B, S)`` global labels (usually ``input_ids``, with ``ignore_index`` on
            tokens that must not be predicted), or None.

    Returns:
        A :class:`LocalBatch` of ``(B, s)`` tensors (``(1, s)`` positions).

    Raises:
        ValueError: input_ids not 2-D, labels of another shape, S != sp.seq_len, or uneven
            shards without sp.seq_len.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq); got {tuple(input_ids.shape)}")
    seq_len = input_ids.shape[1]
    if sp.seq_len is not None and sp.seq_len != seq_len:
        raise ValueError(f"input_ids has {seq_len} tokens per row but sp.seq_len={sp.seq_len}")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels must have the shape of input_ids {tuple(input_ids.shape)}; got "
            f"{tuple(labels.shape)}"
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

    def local(x: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, s)
        return shard(x, rank=rank, world_size=world_size, layout=sp.layout, cu_seqlens=cu_seqlens)

    positions = position_ids(
        rank=rank, world_size=world_size, layout=sp.layout, seq_len=seq_len, cu_seqlens=cu_seqlens
    )
    shifted = None
    if labels is not None:
        shifted = local(shift_labels(labels, ignore_index=ignore_index, cu_seqlens=cu_seqlens))
    return LocalBatch(
        input_ids=local(input_ids),
        position_ids=positions.to(input_ids.device).unsqueeze(0),
        shift_labels=shifted,
    )


def gather_sequence(sp: SequenceParallel, x: torch.Tensor, *, seq_dim: int = 1) -> torch.Tensor:
    """Every rank's shard put back in global order, on every rank (no gradient).

    Args:
        x: this rank's ``(B, s, ...)`` shard (e.g. logits ``(B, s, V)``) along ``seq_dim``.

    Returns:
        ``(B, S, ...)``.
    """
    comm = sp.communicator
    x = x.detach().contiguous()
    if comm.world_size == 1:
        return x
    lengths = torch.tensor([x.shape[seq_dim]], dtype=torch.int64, device=x.device)
    all_lengths = [torch.empty_like(lengths) for _ in range(comm.world_size)]
    dist.all_gather(all_lengths, lengths, group=comm.group)
    sizes = [int(n.item()) for n in all_lengths]
    padded_shape = list(x.shape)
    padded_shape[seq_dim] = max(sizes)
    padded = x.new_zeros(padded_shape)
    padded.narrow(seq_dim, 0, x.shape[seq_dim]).copy_(x)
    gathered = [torch.empty_like(padded) for _ in range(comm.world_size)]
    dist.all_gather(gathered, padded, group=comm.group)
    shards = [g.narrow(seq_dim, 0, n) for g, n in zip(gathered, sizes, strict=True)]
    return unshard(shards, layout=sp.layout, seq_dim=seq_dim, cu_seqlens=sp.cu_seqlens)


def causal_lm_loss(
    sp: SequenceParallel,
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy averaged over every counted token of every rank (token-count weighted).

    Ranks hold different numbers of counted tokens (``ignore_index``), so a mean of per-rank
    means would be wrong; this sums on each rank and divides by the global count.

    Args:
        logits: ``(B, s, V)`` this rank's logits.
        shift_labels: ``(B, s)`` from :func:`shard_batch` (already shifted globally).

    Returns:
        A scalar whose value on every rank is the global mean, and whose gradient is this
        rank's share of it: after ``backward()``, the parameter gradients summed over the
        group (:func:`all_reduce_gradients`) are the gradient of the global mean. 0 when no
        token is counted.
    """
    if logits.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"logits (B, s, V) and shift_labels (B, s) must agree; got {tuple(logits.shape)} and "
            f"{tuple(shift_labels.shape)}"
        )
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
    comm = sp.communicator
    if comm.world_size > 1:
        dist.all_reduce(totals, group=comm.group)
    global_sum, num_tokens = totals.to(acc).unbind()
    num_tokens = num_tokens.clamp(min=1)
    # value: global_sum / num_tokens, bitwise the same on every rank; gradient: only through
    # this rank's local_sum (the added term is exactly zero)
    return global_sum / num_tokens + (local_sum - local_sum.detach()) / num_tokens


def all_reduce_gradients(
    sp: SequenceParallel, parameters: Iterable[torch.nn.Parameter] | torch.nn.Module
) -> None:
    """Sum every ``.grad`` over the group, in place (what DDP would do, but a sum).

    Each rank's gradients come from its own tokens only; with :func:`causal_lm_loss` their
    sum is the full gradient. (DDP and FSDP *average* over their group: with them, scale the
    loss by the group size instead of calling this.) Reduces in float32 or wider. Every rank
    must hold gradients for the same parameters (one flat all-reduce per dtype).
    """
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    grads = [p.grad for p in parameters if p.grad is not None]
    comm = sp.communicator
    if comm.world_size == 1 or not grads:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        flat = torch.cat([g.reshape(-1) for g in group]).to(
            torch.promote_types(dtype, torch.float32)
        )
        dist.all_reduce(flat, group=comm.group)
        offset = 0
        for g in group:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
