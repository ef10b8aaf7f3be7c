"""transformers Llama with tokenring attention on gloo ranks, against the same model in one process.

One launch per world size; the grid (config, attn_implementation, dtype, how the loss is
taken) is looped inside the ranks. The ranks run the model on their zigzag shards through
``tokenring.hf`` and send back (from rank 0) the gathered logits, the global loss and the
summed parameter gradients; this process runs the same weights on the whole sequence with
transformers' own SDPA attention (and its own masks: Llama 4's chunked attention included)
and computes the loss with its own shift, written here independently of ``tokenring.hf``.

Tolerances (../shared/STYLE.md): float64 within 1e-10; bfloat16 within twice the error of the
same model in bfloat16 in one process plus one rounding step at the tensor's magnitude.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from tokenring.model.costmodel import measured

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
)
from transformers import masking_utils as mu  # noqa: E402

from tokenring import hf  # noqa: E402
from tokenring.hf import attention as hf_attention  # noqa: E402

ModelMask = hf_attention._ModelMask

IGNORE = -100
BATCH = 2
VOCAB = 64
FP64 = 1e-10
WINDOW = 5  # tokens a query sees in the sliding-window config, itself included
CHUNK = 4  # Llama 4's attention_chunk_size in the chunked config


@dataclass(frozen=True)
class Case:
    """One model run: which model, attention, dtype, and how the sequence is cut."""

    config: str
    impl: str = "tokenring"
    dtype: str = "float64"
    seq_len: int = 16  # 16: divisible by 2P for P = 2 and 4; others give uneven shards
    docs: tuple[int, ...] | None = None  # cu_seqlens of a packed sequence
    layout: str = "zigzag"
    # how the loss is taken: "" hf.shard_batch + hf.causal_lm_loss; else model(labels=...)
    # with "local" (this rank's shard of the unshifted labels), "global" (B, S) labels, or
    # "shift" (labels and shift_labels=batch.shift_labels)
    labels: str = ""

    def plan(self, world_size: int, **options: Any) -> hf.SequenceParallel:
        even = self.docs is None and self.seq_len % (2 * world_size) == 0
        seq_len = None if even else self.seq_len  # even shards also work without seq_len
        return hf.SequenceParallel(
            layout=self.layout, seq_len=seq_len, cu_seqlens=self.docs, **options
        )


def model_config(name: str) -> Any:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "max_position_embeddings": 32,
        "use_cache": False,
    }
    if name == "gqa":  # GQA (4 query heads on 2 kv heads), RoPE, causal: the Llama shape
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    if name == "mha_bias_tied":  # q/k/v/o biases and tied embeddings: every parameter kind
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            tie_word_embeddings=True,
            **common,
        )
    if name.startswith("llama4"):
        # layer 0 chunked attention (RoPE), layer 1 full attention (NoPE), dense MLPs; NoPE
        # temperature tuning changes nothing below floor_scale (8192) tokens, and "llama4_tt"
        # lowers floor_scale to 4 so that it does
        return Llama4TextConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size_mlp=48,
            attention_chunk_size=CHUNK,
            no_rope_layers=[1, 0],
            moe_layers=[],
            floor_scale=4 if name == "llama4_tt" else 8192,
            **common,
        )
    assert name == "mistral_window"  # Llama with a sliding window
    return MistralConfig(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, **common
    )


CONFIGS = ("gqa", "mha_bias_tied", "mistral_window", "llama4_chunked")


def build_model(
    name: str, state: dict[str, torch.Tensor], dtype: torch.dtype, attn_implementation: str
) -> Any:
    model = AutoModelForCausalLM.from_config(
        model_config(name), attn_implementation=attn_implementation
    )
    model.load_state_dict(state)
    return model.to(dtype)


def make_batch(seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global input ids and labels; some labels ignored, unevenly over the ranks' shards."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=gen)
    labels = input_ids.clone()
    labels[0, :5] = IGNORE
    labels[1, 2 * seq_len // 3] = IGNORE
    return input_ids, labels


# -- inside the ranks ----------------------------------------------------------------------


def _sharded_step(
    model: Any,
    sp: hf.SequenceParallel,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    how: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, loss and backward on this rank's shard; gradients summed over the group.
    ``how``: as ``Case.labels``."""
    batch = hf.shard_batch(sp, input_ids, labels, ignore_index=IGNORE)
    assert batch.shift_labels is not None
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    if how == "":
        out = model(**inputs, sequence_parallel=sp)
        loss = hf.causal_lm_loss(sp, out.logits, batch.shift_labels, ignore_index=IGNORE)
    elif how == "shift":
        given = batch.shift_labels
        out = model(**inputs, labels=given, shift_labels=given, sequence_parallel=sp)
        loss = out.loss
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        layout, docs = sp.layout, sp.cu_seqlens
        given = labels
        if how == "local":
            given = tokenring.shard(
                labels, rank=rank, world_size=world_size, layout=layout, cu_seqlens=docs
            )
        out = model(**inputs, labels=given, sequence_parallel=sp)
        loss = out.loss
    loss.backward()
    hf.all_reduce_gradients(sp, model)
    return out.logits, loss


def refusals(sp: hf.SequenceParallel) -> list[str]:
    """What must raise on every rank, with the message (or "no error")."""
    found = []
    ids = make_batch(16)[0]
    batch = hf.shard_batch(sp, ids)
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    tuned = AutoModelForCausalLM.from_config(
        model_config("llama4_tt"), attn_implementation="tokenring"
    )
    gqa = AutoModelForCausalLM.from_config(model_config("gqa"), attn_implementation="tokenring")
    # without position_ids each rank counts its shard from 0: contiguous shards are each one
    # offset away from their global positions (another one per rank), zigzag ones are not
    contiguous = hf.SequenceParallel(group=sp.group, layout="contiguous")
    contiguous_ids = hf.shard_batch(contiguous, ids).input_ids
    for call in (
        lambda: tuned(**inputs, sequence_parallel=sp),
        lambda: gqa(**inputs, labels=ids, num_items_in_batch=5, sequence_parallel=sp),
        lambda: gqa(input_ids=contiguous_ids, sequence_parallel=contiguous),
        lambda: gqa(input_ids=batch.input_ids, sequence_parallel=sp),
    ):
        try:
            call()
            found.append("no error")
        except NotImplementedError as exc:
            found.append(str(exc))
    return found


def run_grid(
    states: dict[str, dict[str, torch.Tensor]],
    cases: list[Case],
    train_steps: int,
    refuse: bool = False,
) -> dict[str, Any]:
    hf.register()
    world_size = dist.get_world_size()
    # "tokenring_auto" picks from a description of the links and kernels (none measured here)
    cpu = measured(
        forward_flops_per_s=2e10,
        backward_flops_per_s=1e10,
        link_bandwidth_bytes_per_s=1e9,
        memory_bandwidth_bytes_per_s=1e10,
        dtype=torch.float64,
    )
    results: dict[str, Any] = {"cases": [], "losses": [], "curve": []}
    results["refused"] = refusals(Case("gqa").plan(world_size)) if refuse else []
    for case in cases:
        sp = case.plan(world_size, hardware=cpu if case.impl == "tokenring_auto" else None)
        model = build_model(case.config, states[case.config], getattr(torch, case.dtype), case.impl)
        logits, loss = _sharded_step(model, sp, *make_batch(case.seq_len), case.labels)
        results["losses"].append(loss.item())
        grads = {n: p.grad for n, p in model.named_parameters()}
        full_logits = hf.gather_sequence(sp, logits)
        if dist.get_rank() == 0:
            results["cases"].append({"logits": full_logits, "loss": loss.item(), "grads": grads})
    if train_steps:
        case = Case("gqa")
        sp = case.plan(world_size)
        model = build_model(case.config, states[case.config], torch.float64, case.impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(train_steps):
            _, loss = _sharded_step(model, sp, *make_batch(case.seq_len))
            opt.step()
            opt.zero_grad()
            results["curve"].append(loss.item())
    return results


# -- the single-process reference ----------------------------------------------------------


def reference_inputs(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """Inputs of the one-process run: for documents and windows an explicit additive mask and
    positions restarting per document, spelled out here from their definitions."""
    input_ids, labels = make_batch(case.seq_len)
    window = WINDOW if case.config == "mistral_window" else None
    if case.docs is None and window is None:
        return {"input_ids": input_ids, "labels": labels}  # transformers' own causal mask
    n = case.seq_len
    doc = torch.zeros(n, dtype=torch.int64)
    start = torch.zeros(n, dtype=torch.int64)
    for d, (a, b) in enumerate(itertools.pairwise(case.docs or (0, n))):
        doc[a:b], start[a:b] = d, a
        if a > 0:
            labels[:, a] = IGNORE  # no prediction across a document boundary
    if case.config.startswith("llama4"):
        # transformers' own masks per layer type (chunked and full): it finds the documents
        # from the positions restarting at each, and counts chunks from each document's start
        return {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": (torch.arange(n) - start)[None],
        }
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) & (doc[:, None] == doc[None, :])
    if window is not None:
        allowed &= i - j < window
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": (torch.arange(n) - start)[None],
        "attention_mask": mask.expand(BATCH, 1, n, n),
    }


def reference(case: Case, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The model on the whole sequence in one process (transformers' SDPA), loss by the
    textbook shift: the logits at t predict the label at t + 1."""
    model = build_model(case.config, state, dtype, "sdpa")
    inputs = reference_inputs(case, dtype)
    labels = inputs.pop("labels")
    logits = model(**inputs).logits
    acc = torch.promote_types(dtype, torch.float32)
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).to(acc), labels[:, 1:].reshape(-1), ignore_index=IGNORE
    )
    loss.backward()
    return {
        "logits": logits.detach(),
        "loss": loss.item(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def reference_curve(state: dict[str, torch.Tensor], steps: int) -> list[float]:
    model = build_model("gqa", state, torch.float64, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids, labels = make_batch(16)
    curve = []
    for _ in range(steps):
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        curve.append(loss.item())
    return curve


def initial_states() -> dict[str, dict[str, torch.Tensor]]:
    states = {}
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(model_config(name))
        with torch.no_grad():  # larger weights than the default init: differences show
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        states[name] = copy.deepcopy(model.state_dict())
    return states


def max_errors(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    errors = {
        "logits": (got["logits"].double() - want["logits"].double()).abs().max().item(),
        "loss": abs(got["loss"] - want["loss"]),
    }
    for name, g in want["grads"].items():
        errors[f"grad {name}"] = (got["grads"][name].double() - g.double()).abs().max().item()
    return errors


def scales(want: dict[str, Any]) -> dict[str, float]:
    out = {"logits": want["logits"].abs().max().item(), "loss": abs(want["loss"])}
    for name, g in want["grads"].items():
        out[f"grad {name}"] = g.abs().max().item()
    return out


def check_world(
    world_size: int, cases: list[Case], train_steps: int, refuse: bool = False
) -> dict[str, float]:
    """Run the grid on ``world_size`` ranks and compare; returns the max error per dtype
    (logits and gradients), for the record. ``refuse``: also check :func:`refusals`."""
    states = initial_states()
    per_rank = tokenring.launch(
        run_grid, states, cases, train_steps, refuse, world_size=world_size, timeout_s=300
    )
    failures = []
    for rank, res in enumerate(per_rank):
        if refuse and not (
            "attn_temperature_tuning" in res["refused"][0]
            and "wrong on rank" in res["refused"][0]
            and "num_items_in_batch is not supported" in res["refused"][1]
            and "by another offset per rank" in res["refused"][2]
            and "position_ids are not rank 0's positions" in res["refused"][3]
        ):
            failures.append(f"rank {rank} refusals: {res['refused']}")
    for rank, res in enumerate(per_rank):  # every rank reports the same global loss
        if res["losses"] != per_rank[0]["losses"] or res["curve"] != per_rank[0]["curve"]:
            failures.append(f"rank {rank} losses {res['losses']} != rank 0 {per_rank[0]['losses']}")
    summary: dict[str, float] = {}
    wants: dict[Case, dict[str, Any]] = {}  # cases that differ only in impl share a reference
    for case, got in zip(cases, per_rank[0]["cases"], strict=True):
        dtype = getattr(torch, case.dtype)
        if dtype == torch.float64:
            key = dataclasses.replace(case, impl="")
            if key not in wants:
                wants[key] = reference(case, states[case.config], torch.float64)
            want = wants[key]
            bounds = dict.fromkeys(max_errors(got, want), FP64)
        else:
            # the same rounded weights in float64, and the plain one-process model in dtype
            rounded = {k: v.to(dtype) for k, v in states[case.config].items()}
            want = reference(case, rounded, torch.float64)
            plain = max_errors(reference(case, rounded, dtype), want)
            eps = torch.finfo(dtype).eps
            bounds = {k: 2 * plain[k] + eps * s for k, s in scales(want).items()}
        errors = max_errors(got, want)
        for name, err in errors.items():
            if not err <= bounds[name]:
                failures.append(f"{case} {name}: {err:.3g} > {bounds[name]:.3g}")
            kind = f"{case.dtype} {'logits' if name == 'logits' else 'grads'}"
            if name != "loss":  # for the record: the worst error, and of one process
                summary[kind] = max(summary.get(kind, 0.0), err)
                if dtype != torch.float64:
                    one = f"{kind} (one process)"
                    summary[one] = max(summary.get(one, 0.0), plain[name])
    if train_steps:
        want_curve = reference_curve(states["gqa"], train_steps)
        got_curve = per_rank[0]["curve"]
        if max(abs(a - b) for a, b in zip(got_curve, want_curve, strict=True)) > FP64:
            failures.append(f"loss curve {got_curve} != one process {want_curve}")
        if not want_curve[-1] < want_curve[0]:
            failures.append(f"the reference did not train: {want_curve}")
    assert not failures, "\n".join(failures)
    return summary


RING = ["tokenring", "tokenring_ring", "tokenring_bidir_ring"]  # documents, windows, any length
EVERY = [*RING, *(f"tokenring_{s.value}" for s in tokenring.Strategy if s.is_collective)]


def test_llama_four_ranks_matches_one_process() -> None:
    cases = [Case("gqa", impl) for impl in [*EVERY, "tokenring_auto"]]
    cases += [Case("mha_bias_tied", impl) for impl in ("tokenring", "tokenring_ulysses")]
    # packed documents and any length (ring with documents runs on 2 ranks below)
    cases += [
        Case("gqa", impl, docs=(0, 5, 11, 16)) for impl in ("tokenring", "tokenring_bidir_ring")
    ]
    cases += [Case("gqa", "tokenring_ring", seq_len=15)]
    cases += [Case("gqa", "tokenring", seq_len=13, docs=(0, 6, 13))]
    cases += [
        Case("mistral_window", "tokenring", layout="contiguous"),
        Case("mistral_window", "tokenring_ring"),
        Case("mistral_window", "tokenring_bidir_ring", docs=(0, 9, 16)),
    ]
    cases += [Case("gqa", "tokenring", dtype="bfloat16")]
    # Llama 4: chunked attention (chunk 4) on layer 0, full attention on layer 1
    cases += [
        Case("llama4_chunked", "tokenring"),
        Case("llama4_chunked", "tokenring_ring", docs=(0, 5, 11, 16)),
        Case("llama4_chunked", "tokenring_ulysses", layout="contiguous"),
        Case("llama4_chunked", "tokenring_bidir_ring", seq_len=13, docs=(0, 6, 13)),
    ]
    # the model's own loss: model(..., labels=...) shifts over the global sequence
    cases += [
        Case("gqa", "tokenring", labels="local"),
        Case("gqa", "tokenring_ring", docs=(0, 5, 11, 16), labels="global"),
        Case("llama4_chunked", "tokenring", seq_len=13, docs=(0, 6, 13), labels="local"),
    ]
    summary = check_world(4, cases, train_steps=3)
    print(f"4 ranks, {len(cases)} cases: max |error| {summary}")


def test_llama_two_ranks_matches_one_process() -> None:
    cases = [
        Case("gqa", "tokenring"),
        Case("gqa", "tokenring_ring", docs=(0, 5, 11, 16)),
        Case("gqa", "tokenring_bidir_ring", seq_len=7),
        Case("gqa", "tokenring_ring", seq_len=9, labels="shift"),
        Case("llama4_chunked", "tokenring", labels="local"),
    ]
    summary = check_world(2, cases, train_steps=0, refuse=True)
    print(f"2 ranks, {len(cases)} cases: max |error| {summary}")


# -- in this process (a world of one rank) ---------------------------------------------------


def test_register_names_every_strategy_and_auto() -> None:
    names = hf.register()
    assert set(names) == {"tokenring", "tokenring_auto"} | {
        f"tokenring_{s.value}" for s in tokenring.Strategy if s is not tokenring.Strategy.HYBRID
    }
    for name in names:  # transformers accepts each one
        model = AutoModelForCausalLM.from_config(model_config("gqa"), attn_implementation=name)
        assert model.config._attn_implementation == name


def test_register_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails like an absent package
    with pytest.raises(ImportError, match=r"pip install 'tokenring-attention\[hf\]'"):
        hf.register()


@pytest.mark.parametrize("installed", ["5.23.0", "4.57.6", "4.56.2"])
def test_register_on_an_older_transformers_names_both_versions(
    monkeypatch: pytest.MonkeyPatch, installed: str
) -> None:
    """On these versions the hf tests failed (masks and caches of other signatures; on 5.20
    Llama 4 chunked logits differed from one process), so register() refuses them."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", installed)
    with pytest.raises(ImportError, match=rf"transformers >= 5\.24; transformers {installed}"):
        hf.register()


@pytest.mark.usefixtures("single_rank_group")
def test_one_rank_matches_sdpa_and_refuses_what_it_cannot_do() -> None:
    hf.register()
    state = initial_states()["gqa"]
    model = build_model("gqa", state, torch.float64, "tokenring")
    sp = hf.SequenceParallel(layout="zigzag")
    input_ids, labels = make_batch(16)
    batch = hf.shard_batch(sp, input_ids, labels)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp)
    assert batch.shift_labels is not None
    loss = hf.causal_lm_loss(sp, out.logits, batch.shift_labels)
    want = reference(Case("gqa"), state, torch.float64)
    assert (out.logits - want["logits"]).abs().max().item() <= FP64
    assert abs(loss.item() - want["loss"]) <= FP64

    with pytest.raises(ValueError, match="needs sequence_parallel="):
        model(input_ids=input_ids)
    padding = torch.ones_like(input_ids)
    padding[0, -3:] = 0
    with pytest.raises(NotImplementedError, match="padding attention_mask"):
        model(input_ids=input_ids, attention_mask=padding, sequence_parallel=sp)
    prefill = model(input_ids=input_ids, sequence_parallel=sp, use_cache=True)
    # transformers 5 calls the cache `cache`, 4.x `past_key_values`
    name = "cache" if hasattr(prefill, "cache") else "past_key_values"
    with pytest.raises(NotImplementedError, match="KV cache"):
        model(input_ids=input_ids[:, -2:], sequence_parallel=sp, **{name: getattr(prefill, name)})


@pytest.mark.usefixtures("single_rank_group")
def test_attention_options_tokenring_cannot_honour_raise() -> None:
    """An attention keyword that changes the scores (T5's position_bias, attention sinks)
    raises instead of being dropped; None or False for it, and bookkeeping, pass."""
    hf.register()
    name = "tokenring"
    attend = AttentionInterface()[name]
    module = torch.nn.Module()
    sp = hf.SequenceParallel()
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)  # (B, H, s, D)
    k = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    fine = {"sinks": None, "output_attentions": False, "use_cache": True, "deterministic": True}
    out, _ = attend(module, q, k, k, None, sequence_parallel=sp, **fine)
    assert out.shape == (1, 8, 4, 8)
    for option, value, named in (
        ("position_bias", torch.zeros(1, 4, 8, 8), r"position_bias \(a tensor of shape"),
        ("sinks", torch.zeros(4), "sinks"),
        ("head_mask", torch.ones(4), "head_mask"),
        ("attention_temperature", 0.5, "attention_temperature=0.5"),
    ):
        with pytest.raises(
            NotImplementedError, match=f"does not support the attention option {named}"
        ):
            attend(module, q, k, k, None, sequence_parallel=sp, **{option: value})


@pytest.mark.usefixtures("single_rank_group")
def test_position_ids_must_be_the_shards_up_to_an_offset() -> None:
    """Documents packed in position_ids alone (transformers would mask them) raise; with
    SequenceParallel(cu_seqlens=...) the same call matches one process, and a constant offset
    (RoBERTa's positions) passes."""
    hf.register()
    state = initial_states()["gqa"]
    sdpa = build_model("gqa", state, torch.float64, "sdpa")  # eager's softmax is float32
    model = build_model("gqa", state, torch.float64, "tokenring")
    input_ids, _ = make_batch(8)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(
        NotImplementedError, match="token 4: got 0 where the shard holds position 4"
    ):
        model(input_ids=input_ids, position_ids=packed, sequence_parallel=hf.SequenceParallel())
    sp = hf.SequenceParallel(layout="contiguous", seq_len=8, cu_seqlens=(0, 4, 8))
    batch = hf.shard_batch(sp, input_ids)
    assert torch.equal(batch.position_ids, packed)
    got = model(input_ids=input_ids, position_ids=packed, sequence_parallel=sp).logits
    want = sdpa(input_ids=input_ids, position_ids=packed).logits
    assert (got - want).abs().max().item() <= FP64
    shifted = torch.arange(8)[None] + 5  # every token 5 further: one offset
    got = model(input_ids=input_ids, position_ids=shifted, sequence_parallel=hf.SequenceParallel())
    want = sdpa(input_ids=input_ids, position_ids=shifted).logits
    assert (got.logits - want).abs().max().item() <= FP64


def test_shift_labels_is_global_and_stops_at_documents() -> None:
    labels = torch.arange(8).view(1, 8)
    assert hf.shift_labels(labels).tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    assert hf.shift_labels(labels, cu_seqlens=(0, 3, 8)).tolist() == [
        [1, 2, -100, 4, 5, 6, 7, -100]
    ]


@pytest.mark.usefixtures("single_rank_group")
def test_plan_and_batch_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="cu_seqlens needs seq_len"):
        hf.SequenceParallel(cu_seqlens=(0, 4, 8))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        hf.SequenceParallel(seq_len=8, cu_seqlens=(0, 4, 9))
    ids = torch.zeros(1, 7, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"SequenceParallel\(seq_len=7\)"):
        hf.shard_batch(hf.SequenceParallel(layout="zigzag"), ids)
    with pytest.raises(ValueError, match=r"sp\.seq_len=8"):
        hf.shard_batch(hf.SequenceParallel(seq_len=8), ids)
    sp = hf.SequenceParallel(layout="contiguous", seq_len=7, cu_seqlens=torch.tensor([0, 3, 7]))
    assert sp.cu_seqlens == (0, 3, 7)
    batch = hf.shard_batch(sp, ids)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]


@pytest.mark.usefixtures("single_rank_group")
def test_model_masks_reach_the_attention_or_raise() -> None:
    """What transformers' mask builders hand our mask function becomes the library's mask
    (None: plain causal), or NotImplementedError naming the model option."""
    hf.register()

    def config(name: str, **changes: Any) -> Any:
        c = model_config(name)
        c._attn_implementation = "tokenring"
        for key, value in changes.items():
            setattr(c, key, value)
        return c

    embeds = torch.zeros(1, 8, 32)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # positions restarting: two documents

    def build(builder: Any, c: Any, **kwargs: Any) -> Any:
        return builder(config=c, inputs_embeds=embeds, attention_mask=None, cache=None, **kwargs)

    chunked = ModelMask(causal=True, window_size=(-1, 0), attention_chunk_size=CHUNK)
    window = ModelMask(causal=True, window_size=(WINDOW - 1, 0), attention_chunk_size=None)
    for builder, c, kwargs, want in [
        (mu.create_causal_mask, config("gqa"), {}, None),
        (mu.create_causal_mask, config("gqa"), {"position_ids": packed}, None),
        (mu.create_chunked_causal_mask, config("llama4_chunked"), {}, chunked),
        (
            mu.create_chunked_causal_mask,
            config("llama4_chunked"),
            {"position_ids": packed},
            chunked,
        ),
        (mu.create_sliding_window_causal_mask, config("mistral_window"), {}, window),
        (
            mu.create_causal_mask,
            config("gqa", is_causal=False),
            {},
            ModelMask(causal=False, window_size=(-1, -1), attention_chunk_size=None),
        ),
        (
            mu.create_sliding_window_causal_mask,
            config("mistral_window", is_causal=False),
            {},
            ModelMask(causal=False, window_size=(WINDOW, WINDOW), attention_chunk_size=None),
        ),
    ]:
        assert build(builder, c, **kwargs) == want, (builder.__name__, kwargs)

    def image_tokens(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < 2

    for kwargs, option in [
        ({"or_mask_function": image_tokens}, "or_mask_function"),
        ({"and_mask_function": image_tokens}, "image_tokens"),
        (
            {"block_sequence_ids": torch.tensor([[0, 0, 1, 1, -1, -1, -1, -1]])},
            "block_sequence_ids",
        ),
    ]:
        for builder, name in [
            (mu.create_causal_mask, "gqa"),
            (mu.create_chunked_causal_mask, "llama4_chunked"),
        ]:
            with pytest.raises(NotImplementedError, match=option):
                build(builder, config(name), **kwargs)
    # the attention call checks the mask against the module: a bidirectional mask on a
    # causal module cannot be told apart from a bug
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.zeros(1, 4, 8, 8)
    bidirectional = ModelMask(causal=False, window_size=(-1, -1), attention_chunk_size=None)
    sp = hf.SequenceParallel(layout="zigzag")
    with pytest.raises(NotImplementedError, match="mask is not causal but the attention module"):
        hf_attention._attention_forward(
            module,
            q,
            q,
            q,
            bidirectional,
            strategy="token_ring",
            name="tokenring",
            sequence_parallel=sp,
        )
