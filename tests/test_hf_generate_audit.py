"""tokenring.hf.generate where the ranks' loops could part: sampling whose draws differ on the
last step, stopping criteria that decide differently on different ranks (max_time, a custom
one), and options that run the model outside generate's own steps.

One launch of two gloo ranks (communicators with a 5 s timeout, so a wait for one shows);
oracle: the same float64 Llama with SDPA attention run by transformers' own ``generate`` in
each rank's process.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import (  # noqa: E402
    LogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from tiny_llama import (  # noqa: E402
    GENERATE_PROMPT,
    GENERATE_VOCAB,
    generate_models,
    generate_prompt,
    raised_fast,
    timed,
)
from tokenring import hf  # noqa: E402

WORLD = 2
VOCAB, PROMPT = GENERATE_VOCAB, GENERATE_PROMPT
TIMEOUT_S = 5.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 3.0  # every rank must raise well within it


class _StopAt(StoppingCriteria):
    """Stops every sequence once it holds ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = input_ids.shape[1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


class _SlowOnRank0(LogitsProcessor):
    """Sleeps on rank 0 after the prefill: its clock runs ahead of rank 1's."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0 and input_ids.shape[1] == PROMPT:
            time.sleep(0.6)
        return scores


class _Collect(BaseStreamer):
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.tokens: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _generate(model: Any, seed: int, **options: Any) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(
            hf.SequenceParallel(), model, generate_prompt(), strategy="pass_kv", **options
        )
    return out if isinstance(out, torch.Tensor) else out.sequences


def _oracle(model: Any, seed: int, **options: Any) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(generate_prompt(), **options)


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    model, oracle = generate_models(layers=1)
    sample = {"do_sample": True, "temperature": 5.0, "top_k": 0}
    out: dict[str, Any] = {}
    # the last token is drawn and never fed back: no step's id check sees it
    out["seeded alike"] = timed(TIMEOUT_S, lambda: _generate(model, 3, max_new_tokens=1, **sample))
    out["seeded alike oracle"] = _oracle(oracle, 3, max_new_tokens=1, **sample)
    out["seeded apart"] = timed(
        TIMEOUT_S, lambda: _generate(model, 3 + rank, max_new_tokens=1, **sample)
    )
    # a stopping criterion that stops rank 0 a step before rank 1
    stop = StoppingCriteriaList([_StopAt(PROMPT + 2 + rank)])
    out["stops apart"] = timed(
        TIMEOUT_S,
        lambda: _generate(model, 0, max_new_tokens=4, do_sample=False, stopping_criteria=stop),
    )
    out["after stops apart"] = timed(TIMEOUT_S, lambda: _generate(model, 0, max_new_tokens=3))
    # max_time: rank 0's clock passes it after the prefill, rank 1's never would
    slow = [_SlowOnRank0()]
    out["max_time"] = timed(
        TIMEOUT_S,
        lambda: _generate(model, 0, max_new_tokens=5, max_time=0.3, logits_processor=slow),
    )
    out["max_time oracle"] = _oracle(oracle, 0, max_new_tokens=5, do_sample=False)
    # classifier-free guidance runs the model itself, outside generate's steps
    for scale in (2, 1):
        out[f"guidance_scale {scale}"] = timed(
            TIMEOUT_S,
            lambda scale=scale: _generate(model, 0, max_new_tokens=2, guidance_scale=scale),
        )
    out["guidance oracle"] = _oracle(oracle, 0, max_new_tokens=2)
    # a streamer on rank 0 alone (printing once): it changes no token
    streamer = _Collect() if rank == 0 else None
    out["streamer"] = timed(
        TIMEOUT_S, lambda: _generate(model, 0, max_new_tokens=2, streamer=streamer)
    )
    out["streamed"] = None if streamer is None else streamer.tokens
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=120)


def test_a_last_token_drawn_apart_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """With do_sample=True the ranks each draw the next token; the last one is never fed back,
    so no step's id check saw it: ranks seeded differently returned different sequences
    (max_new_tokens=1: rank 0 [.., 43], rank 1 [.., 50]) without a word. generate now checks
    the ranks' sequences once it ends: every rank raises, naming the seed; seeded alike they
    return the oracle's tokens."""
    for res in ranks:
        assert torch.equal(res["seeded alike"]["value"], res["seeded alike oracle"])
        raised_fast(res["seeded apart"], FAST_S, "different token ids", "manual_seed")


def test_ranks_that_stop_at_different_steps_raise_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """A stopping criterion that stopped rank 0 a step before rank 1: rank 0 returned its
    sequences as if nothing were wrong, rank 1 raised 'ranks are in different calls' naming a
    generate call (rank 0's next one, which then failed in turn). Now both raise in the same
    call, naming the stop, and the next call runs."""
    for res in ranks:
        raised_fast(res["stops apart"], FAST_S, "stopped generating at different steps", "stopping")
        assert "value" in res["after stops apart"], res["after stops apart"]


def test_max_time_stops_every_rank_at_the_same_step(ranks: list[dict[str, Any]]) -> None:
    """max_time is measured by each rank's own clock: rank 0, 0.6 s slower after the prefill,
    ended its loop while rank 1 went on (rank 1 waited out the communicator's timeout, 30 s).
    The ranks now agree on the stop: both end after the prefill's token, with the oracle's."""
    got = [res["max_time"] for res in ranks]
    for res in got:
        assert "value" in res, res
    want = ranks[0]["max_time oracle"][:, : PROMPT + 1]
    for res in got:
        assert torch.equal(res["value"], want), (res["value"], want)


def test_guidance_scale_is_refused_naming_it(ranks: list[dict[str, Any]]) -> None:
    """Classifier-free guidance runs the model on its own, positionally: generate raised
    "generate passes the model's inputs by keyword; got positional ones", which names no
    option. It is refused up front, naming guidance_scale; guidance_scale=1 (no guidance)
    runs."""
    for res in ranks:
        raised_fast(res["guidance_scale 2"], FAST_S, "guidance_scale=2", "classifier-free guidance")
        assert torch.equal(res["guidance_scale 1"]["value"], res["guidance oracle"])


def test_a_streamer_on_one_rank_alone_runs(ranks: list[dict[str, Any]]) -> None:
    """A streamer is a side effect of one rank (rank 0 prints the tokens): it was compared
    with the options ("streamer: rank 0 has _Collect, rank 1 has None") and every rank
    raised. It changes no token: it is left out of the agreed options, and rank 0's streamer
    gets the prompt and each new token."""
    for res in ranks:
        assert "value" in res["streamer"], res["streamer"]
        assert torch.equal(res["streamer"]["value"], ranks[0]["streamer"]["value"])
    sequences = ranks[0]["streamer"]["value"]
    assert ranks[0]["streamed"][0] == sequences[:, :PROMPT].reshape(-1).tolist()
    assert [t for step in ranks[0]["streamed"][1:] for t in step] == sequences[
        :, PROMPT:
    ].T.reshape(-1).tolist()
