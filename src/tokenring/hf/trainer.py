""":class:`SequenceParallelTrainer`: a ``transformers.Trainer`` whose causal-LM loss runs on
sequence shards, composed with its data parallelism (needs transformers and accelerate).

Legend: N world size, dp data-parallel replicas, sp ranks per sequence-parallel group.

Note [Trainer ranks and gradient scale]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
N = dp x sp ranks form dp sequence-parallel groups of sp ranks (e.g. ``mesh["sp"]`` of a
``("dp", "sp")`` mesh); the Trainer's DDP spans all N. The aim: the update transformers'
Trainer makes over dp data-parallel processes fed the groups' first ranks' micro-batches.
Per optimizer step of M accumulated micro-batches m, and group g, where S_gm is the summed
token loss of micro-batch m over the group's tokens and C_g the labels counted in its M
micro-batches (``labels[..., 1:] != -100``, transformers' count; with ``cu_seqlens`` the
labels the loss sums)::

    the loader          gives every rank its own M micro-batches
    _get_num_items_in_batch
                        n: C_g counted on the group's first rank, agreed within g (the
                        others' batches are dropped); average_tokens_across_devices:
                        n = C = sum over g of C_g, and k = dp; else n = C_g, k = 1
    broadcast_batch     the group's first rank's micro-batch on each of its ranks
    shard_batch         each rank's zigzag shard, labels shifted over the global sequence
    causal_lm_loss      k S_gm / n: the same value on every rank of g, its gradient on rank r
                        the share G_rm, and sum over r in g of G_rm = k dS_gm / n
    backward            of it + (sp - 1) (it - it.detach()) (data_parallel_loss): the value
                        stays (the term is exactly 0), the gradient becomes sp G_rm
    accumulate, DDP     1/N sum over ranks and m of sp G_rm = (k / dp) sum over g dS_g / n
                        (S_g = sum over m of S_gm); averaged: dS / C with S = sum over g
                        of S_g, the token mean over every group's micro-batches; else
                        1/dp sum over g d(S_g / C_g): what transformers' Trainer computes
                        over dp processes (its loss times the processes, its DDP average)
    logged loss         the Trainer's mean over ranks of sum over m of k S_gm / n: S / C, or
                        the mean over groups of S_g / C_g (no factor of N or sp)

``loss_is_scaled_for_ga`` is then true (the loss is divided by n, not by M). transformers
passes no n when the model takes no loss keyword arguments (``model_accepts_loss_kwargs``):
then, as there, each micro-batch's loss is the group's token mean L_gm = S_gm / C_gm, the
Trainer divides it by M, and the update is 1/dp sum over g 1/M sum over m dL_gm.
``evaluate`` counts each batch alike (``prediction_step``): its loss is S / C of the batch,
or the mean over groups of their token means, as transformers' evaluate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tokenring.hf.attention import (
    SequenceParallel,
    as_sequence_parallel,
    broadcast_batch,
    causal_lm_loss,
    check_model,
    data_parallel_loss,
    refuse_padding,
    register,
    shard_batch,
    shift_labels,
)

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - tokenring.hf.register checks first
    raise ImportError(
        "tokenring.hf.trainer needs transformers: pip install 'tokenring-attention[hf]'"
    ) from exc

# the hooks of transformers' Trainer that the loss follows (Note [Trainer ranks and gradient
# scale]): without one, the update would silently differ from transformers' own
_HOOKS = ("_get_num_items_in_batch", "get_batch_samples", "loss_is_scaled_for_ga")
_missing = [name for name in _HOOKS if not hasattr(Trainer, name)]
if _missing:  # pragma: no cover - the hf extra's transformers has them
    import transformers

    raise ImportError(
        f"tokenring.hf.trainer needs transformers' Trainer.{', Trainer.'.join(_missing)}, "
        f"which transformers {transformers.__version__} lacks (pip install "
        "'tokenring-attention[hf]')"
    )

__all__ = ["SequenceParallelTrainer"]

_INPUTS = frozenset({"input_ids", "labels", "attention_mask"})


class SequenceParallelTrainer(Trainer):
    """A ``transformers.Trainer`` for causal LMs (with a tokenring ``attn_implementation``)
    whose sequences are sharded over ``sequence_parallel.group`` (Note [Trainer ranks and
    gradient scale]). Batches hold ``input_ids``, optionally ``labels`` (unshifted, ``-100``
    where not counted; without them, ``input_ids``) and an all-ones ``attention_mask``.

    The update and the logged loss are those of transformers' ``Trainer`` over dp =
    N / sp data-parallel processes fed each group's first rank's batches (the others' are
    dropped), gradient accumulation included: the summed token loss divided by
    ``num_items_in_batch``, the labels counted in the group's accumulated micro-batches
    (summed over the dp groups with ``average_tokens_across_devices``), or, where
    transformers passes no ``num_items_in_batch`` (a model without loss keyword arguments),
    each micro-batch's token mean divided by the accumulation steps.

    Args:
        sequence_parallel: the group and layout; every rank's group has the same size, a
            divisor of the world size.
        args, kwargs: ``Trainer``'s.

    Raises:
        ValueError: sequence_parallel is not a SequenceParallel, or its group size does not
            divide the number of processes.
        NotImplementedError: a layer of the model mixes tokens other than by attention
            (``tokenring.hf.check_model``); label smoothing, ``compute_loss_func`` or
            ``compute_metrics`` (the loss is the causal-LM loss over the global sequence).
    """

    # set by compute_loss for training_step: True when the loss was divided by num_items
    loss_is_scaled_for_ga: bool | None = None

    def __init__(self, *args: Any, sequence_parallel: SequenceParallel, **kwargs: Any) -> None:
        as_sequence_parallel(sequence_parallel)
        register()
        super().__init__(*args, **kwargs)
        if self.model is not None:  # with model_init: each trial's model is not checked
            check_model(self.model)
        for option, given in (
            ("label smoothing (label_smoothing_factor)", self.label_smoother is not None),
            ("compute_loss_func", self.compute_loss_func is not None),
            (
                "compute_metrics (prediction_step returns the loss alone)",
                self.compute_metrics is not None,
            ),
        ):
            if given:  # compute_loss and prediction_step would drop it
                raise NotImplementedError(f"SequenceParallelTrainer does not support {option}")
        self.sequence_parallel = sequence_parallel
        sp_size = sequence_parallel.communicator.world_size
        num_processes = self.accelerator.num_processes
        world = dist.get_world_size() if dist.is_initialized() else 1
        if num_processes != world or num_processes % sp_size:
            raise ValueError(
                f"sequence_parallel's group size ({sp_size}) must divide the Trainer's "
                f"{num_processes} processes, which must be the whole world ({world} ranks)"
            )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The group's summed token loss over ``num_items_in_batch`` (from
        :meth:`_get_num_items_in_batch`; None or a model without loss keyword arguments: the
        group's token mean), its gradient scaled for DDP's average (Note [Trainer ranks and
        gradient scale])."""
        sp = self.sequence_parallel
        # transformers' rule (Trainer.compute_loss, training_step): the loss is divided by
        # num_items_in_batch when the model takes loss keyword arguments and one is given
        num_items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        self.loss_is_scaled_for_ga = num_items is not None  # training_step reads it next
        extra = sorted(set(inputs) - _INPUTS)
        if extra:
            raise NotImplementedError(
                f"SequenceParallelTrainer takes input_ids, labels and attention_mask; got {extra}"
            )
        hint = "pad at the end and set the padded labels to -100, or pack the sequences"
        refuse_padding(inputs.get("attention_mask"), hint)
        input_ids = inputs["input_ids"]
        labels = inputs.get("labels")
        batch = broadcast_batch(
            sp, {"input_ids": input_ids, "labels": input_ids if labels is None else labels}
        )
        local = shard_batch(sp, batch["input_ids"], batch["labels"])
        outputs = model(
            input_ids=local.input_ids,
            position_ids=local.position_ids,
            sequence_parallel=sp,
            use_cache=False,
        )
        assert local.shift_labels is not None
        loss = causal_lm_loss(sp, outputs.logits, local.shift_labels, num_items_in_batch=num_items)
        if num_items is not None and self.args.average_tokens_across_devices:
            # transformers multiplies by its processes, the dp replicas, to undo DDP's average
            loss = loss * (self.accelerator.num_processes // sp.communicator.world_size)
        loss = data_parallel_loss(sp, loss)
        return (loss, outputs) if return_outputs else loss

    def _get_num_items_in_batch(
        self, batch_samples: list[Any], device: torch.device
    ) -> torch.Tensor | None:
        """transformers' ``num_items_in_batch`` over the batches the group uses: the labels
        counted in its first rank's micro-batches ``batch_samples``, the same on every rank
        of the group, summed over the dp groups with ``average_tokens_across_devices``; None
        where transformers passes none (no batches, or a model without loss keyword
        arguments). Called by ``get_batch_samples`` and :meth:`prediction_step`."""
        if not batch_samples or not self.model_accepts_loss_kwargs:
            return None
        sp = self.sequence_parallel
        comm = sp.communicator
        count = torch.zeros((), dtype=torch.int64, device=device)
        if comm.rank == 0:  # the other ranks' batches are dropped by broadcast_batch
            try:
                for batch in batch_samples:
                    labels = batch.get("labels")
                    labels = torch.as_tensor(batch["input_ids"] if labels is None else labels)
                    # transformers counts labels[..., 1:] != -100: the labels the loss sums
                    shifted = shift_labels(labels, cu_seqlens=sp.cu_seqlens)
                    count += (shifted != -100).sum().to(device)
            except (KeyError, TypeError, ValueError):
                count.fill_(-1)  # a malformed batch: compute_loss raises it on every rank
        if comm.world_size > 1:
            comm.all_reduce(count, label="num_items_in_batch").wait()
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.gather(count)
            # every rank of a group holds its count: the sum over ranks is sp times the sum
            # over groups
            count = counts.sum() // comm.world_size if counts.min() >= 0 else counts.min()
        return None if count < 0 else count

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """The evaluation loss only (logits are per shard: ``tokenring.hf.gather_sequence``),
        normalized as transformers' ``prediction_step`` does: by the batch's count
        (:meth:`_get_num_items_in_batch`)."""
        with torch.no_grad():
            num_items = self._get_num_items_in_batch([inputs], self.args.device)
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items)
        return loss.detach(), None, None
