"""Audit of tokenring.hf over every architecture of transformers: what a sweep of all of them
(tiny configs, float64, 2 and 3 ranks against one process) found, and a sample of those that
were not covered before and match.

The oracle is the same tiny model (AutoConfig.for_model, seeded weights spread wider than the
default init) in one process with transformers' own SDPA attention, float64: logits within
1e-10 and every parameter's gradient within 1e-10 of its largest entry (floored at 1e-3 of
the largest gradient of the model: a key bias' gradient is zero in exact arithmetic, its
rounding noise alone), ../shared/STYLE.md.

Legend: B batch, S global seq, V vocab, P world size.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AutoConfig  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from tokenring import hf  # noqa: E402

FP64 = 1e-10
SEQ = 12
VOCAB = 64
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
LLAMA_LIKE = dict(
    SMALL,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
)
EXPERTS = dict(moe_intermediate_size=16, num_experts_per_tok=2, output_router_logits=False)
LATENT = dict(
    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
    qk_nope_head_dim=8, v_head_dim=8,
)  # fmt: skip
GPT2_SIZES = dict(SMALL, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def _model_class(model_type: str) -> Any:
    """The causal LM class of ``model_type``, else its masked LM, else its base model."""
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        modeling_auto.MODEL_MAPPING_NAMES,
    ):
        if model_type in mapping:
            return getattr(transformers, mapping[model_type])
    raise KeyError(model_type)


def _model(model_type: str, sizes: dict[str, Any], attn_implementation: str) -> Any:
    """The seeded float64 model of ``sizes`` (the config's constructor arguments)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    config = AutoConfig.for_model(model_type, **sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = _model_class(model_type)._from_config(
            config, attn_implementation=attn_implementation, experts_implementation="eager"
        )
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.double().eval()


def _input_ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def _output(out: Any) -> torch.Tensor:
    """Logits, or a base model's last hidden state."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _sharded_output(model: Any, batch: Any, sp: Any) -> torch.Tensor:
    """The model's output on this rank's shard of the batch."""
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
    return _output(out)


def _weights(shape: tuple[int, ...]) -> torch.Tensor:
    """Fixed weights of the scalar sum(output * w) whose gradient is checked."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


# -- architectures the sweep covered first, that match one process ----------------------------

# (model_type, config arguments): Qwen2-MoE's default config, which sets sliding_window=0 for
# "no window" (its full-attention layers never get the sliding mask it also builds: our mask
# function raised "sliding_window must be >= 1 ... got 0" for every forward); GPT-2's learned
# positions and Conv1D projections; OPT's positions offset by 2; CodeGen's partial rotary over
# interleaved pairs; BioGPT's scaled embeddings; MiniCPM3's latent attention; JetMoE's
# mixture of attention experts; EXAONE 4's sliding and global layers; EuroBERT, an encoder
SWEPT = (
    ("qwen2_moe", dict(LLAMA_LIKE, **EXPERTS, num_experts=4,
                       shared_expert_intermediate_size=16)),
    ("gpt2", dict(GPT2_SIZES, bos_token_id=1, eos_token_id=2)),
    ("opt", dict(SMALL, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    ("codegen", dict(GPT2_SIZES, n_ctx=64, rotary_dim=4, bos_token_id=1, eos_token_id=2)),
    ("biogpt", dict(LLAMA_LIKE, num_key_value_heads=None, pad_token_id=0)),
    ("minicpm3", dict(LLAMA_LIKE, **LATENT)),
    ("jetmoe", dict(SMALL, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
                    kv_channels=8, intermediate_size=48, num_local_experts=4,
                    num_experts_per_tok=2, output_router_logits=False)),
    ("exaone4", dict(LLAMA_LIKE, sliding_window=5)),
    ("eurobert", dict(LLAMA_LIKE, head_dim=8, pad_token_id=0, mask_token_id=3)),
)  # fmt: skip


def _sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sizes.items() if v is not None}


def rank_swept() -> dict[str, Any]:
    """Inside a rank: each model's gathered output and summed gradients, or its error."""
    hf.register()
    out: dict[str, Any] = {}
    for model_type, sizes in SWEPT:
        model = _model(model_type, _sizes(sizes), "tokenring")
        sp = hf.SequenceParallel()
        batch = hf.shard_batch(sp, _input_ids())
        try:
            got = _sharded_output(model, batch, sp)
        except NotImplementedError as exc:
            out[model_type] = str(exc)
            continue
        w = hf.attention._local(sp, _weights((2, SEQ, got.shape[-1])))
        (got * w).sum().backward()
        hf.all_reduce_gradients(sp, model)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[model_type] = (hf.gather_sequence(sp, got.detach()), grads)
    return out


def test_swept_architectures_match_one_process_on_two_ranks() -> None:
    """Qwen2-MoE with its default config raised "sliding_window must be >= 1 (model_type
    'qwen2_moe'); got 0" on every forward, for a mask none of its layers uses; it now matches
    one process, as the other architectures first covered by the sweep do (logits and every
    parameter's gradient)."""
    per_rank = tokenring.launch(rank_swept, world_size=2, timeout_s=300)
    for model_type, sizes in SWEPT:
        oracle = _model(model_type, _sizes(sizes), "sdpa")
        want = _output(oracle(input_ids=_input_ids(), position_ids=torch.arange(SEQ)[None]))
        (want * _weights(tuple(want.shape))).sum().backward()
        top = max(float(p.grad.abs().max()) for p in oracle.parameters() if p.grad is not None)
        for rank, res in enumerate(per_rank):
            assert not isinstance(res[model_type], str), f"{model_type}: {res[model_type]}"
            got, grads = res[model_type]
            err = float((got - want.detach()).abs().max())
            assert err <= FP64, f"{model_type}: rank {rank} output off by {err}"
            for name, p in oracle.named_parameters():
                if p.grad is None:
                    continue
                scale = max(float(p.grad.abs().max()), 1e-3 * top)
                err = float((grads[name] - p.grad).abs().max()) / scale
                assert err <= FP64, f"{model_type}: rank {rank} {name} off by {err} (relative)"


@pytest.mark.usefixtures("single_rank_group")
def test_a_window_under_one_raises_in_the_layer_that_gets_it() -> None:
    """The window of 0 is refused where a layer attends through it: Qwen2-MoE with a sliding
    layer and sliding_window set to 0 after its config was built."""
    sizes = dict(LLAMA_LIKE, **EXPERTS, num_experts=4, shared_expert_intermediate_size=16)
    sizes |= {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}
    hf.register()
    model = _model("qwen2_moe", sizes, "tokenring")
    assert "sliding_attention" in model.config.layer_types
    model.config.sliding_window = 0
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 0
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    with pytest.raises(NotImplementedError, match=r"sliding_window must be >= 1 .*got 0"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)


# -- models whose forward never reached tokenring's checks -------------------------------------

INDEXED = dict(LLAMA_LIKE, **EXPERTS, **LATENT, n_routed_experts=4, n_group=1, topk_group=1)
# (model_type, config arguments, what the error names): DeepSeek V3.2's sparse attention and
# its kin slice the mask for their indexer (top-k keys per query, over this rank's keys alone)
# before attention: a TypeError ('NoneType' object is not subscriptable) on ours. Hybrids of
# two layers whose first attention layer comes later: the forward ran with no attention call,
# each rank's linear attention or recurrence over its own shard (on 2 ranks Qwen3-Next's
# logits were 1.0 off one process, Qwen3.5's 0.91, RecurrentGemma's 0.34, silently)
NEVER_CHECKED = (
    ("deepseek_v32", INDEXED, "'indexed_attention'"),
    ("glm_moe_dsa", INDEXED, "'indexed_attention'"),
    ("mistral_large4_text", INDEXED, "'indexed_attention'"),
    ("qwen3_next", dict(LLAMA_LIKE, **EXPERTS, head_dim=8, num_experts=4,
                        shared_expert_intermediate_size=16), "'linear_attention'"),
    ("qwen3_5_text", dict(LLAMA_LIKE, head_dim=8), "'linear_attention'"),
    ("recurrent_gemma", dict(LLAMA_LIKE, pad_token_id=0), "'linear_attention'|'recurrent'"),
)  # fmt: skip


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("model_type", "sizes", "named"), NEVER_CHECKED, ids=[c[0] for c in NEVER_CHECKED]
)
def test_a_model_refused_before_its_first_attention_call(
    model_type: str, sizes: dict[str, Any], named: str
) -> None:
    """The mask function (run by the model's forward before any layer) now refuses what the
    attention call would: NotImplementedError naming the layer kind, on every rank alike (it
    reads the config only)."""
    hf.register()
    model = _model(model_type, sizes, "tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    refused = f"cannot split model_type '{model_type}'.*({named})"
    with pytest.raises(NotImplementedError, match=refused):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)


# -- forwards that call no tokenring attention ------------------------------------------------

# (model_type, config arguments, attn_implementation): Mamba's recurrence, FNet's Fourier
# mixing, OpenAI GPT's attention in its own code, and a Llama built with SDPA but given
# sequence_parallel=: no tokenring code ran in their forward, each rank computed over its own
# shard (on 2 ranks Mamba's logits were 1.0-4.1 off one process, OpenAI GPT's 0.04-0.1),
# silently (Note [A forward that calls no tokenring attention] in tokenring.hf.attention)
NO_ATTENTION = (
    ("mamba", dict(SMALL, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2,
                   conv_kernel=4), "tokenring"),
    ("fnet", dict(SMALL, hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                  pad_token_id=0), "tokenring"),
    ("openai-gpt", dict(SMALL, n_positions=64, n_embd=32, n_layer=2, n_head=4), "tokenring"),
    ("llama", LLAMA_LIKE, "sdpa"),
)  # fmt: skip


def rank_no_attention() -> dict[str, str]:
    """Inside a rank: what each forward raised, or "ran" (and on one rank of its own, the
    same forward with sequence_parallel= of that rank alone, which is exact)."""
    hf.register()
    out: dict[str, str] = {}
    alone = torch.distributed.new_group([torch.distributed.get_rank()])
    for model_type, sizes, implementation in NO_ATTENTION:
        model = _model(model_type, sizes, implementation)
        for key, sp in (("", hf.SequenceParallel()), (" alone", hf.SequenceParallel(group=alone))):
            batch = hf.shard_batch(sp, _input_ids())
            try:
                model(input_ids=batch.input_ids, sequence_parallel=sp)
                out[model_type + key] = "ran"
            except NotImplementedError as exc:
                out[model_type + key] = str(exc)
    return out


def test_a_forward_that_calls_no_tokenring_attention_raises_on_every_rank() -> None:
    per_rank = tokenring.launch(rank_no_attention, world_size=2, timeout_s=300)
    for rank, found in enumerate(per_rank):
        for model_type, _, implementation in NO_ATTENTION:
            said = found[model_type]
            if implementation == "sdpa":
                words = "LlamaForCausalLM ran its forward with sequence_parallel= but with "
                assert words + "attn_implementation='sdpa'" in said, f"rank {rank}: {said}"
            else:  # check_model's reason
                words = f"attn_implementation='tokenring' cannot split model_type '{model_type}'"
                assert words in said, f"rank {rank} {model_type}: {said}"
            assert found[model_type + " alone"] == "ran", f"rank {rank} {model_type}: {said}"


# -- the swept architectures under the settings the first sweep left out ---------------------

# A second sweep ran every architecture that matches above on 2, 3 and 4 ranks, zigzag and
# contiguous, odd lengths (seq_len=), packed documents of uneven lengths (one of a single
# token, an empty one), batch 1, bfloat16 and float16: every one matched (a few to the
# rounding of their own float32 routers and norms, as on zigzag). A sample of it, on 3 and 4
# ranks: (P, model_type, layout, S, documents or None, dtype). Windows and latent attention
# over documents longer than the window (EXAONE 4's window of 5, documents of 9 and 8),
# learned positions restarting at every document (GPT-2, OPT's offset of 2), a bidirectional
# encoder over documents (EuroBERT), odd lengths on both layouts, and bfloat16
LAYOUTS = (
    (3, "exaone4", "contiguous", 14, (0, 2, 11, 14), torch.float64),
    (3, "exaone4", "zigzag", 14, (0, 8, 9, 14), torch.float64),
    (3, "gpt2", "zigzag", 14, (0, 8, 9, 14), torch.float64),
    (3, "opt", "contiguous", 13, (0, 3, 3, 13), torch.float64),
    (3, "eurobert", "contiguous", 14, (0, 5, 14), torch.float64),
    (3, "minicpm3", "zigzag", 13, None, torch.float64),
    (3, "codegen", "contiguous", 13, None, torch.float64),
    (3, "exaone4", "contiguous", 13, (0, 3, 10, 13), torch.bfloat16),
    (4, "exaone4", "contiguous", 13, None, torch.float64),
    (4, "jetmoe", "zigzag", 15, (0, 1, 7, 15), torch.float64),
    (4, "biogpt", "zigzag", 16, None, torch.float64),
    (4, "eurobert", "zigzag", 15, (0, 9, 15), torch.float64),
)  # fmt: skip


def _cases(world_size: int) -> list[tuple[Any, ...]]:
    return [case for case in LAYOUTS if case[0] == world_size]


def _swept(model_type: str, implementation: str, dtype: torch.dtype) -> Any:
    sizes = _sizes(dict(SWEPT)[model_type])
    return _model(model_type, sizes, implementation).to(dtype)


def rank_layouts(world_size: int) -> list[Any]:
    """Inside a rank: each case of ``world_size`` ranks' gathered output and summed gradients
    (float64), or its error."""
    hf.register()
    out: list[Any] = []
    for _, model_type, layout, seq, docs, dtype in _cases(world_size):
        model = _swept(model_type, "tokenring", dtype)
        sp = hf.SequenceParallel(layout=layout, seq_len=seq, cu_seqlens=docs)
        batch = hf.shard_batch(sp, _input_ids(seq))
        try:
            got = _sharded_output(model, batch, sp)
        except (NotImplementedError, ValueError) as exc:
            out.append(str(exc))
            continue
        w = hf.attention._local(sp, _weights((2, seq, got.shape[-1])))
        (got.double() * w).sum().backward()
        hf.all_reduce_gradients(sp, model)
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        out.append((hf.gather_sequence(sp, got.detach()).double(), grads))
    return out


def _one_process(
    model_type: str, seq: int, docs: tuple[int, ...] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The oracle: the model in one process, one forward per document (positions from 0),
    outputs side by side; (B, S, ...) float64 and the parameters' gradients."""
    model = _swept(model_type, "sdpa", dtype)
    ids = _input_ids(seq)
    bounds = docs if docs is not None else (0, seq)
    pieces = [
        _output(model(input_ids=ids[:, a:b], position_ids=torch.arange(b - a)[None]))
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    out = torch.cat(pieces, 1).double()
    (out * _weights(tuple(out.shape))).sum().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _errors(
    want: torch.Tensor, wgrads: dict[str, torch.Tensor], got: torch.Tensor, grads: dict[str, Any]
) -> tuple[float, float]:
    """|output error| and the largest gradient error relative to its parameter's (floored)."""
    top = max(float(g.abs().max()) for g in wgrads.values())
    gerr = max(
        float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * top)
        for n, g in wgrads.items()
    )
    return float((got - want).abs().max()), gerr


@pytest.mark.parametrize("world_size", [3, 4])
def test_swept_architectures_match_one_process_on_other_layouts_documents_and_dtypes(
    world_size: int,
) -> None:
    """Three and four ranks, both layouts, odd lengths, packed documents of uneven lengths (of
    a single token, empty) with the models' own windows shorter than a document, and bfloat16
    (twice the error of the same model in bfloat16 in one process plus one rounding step)."""
    per_rank = tokenring.launch(rank_layouts, world_size, world_size=world_size, timeout_s=300)
    for i, (_, model_type, layout, seq, docs, dtype) in enumerate(_cases(world_size)):
        case = f"{model_type} {layout} S={seq} documents={docs} {dtype}"
        want, wgrads = _one_process(model_type, seq, docs, torch.float64)
        out_tol, grad_tol = FP64, FP64
        if dtype != torch.float64:
            same, sgrads = _one_process(model_type, seq, docs, dtype)
            err, gerr = _errors(want, wgrads, same, sgrads)
            step = torch.finfo(dtype).eps
            out_tol, grad_tol = 2 * err + step * float(want.abs().max()), 2 * gerr + step
        for rank, res in enumerate(per_rank):
            assert not isinstance(res[i], str), f"{case}: rank {rank} raised {res[i]}"
            err, gerr = _errors(want, wgrads, *res[i])
            assert err <= out_tol, f"{case}: rank {rank} output off by {err} (tol {out_tol})"
            assert gerr <= grad_tol, f"{case}: rank {rank} gradients off by {gerr} (relative)"


# -- a rank without a token -------------------------------------------------------------------

# (layout, S, documents): shardings that leave rank 1 of 2 without a token: one token on the
# contiguous layout; on zigzag, documents of one token each (every document is zigzagged on
# its own, and a document's first chunk is rank 0's). transformers' forward cannot run over no
# tokens (IndexError in its packed-sequence detection, or a reshape of 0 elements); the other
# rank waited for it in its first attention call for the process group's timeout, then raised
# "rank(s) [1] did not arrive"
EMPTY_RANK = (("contiguous", 1, None), ("zigzag", 3, (0, 1, 2, 3)))


def rank_empty_shard() -> list[str]:
    """Inside a rank: what shard_batch raised, and what the model's forward raised when given
    shards cut by tokenring.shard (no shard_batch)."""
    hf.register()
    out: list[str] = []
    model = _swept("gpt2", "tokenring", torch.float64)
    for layout, seq, docs in EMPTY_RANK:
        sp = hf.SequenceParallel(layout=layout, seq_len=seq, cu_seqlens=docs)
        try:
            hf.shard_batch(sp, _input_ids(seq))
            out.append("shard_batch ran")
        except ValueError as exc:
            out.append(str(exc))
        rank = torch.distributed.get_rank()
        ids = tokenring.shard(_input_ids(seq), rank=rank, world_size=2, layout=layout,
                              cu_seqlens=docs)  # fmt: skip
        positions = tokenring.position_ids(
            rank=rank, world_size=2, layout=layout, seq_len=seq, cu_seqlens=docs
        )
        try:
            model(input_ids=ids, position_ids=positions[None], sequence_parallel=sp)
            out.append("forward ran")
        except Exception as exc:  # what it raised, whatever it is
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_sharding_that_leaves_a_rank_without_tokens_raises_on_every_rank() -> None:
    per_rank = tokenring.launch(rank_empty_shard, world_size=2, timeout_s=120, pg_timeout_s=60)
    for rank, said in enumerate(per_rank):
        for (layout, seq, docs), (batch, forward) in zip(
            EMPTY_RANK, zip(said[::2], said[1::2], strict=True), strict=True
        ):
            case = f"rank {rank}, layout={layout} seq_len={seq} cu_seqlens={docs}"
            words = f"layout={layout!r}, seq_len={seq}"
            assert words in batch and "leaves rank(s) [1] of 2 without a token" in batch, (
                f"{case}: shard_batch: {batch}"
            )
            assert forward.startswith("ValueError: ") and words in forward, (
                f"{case}: forward: {forward}"
            )
