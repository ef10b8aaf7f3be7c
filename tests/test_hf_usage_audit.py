"""tokenring.hf driven as a transformers user drives a model, beyond tests/test_hf*.py: other
heads and outputs, padding masks, switching the attention, saving and loading, transformers'
own generate and pipeline, keyword variants of the forward.

One launch of two gloo ranks (communicators with a 5 s timeout, so a wait for a peer shows).
The oracle is the same tiny float64 Llama (or BERT) in one process with transformers' own SDPA
attention; float64 within 1e-10 (../shared/STYLE.md), the loss against a float64
cross-entropy written here (transformers' own takes float32 logits).

Defects found (each now raises on every rank within a second):

- a padding ``attention_mask`` whose zeros fall on one rank's shard alone (right padding on
  the last rank, left padding on the first): that rank raised in the mask function while the
  other ran its attention call, whose rank check then paired with the raising rank's *next*
  forward (or waited out the timeout);
- a head that pools over the sequence: ``AutoModelForSequenceClassification`` on a decoder
  pools the last non-pad token of each rank's shard (rank 1's logits 1.67 off one process),
  BERT's ``pooler_output`` the first token of each shard (0.42 off on rank 1), and
  ``logits_to_keep=1`` kept each rank's last local row (rank 1: not the sequence's last token).

What held (checked here so that it stays so): ``inputs_embeds`` (and its gradient),
``return_dict=False``, labels with -100 entries given as shards or global, an all-ones
``attention_mask`` (shard or global), ``output_hidden_states`` (each rank's shard of every
layer's hidden states), ``use_cache=True`` in a training forward (its returned cache refused
when handed back), tied embeddings' gradients, token classification and the base model's
``last_hidden_state`` (each rank's shard), ``set_attn_implementation`` and
``config._attn_implementation`` switched at runtime, a ``save_pretrained`` /
``from_pretrained`` round trip, attention dropout (refused in train(), exact in eval()), a
model without ``sequence_parallel=`` or through transformers' ``generate`` and ``pipeline``
(ValueError on every rank), ``num_items_in_batch`` through the labels loss (the documented
NotImplementedError).

Legend: B batch, S global seq, s local seq, V vocab, P world size.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from tokenring import hf  # noqa: E402

V, S = 64, 12


def _pair(changes: dict[str, Any] | None = None, auto: Any = None) -> tuple[Any, Any]:
    """A seeded tiny float64 Llama (2 layers, GQA 2/1) with SDPA (the oracle) and the same
    weights with tokenring attention; ``changes`` set on its config; ``auto`` its class."""
    from tiny_llama import llama_config

    hf.register()
    config = llama_config(V, hidden=16, layers=2, heads=2, kv_heads=1)
    for name, value in (changes or {}).items():
        setattr(config, name, value)
    auto = auto or transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        with torch.no_grad():
            for p in oracle.parameters():
                p.add_(0.3 * torch.randn_like(p))
        ours = auto.from_config(copy.deepcopy(config), attn_implementation="tokenring")
    ours.load_state_dict(oracle.state_dict())
    return oracle.double().eval(), ours.double().eval()


def _ids() -> torch.Tensor:
    """(B, S) = (2, 12): rows of different content."""
    return torch.randint(3, V, (2, S), generator=torch.Generator().manual_seed(1))


def _labels() -> torch.Tensor:
    labels = _ids()
    labels[0, :5] = -100
    labels[1, 7:] = -100
    return labels


def _outcome(call: Callable[[], object]) -> tuple[str, Any, float]:
    """("ok", value) or ("error", "Type: message"), and the seconds it took."""
    start = time.perf_counter()
    try:
        found: tuple[str, Any] = ("ok", call())
    except (ValueError, NotImplementedError, RuntimeError, TypeError) as exc:
        found = ("error", f"{type(exc).__name__}: {exc}")
    return (*found, time.perf_counter() - start)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def rank_usage(save_dir: str) -> dict[str, Any]:
    """Inside a rank: every case's outcome (value, or error and seconds)."""
    rank = dist.get_rank()
    comm = tokenring.Communicator(timeout_s=5.0)
    sp = hf.SequenceParallel(group=comm)
    spc = hf.SequenceParallel(group=comm, layout="contiguous")
    oracle, model = _pair()
    ids, labels = _ids(), _labels()
    batch = hf.shard_batch(sp, ids, labels)
    local_labels = tokenring.shard(labels, rank=rank, world_size=2, layout="zigzag")
    with torch.no_grad():
        want = oracle(ids).logits  # (B, S, V)
    out: dict[str, Any] = {}

    def logits(m: Any = model, b: Any = batch, s: Any = sp, **kw: Any) -> torch.Tensor:
        with torch.no_grad():
            got = m(position_ids=b.position_ids, sequence_parallel=s, use_cache=False, **kw)
        return hf.gather_sequence(s, got.logits if hasattr(got, "logits") else got[0])

    def case(name: str, call: Callable[[], object]) -> None:
        out[name] = _outcome(call)

    # -- defects: padding on one rank's shard, outputs that pool over the sequence ---------------
    cont = hf.shard_batch(spc, ids)
    right, left = torch.ones_like(ids), torch.ones_like(ids)
    right[1, -3:] = 0  # on the last rank's contiguous shard alone
    left[1, :3] = 0  # on the first rank's
    for name, mask in (("right padding", right), ("left padding", left)):
        local_mask = tokenring.shard(mask, rank=rank, world_size=2, layout="contiguous")
        case(name, lambda m=local_mask: logits(b=cont, s=spc, input_ids=cont.input_ids,
                                                attention_mask=m).shape)  # fmt: skip
    _, classifier = _pair({"pad_token_id": 0, "num_labels": 3},
                          transformers.AutoModelForSequenceClassification)  # fmt: skip
    case("sequence classification", lambda: classifier(
        input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
    ).logits)  # fmt: skip
    case("logits_to_keep=1", lambda: logits(input_ids=batch.input_ids, logits_to_keep=1))
    case("bert pooler", lambda: _bert(spc, pooler=True))
    case("after the errors", lambda: _err(logits(input_ids=batch.input_ids), want))

    # -- what held -----------------------------------------------------------------------------
    bert = _bert(spc, pooler=False)
    case("bert without pooler", lambda: bert)
    embed = model.get_input_embeddings()
    case("inputs_embeds", lambda: _err(logits(inputs_embeds=embed(batch.input_ids)), want))
    case("return_dict=False",
         lambda: _err(logits(input_ids=batch.input_ids, return_dict=False), want))  # fmt: skip
    for name, mask in (("ones, shard", torch.ones_like(batch.input_ids)),
                       ("ones, global", torch.ones_like(ids))):  # fmt: skip
        case(name, lambda m=mask: _err(logits(input_ids=batch.input_ids, attention_mask=m), want))
    want_loss = F.cross_entropy(want[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    for name, given in (("labels, shard", local_labels), ("labels, global", labels)):
        case(name, lambda g=given: float(model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, labels=g,
            sequence_parallel=sp, use_cache=False).loss - want_loss))  # fmt: skip
    case("num_items_in_batch", lambda: model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, labels=labels,
        num_items_in_batch=20, sequence_parallel=sp, use_cache=False))  # fmt: skip

    def hidden() -> list[float]:
        with torch.no_grad():
            got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                        sequence_parallel=sp, output_hidden_states=True).hidden_states  # fmt: skip
            ref = oracle(ids, output_hidden_states=True).hidden_states
        return [_err(hf.gather_sequence(sp, g), r) for g, r in zip(got, ref, strict=True)]

    case("hidden states", hidden)

    def cache_back() -> Any:
        first = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                      sequence_parallel=sp, use_cache=True)  # fmt: skip
        return model(input_ids=ids[:, -1:], past_key_values=first.past_key_values,
                     position_ids=torch.tensor([[S]]), sequence_parallel=sp)  # fmt: skip

    case("cache handed back", cache_back)
    case("gradients, tied, train, use_cache", lambda: _tied_gradients(sp, batch, ids, labels))
    tagger_oracle, tagger = _pair({"num_labels": 3}, transformers.AutoModelForTokenClassification)
    case("token classification", lambda: _err(logits(tagger, input_ids=batch.input_ids),
                                               tagger_oracle(ids).logits))  # fmt: skip
    base_oracle, base = _pair(auto=transformers.AutoModel)
    case("base model", lambda: _err(
        hf.gather_sequence(sp, base(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                    sequence_parallel=sp).last_hidden_state),
        base_oracle(ids).last_hidden_state))  # fmt: skip

    def switched(set_to: str, how: str) -> float:
        before = model.config._attn_implementation
        if how == "set":
            model.set_attn_implementation(set_to)
        else:
            model.config._attn_implementation = set_to
        try:
            return _err(logits(input_ids=batch.input_ids), want)
        finally:
            model.set_attn_implementation(before)

    case("set sdpa", lambda: switched("sdpa", "set"))
    case("config sdpa", lambda: switched("sdpa", "config"))
    case("config tokenring_ring", lambda: switched("tokenring_ring", "config"))
    if rank == 0:
        model.save_pretrained(save_dir)
    dist.barrier()
    auto = transformers.AutoModelForCausalLM
    case("loaded", lambda: _err(logits(auto.from_pretrained(save_dir, dtype=torch.float64),
                                       input_ids=batch.input_ids), want))  # fmt: skip
    case("loaded tokenring", lambda: _err(logits(auto.from_pretrained(
        save_dir, dtype=torch.float64, attn_implementation="tokenring"),
        input_ids=batch.input_ids), want))  # fmt: skip
    case("no sequence_parallel", lambda: model(input_ids=ids))
    case("transformers generate", lambda: model.generate(ids[:1], max_new_tokens=2))
    case("transformers generate, sequence_parallel",
         lambda: model.generate(ids[:1], max_new_tokens=2, sequence_parallel=sp))  # fmt: skip
    case("pipeline", lambda: _pipeline(model)("w5 w6 w7", max_new_tokens=2, do_sample=False))
    _, dropping = _pair({"attention_dropout": 0.1})
    case("dropout, eval", lambda: _err(logits(dropping, input_ids=batch.input_ids), want))
    case("dropout, train", lambda: logits(dropping.train(), input_ids=batch.input_ids))
    return out


def _bert(sp: Any, *, pooler: bool) -> Any:
    """A tiny float64 BERT's base model (with or without its pooler) on contiguous shards:
    the gathered last hidden state's and the pooler output's distances from one process."""
    import test_hf_architectures as arch

    config = arch._config("bert", encoder=True)
    torch.manual_seed(0)
    oracle = transformers.AutoModel.from_config(
        copy.deepcopy(config), attn_implementation="sdpa", add_pooling_layer=pooler
    )
    ours = transformers.AutoModel.from_config(
        copy.deepcopy(config), attn_implementation="tokenring", add_pooling_layer=pooler
    )
    ours.load_state_dict(oracle.state_dict())
    oracle, ours = oracle.double().eval(), ours.double().eval()
    ids = arch._input_ids()
    batch = hf.shard_batch(sp, ids)
    with torch.no_grad():
        want = oracle(ids)
        got = ours(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
    return _err(hf.gather_sequence(sp, got.last_hidden_state), want.last_hidden_state)


def _tied_gradients(sp: Any, batch: Any, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Tied embeddings, train(), use_cache=True: the summed gradients against one process's
    (float64 cross-entropy), the largest distance."""
    oracle, model = _pair({"tie_word_embeddings": True})
    model.train()
    want = oracle(ids).logits[:, :-1]
    F.cross_entropy(want.reshape(-1, V), labels[:, 1:].reshape(-1)).backward()
    loss = model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=labels,
                 sequence_parallel=sp, use_cache=True).loss  # fmt: skip
    loss.backward()
    hf.all_reduce_gradients(sp, model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pairs = zip(oracle.parameters(), model.parameters(), strict=True)
    return max(_err(p.grad, q.grad) for p, q in pairs)


def _pipeline(model: Any) -> Any:
    """transformers' text-generation pipeline over a word-level tokenizer of w0..w{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", eos_token="w1", pad_token="w2"
    )
    return transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)


NEEDS_SP = "needs sequence_parallel=tokenring.hf.SequenceParallel"
RAISED_ON_EVERY_RANK = {
    # case: (part of every rank's message; part of the message on one rank or the other)
    "right padding": "padding attention_mask",
    "left padding": "padding attention_mask",
    "sequence classification": "LlamaForSequenceClassification",
    "logits_to_keep=1": "logits_to_keep",
    "bert pooler": "pooler_output",
    "num_items_in_batch": "num_items_in_batch is not supported",
    "cache handed back": "takes no KV cache",
    "set sdpa": "attn_implementation='sdpa'",
    "config sdpa": "attn_implementation='sdpa'",
    "loaded": "attn_implementation='sdpa'",
    "no sequence_parallel": NEEDS_SP,
    "transformers generate": NEEDS_SP,
    "transformers generate, sequence_parallel": "sequence_parallel",
    "pipeline": NEEDS_SP,
    "dropout, train": "attention dropout is not supported",
}


def test_transformers_usage_on_two_ranks(tmp_path: Any) -> None:
    """Every case of rank_usage on 2 ranks: the held cases match one process within 1e-10;
    the refused ones raise on every rank within 3 s, naming what is refused."""
    per_rank = tokenring.launch(
        rank_usage, str(tmp_path / "saved"), world_size=2, timeout_s=120, pg_timeout_s=10
    )
    for rank, got in enumerate(per_rank):
        for case, (kind, value, seconds) in got.items():
            where = f"rank {rank}, {case}"
            if case in RAISED_ON_EVERY_RANK:
                assert kind == "error", f"{where}: no error, got {value}"
                assert RAISED_ON_EVERY_RANK[case] in value, f"{where}: {value}"
                assert seconds < 3, f"{where}: raised after {seconds:.1f} s: {value}"
                continue
            assert kind == "ok", f"{where}: {value}"
            errors = value if isinstance(value, list) else [value]
            assert all(abs(e) <= 1e-10 for e in errors), f"{where}: off one process by {value}"
