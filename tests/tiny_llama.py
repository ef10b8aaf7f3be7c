"""A tiny float64 Llama for the Trainer tests: its config, a perturbed initial state (so that
the gradients are not those of an initialisation's symmetries), and a model of that state."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


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
