"""Audit of statements the rest of the suite never ran (third part): each reached here and
checked against an independent oracle (transformers' own generate, model and caches in this
process) or the documented error.

- ``tokenring.hf.generate`` in a world of one rank: options that are dicts (sequence_bias) or
  tensors (eos_token_id), num_return_sequences with sampling, a model without a generation
  config: the tokens (or the error) of transformers' generate. The ShardedKVCache's layers
  answer as a DynamicCache's after the same call.
- What generate and its cache refuse. One was a silently wrong answer: the cache that
  generate returns, handed back to the model to go on decoding (the DynamicCache way), was
  taken (its layers checked only that a step had ever begun) and each layer attended over
  the new token alone: logits off transformers' by 7.3 (max |logit| 6.1). Now a model call
  outside generate's steps raises. Two misled: a logits processor that runs the model
  (classifier-free guidance's) was told "generate passes the model's inputs by keyword;
  got positional ones"; position_ids of other positions did not say which.
- The transformers attention, mask and loss functions refuse what they cannot express,
  naming it; the helpers over one rank hand back their inputs.
- Three ranks: SequenceParallelTrainer over groups of two sizes ([0, 1] and [2]) raised on
  ranks 0 and 1 only (their size did not divide the world) while rank 2 made its Trainer
  and waited for them (6 s, the communicator's timeout); inputs bad on rank 1 alone (an
  extra input, a padding mask) raised there while the others waited out the timeout in the
  batch check. Every rank now raises at once, naming the cause (a list for input_ids did
  already). A model whose attention never ran and a model forward without position_ids
  raise on every rank.
- The Flux processor and joint_attn name a bad text_seq_len, num_text, or text given to a
  single-stream block; the flash-attention shims and cached_attn their bad arguments.
- SequenceParallelTrainer over one process deals the data as transformers' Trainer does.
- The cost model, planner and simulator name their bad arguments (a pure table); launch
  refuses a backend this torch lacks and a function in __main__, and runs from a thread.

Legend: B batch, S global seq, P world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
from transformers.generation.logits_process import (  # noqa: E402
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from oracle import error_of  # noqa: E402
from tiny_llama import generate_models, generate_prompt  # noqa: E402
from tokenring import hf  # noqa: E402


def _sequences(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


# -- tokenring.hf.generate in one process ---------------------------------------------------------

# (name, generate's options): each run by hf.generate and by transformers' generate, seeded alike
GENERATE_CASES: dict[str, dict[str, Any]] = {
    "sequence_bias (a dict option)": dict(max_new_tokens=3, sequence_bias={(5,): 50.0}),
    "eos_token_id a tensor": dict(max_new_tokens=4, eos_token_id=torch.tensor([20])),
    "num_return_sequences": dict(
        max_new_tokens=2, do_sample=True, temperature=3.0, top_k=0, num_return_sequences=2
    ),
}


@pytest.mark.usefixtures("single_rank_group")
def test_generate_in_one_process_against_transformers() -> None:
    """Tokens identical to transformers' generate of the same float64 weights with SDPA."""
    hf.register()
    model, oracle = generate_models(layers=1)
    for name, options in GENERATE_CASES.items():
        torch.manual_seed(5)
        with torch.no_grad():
            got = _sequences(
                hf.generate(
                    hf.SequenceParallel(), model, generate_prompt(), strategy="pass_kv", **options
                )
            )
        torch.manual_seed(5)
        with torch.no_grad():
            want = oracle.generate(generate_prompt(), **options)
        assert torch.equal(got, want), (name, got, want)
    # no generation config: transformers' own error, as its generate raises it
    bare, bare_oracle = copy.deepcopy(model), copy.deepcopy(oracle)
    bare.generation_config = bare_oracle.generation_config = None
    want_error = error_of(lambda: bare_oracle.generate(generate_prompt(), max_new_tokens=1))
    assert want_error.startswith("AttributeError"), want_error
    got_error = error_of(
        lambda: hf.generate(
            hf.SequenceParallel(), bare, generate_prompt(), strategy="pass_kv", max_new_tokens=1
        )
    )
    assert got_error == want_error


def _patched(model: Any, layer: int, **attributes: Any) -> Any:
    """A copy of ``model`` whose ``layer``'s attention module has ``attributes`` set."""
    model = copy.deepcopy(model)
    for name, value in attributes.items():
        setattr(model.model.layers[layer].self_attn, name, value)
    return model


def _wider_kv(model: Any, layer: int) -> Any:
    """A copy of ``model`` whose ``layer`` projects twice the K/V heads of the config."""
    model = copy.deepcopy(model)
    attn = model.model.layers[layer].self_attn
    for name in ("k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, torch.nn.Linear(old.in_features, 2 * old.out_features).double())
    return model


@pytest.mark.usefixtures("single_rank_group")
def test_generate_refusals_name_the_cause() -> None:
    """What generate and its cache refuse, each naming the option or value and what runs."""
    import test_hf_generate as tiny

    hf.register()
    model, oracle = generate_models(layers=1)  # 1 layer
    deep = tiny.build_model(tiny.initial_state(), "tokenring").double()  # 2 layers

    def run(m: Any, **options: Any) -> Callable[[], object]:
        sp = hf.SequenceParallel()
        return lambda: hf.generate(
            sp, m, generate_prompt(), strategy="pass_kv", max_new_tokens=2, **options
        )

    cfg = UnbatchedClassifierFreeGuidanceLogitsProcessor(2.0, model)
    shifted = torch.arange(3, 3 + generate_prompt().shape[1]).repeat(2, 1)
    with torch.no_grad():
        out = hf.generate(hf.SequenceParallel(), model, generate_prompt(), strategy="pass_kv",
                          max_new_tokens=2, return_dict_in_generate=True)  # fmt: skip
    cache = out.past_key_values
    sp = hf.SequenceParallel(layout="contiguous")
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "a logits processor runs the model": (
            run(model, logits_processor=[cfg]),
            "NotImplementedError: the model ran inside tokenring.hf.generate outside generate's "
            "own steps (a logits processor",
        ),
        "position_ids of other positions": (
            run(model, position_ids=shifted),
            "NotImplementedError: position_ids other than the token positions are not supported"
            " by tokenring.hf.generate (it derives each rank's positions); got position_ids "
            "[3, 4, 5, 6, 7, 8, 9] for tokens at [0, 1, 2, 3, 4, 5, 6]",
        ),
        "layer 1 of other K/V heads": (
            run(_wider_kv(deep, 1)),
            "NotImplementedError: layer 1 gives 4 query and 4 K/V heads of head dim 8; the cache"
            " holds 2 K/V heads",
        ),
        "NoPE temperature tuning": (
            run(_patched(model, 0, attn_temperature_tuning=True, use_rope=False)),
            "NotImplementedError: attn_temperature_tuning (Llama 4's NoPE query scale) is not "
            "supported in generation",
        ),
        "no layer_idx": (  # the layer's Cache.update indexes the layers by it first
            run(_patched(model, 0, layer_idx=None)),
            error_of(lambda: _patched(oracle, 0, layer_idx=None).generate(generate_prompt())),
        ),
        "the cache outside generate": (
            lambda: model(
                input_ids=out.sequences[:, -1:], past_key_values=cache, sequence_parallel=sp
            ),
            "ValueError: a ShardedKVCache runs inside tokenring.hf.generate (which places each "
            "step's tokens on the ranks); got a model call outside generate's steps",
        ),
        "a step of 1-D ids": (
            lambda: cache.begin_step(
                generate_prompt()[0], dtype=torch.float64, device=torch.device("cpu")
            ),
            "ValueError: input_ids must have shape (batch, new tokens >= 1); got (7,)",
        ),
        "a step of another batch": (
            lambda: cache.begin_step(
                generate_prompt()[:1], dtype=torch.float64, device=torch.device("cpu")
            ),
            "ValueError: the cache holds 2 sequences; got input_ids of batch 1",
        ),
        "batch_repeat_interleave": (
            lambda: cache.batch_repeat_interleave(2),
            "NotImplementedError: repeating the cache's batch is not supported by tokenring's "
            "ShardedKVCache",
        ),
        "batch_select_indices": (
            lambda: cache.batch_select_indices(torch.tensor([0])),
            "NotImplementedError: selecting from the cache's batch is not supported",
        ),
        "reset": (
            lambda: cache.reset(),
            "NotImplementedError: resetting the cache (make a new one)",
        ),
    }
    with torch.no_grad():
        for name, (call, want) in cases.items():
            got = error_of(call)
            assert got.startswith(want), (name, got)
    # the layers answer as a DynamicCache's after the same call (transformers' own)
    with torch.no_grad():
        dynamic = oracle.generate(generate_prompt(), max_new_tokens=2, return_dict_in_generate=True)
    ours, theirs = cache.layers[0], dynamic.past_key_values.layers[0]
    for ask in (
        lambda layer: layer.get_seq_length(),
        lambda layer: layer.get_mask_sizes(3),
        lambda layer: layer.get_max_length(),
    ):
        assert ask(ours) == ask(theirs)
    assert cache.get_max_length() == dynamic.past_key_values.get_max_length() == -1
    fresh = hf.ShardedKVCache(model.config, hf.SequenceParallel()).layers[0]
    fresh.lazy_initialization(torch.zeros(1), torch.zeros(1))
    assert fresh.is_initialized


# -- transformers attention and helpers in one process -------------------------------------------


def _llama(vocab: int = 32, **changes: Any) -> Any:
    """The tiny float64 Llama (2 query heads, 1 K/V head) with tokenring attention, and with
    SDPA, same weights."""
    from tiny_llama import llama_config, model_of, perturbed_state

    config = llama_config(vocab, layers=1)
    for name, value in changes.items():
        setattr(config, name, value)
    state = perturbed_state(config, seed=3, scale=0.3)
    return tuple(model_of(copy.deepcopy(config), state, impl) for impl in ("tokenring", "sdpa"))


@pytest.mark.usefixtures("single_rank_group")
def test_hf_refusals_and_one_rank_helpers() -> None:
    """The attention function, mask function and loss refuse what they cannot run, naming
    it; the helpers of one rank are the identity (against the inputs themselves)."""
    from transformers import LlamaForQuestionAnswering
    from transformers import masking_utils as mu
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tokenring.model.costmodel import PRESETS

    hf.register()
    model, sdpa = _llama()
    attention, mask = (
        ALL_ATTENTION_FUNCTIONS["tokenring"],
        ALL_MASK_ATTENTION_FUNCTIONS["tokenring"],
    )
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel(layout="contiguous")
    q = torch.randn(2, 2, 8, 8, dtype=torch.float64)  # (B, H, s, D)
    layer = model.model.layers[0].self_attn
    conv_layer = copy.deepcopy(layer)
    conv_layer.config = copy.deepcopy(model.config)
    conv_layer.config.layer_types = ["conv"]
    nowhere = type("Config", (type(model.config),), {"__module__": "nowhere.configuration_x"})()
    no_padding = torch.zeros(1, dtype=torch.int64)
    chunks = mu.and_masks(mu.chunked_overlay(4, no_padding), mu.chunked_overlay(8, no_padding))
    padded = mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(torch.ones(2, 8) > 0))
    dropout, _ = _llama(attention_dropout=0.25)
    qa = LlamaForQuestionAnswering(model.config).double()
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "a prepared mask tensor": (
            lambda: attention(layer, q, q, q, torch.zeros(1, 1, 8, 8), sequence_parallel=sp),
            "NotImplementedError: attn_implementation='tokenring' does not take a prepared "
            "attention mask; got one of shape (1, 1, 8, 8)",
        ),
        "a layer whose config has conv layers": (
            lambda: attention(conv_layer, q, q, q, None, sequence_parallel=sp),
            "NotImplementedError: attn_implementation='tokenring' cannot split model_type "
            "'llama' over the sequence: its layer_types include ['conv']",
        ),
        "state-space fields": (
            lambda: hf.check_model(_llama(mamba_d_state=4)[0]),
            "NotImplementedError: attn_implementation='tokenring' cannot split model_type "
            "'llama' over the sequence: it has state-space blocks (mamba_d_state)",
        ),
        "chunks of two sizes": (
            lambda: mask(mask_function=chunks, config=model.config),
            "NotImplementedError: the model's mask (model_type 'llama') asks for chunks of "
            "several sizes at once: [4, 8]",
        ),
        "chunks after left padding": (
            lambda: mask(
                mask_function=mu.chunked_overlay(4, torch.tensor([1])), config=model.config
            ),
            "NotImplementedError: chunked attention with left padding (model_type 'llama') is "
            "not supported",
        ),
        "a padding piece": (
            lambda: mask(mask_function=padded, config=model.config),
            "NotImplementedError: a padding attention_mask (model_type 'llama') is not "
            "supported by tokenring attention",
        ),
        "attention dropout in training": (
            lambda: dropout.train()(input_ids=ids, sequence_parallel=sp),
            "NotImplementedError: attention dropout is not supported; got dropout=0.25",
        ),
        "hardware without tokenring_auto": (
            lambda: model(
                input_ids=ids,
                sequence_parallel=hf.SequenceParallel(
                    layout="contiguous", hardware=PRESETS["h100-nvswitch"]
                ),
            ),
            "ValueError: SequenceParallel.hardware only chooses the strategy of "
            "attn_implementation='tokenring_auto'; got it with 'tokenring'",
        ),
        "a question-answering loss": (
            lambda: qa(
                input_ids=ids,
                start_positions=ids[:, 0],
                end_positions=ids[:, 1],
                sequence_parallel=sp,
            ),
            "NotImplementedError: transformers' ForQuestionAnswering loss under "
            "sequence_parallel would average over this rank's shard only",
        ),
        "labels of another length": (
            lambda: model(input_ids=ids, labels=ids[:, :7], sequence_parallel=sp),
            "ValueError: labels must be every rank's shard (lengths [9]) or the global labels "
            "(length 9 on every rank); got lengths [7] over the ranks",
        ),
    }
    with torch.no_grad():
        for name, (call, want) in cases.items():
            got = error_of(call)
            assert got.startswith(want), (name, got)
    # the mask function for no mask piece, of a model whose modeling module is not loaded:
    # plain causal (None), as transformers' own causal mask
    assert mask(mask_function=None, config=nowhere) is None
    # one rank: the helpers hand back what they were given
    x = torch.randn(2, 8, 3, dtype=torch.float64)
    assert torch.equal(hf.gather_sequence(sp, x), x)
    batch = {"ids": ids, "labels": ids + 1}
    got_batch = hf.broadcast_batch(sp, batch)
    assert got_batch.keys() == batch.keys() and all(
        torch.equal(got_batch[k], batch[k]) for k in batch
    )
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.arange(3.0)
    hf.all_reduce_gradients(sp, [weight])
    assert torch.equal(weight.grad, torch.arange(3.0))
    # the Trainer over one process deals the data as transformers' own Trainer does
    import tempfile

    from tiny_llama import labelled_rows, sgd_args
    from tokenring.hf.trainer import SequenceParallelTrainer

    rows = labelled_rows(5, 0, vocab=32, seq_len=8)
    with tempfile.TemporaryDirectory() as tmp:
        args = sgd_args(tmp, per_device_train_batch_size=2)
        loaders = [
            kind(model=model, args=args, train_dataset=rows, **extra).get_train_dataloader()
            for kind, extra in (
                (SequenceParallelTrainer, {"sequence_parallel": sp}),
                (transformers.Trainer, {}),
            )
        ]
    torch.manual_seed(0)
    ours = [batch["input_ids"] for batch in loaders[0]]
    torch.manual_seed(0)
    theirs = [batch["input_ids"] for batch in loaders[1]]
    assert len(ours) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # and the model over one rank is the model (the labels loss too)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, sequence_parallel=sp)
        want = sdpa(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-10)
    # transformers' loss casts the logits to float32; ours keeps float64
    torch.testing.assert_close(got.loss, want.loss.double(), rtol=0, atol=1e-6)


# -- three ranks ----------------------------------------------------------------------------------

TIMEOUT_S = 6.0  # the communicators' timeout: a case that waits for it is a defect
FAST_S = 3.0


def _timed_error(call: Callable[[], object]) -> tuple[str, float]:
    import time

    import tokenring

    start = time.monotonic()
    message = error_of(call)
    if message != "no error":  # a failed check leaves the communicators failed: new ones
        tokenring.close_communicators()
        tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    return message, time.monotonic() - start


def rank_cases() -> dict[str, tuple[str, float]]:
    """Inside a rank (P = 3): each case's error and seconds."""
    import os
    import tempfile

    import torch.distributed as dist
    from transformers import PreTrainedModel

    import tokenring
    from tiny_llama import sgd_args
    from tokenring.hf.trainer import SequenceParallelTrainer

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    hf.register()
    model, _ = _llama()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel(layout="contiguous")
    local = hf.shard_batch(sp, ids)
    out: dict[str, tuple[str, float]] = {}
    # groups of two sizes: [0, 1] and [2]
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    uneven = hf.SequenceParallel(group=pair if rank < 2 else alone)
    with tempfile.TemporaryDirectory() as tmp:
        out["groups of two sizes"] = _timed_error(
            lambda: SequenceParallelTrainer(
                model=model, args=sgd_args(tmp), sequence_parallel=uneven
            )
        )
        trainer = SequenceParallelTrainer(model=model, args=sgd_args(tmp), sequence_parallel=sp)
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids}
    odd = {**inputs, "token_type_ids": ids} if rank == 1 else inputs
    padded = {**inputs, "attention_mask": (ids > 3).long()} if rank == 1 else inputs
    listed = {"input_ids": ids.tolist()} if rank == 1 else inputs
    model.eval()
    for name, batch in (("extra input", odd), ("padding", padded), ("a list", listed)):
        out[name] = _timed_error(lambda b=batch: trainer.prediction_step(model, b, True))

    # a model whose attention modules skip attention (its class still routes it)
    skipping = copy.deepcopy(model)
    for layer in skipping.model.layers:
        layer.self_attn.forward = lambda hidden_states, **_: (torch.zeros_like(hidden_states), None)

    class Wrapper(PreTrainedModel):  # type: ignore[misc]
        """A model whose forward takes no position_ids (nor **kwargs), through a helper."""

        config_class = transformers.PretrainedConfig

        def __init__(self, inner: Any) -> None:
            super().__init__(inner.config)
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, sequence_parallel: Any = None) -> Any:
            return self.forward_inner(input_ids, sequence_parallel)

        def forward_inner(self, input_ids: torch.Tensor, sequence_parallel: Any) -> Any:
            return self.inner(input_ids=input_ids, sequence_parallel=sequence_parallel)

    import test_hf_architectures as arch

    _, bert = arch._models("bert", torch.float64, encoder=True)  # hands attention no positions
    wrapped = Wrapper(bert)
    bert_ids = arch._input_ids()[:, :9]
    with torch.no_grad():
        out["no attention ran"] = _timed_error(
            lambda: skipping(input_ids=local.input_ids, position_ids=local.position_ids,
                             sequence_parallel=sp)
        )  # fmt: skip
        out["a forward without position_ids"] = _timed_error(
            lambda: wrapped(hf.shard_batch(sp, bert_ids).input_ids, sequence_parallel=sp)
        )
    return out


# case -> what every rank's error starts with
THREE_RANKS = {
    "groups of two sizes": "ValueError: sequence_parallel's groups must split the world into "
    "groups of one size; got [(0, 1), (0, 1), (2,)] by rank",
    "no attention ran": "NotImplementedError: LlamaForCausalLM ran its forward with "
    "sequence_parallel= but called no tokenring attention (attn_implementation='tokenring')",
    "a forward without position_ids": "NotImplementedError: attn_implementation='tokenring': "
    "Wrapper.forward takes no position_ids (rank(s) [0, 1, 2])",
}
# case bad on rank 1 alone -> (rank 1's error type, what every rank's error names)
RANK_1 = {
    "extra input": (
        "NotImplementedError",
        "SequenceParallelTrainer takes input_ids, labels and attention_mask; got "
        "['input_ids', 'labels', 'token_type_ids']",
    ),
    "padding": (
        "NotImplementedError",
        "a padding attention_mask is not supported under sequence parallelism",
    ),
    "a list": ("ValueError", "batch['input_ids'] must be a tensor; got list"),
}


def test_three_ranks_raise_together_naming_the_cause() -> None:
    """P = 3. Trainer groups of two sizes ([0, 1] and [2]): ranks 0 and 1 raised, rank 2 made
    its Trainer (its first collective would wait for them). Inputs bad on rank 1 alone
    (another input, a padding mask): rank 1 raised at once and ranks 0 and 2 waited out the
    communicator's timeout in the batch check (a list for input_ids raised on every rank
    already). A model whose attention never ran, a model forward that takes no position_ids:
    every rank raises. All within FAST_S."""
    import tokenring

    per_rank = tokenring.launch(rank_cases, world_size=3, timeout_s=120)
    for rank, got in enumerate(per_rank):
        for case, want in THREE_RANKS.items():
            message, seconds = got[case]
            assert message.startswith(want), (rank, message)
            assert seconds < FAST_S, (rank, case, seconds)
        for case, (kind, names) in RANK_1.items():
            message, seconds = got[case]
            start = kind if rank == 1 else "ValueError: rank 1 cannot run"
            assert message.startswith(start) and names in message, (rank, message)
            assert seconds < FAST_S, (rank, case, seconds)


# -- diffusers in one process ---------------------------------------------------------------------


@pytest.mark.usefixtures("single_rank_group")
def test_diffusers_refusals_name_the_argument() -> None:
    """The Flux processor and joint_attn refuse, naming the argument, its value and what was
    expected (the tiny Flux of test_diffusers: text of 3 rows)."""
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    from test_diffusers import build_model
    from tokenring import diffusers as tr_diffusers

    model = build_model()
    proc = tr_diffusers.FluxSequenceParallelProcessor()
    joint, single = model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn
    x, text = torch.randn(1, 4, 16), torch.randn(1, 3, 16)
    q = torch.randn(1, 4, 2, 8)
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "text given to a single-stream block": (
            lambda: proc(single, x, encoder_hidden_states=text),
            "NotImplementedError: encoder_hidden_states given to an attention without added "
            "K/V projections (added_kv_proj_dim=None): not a Flux joint block",
        ),
        "text_seq_len of another length": (
            lambda: proc(joint, x, encoder_hidden_states=text, text_seq_len=4),
            "ValueError: text_seq_len must be 3 (the text rows this rank holds); got 4",
        ),
        "text_seq_len past the joint rows": (
            lambda: proc(single, x, text_seq_len=5),
            "ValueError: text_seq_len must be at most the joint length 4 (the text rows this "
            "rank holds); got 5",
        ),
        "num_text a string": (
            lambda: tr_diffusers.joint_attn(q, q, q, num_text="2", text="replicated"),
            "ValueError: num_text must be an int; got '2'",
        ),
    }
    with torch.no_grad():
        for name, (call, want) in cases.items():
            got = error_of(call)
            assert got.startswith(want), (name, got)


# -- errors of one process ------------------------------------------------------------------------


@pytest.mark.usefixtures("single_rank_group")
def test_shim_and_cache_errors_name_the_argument() -> None:
    """The flash-attention shims, cached_attn, hybrid_attn and sequence_parallel_attn: each
    error names its argument, the value and what was expected."""
    import tokenring
    from tokenring import compat, inference

    q = torch.randn(4, 2, 8, dtype=torch.float64)  # (tokens, H, D)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    llama3 = compat.llama3_flash_attn_varlen_func
    cache = tokenring.DistributedKVCache(
        num_layers=1, batch=1, heads_kv=2, head_dim=8, dtype=torch.float64,
        device=torch.device("cpu"), block_size=4,
    )  # fmt: skip
    cache.begin_step([4])
    from torch.distributed.device_mesh import init_device_mesh

    from tokenring.hybrid import hybrid_positions

    mesh = tokenring.HybridMesh.from_device_mesh(
        init_device_mesh("cpu", (1, 1), mesh_dim_names=("outer", "inner"))
    )
    x = q[None]  # (B, S, H, D)
    place = dict(outer=2, inner=1, layout="contiguous")
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "bidir_token_ring of one query head": (
            lambda: tokenring.sequence_parallel_attn(
                x[:, :, :1], x[:, :, :1], x[:, :, :1], strategy="bidir_token_ring"
            ),
            "NotImplementedError: strategy 'bidir_token_ring' sends half of the query heads each "
            "way round the ring and needs heads_q >= 2; got q.shape[2]=1",
        ),
        "hybrid: outer_rank past outer": (
            lambda: hybrid_positions(outer_rank=2, inner_rank=0, seq_local=4, **place),
            "ValueError: need 0 <= outer_rank < outer and 0 <= inner_rank < inner; got "
            "outer_rank=2, outer=2, inner_rank=0, inner=1",
        ),
        "hybrid: cu_seqlens with seq_local": (
            lambda: hybrid_positions(
                outer_rank=0, inner_rank=0, seq_local=4, cu_seqlens=[0, 8], **place
            ),
            "ValueError: cu_seqlens needs seq_len (the global length it ends at)",
        ),
        "hybrid: last_block_splits a string": (
            lambda: tokenring.hybrid_attn(x, x, x, mesh=mesh, last_block_splits="2"),
            "ValueError: last_block_splits must be an int >= 1; got '2'",
        ),
        "hybrid: q longer than its share": (
            lambda: tokenring.hybrid_attn(x, x, x, mesh=mesh, seq_len=3),
            "ValueError: q.shape[1] must be 3 on outer rank 0, inner rank 0: its share of "
            "seq_len=3 (see tokenring.hybrid_shard); got 4",
        ),
        "dropout_p a string": (
            lambda: compat.ring_flash_attn_func(q[None], q[None], q[None], dropout_p="0"),
            "ValueError: dropout_p must be a number in [0, 1]; got '0'",
        ),
        "k of other tokens": (
            lambda: llama3(q, q[:3], q[:3], cu, cu, 2, 2, 1, slice(0, 4)),
            "ValueError: q, k and v must hold the same tokens (self-attention); got "
            "q.shape[0]=4, k.shape[0]=3, v.shape[0]=3",
        ),
        "cu_seqlens_k of fewer entries": (
            lambda: llama3(q, q, q, cu, cu[::2], 2, 2, 1, slice(0, 4)),
            "ValueError: cu_seqlens_k must have as many entries as cu_seqlens_q (3); got [0, 4]",
        ),
        "a 4-D q": (
            lambda: inference.cached_attn(q[None], q, q, cache=cache, layer=0, strategy="direct"),
            "ValueError: q must be a (rows, heads_q, head_dim) tensor; got (1, 4, 2, 8)",
        ),
        "auto without hardware": (
            lambda: inference.cached_attn(q, q, q, cache=cache, layer=0, strategy="auto"),
            "ValueError: " + inference.AUTO_NEEDS_HARDWARE,
        ),
        "auto without hardware, resolved": (
            lambda: inference.resolve_cached_strategy(
                "auto",
                step=cache.step,
                comm=cache.comm,
                heads_q=2,
                heads_kv=2,
                head_dim=8,
                dtype=torch.float64,
                device=torch.device("cpu"),
            ),
            "ValueError: " + inference.AUTO_NEEDS_HARDWARE,
        ),
    }
    for name, (call, want) in cases.items():
        got = error_of(call)
        assert got.startswith(want), (name, got)


# -- the cost model, planner and simulator (pure) -------------------------------------------------


def test_model_errors_name_the_argument(tmp_path: Any) -> None:
    """Validation branches of the cost model, planner and simulator that never ran."""
    import dataclasses
    import json

    from tokenring.core.schedule import AttentionShape
    from tokenring.model import costmodel, planner, simulate

    hw = costmodel.PRESETS["h100-nvswitch"]
    shape = AttentionShape(batch=1, heads_q=4, heads_kv=2, head_dim=64, dtype="bfloat16")
    call: dict[str, Any] = dict(world_size=4, seq_local=256, heads_q=4, heads_kv=2, head_dim=64)
    call |= dict(dtype="bfloat16", causal=True, hardware=hw)
    run: dict[str, Any] = dict(layout="zigzag", causal=True, seq_local=256, shape=shape)
    run["hardware"] = hw
    net = dict(link_bandwidth_bytes_per_s=1e9, latency_s=1e-6)
    mesh, ring = (costmodel.Interconnect(topology=t, **net) for t in ("mesh", "ring"))
    switch = costmodel.Interconnect(topology="switch", port_bandwidth_bytes_per_s=1e9, **net)
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates": {}}))
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "no strategies": (
            lambda: planner.explain(**call, strategies=[]),
            "ValueError: strategies must name at least one strategy; got none",
        ),
        "last_pair": (
            lambda: planner.explain(**call, last_pair="x"),
            "ValueError: last_pair must be one of ('return', 'lend', 'auto'); got 'x'",
        ),
        "world_size 0": (
            lambda: simulate.simulate_pass("ring", "forward", world_size=0, **run),
            "ValueError: world_size must be >= 1; got 0",
        ),
        "mode": (
            lambda: simulate.simulate_pass("ring", "forward", world_size=4, mode="fast", **run),
            "ValueError: mode must be one of 'auto', 'event', 'vectorised'; got 'fast'",
        ),
        "passes": (
            lambda: simulate.simulate("ring", passes="all", world_size=4, **run),
            "ValueError: passes must be one of ['backward', 'both', 'forward']; got 'all'",
        ),
        "no dtypes": (
            lambda: dataclasses.replace(hw, dtypes=()),
            "ValueError: dtypes must name at least one dtype; got ()",
        ),
        "islands joined by a mesh": (
            lambda: dataclasses.replace(hw, devices_per_node=2, inter=mesh),
            "ValueError: inter.topology must be 'switch' (one NIC per device into a "
            "non-blocking fabric); got 'mesh'",
        ),
        "rings inside islands": (
            lambda: dataclasses.replace(hw, interconnect=ring, devices_per_node=2, inter=switch),
            "ValueError: interconnect.topology 'ring' inside islands is not modelled",
        ),
        "rates without rates": (
            lambda: costmodel.load_kernel_rates(rates),
            f"ValueError: {rates}: expected a JSON object with non-empty 'rates'",
        ),
        "route past the world": (
            lambda: costmodel.route(hw, 0, 5, 4),
            "ValueError: dst must be in [0, 4); got 5",
        ),
    }
    for name, (make, want) in cases.items():
        got = error_of(make)
        assert got.startswith(want), (name, got)


# -- launch ---------------------------------------------------------------------------------------


def _double(x: int) -> int:
    return 2 * x


def test_launch_errors_and_a_launch_from_another_thread() -> None:
    """A backend this torch lacks and a function defined in __main__ are refused before any
    rank starts; a launch from a thread other than the main one (no signal handlers there)
    runs and returns the ranks' results."""
    import threading

    import torch.distributed as dist

    import tokenring

    def in_main() -> int:
        return 1

    in_main.__module__ = "__main__"
    cases: dict[str, tuple[Callable[[], object], str]] = {
        "fn in __main__": (
            lambda: tokenring.launch(in_main, world_size=1),
            "ValueError: fn must be importable by the worker processes; got <function",
        ),
    }
    if not dist.is_mpi_available():
        cases["mpi"] = (
            lambda: tokenring.launch(_double, 1, world_size=1, backend="mpi"),
            f"ValueError: backend 'mpi': this torch ({torch.__version__}) has no mpi built in",
        )
    for name, (call, want) in cases.items():
        got = error_of(call)
        assert got.startswith(want), (name, got)
    results: list[Any] = []

    def run() -> None:
        results.append(tokenring.launch(_double, 21, world_size=1))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert results == [[42]]
