"""A tiny causal language model and greedy generation, on one process or over the KV cache.

This module owns the end-to-end check of inference: :func:`generate` (K/V sharded over the
ranks) must return exactly the tokens of :func:`generate_reference` (one process, no cache).
The model is a small seeded Llama: RMS norms, RoPE (half-split), GQA attention, a SiLU MLP.

Legend: n packed tokens of this rank, E model dim, V vocabulary, Hq / Hkv heads, D head dim,
L layers, B sequences.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from tokenring.api import check_hardware_use, get_communicator
from tokenring.core.layout import check_size
from tokenring.inference import cached_attn, step_strategy
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import Hardware
from tokenring.model.planner import calibrate
from tokenring.runtime.comm import Communicator
from tokenring.strategies.cached import CachedStrategy

__all__ = ["Generation", "TinyCausalLM", "TinyLMConfig", "generate", "generate_reference"]

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, q (n, Hq, D), k (n, Hkv, D), v (n, Hkv, D)) -> out (n, Hq, D)``, causal."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyLMConfig:
    """Sizes of the tiny model."""

    vocab_size: int = 96
    """V."""
    dim: int = 64
    """E."""
    num_layers: int = 2
    """L."""
    heads_q: int = 4
    """Hq."""
    heads_kv: int = 2
    """Hkv; divides Hq."""
    head_dim: int = 16
    """D; even (RoPE rotates pairs)."""
    mlp_dim: int = 128
    """Hidden width of the MLP."""
    rope_base: float = 10000.0
    """RoPE frequency base."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "heads_q", "heads_kv", "mlp_dim"):
            check_size(name, getattr(self, name), 1)
        rope_base = self.rope_base
        if isinstance(rope_base, bool) or not (
            isinstance(rope_base, int | float) and 0 < rope_base < math.inf
        ):
            raise ValueError(f"rope_base must be a finite number > 0; got {rope_base!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_kv must divide heads_q; got heads_q={self.heads_q}, "
                f"heads_kv={self.heads_kv}"
            )
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2 for RoPE; got {self.head_dim}")


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyCausalLM(torch.nn.Module):
    """The tiny model; ``forward`` takes tokens, their global positions and an attention
    function, so one process and many ranks run the same code around attention.

    Args:
        config: sizes.
        seed: weights are drawn from ``torch.Generator().manual_seed(seed)``.
        dtype, device: of the weights and activations.
    """

    def __init__(
        self,
        config: TinyLMConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(seed)
        c = config

        def weight(rows: int, cols: int, scale: float | None = None) -> torch.nn.Parameter:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
            w = w / rows**0.5 if scale is None else w * scale
            return torch.nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)

        self.embed = weight(c.vocab_size, c.dim, scale=1.0)
        self.layers = [
            {
                "wq": weight(c.dim, c.heads_q * c.head_dim),
                "wk": weight(c.dim, c.heads_kv * c.head_dim),
                "wv": weight(c.dim, c.heads_kv * c.head_dim),
                "wo": weight(c.heads_q * c.head_dim, c.dim),
                "w1": weight(c.dim, c.mlp_dim),
                "w2": weight(c.mlp_dim, c.dim),
            }
            for _ in range(c.num_layers)
        ]
        for index, layer in enumerate(self.layers):
            for name, param in layer.items():
                self.register_parameter(f"layer{index}_{name}", param)
        self.lm_head = weight(c.dim, c.vocab_size)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``(n, H, D)`` by its positions ``(n,)`` (angles in float64)."""
        half = x.shape[-1] // 2
        freqs = self.config.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)  # (D/2,)
        angles = positions.to(torch.float64).unsqueeze(1) * freqs  # (n, D/2)
        cos = angles.cos().to(x.dtype).unsqueeze(1).to(x.device)  # (n, 1, D/2)
        sin = angles.sin().to(x.dtype).unsqueeze(1).to(x.device)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """Logits of ``tokens`` ``(n,)`` at global ``positions`` ``(n,)``: ``(n, V)``."""
        c = self.config
        n = tokens.shape[0]
        x = self.embed[tokens]  # (n, E)
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x)
            q = self._rope((h @ layer["wq"]).view(n, c.heads_q, c.head_dim), positions)
            k = self._rope((h @ layer["wk"]).view(n, c.heads_kv, c.head_dim), positions)
            v = (h @ layer["wv"]).view(n, c.heads_kv, c.head_dim)
            a = attend(index, q, k, v)  # (n, Hq, D)
            x = x + a.reshape(n, c.heads_q * c.head_dim) @ layer["wo"]
            x = x + torch.nn.functional.silu(_rms_norm(x) @ layer["w1"]) @ layer["w2"]
        return _rms_norm(x) @ self.lm_head  # (n, V)


def _full_causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of a whole sequence (one process)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, n, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompts must be one or more non-empty token lists; got {prompts!r}")
    for p in prompts:  # an int: anything with __index__ but a bool
        bad = [t for t in p if isinstance(t, bool) or not hasattr(type(t), "__index__")]
        bad = bad or [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt tokens must be ints in [0, {vocab_size}); got {bad[:5]}")
    check_size("max_new_tokens", max_new_tokens, 1)


@torch.no_grad()
def generate_reference(
    model: TinyCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuation of each prompt on one process, recomputing the whole sequence every
    step (the oracle of :func:`generate`).

    Returns:
        ``max_new_tokens`` new tokens per prompt.
    """
    _check_prompts(prompts, model.config.vocab_size, max_new_tokens)
    device = model.embed.device
    results = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            ids = torch.tensor(tokens, device=device)
            logits = model(ids, torch.arange(len(tokens)), _full_causal)
            tokens.append(int(logits[-1].argmax()))
        results.append(tokens[len(prompt) :])
    return results


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """What :func:`generate` returns."""

    tokens: list[list[int]]
    """The new tokens of each sequence (the same on every rank)."""
    cache: DistributedKVCache
    """The cache after the last step (its lengths, per-rank tokens and bytes)."""
    strategies: list[str]
    """The attention strategy of each step (``" (zigzag)"``: on the ordinary path)."""


def _weights_digest(model: TinyCausalLM) -> int:
    """CRC-32 of every parameter's bytes: ranks whose weights differ would pick tokens from
    different models (each sequence's next token comes from the rank that owns its last one)."""
    crc = 0
    for name, param in model.named_parameters():
        data = param.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        crc = zlib.crc32(data.numpy().tobytes(), zlib.crc32(name.encode(), crc))
    return crc


@torch.no_grad()
def generate(
    model: TinyCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    group: Any = None,
    block_size: int = 16,
    budget_bytes: int | None = None,
    strategy: CachedStrategy | str = "auto",
    hardware: Hardware | str | None = None,
) -> Generation:
    """Greedy decoding with the K/V cache sharded over the ranks of ``group`` (every rank
    calls it with the same model and prompts): step 0 prefills, each later step decodes one
    token per sequence; the owner of a sequence's last token picks the next.

    Args:
        block_size, budget_bytes: of the ``DistributedKVCache``.
        strategy, hardware: of ``cached_attn``; ``"auto"`` with hardware None measures this
            machine once per call (``tokenring.model.planner.calibrate``, a collective).

    Returns:
        The new tokens per prompt and the cache.

    Raises:
        ValueError: on every rank: empty prompts, tokens outside the vocabulary, max_new_tokens
            not an int >= 1, an unknown strategy, hardware with a strategy other than "auto",
            a bad block_size or budget_bytes; ranks with other prompts, max_new_tokens,
            strategy, hardware, config or weights.
        KVCacheBudgetError: a rank would exceed ``budget_bytes``.
    """

    comm = get_communicator(group)
    validate = functools.partial(
        _checked_call, model, prompts, max_new_tokens, comm, block_size=block_size,
        budget_bytes=budget_bytes, strategy=strategy, hardware=hardware,
    )  # fmt: skip
    cache = comm.agreed(validate, what="generate call")
    if strategy == "auto" and hardware is None:  # once per call (Note [Calibration is passed in])
        hardware = calibrate(comm, dtype=model.embed.dtype, device=model.embed.device)
    seqs = [list(p) for p in prompts]
    used = [_decode_step(model, cache, seqs, strategy, hardware) for _ in range(max_new_tokens)]
    tokens = [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]
    return Generation(tokens=tokens, cache=cache, strategies=used)


def _checked_call(
    model: TinyCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    comm: Communicator,
    *,
    block_size: int,
    budget_bytes: int | None,
    strategy: CachedStrategy | str,
    hardware: Hardware | str | None,
) -> tuple[DistributedKVCache, dict[str, Any]]:
    """:func:`generate`'s checks on this rank, its cache and the signature the ranks compare
    (Note [Rank agreement] in tokenring.api)."""
    c = model.config
    _check_prompts(prompts, c.vocab_size, max_new_tokens)
    if strategy != "auto":
        CachedStrategy.parse(strategy)
        check_hardware_use(strategy, hardware)
    cache = DistributedKVCache(
        num_layers=c.num_layers,
        batch=len(prompts),
        heads_kv=c.heads_kv,
        head_dim=c.head_dim,
        dtype=model.embed.dtype,
        device=model.embed.device,
        block_size=block_size,
        budget_bytes=budget_bytes,
        group=comm,
    )
    tokens = [[int(t) for t in p] for p in prompts]
    return cache, {
        "prompts": [len(tokens), zlib.crc32(repr(tokens).encode())],
        "max_new_tokens": max_new_tokens,
        "strategy": str(getattr(strategy, "value", strategy)),
        "hardware": None if hardware is None else repr(hardware),
        "config": repr(c),
        "weights": _weights_digest(model),
    }


def _decode_step(
    model: TinyCausalLM,
    cache: DistributedKVCache,
    seqs: list[list[int]],
    strategy: CachedStrategy | str,
    hardware: Hardware | str | None,
) -> str:
    """One step of :func:`generate` (the model on the new tokens this rank owns, the next
    tokens appended); returns the step's strategy."""
    comm, c, device = cache.comm, model.config, model.embed.device
    assert comm is not None
    step = cache.begin_step([len(s) - n for s, n in zip(seqs, cache.lengths, strict=True)])
    # once per step; every layer runs the same
    chosen = step_strategy(strategy, cache, heads_q=c.heads_q, hardware=hardware)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, cached_attn(q, k, v, cache=cache, layer=layer, strategy=chosen))

    mine = step.new_positions[comm.rank]
    held = [seqs[b][p] for b, positions in enumerate(mine) for p in positions.tolist()]
    ids = torch.tensor(held, dtype=torch.int64, device=device)  # (n,)
    logits = model(ids, step.positions(comm.rank), attend)  # (n, V)
    picks = torch.zeros(len(seqs), dtype=torch.int64, device=device)
    offset = 0
    for b, pos in enumerate(mine):
        offset += len(pos)
        if len(pos) and int(pos[-1]) == len(seqs[b]) - 1:  # this rank owns the last token
            picks[b] = int(logits[offset - 1].argmax()) + 1
    comm.all_reduce(picks, label="next tokens").wait()
    for b, seq in enumerate(seqs):
        seq.append(int(picks[b]) - 1)
    return chosen.value + (" (zigzag)" if step.zigzag else "")
