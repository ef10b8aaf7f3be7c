"""tokenring.hf with one rank's call differing from its peers', beyond test_hf_usage_audit and
test_hf_generate_usage_audit: a prepared attention mask on one rank, logits_to_keep over
uneven shards, and hf.generate failing on one rank between its rank checks.

One launch of three gloo ranks (communicators with a 5 s timeout, so a wait for a peer
shows); S = 7 over 3 zigzag ranks gives shards of 3, 2 and 2 tokens. Oracle: the same tiny
float64 Llama with SDPA attention in each rank's process (float64 within 1e-10), transformers'
own generate for the tokens, or the documented refusal on every rank within FAST_S.

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

from tiny_llama import (  # noqa: E402
    generate_models,
    generate_prompt,
    llama_config,
    model_of,
    perturbed_state,
    raised_fast,
    timed,
)
from tokenring import hf  # noqa: E402

WORLD, S, V = 3, 7, 32
TIMEOUT_S = 5.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 3.0  # every rank must raise well within it


class _FailingProcessor(transformers.LogitsProcessor):
    """A logits processor that raises on ``rank`` at its ``at``-th call, else changes
    nothing."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at, self.calls = rank, at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.at:
            raise RuntimeError(f"user code failed on rank {self.rank}")
        return scores


class _FailingCriterion(transformers.StoppingCriteria):
    """A stopping criterion that raises on ``rank`` at its ``at``-th call, else stops
    nothing."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at, self.calls = rank, at, 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.at:
            raise RuntimeError(f"user code failed on rank {self.rank}")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _hook_raising(module: torch.nn.Module, rank: int, at: int) -> Any:
    """A forward pre-hook on ``module`` that raises on ``rank`` at its ``at``-th call."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == at:
            raise RuntimeError(f"a hook failed on rank {rank}")

    return module.register_forward_pre_hook(hook)


def _forward_cases(out: dict[str, Any]) -> None:
    """A forward given sequence_parallel=: prepared masks and logits_to_keep."""
    rank = dist.get_rank()
    config = llama_config(V, hidden=16, layers=2)
    state = perturbed_state(config, seed=0, scale=0.1)
    model = model_of(copy.deepcopy(config), state, "tokenring")
    oracle = model_of(config, state, "sdpa")
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel(seq_len=S)
    batch = hf.shard_batch(sp, ids)
    s = batch.input_ids.shape[1]
    with torch.no_grad():
        want = oracle(ids).logits  # (B, S, V)

    def error(**kwargs: Any) -> Callable[[], float]:
        def run() -> float:
            with torch.no_grad():
                got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                            sequence_parallel=sp, **kwargs).logits  # fmt: skip
            return float((hf.gather_sequence(sp, got) - want).abs().max())

        return run

    prepared = torch.ones(2, 1, s, s, dtype=torch.bool)  # (B, 1, s, s)
    out["4-D mask on rank 0"] = timed(
        TIMEOUT_S, error(attention_mask=prepared if rank == 0 else None)
    )
    ones = torch.ones(2, s, dtype=torch.int64)
    out["4-D mask on rank 0, ones elsewhere"] = timed(
        TIMEOUT_S, error(attention_mask=prepared if rank == 0 else ones)
    )
    out["3-D mask"] = timed(TIMEOUT_S, error(attention_mask=torch.ones(2, s, s)))
    out["logits_to_keep=2"] = timed(TIMEOUT_S, error(logits_to_keep=2))  # ranks 1, 2: 2 rows
    out["logits_to_keep on rank 0"] = timed(TIMEOUT_S, error(logits_to_keep=0 if rank else 5))
    out["logits_to_keep=3"] = timed(TIMEOUT_S, error(logits_to_keep=3))  # every shard's rows
    out["forward after"] = timed(TIMEOUT_S, error())


def _generate_cases(out: dict[str, Any]) -> None:
    """hf.generate with code that fails on rank 1 alone between the rank checks."""
    rank = dist.get_rank()
    model, oracle = generate_models(layers=2)
    prompt = generate_prompt()

    def generate(**options: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return hf.generate(hf.SequenceParallel(), model, prompt, strategy="pass_kv",
                                   do_sample=False, max_new_tokens=4, **options)  # fmt: skip

        return run

    processors = transformers.LogitsProcessorList
    out["logits processor"] = timed(
        TIMEOUT_S, generate(logits_processor=processors([_FailingProcessor(1, 2)]))
    )
    out["logits processor, max_time"] = timed(
        TIMEOUT_S, generate(logits_processor=processors([_FailingProcessor(1, 2)]), max_time=60.0)
    )
    criteria = transformers.StoppingCriteriaList([_FailingCriterion(1, 2)])
    out["stopping criterion"] = timed(TIMEOUT_S, generate(stopping_criteria=criteria))

    def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
        if rank == 1 and ids.shape[0] > prompt.shape[1]:  # after the first new token
            raise RuntimeError("prefix_allowed_tokens_fn failed on rank 1")
        return list(range(model.config.vocab_size))

    out["prefix_allowed_tokens_fn"] = timed(TIMEOUT_S, generate(prefix_allowed_tokens_fn=allowed))
    layers = model.model.layers
    for name, module in (
        ("before the first layer", layers[0]),  # peers: the first cached_attn check
        ("between the layers", layers[1]),  # peers: the second layer's
        ("after the last layer", model.model.norm),  # peers: the logits' all-reduce
    ):
        handle = _hook_raising(module, 1, 2)  # the second step
        try:
            out[f"hook {name}"] = timed(TIMEOUT_S, generate())
        finally:
            handle.remove()
    out["synced_gpus on rank 0"] = timed(TIMEOUT_S, generate(synced_gpus=rank == 0))
    out["synced_gpus"] = timed(TIMEOUT_S, generate(synced_gpus=True))
    out["generate after"] = timed(TIMEOUT_S, generate())
    with torch.no_grad():
        out["oracle"] = oracle.generate(prompt, max_new_tokens=4, do_sample=False)


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    _forward_cases(out)
    _generate_cases(out)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=150)


def test_a_prepared_mask_on_one_rank_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """A 4-D mask given to rank 0 alone (None or a 2-D mask of ones elsewhere): transformers
    hands a 4-D mask to the layers as is, without the mask function, so rank 0 raised in its
    attention call while ranks 1 and 2 waited out the 5 s timeout in the mask function's
    padding exchange. The forward's rank check now names rank 0's mask on every rank at once.
    A 3-D mask was read by no one (its zeros silently ignored); it is refused."""
    for res in ranks:
        raised_fast(res["4-D mask on rank 0"], FAST_S, "prepared attention mask", "(2, 1, 3, 3)")
        raised_fast(res["4-D mask on rank 0, ones elsewhere"], FAST_S, "prepared attention mask")
        raised_fast(res["3-D mask"], FAST_S, "2-D")
        assert res["forward after"]["value"] < 1e-10, res["forward after"]


def test_logits_to_keep_is_decided_from_the_option(ranks: list[dict[str, Any]]) -> None:
    """logits_to_keep=2 over shards of 3, 2 and 2 rows: ranks 1 and 2 returned their 2 rows
    (their whole shard) and passed the row check while rank 0 raised. logits_to_keep of rank 0
    alone raised there alone. Both now raise on every rank naming logits_to_keep; a k that
    keeps every shard's rows runs and matches one process."""
    for res in ranks:
        raised_fast(res["logits_to_keep=2"], FAST_S, "logits_to_keep")
        raised_fast(res["logits_to_keep on rank 0"], FAST_S, "logits_to_keep")
        assert res["logits_to_keep=3"]["value"] < 1e-10, res["logits_to_keep=3"]


def test_generate_failing_on_one_rank_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """A logits processor, stopping criterion, prefix_allowed_tokens_fn or forward hook that
    raised on rank 1 alone at the second step: ranks 0 and 2 waited out the 5 s timeout in
    the next rank check (or in a transfer, or, for a hook on the final norm, in the logits'
    all-reduce). Each now raises on
    every rank at once, naming rank 1's error; generate runs and matches transformers'
    afterwards."""
    for rank, res in enumerate(ranks):
        for case, words in (
            ("logits processor", ("user code failed on rank 1",)),
            ("logits processor, max_time", ("user code failed on rank 1",)),
            ("stopping criterion", ("user code failed on rank 1",)),
            ("prefix_allowed_tokens_fn", ("prefix_allowed_tokens_fn failed on rank 1",)),
            ("hook before the first layer", ("a hook failed on rank 1",)),
            ("hook between the layers", ("a hook failed on rank 1",)),
            ("hook after the last layer", ("a hook failed on rank 1",)),
        ):
            raised_fast(res[case], FAST_S, *words)
            assert rank == 1 or "rank 1" in res[case]["error"], (case, res[case])
        assert torch.equal(res["generate after"]["value"], res["oracle"])


def test_synced_gpus_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """synced_gpus=True adds transformers' all-reduce over the default group between the
    steps, where a rank that fails cannot reach its peers: refused, on every rank, also when
    one rank alone passes it."""
    for res in ranks:
        raised_fast(res["synced_gpus on rank 0"], FAST_S, "synced_gpus")
        raised_fast(res["synced_gpus"], FAST_S, "synced_gpus")
