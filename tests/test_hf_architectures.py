"""transformers architectures beyond Llama through tokenring attention: the ones whose only
token mixing is attention match one process, the ones with other token-mixing layers raise.

The oracle is the same tiny model (AutoConfig.for_model, seeded weights) in one process with
transformers' own SDPA attention and masks, float64, within 1e-10 (../shared/STYLE.md). An
architecture the installed transformers does not know is skipped by name.

Legend: B batch, S global seq, V vocab, P world size.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from tokenring import hf  # noqa: E402

FP64 = 1e-10
SEQ = 16
WINDOW = 5  # sliding window of the configs that have one: shorter than S, so it matters
COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# what each adds to Llama: Qwen2/3 q/k norms or biases, Gemma's query_pre_attn_scalar scale,
# Gemma 3's alternating sliding-window and full layers, Granite's attention_multiplier scale,
# Cohere 2's sliding layers with parallel blocks, Phi's partial rotary, GPT-NeoX's fused qkv,
# OLMo 2's q/k norm after projection, SmolLM 3's NoPE layers, Mixtral's experts
MATCHING = (
    "qwen2",
    "qwen3",
    "gemma",
    "gemma3_text",
    "granite",
    "cohere2",
    "phi",
    "gpt_neox",
    "olmo2",
    "smollm3",
)
# (model_type, changes to the config, what the error names): each has a layer that mixes
# tokens other than by attention (Note [Layers that mix tokens] in tokenring.hf.attention)
REFUSED = (
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "'conv'"),
    # older transformers name Mamba layers "mamba" or list none (then mamba_* fields)
    ("nemotron_h", {}, "'linear_attention'|'mamba'|state-space"),
    ("falcon_h1", {}, "'hybrid'|'mamba'|state-space"),
)


# encoders (bidirectional attention): BERT, ModernBERT's alternating local and global layers,
# RoBERTa, whose positions count from pad_token_id + 1 (README: pass the offset)
ENCODERS = ("bert", "modernbert", "roberta")


def _config(name: str, *, encoder: bool = False, **changes: Any) -> Any:
    if name not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {name!r}")
    if encoder:
        common = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "use_cache")}
        if name == "modernbert":
            common |= {"local_attention": 6, "global_attn_every_n_layers": 2}
        return AutoConfig.for_model(name, **common)
    config = AutoConfig.for_model(name, **COMMON)
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = WINDOW
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _models(
    name: str, dtype: torch.dtype, *, encoder: bool = False, **changes: Any
) -> tuple[Any, Any]:
    """The seeded model with SDPA (the oracle) and the same weights with tokenring attention
    (a causal LM, or with ``encoder`` a masked LM); one config each, as a model keeps its
    config's attention."""
    hf.register()
    auto = AutoModelForMaskedLM if encoder else AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        oracle = auto.from_config(
            _config(name, encoder=encoder, **changes), attn_implementation="sdpa"
        )
        ours = auto.from_config(
            _config(name, encoder=encoder, **changes), attn_implementation="tokenring"
        )
    ours.load_state_dict(oracle.state_dict())
    return oracle.to(dtype).eval(), ours.to(dtype).eval()


def _input_ids() -> torch.Tensor:
    return torch.randint(
        3, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0)
    )


def rank_logits(names: tuple[str, ...], encoder: bool) -> dict[str, torch.Tensor]:
    """Inside a rank: each model's logits ``(B, S, V)`` gathered from its shards (zigzag for
    causal LMs, contiguous for encoders)."""
    out = {}
    for name in names:
        _, model = _models(name, torch.float64, encoder=encoder)
        sp = hf.SequenceParallel(layout="contiguous" if encoder else "zigzag")
        batch = hf.shard_batch(sp, _input_ids())
        offset = model.config.pad_token_id + 1 if name == "roberta" else 0
        with torch.no_grad():
            logits = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids + offset,
                sequence_parallel=sp,
            ).logits
        out[name] = hf.gather_sequence(sp, logits)
    return out


def _check_two_ranks_match_one_process(names: tuple[str, ...], *, encoder: bool) -> None:
    known = tuple(name for name in names if name in CONFIG_MAPPING)
    assert len(known) >= len(names) // 2, f"transformers knows too few of {names}"
    per_rank = tokenring.launch(rank_logits, known, encoder, world_size=2, timeout_s=300)
    for name in known:
        oracle, _ = _models(name, torch.float64, encoder=encoder)
        with torch.no_grad():
            want = oracle(_input_ids()).logits
        for rank, got in enumerate(per_rank):
            err = float((got[name] - want).abs().max())
            assert err < FP64, f"{name}: rank {rank} logits differ from one process by {err}"


def test_encoders_match_one_process() -> None:
    _check_two_ranks_match_one_process(ENCODERS, encoder=True)


def test_attention_only_architectures_match_one_process() -> None:
    _check_two_ranks_match_one_process(MATCHING, encoder=False)


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(("name", "changes", "named"), REFUSED, ids=[r[0] for r in REFUSED])
def test_layers_that_mix_tokens_otherwise_raise(name: str, changes: dict, named: str) -> None:
    _, model = _models(name, torch.float32, **changes)
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    with pytest.raises(NotImplementedError, match=f"cannot split model_type '{name}'.*({named})"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
    with pytest.raises(NotImplementedError, match=named):
        hf.check_model(model)


@pytest.mark.usefixtures("single_rank_group")
def test_check_model_catches_models_whose_attention_never_runs() -> None:
    # two layers of a hybrid whose first attention layer comes later: no attention call ever
    # sees the config, so only the model check can refuse it
    known = [n for n in ("qwen3_next", "recurrent_gemma", "jamba", "mamba") if n in CONFIG_MAPPING]
    assert known, "transformers knows none of the hybrids and state-space models"
    for name in known:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(_config(name))
        with pytest.raises(NotImplementedError, match=f"cannot split model_type '{name}'"):
            hf.check_model(model)
        sp = hf.SequenceParallel()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with pytest.raises(NotImplementedError, match=f"cannot split model_type '{name}'"):
            hf.all_reduce_gradients(sp, model)

    class ConvOverTokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Conv1d(4, 4, kernel_size=3, padding=1)

    with pytest.raises(NotImplementedError, match="'mix' is a convolution over the sequence"):
        hf.check_model(ConvOverTokens())
    for name in MATCHING[:3]:
        if name in CONFIG_MAPPING:
            hf.check_model(_models(name, torch.float32)[1])  # attention only: no error


# models whose attention layers computed attention in their own code (transformers 5.24: all
# five; 5.25 moved Falcon to the interface): attn_implementation="tokenring" set after loading
# was accepted and never ran, so each rank attended over its own shard alone (Bloom and
# GPT-Neo gave logits off by 0.003 and 0.09 on 2 ranks, silently)
OWN_ATTENTION = (
    ("bloom", {"hidden_size": 32, "n_layer": 1, "n_head": 4}),
    ("gpt_neo", {"hidden_size": 32, "num_layers": 1, "num_heads": 4,
                 "attention_types": [[["global"], 1]]}),
    ("mpt", {"d_model": 32, "n_heads": 4, "n_layers": 1, "max_seq_len": 64}),
    ("falcon", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}),
    ("xglm", {"d_model": 32, "num_layers": 1, "attention_heads": 4, "ffn_dim": 48}),
)  # fmt: skip


def _reaches_tokenring(model: Any) -> bool | None:
    """Whether a forward of ``model`` set to "tokenring" calls tokenring's attention (without
    sequence_parallel= it then raises saying so); None: transformers refuses the name."""
    try:
        model.set_attn_implementation("tokenring")
    except (KeyError, ValueError):
        return None
    try:
        model(input_ids=_input_ids()[:, :8])
    except ValueError as exc:
        if "needs sequence_parallel=" in str(exc):
            return True
        raise
    return False


@pytest.mark.usefixtures("single_rank_group")
def test_check_model_refuses_exactly_the_models_whose_attention_never_reaches_tokenring() -> None:
    hf.register()
    refused, reached = [], []
    # BioGPT: _supports_attention_backend = False, yet it dispatches through the interface
    control = ("biogpt", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4})
    for name, sizes in (*OWN_ATTENTION, control):
        if name not in CONFIG_MAPPING:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(name, vocab_size=64, **sizes)
            )
        try:
            hf.check_model(model)
            refuses = False
        except NotImplementedError as exc:
            assert "through transformers' AttentionInterface" in str(exc), (name, exc)
            refuses = True
        reaches = _reaches_tokenring(model)
        if reaches is not None:
            assert refuses == (not reaches), (name, refuses, reaches)
        if reaches:
            reached.append(name)
        if refuses:
            refused.append(name)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            with pytest.raises(NotImplementedError, match="AttentionInterface"):
                hf.all_reduce_gradients(hf.SequenceParallel(), model)
    assert refused, "none of the models computes attention itself in this transformers"
    assert "biogpt" in reached or "biogpt" not in CONFIG_MAPPING


@pytest.mark.usefixtures("single_rank_group")
def test_check_model_passes_a_model_that_calls_attention_through_the_interface() -> None:
    """BioGPT says _supports_attention_backend = False yet its attention goes through the
    interface: the check reads the code, not the flag."""
    if "biogpt" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no 'biogpt'")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model("biogpt", **COMMON)
        hf.check_model(AutoModelForCausalLM.from_config(config))


@pytest.mark.usefixtures("single_rank_group")
def test_a_model_that_drops_sequence_parallel_raises_saying_so() -> None:
    # StableLM's decoder layers do not pass the forward's keyword arguments to attention
    _, model = _models("stablelm", torch.float32)
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    with pytest.raises(ValueError, match="does not hand its forward's keyword arguments down"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)


@pytest.mark.usefixtures("single_rank_group")
def test_router_load_balancing_loss_raises() -> None:
    """A mixture of experts' aux_loss (added to the loss with labels) averages the routing over
    the tokens it sees: on 2 ranks Mixtral's loss was 6.1639 on rank 0, 6.1641 on rank 1 and
    6.1613 in one process, silently; output_router_logits=True now raises, False runs."""
    _, model = _models("mixtral", torch.float32, num_local_experts=4, num_experts_per_tok=2)
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    with pytest.raises(NotImplementedError, match=r"output_router_logits=True.*aux_loss"):
        model(**inputs, labels=_input_ids(), output_router_logits=True, sequence_parallel=sp)
    model.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits=True"):
        model(**inputs, sequence_parallel=sp)
    model(**inputs, output_router_logits=False, sequence_parallel=sp)


@pytest.mark.usefixtures("single_rank_group")
def test_alibi_raises_naming_it() -> None:
    """Falcon with alibi=True added its bias to the mask our mask function had not
    materialised: AttributeError deep in the model; now NotImplementedError naming ALiBi."""
    if "falcon" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no 'falcon'")
    hf.register()
    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "alibi": True}
    config = AutoConfig.for_model("falcon", vocab_size=64, **sizes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    with pytest.raises(NotImplementedError, match=r"ALiBi .*model_type 'falcon'"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)


@pytest.mark.usefixtures("single_rank_group")
def test_a_forward_of_a_model_whose_attention_never_reaches_tokenring_raises() -> None:
    """Bloom and XGLM built with attn_implementation="tokenring" ran a forward with
    sequence_parallel= on each rank's shard alone (only check_model refused them); their mask
    goes through our mask function, which now refuses them as check_model does (MPT: ALiBi)."""
    hf.register()
    checked = []
    for name, sizes in OWN_ATTENTION:
        if name not in CONFIG_MAPPING:
            continue
        config = AutoConfig.for_model(name, vocab_size=64, **sizes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation="tokenring")
            except (KeyError, ValueError):  # transformers refuses the name for this model
                continue
        try:
            hf.check_model(model)
            continue  # attention through the interface (Falcon in 5.25)
        except NotImplementedError:
            pass
        sp = hf.SequenceParallel()
        batch = hf.shard_batch(sp, _input_ids())
        with pytest.raises(NotImplementedError, match=r"AttentionInterface|ALiBi"):
            model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
        checked.append(name)
    assert checked, "transformers builds none of the models with attn_implementation='tokenring'"


# encoder-decoder models and their decoders alone: (model_type, AutoModel class name, sizes)
ENCODER_DECODER = (
    ("bart", "AutoModelForSeq2SeqLM", {"d_model": 32, "encoder_attention_heads": 4,
                                       "decoder_attention_heads": 4}),
    ("bart", "AutoModelForCausalLM", {"d_model": 32, "encoder_attention_heads": 4,
                                      "decoder_attention_heads": 4}),
    ("pegasus", "AutoModelForSeq2SeqLM", {"d_model": 32, "encoder_attention_heads": 4,
                                          "decoder_attention_heads": 4}),
    ("whisper", "AutoModelForSpeechSeq2Seq", {"d_model": 32, "encoder_attention_heads": 4,
                                              "decoder_attention_heads": 4, "num_mel_bins": 8,
                                              "max_source_positions": 8}),
)  # fmt: skip


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("name", "auto", "sizes"), ENCODER_DECODER, ids=[f"{n}-{a}" for n, a, _ in ENCODER_DECODER]
)
def test_encoder_decoder_models_raise(name: str, auto: str, sizes: dict[str, Any]) -> None:
    """BART, Pegasus and Whisper count their position embeddings over the rows they get (no
    position_ids; BartForCausalLM drops them): on 2 ranks BART's, M2M-100's and Pegasus'
    logits were 0.37, 0.36 and 0.34 off one process, silently, and Whisper's forward ran
    with its encoder convolving over each shard. A forward and check_model now raise."""
    if name not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {name!r}")
    hf.register()
    common = {"vocab_size": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 48}
    config = AutoConfig.for_model(
        name, **common, decoder_ffn_dim=48, use_cache=False, pad_token_id=0, **sizes
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, auto).from_config(config, attn_implementation="tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    inputs: dict[str, Any] = {"decoder_input_ids": batch.input_ids}
    if name == "whisper":
        inputs["input_features"] = torch.randn(2, 8, 16)
    elif auto == "AutoModelForCausalLM":
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    else:
        inputs["input_ids"] = batch.input_ids
    with pytest.raises(NotImplementedError, match=f"encoder-decoder .*model_type '{name}'"):
        model(**inputs, sequence_parallel=sp)
    with pytest.raises(NotImplementedError, match=f"encoder-decoder .*model_type '{name}'"):
        hf.check_model(model)


# DeepSeek's multi-head latent attention: query and key heads of qk_nope + qk_rope = 12, value
# heads of 8 or 16; dense MLPs (first_k_dense_replace) so that float64 runs on CPU
LATENT = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "first_k_dense_replace": 2,
    "n_group": 1,
    "topk_group": 1,
}


def _latent_model(v_head_dim: int, attn_implementation: str) -> Any:
    config = AutoConfig.for_model("deepseek_v3", **COMMON | LATENT, v_head_dim=v_head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.double()


def _latent_loss(logits: torch.Tensor, sp: hf.SequenceParallel | None) -> torch.Tensor:
    """sum(logits * w) for fixed global weights w (B, S, V), this rank's rows of them."""
    w = torch.randn(2, SEQ, COMMON["vocab_size"], generator=torch.Generator().manual_seed(1))
    w = w.double() if sp is None else hf.attention._local(sp, w.double())
    return (logits * w).sum()


def rank_latent(v_head_dims: tuple[int, ...]) -> dict[int, Any]:
    """Inside a rank: logits (gathered) and summed gradients of each latent-attention model."""
    hf.register()
    out: dict[int, Any] = {}
    for v_head_dim in v_head_dims:
        model = _latent_model(v_head_dim, "tokenring")
        sp = hf.SequenceParallel()
        batch = hf.shard_batch(sp, _input_ids())
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ).logits
        _latent_loss(logits, sp).backward()
        hf.all_reduce_gradients(sp, model)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        with pytest.raises(NotImplementedError, match="latent attention"), torch.no_grad():
            hf.generate(sp, model, _input_ids()[:1, :8], max_new_tokens=2, use_cache=True)
        out[v_head_dim] = (hf.gather_sequence(sp, logits), grads)
    return out


def test_latent_attention_matches_one_process() -> None:
    """DeepSeek V3's value heads are narrower (8) or wider (16) than its query and key heads
    (12): tokenring attention raised "k and v must have the same shape". It now pads the
    narrower side with zeros (zero output channels, or zero added to every score) and matches
    SDPA in one process, logits and every gradient; hf.generate raises naming it."""
    if "deepseek_v3" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no 'deepseek_v3'")
    per_rank = tokenring.launch(rank_latent, (8, 16), world_size=2, timeout_s=300)
    for v_head_dim in (8, 16):
        oracle = _latent_model(v_head_dim, "sdpa")
        want = oracle(_input_ids()).logits
        _latent_loss(want, None).backward()
        for rank, res in enumerate(per_rank):
            logits, grads = res[v_head_dim]
            err = float((logits - want.detach()).abs().max())
            assert err < FP64, f"v_head_dim={v_head_dim}: rank {rank} logits off by {err}"
            for name, p in oracle.named_parameters():
                if p.grad is not None:
                    err = float((grads[name] - p.grad).abs().max())
                    assert err < FP64, f"v_head_dim={v_head_dim}: rank {rank} {name} off by {err}"
