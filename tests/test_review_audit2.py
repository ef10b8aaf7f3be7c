"""Review of the outputs' rank check (one exchange after every outermost forward given
sequence_parallel= over several ranks): a forward that raises on one rank alone, before, between
or after its attention calls, or in a model that calls no tokenring attention; the same error
on every rank; a model call nested in another's forward.

One launch of two gloo ranks (communicators with a 4 s timeout, so a wait for a peer shows).
Oracles: the documented behaviour (every rank raises within FAST_S, naming the failing rank's
error) and, for the forwards after a failure, the same tiny float64 model with SDPA attention
in each rank's process (float64 within 1e-10).

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
from common import outcome

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
)
from tokenring import hf  # noqa: E402

WORLD, S, V = 2, 8, 32
TIMEOUT_S = 4.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 2.5  # every rank must raise well within it


def _raising_hook(module: torch.nn.Module, ranks: tuple[int, ...]) -> Any:
    """A forward pre-hook on ``module`` that raises on ``ranks``."""

    def hook(*_: Any) -> None:
        if dist.get_rank() in ranks:
            raise RuntimeError(f"a hook failed on rank {dist.get_rank()}")

    return module.register_forward_pre_hook(hook)


def _timed(run: Callable[[], Any]) -> dict[str, Any]:
    """``run()``'s value or error and its time; then, once every rank is done, a new
    communicator on every rank if one rank's failed (tiny_llama.timed rebuilds it on the
    raising ranks alone, which waits for a peer that returned)."""
    out = outcome(run)
    failed = [None] * WORLD
    dist.all_gather_object(failed, tokenring.get_communicator(None)._broken is not None)
    if any(failed):
        tokenring.close_communicators()
        tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    return out


class _Sum(transformers.LlamaForCausalLM):
    """A model whose forward also calls a second model given sequence_parallel= (a nested
    model call: the outermost one holds the checks) and returns the sum of their logits."""

    def forward(self, **kwargs: Any) -> Any:
        out = super().forward(**kwargs)
        out.logits = out.logits + self.second(**kwargs).logits
        return out


class _LoggedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A model's attention class with a forward of its own that hands over to the base's
    (to log or wrap it): its code names no ALL_ATTENTION_FUNCTIONS, the base's does."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


def _generate_cases(out: dict[str, Any]) -> None:
    """hf.generate of a Llama whose second layer's attention is a _LoggedAttention."""
    model, oracle = generate_models(layers=2)
    logged = _LoggedAttention(model.config, layer_idx=1)
    logged.load_state_dict(model.model.layers[1].self_attn.state_dict())
    model.model.layers[1].self_attn = logged.double()
    prompt = generate_prompt()
    with torch.no_grad():
        options = dict(strategy="pass_kv", do_sample=False, max_new_tokens=4)
        out["generate, a subclassed attention"] = _timed(
            lambda: hf.generate(hf.SequenceParallel(), model, prompt, **options)
        )
        out["generate oracle"] = oracle.generate(prompt, max_new_tokens=4, do_sample=False)


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    config = llama_config(V, hidden=16, layers=2)
    state = perturbed_state(config, seed=0, scale=0.1)
    model = model_of(copy.deepcopy(config), state, "tokenring")
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, ids)
    with torch.no_grad():
        want = model_of(copy.deepcopy(config), state, "sdpa")(ids).logits  # (1, S, V)

    def error(model: Any) -> Callable[[], Any]:
        """The model's forward on this rank's shard; the max error of the gathered logits."""

        def run() -> float:
            with torch.no_grad():
                got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                            sequence_parallel=sp)  # fmt: skip
                got = got if isinstance(got, torch.Tensor) else got.logits  # (1, s, V)
                return float((hf.gather_sequence(sp, got) - want).abs().max())

        return run

    where = {
        "embeddings": model.model.embed_tokens,  # before the first attention call
        "second layer": model.model.layers[1],  # between the attention calls
        "final norm": model.model.norm,  # after the last one
        "lm_head": model.lm_head,
    }
    for name, module in where.items():
        for ranks in ((1,), (0, 1)):
            handle = _raising_hook(module, ranks)
            try:
                out[f"{name} {ranks}"] = _timed(error(model))
            finally:
                handle.remove()
            # no tokenring.close_communicators() after an error raised alike on every rank:
            # the next forward runs on the same communicator
            out[f"after {name} {ranks}"] = error(model)()
    nested = _Sum._from_config(copy.deepcopy(config), attn_implementation="tokenring")
    nested.load_state_dict(state)
    nested.second = model
    nested.double()
    want = 2 * want  # (1, S, V): the same model twice
    handle = _raising_hook(model.lm_head, (1,))
    try:
        out["nested, the second model's head"] = _timed(error(nested))
    finally:
        handle.remove()
    out["nested"] = _timed(error(nested))
    sdpa = model_of(copy.deepcopy(config), state, "sdpa")
    handle = _raising_hook(sdpa.lm_head, (1,))
    try:
        out["no tokenring attention"] = _timed(error(sdpa))
    finally:
        handle.remove()
    _foreign_collective_case(model, error, out)
    _generate_cases(out)
    return out


def _foreign_collective_case(model: Any, error: Callable[..., Any], out: dict[str, Any]) -> None:
    """Rank 1's final norm raises while rank 0's waits in an all-reduce of another group (a
    collective of another library, as FSDP's all-gathers), which rank 1 joins once its
    forward has raised."""
    foreign = dist.new_group([0, 1], backend="gloo")
    saved = tokenring.runtime.comm.TELL_WITHIN_S
    tokenring.runtime.comm.TELL_WITHIN_S = 1.0  # below the communicators' 4 s timeout

    def hook(*_: Any) -> None:
        if dist.get_rank() == 1:
            raise RuntimeError("a hook failed on rank 1")
        dist.all_reduce(torch.zeros(1), group=foreign)

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        run = error(model)
        if dist.get_rank() == 1:

            def run_then_release() -> Any:
                try:
                    return run()
                finally:
                    dist.all_reduce(torch.zeros(1), group=foreign)

            out["foreign collective"] = _timed(run_then_release)
        else:
            out["foreign collective"] = _timed(run)
    finally:
        handle.remove()
        tokenring.runtime.comm.TELL_WITHIN_S = saved


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=150)


@pytest.mark.parametrize("where", ["embeddings", "second layer", "final norm", "lm_head"])
def test_a_forward_that_fails_on_one_rank_fails_fast_on_every_rank(
    ranks: list[dict[str, Any]], where: str
) -> None:
    """A hook that raises on rank 1 alone. After the last attention call (final norm, LM
    head) rank 0 returned from its forward into the outputs' rank check and waited there for
    the 4 s timeout ("rank(s) [1] did not arrive"), where before that check it returned its
    logits; before the first attention call it waited in the forward's rank check, between the
    calls in the second layer's attention check. Rank 1 now posts its error to the check its
    peers meet next: every rank raises at once naming it."""
    for res in ranks:
        raised_fast(res[f"{where} (1,)"], FAST_S, "a hook failed on rank 1")
        # not the check_ranks hint of ranks in different calls: rank 1 said why
        assert "check_ranks=False" not in res[f"{where} (1,)"]["error"], res[f"{where} (1,)"]


@pytest.mark.parametrize("where", ["embeddings", "second layer", "final norm", "lm_head"])
def test_an_error_on_every_rank_keeps_the_communicator(
    ranks: list[dict[str, Any]], where: str
) -> None:
    """The same hook on every rank: each raises its own error at once, and the next forward
    on the same communicator matches one process."""
    for rank, res in enumerate(ranks):
        raised_fast(res[f"{where} (0, 1)"], FAST_S, f"a hook failed on rank {rank}")
        assert res[f"after {where} (0, 1)"] < 1e-10, res[f"after {where} (0, 1)"]


def test_nested_and_refused_forwards_that_fail_on_one_rank(ranks: list[dict[str, Any]]) -> None:
    """A model whose forward calls a second one, whose LM head raises on rank 1 (after the
    outer model's attention calls and the second's): every rank raises at once naming it, and
    the next call matches one process; a model of SDPA attention (no tokenring attention
    call) whose LM head raises on rank 1 while rank 0 refuses it: each raises at once."""
    for res in ranks:
        raised_fast(res["nested, the second model's head"], FAST_S, "a hook failed on rank 1")
        assert res["nested"]["value"] < 1e-10, res["nested"]
        assert res["no tokenring attention"]["elapsed_s"] < FAST_S, res["no tokenring attention"]
    raised_fast(ranks[1]["no tokenring attention"], FAST_S, "a hook failed on rank 1")
    raised_fast(ranks[0]["no tokenring attention"], FAST_S, "attn_implementation='sdpa'")


def test_a_failure_whose_peer_waits_in_another_collective(ranks: list[dict[str, Any]]) -> None:
    """Rank 1 fails while rank 0 waits in another library's collective (which rank 1 joins
    after raising): rank 1 waited for rank 0 at the outputs' rank check for the whole 4 s
    timeout before raising its own error; it now waits Communicator.tell's bound (1 s here),
    and rank 0, reaching the check after, raises naming rank 1's error."""
    raised_fast(ranks[1]["foreign collective"], FAST_S, "a hook failed on rank 1")
    got = ranks[0]["foreign collective"]
    assert "a hook failed on rank 1" in got.get("error", ""), got


def test_generate_with_an_attention_class_of_ones_own(ranks: list[dict[str, Any]]) -> None:
    """A layer whose attention is a subclass of the model's with a forward that calls the
    base's: generate read the attention layers from the forwards' code (Note [Layers without
    attention]) and found layer 0 alone, so every rank raised "layer 1 ran attention, but the
    model's attention layers are [0]" where the model generated before that change. A forward
    that hands over to its base's now counts as the base's: transformers' tokens."""
    for res in ranks:
        got = res["generate, a subclassed attention"]
        assert "value" in got, got
        assert torch.equal(got["value"], res["generate oracle"]), (got, res["generate oracle"])
