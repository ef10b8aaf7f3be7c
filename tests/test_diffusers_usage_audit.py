"""diffusers' Flux driven as a diffusers user drives it, on 2 gloo ranks, against one process.

One launch. Inside the ranks a tiny random float64 ``FluxTransformer2DModel`` (two blocks of
each kind) with ``FluxSequenceParallelProcessor``:

- diffusers' ``FirstBlockCache`` hook, whose skip decision each rank takes from its own image
  tokens: a rank that skipped the remaining blocks went on to the next step's first block, and
  its attention exchanged with the other rank's second block (the same kind of block, the same
  shapes) without an error: numbers that match no model, until a joint block met a
  single-stream one ("block: rank 0 has joint, rank 1 has single-stream", which names no
  cause). Now every rank raises at the first layer the ranks differ in, naming the layer;
- a rank whose model was built from another seed (other weights): each rank attended with its
  own projections, no error; now every rank raises naming the layer's weights;
- what held, checked against one process (float64, within 1e-10; gradients rtol 1e-6, as in
  tests/test_diffusers_audit.py): guidance embeddings with one text token and batch 2 (another
  prompt per row, text replicated), and training a subset of the parameters (LoRA-like) with
  gradient checkpointing and sharded text.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tokenring

pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

import tiny_flux
from tiny_flux import IMAGE, TEXT, WORLD_SIZE, build_model, local_inputs, rows
from tokenring import diffusers as tr_diffusers


def model_inputs(num_text: int = TEXT) -> dict[str, torch.Tensor]:
    """tiny_flux's inputs with guidance and loss weights (B, S, 4)."""
    return tiny_flux.model_inputs(guidance=True, num_text=num_text, weight=True)


def first_block_cache(comm: tokenring.Communicator) -> list[str]:
    """Three steps under FirstBlockCache (threshold 0.02): rank 0's image stays the same (its
    first block's residual moves by rank 1's tokens alone: below the threshold, it skips the
    rest), rank 1's moves by 0.05 a step (above: it computes them). What each step did."""
    model = build_model()
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.02))
    inputs = model_inputs()
    del inputs["weight"], inputs["guidance"]
    mine = local_inputs(inputs, comm.rank, "sharded")
    log = []
    with torch.no_grad(), model.cache_context("cond"):
        for step in range(3):
            if comm.rank == 1:
                mine["hidden_states"] = mine["hidden_states"] + 0.05 * step
            try:
                model(**mine, joint_attention_kwargs={"text_seq_len": TEXT})
            except ValueError as exc:
                return [*log, str(exc)]
            log.append("ran")
    return log


def other_seed(comm: tokenring.Communicator) -> str:
    """Rank 1's model built from another seed."""
    model = build_model(seed=comm.rank)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    inputs = model_inputs()
    del inputs["weight"], inputs["guidance"]
    with torch.no_grad(), pytest.raises(ValueError) as info:
        model(**local_inputs(inputs, comm.rank, "sharded"))
    return str(info.value)


def trainable(name: str) -> bool:
    return "to_q" in name or "add_k_proj" in name or "proj_mlp" in name


def guidance_one_token(comm: tokenring.Communicator) -> torch.Tensor:
    model = build_model(guidance=True)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    inputs = model_inputs(num_text=1)
    del inputs["weight"]
    with torch.no_grad():
        out = model(
            **local_inputs(inputs, comm.rank, "replicated"),
            joint_attention_kwargs={"text_seq_len": 1},
        ).sample  # (B, s, 4)
    return torch.cat(comm.all_gather(out.contiguous(), label="test output"), dim=1)


def lora_like_checkpointed(comm: tokenring.Communicator) -> dict[str, torch.Tensor]:
    """A subset of the parameters trained, gradient checkpointing on, text sharded: the
    gradients summed over the ranks."""
    model = build_model()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    model.enable_gradient_checkpointing()
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    inputs = model_inputs()
    weight = inputs.pop("weight")[:, rows(IMAGE, comm.rank, WORLD_SIZE)]
    del inputs["guidance"]
    out = model(**local_inputs(inputs, comm.rank, "sharded")).sample
    (out * weight).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        comm.all_reduce(g, label="test gradients").wait()
    return grads


def run_ranks() -> dict[str, Any]:
    comm = tokenring.get_communicator()
    return {
        "first block cache": first_block_cache(comm),
        "other seed": other_seed(comm),
        "guidance, T=1": guidance_one_token(comm),
        "lora-like": lora_like_checkpointed(comm),
    }


def test_diffusers_usage() -> None:
    per_rank = tokenring.launch(run_ranks, world_size=WORLD_SIZE, timeout_s=120)
    layer = "ranks disagree on this Flux attention layer: layer (the signs of its query projection"
    for rank, got in enumerate(per_rank):
        log = got["first block cache"]
        # step 0 runs everywhere; step 1: rank 0 skips after the first block, so the ranks
        # meet at different layers, and both raise there
        assert log[:-1] == ["ran"] * (2 - rank), (rank, log)
        assert layer in log[-1] and "FirstBlockCache" in log[-1], (rank, log)
        assert layer in got["other seed"], (rank, got["other seed"])
        assert "rank 0 has 0x" in got["other seed"], got["other seed"]
    got = per_rank[0]
    model = build_model(guidance=True)
    inputs = model_inputs(num_text=1)
    del inputs["weight"]
    with torch.no_grad():
        want = model(**inputs).sample
    torch.testing.assert_close(got["guidance, T=1"], want, rtol=0, atol=1e-10)
    model = build_model()
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    inputs = model_inputs()
    weight = inputs.pop("weight")
    del inputs["guidance"]
    (model(**inputs).sample * weight).sum().backward()
    want_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got["lora-like"].keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got["lora-like"][name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_layer_signs_are_read_once_per_version_of_the_weight() -> None:
    """The layer check's signs are read from the weight once per version of it (on a GPU the
    read synchronises): an in-place update (an optimizer step) is read again, another weight
    too; the value is the signs of the query projection's first 32 weights."""
    torch.manual_seed(0)
    attn = torch.nn.Module()
    attn.to_q = torch.nn.Linear(40, 8)
    weight = attn.to_q.weight

    def want() -> str:
        return hex(sum(int(w > 0) << i for i, w in enumerate(weight[0, :32].tolist())))

    first = tr_diffusers._layer_signs(attn)
    assert first == want()
    reads = []
    real_tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        if self.dtype == torch.bool:  # the signs (the oracle reads floats)
            reads.append(self.shape)
        return real_tolist(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted)
        assert tr_diffusers._layer_signs(attn) == first and not reads  # cached
        with torch.no_grad():
            weight.neg_()  # a new version
        assert tr_diffusers._layer_signs(attn) == want() != first and len(reads) == 1
        attn.to_q = torch.nn.Linear(40, 8)  # another weight
        weight = attn.to_q.weight
        assert tr_diffusers._layer_signs(attn) == want() and len(reads) == 2
