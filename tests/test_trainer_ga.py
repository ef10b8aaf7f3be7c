"""tokenring.hf.trainer.SequenceParallelTrainer with gradient accumulation against
transformers' own ``Trainer`` (Note [Trainer ranks and gradient scale], Note [Data over the
groups]).

Micro-batches with -100 prompt masks of different lengths count different numbers of labels,
so a mean of micro-batch means differs from transformers' loss (the summed token loss over
``num_items_in_batch``). Two launches of gloo ranks train a float64 Llama for one SGD step
with ``gradient_accumulation_steps=2``, sequential sampling and three cases:
``average_tokens_across_devices`` True and False, and a model without loss keyword
arguments (transformers then passes no ``num_items_in_batch``: each micro-batch's mean over
the accumulation steps). Each run records the micro-batches its ranks loaded, its parameters
after the step, the loss it logged and ``evaluate``'s loss over an eval set whose last batch
is partial (3 rows on dp = 1, 5 on dp = 2: accelerate pads the last batch and
``gather_for_metrics`` cuts it). The ranks also count a batch without labels (every next
token counts) and one that the first rank alone gives malformed (no count on any rank, so
compute_loss raises on each instead of a rank waiting).

- 2 ranks, sp = 2 (dp = 1): the oracle is transformers' plain ``Trainer`` in this one
  process (SDPA) on the same datasets.
- 4 ranks, dp = 2 x sp = 2: the oracle is transformers' plain ``Trainer`` on 2 processes
  (DDP over gloo, in the 2-rank launch) on the same datasets: transformers' own data
  parallelism (its loaders dealt over the processes, its count gathered over them, its loss
  times the processes, DDP's average, its evaluation gather), nothing rebuilt by hand.

Both ranks of a group load the same micro-batches, those the oracle's process of the same
index loads (the dataset is dealt over the dp groups, not the N ranks).

Float64 weights; transformers' loss is computed in float32 (PARAMS_ATOL says why): the
parameters agree within 1e-6 (2e-8 measured), the logged and ``evaluate``'s loss within a
relative 1e-6.
"""

from __future__ import annotations

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
from transformers import (  # noqa: E402
    Trainer,
    TrainerCallback,
)

from tiny_llama import labelled_rows, llama_config, model_of, perturbed_state, sgd_args  # noqa: E402
from tokenring import hf  # noqa: E402

VOCAB = 32
SEQ_LEN = 8
PER_DEVICE = 2
GA = 2
LR = 0.5
SP = 2
IGNORE = -100
# transformers' ForCausalLMLoss computes the cross-entropy in float32 (logits.float()), so
# the oracle's loss and gradients carry float32 rounding even with float64 weights: about 1e-7
# of the loss, 2e-8 on the parameters after the step. A wrong normalization shows far above:
# a mean of micro-batch means is off by 3e-2 to 1.3e-1 on the parameters here.
PARAMS_ATOL = 1e-6
LOSS_RTOL = 1e-6
CASES = ("tokens averaged", "per device", "no loss kwargs")


MODEL_CONFIG = llama_config(VOCAB)


def initial_state() -> dict[str, torch.Tensor]:
    return perturbed_state(MODEL_CONFIG, seed=7, scale=0.2)


def rows(num_rows: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return labelled_rows(num_rows, seed, vocab=VOCAB, seq_len=SEQ_LEN, numbered=False)


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logged.append(float(logs["loss"]))


def train(
    case: str,
    state: dict[str, torch.Tensor],
    data: list[dict[str, torch.Tensor]],
    eval_data: list[dict[str, torch.Tensor]],
    sp: hf.SequenceParallel | None = None,
) -> dict[str, Any]:
    """One SGD step of transformers' Trainer (sp None) or SequenceParallelTrainer, then
    evaluate: the micro-batches this rank loaded, parameters, logged and evaluation loss."""
    from tokenring.hf.trainer import SequenceParallelTrainer

    seen: dict[str, list[dict[str, torch.Tensor]]] = {"train": [], "eval": []}
    base: type = Trainer if sp is None else SequenceParallelTrainer

    class Recording(base):  # type: ignore[valid-type, misc]
        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            kept = {k: v.clone() for k, v in inputs.items()}  # before any broadcast
            seen["train" if model.training else "eval"].append(kept)
            return super().compute_loss(model, inputs, *a, **kw)

    model = model_of(MODEL_CONFIG, state, "sdpa" if sp is None else "tokenring")
    if case == "no loss kwargs":
        model.accepts_loss_kwargs = False  # transformers then counts no num_items_in_batch
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as out:
        args = sgd_args(
            out,
            per_device_train_batch_size=PER_DEVICE,
            per_device_eval_batch_size=PER_DEVICE,
            gradient_accumulation_steps=GA,
            average_tokens_across_devices=case != "per device",
            train_sampling_strategy="sequential",
            max_steps=1,
            learning_rate=LR,
        )
        extra = {} if sp is None else {"sequence_parallel": sp}
        trainer = Recording(
            model=model, args=args, train_dataset=data, callbacks=[recorder], **extra
        )
        trainer.train()
        eval_loss = trainer.evaluate(eval_data)["eval_loss"]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = {"seen": seen, "params": params, "logged": recorder.logged, "eval": eval_loss}
    if sp is not None and case == "tokens averaged":
        # the count without labels (every next token), and of a malformed batch on the first
        # rank only (None on every rank: compute_loss then raises on each)
        ids = torch.zeros(PER_DEVICE, SEQ_LEN, dtype=torch.long)
        first = sp.communicator.rank == 0
        out["counts"] = [
            trainer._get_num_items_in_batch([{"input_ids": ids}] * GA, args.device),
            trainer._get_num_items_in_batch([{"input_ids": ids[0] if first else ids}], "cpu"),
        ]
    return out


def run_ranks(
    state: dict[str, torch.Tensor],
    data: list[dict[str, torch.Tensor]],
    eval_data: list[dict[str, torch.Tensor]],
    plain: tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] | None = None,
) -> dict[str, Any]:
    """Inside each rank: SequenceParallelTrainer on a (dp, sp) mesh for every case; then,
    given ``plain`` (train and eval rows), transformers' Trainer on these ranks (DDP) for
    every case."""
    from torch.distributed.device_mesh import init_device_mesh

    # what torchrun sets, and accelerate reads (the process group is already up)
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    hf.register()
    mesh = init_device_mesh("cpu", (dist.get_world_size() // SP, SP), mesh_dim_names=("dp", "sp"))
    sp = hf.SequenceParallel(group=mesh["sp"])
    out: dict[str, Any] = {"sp": {case: train(case, state, data, eval_data, sp) for case in CASES}}
    if plain is not None:
        out["plain"] = {case: train(case, state, *plain) for case in CASES}
    return out


def same_batches(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return all(
        torch.equal(g[name], w[name])
        for kind in ("train", "eval")
        for g, w in zip(got["seen"][kind], want["seen"][kind], strict=True)
        for name in ("input_ids", "labels")
    )


def counted(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


def errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Max |parameter difference|, and relative differences of the logged and eval loss."""
    assert len(got["logged"]) == len(want["logged"]) == 1, (got["logged"], want["logged"])
    return {
        "params": max_diff(got["params"], want["params"]),
        "logged": abs(got["logged"][0] / want["logged"][0] - 1),
        "eval": abs(got["eval"] / want["eval"] - 1),
    }


def test_gradient_accumulation_matches_transformers_trainer() -> None:
    state = initial_state()
    # one step: dp groups x PER_DEVICE x GA rows; the eval sets end in a partial batch
    data4, eval4 = rows(2 * PER_DEVICE * GA, 1), rows(5, 2)
    data2, eval2 = rows(PER_DEVICE * GA, 3), rows(3, 4)
    four = tokenring.launch(run_ranks, state, data4, eval4, world_size=4, timeout_s=300)
    # transformers' Trainer on 2 processes over the 4-rank launch's data
    two = tokenring.launch(run_ranks, state, data2, eval2, (data4, eval4), world_size=2)
    one_process = {case: train(case, state, data2, eval2) for case in CASES}
    # mesh ("dp", "sp") of 4 ranks: the groups are {0, 1} and {2, 3}
    groups = [four[0]["sp"][CASES[0]], four[2]["sp"][CASES[0]]]
    first = two[0]["sp"][CASES[0]]

    # the data discriminates: micro-batches and the groups count differently
    def group_count(res: dict[str, Any]) -> int:
        return sum(counted(b) for b in res["seen"]["train"])

    firsts = first["seen"]["train"]
    assert counted(firsts[0]) != counted(firsts[1])
    assert group_count(groups[0]) != group_count(groups[1])

    found: dict[str, dict[str, float]] = {}
    for case in CASES:
        # dp = 1: both ranks loaded the one-process Trainer's batches, the whole eval set
        for rank, res in enumerate(two):
            assert same_batches(res["sp"][case], one_process[case]), (case, rank)
            found[f"sp=2 {case} rank {rank}"] = errors(res["sp"][case], one_process[case])
        eval_rows = sum(len(b["input_ids"]) for b in one_process[case]["seen"]["eval"])
        assert eval_rows == len(eval2)
        # dp = 2: transformers' 2-process Trainer; group d's ranks loaded its rank d's batches
        for d in range(2):
            assert max_diff(two[d]["plain"][case]["params"], two[0]["plain"][case]["params"]) == 0
        for rank, res in enumerate(four):
            assert same_batches(res["sp"][case], two[rank // SP]["plain"][case]), (case, rank)
            found[f"dp=2 x sp=2 {case} rank {rank}"] = errors(
                res["sp"][case], two[0]["plain"][case]
            )
    print("against transformers' Trainer after one step:")
    for label, err in found.items():
        print(f"  {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    assert all(err["params"] <= PARAMS_ATOL for err in found.values()), found
    assert all(err["logged"] <= LOSS_RTOL and err["eval"] <= LOSS_RTOL for err in found.values())
    for world, ranks in ((2, two), (4, four)):
        for res in ranks:
            num_items, malformed = res["sp"][CASES[0]]["counts"]
            assert int(num_items) == world // SP * GA * PER_DEVICE * (SEQ_LEN - 1)
            assert malformed is None
    # the cases differ from each other: a mix-up of the rules would show
    for a, b in ((0, 1), (0, 2), (1, 2)):
        oracle_a, oracle_b = two[0]["plain"][CASES[a]], two[0]["plain"][CASES[b]]
        assert max_diff(oracle_a["params"], oracle_b["params"]) > 1e-4, (CASES[a], CASES[b])
    assert max_diff(one_process[CASES[0]]["params"], one_process[CASES[2]]["params"]) > 1e-4
