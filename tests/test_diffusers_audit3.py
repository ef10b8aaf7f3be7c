"""FluxSequenceParallelProcessor where the model, not one attention layer, is misused: 2 ranks.

One launch. Inside the ranks a tiny random float64 ``FluxTransformer2DModel`` (two blocks of
each kind), against the same model in one process (diffusers' own processor):

- the processor set on some attention layers only (``block.attn.set_processor``): the other
  layers attended to this rank's shard alone, no error (0.10 off the one-process model with
  sharded text; with replicated text a misleading error about the text). Now
  every rank raises at the model call, naming the layers without it; so does a model whose
  processor was replaced on one layer after a call that ran (that call matches one process);
- with ``text="sharded"`` one rank given another ``timestep``, ``guidance`` or
  ``pooled_projections`` than its peers (nothing replicated reaches the attention there): no
  error, 0.67, 0.90 and 0.077 off. Now every rank raises naming the argument (each rides as
  a sketch of its own in the first layer's check); with replicated text too (it raised naming
  the text rows alone);
- every attention layer with the same query-projection weights (LoRA-like frozen copies, or
  zero-initialised layers): the layer check by weight signs saw the same signs at every layer,
  so ranks at different layers (diffusers' FirstBlockCache skipping blocks on one rank only)
  exchanged tokens of different layers, until a joint block met a single-stream one ("block:
  rank 0 has joint, rank 1 has single-stream", naming no cause). Now the layer's name in the
  model rides in the check and every rank raises at the first layer they differ in, naming
  both.
- a forward pre-hook raising on rank 1 alone, between the attention layers: rank 0 waited
  out the timeout in the next layer's check, naming no cause. Now every rank raises at once
  naming it (after the last layer: rank 0 at its next call's first layer).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

import tokenring

pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import tiny_flux
from tiny_flux import TEXT, WORLD_SIZE, build_model, model_inputs
from tokenring import diffusers as tr_diffusers


def local_inputs(inputs: dict[str, Any], rank: int, text: str) -> dict[str, Any]:
    return tiny_flux.local_inputs(inputs, rank, text, text_seq_len=TEXT)


def attempt(comm: tokenring.Communicator, model: Any, mine: dict[str, Any]) -> Any:
    """The gathered output (B, S, 4), or the error's message."""
    try:
        with torch.no_grad():
            out = model(**mine).sample  # (B, s, 4)
    except ValueError as exc:
        return str(exc)
    return torch.cat(comm.all_gather(out.contiguous(), label="test output"), dim=1)


def some_layers(comm: tokenring.Communicator, text: str) -> Any:
    """The processor on the first joint block and the last single-stream block only."""
    model = build_model()
    processor = tr_diffusers.FluxSequenceParallelProcessor(group=comm, text=text)
    model.transformer_blocks[0].attn.set_processor(processor)
    model.single_transformer_blocks[1].attn.set_processor(processor)
    return attempt(comm, model, local_inputs(model_inputs(), comm.rank, text))


def replaced_later(comm: tokenring.Communicator) -> tuple[Any, Any]:
    """On every layer, one call; then diffusers' own processor on one layer again."""
    model = build_model()
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    mine = local_inputs(model_inputs(), comm.rank, "replicated")
    first = attempt(comm, model, mine)
    model.single_transformer_blocks[0].attn.set_processor(FluxAttnProcessor())
    return first, attempt(comm, model, mine)


def other_conditioning(comm: tokenring.Communicator, name: str, text: str) -> Any:
    """Rank 1 given another ``name`` than rank 0."""
    guidance = name == "guidance"
    model = build_model(guidance=guidance)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text=text))
    mine = local_inputs(model_inputs(guidance=guidance), comm.rank, text)
    if comm.rank == 1:
        mine[name] = mine[name] + 0.25
    return attempt(comm, model, mine)


def copied_query_weights(comm: tokenring.Communicator) -> list[str]:
    """Every attention layer's query projection a copy of the first's; FirstBlockCache skips
    the remaining blocks on rank 0 only at the second step (as in
    tests/test_diffusers_usage_audit.py). What each step did."""
    model = build_model()
    layers = [b.attn for b in (*model.transformer_blocks, *model.single_transformer_blocks)]
    with torch.no_grad():
        for attn in layers[1:]:
            attn.to_q.weight.copy_(layers[0].to_q.weight)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.02))
    mine = local_inputs(model_inputs(), comm.rank, "sharded")
    log = []
    with torch.no_grad(), model.cache_context("cond"):
        for step in range(3):
            if comm.rank == 1:
                mine["hidden_states"] = mine["hidden_states"] + 0.05 * step
            try:
                model(**mine)
            except ValueError as exc:
                return [*log, str(exc)]
            log.append("ran")
    return log


FAILED_AT = ("transformer_blocks.1", "single_transformer_blocks.1", "norm_out")
FAST_S = 2.5  # far below the 4 s timeout the failure cases run with


def failed_on_one_rank(comm: tokenring.Communicator, where: str) -> list[tuple[str, float]]:
    """A forward pre-hook on the model's ``where`` raising on rank 1, from the model's second
    call (its first installs the processor's hooks); up to two calls, each one's message (or
    "returned") and time."""
    model = build_model()
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm))
    mine = local_inputs(model_inputs(), comm.rank, "replicated")
    attempt(comm, model, mine)

    def hook(*_: Any) -> None:
        if comm.rank == 1:
            raise RuntimeError("a hook failed on rank 1")

    model.get_submodule(where).register_forward_pre_hook(hook)
    log: list[tuple[str, float]] = []
    for _ in range(2):  # after the last layer, rank 0 meets rank 1 in its next call
        start = time.monotonic()
        try:
            with torch.no_grad():
                model(**mine)
        except Exception as exc:
            log.append((str(exc), time.monotonic() - start))
            break
        log.append(("returned", time.monotonic() - start))
    return log


def run_ranks() -> dict[str, Any]:
    comm = tokenring.get_communicator()
    return {
        **{f"some layers, {text}": some_layers(comm, text) for text in ("sharded", "replicated")},
        "replaced later": replaced_later(comm),
        **{
            f"{name}, {text}": other_conditioning(comm, name, text)
            for name in CONDITIONING
            for text in ("sharded", "replicated")
        },
        "copied query weights": copied_query_weights(comm),
        **{  # last: with a timeout a wait for the peer would show
            f"failed at {where}": failed_on_one_rank(
                tokenring.get_communicator(None, timeout_s=4.0), where
            )
            for where in FAILED_AT
        },
    }


CONDITIONING = ("timestep", "guidance", "pooled_projections")


def one_process(guidance: bool = False) -> torch.Tensor:
    model = build_model(guidance=guidance)
    with torch.no_grad():
        return model(**model_inputs(guidance=guidance)).sample


def refused(got: Any, want: torch.Tensor, *, what: str) -> str:
    """The message, where the ranks raised; else fail with the output's distance from one
    process."""
    if isinstance(got, torch.Tensor):
        pytest.fail(f"{what}: no error; {(got - want).abs().max().item():.3g} off one process")
    return str(got)


def test_model_level_misuse_raises_on_every_rank() -> None:
    per_rank = tokenring.launch(run_ranks, world_size=WORLD_SIZE, timeout_s=120)
    want = one_process()
    want_guidance = one_process(guidance=True)
    for rank, got in enumerate(per_rank):
        for text in ("sharded", "replicated"):
            message = refused(got[f"some layers, {text}"], want, what=f"2 of 4 layers, {text}")
            assert "set on 2 of the 4 attention layers" in message, (rank, text, message)
            assert "transformer_blocks.1.attn" in message, (rank, text, message)
            assert "single_transformer_blocks.0.attn" in message, (rank, text, message)
        first, then = got["replaced later"]
        torch.testing.assert_close(first, want, rtol=0, atol=1e-10)
        message = refused(then, want, what="diffusers' processor on one layer again")
        assert "set on 3 of the 4 attention layers" in message, (rank, message)
        assert "single_transformer_blocks.0.attn" in message, (rank, message)
        for name, text in itertools.product(CONDITIONING, ("sharded", "replicated")):
            oracle = want_guidance if name == "guidance" else want
            case = f"{name}, {text}"
            message = refused(got[case], oracle, what=f"another {name} on rank 1, {text} text")
            # named as an argument of the model call, in the first layer's check
            assert "ranks disagree on this Flux attention layer" in message, (rank, case, message)
            assert f"model call: {name} (" in message, (rank, case, message)
            assert "rank 1 differs" in message, (rank, case, message)
            for other in set(CONDITIONING) - {name}:  # the others agree
                assert f"model call: {other} (" not in message, (rank, case, message)
        log = got["copied query weights"]
        assert log[:-1] == ["ran"] * (2 - rank), (rank, log)
        assert "layer name" in log[-1], (rank, log)
        assert "rank 0 has FluxTransformer2DModel.transformer_blocks.0.attn" in log[-1], log
        assert "rank 1 has FluxTransformer2DModel.transformer_blocks.1.attn" in log[-1], log
        # Note [A Flux model call that fails on one rank]: rank 0 waited out the 4 s timeout
        # in the next layer's check ("rank(s) [1] did not arrive"); after the last layer it
        # returned, and met rank 1 in its next call's first layer
        for where in FAILED_AT:
            log = got[f"failed at {where}"]
            message, elapsed = log[-1]
            assert "a hook failed on rank 1" in message and elapsed < FAST_S, (rank, where, log)
            returned = 1 if where == "norm_out" and rank == 0 else 0
            assert [m for m, _ in log[:-1]] == ["returned"] * returned, (rank, where, log)
