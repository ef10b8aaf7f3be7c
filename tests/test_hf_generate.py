"""tokenring.hf.generate on 4 gloo ranks against transformers' own generate in one process.

One launch; the grid (prompt length, batch, cached strategy, greedy or sampling, chunked
prefill) is looped inside the ranks. Every rank runs ``hf.generate`` on the same prompt with
the KV cache sharded over the group; this process runs the same weights with transformers'
SDPA attention and its DynamicCache. The tokens must be identical, and the raw logits of
every step equal within float32's ``assert_close`` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig  # noqa: E402

from tokenring import hf  # noqa: E402
from tokenring.model.costmodel import measured  # noqa: E402
from tokenring.strategies.cached import CachedStrategy  # noqa: E402

VOCAB = 64
NEW_TOKENS = 5
WORLD_SIZE = 4
# what "auto" plans for, described rather than measured (no calibration run on the ranks)
HARDWARE = measured(
    forward_flops_per_s=2e10,
    backward_flops_per_s=1e10,
    link_bandwidth_bytes_per_s=1e9,
    memory_bandwidth_bytes_per_s=1e10,
    dtype=torch.float32,
)


@dataclass(frozen=True)
class Case:
    """One generate call."""

    prompt_len: int
    batch: int = 1
    strategy: str = "auto"
    sample: bool = False
    prefill_chunk_size: int | None = None
    block_size: int | None = None  # None: the prompt spread over every rank


CASES = [
    Case(16),  # 2P divides 16: the prompt is prefilled in the zigzag layout, pass-Q or pass-KV
    Case(13),  # odd: block-cyclic prefill, the simulator picks
    Case(16, strategy="pass_q"),
    Case(16, strategy="pass_kv"),
    Case(13, strategy="direct"),
    Case(13, strategy="tree"),
    Case(11, batch=2, block_size=64),  # both in one block: seq b starts on rank b
    Case(13, sample=True),  # every rank seeded alike draws the same tokens
    Case(13, prefill_chunk_size=5),  # a prefill on top of a cache
]


# every tiny model here: 2 layers of 4 query and 2 K/V heads
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def model_config() -> Any:
    return LlamaConfig(**TINY)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(model_config())
    with torch.no_grad():  # larger weights than the default init: the logits spread out
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.state_dict()


def build_model(state: dict[str, torch.Tensor], attn_implementation: str) -> Any:
    model = AutoModelForCausalLM.from_config(
        model_config(), attn_implementation=attn_implementation
    )
    model.load_state_dict(state)
    return model.eval()


def prompt(case: Case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.prompt_len)
    return torch.randint(0, VOCAB, (case.batch, case.prompt_len), generator=gen)


def gen_kwargs(case: Case) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": case.sample,
        "return_dict_in_generate": True,
        "output_logits": True,
        "pad_token_id": 0,
    }
    if case.sample:
        kwargs.update(temperature=2.0, top_k=0, top_p=1.0)
    if case.prefill_chunk_size is not None:
        kwargs["prefill_chunk_size"] = case.prefill_chunk_size
    return kwargs


# -- inside the ranks ----------------------------------------------------------------------


def run_cases(state: dict[str, torch.Tensor], cases: list[Case]) -> dict[str, Any]:
    hf.register()
    model = build_model(state, "tokenring")
    out: dict[str, Any] = {"cases": [], "refused": refusals(model)}
    for case in cases:
        sp = hf.SequenceParallel(hardware=HARDWARE if case.strategy == "auto" else None)
        torch.manual_seed(1234)  # the same on every rank: sampling draws alike
        with torch.no_grad():
            res = hf.generate(
                sp,
                model,
                prompt(case),
                strategy=case.strategy,
                block_size=case.block_size,
                **gen_kwargs(case),
            )
        out["cases"].append(
            {
                "sequences": res.sequences,
                "logits": torch.stack(res.logits, dim=1),  # (B, new, V)
                "strategies": [s.value for s in res.cache.strategies],
                "held": res.cache.kv.tokens_held(),  # [rank][sequence]
            }
        )
    return out


def refusals(model: Any) -> list[str]:
    """What cannot run raises, on every rank alike (no rank waits for another)."""
    sp = hf.SequenceParallel()
    ids = torch.zeros(1, 8, dtype=torch.int64)
    messages = []
    for kwargs, error in [
        ({"num_beams": 2}, NotImplementedError),
        ({"prompt_lookup_num_tokens": 3}, NotImplementedError),
        ({"use_cache": False}, ValueError),
        ({"output_hidden_states": True, "return_dict_in_generate": True}, NotImplementedError),
        ({"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])}, NotImplementedError),
    ]:
        with pytest.raises(error) as info:
            hf.generate(sp, model, ids, max_new_tokens=2, **kwargs)
        messages.append(str(info.value))
    # ranks whose prompts differ: every rank raises at the first step
    rank_ids = torch.full((1, 8), dist.get_rank(), dtype=torch.int64)
    with pytest.raises(ValueError) as info:
        hf.generate(sp, model, rank_ids, max_new_tokens=2, do_sample=False)
    messages.append(str(info.value))
    # a model without tokenring attention would attend within each rank's rows
    with pytest.raises(ValueError) as info:
        hf.generate(sp, build_model(model.state_dict(), "sdpa"), ids, max_new_tokens=2)
    messages.append(str(info.value))
    # a sliding window is not what the cached attention computes
    window = AutoModelForCausalLM.from_config(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
        ),
        attn_implementation="tokenring",
    )
    with pytest.raises(NotImplementedError) as info:
        hf.generate(sp, window, ids, max_new_tokens=2, do_sample=False)
    messages.append(str(info.value))
    return messages


# -- the one-process reference ---------------------------------------------------------------


def reference(state: dict[str, torch.Tensor], case: Case) -> dict[str, torch.Tensor]:
    model = build_model(state, "sdpa")
    torch.manual_seed(1234)
    with torch.no_grad():
        res = model.generate(prompt(case), **gen_kwargs(case))
    return {"sequences": res.sequences, "logits": torch.stack(res.logits, dim=1)}


def test_generate_on_four_ranks_matches_one_process() -> None:
    state = initial_state()
    per_rank = tokenring.launch(run_cases, state, CASES, world_size=WORLD_SIZE, timeout_s=400)
    for rank, res in enumerate(per_rank):
        refused = res["refused"]
        for message, expected in zip(
            refused,
            [
                "beam search (num_beams > 1)",
                "prompt lookup decoding",
                "use_cache=False",
                "output_hidden_states",
                "padding attention_mask",
                "different token ids",
                "model must run a tokenring attention",
                "window_size=(3, 0)",
            ],
            strict=True,
        ):
            assert expected in message, (rank, message)
    worst = 0.0
    for i, case in enumerate(CASES):
        want = reference(state, case)
        assert want["sequences"].shape == (case.batch, case.prompt_len + NEW_TOKENS)
        for rank, res in enumerate(per_rank):
            got = res["cases"][i]
            assert torch.equal(got["sequences"], want["sequences"]), (case, rank)
            torch.testing.assert_close(got["logits"], want["logits"], msg=f"{case} rank {rank}")
            worst = max(worst, (got["logits"] - want["logits"]).abs().max().item())
            assert got["strategies"] == per_rank[0]["cases"][i]["strategies"]
        held = per_rank[0]["cases"][i]["held"]
        total = case.prompt_len + NEW_TOKENS - 1  # the last token is never fed back
        assert [sum(col) for col in zip(*held, strict=True)] == [total] * case.batch, held
        if case.block_size is None:  # the prompt and the new tokens on every rank
            assert all(n > 0 for row in held for n in row), (case, held)
        else:  # one block of 64: sequence b on rank b alone
            assert held == [[total if r == b else 0 for b in range(case.batch)] for r in range(4)]
        strategies = per_rank[0]["cases"][i]["strategies"]
        steps = NEW_TOKENS  # the prefill, then one decode step per new token but the last
        if case.prefill_chunk_size is not None:
            steps += -(-case.prompt_len // case.prefill_chunk_size) - 1
        assert len(strategies) == steps, (case, strategies)
        if case.strategy != "auto":
            assert set(strategies) == {case.strategy}, (case, strategies)
        elif case.prompt_len % (2 * WORLD_SIZE) == 0:  # zigzag prefill: TokenRing or Ring
            assert strategies[0] in (CachedStrategy.PASS_Q.value, CachedStrategy.PASS_KV.value)
    print(f"{len(CASES)} calls on {WORLD_SIZE} ranks: same tokens; max |logit diff| {worst:.3g}")


# -- in this process (a world of one rank) ---------------------------------------------------


@pytest.mark.usefixtures("single_rank_group")
def test_one_rank_generate_and_errors_name_the_fix() -> None:
    """One rank is the plain model; bad arguments raise naming what was expected."""
    hf.register()
    state = initial_state()
    model = build_model(state, "tokenring")
    case = Case(13)
    want = reference(state, case)
    with torch.no_grad():
        sp = hf.SequenceParallel(hardware=HARDWARE)
        got = hf.generate(sp, model, prompt(case), **gen_kwargs(case))
    assert torch.equal(got.sequences, want["sequences"])
    with pytest.raises(ValueError, match=r"sp must be a tokenring\.hf\.SequenceParallel"):
        hf.generate(None, model, prompt(case))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"input_ids must be a \(batch, seq\) tensor"):
        hf.generate(hf.SequenceParallel(), model, prompt(case)[0])
    with pytest.raises(ValueError, match="strategy must be one of"):
        hf.generate(hf.SequenceParallel(), model, prompt(case), strategy="fastest")
    with pytest.raises(ValueError, match="hardware only plans strategy='auto'"):
        hf.generate(hf.SequenceParallel(hardware=HARDWARE), model, prompt(case), strategy="tree")
    with pytest.raises(ValueError, match="without seq_len and cu_seqlens; got seq_len=13"):
        hf.generate(hf.SequenceParallel(seq_len=13), model, prompt(case))
    with pytest.raises(ValueError, match="block_size must be an int >= 1 or None; got 0"):
        hf.generate(hf.SequenceParallel(), model, prompt(case), block_size=0)
    with pytest.raises(NotImplementedError, match="continuing from a cache"):
        hf.generate(hf.SequenceParallel(), model, prompt(case), cache=object())
    # the cache refuses what it cannot do, naming it
    cache = got.cache
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="cropping"):
        cache.crop(1)
    # broadcast_batch: tensors only
    with pytest.raises(ValueError, match=r"batch\['ids'\] must be a tensor; got list"):
        hf.broadcast_batch(hf.SequenceParallel(), {"ids": [1, 2]})  # type: ignore[dict-item]
    assert hf.data_parallel_loss(hf.SequenceParallel(), torch.tensor(2.5)).item() == 2.5


@pytest.mark.usefixtures("single_rank_group")
def test_hybrid_mesh_from_a_device_mesh_needs_two_dims() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("outer", "inner"))
    hybrid = tokenring.HybridMesh.from_device_mesh(mesh)
    assert (hybrid.outer_size, hybrid.inner_size) == (1, 1)
    with pytest.raises(ValueError, match=r"mesh must be a 2-D DeviceMesh .* got ndim=1"):
        tokenring.HybridMesh.from_device_mesh(mesh["outer"])
    with pytest.raises(ValueError, match="got str"):
        tokenring.HybridMesh.from_device_mesh("outer x inner")


# -- windows the sequence fits in ------------------------------------------------------------

WINDOW_PROMPT = 9  # odd: block-cyclic prefill over 2 ranks
WINDOW_NEW = 4
FITS = WINDOW_PROMPT + WINDOW_NEW - 1  # tokens of the last forward (the last new one is not fed)
# (model_type, changes): Mistral's default sliding_window (4096), a window the last forward
# just fits, Gemma 3's sliding layers between full ones, Llama 4's chunks the same
WINDOWED = (
    ("mistral", {}),
    ("mistral", {"sliding_window": FITS}),
    ("gemma3_text", {"sliding_window": FITS, "head_dim": 8}),
    ("llama4_text", {"attention_chunk_size": FITS, "head_dim": 8, "no_rope_layers": [1, 1]}),
)


def windowed_model(name: str, changes: dict[str, Any], attn_implementation: str) -> Any:
    config = transformers.AutoConfig.for_model(name, **TINY, **changes)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    with torch.no_grad():  # larger weights than the default init: the logits spread out
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def window_kwargs() -> dict[str, Any]:
    return {
        "max_new_tokens": WINDOW_NEW,
        "min_new_tokens": WINDOW_NEW,  # no early end of sequence: every forward runs
        "do_sample": False,
        "return_dict_in_generate": True,
        "output_logits": True,
        "pad_token_id": 0,
    }


def window_prompt() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, WINDOW_PROMPT), generator=torch.Generator().manual_seed(5))


def run_windowed() -> dict[str, Any]:
    hf.register()
    out: dict[str, Any] = {}
    for i, (name, changes) in enumerate(WINDOWED):
        model = windowed_model(name, changes, "tokenring")
        with torch.no_grad():
            res = hf.generate(hf.SequenceParallel(), model, window_prompt(), **window_kwargs())
        out[f"{i}"] = (res.sequences, torch.stack(res.logits, dim=1))
    # one token less: the last forward's window masks its first key
    model = windowed_model("mistral", {"sliding_window": FITS - 1}, "tokenring")
    with pytest.raises(NotImplementedError) as info, torch.no_grad():
        hf.generate(hf.SequenceParallel(), model, window_prompt(), **window_kwargs())
    out["refused"] = str(info.value)
    return out


def test_generate_runs_a_window_the_sequence_fits_in() -> None:
    """hf.generate refused every sliding window (Mistral's default 4096 too) and chunk,
    though a window or chunk the whole sequence fits in masks no key: the same answer as
    plain causal attention. It now runs them and matches the model's own generate in one
    process (SDPA, its own sliding-window masks); the step whose sequence outgrows the window
    raises on every rank, naming the length."""
    per_rank = tokenring.launch(run_windowed, world_size=2, timeout_s=300)
    for i, (name, changes) in enumerate(WINDOWED):
        model = windowed_model(name, changes, "sdpa")
        with torch.no_grad():
            want = model.generate(window_prompt(), **window_kwargs())
        for rank, res in enumerate(per_rank):
            sequences, logits = res[f"{i}"]
            assert want.sequences.shape[1] == WINDOW_PROMPT + WINDOW_NEW
            assert torch.equal(sequences, want.sequences), (name, changes, rank)
            torch.testing.assert_close(
                logits, torch.stack(want.logits, dim=1), msg=f"{name} {changes} rank {rank}"
            )
    for res in per_rank:
        assert f"window_size=({FITS - 2}, 0)" in res["refused"], res["refused"]
        assert f"a sequence of {FITS} tokens" in res["refused"], res["refused"]
