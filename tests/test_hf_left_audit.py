"""tokenring.hf gaps left by earlier audits: label keywords and logits_to_keep passed by
position, outputs whose verdict differs between ranks (a pooled (B, C, X) output over uneven
shards, a loss computed from input_ids on some ranks), hf.generate of a model with a layer
that runs no attention, and hf.generate under FSDP (transformers' default synced_gpus).

One launch of two gloo ranks (communicators with a 4 s timeout, so a wait for a peer shows).
Oracles: the same tiny float64 model with SDPA attention in each rank's process (float64
within 1e-10), transformers' own generate for the tokens, or the documented refusal on every
rank within FAST_S.

Legend: B batch, S global seq, s local seq, V vocab, P world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402

from tiny_llama import (  # noqa: E402
    generate_models,
    generate_prompt,
    labelled_rows,
    llama_config,
    model_of,
    perturbed_state,
    raised_fast,
    sgd_args,
    timed,
)
from tokenring import hf  # noqa: E402

WORLD, S, V = 2, 8, 32
TIMEOUT_S = 4.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 2.5  # every rank must raise well within it
MASK_TOKEN = 5


class _PooledRows(transformers.LlamaForCausalLM):
    """A head whose logits are the shard's first row repeated 3 times: (B, 3, V) on every
    rank, pooled (not per-token) whatever the shard's length."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        return CausalLMOutput(logits=out.logits[:, :1].repeat(1, 3, 1))


class _MaskTokenLoss(transformers.LlamaForCausalLM):
    """A head computing a loss from input_ids alone, no label keyword: over the rows holding
    MASK_TOKEN, where there are any (in one rank's shard only, below)."""

    def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
        out = super().forward(input_ids=input_ids, **kwargs)
        hit = input_ids == MASK_TOKEN
        loss = out.logits[hit].logsumexp(-1).mean() if bool(hit.any()) else None
        return CausalLMOutput(loss=loss, logits=out.logits)


class _NoAttention(torch.nn.Module):
    """A decoder layer's attention slot that mixes no tokens: the layer is its MLP alone."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return torch.zeros_like(hidden_states), None


def _hook_raising(module: torch.nn.Module, rank: int, at: int) -> Any:
    """A forward pre-hook on ``module`` that raises on ``rank`` at its ``at``-th call."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == at:
            raise RuntimeError(f"a hook failed on rank {rank}")

    return module.register_forward_pre_hook(hook)


def _positional_cases(out: dict[str, Any]) -> None:
    """Labels and logits_to_keep passed by position, on one rank or on every rank."""
    rank = dist.get_rank()
    config = llama_config(V, hidden=16, layers=1)
    state = perturbed_state(config, seed=0, scale=0.1)
    llama = model_of(copy.deepcopy(config), state, "tokenring")
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, ids)

    def call(model: Any, *args: Any) -> Callable[[], Any]:
        def run() -> Any:
            result = model(*args, sequence_parallel=sp)
            return None if result.loss is None else float(result.loss)

        return run

    # LlamaForCausalLM(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
    # use_cache, logits_to_keep)
    first = (batch.input_ids, None, batch.position_ids, None, None)
    labels = ids if rank == 1 else None
    out["llama labels by position on rank 1"] = timed(TIMEOUT_S, call(llama, *first, labels))
    keep = (None, None, 1)
    out["llama logits_to_keep by position"] = timed(TIMEOUT_S, call(llama, *first, *keep))
    # BertForMaskedLM(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
    # encoder_hidden_states, encoder_attention_mask, labels)
    bert_config = transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM._from_config(bert_config, attn_implementation="tokenring")
    bert = bert.double().eval()
    first = (batch.input_ids, None, None, batch.position_ids, None, None, None)
    out["bert labels by position on rank 1"] = timed(
        TIMEOUT_S, call(bert, *first, batch.input_ids if rank == 1 else None)
    )
    out["bert labels by position"] = timed(TIMEOUT_S, call(bert, *first, batch.input_ids))
    oracle = model_of(copy.deepcopy(config), state, "sdpa")
    with torch.no_grad():
        want = oracle(ids).logits  # (1, S, V)
        got = llama(batch.input_ids, None, batch.position_ids, sequence_parallel=sp).logits
        out["llama by position after"] = float((hf.gather_sequence(sp, got) - want).abs().max())


def _outputs_cases(out: dict[str, Any]) -> None:
    """Outputs whose verdict differs between the ranks: S = 5 in contiguous shards of 3 and
    2 rows."""
    config = llama_config(V, hidden=16, layers=1)
    state = perturbed_state(config, seed=0, scale=0.1)
    sp = hf.SequenceParallel(layout="contiguous", seq_len=5)
    ids = torch.randint(MASK_TOKEN + 1, V, (1, 5), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = MASK_TOKEN  # in rank 0's shard alone
    batch = hf.shard_batch(sp, ids)
    for cls in (_PooledRows, _MaskTokenLoss):
        model = cls._from_config(copy.deepcopy(config), attn_implementation="tokenring")
        model.load_state_dict(state)
        model.double()

        def run(model: Any = model) -> Any:
            got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                        sequence_parallel=sp)  # fmt: skip
            return tuple(got.logits.shape)

        out[cls.__name__] = timed(TIMEOUT_S, run)


def _generate_cases(out: dict[str, Any]) -> None:
    """A Llama of 3 layers whose last layer runs no attention (its MLP alone)."""
    model, oracle = generate_models(layers=3)
    for m in (model, oracle):
        m.model.layers[2].self_attn = _NoAttention()
    prompt = generate_prompt()

    def generate() -> Any:
        with torch.no_grad():
            return hf.generate(hf.SequenceParallel(), model, prompt, strategy="pass_kv",
                               do_sample=False, max_new_tokens=4)  # fmt: skip

    out["layer without attention"] = timed(TIMEOUT_S, generate)
    hooked = (("the MLP-only layer", model.model.layers[2]), ("norm", model.model.norm))
    for where, module in hooked:
        for at in (1, 2):  # the prefill, the first decode step
            handle = _hook_raising(module, 1, at)
            try:
                out[f"hook on {where} at {at}"] = timed(TIMEOUT_S, generate)
            finally:
                handle.remove()
    with torch.no_grad():
        out["oracle"] = oracle.generate(prompt, max_new_tokens=4, do_sample=False)


def _fsdp_cases(out: dict[str, Any]) -> None:
    """hf.generate of a model under FSDP2, marked as transformers' own FSDP2 marks it (so
    that its generate turns synced_gpus on by default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, oracle = generate_models(layers=2)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model._is_fsdp_managed_module = True  # what transformers' apply_fsdp2 sets
    prompt = generate_prompt()
    alone = [dist.new_group([r]) for r in range(WORLD)][dist.get_rank()]

    def generate(group: Any = None, **options: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return hf.generate(hf.SequenceParallel(group=group), model, prompt,
                                   strategy="pass_kv", do_sample=False, max_new_tokens=4,
                                   **options)  # fmt: skip

        return run

    out["fsdp"] = timed(TIMEOUT_S, generate())
    out["fsdp synced_gpus=False"] = timed(TIMEOUT_S, generate(synced_gpus=False))
    out["fsdp, sp of one rank"] = timed(TIMEOUT_S, generate(group=alone))
    with torch.no_grad():
        out["fsdp oracle"] = oracle.generate(prompt, max_new_tokens=4, do_sample=False)


def _training_step_cases(out: dict[str, Any]) -> None:
    """SequenceParallelTrainer (DDP over the 2 ranks) whose second layer's MLP backward
    raises on rank 1 alone (DDP's reducer is left mid-backward: the Trainer is not reused)."""
    import os
    import tempfile

    from tokenring.hf.trainer import SequenceParallelTrainer

    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.update(LOCAL_WORLD_SIZE=str(WORLD))
    config = llama_config(V, layers=2)
    model = model_of(config, perturbed_state(config, seed=3, scale=0.2), "tokenring")

    def hook(*_: Any) -> None:
        if rank == 1:
            raise RuntimeError("a backward hook failed on rank 1")

    handle = model.model.layers[1].mlp.register_full_backward_hook(hook)
    with tempfile.TemporaryDirectory() as tmp:
        args = sgd_args(tmp, per_device_train_batch_size=2, max_steps=1)
        rows = labelled_rows(4, 1, vocab=V, seq_len=S)
        trainer = SequenceParallelTrainer(
            model=model, args=args, train_dataset=rows, sequence_parallel=hf.SequenceParallel()
        )
        out["training step"] = timed(TIMEOUT_S, trainer.train)
        handle.remove()


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    _positional_cases(out)
    _outputs_cases(out)
    _generate_cases(out)
    _fsdp_cases(out)
    _training_step_cases(out)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=150)


def test_label_keywords_by_position_reach_the_forwards_rank_check(
    ranks: list[dict[str, Any]],
) -> None:
    """labels passed by position to rank 1 alone: the forward's rank check read the keywords
    only, so LlamaForCausalLM's rank 1 waited out the 4 s timeout in the labels loss while
    rank 0 returned its logits, and BertForMaskedLM's rank 1 raised after its forward while
    rank 0 returned. A positional logits_to_keep=1 was not seen either (refused by the shape
    of the logits it left, a rule uneven shards defeat). The forward's signature is bound now:
    every rank raises at once naming the label keyword or logits_to_keep, and a loss from
    labels given by position names labels= as given."""
    for res in ranks:
        for case in ("llama labels by position on rank 1", "bert labels by position on rank 1"):
            raised_fast(res[case], FAST_S, "label keywords", "['labels']")
        raised_fast(res["llama logits_to_keep by position"], FAST_S, "logits_to_keep=1")
        raised_fast(res["bert labels by position"], FAST_S, "its own code", "given labels=")
        assert res["llama by position after"] < 1e-10, res["llama by position after"]


def test_an_outputs_verdict_that_differs_raises_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """Shards of 3 and 2 rows. A pooled (B, 3, V) output passed on rank 0 (its shard holds 3
    rows) as per-token while rank 1 raised; a loss computed from input_ids (no label keyword)
    where the mask token lies in rank 0's shard alone raised on rank 0 while rank 1 returned.
    The outputs' rank check makes every rank raise the first rank's error."""
    for res in ranks:
        raised_fast(res["_PooledRows"], FAST_S, "output logits of shape (1, 3, 32)")
        raised_fast(res["_MaskTokenLoss"], FAST_S, "_MaskTokenLoss computed its loss")


def test_generate_with_a_layer_without_attention(ranks: list[dict[str, Any]]) -> None:
    """A Llama of 3 layers whose last runs its MLP alone: the cache held a K/V shard for each
    of num_hidden_layers layers, so the second step raised "layers [2] have not appended the
    K/V" on every rank, and a hook failing on rank 1 in the prefill after the last attention
    call posted its error to the next layer's cached_attn check while rank 0 waited in the
    logits' one: every rank raised "ranks are in different calls", naming neither the hook
    nor its rank. Now the tokens are transformers' own, and a failure names its cause on
    every rank."""
    oracle = ranks[0]["oracle"]
    for res in ranks:
        assert torch.equal(res["layer without attention"]["value"], oracle), res
        for where in ("the MLP-only layer", "norm"):
            for at in (1, 2):
                raised_fast(res[f"hook on {where} at {at}"], FAST_S, "a hook failed on rank 1")


def test_generate_under_fsdp(ranks: list[dict[str, Any]]) -> None:
    """A model under FSDP2 marked as transformers' FSDP2 marks it: transformers' generate
    turned synced_gpus on, whose all-reduce between the steps lies outside tokenring's rank
    checks. sp.group spanning every rank steps alike, so generate passes synced_gpus=False
    (transformers' tokens); a sp.group of one of the two ranks is refused on every rank,
    naming FSDP and synced_gpus."""
    oracle = ranks[0]["fsdp oracle"]
    for res in ranks:
        for case in ("fsdp", "fsdp synced_gpus=False"):
            assert torch.equal(res[case]["value"], oracle), res[case]
        raised_fast(res["fsdp, sp of one rank"], FAST_S, "FSDP", "synced_gpus=True")


def test_a_training_step_that_fails_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    """A backward hook raising on rank 1 alone inside SequenceParallelTrainer: rank 0 waited
    out the 4 s timeout in the attention backward's receive, its error naming no cause
    ("no message within 4 s"). training_step now tells the peers (Note [A training step that
    fails on one rank]): every rank raises at once naming it."""
    for res in ranks:
        raised_fast(res["training step"], FAST_S, "a backward hook failed on rank 1")
