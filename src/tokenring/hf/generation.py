"""``model.generate`` under sequence parallelism: :class:`ShardedKVCache` (a
``transformers.Cache`` over a :class:`tokenring.DistributedKVCache`) and :func:`generate`, each
rank computing only its own tokens. Imports transformers: reach it through ``tokenring.hf``.

Legend: B sequences, T new tokens per sequence in a step, n this rank's new rows, V vocab,
P world size.

Note [Generation under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank runs the same ``model.generate`` on the same global token ids; a forward hook
makes each forward compute this rank's rows only::

    generate(sp, model, ids, ...)     refuses what cannot run (beam search, assisted decoding,
                                      padding, ...), makes a ShardedKVCache, hooks the model
    each forward of generate, new ids (B, T) (the prompt, then one token per sequence):
      pre-hook  1 agree   the ids' digest over the group: sampling must draw the same tokens
                          on every rank (seed every rank alike), else every rank raises
                2 place   kv.begin_step([T] * B) (Note [Placement] in tokenring.kvcache): the
                          first prefill zigzag when 2P divides T, else block-cyclic; a decode
                          token has one owner rank
                3 choose  the cached strategy, once per step: on the zigzag prefill pass-Q
                          (TokenRing) or pass-KV (Ring) by the planner, after it pass_q,
                          pass_kv, direct or tree by the simulator (or as forced)
                4 shard   input_ids -> this rank's packed rows (1, n), position_ids their
                          global positions (RoPE), logits_to_keep the rows that end a sequence
      each attention layer: cache.update hands the new k, v back unchanged; the attention
                          function runs tokenring.inference.cached_attn (append to this rank's
                          shard, attend over every rank's)
      post-hook           logits of the rows that end a sequence -> (B, 1, V) on every rank
                          (a sum over the group, zeros elsewhere: exact)

A rank may own no new row in a step (decode with B < P) but still runs every layer (it holds
part of the cache); models cannot reshape 0 rows, so it runs one placeholder row (token 0 at
position 0) whose attention passes 0 rows to ``cached_attn`` and returns zeros.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tokenring.core.layout import check_int
from tokenring.hf.attention import (
    _EAGER,
    _PLAIN_CAUSAL,
    ATTN_IMPLEMENTATIONS,
    MIN_TRANSFORMERS,
    SequenceParallel,
    _check_transformers,
    _ModelMask,
    _routes_attention,
    as_sequence_parallel,
    check_model,
    refuse_padding,
)
from tokenring.inference import CACHED_CALL, cached_attn, step_strategy
from tokenring.kvcache import DistributedKVCache
from tokenring.model.costmodel import Hardware
from tokenring.model.planner import calibrate
from tokenring.runtime.comm import Communicator
from tokenring.strategies.cached import CachedStrategy, CacheStep

try:
    import transformers
    from transformers import Cache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
    from transformers.cache_utils import CacheLayerMixin
    from transformers.generation.configuration_utils import GenerationMode
except ImportError as exc:  # pragma: no cover - tokenring.hf checks first
    raise ImportError(
        f"tokenring.hf.generate needs transformers >= {MIN_TRANSFORMERS}: "
        "pip install 'tokenring-attention[hf]'"
    ) from exc
_check_transformers(transformers.__version__)

__all__ = ["ShardedKVCache", "generate"]

_CACHE_KWARGS = ("cache", "past_key_values")  # the cache's name in the forward (5, 4.x)


class _ShardedLayer(CacheLayerMixin):
    """A layer of a :class:`ShardedKVCache`: ``update`` hands the new rows back unchanged."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: ShardedKVCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.owner._in_step:  # its K/V never reach a call outside generate's steps
            raise ValueError(
                "a ShardedKVCache runs inside tokenring.hf.generate (which places each step's "
                "tokens on the ranks); got a model call outside generate's steps (to continue "
                "from a generate call, run generate again on its sequences)"
            )
        self.is_initialized = True
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class ShardedKVCache(Cache):
    """A ``transformers.Cache`` whose K/V are a :class:`tokenring.DistributedKVCache` over
    ``sequence_parallel.group`` (Note [Generation under sequence parallelism]);
    :func:`generate` makes one per call and returns it with ``return_dict_in_generate=True``.

    Args:
        config: the model's config (its text config: layers, heads, head dim).
        sequence_parallel: a ``tokenring.hf.SequenceParallel``: its group, and its
            ``hardware`` for ``strategy="auto"`` (None: measured by the first step).
        strategy: ``"auto"`` or a cached strategy (``"pass_q"``, ``"pass_kv"``, ``"direct"``,
            ``"tree"``) for every step.
        block_size: of the DistributedKVCache; None: ``min(64, ceil(T / P))`` for a first
            prefill of T tokens, so a short prompt is still spread over every rank.
        budget_bytes: the most K/V bytes a rank may reserve (None: no limit).

    Raises:
        ValueError: an unknown strategy, hardware with a forced strategy, a block_size below 1,
            or a config without layers and heads.
    """

    def __init__(
        self,
        config: Any,
        sequence_parallel: Any,
        *,
        strategy: CachedStrategy | str = "auto",
        block_size: int | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        sequence_parallel = as_sequence_parallel(sequence_parallel)
        if strategy != "auto":
            strategy = CachedStrategy.parse(strategy)
            if sequence_parallel.hardware is not None:
                raise ValueError(
                    "SequenceParallel.hardware only plans strategy='auto'; got hardware="
                    f"{sequence_parallel.hardware!r} with strategy={strategy.value!r}"
                )
        check_int("block_size", block_size, 1, optional=True)
        check_int("budget_bytes", budget_bytes, 0, optional=True)
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        try:
            self.num_layers = int(text.num_hidden_layers)
            self.heads_q = int(text.num_attention_heads)
            heads_kv = getattr(text, "num_key_value_heads", None)
            self.heads_kv = int(heads_kv) if heads_kv is not None else self.heads_q
            head_dim = getattr(text, "head_dim", None)
            self.head_dim = int(head_dim) if head_dim else int(text.hidden_size) // self.heads_q
        except AttributeError as exc:
            raise ValueError(
                f"config must give num_hidden_layers, num_attention_heads and hidden_size; {exc}"
            ) from exc
        self.sequence_parallel = sequence_parallel
        self.strategy: CachedStrategy | str = strategy
        self.hardware: Hardware | str | None = sequence_parallel.hardware
        """What ``"auto"`` plans for: ``sequence_parallel.hardware``, or when that is None this
        machine, measured once by the first step (``tokenring.model.planner.calibrate``)."""
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.kv: DistributedKVCache | None = None
        """The K/V, made at the first step (when the batch size is known)."""
        self.strategies: list[CachedStrategy] = []
        """The cached strategy each step ran, in order (the prefill first)."""
        self._seen = 0
        self._placeholder = False  # this rank runs one placeholder row this step
        # a step of generate runs (begin_step to end_step): a model call outside one would
        # attend over its new tokens alone (the cached K/V live in self.kv), so update refuses
        self._in_step = False
        self._written = False  # K/V appended: the cache's sizes are the layers' from now on
        self.call_signature: dict[str, Any] = {}
        """What the ranks' generate calls must agree on (:func:`generate`'s options), checked
        with the first step's token ids."""
        self.first_step_begun = False
        """Whether the first step's rank check began: a rank that fails before it tells its
        peers there (:func:`generate`)."""
        self.exchanging = False
        """An exchange of a step is in progress, or raised: its failure reaches every rank
        (Note [A step that fails on one rank])."""
        self.peers_next: str | None = None
        """The rank check the peers meet next, where this rank's failure is posted; None: they
        may be in a transfer or collective (Note [A step that fails on one rank])."""
        self.max_time: _AgreedMaxTime | None = None
        """The criterion that all-reduces between the steps, if generate has one."""
        self.attention_layers: tuple[int, ...] = tuple(range(self.num_layers))
        """The layer indices that run attention, in order (:func:`generate` reads them from
        the model: Note [Layers without attention]); the K/V cache holds these alone."""
        super().__init__(layers=[_ShardedLayer(self) for _ in range(self.num_layers)])

    @property
    def communicator(self) -> Communicator:
        """The group's communicator."""
        return self.sequence_parallel.communicator

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens of each sequence cached before the step in progress."""
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen + query_length, 0

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"{what} is not supported by tokenring's ShardedKVCache (its shards live on "
            "several ranks and are append-only)"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise self._unsupported("reordering the cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        raise self._unsupported("cropping the cache (assisted decoding, rollbacks)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise self._unsupported("repeating the cache's batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise self._unsupported("selecting from the cache's batch")

    def reset(self) -> None:
        raise self._unsupported("resetting the cache (make a new one)")

    @contextlib.contextmanager
    def exchange(self, peers_next: str | None = None) -> Iterator[None]:
        """Mark an exchange of every rank (Note [A step that fails on one rank]): in progress
        while the block runs, and still after it raised; ``peers_next`` after it returned."""
        self.exchanging = True
        yield
        self.exchanging = False
        self.peers_next = peers_next

    def fail(self, exc: Exception) -> None:
        """Tell the peers that this rank's generate failed with ``exc`` outside an exchange
        (Note [A step that fails on one rank]): at the rank check they meet next, where it
        raises ``exc``, or by failing the communicator."""
        if self.exchanging:
            return
        if self.peers_next == MAX_TIME and self.max_time is not None:
            self.max_time.stop_every_rank()  # then they meet generate's last check
        if self.peers_next is not None:
            self.communicator.agree(None, exc, what=self.peers_next)  # raises exc
        else:
            self.communicator.abandon(exc)

    def begin_step(
        self, input_ids: torch.Tensor, *, dtype: torch.dtype, device: torch.device
    ) -> CacheStep:
        """Steps 1 to 3 of Note [Generation under sequence parallelism]. Collective."""
        comm = self.communicator
        with self.exchange():
            self._agree_on_ids(input_ids)
        batch, num_new = input_ids.shape
        if self.kv is None:
            block_size = self.block_size or min(64, -(-num_new // comm.world_size))
            self.kv = DistributedKVCache(
                num_layers=len(self.attention_layers),
                batch=batch,
                heads_kv=self.heads_kv,
                head_dim=self.head_dim,
                dtype=dtype,
                device=device,
                block_size=block_size,
                budget_bytes=self.budget_bytes,
                group=comm,
            )
            if self.strategy == "auto" and self.hardware is None:  # once per cache
                with self.exchange():
                    self.hardware = calibrate(comm, dtype=dtype, device=device)
        step = self.kv.begin_step([num_new] * batch, check_ranks=False)  # agreed above
        chosen = step_strategy(self.strategy, self.kv, heads_q=self.heads_q, hardware=self.hardware)
        self.strategies.append(chosen)
        self._in_step = True
        self.peers_next = CACHED_CALL  # the first layer's
        return step

    def finish(self, sequences: torch.Tensor) -> None:
        """Check that every rank ended generate at the same step with the same
        ``sequences``, or every rank raises (Note [Generation ends agreed]). Collective."""
        with self.exchange():
            self._agree_on_ids(sequences, finished=True)

    def _agree_on_ids(self, input_ids: torch.Tensor, *, finished: bool = False) -> None:
        """Check ``input_ids`` (a step's new ids; ``finished``: generate's sequences) and that
        every rank holds the same ones at the same point, or every rank raises."""

        first = not self.first_step_begun
        self.first_step_begun = True

        def validate() -> tuple[None, dict[str, Any]]:  # the signature: a digest of the ids
            if input_ids.dim() != 2 or input_ids.shape[1] < 1:
                raise ValueError(
                    "input_ids must have shape (batch, new tokens >= 1); got "
                    f"{tuple(input_ids.shape)}"
                )
            if not finished and self.kv is not None and input_ids.shape[0] != self.kv.batch:
                raise ValueError(
                    f"the cache holds {self.kv.batch} sequences; got input_ids of batch "
                    f"{input_ids.shape[0]}"
                )
            ids = input_ids.detach().to("cpu", torch.int64).contiguous()
            digest = hashlib.sha1(ids.numpy().tobytes()).hexdigest()
            signature = {
                "shape": list(ids.shape),
                "cached": self._seen,
                "ids sha1": digest,
                "generation ended": finished,
            }
            return None, signature | (self.call_signature if first else {})

        what = FIRST_STEP if first else STEP_CHECK
        try:
            self.communicator.agreed(validate, what=what, errors=(ValueError,))
        except ValueError as exc:
            if "generation ended" in str(exc):  # one rank's loop ended, another's went on
                raise ValueError(
                    "the ranks stopped generating at different steps: a stopping criterion "
                    "decided differently on different ranks (stopping_criteria, stop_strings "
                    "or a logits processor that ends sequences must decide alike on every "
                    f"rank); {exc}"
                ) from exc
            if "ids sha1" in str(exc):  # the ranks differ (no check's own error says this)
                raise ValueError(
                    "the ranks hold different token ids at this generation step: every rank "
                    "must pass the same input_ids, and with do_sample=True seed every rank "
                    "alike (torch.manual_seed) so that they draw the same tokens; "
                    f"{exc}"
                ) from exc
            raise

    def _fit(self, query: torch.Tensor, key: torch.Tensor, layer: int) -> None:
        """Size the cache by the keys the layers give ``(1, Hkv, n, D)``, not the config's
        fields: a config may carry a field its model ignores (a GPT-2 or OPT config given
        ``num_key_value_heads`` or ``head_dim``), which sized the cache wrong. Before any K/V
        is written the cache is remade at the layers' sizes (every rank runs every layer: all
        remake it alike); afterwards a layer of other sizes raises."""
        heads_q, heads_kv, head_dim = query.shape[1], key.shape[1], key.shape[-1]
        if (heads_q, heads_kv, head_dim) == (self.heads_q, self.heads_kv, self.head_dim):
            return
        if self._written:
            raise NotImplementedError(
                f"layer {self.attention_layers[layer]} gives {heads_q} query and {heads_kv} K/V "
                f"heads of head dim "
                f"{head_dim}; the cache holds {self.heads_kv} K/V heads of dim {self.head_dim} "
                f"for {self.heads_q} query heads, from the layers before (layers of different "
                "attention sizes are not supported by tokenring.hf.generate)"
            )
        old = self.kv
        assert old is not None and old.step is not None
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, head_dim
        self.kv = DistributedKVCache(
            num_layers=old.num_layers,
            batch=old.batch,
            heads_kv=heads_kv,
            head_dim=head_dim,
            dtype=old.dtype,
            device=old.device,
            block_size=old.block_size,
            budget_bytes=old.budget_bytes,
            group=self.communicator,
        )
        self.kv.begin_step(list(old.step.new), check_ranks=False)  # the same placement
        self.strategies[-1] = step_strategy(
            self.strategy, self.kv, heads_q=heads_q, hardware=self.hardware
        )

    def end_step(self) -> None:
        assert self.kv is not None
        self._seen = self.kv.lengths[0]
        self._in_step = False

    def attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float | None,
        mask: _ModelMask = _PLAIN_CAUSAL,
    ) -> torch.Tensor:
        """One layer's attention of the step's new rows: ``(1, H, n, D)`` in, ``(1, n, Hq, D)``
        out. Plain causal only (``mask``: the layer's; a sliding window or chunk that the
        sequence so far fits in is the same)."""
        if getattr(module, "attn_temperature_tuning", False) and not getattr(
            module, "use_rope", True
        ):
            raise NotImplementedError(
                "attn_temperature_tuning (Llama 4's NoPE query scale) is not supported in "
                "generation"
            )
        assert self.kv is not None
        total = max(self.kv.lengths)  # tokens of each sequence, this step's included
        if not _masks_nothing(mask, total):
            raise NotImplementedError(
                f"generation runs plain causal attention over the KV cache; this layer asks for "
                f"causal={mask.causal}, window_size={mask.window_size}, "
                f"attention_chunk_size={mask.attention_chunk_size}, which masks keys of a "
                f"sequence of {total} tokens (a sliding window or a chunk runs only while the "
                "whole sequence, prompt and new tokens, fits in it)"
            )
        layer_idx = module.layer_idx
        assert isinstance(layer_idx, int), "the layer's Cache.update indexed the layers by it"
        if layer_idx not in self.attention_layers:  # every rank runs the same model
            raise NotImplementedError(
                f"layer {layer_idx} ran attention, but the model's attention layers are "
                f"{list(self.attention_layers)} (Note [Layers without attention] in "
                "tokenring.hf.generation): a model whose layers call attention other than "
                "through their modules' layer_idx is not supported by tokenring.hf.generate"
            )
        layer = self.attention_layers.index(layer_idx)  # its layer of self.kv
        self._fit(query, key, layer)
        dims = (query.shape[-1], key.shape[-1], value.shape[-1])
        if dims != (self.head_dim,) * 3:  # DeepSeek's latent attention: V of another width
            raise NotImplementedError(
                f"generation caches K and V of head_dim={self.head_dim}; this layer gives query, "
                f"key and value head dims {dims} (multi-head latent attention, as in DeepSeek, "
                "is not supported by tokenring.hf.generate)"
            )
        assert query.shape[0] == 1, "rows are packed into batch 1"
        rows = 0 if self._placeholder else query.shape[2]
        # after the last attention layer the peers go on to the check before the logits'
        # all-reduce (Note [Layers without attention])
        peers_next = CACHED_CALL if layer < len(self.attention_layers) - 1 else LOGITS_CHECK
        with self.exchange(peers_next):
            out = cached_attn(
                query[0, :, :rows].transpose(0, 1).contiguous(),  # (n, Hq, D)
                key[0, :, :rows].transpose(0, 1).contiguous(),  # (n, Hkv, D)
                value[0, :, :rows].transpose(0, 1).contiguous(),
                cache=self.kv,
                layer=layer,
                strategy=self.strategies[-1],
                softmax_scale=scaling,
            )
        assert isinstance(out, torch.Tensor)
        self._written = True
        if self._placeholder:
            out = query.new_zeros(1, query.shape[1], query.shape[3])  # (1, Hq, D)
        return out.unsqueeze(0)  # (1, n, Hq, D)


def _masks_nothing(mask: _ModelMask, total: int) -> bool:
    """Whether ``mask`` keeps every key of plain causal attention over positions ``0..total -
    1``: a window ``(left, 0)`` with ``left >= total - 1`` (query i sees keys from ``i - left
    <= 0``) or chunks of ``>= total`` tokens (all in the first) mask none."""
    left, right = mask.window_size
    return (
        mask.causal
        and right == 0
        and (left == -1 or left >= total - 1)
        and (mask.attention_chunk_size is None or mask.attention_chunk_size >= total)
    )


_REFUSED_OPTIONS = {
    "num_beams": (1, "beam search (num_beams > 1): the cache cannot reorder its shards"),
    "assistant_model": (None, "assisted decoding (assistant_model): the cache cannot crop"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding: the cache cannot crop"),
    "assistant_early_exit": (None, "self-speculative decoding: the cache cannot crop"),
    "custom_generate": (None, "custom_generate"),
    "guidance_scale": (
        1,
        "classifier-free guidance (guidance_scale): it runs the model outside generate's steps",
    ),
    "cache_implementation": (None, "cache_implementation (generate uses a ShardedKVCache)"),
    "output_attentions": (False, "output_attentions (no attention weights are formed)"),
    "output_hidden_states": (False, "output_hidden_states (each rank holds its own rows only)"),
    "inputs_embeds": (None, "inputs_embeds (pass input_ids)"),
    "synced_gpus": (
        False,
        "synced_gpus=True (the ranks of sp.group run every step alike already; its all-reduce "
        "over the default group between the steps is outside tokenring's rank checks)",
    ),
}
"""generate option -> (the only value that runs, why any other does not)."""


_REFUSED_MODES = {
    GenerationMode.CONTRASTIVE_SEARCH: "contrastive search (penalty_alpha > 0 with top_k > 1)",
    GenerationMode.DOLA_GENERATION: "DoLa decoding (dola_layers)",
    GenerationMode.GROUP_BEAM_SEARCH: "group beam search (num_beam_groups > 1)",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "constrained beam search (force_words_ids)",
    GenerationMode.ASSISTED_GENERATION: "assisted decoding (use_mtp): the cache cannot crop",
    GenerationMode.BEAM_SEARCH: "beam search (num_beams > 1)",
    GenerationMode.BEAM_SAMPLE: "beam search (num_beams > 1)",
}
"""transformers' generation modes other than greedy search and sampling. Those that transformers
moved to Hub repositories (contrastive, DoLa, group and constrained beam search) asked for
``trust_remote_code=True`` and then ran that code over the sharded cache: refused whatever
``trust_remote_code`` says."""


_SEPARATE_CALLS = "generate prompts of different lengths in separate calls"
_TOKEN_OPTIONS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def _check_token_ids(option: str, value: Any) -> None:
    """ValueError naming ``option`` unless ``value`` is None, a token id (an int >= 0), a
    list of them, or an integer tensor."""
    if value is None:
        return
    if (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and value.dtype != torch.bool
    ):
        return
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(
            f"{option} must be a token id (an int >= 0), a list of them or an integer tensor; "
            f"got {value!r}"
        )


def _check_options(model: Any, gen_kwargs: dict[str, Any]) -> None:
    config = gen_kwargs.get("generation_config")
    if config is not None and not isinstance(config, GenerationConfig):
        raise ValueError(
            "generation_config must be a transformers.GenerationConfig; got "
            f"{type(config).__name__}"
        )
    for option in _TOKEN_OPTIONS:  # transformers fails on another type with no name
        _check_token_ids(option, gen_kwargs.get(option))
    given = config or getattr(model, "generation_config", None)
    base = given or GenerationConfig()
    for option, (allowed, why) in _REFUSED_OPTIONS.items():
        value = gen_kwargs[option] if option in gen_kwargs else getattr(base, option, None)
        if value is None:
            continue  # unset: the default runs
        if allowed is None or value != allowed:
            shown = value if isinstance(value, (bool, int, float, str)) else type(value).__name__
            raise NotImplementedError(
                f"tokenring.hf.generate does not support {why}; got {option}={shown!r}"
            )
    if gen_kwargs.get("use_cache", getattr(base, "use_cache", True)) is False:
        raise ValueError("tokenring.hf.generate runs with its KV cache; got use_cache=False")
    for name in _CACHE_KWARGS:
        if gen_kwargs.get(name) is not None:
            raise NotImplementedError(
                f"continuing from a cache ({name}=...) is not supported; tokenring.hf.generate "
                "makes a ShardedKVCache per call"
            )
    refuse_padding(gen_kwargs.get("attention_mask"), _SEPARATE_CALLS)
    merged = copy.deepcopy(base)
    merged.update(**{k: v for k, v in gen_kwargs.items() if k != "generation_config"})
    mode = merged.get_generation_mode(gen_kwargs.get("assistant_model"))
    if mode in _REFUSED_MODES:  # the options above name most; transformers' mode the rest
        raise NotImplementedError(
            f"tokenring.hf.generate runs greedy search and sampling; got {_REFUSED_MODES[mode]}"
        )


def _check_call(
    sp: SequenceParallel, model: Any, input_ids: Any, gen_kwargs: dict[str, Any]
) -> None:
    """:func:`generate`'s arguments, checked on this rank (its Raises but the token ids)."""
    if sp.seq_len is not None or sp.cu_seqlens is not None:
        raise ValueError(
            "generation places each step's tokens itself: pass a SequenceParallel without "
            f"seq_len and cu_seqlens; got seq_len={sp.seq_len}, cu_seqlens={sp.cu_seqlens}"
        )
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            "model must run a tokenring attention (attn_implementation one of "
            f"{sorted(ATTN_IMPLEMENTATIONS)}, after tokenring.hf.register()); got {impl!r}"
        )
    check_model(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ValueError(f"input_ids must be a (batch, seq) tensor; got {shape!r}")
    _check_options(model, gen_kwargs)


def generate(
    sp: Any,
    model: Any,
    input_ids: torch.Tensor,
    *,
    strategy: CachedStrategy | str = "auto",
    block_size: int | None = None,
    budget_bytes: int | None = None,
    **gen_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **gen_kwargs)`` with the KV cache sharded over ``sp.group``
    (Note [Generation under sequence parallelism]), on every rank with the same arguments.

    Args:
        sp: a ``tokenring.hf.SequenceParallel`` (its group; ``hardware`` for ``"auto"``).
            Its ``layout`` is not read: the prefill lays the prompt out itself (zigzag where
            2P divides it, else block-cyclic).
        model: a transformers causal LM whose ``attn_implementation`` is a tokenring name
            (``tokenring.hf.register()``); which one does not matter here: every step runs
            the cached plan that ``strategy`` picks, and the prefill pass-Q or pass-KV.
            ``model.compile()`` compiles the steps; ``torch.compile(model)`` generates through
            its original module, uncompiled, as transformers' ``generate`` on it does.
        input_ids: ``(B, S)`` prompts of equal length, the same on every rank.
        strategy, block_size, budget_bytes: of the :class:`ShardedKVCache`.
        gen_kwargs: ``model.generate``'s: greedy search and sampling (seed every rank alike);
            the options of ``_REFUSED_OPTIONS`` raise; ``max_time`` stops every rank at the
            same step.

    Returns:
        What ``model.generate`` returns: ``(B, S + new)`` ids, or its output object.

    Raises:
        ValueError: a model without a tokenring attention, input_ids not 2-D, use_cache=False,
            sp with seq_len or cu_seqlens, ranks whose token ids differ (the sequences
            returned too), or ranks that stopped at different steps (Note [Generation ends
            agreed]).
        NotImplementedError: an option of ``_REFUSED_OPTIONS`` or a generation mode of
            ``_REFUSED_MODES`` (contrastive search, DoLa, ...), a padding attention_mask, a
            cache to continue from, a sliding window or chunked attention once the sequence
            outgrows it (at that step, on every rank), or a layer that mixes tokens other
            than by attention (``check_model``).
    """
    sp = as_sequence_parallel(sp, "sp")
    comm = sp.communicator
    cache: ShardedKVCache | None = None
    try:
        model = _generating_module(model)
        _check_call(sp, model, input_ids, gen_kwargs)
        cache = ShardedKVCache(
            model.config, sp, strategy=strategy, block_size=block_size, budget_bytes=budget_bytes
        )
        cache.attention_layers = _attention_layers(model, cache.num_layers)
        gen_kwargs = _without_synced_gpus(sp, model, gen_kwargs)
        cache.call_signature = _call_signature(model, gen_kwargs, cache)
        gen_kwargs = _agreed_max_time(model, gen_kwargs, cache)
        with _sharded_forward(model, cache, _padding_hint(model, gen_kwargs)):
            out = model.generate(input_ids, cache=cache, **gen_kwargs)
        cache.finish(out if isinstance(out, torch.Tensor) else out.sequences)
        return out
    except Exception as exc:
        if cache is None or not cache.first_step_begun:
            # the peers wait in the first step's check: they learn this rank's error there
            comm.agree(None, exc, what=FIRST_STEP)
        else:  # Note [A step that fails on one rank]
            cache.fail(exc)
        raise


# Note [Layers without attention]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A model's config counts its layers (num_hidden_layers), not its attention calls: a layer may
# mix no tokens at all (an MLP-only block between attention blocks, as DeciLM / Nemotron-NAS
# layers without attention), and check_model lets it pass. The cache held a K/V shard for
# every layer and took the layer of num_hidden_layers - 1 for the last attention call: the
# second step raised "layers [2] have not appended the K/V" on every rank (no such model could
# generate), and a rank failing after the last attention call in the first step posted its
# error to the next layer's cached_attn check while its peers waited in the logits' one. So
# generate reads the layer indices of the attention modules (those routing through
# transformers' AttentionInterface, in their forward or in a base class's forward that theirs
# calls: a subclass that logs or wraps the model's attention was left out, and generate
# refused a model it ran before) of the model's decoder: the cache holds those layers alone
# and the last of them hands over to the logits' check. Without any such module found, every
# layer counts.
def _attention_layers(model: Any, num_layers: int) -> tuple[int, ...]:
    """The ``layer_idx`` of each attention module of ``model``'s decoder, sorted (Note
    [Layers without attention]); every layer when none is found or one is out of range."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = model
    if callable(get_decoder):
        with contextlib.suppress(Exception):  # a model without a decoder of its own
            decoder = get_decoder() or model
    found = {
        module.layer_idx
        for module in decoder.modules()
        if _routes_attention(module) and isinstance(getattr(module, "layer_idx", None), int)
    }
    if not found or not all(0 <= i < num_layers for i in found):
        return tuple(range(num_layers))
    return tuple(sorted(found))


# Note [Generation under FSDP or ZeRO-3]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers' generate turns synced_gpus on by default for a model under FSDP (FSDP1's
# wrapper, or transformers' own FSDP2) or with DeepSpeed ZeRO-3 over several processes: every
# step all-reduces "this rank finished" over the default group, so that ranks whose sequences
# ended early keep running the forward their sharded parameters' all-gathers need. That
# all-reduce lies outside tokenring's rank checks (Note [A step that fails on one rank]): a
# rank failing between the steps left its peers in it for the default group's timeout. An
# explicit synced_gpus=True is refused; its default is decided here, alike on every rank:
#
#     sp.group spans the default group     synced_gpus=False: every rank of the world is a
#                                          rank of sp.group, which steps alike (the step check
#                                          compares the ids, Note [Generation ends agreed]
#                                          the end): each runs the same forwards, what
#                                          synced_gpus ensures
#     ranks outside sp.group (other data-  NotImplementedError: their generate calls end at
#       parallel replicas)                 their own steps, so sharded parameters need
#                                          synced_gpus, whose all-reduce tokenring cannot check
def _without_synced_gpus(sp: SequenceParallel, model: Any, gen_kwargs: dict[str, Any]) -> dict:
    """``gen_kwargs`` with synced_gpus=False where transformers would turn it on and every
    rank of the default group is one of ``sp.group``'s; NotImplementedError where others are
    (Note [Generation under FSDP or ZeRO-3])."""
    if gen_kwargs.get("synced_gpus") is not None or not dist.is_initialized():
        return gen_kwargs  # True is refused by _check_options; False runs as given
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    world_size = dist.get_world_size()
    if world_size == 1 or not (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)):
        return gen_kwargs
    group_size = sp.communicator.world_size
    if group_size != world_size:
        raise NotImplementedError(
            f"tokenring.hf.generate of a model under FSDP or DeepSpeed ZeRO-3 over a sp.group of "
            f"{group_size} of the {world_size} ranks: transformers would pass synced_gpus=True "
            "(its all-reduce over every rank between the steps keeps the other groups' "
            "forwards going for the sharded parameters), which lies outside tokenring's rank "
            "checks; generate over a sp.group of every rank, or with the parameters gathered "
            "(a model that is not sharded)"
        )
    return gen_kwargs | {"synced_gpus": False}


def _generating_module(model: Any) -> Any:
    """The module whose forward ``model.generate`` calls, which the steps hook: the module
    itself, or the one under ``torch.compile``'s wrapper (an ``OptimizedModule`` hands
    ``generate`` to its original module, which calls its own forward, uncompiled: as
    transformers' generate on it). Hooked on the wrapper, the steps never ran their hooks
    and the model's first layer raised that it ran outside generate's steps."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


FIRST_STEP = "generate call"
"""The first step's rank check (Note [Generation options agreed])."""
STEP_CHECK = "generation step"
"""The rank check of every later step, and of the sequences generate returns."""
MAX_TIME = "generate max_time"
"""The all-reduce of _AgreedMaxTime between the steps."""
LOGITS_CHECK = "generate logits"
"""The rank check before the logits' all-reduce (Note [A step that fails on one rank])."""

# Note [A step that fails on one rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Between the rank checks every rank runs code of its own: transformers' logits processors
# and stopping criteria (a user's, prefix_allowed_tokens_fn), the step's input preparation,
# the model's layers. One that raised on one rank alone left its peers waiting out the
# timeout in the next step's check or in the step's first cached attention call. Each rank's
# ShardedKVCache knows where its peers wait next, from the exchanges it has made::
#
#     after the logits' all-reduce            the next step's check (or generate's last,
#       (or max_time's, between the steps)    of the sequences): "generation step"
#     after the logits' all-reduce, with      max_time's all-reduce: the failing rank takes
#       max_time's still to come              part with FAILED, which stops every rank's
#                                             generate, then "generation step" (the last)
#     after the step's check and placement,   the next layer's cached_attn check: "cached
#       or a layer's cached_attn but the last   attention call"
#     after the last layer's cached_attn      the check before the logits' all-reduce:
#                                             "generate logits"
#
# A rank whose generate raises outside an exchange (ShardedKVCache.exchange) posts its error
# to the check its peers meet next, so every rank raises at once naming it ("rank r cannot
# run this generate logits: ..."). The logits' check is there for that alone (a hook on the
# final norm or the LM head that raised on one rank left its peers in the all-reduce, which
# waited for its timeout): one digest exchange per step, beside the step's and the layers'.
# Where no check is known (before the first step's) it fails the communicator
# (Communicator.abandon): its peers' transfers and checks end at once naming it (Note
# [Failures through the store] in tokenring.runtime.comm). An error of an exchange reached
# every rank already.
# transformers' synced_gpus adds an all-reduce over the default group between the steps,
# outside tokenring's checks: a failing rank could not reach its peers there, and the ranks of
# sp.group step alike anyway, so it is refused.

# Note [Generation ends agreed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each rank's model.generate decides on its own when to stop, and draws the last token on its
# own: a token fed back is checked by the next step's id check, the last one never is. So
# ranks seeded apart returned different sequences without a word, and a stopping criterion
# that stopped one rank a step early returned there while its peers waited in the next step
# (they raised "ranks are in different calls", naming the stopped rank's next call). Once
# model.generate returns, every rank checks its sequences in the same check as the steps
# (ShardedKVCache.finish: "generation ended" in the signature): a rank still stepping meets
# an ended one there and every rank raises naming the stop; sequences that differ raise as
# the ids of a step do. max_time, a stop by each rank's own clock, is decided alike: its
# criterion (_AgreedMaxTime) stops every rank once any rank's clock passed it.


class _AgreedMaxTime(StoppingCriteria):
    """transformers' ``MaxTimeCriteria`` decided alike on every rank of ``cache``'s group:
    every sequence stops once any rank's clock passed ``max_time`` seconds since generate
    began (an all-reduce per step)."""

    FAILED = 2
    """The flag of a rank that failed before this step's all-reduce: every rank stops too,
    and meets its error in generate's last check (Note [A step that fails on one rank])."""

    def __init__(self, max_time: float, cache: ShardedKVCache) -> None:
        self.max_time = max_time
        self.cache = cache
        self.start = time.time()
        cache.max_time = self

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        late = time.time() - self.start > self.max_time
        flag = self._all_reduce(int(late), input_ids.device)
        return torch.full(
            (input_ids.shape[0],), flag > 0, dtype=torch.bool, device=input_ids.device
        )

    def stop_every_rank(self) -> None:
        """This rank's generate failed before the all-reduce: take part with FAILED."""
        assert self.cache.kv is not None, "a step ran before"
        self._all_reduce(self.FAILED, self.cache.kv.device)

    def _all_reduce(self, flag: int, device: torch.device) -> int:
        """The largest ``flag`` over the ranks."""
        wire = torch.tensor([flag], dtype=torch.int32, device=device)
        comm = self.cache.communicator
        if comm.world_size > 1:
            with self.cache.exchange(STEP_CHECK):
                comm.all_reduce(wire, op=dist.ReduceOp.MAX, label=MAX_TIME).wait()
        return int(wire.item())


def _agreed_max_time(
    model: Any, gen_kwargs: dict[str, Any], cache: ShardedKVCache
) -> dict[str, Any]:
    """``gen_kwargs`` with max_time (a keyword's or the generation config's) replaced by an
    :class:`_AgreedMaxTime` stopping criterion (Note [Generation ends agreed])."""
    config = gen_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_time = gen_kwargs.get("max_time", getattr(config, "max_time", None))
    if isinstance(max_time, bool) or not isinstance(max_time, (int, float)):
        return gen_kwargs  # None, or a value transformers refuses
    given = gen_kwargs.get("stopping_criteria") or []
    criteria = StoppingCriteriaList([*given, _AgreedMaxTime(float(max_time), cache)])
    return gen_kwargs | {"max_time": None, "stopping_criteria": criteria}


# Note [Generation options agreed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every rank runs its own model.generate, so an option one rank alone was given changed that
# rank alone: max_new_tokens or eos_token_id ended its loop early (its peers waited for it in
# the next step), do_sample or temperature drew other tokens (the step check named the token
# ids, not the option). generate's options, as transformers merges them (the generation
# config's fields that differ from the defaults, then every keyword that is not one), travel
# with the first step's token ids: one exchange, which names the option that differs (all but
# a streamer, which changes no token: one rank alone may print them). A rank that fails
# before that check (its own refusal, or transformers' validation inside model.generate)
# posts its error to the same check, so its peers raise at once, naming it. The cache's
# budget_bytes and sp.hardware travel too: the step after the check plans and reserves from
# them without a word between the ranks, so a rank given its own budget or hardware raised
# there alone while its peers waited in the first attention for the timeout.


_RANK_LOCAL = frozenset({"streamer"})
"""generate options that change no token: a rank may pass one alone (rank 0 prints)."""


def _call_signature(
    model: Any, gen_kwargs: dict[str, Any], cache: ShardedKVCache
) -> dict[str, Any]:
    """generate's options as the ranks must agree on them (Note [Generation options agreed])."""
    given = gen_kwargs.get("generation_config")
    base = copy.deepcopy(given if given is not None else model.generation_config)
    if base is None:
        base = GenerationConfig()
    rest = base.update(**{k: v for k, v in gen_kwargs.items() if k != "generation_config"})
    options = {name: _described(value) for name, value in base.to_diff_dict().items()}
    options |= {name: _described(v) for name, v in rest.items() if name not in _RANK_LOCAL}
    strategy = cache.strategy
    options["strategy"] = strategy if isinstance(strategy, str) else strategy.value
    options["block_size"] = cache.block_size
    options["budget_bytes"] = cache.budget_bytes
    hardware = cache.sequence_parallel.hardware  # None: calibrated alike by every rank
    options["hardware"] = (
        hardware if hardware is None or isinstance(hardware, str) else repr(hardware)
    )
    return options


def _described(value: Any) -> Any:
    """``value`` as JSON the ranks compare: a tensor by shape, dtype and digest, an object
    that is neither by its type."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # nan and inf too
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest = hashlib.sha1(data.numpy().tobytes()).hexdigest()[:16]
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "sha1": digest}
    if isinstance(value, (list, tuple)):
        return [_described(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _described(v) for k, v in value.items()}
    return type(value).__qualname__


def _padding_hint(model: Any, gen_kwargs: dict[str, Any]) -> str:
    """What a padding mask that reaches the model means: without an ``attention_mask`` given,
    transformers derived it from the pad token in the prompt."""
    if gen_kwargs.get("attention_mask") is not None:
        return _SEPARATE_CALLS
    config = gen_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    pad = gen_kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    return (
        f"no attention_mask was given: transformers derived one from pad_token_id={pad!r}, "
        "which input_ids hold (pass attention_mask=torch.ones_like(input_ids) where those "
        f"tokens are not padding, or {_SEPARATE_CALLS})"
    )


@contextlib.contextmanager
def _sharded_forward(
    model: torch.nn.Module, cache: ShardedKVCache, padding_hint: str = ""
) -> Iterator[None]:
    """Hook ``model``'s forward (Note [Generation under sequence parallelism]);
    ``padding_hint`` ends the error for a padding mask."""
    state: dict[str, Any] = {}

    # host code: placement, the step's checks and exchanges; under model.compile() dynamo
    # traced it, recompiling per step kind until its recompile limit (Note [The attention
    # function under torch.compile] in tokenring.hf.attention)
    @torch.compiler.disable(reason=_EAGER)
    def before(
        module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:  # module: the PreTrainedModel
        input_ids = _step_input_ids(cache, args, kwargs, padding_hint)
        step = cache.begin_step(input_ids, dtype=module.dtype, device=input_ids.device)
        local_ids, keep, ends = _local_rows(step, cache.communicator.rank, input_ids)
        state.update(batch=input_ids.shape[0], ends=ends)
        local_positions = step.positions(cache.communicator.rank).to(input_ids.device).unsqueeze(0)
        cache._placeholder = local_ids.shape[1] == 0
        if cache._placeholder:
            local_ids = local_positions = input_ids.new_zeros(1, 1)
        kwargs["input_ids"] = local_ids
        kwargs["position_ids"] = local_positions
        kwargs["logits_to_keep"] = torch.tensor(keep, dtype=torch.int64, device=input_ids.device)
        kwargs["sequence_parallel"] = cache.sequence_parallel
        kwargs["sequence_parallel_cache"] = cache
        return args, kwargs

    @torch.compiler.disable(reason=_EAGER)
    def after(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        cache.end_step()
        logits = output["logits"]  # (1, k, V): the rows this rank ends
        full = logits.new_zeros(state["batch"], logits.shape[-1])  # (B, V)
        for i, b in enumerate(state["ends"]):
            full[b] = logits[0, i]
        with cache.exchange(MAX_TIME if cache.max_time else STEP_CHECK):
            # where a rank that failed after the last layer posts its error (Note [A step
            # that fails on one rank]): every rank raises it before the all-reduce
            cache.communicator.agree({}, None, what=LOGITS_CHECK)
            cache.communicator.all_reduce(full, label="generate logits").wait()
        output["logits"] = full.unsqueeze(1)  # (B, 1, V)
        return output

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        cache._in_step = False  # a step that raised never ended
        for handle in handles:
            handle.remove()


def _step_input_ids(
    cache: ShardedKVCache, args: tuple[Any, ...], kwargs: dict[str, Any], padding_hint: str = ""
) -> torch.Tensor:
    """The checked global input ids ``(B, T)`` of a step; pops the mask and position ids."""
    given = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if args or given is not cache:  # generate's own steps pass its cache, by keyword
        got = f"{len(args)} positional input(s)" if args else f"cache={type(given).__name__}"
        got = "no cache" if not args and given is None else got
        raise NotImplementedError(
            "the model ran inside tokenring.hf.generate outside generate's own steps (a logits "
            "processor or stopping criterion that calls the model, as classifier-free "
            "guidance's does), which tokenring.hf.generate does not support; got a call with "
            f"{got} (generate's steps pass its ShardedKVCache, by keyword)"
        )
    input_ids = kwargs.get("input_ids")
    if input_ids is None:
        raise NotImplementedError("tokenring.hf.generate needs input_ids (not inputs_embeds)")
    refuse_padding(kwargs.pop("attention_mask", None), padding_hint)
    past = cache.get_seq_length()
    positions = kwargs.pop("position_ids", None)
    want = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
    if positions is not None and not bool((positions == want).all()):
        raise NotImplementedError(
            "position_ids other than the token positions are not supported by "
            "tokenring.hf.generate (it derives each rank's positions); got position_ids "
            f"{positions.reshape(-1, positions.shape[-1])[0].tolist()} for tokens at "
            f"{want.tolist()}"
        )
    return input_ids


def _local_rows(
    step: CacheStep, rank: int, input_ids: torch.Tensor
) -> tuple[torch.Tensor, list[int], list[int]]:
    """This rank's new ids ``(1, n)``, the local rows that end a sequence and which one."""
    rows: list[torch.Tensor] = []
    keep: list[int] = []
    ends: list[int] = []
    offset = 0
    for b, held in enumerate(step.new_positions[rank]):
        rows.append(input_ids[b, (held - step.cached[b]).to(input_ids.device)])
        if held.numel() and int(held[-1]) == step.cached[b] + step.new[b] - 1:
            keep.append(offset + held.numel() - 1)
            ends.append(b)
        offset += held.numel()
    return torch.cat(rows).unsqueeze(0), keep, ends
