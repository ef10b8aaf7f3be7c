"""The attention layers the command line knows by name: CPU-sized stand-ins for the benches,
and the shapes of well-known models for the simulator."""

from __future__ import annotations

from dataclasses import dataclass

from tokenring.core.schedule import AttentionShape

__all__ = ["BENCH_MODELS", "KNOWN_MODELS", "KnownModel"]

# Llama2-7B has 32 heads of 128 and Llama3-8B 32 query / 8 kv heads of 128; the benches keep
# their head ratios at a size two CPU cores run in about a minute.
BENCH_MODELS: dict[str, AttentionShape] = {
    "mha-8/8": AttentionShape(heads_q=8, heads_kv=8, head_dim=64),
    "gqa-8/2": AttentionShape(heads_q=8, heads_kv=2, head_dim=64),
}
"""The benches' default layers, by the label of their rows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KnownModel:
    """A known model's attention layer and its mask."""

    shape: AttentionShape
    """Heads and head dimension (batch and dtype are the simulated run's)."""
    causal: bool
    """Causal LM (True) or a bidirectional DiT (False)."""


KNOWN_MODELS: dict[str, KnownModel] = {
    "llama2-7b": KnownModel(
        shape=AttentionShape(heads_q=32, heads_kv=32, head_dim=128), causal=True
    ),
    "llama3-8b": KnownModel(
        shape=AttentionShape(heads_q=32, heads_kv=8, head_dim=128), causal=True
    ),
    "llama3-70b": KnownModel(
        shape=AttentionShape(heads_q=64, heads_kv=8, head_dim=128), causal=True
    ),
    "flux-dit": KnownModel(
        shape=AttentionShape(heads_q=24, heads_kv=24, head_dim=128), causal=False
    ),
}
"""``tokenring simulate --model``."""
