"""tokenring.hf.generate under the options a transformers user reaches for, beyond
test_hf_generate(_audit): decoding modes transformers hands to a Hub repository, a prompt
that holds the pad token, and cache options given differently on one rank.

One launch of three gloo ranks (communicators with a 5 s timeout, so a wait for one shows);
oracle: the same float64 Llama with SDPA attention run by transformers' own ``generate`` in
each rank's process, or the documented refusal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)

from tiny_llama import (  # noqa: E402
    GENERATE_PROMPT,
    GENERATE_VOCAB,
    generate_models,
    generate_prompt,
    raised_fast,
    timed,
)
from tokenring import hf  # noqa: E402

WORLD = 3
VOCAB, PROMPT = GENERATE_VOCAB, GENERATE_PROMPT
TIMEOUT_S = 5.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 3.0  # every rank must raise well within it


def _generate(model: Any, prompt: torch.Tensor, sp: Any = None, **options: Any) -> dict[str, Any]:
    sp = hf.SequenceParallel() if sp is None else sp
    with torch.no_grad():
        return timed(TIMEOUT_S, lambda: hf.generate(sp, model, prompt, do_sample=False, **options))


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    model, oracle = generate_models(layers=2)
    prompt = generate_prompt()
    out: dict[str, Any] = {}
    # modes transformers moved to the Hub: it asks for trust_remote_code, then runs that code
    for name, options in {
        "contrastive": {"penalty_alpha": 0.6, "top_k": 4},
        "dola": {"dola_layers": "high"},
        "constrained": {"force_words_ids": [[5]]},
    }.items():
        for trust in (False, True):
            out[f"{name} trust={trust}"] = _generate(
                model, prompt, max_new_tokens=2, trust_remote_code=trust, **options
            )
    # the prompt holds pad_token_id (0): transformers derives a padding mask from it
    padded = prompt.clone()
    padded[0, 3] = 0
    out["pad token"] = _generate(model, padded, max_new_tokens=2)
    out["pad token, mask of ones"] = _generate(
        model, padded, max_new_tokens=2, attention_mask=torch.ones_like(padded)
    )
    with torch.no_grad():
        out["pad token oracle"] = oracle.generate(
            padded, max_new_tokens=2, do_sample=False, attention_mask=torch.ones_like(padded)
        )
    # cache options of one rank alone
    out["budget one rank"] = _generate(
        model, prompt, strategy="pass_kv", max_new_tokens=2, budget_bytes=64 if rank == 0 else None
    )
    hardware = hf.SequenceParallel(hardware="h100-nvswitch" if rank else None)
    out["hardware one rank"] = _generate(model, prompt, sp=hardware, max_new_tokens=2)
    out["after"] = _generate(model, prompt, strategy="pass_kv", max_new_tokens=2)
    with torch.no_grad():
        out["oracle"] = oracle.generate(prompt, max_new_tokens=2, do_sample=False)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=120)


def test_modes_moved_to_the_hub_are_refused_naming_the_option(
    ranks: list[dict[str, Any]],
) -> None:
    """Contrastive search, DoLa and constrained beam search live in Hub repositories since
    transformers 4.56: generate raised transformers' "requires trust_remote_code=True", and
    with it (offline) "transformers-community/dola does not contain a custom_generate
    subdirectory" -- online it would run that code over the sharded cache (DoLa reads every
    layer's hidden states, which hold each rank's own rows). Each is refused on every rank,
    naming its option, whatever trust_remote_code says."""
    for res in ranks:
        for trust in (False, True):
            raised_fast(
                res[f"contrastive trust={trust}"], FAST_S, "NotImplementedError", "penalty_alpha"
            )
            raised_fast(res[f"dola trust={trust}"], FAST_S, "NotImplementedError", "dola_layers")
            raised_fast(
                res[f"constrained trust={trust}"], FAST_S, "NotImplementedError", "force_words_ids"
            )


def test_a_prompt_holding_the_pad_token_names_it(ranks: list[dict[str, Any]]) -> None:
    """A prompt that holds pad_token_id (no attention_mask given): transformers derives a
    padding mask from it, and generate raised "a padding attention_mask is not supported",
    naming a mask the user never passed. It now names pad_token_id and the way out (a mask
    of ones when the token is not padding), which runs and matches the oracle."""
    for res in ranks:
        raised_fast(res["pad token"], FAST_S, "pad_token_id=0", "attention_mask=torch.ones_like")
        assert torch.equal(res["pad token, mask of ones"]["value"], res["pad token oracle"])


def test_cache_options_of_one_rank_raise_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """budget_bytes=64 on rank 0 alone: rank 0 raised KVCacheBudgetError while ranks 1 and 2
    went on into the first attention and waited out the timeout ("rank 0 did not arrive
    within 5 s"). SequenceParallel(hardware='h100-nvswitch') on ranks 1 and 2 alone: they
    raised (no float64 FLOP/s) and rank 0 waited ("rank 1 is gone"). Neither option was
    compared with the others; both are now, and every rank raises at once naming it."""
    for res in ranks:
        raised_fast(res["budget one rank"], FAST_S, "budget_bytes")
        raised_fast(res["hardware one rank"], FAST_S, "hardware")
        assert torch.equal(res["after"]["value"], res["oracle"])
