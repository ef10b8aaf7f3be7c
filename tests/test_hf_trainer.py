"""tokenring.hf.trainer.SequenceParallelTrainer on 4 gloo ranks as 2 (dp) x 2 (sp), against
one process on the full batch.

One launch. Each rank trains the same float64 Llama for two SGD steps with the Hugging Face
``Trainer`` (DDP over the 4 ranks); the sequence-parallel groups are the ``"sp"`` dimension of
a 2-D ``DeviceMesh``. The ranks record the batch their group's first rank loaded, the
gradients after DDP (before the optimizer step) and the loss the Trainer logs; both ranks of
a group load the same batches (the data is dealt over the groups). This process
runs the same model with transformers' SDPA on the full batch of each step (both groups'
sequences), takes the token mean of the cross-entropy with its own shift, and makes the same
SGD step. Every sequence has the same number of counted labels, so the mean over the groups
is the full batch's token mean.

Also here: every strategy takes a slice of a larger mesh (a 1-D ``DeviceMesh`` dimension, or
its process group; the hybrid a 2-D sub-mesh of a 3-D one), checked against the float64
oracle.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from oracle import full_attention, owned_positions

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
pytest.importorskip(
    "accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)"
)
from transformers import (  # noqa: E402
    TrainerCallback,
    TrainingArguments,
)

from tiny_llama import llama_config, model_of, perturbed_state, sgd_args  # noqa: E402
from tokenring import hf  # noqa: E402

VOCAB = 64
SEQ_LEN = 16
NUM_SEQS = 8  # two steps: 2 groups x 2 per device (both ranks of a group load the same)
PER_DEVICE = 2
STEPS = 2
LR = 0.5
IGNORE = -100
FP64 = 1e-10


MODEL_CONFIG = llama_config(VOCAB, hidden=32, layers=2, heads=4, kv_heads=2)


def initial_state() -> dict[str, torch.Tensor]:
    return perturbed_state(MODEL_CONFIG, seed=3, scale=0.1)


def build_model(state: dict[str, torch.Tensor], attn: str) -> Any:
    return model_of(MODEL_CONFIG, state, attn)


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(2 * NUM_SEQS):
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=gen)
        labels = ids.clone()
        labels[:3] = IGNORE  # the same count per sequence, unevenly over the zigzag shards
        rows.append({"input_ids": ids, "labels": labels})
    return rows


# -- inside the ranks ----------------------------------------------------------------------


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.logged: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logged.append(float(logs["loss"]))


def run_trainer(state: dict[str, torch.Tensor], data: list[dict[str, torch.Tensor]]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from tokenring.hf.trainer import SequenceParallelTrainer

    seen: list[torch.Tensor] = []

    class RecordingTrainer(SequenceParallelTrainer):
        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kw: Any) -> Any:
            seen.append(inputs["input_ids"].clone())  # what this rank's loader gave it
            return super().compute_loss(model, inputs, *args, **kw)

    # what torchrun sets, and accelerate reads (the process group is already up)
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    hf.register()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp = hf.SequenceParallel(group=mesh["sp"])
    model = build_model(state, "tokenring")
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as out:
        args = sgd_args(
            out, per_device_train_batch_size=PER_DEVICE, max_steps=STEPS, learning_rate=LR
        )
        trainer = RecordingTrainer(
            model=model,
            args=args,
            train_dataset=data,
            sequence_parallel=sp,
            callbacks=[recorder],
        )
        trainer.train()
        # what the Trainer would do besides the causal-LM loss raises, not dropped silently
        smoothing = TrainingArguments(**{**args.to_dict(), "label_smoothing_factor": 0.1})
        for extra, what in (
            ({"args": smoothing}, "label smoothing"),
            ({"args": args, "compute_loss_func": lambda *a, **k: 0.0}, "compute_loss_func"),
            ({"args": args, "compute_metrics": lambda p: {}}, "compute_metrics"),
        ):
            with pytest.raises(NotImplementedError, match=what):
                SequenceParallelTrainer(
                    model=model, train_dataset=data, sequence_parallel=sp, **extra
                )
    # a rank that passes something else: every rank of its group raises, naming it
    odd = mesh["sp"].get_local_rank() == 1
    bad: dict[str, Any] = {"input_ids": [1] if odd else torch.zeros(1)}
    with pytest.raises(ValueError, match=r"rank 1: batch\['input_ids'\] must be a tensor"):
        hf.broadcast_batch(sp, bad)
    with pytest.raises(ValueError, match="every rank must give the same batch names"):
        hf.broadcast_batch(sp, {f"ids{dist.get_rank()}": torch.zeros(1)})
    return {
        "seen": seen,
        "grads": recorder.grads,
        "logged": recorder.logged,
        "accelerate": accelerate_step(state, data, sp),
        "slices": strategies_on_mesh_slices(),
    }


def accelerate_step(
    state: dict[str, torch.Tensor], data: list[dict[str, torch.Tensor]], sp: hf.SequenceParallel
) -> dict[str, Any]:
    """One backward in a plain accelerate loop: rank r loads rows [2r, 2r + 2) of the data,
    its group takes its first rank's."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(build_model(state, "tokenring"))
    rows = data[PER_DEVICE * dist.get_rank() : PER_DEVICE * (dist.get_rank() + 1)]
    mine = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")}
    batch = hf.broadcast_batch(sp, mine)
    local = hf.shard_batch(sp, batch["input_ids"], batch["labels"])
    logits = model(
        input_ids=local.input_ids,
        position_ids=local.position_ids,
        sequence_parallel=sp,
        use_cache=False,
    ).logits
    assert local.shift_labels is not None
    loss = hf.causal_lm_loss(sp, logits, local.shift_labels)
    accelerator.backward(hf.data_parallel_loss(sp, loss))
    named = accelerator.unwrap_model(model).named_parameters()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in named}}


def strategies_on_mesh_slices() -> dict[str, float]:
    """Every 1-D strategy on mesh["sp"] and on its process group, the hybrid on a 2-D
    sub-mesh of a 3-D mesh: max |error| against the float64 oracle per case."""
    from torch.distributed.device_mesh import init_device_mesh

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 8, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want, _ = full_attention(q, k, v, causal=True, scale=8**-0.5)  # (B, S, H, D)
    errors: dict[str, float] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp_rank = mesh["sp"].get_local_rank()
    rows = owned_positions("zigzag", sp_rank, 2, 8)
    local = [x[:, rows] for x in (q, k, v)]
    for strategy in tokenring.Strategy:
        if strategy is tokenring.Strategy.HYBRID:
            continue
        for kind, group in (("mesh", mesh["sp"]), ("group", mesh["sp"].get_group())):
            out = tokenring.sequence_parallel_attn(
                *local, strategy=strategy, causal=True, layout="zigzag", group=group
            )
            errors[f"{strategy.value} on {kind}"] = (out - want[:, rows]).abs().max().item()
    for shape in ((2, 1, 2), (2, 2, 1)):  # (dp, outer, inner)
        mesh3 = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "outer", "inner"))
        hybrid = tokenring.HybridMesh.from_device_mesh(mesh3["outer", "inner"])
        where = {
            "outer_rank": mesh3["outer"].get_local_rank(),
            "inner_rank": mesh3["inner"].get_local_rank(),
            "outer": shape[1],
            "inner": shape[2],
            "layout": "zigzag",
        }
        # the hybrid's own layout (its tests check it against the oracle's positions)
        local3 = [tokenring.hybrid_shard(x, **where) for x in (q, k, v)]
        out = tokenring.hybrid_attn(*local3, mesh=hybrid, causal=True, layout="zigzag")
        mine = tokenring.hybrid_shard(want, **where)
        errors[f"hybrid {shape[1]}x{shape[2]} of dp={shape[0]}"] = (out - mine).abs().max().item()
    return errors


# -- the one-process reference ---------------------------------------------------------------


def reference(
    state: dict[str, torch.Tensor], batches: list[torch.Tensor], labels: list[torch.Tensor]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = build_model(state, "sdpa")
    losses, grads = [], []
    for input_ids, label_ids in zip(batches, labels, strict=True):
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), label_ids[:, 1:].reshape(-1), ignore_index=IGNORE
        )
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
    return losses, grads


def test_trainer_dp_by_sp_matches_one_process() -> None:
    state = initial_state()
    data = dataset()
    per_rank = tokenring.launch(run_trainer, state, data, world_size=4, timeout_s=400)
    # mesh ("dp", "sp") of 4 ranks: the groups are {0, 1} and {2, 3}; each group's ranks loaded
    # the same batches, and the groups' batches of the two steps are 8 distinct rows (the data
    # is dealt over the 2 groups: no row twice before the epoch is through)
    for step in range(STEPS):
        assert torch.equal(per_rank[0]["seen"][step], per_rank[1]["seen"][step]), step
        assert torch.equal(per_rank[2]["seen"][step], per_rank[3]["seen"][step]), step
    loaded = {tuple(row.tolist()) for r in (0, 2) for b in per_rank[r]["seen"] for row in b}
    assert len(loaded) == STEPS * 2 * PER_DEVICE, len(loaded)
    by_ids = {tuple(row["input_ids"].tolist()): row["labels"] for row in data}
    batches, labels = [], []
    for step in range(STEPS):
        ids = torch.cat([per_rank[0]["seen"][step], per_rank[2]["seen"][step]])  # (4, S)
        batches.append(ids)
        labels.append(torch.stack([by_ids[tuple(row.tolist())] for row in ids]))
    # the two groups trained on different sequences (data parallelism did its part)
    assert not torch.equal(per_rank[0]["seen"][0], per_rank[2]["seen"][0])
    want_losses, want_grads = reference(state, batches, labels)
    # accelerate: the groups' first ranks loaded rows 0-1 and 4-5
    used = (0, 1, 4, 5)
    want_accelerate_loss, want_accelerate_grads = reference(
        state,
        [torch.stack([data[i]["input_ids"] for i in used])],
        [torch.stack([data[i]["labels"] for i in used])],
    )
    group_losses = [per_rank[r]["accelerate"]["loss"] for r in (0, 2)]
    assert abs(sum(group_losses) / 2 - want_accelerate_loss[0]) <= FP64, group_losses
    worst = dict.fromkeys(("trainer grads", "accelerate grads", "mesh slices"), 0.0)
    for rank, res in enumerate(per_rank):
        assert len(res["logged"]) == STEPS and len(res["grads"]) == STEPS, rank
        for step in range(STEPS):
            # the Trainer logs a float32 value; a factor of the world or group size would be
            # far outside
            assert res["logged"][step] == pytest.approx(want_losses[step], rel=1e-6), (
                rank,
                step,
                res["logged"],
                want_losses,
            )
            for name, g in want_grads[step].items():
                err = (res["grads"][step][name] - g).abs().max().item()
                assert err <= FP64, (rank, step, name, err)
                worst["trainer grads"] = max(worst["trainer grads"], err)
        for name, g in want_accelerate_grads[0].items():
            err = (res["accelerate"]["grads"][name] - g).abs().max().item()
            assert err <= FP64, (rank, "accelerate", name, err)
            worst["accelerate grads"] = max(worst["accelerate grads"], err)
        for case, err in res["slices"].items():
            assert err <= FP64, (rank, case, err)
            worst["mesh slices"] = max(worst["mesh slices"], err)
    print(f"2 (dp) x 2 (sp): logged losses {per_rank[0]['logged']} vs {want_losses}; {worst}")
