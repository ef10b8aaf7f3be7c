""":class:`SequenceParallelTrainer`: a ``transformers.Trainer`` whose causal-LM loss runs on
sequence shards, composed with its data parallelism (needs transformers and accelerate).

Legend: N world size, dp data-parallel replicas, sp ranks per sequence-parallel group.

Note [Trainer ranks and gradient scale]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
N = dp x sp ranks form dp sequence-parallel groups of sp ranks (e.g. ``mesh["sp"]`` of a
``("dp", "sp")`` mesh); the Trainer's DDP spans all N. Per step and group g::

    the loader          gives every rank its own batch
    broadcast_batch     the group's first rank's batch on each of its ranks (the others' dropped)
    shard_batch         each rank's zigzag shard, labels shifted over the global sequence
    causal_lm_loss      L_g, the token-weighted mean over the group's tokens; its value is the
                        same on every rank of g, its gradient on rank r the share G_r, and
                        sum over r in g of G_r = dL_g (the group's full gradient)
    backward            of L_g + (sp - 1) (L_g - L_g.detach()): the value stays L_g (the term
                        is exactly 0), the gradient becomes sp G_r
    DDP average         1/N sum over all ranks sp G_r = 1/dp sum over g dL_g: the gradient of
                        the mean over groups, what data parallelism over dp replicas computes
    logged loss         the Trainer's mean over ranks of L_g = the mean over groups, the true
                        loss (no factor of N or sp)
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
)

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - tokenring.hf.register checks first
    raise ImportError(
        "tokenring.hf.trainer needs transformers: pip install 'tokenring-attention[hf]'"
    ) from exc

__all__ = ["SequenceParallelTrainer"]

_INPUTS = frozenset({"input_ids", "labels", "attention_mask"})


class SequenceParallelTrainer(Trainer):
    """A ``transformers.Trainer`` for causal LMs (with a tokenring ``attn_implementation``)
    whose sequences are sharded over ``sequence_parallel.group`` (Note [Trainer ranks and
    gradient scale]). Batches hold ``input_ids``, optionally ``labels`` (unshifted, ``-100``
    where not counted) and an all-ones ``attention_mask``.

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

    loss_is_scaled_for_ga = False  # a mean per micro-batch: Trainer divides by the GA steps

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
                f"the sequence-parallel group size ({sp_size}) must divide the Trainer's "
                f"{num_processes} processes, which must be the whole world ({world} ranks)"
            )

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The group's token-weighted mean loss, its gradient scaled for DDP's average
        (Note [Trainer ranks and gradient scale]); ``num_items_in_batch`` is not needed."""
        sp = self.sequence_parallel
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
        loss = data_parallel_loss(sp, causal_lm_loss(sp, outputs.logits, local.shift_labels))
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """The evaluation loss only (logits are per shard: ``tokenring.hf.gather_sequence``)."""
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
