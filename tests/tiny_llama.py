"""A tiny float64 Llama for the Trainer and generate tests: its config, a perturbed initial state
(so that the gradients are not those of an initialisation's symmetries), a model of that state,
and the generate tests' pair of models (tokenring and SDPA), prompt and timed call."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

import tokenring
from common import outcome


def llama_config(
    vocab: int, *, hidden: int = 16, layers: int = 1, heads: int = 2, kv_heads: int = 1
) -> Any:
    """A Llama of ``hidden`` size (an MLP of 1.5 x hidden), ``heads`` / ``kv_heads``, as many
    positions as ``hidden``, no cache."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=hidden,
        use_cache=False,
    )


def perturbed_state(config: Any, *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The float64 state of a model of ``config`` initialised under ``seed``, every parameter
    moved by ``scale`` times a normal draw."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return {k: v.double() for k, v in model.state_dict().items()}


def model_of(config: Any, state: dict[str, torch.Tensor], attn_implementation: str) -> Any:
    """A float64 model of ``config`` holding ``state``, with this attention implementation."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.load_state_dict(state)
    return model.double()


def sgd_args(output_dir: str, **options: Any) -> Any:
    """transformers' TrainingArguments of plain SGD at a constant rate (no decay, no clipping),
    every step logged, nothing saved or reported, on CPU; ``options`` add to or override."""
    base: dict[str, Any] = dict(output_dir=output_dir, optim="sgd", lr_scheduler_type="constant")
    base |= dict(weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no")
    base |= dict(report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    return TrainingArguments(**(base | options))


def labelled_rows(
    num_rows: int, seed: int, *, vocab: int, seq_len: int, numbered: bool = True
) -> list[dict[str, torch.Tensor]]:
    """Rows whose first 1..seq_len-1 labels are -100 (a prompt mask of random length, so the
    rows count different labels); ``numbered``: token 0 of row i is i (tells them apart)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_rows):
        ids = torch.randint(0, vocab, (seq_len,), generator=gen)
        if numbered:
            ids[0] = i
        labels = ids.clone()
        labels[: int(torch.randint(1, seq_len, (1,), generator=gen))] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


GENERATE_VOCAB, GENERATE_PROMPT = 64, 7


def generate_models(layers: int) -> tuple[Any, Any]:
    """The tokenring Llama of the generate tests (GQA 4/2, pad token 0, no bos/eos) and the
    same weights with SDPA, float64, in eval mode."""
    config = LlamaConfig(
        vocab_size=GENERATE_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    models = []
    for impl in ("tokenring", "sdpa"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=impl
            )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        models.append(model.double().eval())
    return models[0], models[1]


def generate_prompt() -> torch.Tensor:
    """Two prompts of GENERATE_PROMPT tokens (none of them the pad token 0)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, GENERATE_VOCAB, (2, GENERATE_PROMPT), generator=gen)


def timed(timeout_s: float, run: Callable[[], Any]) -> dict[str, Any]:
    """``run()``'s value or error and its time; after an error the default group gets a new
    communicator (of ``timeout_s``): a failed check leaves the old one failed."""

    def then_rebuild() -> Any:
        try:
            return run()
        except Exception:
            tokenring.close_communicators()
            tokenring.get_communicator(None, timeout_s=timeout_s)
            raise

    return outcome(then_rebuild)


def raised_fast(res: dict[str, Any], fast_s: float, *words: str) -> None:
    """``res`` (of :func:`timed`) is an error naming every one of ``words``, within ``fast_s``."""
    assert "error" in res, res
    assert res["elapsed_s"] < fast_s, res
    for word in words:
        assert word in res["error"], (word, res["error"])
