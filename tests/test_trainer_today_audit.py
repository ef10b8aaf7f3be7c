"""SequenceParallelTrainer against transformers' own Trainer over dp processes, on the options
that rebuild or wrap its loaders (Note [Data over the groups] in tokenring.hf.trainer).

The oracle is transformers' plain ``Trainer`` itself, float64 Llama with sdpa attention, run
over dp data-parallel processes: in one process (dp = 1) and over the 2 ranks of the first
launch (dp = 2). The sequence-parallel trainer runs on 2 ranks (sp = 2, dp = 1) and on 4 ranks
(dp = 2 x sp = 2). Both record the rows of every training micro-batch (process / group g) and
run the same scenarios:

- ``epochs``: 2 epochs over 11 rows (not a multiple of dp x batch), gradient accumulation,
  an evaluation after every step (``eval_strategy="steps"``, 5 rows) and a checkpoint after
  every step; then ``predict`` on 7 rows, with and without ``eval_use_gather_object``;
- ``resume``: a new Trainer resuming from the first checkpoint (mid-epoch): the micro-batches
  after it are those of the uninterrupted run, and so are its parameters;
- ``lengths``: ``dataloader_drop_last``, ``group_by_length`` and ``data_seed``.

Each group's micro-batches must be the plain Trainer's process g's, the parameters, the eval
losses during training and the test losses equal (float64: 1e-9).
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
pytest.importorskip(
    "accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)"
)
from transformers import Trainer  # noqa: E402

from tiny_llama import labelled_rows, llama_config, model_of, perturbed_state, sgd_args  # noqa: E402
from tokenring import hf  # noqa: E402

VOCAB = 32
SEQ_LEN = 8
SP = 2
TOL = 1e-6  # transformers computes the oracle's loss in float32 (ForCausalLMLoss upcasts)


MODEL_CONFIG = llama_config(VOCAB)


def initial_state() -> dict[str, torch.Tensor]:
    return perturbed_state(MODEL_CONFIG, seed=3, scale=0.2)


def build_model(state: dict[str, torch.Tensor], attn: str) -> Any:
    return model_of(MODEL_CONFIG, state, attn)


def rows(num_rows: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return labelled_rows(num_rows, seed, vocab=VOCAB, seq_len=SEQ_LEN)


TRAIN, EVAL, TEST = rows(11, 1), rows(5, 2), rows(7, 3)


def make_args(out_dir: str, **kw: Any) -> Any:
    base: dict[str, Any] = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2)
    base |= dict(gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=0.5)
    return sgd_args(out_dir, **(base | kw))


def scenarios(state: dict[str, torch.Tensor], sp: Any) -> dict[str, Any]:
    """The scenarios with the plain Trainer (sp None) or the sequence-parallel one."""
    seen: list[list[int]] = []
    if sp is None:
        base: Any = Trainer
        attn, extra = "sdpa", {}
    else:
        from tokenring.hf.trainer import SequenceParallelTrainer

        base, attn, extra = SequenceParallelTrainer, "tokenring", {"sequence_parallel": sp}

    class Recording(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            if model.training:
                seen.append(inputs["input_ids"][:, 0].tolist())
            return super().compute_loss(model, inputs, *a, **kw)

    def params(trainer: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if dist.is_initialized():  # one directory for every rank (the checkpoints)
            box = [tmp]
            dist.broadcast_object_list(box, src=0)
            run_dir = os.path.join(box[0], "run")
        else:
            run_dir = os.path.join(tmp, "run")
        args = make_args(
            run_dir, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1
        )
        trainer = Recording(
            model=build_model(state, attn),
            args=args,
            train_dataset=TRAIN,
            eval_dataset=EVAL,
            **extra,
        )
        trainer.train()
        out["epochs seen"] = list(seen)
        out["epochs params"] = params(trainer)
        history = trainer.state.log_history
        out["epochs eval"] = [h["eval_loss"] for h in history if "eval_loss" in h]
        out["epochs loss"] = [h["loss"] for h in history if "loss" in h]
        out["test"] = trainer.predict(TEST).metrics["test_loss"]
        gather = make_args(run_dir, eval_use_gather_object=True)
        out["test gather_object"] = (
            Recording(model=build_model(state, attn), args=gather, **extra)
            .predict(TEST)
            .metrics["test_loss"]
        )
        seen.clear()
        resumed = Recording(
            model=build_model(state, attn),
            args=args,
            train_dataset=TRAIN,
            eval_dataset=EVAL,
            **extra,
        )
        resumed.train(resume_from_checkpoint=os.path.join(run_dir, "checkpoint-1"))
        out["resume seen"] = list(seen)
        out["resume params"] = params(resumed)
        seen.clear()
        lengths = make_args(
            os.path.join(tmp, "lengths"),
            dataloader_drop_last=True,
            train_sampling_strategy="group_by_length",
            data_seed=7,
            num_train_epochs=1,
        )
        trainer = Recording(
            model=build_model(state, attn), args=lengths, train_dataset=TRAIN, **extra
        )
        trainer.train()
        out["lengths seen"] = list(seen)
        out["lengths params"] = params(trainer)
        if dist.is_initialized():
            dist.barrier()  # rank 0 removes the directory
    return out


def run_ranks(state: dict[str, torch.Tensor], plain: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
    os.environ.update(env, LOCAL_WORLD_SIZE=str(world))
    hf.register()
    mesh = init_device_mesh("cpu", (world // SP, SP), mesh_dim_names=("dp", "sp"))
    out = {"sp": scenarios(state, hf.SequenceParallel(group=mesh["sp"]))}
    if plain:
        out["plain"] = scenarios(state, None)
    return out


def compare(got: dict[str, Any], want: dict[str, Any], label: str) -> dict[str, float]:
    errs: dict[str, float] = {}
    for key, value in want.items():
        name = f"{label} {key}"
        if key.endswith("seen"):
            assert got[key] == value, (name, got[key], value)
        elif key.endswith("params"):
            errs[name] = max((got[key][n] - w).abs().max().item() for n, w in value.items())
        elif isinstance(value, list):
            assert len(got[key]) == len(value), (name, got[key], value)
            errs[name] = max(
                (abs(g / w - 1) for g, w in zip(got[key], value, strict=True)), default=0.0
            )
        else:
            errs[name] = abs(got[key] / value - 1)
    return errs


def test_trainer_matches_plain_trainer_over_dp() -> None:
    state = initial_state()
    from accelerate import PartialState

    one = scenarios(state, None)  # dp = 1: transformers' Trainer in one process
    PartialState._reset_state()
    two = tokenring.launch(run_ranks, state, True, world_size=2, timeout_s=300)
    four = tokenring.launch(run_ranks, state, False, world_size=4, timeout_s=300)
    errs: dict[str, float] = {}
    # the uninterrupted run's micro-batches after the checkpoint, and its parameters
    for rank, res in enumerate(two):
        errs.update(compare(res["sp"], one, f"sp=2 rank {rank}"))
    for rank, res in enumerate(four):
        errs.update(compare(res["sp"], two[rank // SP]["plain"], f"dp=2 x sp=2 rank {rank}"))
    for label, res in (("dp=1", one), ("dp=2 rank 0", two[0]["plain"])):
        after = res["epochs seen"][-len(res["resume seen"]) :]
        assert res["resume seen"] == after, (label, res["resume seen"], after)
        errs.update(
            compare({"params": res["resume params"]}, {"params": res["epochs params"]}, label)
        )
    print("\n".join(f"{k}: {v:.1e}" for k, v in errs.items()))
    assert all(math.isfinite(v) and v <= TOL for v in errs.values()), errs
