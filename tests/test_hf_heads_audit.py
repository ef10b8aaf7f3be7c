"""transformers task heads under ``sequence_parallel=``: every output is this rank's shard of
the one-process output, a global loss, or an error on every rank at once.

One launch of three gloo ranks (communicators with a 5 s timeout, so a wait for a peer
shows); S = 7 gives shards of 3, 2 and 2 tokens in both layouts, S = 6 shards of 2 tokens
each. Oracle: the same tiny float64 model with SDPA attention in each rank's process
(per-token outputs gathered with ``hf.gather_sequence``, within 1e-10), or the documented
refusal on every rank within FAST_S.

Legend: B batch, S global seq, s local seq, P world size.
"""

from __future__ import annotations

import copy
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

from tiny_llama import raised_fast, timed  # noqa: E402
from tokenring import hf  # noqa: E402

WORLD, V = 3, 32
TIMEOUT_S = 5.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 3.0  # every rank must raise well within it
LAYOUTS = ("zigzag", "contiguous")


def _pair(cls: Any, config: Any) -> tuple[Any, Any]:
    """``cls`` of ``config`` with tokenring attention and the same weights with SDPA,
    float64, in eval mode."""
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(config), attn_implementation="tokenring")
    oracle = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    oracle.load_state_dict(model.state_dict())
    return model.double().eval(), oracle.double().eval()


def _bert() -> Any:
    return transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32,
    )  # fmt: skip


def _llama() -> Any:
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        use_cache=False, pad_token_id=0,
    )  # fmt: skip


def _errors(
    sp: Any, got: Any, want: Any, names: tuple[str, ...], loss: torch.Tensor | None = None
) -> dict[str, float]:
    """Each of ``names``: the largest distance of ``got``'s output from ``want``'s, per-token
    outputs gathered first (a tuple's entries are named by position: "0", "1", ...); the
    loss from ``loss`` where given (transformers' causal-LM loss upcasts to float32 only)."""
    out = {}
    for name in names:
        mine, theirs = (r[int(name)] if isinstance(r, tuple) else r[name] for r in (got, want))
        if loss is not None and mine.dim() == 0:
            theirs = loss
        if mine.shape != theirs.shape:
            mine = hf.gather_sequence(sp, mine)
        out[name] = float((mine - theirs).abs().max())
    return out


def _layout_cases(out: dict[str, Any], layout: str) -> None:
    rank = dist.get_rank()
    seq_len = 7
    ids = torch.randint(1, V, (2, seq_len), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel(seq_len=seq_len, layout=layout)
    batch = hf.shard_batch(sp, ids)
    mine = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    spans = {"start_positions": torch.tensor([1, 5]), "end_positions": torch.tensor([3, 6])}

    def case(name: str, model: Any, oracle: Any, kwargs: Any, *names: str, **whole: Any) -> None:
        def run() -> dict[str, float]:
            with torch.no_grad():
                got = model(**mine, **kwargs, sequence_parallel=sp)
                want = oracle(input_ids=ids, **whole)
            loss = None
            if "labels" in whole:  # the float64 causal-LM loss of the oracle's logits
                logits = want[1] if isinstance(want, tuple) else want.logits  # (B, S, V)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
            return _errors(sp, got, want, names, loss)

        out[f"{layout}: {name}"] = timed(TIMEOUT_S, run)

    qa, qa_oracle = _pair(transformers.BertForQuestionAnswering, _bert())
    case("bert qa", qa, qa_oracle, {}, "start_logits", "end_logits")
    case("bert qa tuple", qa, qa_oracle, {"return_dict": False}, "0", "1", return_dict=False)
    case("bert qa spans", qa, qa_oracle, spans, "loss", **spans)
    case("bert qa spans on rank 0", qa, qa_oracle, spans if rank == 0 else {}, "start_logits")
    llama_qa, llama_qa_oracle = _pair(transformers.LlamaForQuestionAnswering, _llama())
    case("llama qa", llama_qa, llama_qa_oracle, {}, "start_logits", "end_logits")
    case(
        "llama qa spans on rank 0", llama_qa, llama_qa_oracle, spans if rank == 0 else {},
        "start_logits",
    )  # fmt: skip
    pretraining, pretraining_oracle = _pair(transformers.BertForPreTraining, _bert())
    case("bert pretraining", pretraining, pretraining_oracle, {}, "prediction_logits")
    mlm, mlm_oracle = _pair(transformers.BertForMaskedLM, _bert())
    case("bert mlm", mlm, mlm_oracle, {}, "logits")
    case("bert mlm attentions on rank 0", mlm, mlm_oracle, {"output_attentions": rank == 0})
    lm, lm_oracle = _pair(transformers.LlamaForCausalLM, _llama())
    case("llama lm labels", lm, lm_oracle, {"labels": ids}, "loss", "logits", labels=ids)
    case(
        "llama lm labels tuple", lm, lm_oracle, {"labels": ids, "return_dict": False}, "0", "1",
        labels=ids, return_dict=False,
    )  # fmt: skip
    case("llama lm attentions on rank 0", lm, lm_oracle, {"output_attentions": rank == 0})


def _even_cases(out: dict[str, Any]) -> None:
    """S = 6 over 3 ranks: shards of 2 rows, the row count of a (B, 2) pooled output."""
    ids = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(1))
    sp = hf.SequenceParallel(layout="contiguous")
    batch = hf.shard_batch(sp, ids)
    model, oracle = _pair(transformers.BertForPreTraining, _bert())

    def run() -> dict[str, float]:
        with torch.no_grad():
            got = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                        sequence_parallel=sp)  # fmt: skip
            return _errors(sp, got, oracle(input_ids=ids), ("seq_relationship_logits",))

    out["bert pretraining, shards of 2"] = timed(TIMEOUT_S, run)


def run_cases() -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        _layout_cases(out, layout)
    _even_cases(out)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return tokenring.launch(run_cases, world_size=WORLD, timeout_s=150)


def _each(ranks: list[dict[str, Any]], check: Callable[[str, dict[str, Any]], None]) -> None:
    for res in ranks:
        for layout in LAYOUTS:
            check(f"{layout}: ", res)


def test_per_token_heads_match_one_process(ranks: list[dict[str, Any]]) -> None:
    """Question-answering span scores (B, s) (return_dict=False too), masked-LM and
    pretraining token logits, and the causal-LM loss from labels= (a tuple's first entry
    too): within 1e-10 of one process."""

    def check(at: str, res: dict[str, Any]) -> None:
        for name in ("bert qa", "bert qa tuple", "llama qa", "bert mlm", "llama lm labels"):
            got = res[at + name]
            assert "value" in got and max(got["value"].values()) < 1e-10, (name, got)
        got = res[at + "llama lm labels tuple"]
        assert "value" in got and max(got["value"].values()) < 1e-10, got

    _each(ranks, check)


def test_a_loss_from_span_positions_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """BertForQuestionAnswering given start_positions= and end_positions= computed its loss
    in its own code over each rank's start_logits, the positions clamped to the shard's
    length (nan on every rank, no error: the check keyed on labels= alone). It now raises on
    every rank naming the positions; ranks that differ in giving them (which returned a loss
    on rank 0 alone, or, through transformers' loss, raised there while the others returned)
    raise at once in the forward's rank check."""

    def check(at: str, res: dict[str, Any]) -> None:
        raised_fast(res[at + "bert qa spans"], FAST_S, "in its own code", "start_positions=")
        for name in ("bert qa spans on rank 0", "llama qa spans on rank 0"):
            raised_fast(res[at + name], FAST_S, "label keywords", "start_positions")

    _each(ranks, check)


def test_a_pooled_output_of_two_dims_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """BertForPreTraining's seq_relationship_logits (B, 2) pools the first token of each
    shard: over shards of 3, 2 and 2 rows rank 0 raised while ranks 1 and 2 passed it as
    their per-token shard (0.008 and 0.012 off one process); over shards of 2 rows every rank
    returned it without an error. A 2-D output other than span scores now raises on every
    rank."""

    def check(at: str, res: dict[str, Any]) -> None:
        raised_fast(res[at + "bert pretraining"], FAST_S, "seq_relationship_logits")

    _each(ranks, check)
    for res in ranks:
        raised_fast(res["bert pretraining, shards of 2"], FAST_S, "seq_relationship_logits")


def test_output_attentions_on_one_rank_raises_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """output_attentions=True on rank 0 alone: rank 0 raised in its attention call while ranks
    1 and 2 waited out the 5 s timeout in their position_ids check. The first attention
    call's options are now part of the forward's rank check."""

    def check(at: str, res: dict[str, Any]) -> None:
        for name in ("bert mlm attentions on rank 0", "llama lm attentions on rank 0"):
            raised_fast(res[at + name], FAST_S, "output_attentions")

    _each(ranks, check)


def test_any_model_still_compiles_fullgraph_with_return_dict_false() -> None:
    """register() wraps transformers' ModelOutput.to_tuple for every model, to name the
    entries of a sequence-parallel forward's tuple. The wrapper read a context variable,
    which dynamo cannot trace: once hf.register() had run, any model compiled with
    fullgraph=True and return_dict=False failed to compile, tokenring or not. While dynamo
    compiles it now records nothing; the compiled tuple equals the eager one."""
    hf.register()
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        got, want = (
            compiled(input_ids=ids, return_dict=False),
            model(input_ids=ids, return_dict=False),
        )
    assert len(got) == len(want) == 2
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
