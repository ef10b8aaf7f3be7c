"""Audit of tokenring.hf across model architectures: what tests/test_hf*.py do not cover.

The oracle is the same tiny model (AutoConfig.for_model, seeded weights) in one process with
an attention written here from its definition (float64 softmax over transformers' own
materialised masks, softcap and attention sinks applied), registered as "oracle64"; float64
within 1e-10 (../shared/STYLE.md), gradients relative to their largest entry (the models'
RMSNorms run in float32, so a norm weight's gradient sums float32-rounded terms in another
order on each shard: within 1e-6 of its scale there, 1e-10 elsewhere).

Legend: B batch, S global seq, V vocab, P world size.
"""

from __future__ import annotations

import itertools
import re
import time
import warnings
from typing import Any

import pytest
import torch

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from tokenring import hf  # noqa: E402

FP64 = 1e-10
FLOAT32_NORMS = 1e-6  # relative, for the gradient of a weight used in a float32 RMSNorm
SEQ = 16
VOCAB = 64
WINDOW = 5
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def oracle_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention ``(B, H, S, D)`` in, ``(B, S, H, D)`` out: the scores, capped, plus
    the additive mask, softmax (with one sink logit per head) in the inputs' dtype."""
    assert dropout == 0.0
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[2]]
    if s_aux is not None:
        sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def _register_oracle() -> None:
    AttentionInterface.register("oracle64", oracle_attention)
    AttentionMaskInterface.register("oracle64", eager_mask)


def _model(model_type: str, changes: dict[str, Any], attn_implementation: str) -> Any:
    """The seeded float64 model (weights spread wider than the default init)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    config = AutoConfig.for_model(model_type, **COMMON | changes)  # layer_types from them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, experts_implementation="eager"
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model.double().eval()


def _input_ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))


def _weights(seq: int = SEQ) -> torch.Tensor:
    """Fixed weights (B, S, V) of the scalar sum(logits * w) whose gradient is checked."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, seq, VOCAB, generator=g, dtype=torch.float64)


# -- the model's mask against the attention call's sliding_window -----------------------------


@pytest.mark.usefixtures("single_rank_group")
def test_a_sliding_window_the_models_mask_does_not_have_raises() -> None:
    """OLMoE's attention passes config.sliding_window to every call while its mask is plain
    causal (create_causal_mask: "no sliding"): transformers' eager and SDPA attention follow
    the mask, flash-attention the keyword. tokenring's mask function answered None for plain
    causal, so the call could not tell the model's mask from no mask and applied the window:
    with sliding_window=5 the logits were 0.81 off one process (SDPA or eager), silently, on
    one rank as on two. It now raises, naming both; without the window it matches."""
    hf.register()
    _register_oracle()
    changes = {"num_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}
    model = _model("olmoe", changes, "tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    named = r"window_size=\(-1, 0\) but its attention passes sliding_window=5"
    with pytest.raises(NotImplementedError, match=named):
        model(**inputs, sequence_parallel=sp)
    # the same model without the window: the one-process answer
    changes["sliding_window"] = None
    got = _model("olmoe", changes, "tokenring")(**inputs, sequence_parallel=sp).logits
    want = _model("olmoe", changes, "oracle64")(input_ids=_input_ids()).logits
    assert float((got - want).abs().max().detach()) <= FP64


# -- architectures on two ranks: logits and every parameter's gradient -----------------------

# (label, model_type, config changes, SequenceParallel seq_len / cu_seqlens or None, what the
# error names or None): Gemma 2's query_pre_attn_scalar scale and alternating sliding and full
# layers (without its softcapping, which raises); Qwen 2's use_sliding_window above
# max_window_layers and OLMo 3's sliding layers over packed documents; Phi-3's window over an
# uneven split; Mixtral's experts; gpt-oss' attention sinks and OLMoE's window, which raise
ARCHITECTURES = (
    ("gemma2", "gemma2", {"attn_logit_softcapping": None, "query_pre_attn_scalar": 7,
                          "sliding_window": WINDOW}, None, None),
    ("gemma2 softcap", "gemma2", {"sliding_window": WINDOW}, None, "does not support softcap"),
    ("qwen2 window", "qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                               "max_window_layers": 1}, (0, 9, SEQ), None),
    ("olmo3 documents", "olmo3", {"sliding_window": WINDOW}, (0, 5, SEQ), None),
    ("phi3 uneven", "phi3", {"sliding_window": WINDOW}, (0, 13), None),
    ("mixtral", "mixtral", {"sliding_window": WINDOW, "num_local_experts": 4,
                            "num_experts_per_tok": 2}, None, None),
    ("gpt-oss", "gpt_oss", {"sliding_window": WINDOW, "num_local_experts": 4,
                            "num_experts_per_tok": 2}, None, r"attention sinks \(s_aux\)"),
    ("olmoe window", "olmoe", {"sliding_window": WINDOW, "num_experts": 4,
                               "num_experts_per_tok": 2}, None, "passes sliding_window=5"),
)  # fmt: skip


def _plan(docs: tuple[int, ...] | None) -> hf.SequenceParallel:
    if docs is None:
        return hf.SequenceParallel()
    return hf.SequenceParallel(seq_len=docs[-1], cu_seqlens=docs if len(docs) > 2 else None)


def rank_architectures() -> dict[str, Any]:
    """Inside a rank: each model's gathered logits and summed gradients, or its error."""
    hf.register()
    out: dict[str, Any] = {}
    for label, model_type, changes, docs, _ in ARCHITECTURES:
        model = _model(model_type, changes, "tokenring")
        sp = _plan(docs)
        seq = SEQ if docs is None else docs[-1]
        batch = hf.shard_batch(sp, _input_ids(seq))
        try:
            logits = model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
            ).logits
        except NotImplementedError as exc:
            out[label] = str(exc)
            continue
        (logits * hf.attention._local(sp, _weights(seq))).sum().backward()
        hf.all_reduce_gradients(sp, model)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[label] = (hf.gather_sequence(sp, logits), grads)
    return out


def _positions(docs: tuple[int, ...] | None, seq: int) -> torch.Tensor:
    """(1, S) positions restarting at each document: transformers finds the documents there."""
    pos = torch.arange(seq)
    for start, end in itertools.pairwise(docs or (0, seq)):
        pos[start:end] -= start
    return pos[None]


def test_architectures_on_two_ranks_match_one_process_or_raise() -> None:
    per_rank = tokenring.launch(rank_architectures, world_size=2, timeout_s=300)
    _register_oracle()
    for label, model_type, changes, docs, refused in ARCHITECTURES:
        if refused is not None:
            for rank, got in enumerate(per_rank):
                assert isinstance(got[label], str), f"{label}: rank {rank} did not raise"
                assert re.search(refused, got[label]), f"{label}: rank {rank}: {got[label]}"
            continue
        model = _model(model_type, changes, "oracle64")
        seq = SEQ if docs is None else docs[-1]
        want = model(input_ids=_input_ids(seq), position_ids=_positions(docs, seq)).logits
        (want * _weights(seq)).sum().backward()
        for rank, res in enumerate(per_rank):
            logits, grads = res[label]
            err = float((logits - want.detach()).abs().max())
            assert err <= FP64, f"{label}: rank {rank} logits off by {err}"
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                bound = FLOAT32_NORMS if "norm" in name else FP64
                err = float((grads[name] - p.grad).abs().max() / p.grad.abs().max())
                assert err <= bound, f"{label}: rank {rank} {name} off by {err} (relative)"


# -- position_ids a model never hands to attention ---------------------------------------------

# (model_type, encoder): absolute position embeddings (BERT, RoBERTa, DistilBERT) or RoPE
# computed outside attention (ModernBERT, GPTBigCode's learned ones, Persimmon): none hands
# position_ids to its attention calls
UNSEEN_POSITIONS = (
    ("bert", True),
    ("roberta", True),
    ("distilbert", True),
    ("modernbert", True),
    ("gpt_bigcode", False),
    ("persimmon", False),
)


def _no_dropout(model: Any) -> Any:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "dropout_prob"):
            module.dropout_prob = 0.0
    return model


def rank_unseen_positions() -> dict[str, Any]:
    """Inside a rank: each model called without position_ids (its error) and with
    shard_batch's (its gathered logits); the base model alone; gradient checkpointing."""
    import test_hf_architectures as arch

    out: dict[str, Any] = {}
    for name, encoder in UNSEEN_POSITIONS:
        _, model = arch._models(name, torch.float64, encoder=encoder)
        sp = hf.SequenceParallel(layout="contiguous" if encoder else "zigzag")
        batch = hf.shard_batch(sp, arch._input_ids())
        offset = model.config.pad_token_id + 1 if name == "roberta" else 0
        with torch.no_grad():
            try:
                model(input_ids=batch.input_ids, sequence_parallel=sp)
                out[name] = "no error"
            except NotImplementedError as exc:
                out[name] = str(exc)
            logits = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids + offset,
                sequence_parallel=sp,
            ).logits
        out[f"{name} logits"] = hf.gather_sequence(sp, logits)
    # Persimmon's base model alone sets its position_ids local from cache_position: the
    # shard's count from 0, checked as any tensor (zigzag: not rank 0's positions)
    _, causal = arch._models("persimmon", torch.float64)
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, arch._input_ids())
    with torch.no_grad():
        try:
            causal.model(input_ids=batch.input_ids, sequence_parallel=sp)
            out["base"] = "no error"
        except NotImplementedError as exc:
            out["base"] = str(exc)
        base = causal.model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ).last_hidden_state
        want = causal(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ).logits
        out["base matches"] = torch.equal(causal.lm_head(base), want)
    # gradient checkpointing re-runs attention in the backward, under no model's forward
    _, bert = arch._models("bert", torch.float64, encoder=True)
    bert = _no_dropout(bert).train()
    bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sp = hf.SequenceParallel(layout="contiguous")
    batch = hf.shard_batch(sp, arch._input_ids())
    logits = bert(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
    ).logits
    logits.sum().backward()
    out["checkpointed"] = hf.gather_sequence(sp, logits)
    return out


def test_models_that_never_hand_position_ids_to_attention_need_them() -> None:
    """BERT, RoBERTa, DistilBERT, ModernBERT, GPTBigCode and Persimmon count positions over
    the shard they are given when called without position_ids, and hand none to attention:
    on 2 ranks their logits were silently off one process (README said "Not detectable").
    Every rank now raises naming position_ids (the outermost model forward's value is read,
    Note [Positions the model was given]); with shard_batch's they match one process, and
    so does a gradient-checkpointed BERT."""
    import test_hf_architectures as arch

    per_rank = tokenring.launch(rank_unseen_positions, world_size=2, timeout_s=300)
    for name, encoder in UNSEEN_POSITIONS:
        oracle, _ = arch._models(name, torch.float64, encoder=encoder)
        with torch.no_grad():
            want = oracle(arch._input_ids()).logits
        for rank, got in enumerate(per_rank):
            assert re.search(r"was given no position_ids on rank\(s\) \[0, 1\]", got[name]), (
                f"{name}: rank {rank}: {got[name]}"
            )
            err = float((got[f"{name} logits"] - want).abs().max())
            assert err <= FP64, f"{name}: rank {rank} logits off one process by {err}"
    oracle, _ = arch._models("bert", torch.float64, encoder=True)
    with torch.no_grad():
        want = oracle(arch._input_ids()).logits
    for rank, got in enumerate(per_rank):
        assert "position_ids are not rank 0's positions" in got["base"], got["base"]
        assert got["base matches"], f"rank {rank}: the base model with position_ids differs"
        err = float((got["checkpointed"] - want).abs().max())
        assert err <= FP64, f"rank {rank}: checkpointed BERT off one process by {err}"


@pytest.mark.stress  # dynamo traces BERT for about 10 s
@pytest.mark.usefixtures("single_rank_group")
def test_unseen_positions_are_read_under_torch_compile() -> None:
    """Under torch.compile(fullgraph=False) the graph breaks at the attention call, whose
    frames still hold the head model's position_ids: none over documents raises, shard_batch's
    give the eager logits."""
    import test_hf_architectures as arch

    _, model = arch._models("bert", torch.float64, encoder=True)
    sp = hf.SequenceParallel(layout="contiguous", seq_len=SEQ, cu_seqlens=(0, 5, SEQ))
    batch = hf.shard_batch(sp, arch._input_ids())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    with pytest.raises(NotImplementedError, match="was given no position_ids"):
        compiled(input_ids=batch.input_ids, sequence_parallel=sp)
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    got = compiled(**inputs, sequence_parallel=sp).logits
    assert torch.equal(got, model(**inputs, sequence_parallel=sp).logits)


# -- training under torch.autocast --------------------------------------------------------------


def _float32_llama(attn_implementation: str) -> Any:
    return _model("llama", {}, attn_implementation).float().train()


def rank_autocast() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Inside a rank: a float32 Llama trained under autocast(bfloat16) through tokenring."""
    hf.register()
    model = _float32_llama("tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ).logits  # (B, s, V)
    (logits.float() * hf.attention._local(sp, _weights()).float()).sum().backward()
    hf.all_reduce_gradients(sp, model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return hf.gather_sequence(sp, logits.detach().float()), grads


def test_a_model_under_autocast_runs_as_its_own_sdpa_does() -> None:
    """Before: a float32 model under torch.autocast(bfloat16) hands attention float32 q and k
    (after RoPE) beside a bfloat16 v, and tokenring refused the mix (its operator never
    casts), where the model's own SDPA computes in bfloat16. Now the integration casts q, k, v
    to the autocast dtype as SDPA does: logits and every gradient within the bfloat16 rule of
    ../shared/STYLE.md (error against float64 at most twice the same model's in one process
    under autocast with SDPA, plus one bfloat16 rounding step of the largest value)."""
    per_rank = tokenring.launch(rank_autocast, world_size=2, timeout_s=240)
    exact = _model("llama", {}, "sdpa").train()  # float64, the same weights
    want = exact(input_ids=_input_ids()).logits
    (want * _weights()).sum().backward()
    plain = _float32_llama("sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same = plain(input_ids=_input_ids()).logits
    (same.float() * _weights().float()).sum().backward()
    step = 2.0**-8
    want, same = want.detach(), same.detach()
    for rank, (logits, grads) in enumerate(per_rank):
        base = float((same.double() - want).abs().max())
        err = float((logits.double() - want).abs().max())
        assert err <= 2 * base + step * float(want.abs().max()), (rank, err, base)
        for name, p in exact.named_parameters():
            ref = dict(plain.named_parameters())[name].grad.double()
            base = float((ref - p.grad).abs().max())
            err = float((grads[name].double() - p.grad).abs().max())
            bound = 2 * base + step * float(p.grad.abs().max())
            assert err <= bound, f"rank {rank} {name}: {err} > {bound} (one process: {base})"


# -- position_ids checked once per forward on every rank alike --------------------------------


def rank_reused_positions() -> list[str]:
    """Inside a rank: three forwards; rank 0 passes one position_ids tensor to all of them,
    rank 1 a new one each time (right in the second forward, off by one in the third)."""
    hf.register()
    model = _model("llama", {}, "tokenring")
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, _input_ids())
    rank = torch.distributed.get_rank()
    seen = []
    for forward in range(3):
        positions = batch.position_ids
        if rank == 1:
            positions = batch.position_ids.clone() + (1 if forward == 2 else 0)
        start = time.monotonic()
        try:
            model(input_ids=batch.input_ids, position_ids=positions, sequence_parallel=sp)
            seen.append("ran")
        except NotImplementedError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        if time.monotonic() - start > 5:
            seen.append(f"forward {forward} took {time.monotonic() - start:.1f} s")
    return seen


def test_position_ids_reused_on_one_rank_are_checked_with_the_others() -> None:
    """Before: a checked position_ids tensor was skipped for good (a module-level cache by
    tensor), so rank 0 reusing its tensor skipped the exchange that rank 1, passing a new
    one, waited in until the communicator's timeout (300 s). Now the check runs once per
    tensor and model forward on every rank alike."""
    per_rank = tokenring.launch(rank_reused_positions, world_size=2, timeout_s=120)
    for rank, seen in enumerate(per_rank):
        assert seen[:2] == ["ran", "ran"], (rank, seen)
        assert len(seen) == 3, (rank, seen)
        assert "position_ids differ from each rank's positions" in seen[2], (rank, seen)
