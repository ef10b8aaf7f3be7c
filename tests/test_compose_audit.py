"""tokenring inside PyTorch's own parallel training: DDP and FSDP2 over a 2-D ("dp", "sp") or
("sp", "dp") mesh of 4 CPU ranks, against the same model in one process on the full batch.

One launch. Every case trains two SGD steps (float64) and checks each rank's losses and its
parameters after the steps against this process (1e-10):

(a) a block of our own: a qkv projection, ``tokenring.SequenceParallelAttention`` on the sp
    group, an output projection; one process runs it with ``F.scaled_dot_product_attention``
    - DDP over all ranks (``static_graph``, activation checkpointing), the gradient scaled
      by sp as ``hf.data_parallel_loss`` scales it;
    - DDP with ``find_unused_parameters`` and two accumulated micro-batches, the first under
      ``no_sync()``;
    - DDP over the dp group alone, the sp sum by ``hf.all_reduce_gradients`` of the wrapped
      block (before, ``check_model`` refused a model whose attention is a
      ``SequenceParallelAttention``, saying its attention would see this rank's shard
      alone); the replicas run different strategies on groups built differently
      (``dist.new_group`` for one, the mesh's slice for the other: they never talk); an EMA
      copy (``AveragedModel``: a deepcopy) attends over the same group (before: "cannot
      pickle 'ProcessGroup' object");
    - FSDP2 (``fully_shard``, which runs on CPU and gloo in torch 2.13) as HSDP over the 2-D
      mesh;
    - ``torch.compile`` of the DDP-wrapped block. The defect: ``SequenceParallelAttention``
      remembered a ProcessGroup for its compiled forward but not a 1-D DeviceMesh's group,
      so ``group=mesh["sp"]`` compiled to "process group '100' is not known to tokenring"
      (the README says passing the group to the module is enough);
    - ranks of one sp group passing different strategies raise on every rank at once;
(b) a tiny float64 transformers Llama with ``attn_implementation="tokenring"`` and
    ``hf.shard_batch`` / ``causal_lm_loss``, one process running it with SDPA:
    - DDP over all ranks with ``hf.data_parallel_loss``;
    - FSDP2 over all 4 ranks with gradient checkpointing and ``hf.data_parallel_loss``; then
      ``hf.all_reduce_gradients`` of its DTensor gradients (sharded over the sp ranks too)
      raises ValueError on every rank, naming the parameter and the cure;
    - FSDP2 over the dp ranks alone, the sp sum by ``hf.all_reduce_gradients``. The defect:
      the DTensor gradients reached the group's all-reduce, which raised "Operator
      c10d.allreduce_.default does not have a sharding strategy registered"; now their
      local shards (the same rows on every rank of a group) are summed.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

import tokenring
from oracle import owned_positions

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from tokenring import hf  # noqa: E402

DP, SP = 2, 2
S, B = 16, 2  # global sequence; rows per dp replica (the full batch: DP * B rows)
E, H, D = 16, 4, 4  # the block's width, heads, head dim
VOCAB = 32
LR = 0.5
STEPS = 2
FP64 = 1e-10


# -- (a) a block of our own ------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.attn = attn
        self.out = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D).unbind(2)  # (b, s, H, D) each
        return self.out(self.attn(q, k, v).reshape(b, s, E))


class CausalAttention(nn.Module):
    """One process: float64 causal attention over the whole sequence."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def block_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: v.double() for k, v in Block(CausalAttention()).state_dict().items()}


def block_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    shape = (DP * B, S, E)
    return [
        tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))  # type: ignore[misc]
        for _ in range(STEPS)
    ]


def sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)
            p.grad = None


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP's DTensors gathered), under the plain model's names."""
    state = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        state[name.replace("_orig_mod.", "").replace("module.", "")] = value.detach().clone()
    return state


def block_oracle() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = Block(CausalAttention()).double()
    model.load_state_dict(block_state())
    losses = []
    for x, target in block_data():
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        sgd(model)
    return losses, full_state(model)


def block_case(
    mesh_order: tuple[str, str],
    wrap: str,
    *,
    strategy: str = "token_ring",
    checkpointed: bool = False,
    accumulate: bool = False,
    compiled: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(
        "cpu", (DP, SP) if mesh_order[0] == "dp" else (SP, DP), mesh_dim_names=mesh_order
    )
    dp_rank, sp_rank = mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
    group: Any = mesh["sp"]
    if wrap == "ddp_dp":  # the replicas' groups built differently, their strategies differ
        every = mesh.mesh.movedim(mesh_order.index("sp"), -1).reshape(-1, SP).tolist()
        made = [dist.new_group(ranks) for ranks in every]  # a collective: every rank makes all
        if dp_rank == 0:
            group = made[every.index(mesh["sp"].mesh.tolist())]
        strategy = ("ulysses", "bidir_ring")[dp_rank]
    attn = tokenring.SequenceParallelAttention(
        strategy=strategy, causal=True, layout="zigzag", group=group
    )
    block = Block(attn).double()
    block.load_state_dict(block_state())
    model: Any = block
    scale = SP  # what data_parallel_loss does: DDP and FSDP over all N ranks average
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(block, static_graph=True)
    elif wrap == "ddp_unused":
        model = nn.parallel.DistributedDataParallel(block, find_unused_parameters=True)
    elif wrap == "ddp_dp":
        model = nn.parallel.DistributedDataParallel(block, process_group=mesh["dp"].get_group())
        scale = 1
    elif wrap == "hsdp":
        fully_shard(block, mesh=mesh[mesh_order])
    else:
        raise AssertionError(wrap)
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        def forward(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(model, x, use_reentrant=False)  # type: ignore[no-any-return]

    if compiled:  # backend "eager": the group is named when dynamo traces the operator
        forward = torch.compile(model, backend="eager")
    rows = owned_positions("zigzag", sp_rank, SP, S)
    mine = slice(dp_rank * B, (dp_rank + 1) * B)
    losses = []
    for x, target in block_data():
        x, target = x[mine][:, rows], target[mine][:, rows]  # (B, s, E)
        micro = [slice(0, 1), slice(1, 2)] if accumulate else [slice(0, B)]
        share = torch.zeros((), dtype=torch.float64)
        for i, rows_i in enumerate(micro):
            first = accumulate and i == 0
            with model.no_sync() if first else contextlib.nullcontext():
                part = ((forward(x[rows_i]) - target[rows_i]) ** 2).sum() / (B * S * E)
                (scale * part).backward()
            share += part.detach()
        if wrap == "ddp_dp":  # the DDP-wrapped block: check_model finds its attention
            hf.all_reduce_gradients(hf.SequenceParallel(group=group), model)
        dist.all_reduce(share)  # every rank's share: DP times the mean over the replicas
        losses.append(share.item() / DP)
        sgd(block)
    if wrap == "ddp_dp":  # an EMA copy attends over the same group (a ProcessGroup on dp 0)
        ema = AveragedModel(block)
        assert ema.module.attn.group is group
        x = block_data()[0][0][mine][:, rows]
        torch.testing.assert_close(ema(x), block(x), rtol=0, atol=0)
    return losses, full_state(block)


def strategies_differ_within_sp() -> str:
    """Ranks of one sp group pass different strategies: raises on every rank at once."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, SP), mesh_dim_names=("dp", "sp"))
    strategy = ("token_ring", "ring")[mesh["sp"].get_local_rank()]
    attn = tokenring.SequenceParallelAttention(
        strategy=strategy, causal=True, layout="zigzag", group=mesh["sp"]
    )
    model = nn.parallel.DistributedDataParallel(Block(attn).double())
    x = torch.randn(B, S // SP, E, dtype=torch.float64)
    start = time.monotonic()
    with pytest.raises(ValueError, match="strategy: rank 0 has token_ring, rank 1 has ring"):
        model(x)
    return f"{time.monotonic() - start:.2f}"


# -- (b) a transformers Llama ----------------------------------------------------------------


def llama_config() -> Any:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )


def llama_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(llama_config())
    return {k: v.double() for k, v in model.state_dict().items()}


def build_llama(attn_implementation: str) -> Any:
    model = AutoModelForCausalLM.from_config(
        llama_config(), attn_implementation=attn_implementation
    )
    model.load_state_dict(llama_state())
    return model.double()


def llama_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (DP * B, S), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100  # the same count per row, unevenly over the zigzag shards
        out.append((ids, labels))
    return out


def llama_oracle() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_llama("sdpa")
    losses = []
    for ids, labels in llama_data():
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        losses.append(loss.item())
        sgd(model)
    return losses, full_state(model)


def llama_case(
    mesh_order: tuple[str, str], wrap: str
) -> tuple[list[float], dict[str, torch.Tensor], str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hf.register()
    mesh = init_device_mesh(
        "cpu", (DP, SP) if mesh_order[0] == "dp" else (SP, DP), mesh_dim_names=mesh_order
    )
    sp = hf.SequenceParallel(group=mesh["sp"], layout="zigzag")
    dp_rank = mesh["dp"].get_local_rank()
    llama = build_llama("tokenring")
    model: Any = llama
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(llama)
    elif wrap == "fsdp_all":  # FSDP over all N ranks (a 1-D mesh of the world)
        llama.gradient_checkpointing_enable({"use_reentrant": False})
        world = init_device_mesh("cpu", (DP * SP,))
        for layer in llama.model.layers:
            fully_shard(layer, mesh=world)
        fully_shard(llama, mesh=world)
    elif wrap == "fsdp_dp":
        fully_shard(llama, mesh=mesh["dp"])
    else:
        raise AssertionError(wrap)
    losses, refused = [], ""
    for step, (ids, labels) in enumerate(llama_data()):
        mine = slice(dp_rank * B, (dp_rank + 1) * B)
        local = hf.shard_batch(sp, ids[mine], labels[mine])
        logits = model(
            input_ids=local.input_ids,
            position_ids=local.position_ids,
            sequence_parallel=sp,
            use_cache=False,
        ).logits
        assert local.shift_labels is not None
        loss = hf.causal_lm_loss(sp, logits, local.shift_labels)
        if wrap == "fsdp_dp":
            loss.backward()
            hf.all_reduce_gradients(sp, model)
        else:
            hf.data_parallel_loss(sp, loss).backward()
        if wrap == "fsdp_all" and step == STEPS - 1:  # its gradients are sharded over sp too
            with pytest.raises(ValueError, match="data_parallel_loss") as info:
                hf.all_reduce_gradients(sp, model)
            refused = str(info.value)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / (DP * SP))
        sgd(llama)
    return losses, full_state(llama), refused


# -- the launch ------------------------------------------------------------------------------

BLOCK_CASES: dict[str, dict[str, Any]] = {
    "DDP static_graph, checkpointed, (dp, sp)": dict(
        mesh_order=("dp", "sp"), wrap="ddp", checkpointed=True
    ),
    "DDP find_unused, no_sync accumulation, ring, (sp, dp)": dict(
        mesh_order=("sp", "dp"), wrap="ddp_unused", accumulate=True, strategy="ring"
    ),
    "DDP over dp + all_reduce_gradients, new_group vs mesh, ulysses | bidir_ring, (sp, dp)": dict(
        mesh_order=("sp", "dp"), wrap="ddp_dp"
    ),
    "FSDP2 HSDP on the 2-D mesh, allgather_kv, (dp, sp)": dict(
        mesh_order=("dp", "sp"), wrap="hsdp", strategy="allgather_kv"
    ),
    "torch.compile(DDP), mesh['sp'] given to the module, (dp, sp)": dict(
        mesh_order=("dp", "sp"), wrap="ddp", compiled=True
    ),
}
LLAMA_CASES: dict[str, tuple[tuple[str, str], str]] = {
    "Llama, DDP, (dp, sp)": (("dp", "sp"), "ddp"),
    "Llama, FSDP2 over every rank, checkpointed, (sp, dp)": (("sp", "dp"), "fsdp_all"),
    "Llama, FSDP2 over dp + all_reduce_gradients, (dp, sp)": (("dp", "sp"), "fsdp_dp"),
}


def run_rank() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in BLOCK_CASES.items():
        try:
            results[name] = block_case(**case)
        except Exception:
            results[name] = traceback.format_exc()
    for name, (order, wrap) in LLAMA_CASES.items():
        try:
            results[name] = llama_case(order, wrap)
        except Exception:
            results[name] = traceback.format_exc()
    results["within sp"] = strategies_differ_within_sp()
    return results


def test_ddp_and_fsdp_over_a_2d_mesh_match_one_process() -> None:
    per_rank = tokenring.launch(run_rank, world_size=DP * SP, timeout_s=300)
    oracles = {"block": block_oracle(), "llama": llama_oracle()}
    worst: dict[str, float] = {}
    for rank, results in enumerate(per_rank):
        for name in [*BLOCK_CASES, *LLAMA_CASES]:
            got = results[name]
            assert not isinstance(got, str), f"rank {rank}, {name}:\n{got}"
            want_losses, want_state = oracles["llama" if name in LLAMA_CASES else "block"]
            losses, state = got[:2]
            errors = [abs(a - b) for a, b in zip(losses, want_losses, strict=True)]
            errors += [(state[k] - v).abs().max().item() for k, v in want_state.items()]
            assert max(errors) <= FP64, (rank, name, max(errors))
            worst[name] = max(worst.get(name, 0.0), max(errors))
        refused = results["Llama, FSDP2 over every rank, checkpointed, (sp, dp)"][2]
        assert "model.embed_tokens.weight is a DTensor over global ranks [0, 1, 2, 3]" in refused
        # every rank of each group raised at once (a hang would wait out the 300 s timeout)
        assert float(results["within sp"]) < 10, results["within sp"]
    print(worst)
