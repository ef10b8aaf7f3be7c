""":class:`SequenceParallelTrainer`: a ``transformers.Trainer`` whose causal-LM loss runs on
sequence shards, composed with its data parallelism (needs transformers and accelerate).

Legend: N world size, dp data-parallel replicas, sp ranks per sequence-parallel group.

Note [Trainer ranks and gradient scale]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
N = dp x sp ranks form dp sequence-parallel groups of sp ranks (e.g. ``mesh["sp"]`` of a
``("dp", "sp")`` mesh); the Trainer's DDP spans all N. The aim: the update transformers'
Trainer makes over dp data-parallel processes, its process g fed group g's micro-batches
(Note [Data over the groups]: every rank of a group loads the same ones, the dataset dealt
over the dp groups). Per optimizer step of M accumulated micro-batches m, and group g, where
S_gm is the summed token loss of micro-batch m over the group's tokens and C_g the labels
counted in its M micro-batches (``labels[..., 1:] != -100``, transformers' count; with
``cu_seqlens`` the labels the loss sums)::

    the loader          gives every rank of group g the group's M micro-batches
    _get_num_items_in_batch
                        n: C_g counted on the group's first rank, agreed within g (its
                        ranks hold the same batches); average_tokens_across_devices:
                        n = C = sum over g of C_g, and k = dp; else n = C_g, k = 1
    _same_batch         checks that the group's ranks hold the same micro-batch (raises
                        on each of them otherwise)
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

Note [Data over the groups]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Context parallelism (Megatron, torchtitan) deals the data over the data-parallel ranks only:
the ranks of a sequence-parallel group see the same batch. accelerate deals it over all N
processes, so the Trainer's loaders are re-dealt over the dp groups: group g (the groups
ordered by their lowest global rank; a ``("sp", "dp")`` mesh gives strided groups) takes
process index g of dp. Then an epoch covers the dataset once, and ``evaluate`` scores every
row: its loss is that of transformers' Trainer over dp processes. What this relies on, from
transformers 5.x and accelerate 1.x:

- ``Trainer._get_dataloader`` builds the train, eval and test loaders and returns
  ``accelerator.prepare``'s loader; for a dataset with a length that is a ``DataLoaderShard``
  whose ``BatchSamplerShard`` reads ``num_processes`` and ``process_index`` when iterated and
  measured (``__iter__``, ``__len__``; the loader's ``total_batch_size``, hence
  ``GradientState.remainder`` and ``end_of_dataloader``, from the same attributes).
  transformers itself resets them for its ``BatchRebalanceSampler``. :meth:`_get_dataloader`
  sets them to dp and g (dp = 1: also ``even_batches`` off, as for one process, which
  accelerate does not wrap: a last partial batch stays partial); other loaders (an
  ``IterableDataset``: accelerate dispatches or shards it over the N processes) and the
  ``batch_rebalance`` sampler (dealt over N by transformers) raise ``NotImplementedError``.
- ``evaluation_loop`` gathers each batch's ``losses.repeat(batch_size)`` with
  ``self.gather_function`` (accelerate's ``gather_for_metrics``: all N processes in rank
  order, the last batch cut to ``GradientState.remainder``), and resets it at its end.
  :meth:`evaluation_loop` sets it to :meth:`_gather_for_metrics`, which keeps the groups'
  first ranks' parts in group order before the cut: what dp processes gather. The sp copies
  in rank order would count a group sp times and cut the wrong rows off the last batch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from tokenring.api import get_communicator
from tokenring.hf.attention import (
    PADDING_HINT,
    SequenceParallel,
    as_sequence_parallel,
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


# Note [A training step that fails on one rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward that raises on one rank is told to its peers by tokenring.hf's forward wrapper
# (Note [A forward that fails on one rank] in tokenring.hf.attention); a backward has no such
# wrapper: a layer's backward hook, a NaN check or an allocation that failed on one rank left
# its peers waiting out the timeout in the next attention backward's transfer ("receive of
# 'q_grad' ... no message within 4 s", 2 ranks, a 4 s timeout), naming no cause. The Trainer
# owns the step, so training_step tells the peers of an error of this rank's own
# (Communicator.tell: at the check they meet next, waiting for them at most TELL_WITHIN_S), and
# every rank raises naming it.
TRAINING_STEP = "training step"


class SequenceParallelTrainer(Trainer):
    """A ``transformers.Trainer`` for causal LMs (with a tokenring ``attn_implementation``)
    whose sequences are sharded over ``sequence_parallel.group`` (Note [Trainer ranks and
    gradient scale]). Batches hold ``input_ids``, optionally ``labels`` (unshifted, ``-100``
    where not counted; without them, ``input_ids``) and an all-ones ``attention_mask``.

    The train, eval and test loaders deal the dataset over the dp = N / sp groups, not the
    N ranks: every rank of a group loads the same batches (Note [Data over the groups]), so
    an epoch covers the dataset once and ``evaluate`` scores every row. The update, the
    logged loss and ``evaluate``'s loss are those of transformers' ``Trainer`` over dp
    data-parallel processes, process g fed group g's batches, gradient accumulation
    included: the summed token loss divided by ``num_items_in_batch``, the labels counted in
    the group's accumulated micro-batches (summed over the dp groups with
    ``average_tokens_across_devices``), or, where transformers passes no
    ``num_items_in_batch`` (a model without loss keyword arguments), each micro-batch's token
    mean divided by the accumulation steps.

    Args:
        sequence_parallel: the group and layout; every rank's group has the same size, a
            divisor of the world size.
        args, kwargs: ``Trainer``'s.

    Raises:
        RuntimeError: in training, with more than one process, when the model is not
            wrapped for data parallelism (transformers' Trainer does not wrap it after
            ``evaluate`` or ``predict`` ran first on it).
        ValueError: sequence_parallel is not a SequenceParallel, or the ranks' groups do not
            split the world into groups of one size (on every rank); in training or
            evaluation, on every rank of a group, when its ranks were given different batches
            (a loader that deals them to each rank).
        NotImplementedError: a layer of the model mixes tokens other than by attention
            (``tokenring.hf.check_model``); label smoothing, ``compute_loss_func`` or
            ``compute_metrics`` (the loss is the causal-LM loss over the global sequence);
            the ``batch_rebalance`` sampling strategy; with sp > 1 and more than one
            process, when a loader is made, a dataset without a length (accelerate deals an
            ``IterableDataset`` over all processes).
    """

    # set by compute_loss for training_step: True when the loss was divided by num_items
    loss_is_scaled_for_ga: bool | None = None
    # Note [Data over the groups]: (dp, this rank's group g, each group's first global rank
    # in group order), or None when the loaders need no re-dealing (sp = 1 or one process)
    _data_groups: tuple[int, int, tuple[int, ...]] | None = None

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
            (
                "train_sampling_strategy='batch_rebalance' (it deals the batches over all "
                "processes, not the sequence-parallel groups)",
                self.args.train_sampling_strategy == "batch_rebalance",
            ),
        ):
            if given:  # compute_loss and prediction_step would drop it
                raise NotImplementedError(f"SequenceParallelTrainer does not support {option}")
        self.sequence_parallel = sequence_parallel
        sp_size = sequence_parallel.communicator.world_size
        num_processes = self.accelerator.num_processes
        world = dist.get_world_size() if dist.is_initialized() else 1
        if num_processes != world:
            raise ValueError(
                f"the Trainer's {num_processes} processes must be the whole world ({world} ranks)"
            )
        if world > 1:  # on every rank: one whose group is of another size raises with the rest
            groups = _data_groups(sequence_parallel, world)
            self._data_groups = groups if sp_size > 1 else None

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
        if (
            model.training
            and self.accelerator.num_processes > 1
            and not self.is_fsdp_enabled  # FSDP2 shards the module in place
            and not _data_parallel(self.accelerator, model)
        ):
            # transformers 5.x: evaluate() before train() prepares the model for evaluation
            # alone, and accelerate then never wraps it in DDP: the ranks would not average
            # their gradients (each rank's is sp times its share), silently diverging
            raise RuntimeError(
                "SequenceParallelTrainer is training a model without DDP over its "
                f"{self.accelerator.num_processes} processes (transformers does this after "
                "evaluate() or predict() ran before train() on the same Trainer): train "
                "first, or evaluate with another Trainer"
            )
        batch = _same_batch(sp, inputs)  # Note [Data over the groups]: the loaders give it
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
        """transformers' ``num_items_in_batch`` over the group's batches: the labels counted
        in its micro-batches ``batch_samples`` (on its first rank), the same on every rank
        of the group, summed over the dp groups with ``average_tokens_across_devices``; None
        where transformers passes none (no batches, or a model without loss keyword
        arguments). Called by ``get_batch_samples`` and :meth:`prediction_step`."""
        if not batch_samples or not self.model_accepts_loss_kwargs:
            return None
        sp = self.sequence_parallel
        comm = sp.communicator
        count = torch.zeros((), dtype=torch.int64, device=device)
        if comm.rank == 0:  # the group's ranks hold the same batches (compute_loss checks)
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

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """``Trainer.training_step``; where it raises on this rank alone, the peers are told
        (Note [A training step that fails on one rank])."""
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        except Exception as exc:
            comm = self.sequence_parallel.communicator
            if not comm.raised_on_every_rank(exc):
                comm.tell(exc, what=TRAINING_STEP)
            raise

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

    def get_total_train_batch_size(self, args: Any) -> int:
        """transformers' total batch (logged, and its samples per second): the per-device
        batch times the accumulation steps times dp, the groups (not the N ranks)."""
        dp = args.world_size // self.sequence_parallel.communicator.world_size
        return int(self._train_batch_size * args.gradient_accumulation_steps * dp)

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' loader (train, eval, test), dealt over the dp groups instead of the
        N processes (Note [Data over the groups])."""
        loader = super()._get_dataloader(*args, **kwargs)
        if self._data_groups is None:
            return loader
        from accelerate.data_loader import BatchSamplerShard

        dp, group, _ = self._data_groups
        shards = [
            s
            for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
            if isinstance(s, BatchSamplerShard)
        ]
        if not shards or shards[0].num_processes != self.accelerator.num_processes:
            raise NotImplementedError(
                "SequenceParallelTrainer deals the data over the sequence-parallel groups for "
                "a dataset with a length (a map-style dataset, which accelerate's "
                f"BatchSamplerShard splits); got a {type(loader).__name__} over a "
                f"{type(loader.dataset).__name__} (an IterableDataset is dealt over all "
                f"{self.accelerator.num_processes} processes)"
            )
        shards[0].num_processes = dp
        shards[0].process_index = group
        if dp == 1:  # one process: accelerate would not wrap, nor pad a last partial batch
            shards[0].even_batches = False
        return loader

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``evaluation_loop``, gathering over the dp groups
        (:meth:`_gather_for_metrics`; Note [Data over the groups])."""
        if self._data_groups is not None:
            # evaluation_loop gathers with it, then resets it to gather_for_metrics
            self.gather_function = self._gather_for_metrics
        return super().evaluation_loop(*args, **kwargs)

    def _gather_for_metrics(self, data: Any) -> Any:
        """accelerate's ``gather_for_metrics`` over dp processes: the groups' first ranks'
        ``data`` in group order (each rank of a group holds the same), the last batch cut
        to the dataset's remainder."""
        from accelerate.utils import gather_object, recursively_apply

        assert self._data_groups is not None
        _, _, firsts = self._data_groups
        num = self.accelerator.num_processes
        state = self.accelerator.gradient_state
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None
        if self.args.eval_use_gather_object:
            parts = gather_object([data])  # one entry per process, in rank order
            if len(firsts) == 1:  # one process: gather_object returns the object itself
                kept = parts[firsts[0]]
            else:  # over processes: their objects' items, concatenated in a list
                kept = [item for rank in firsts for item in parts[rank]]
            return kept if cut is None else kept[:cut]

        def keep(t: torch.Tensor) -> torch.Tensor:
            parts = t.split(t.shape[0] // num)  # accelerate's gather: equal parts
            mine = torch.cat([parts[rank] for rank in firsts])
            return mine if cut is None else mine[:cut]

        return recursively_apply(keep, self.accelerator.gather(data))


def _data_parallel(accelerator: Any, model: torch.nn.Module) -> bool:
    """Whether ``model``, as the Trainer runs it, holds a data-parallel wrapper (DDP) under
    torch.compile's wrapper, if any (accelerate compiles last: ``torch.compile(DDP(model))``).

    accelerate's ``unwrap_model`` keeps a compiled wrapper by default by pointing its
    ``_orig_mod`` at the bare model: asked of ``torch.compile(DDP(model))`` (TrainingArguments'
    ``torch_compile=True``), it took DDP out of the Trainer's model and returned that model
    itself, which then read as never wrapped. Unwrapped without the compiled wrapper it
    changes nothing."""
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    inner: Any = model
    while True:  # torch.compile's OptimizedModule, or accelerate's regional compile
        if isinstance(inner, torch._dynamo.eval_frame.OptimizedModule):
            inner = inner._orig_mod
        elif "_orig_mod" in vars(inner):
            inner = vars(inner)["_orig_mod"]
        else:
            return bare is not inner


def _data_groups(sp: SequenceParallel, world: int) -> tuple[int, int, tuple[int, ...]]:
    """(dp, this rank's group index, each group's first global rank) from every rank's
    group (a collective over the world); ValueError on every rank unless the groups split
    the world into groups of one size."""
    mine = tuple(sp.communicator.global_ranks)
    every = get_communicator(None).all_gather_object(mine, what="the sequence-parallel groups")
    groups = sorted(set(every), key=min)
    sizes = {len(g) for g in groups}
    covered = sorted(r for g in groups for r in g)
    if len(sizes) != 1 or covered != list(range(world)):
        raise ValueError(
            "sequence_parallel's groups must split the world into groups of one size; got "
            f"{every} by rank"
        )
    return len(groups), groups.index(mine), tuple(g[0] for g in groups)


def _same_batch(sp: SequenceParallel, inputs: dict[str, Any]) -> dict[str, Any]:
    """``{"input_ids", "labels"}`` of compute_loss's ``inputs`` (labels: the ids when none);
    on every rank of the group at once, NotImplementedError for other inputs or a padding
    mask, ValueError unless each rank holds the same tensors (Note [Data over the groups]):
    names, shapes, dtypes and a digest of the values, in the group's rank agreement."""

    def validate() -> tuple[dict[str, Any], dict[str, Any]]:
        extra = sorted(set(inputs) - _INPUTS)
        if extra or "input_ids" not in inputs:
            raise NotImplementedError(
                "SequenceParallelTrainer takes input_ids, labels and attention_mask; got "
                f"{sorted(inputs)}"
            )
        refuse_padding(inputs.get("attention_mask"), PADDING_HINT)
        ids, labels = inputs["input_ids"], inputs.get("labels")
        batch = {"input_ids": ids, "labels": ids if labels is None else labels}
        signature: dict[str, Any] = {"batch names": sorted(batch)}
        for name, t in sorted(batch.items()):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"batch[{name!r}] must be a tensor; got {type(t).__name__}")
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            digest = hashlib.blake2b(raw.tobytes(), digest_size=16).hexdigest()
            signature[f"batch[{name!r}] ({_SAME_BATCH})"] = (tuple(t.shape), str(t.dtype), digest)
        return batch, signature

    return sp.communicator.agreed(validate, what="SequenceParallelTrainer batch")


_SAME_BATCH = (
    "every rank of a sequence-parallel group must be given the same batch: a data loader that "
    "deals batches to each rank, not to the data-parallel groups?"
)
