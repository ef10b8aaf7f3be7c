"""Every keyword of the transformers and diffusers integrations' public entry points, one rank
at a time: a keyword either reaches the ranks' agreed signature and the answer, or is rejected
(Note [Rank agreement] in tokenring.api); an integration that cannot express an option raises.

The pattern of tests/test_keywords_audit.py, for ``tokenring.hf`` (SequenceParallel, the
training helpers, generate, ShardedKVCache, the Trainer) and ``tokenring.diffusers``' Flux
processor. Per entry point a table lists every keyword of its signature (read by
``inspect.signature``; for ``generate``'s ``**gen_kwargs`` the generation options below; a
keyword added later without a row fails :func:`test_every_keyword_has_a_row`) with three
values:

- ``one``: a legal value on rank 1 only. Every rank raises within a few seconds naming the
  keyword (the ranks disagree), or returns the one-process oracle's answer for its own inputs.
- ``legal``: a legal value on every rank: the oracle's answer for that value (the same model
  in one process, without tokenring), or the documented refusal on every rank.
- ``bad``: a wrong type or value on rank 1 (on every rank for a local function or a
  constructor): an error naming the keyword on that rank, and an error on every rank within a
  few seconds.

All cases run in one launch of two gloo ranks (communicators with a 3 s timeout, so a wait for
it shows). Models: a one-layer float64 Llama (hidden 32, 4 query and 2 K/V heads) and a
one-block-each float64 Flux. Oracles: the same Llama with SDPA attention (documents run one
by one), transformers' own ``generate``, and diffusers' own ``FluxAttnProcessor`` over the
whole sequence.

Legend: B batch, S global seq, s local seq, T text tokens, V vocab, P world size.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)
from diffusers import FluxTransformer2DModel  # noqa: E402
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    TrainingArguments,
)

from oracle import sharded_positions  # noqa: E402
from test_keywords_audit import (  # noqa: E402
    Dyn,
    Refused,
    Row,
    Skip,
    _fresh,
    _hardware,
    assert_rules_kept,
    timed_result,
)
from tokenring import diffusers as tr_diffusers  # noqa: E402
from tokenring import hf  # noqa: E402
from tokenring.hf import generation  # noqa: E402
from tokenring.hf.trainer import SequenceParallelTrainer  # noqa: E402

WORLD = 2
SEQ, VOCAB, PROMPT = 16, 64, 8
TIMEOUT_S = 3.0  # the communicators' timeout: a case that waits for it is a defect
TOL = 1e-10  # float64
# transformers' Trainer computes and logs its evaluation loss in float32
TOLERANCES = {"hf.trainer.SequenceParallelTrainer": 1e-6}
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,  # generation runs its max_new_tokens
    pad_token_id=0,
)
GEN_BASE: dict[str, Any] = {"max_new_tokens": 3, "do_sample": False}
TEXT, IMAGE = 4, 8  # Flux: text tokens, image tokens (global)

HW = Dyn(lambda ctx: _hardware())
HW_OTHER = Dyn(lambda ctx: _hardware("another machine"))


# -- the ranks' context ---------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    comm: Any  # an explicit Communicator over the world (timeout 3 s)
    model: Any  # the tokenring Llama, float64
    oracle: Any  # the same weights, SDPA attention
    ids: torch.Tensor  # (1, S) token ids >= 3
    labels: torch.Tensor  # (1, S): ids with -100 at two places
    prompt: torch.Tensor  # (1, PROMPT)
    mode: str = ""
    flux: Any = None


def _llama(attn_implementation: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**CONFIG), attn_implementation=attn_implementation
        )
        with torch.no_grad():  # wider than the default init: the logits spread out
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return model.double().eval()


def _sp(ctx: Ctx, **options: Any) -> hf.SequenceParallel:
    return hf.SequenceParallel(group=ctx.comm, **options)


def _rows(ctx: Ctx, seq: int = SEQ, docs: Any = None, layout: str = "zigzag") -> list[int]:
    cu = [int(x) for x in docs] if docs is not None else None
    return sharded_positions(layout, ctx.rank, ctx.world, seq, cu)


def _shifted(labels: torch.Tensor, docs: list[int], fill: int = -100) -> torch.Tensor:
    """Next-token labels within each document (written apart from hf.shift_labels)."""
    out = torch.full_like(labels, fill)
    for a, b in itertools.pairwise(docs):
        out[:, a : b - 1] = labels[:, a + 1 : b]
    return out


def _model_oracle(ctx: Ctx, seq: int, docs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (1, S, V) of every document run alone, and the token-mean loss."""
    ids, labels = ctx.ids[:, :seq], ctx.labels[:, :seq]
    with torch.no_grad():
        logits = torch.cat(
            [ctx.oracle(input_ids=ids[:, a:b]).logits for a, b in itertools.pairwise(docs)], 1
        )
    target = _shifted(labels, docs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
    return logits, loss


# -- the runners: (ctx, this rank's keywords, the options its inputs follow) -> (got, want) -------
def _split(o: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runner settings (keys starting with "_") apart from the keywords."""
    return (
        {k: v for k, v in o.items() if not k.startswith("_")},
        {k: v for k, v in o.items() if k.startswith("_")},
    )


def run_sp(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """A sharded forward and loss with SequenceParallel(**o): gathered logits and the loss."""
    o, settings = _split(o)
    shape, _ = _split(shape)
    sp = hf.SequenceParallel(**({"group": ctx.comm} | o))
    seq = shape.get("seq_len") or SEQ
    batch = hf.shard_batch(sp, ctx.ids[:, :seq], ctx.labels[:, :seq])
    ctx.model.config._attn_implementation = settings.get("_impl", "tokenring")
    try:
        with torch.no_grad():
            logits = ctx.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                sequence_parallel=sp,
                use_cache=False,
            ).logits
    finally:
        ctx.model.config._attn_implementation = "tokenring"
    assert batch.shift_labels is not None
    loss = hf.causal_lm_loss(sp, logits, batch.shift_labels)
    got = (hf.gather_sequence(sp, logits), loss)
    docs = shape.get("cu_seqlens")
    return got, _model_oracle(ctx, seq, [int(x) for x in docs] if docs is not None else [0, seq])


def run_shard_batch(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    args = {"sp": _sp(ctx), "input_ids": ctx.ids, "labels": ctx.labels} | o
    got = hf.shard_batch(**args)
    rows = _rows(ctx)
    labels = shape.get("labels", ctx.labels)
    fill = shape.get("ignore_index", -100)
    shift = None if labels is None else _shifted(labels, [0, SEQ], fill)[:, rows]
    want = (ctx.ids[:, rows], torch.tensor([rows]), shift)
    return (got.input_ids, got.position_ids, got.shift_labels), want


def run_shift_labels(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    got = hf.shift_labels(**({"labels": ctx.labels} | o))
    docs = shape.get("cu_seqlens") or [0, SEQ]
    return got, _shifted(ctx.labels, list(docs), shape.get("ignore_index", -100))


def _batch(ctx: Ctx, scale: int = 1) -> dict[str, torch.Tensor]:
    """A rank's own batch: rank 0's is the one every rank must get."""
    mask = torch.ones(1, SEQ, dtype=torch.bool)
    return {"input_ids": ctx.ids * scale + ctx.rank, "labels": ctx.labels, "mask": mask}


def run_broadcast(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    got = hf.broadcast_batch(**({"sp": _sp(ctx), "batch": _batch(ctx)} | o))
    scale = 2 if ctx.mode == "legal" and "batch" in shape else 1
    want = {"input_ids": ctx.ids * scale, "labels": ctx.labels, "mask": torch.ones(1, SEQ) > 0}
    return got, want


def _features() -> torch.Tensor:
    return torch.randn(1, SEQ, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def run_gather(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """Rank's zigzag shard of (1, S, 6) features, the sequence at seq_dim (1 or 2)."""
    seq_dim = o.get("seq_dim", 1)
    dim = seq_dim % 3 if isinstance(seq_dim, int) and -3 <= seq_dim < 3 else 1
    full = _features().movedim(1, dim)
    local = full.index_select(dim, torch.tensor(_rows(ctx)))
    args = {"sp": _sp(ctx), "x": local} | o
    got = hf.gather_sequence(**args)
    return got, full.to(args["x"].dtype) if isinstance(args["x"], torch.Tensor) else full


def _loss_inputs(ctx: Ctx, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    labels = ctx.labels.masked_fill(ctx.labels == -100, ignore_index)
    logits = torch.randn(
        1, SEQ, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    return logits, _shifted(labels, [0, SEQ], ignore_index)


def run_loss(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    rows = _rows(ctx)
    ignore_index = o.get("ignore_index", -100)
    logits, target = _loss_inputs(ctx, ignore_index if isinstance(ignore_index, int) else -100)
    local = logits[:, rows].clone().requires_grad_()
    args = {"sp": _sp(ctx), "logits": local, "shift_labels": target[:, rows]} | o
    loss = hf.causal_lm_loss(**args)
    loss.backward()
    # the oracle: the token mean over the global sequence (sum / num_items_in_batch)
    want_ignore = shape.get("ignore_index", -100)
    logits, target = _loss_inputs(ctx, want_ignore)
    whole = logits.clone().requires_grad_()
    total = F.cross_entropy(
        whole.reshape(-1, VOCAB), target.reshape(-1), ignore_index=want_ignore, reduction="sum"
    )
    count = shape.get("num_items_in_batch", (target != want_ignore).sum())
    want = total / max(int(count), 1)
    want.backward()
    assert whole.grad is not None
    return (loss.detach(), local.grad), (want.detach(), whole.grad[:, rows])


def run_dp_loss(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    x = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    out = hf.data_parallel_loss(**({"sp": _sp(ctx), "loss": x * 2} | o))
    out.backward()
    return (out.detach(), x.grad), (torch.tensor(3.0).double(), torch.tensor(2.0 * ctx.world))


def _pattern(p: torch.Tensor, i: int) -> torch.Tensor:
    return torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.5 + i


def run_all_reduce(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    params = list(ctx.model.parameters())
    for i, p in enumerate(params):
        p.grad = (ctx.rank + 1) * _pattern(p, i)
    try:
        hf.all_reduce_gradients(**({"sp": _sp(ctx), "parameters": ctx.model} | o))
        got = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    finally:
        for p in params:
            p.grad = None
    total = sum(range(1, ctx.world + 1))
    return got, [total * _pattern(p, i) for i, p in enumerate(params)]


def run_check_model(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    return hf.check_model(**({"model": ctx.model} | o)), None


def run_register(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    return hf.register(**o), tuple(hf.ATTN_IMPLEMENTATIONS)


def _generated(out: Any) -> Any:
    """The tokens, and the logits and scores where generate returns them."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    scores = getattr(out, "scores", None)
    return (out.sequences, None if logits is None else list(logits), scores and list(scores))


_CACHE_KEYWORDS = ("strategy", "block_size", "budget_bytes")


def _oracle_generate(ctx: Ctx, shape: dict[str, Any]) -> Any:
    kwargs = GEN_BASE | {k: v for k, v in shape.items() if k not in _CACHE_KEYWORDS}
    kwargs.pop("sp", None)
    torch.manual_seed(1)
    with torch.no_grad():
        return _generated(ctx.oracle.generate(kwargs.pop("input_ids", ctx.prompt), **kwargs))


def run_generate(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    o = dict(o)
    sp = o.pop("sp", _auto_sp(ctx, o))
    model = o.pop("model", ctx.model)
    input_ids = o.pop("input_ids", ctx.prompt)
    torch.manual_seed(1)  # the same draws on every rank (and in the oracle)
    with torch.no_grad():
        got = hf.generate(sp, model, input_ids, **(GEN_BASE | o))
    return _generated(got), _oracle_generate(ctx, {k: v for k, v in shape.items() if k != "model"})


def _auto_sp(ctx: Ctx, o: dict[str, Any]) -> hf.SequenceParallel:
    """The plan: with the hardware "auto" plans for, unless a strategy is forced."""
    return _sp(ctx, hardware=_hardware()) if o.get("strategy", "auto") == "auto" else _sp(ctx)


def run_sharded_cache(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """A ShardedKVCache made by hand, run as generate runs it."""
    args = {"config": ctx.model.config, "sequence_parallel": _auto_sp(ctx, o)} | o
    cache = hf.ShardedKVCache(**args)
    torch.manual_seed(1)
    with generation._sharded_forward(ctx.model, cache), torch.no_grad():
        got = ctx.model.generate(ctx.prompt, cache=cache, **GEN_BASE)
    return _generated(got), _oracle_generate(ctx, {})


def _train_args(**changes: Any) -> TrainingArguments:
    options = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=1,
        max_steps=1,
        learning_rate=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(**(options | changes))


def run_trainer(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """The Trainer made with ``o``; its evaluation loss against the oracle's."""
    data = [{"input_ids": ctx.ids[0]}]
    args = {"model": ctx.model, "args": _train_args(), "eval_dataset": data} | o
    args.setdefault("sequence_parallel", _sp(ctx))
    trainer = SequenceParallelTrainer(**args)
    got = trainer.evaluate()["eval_loss"]
    labels = ctx.ids  # the Trainer's labels: the input ids
    with torch.no_grad():
        logits = ctx.oracle(input_ids=ctx.ids).logits
    want = F.cross_entropy(logits[0, :-1], labels[0, 1:])
    return torch.tensor(got, dtype=torch.float64), want


# -- Flux -----------------------------------------------------------------------------------------
FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(2, 2, 4),
)


@dataclasses.dataclass
class Flux:
    joint: Any  # the double-stream block's FluxAttention
    single: Any  # the single-stream block's
    image: torch.Tensor  # (1, S, 32)
    text: torch.Tensor  # (1, T, 32)
    rotary: tuple[torch.Tensor, torch.Tensor]  # cos, sin: (T + S, 8)


def _flux(ctx: Ctx) -> Flux:
    if ctx.flux is None:
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**FLUX_CONFIG)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model = model.double()
        gen = torch.Generator().manual_seed(5)
        ids = torch.cat([torch.zeros(TEXT, 3), torch.rand(IMAGE, 3, generator=gen) * 4])
        cos, sin = model.pos_embed(ids)
        ctx.flux = Flux(
            joint=model.transformer_blocks[0].attn,
            single=model.single_transformer_blocks[0].attn,
            image=torch.randn(1, IMAGE, 32, generator=gen, dtype=torch.float64),
            text=torch.randn(1, TEXT, 32, generator=gen, dtype=torch.float64),
            rotary=(cos.double(), sin.double()),
        )
    return ctx.flux


_FLUX_FIELDS = ("group", "text", "strategy", "hardware")


def run_flux(ctx: Ctx, o: dict[str, Any], shape: dict[str, Any]) -> Any:
    """One attention layer through the processor (made with the fields of ``o``, called with
    the rest) against diffusers' FluxAttnProcessor over the whole sequence: the joint block,
    or the single-stream block when encoder_hidden_states is None."""
    flux = _flux(ctx)
    fields = {k: v for k, v in o.items() if k in _FLUX_FIELDS}
    call = {k: v for k, v in o.items() if k not in _FLUX_FIELDS}
    processor = tr_diffusers.FluxSequenceParallelProcessor(**({"group": ctx.comm} | fields))
    sharded = str(shape.get("text", "replicated")) == "sharded"
    per_t, per_i = TEXT // ctx.world, IMAGE // ctx.world
    texts = list(range(ctx.rank * per_t, (ctx.rank + 1) * per_t)) if sharded else list(range(TEXT))
    images = list(range(ctx.rank * per_i, (ctx.rank + 1) * per_i))
    rows = texts + [TEXT + i for i in images]  # of the joint sequence [text, image]
    single = "encoder_hidden_states" in shape and shape["encoder_hidden_states"] is None
    rotary = shape.get("image_rotary_emb", flux.rotary)
    whole = torch.cat([flux.text, flux.image], 1)
    if single:
        args = {"attn": flux.single, "hidden_states": whole[:, rows], "text_seq_len": TEXT}
    else:
        args = {
            "attn": flux.joint,
            "hidden_states": flux.image[:, images],
            "encoder_hidden_states": flux.text[:, texts],
        }
    if rotary is not None:
        args["image_rotary_emb"] = (rotary[0][rows], rotary[1][rows])
    with torch.no_grad():
        got = processor(**(args | call))
        if single:
            want: Any = FluxAttnProcessor()(flux.single, whole, image_rotary_emb=rotary)[:, rows]
        else:
            image, text = FluxAttnProcessor()(
                flux.joint, flux.image, flux.text, image_rotary_emb=rotary
            )
            want = (image[:, images], text[:, texts])
    return got, want


# -- the tables -----------------------------------------------------------------------------------
SP_BAD = Row("sp", Skip("a rank's plan: see SequenceParallel"), Skip("the runner's"), "sp")
LOCAL_ONE = Skip("a local function: no group to compare on")


def _sp_row(keyword: str = "sp") -> Row:
    return dataclasses.replace(SP_BAD, keyword=keyword)


def _gen_rows() -> list[Row]:
    """generate's own keywords and the generation options of **gen_kwargs."""
    sample = {"do_sample": True}
    refused = Skip("any value but the default is refused: the legal row")
    return [
        _sp_row(),
        Row("model", Skip("the same weights on every rank"), Skip("the runner's"), "model"),
        Row(
            "input_ids",
            Dyn(lambda ctx: ctx.prompt + 1),
            Skip("the runner's"),
            Dyn(lambda ctx: ctx.prompt[0]),
        ),
        Row("strategy", "tree", "pass_kv", "sideways"),
        Row("block_size", 2, 2, 0),
        Row("budget_bytes", 10**9, 10**9, -5),
        Row("do_sample", True, True, Skip("transformers takes any truthy value")),
        Row("temperature", 0.5, 0.5, -1.0, base=sample),
        Row("top_k", 5, 5, -1, base=sample),
        Row("max_new_tokens", 4, 4, 0),
        Row("min_new_tokens", 2, 2, -1, base={"eos_token_id": 3}),
        Row("eos_token_id", Dyn(lambda ctx: _greedy(ctx)), Dyn(lambda ctx: _greedy(ctx)), "eos"),
        Row("pad_token_id", 1, 1, "pad"),
        Row("repetition_penalty", 1.5, 1.5, 0.0, names=("penalty",)),  # transformers' word
        Row("num_beams", Refused(2), Refused(2), refused),
        Row("return_dict_in_generate", True, True, Skip("any truthy value")),
        Row(
            "output_logits",
            True,
            True,
            Skip("any truthy value"),
            base={"return_dict_in_generate": True},
        ),
        Row(
            "attention_mask",
            Dyn(lambda ctx: torch.ones_like(ctx.prompt)),
            Dyn(lambda ctx: torch.ones_like(ctx.prompt)),
            Dyn(lambda ctx: torch.ones_like(ctx.prompt).index_fill(1, torch.tensor([0]), 0)),
        ),
        Row("use_cache", Refused(False, "ValueError"), Refused(False, "ValueError"), refused),
        Row(
            "generation_config",
            Dyn(lambda ctx: GenerationConfig(repetition_penalty=1.5)),
            Dyn(lambda ctx: GenerationConfig(repetition_penalty=1.5)),
            "config",
            names=("repetition_penalty",),  # the option that differs
        ),
        Row(
            "assistant_model",
            Refused(Dyn(lambda ctx: ctx.oracle)),
            Refused(Dyn(lambda ctx: ctx.oracle)),
            refused,
        ),
        Row("prompt_lookup_num_tokens", Refused(2), Refused(2), refused),
        Row("assistant_early_exit", Refused(1), Refused(1), refused),
        Row("custom_generate", Refused("x/y"), Refused("x/y"), refused),
        Row("guidance_scale", Refused(2.0), Refused(2.0), refused),
        Row("cache_implementation", Refused("static"), Refused("static"), refused),
        Row("output_attentions", Refused(True), Refused(True), refused),
        Row("output_hidden_states", Refused(True), Refused(True), refused),
        Row("synced_gpus", Refused(True), Refused(True), refused),
        Row(
            "inputs_embeds",
            Refused(Dyn(lambda ctx: torch.zeros(1, PROMPT, 32, dtype=torch.float64))),
            Refused(Dyn(lambda ctx: torch.zeros(1, PROMPT, 32, dtype=torch.float64))),
            refused,
        ),
    ]


def _greedy(ctx: Ctx) -> int:
    """The second token greedy search generates: an eos_token_id that stops it early."""
    with torch.no_grad():
        return int(ctx.oracle.generate(ctx.prompt, **GEN_BASE)[0, PROMPT + 1])


# generate's **gen_kwargs: the options its rows cover (every refused one among them)
GENERATION_OPTIONS = frozenset(
    {"do_sample", "temperature", "top_k", "max_new_tokens", "min_new_tokens", "eos_token_id"}
    | {"pad_token_id", "repetition_penalty", "return_dict_in_generate", "output_logits"}
    | {"attention_mask", "use_cache", "generation_config"}
    | set(generation._REFUSED_OPTIONS)
)

TRAINER_OWN = Skip("transformers' own, passed to Trainer unchanged")


def _flux_rows() -> list[Row]:
    return [
        Row(
            "group",
            Skip("each rank's group is another communicator: no channel to compare on"),
            None,
            "world",
        ),
        Row("text", "sharded", "sharded", "both"),
        Row("strategy", "ring", "ulysses", "nope"),
        Row("hardware", HW_OTHER, HW, "nosuchhardware", base={"strategy": "auto", "hardware": HW}),
        Row(
            "attn",
            Skip("the model's module"),
            Skip("the runner's"),
            Dyn(lambda ctx: torch.nn.Linear(2, 2)),
            names=("FluxAttention",),
        ),
        Row(
            "hidden_states",
            Skip("the runner's"),
            Skip("the runner's"),
            Dyn(lambda ctx: torch.zeros(4, 32, dtype=torch.float64)),
        ),
        Row(
            "encoder_hidden_states",
            None,
            None,
            Dyn(lambda ctx: torch.zeros(TEXT, 32, dtype=torch.float64)),
            names=("block",),
        ),
        Row(
            "attention_mask",
            Refused(Dyn(lambda ctx: torch.ones(1, TEXT + IMAGE))),
            Refused(Dyn(lambda ctx: torch.ones(1, TEXT + IMAGE))),
            "mask",
        ),
        Row(
            "image_rotary_emb",
            None,
            None,
            Dyn(lambda ctx: tuple(x[:3] for x in _flux(ctx).rotary)),
        ),
        Row("text_seq_len", Skip("replicated: must equal the text rows"), TEXT, -1),
        Row(
            "ip_hidden_states",
            Refused(Dyn(lambda ctx: [torch.zeros(1, 2, 32)])),
            Refused(Dyn(lambda ctx: [torch.zeros(1, 2, 32)])),
            Skip("any value is refused: the legal row"),
        ),
        Row(
            "ip_adapter_masks",
            Refused(Dyn(lambda ctx: torch.ones(1, 2))),
            Refused(Dyn(lambda ctx: torch.ones(1, 2))),
            Skip("any value is refused: the legal row"),
        ),
    ]


TABLES: dict[str, tuple[Any, Callable[..., Any], list[Row]]] = {
    "hf.SequenceParallel": (
        hf.SequenceParallel,
        run_sp,
        [
            Row(
                "group",
                Skip("each rank's group is another communicator: no channel to compare on"),
                None,
                "world",
            ),
            Row("layout", "contiguous", "contiguous", "diagonal"),
            Row("seq_len", 14, 14, 0),
            Row("cu_seqlens", [0, 7, SEQ], [0, 5, SEQ], [0, 20, SEQ], base={"seq_len": SEQ}),
            Row(
                "hardware",
                HW_OTHER,
                HW,
                "nosuchhardware",
                base={"_impl": "tokenring_auto", "hardware": HW},
            ),
        ],
    ),
    "hf.shard_batch": (
        hf.shard_batch,
        run_shard_batch,
        [
            _sp_row(),
            Row("input_ids", LOCAL_ONE, Skip("the runner's"), Dyn(lambda ctx: ctx.ids[0])),
            Row("labels", LOCAL_ONE, None, Dyn(lambda ctx: ctx.labels[:, :5])),
            Row("ignore_index", LOCAL_ONE, -1, "none"),
        ],
    ),
    "hf.shift_labels": (
        hf.shift_labels,
        run_shift_labels,
        [
            Row("labels", LOCAL_ONE, Skip("the runner's"), Dyn(lambda ctx: ctx.labels[0])),
            Row("ignore_index", LOCAL_ONE, -1, 1.5),
            Row("cu_seqlens", LOCAL_ONE, [0, 5, SEQ], [0, 20, SEQ]),
        ],
    ),
    "hf.broadcast_batch": (
        hf.broadcast_batch,
        run_broadcast,
        [
            _sp_row(),
            Row(
                "batch",
                Dyn(lambda ctx: _batch(ctx, 3)),  # rank 1's own: dropped
                Dyn(lambda ctx: _batch(ctx, 2)),
                Dyn(lambda ctx: {"input_ids": [1, 2]}),
            ),
        ],
    ),
    "hf.gather_sequence": (
        hf.gather_sequence,
        run_gather,
        [
            _sp_row(),
            Row(
                "x",
                Dyn(lambda ctx: _features().index_select(1, torch.tensor(_rows(ctx))).float()),
                Dyn(lambda ctx: _features().index_select(1, torch.tensor(_rows(ctx))).float()),
                "x",
                names=("dtype",),
            ),
            Row("seq_dim", 2, 2, 3),
        ],
    ),
    "hf.causal_lm_loss": (
        hf.causal_lm_loss,
        run_loss,
        [
            _sp_row(),
            Row(
                "logits",
                Skip("each rank's own rows"),
                Skip("the runner's"),
                Dyn(lambda ctx: torch.zeros(1, 3, VOCAB, dtype=torch.float64)),
            ),
            Row(
                "shift_labels",
                Skip("each rank's own rows"),
                Skip("the runner's"),
                Dyn(lambda ctx: torch.zeros(1, 3, dtype=torch.int64)),
            ),
            Row("ignore_index", 7, 7, "none"),
            Row("num_items_in_batch", 7, Dyn(lambda ctx: torch.tensor(7)), -1),
        ],
    ),
    "hf.data_parallel_loss": (
        hf.data_parallel_loss,
        run_dp_loss,
        [_sp_row(), Row("loss", LOCAL_ONE, Skip("the runner's"), "loss")],
    ),
    "hf.all_reduce_gradients": (
        hf.all_reduce_gradients,
        run_all_reduce,
        [
            _sp_row(),
            Row(
                "parameters",
                Dyn(lambda ctx: list(ctx.model.parameters())[1:]),  # one gradient fewer
                Dyn(lambda ctx: list(ctx.model.parameters())),
                "parameters",
                names=("gradients",),
            ),
        ],
    ),
    "hf.check_model": (
        hf.check_model,
        run_check_model,
        [Row("model", LOCAL_ONE, Dyn(lambda ctx: ctx.model), "model")],
    ),
    "hf.register": (hf.register, run_register, []),
    "hf.generate": (hf.generate, run_generate, _gen_rows()),
    "hf.ShardedKVCache": (
        hf.ShardedKVCache,
        run_sharded_cache,
        [
            Row(
                "config",
                # the model's K/V heads are its layers', whatever an unused field says
                Dyn(lambda ctx: _config_with(ctx, num_key_value_heads=4)),
                Dyn(lambda ctx: _config_with(ctx, num_key_value_heads=1)),
                "config",
            ),
            _sp_row("sequence_parallel"),
            Row("strategy", "tree", "pass_kv", "sideways"),
            Row("block_size", 2, 2, 0),
            Row("budget_bytes", 10**9, 10**9, -5),
        ],
    ),
    "hf.trainer.SequenceParallelTrainer": (
        SequenceParallelTrainer,
        run_trainer,
        [
            Row(
                "sequence_parallel",
                Dyn(lambda ctx: _sp(ctx, layout="contiguous")),
                Dyn(lambda ctx: _sp(ctx, layout="contiguous")),
                "sp",
                names=("layout",),
            ),
            Row(
                "args",
                Skip("a refusal on one rank only: that rank never trains"),
                Refused(Dyn(lambda ctx: _train_args(label_smoothing_factor=0.1))),
                TRAINER_OWN,
                names=("label_smoothing_factor",),
            ),
            Row(
                "compute_loss_func",
                Skip("a refusal on one rank only: that rank never trains"),
                Refused(lambda *a, **k: None),
                TRAINER_OWN,
            ),
            Row(
                "compute_metrics",
                Skip("a refusal on one rank only: that rank never trains"),
                Refused(lambda p: {}),
                TRAINER_OWN,
            ),
            *(
                Row(name, TRAINER_OWN, TRAINER_OWN, TRAINER_OWN)
                for name in (
                    "model", "data_collator", "train_dataset", "eval_dataset", "processing_class",
                    "model_init", "callbacks", "optimizers", "optimizer_cls_and_kwargs",
                    "preprocess_logits_for_metrics",
                )
            ),
        ],
    ),
    "diffusers.FluxSequenceParallelProcessor": (
        tr_diffusers.FluxSequenceParallelProcessor,
        run_flux,
        _flux_rows(),
    ),
}  # fmt: skip


def _config_with(ctx: Ctx, **changes: Any) -> Any:
    config = copy.deepcopy(ctx.model.config)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


# entry points without a group: a bad value raises on the rank alone, so it is given to every
# rank (as for constructors, whose rank that raised never calls)
LOCAL = {
    "hf.shard_batch", "hf.shift_labels", "hf.data_parallel_loss", "hf.check_model",
    "hf.SequenceParallel", "hf.ShardedKVCache", "hf.trainer.SequenceParallelTrainer",
}  # fmt: skip
POSITIONAL = {"self"}


def _keywords(entry: str, fn: Any) -> set[str]:
    """An entry point's keywords: its signature's (a class: its constructor's; the Flux
    processor: its fields and its call's; generate's **gen_kwargs: GENERATION_OPTIONS; the
    Trainer's *args, **kwargs: transformers' Trainer's)."""
    params = dict(inspect.signature(fn).parameters)
    if entry == "diffusers.FluxSequenceParallelProcessor":
        params |= inspect.signature(fn.__call__).parameters
    if entry == "hf.trainer.SequenceParallelTrainer":
        params |= inspect.signature(transformers.Trainer.__init__).parameters
    names = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if entry == "hf.generate":
        names |= GENERATION_OPTIONS
    return names - POSITIONAL


# The public names that are no entry point: values, and the functions of the other audit
NOT_ENTRY_POINTS = {
    "tokenring.hf": {"ATTN_IMPLEMENTATIONS", "LocalBatch"},
    "tokenring.diffusers": {"KVPlacement", "TextPlacement", "joint_attn", "cross_attn"},
}


def test_every_public_entry_point_has_a_table() -> None:
    """Read from the modules' ``__all__``: a new public function needs a table."""
    import importlib

    covered = {name.split(".")[-1] for name in TABLES}
    for module_name, exempt in NOT_ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        public = set(module.__all__) - exempt
        assert public <= covered, (module_name, sorted(public - covered))
    assert "SequenceParallelTrainer" in covered


def test_every_keyword_has_a_row() -> None:
    """The tables cover each entry point's keywords exactly (a new keyword needs a row)."""
    for name, (fn, _, rows) in TABLES.items():
        assert {row.keyword for row in rows} == _keywords(name, fn), name


# -- the cases -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    entry: str
    keyword: str
    mode: str  # "one", "legal" or "bad"


CASES = [
    Case(entry, row.keyword, mode)
    for entry, (_, _, rows) in TABLES.items()
    for row in rows
    for mode in ("one", "legal", "bad")
    if not isinstance(getattr(row, mode), Skip)
]


def _row(case: Case) -> Row:
    return next(r for r in TABLES[case.entry][2] if r.keyword == case.keyword)


def _value(x: Any, ctx: Ctx) -> Any:
    x = x.value if isinstance(x, Refused) else x
    return x.fn(ctx) if isinstance(x, Dyn) else x


def _local(case: Case) -> bool:
    if case.entry == "diffusers.FluxSequenceParallelProcessor":
        return case.keyword in _FLUX_FIELDS  # the constructor's
    return case.entry in LOCAL or (case.keyword in ("sp", "sequence_parallel", "group"))


def _options(case: Case, ctx: Ctx) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's keyword arguments, and the options its inputs and its oracle follow."""
    row = _row(case)
    given = case.mode == "legal" or ctx.rank == 1 or (case.mode == "bad" and _local(case))
    options = {name: _value(x, ctx) for name, x in row.base.items()}
    if given:
        options[case.keyword] = _value(getattr(row, case.mode), ctx)
    shape = options if case.mode != "bad" else {n: _value(x, ctx) for n, x in row.base.items()}
    return options, shape


def _distance(got: Any, want: Any) -> float:
    """The largest difference of two nested results (inf where their structure differs)."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        if got.shape != want.shape:
            return float("inf")
        if got.dtype.is_floating_point or want.dtype.is_floating_point:
            return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        return 0.0 if torch.equal(got, want) else float("inf")
    if isinstance(got, dict) and isinstance(want, dict):
        if set(got) != set(want):
            return float("inf")
        return max((_distance(got[k], want[k]) for k in got), default=0.0)
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return float("inf")
        return max((_distance(a, b) for a, b in zip(got, want, strict=True)), default=0.0)
    return 0.0 if got == want else float("inf")


def _run_case(case: Case, ctx: Ctx) -> dict[str, Any]:
    runner = TABLES[case.entry][1]
    options, shape = _options(case, ctx)
    ctx.mode = case.mode
    return timed_result(lambda: runner(ctx, options, shape), _distance)


def _all_cases(cases: list[Case]) -> list[dict[str, Any]]:
    import os

    import torch.distributed as dist

    hf.register()
    rank, world = dist.get_rank(), dist.get_world_size()
    # what torchrun sets, and accelerate reads for the Trainer (the process group is up)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({name: str(value) for name, value in env.items()})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=gen)
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    ctx = Ctx(
        rank=rank,
        world=world,
        comm=tokenring.Communicator(None, timeout_s=TIMEOUT_S),
        model=_llama("tokenring"),
        oracle=_llama("sdpa"),  # float64 throughout (eager's softmax is float32)
        ids=ids,
        labels=ids.index_fill(1, torch.tensor([3, 4]), -100),
        prompt=torch.randint(3, VOCAB, (1, PROMPT), generator=gen),
    )
    results: list[Any] = []
    for case in cases:
        results.append(_run_case(case, ctx))
        flags: list[Any] = [None] * world
        broken = [ctx.comm, tokenring.get_communicator(None)]
        dist.all_gather_object(flags, any(c._broken is not None for c in broken))
        if any(flags):
            _fresh(ctx)
    return {"cases": results, "unused fields": _unused_fields(ctx)}


@pytest.fixture(scope="module")
def launched() -> list[dict[str, Any]]:
    return tokenring.launch(_all_cases, CASES, world_size=WORLD, timeout_s=300, pg_timeout_s=60)


@pytest.fixture(scope="module")
def outcomes(launched: list[dict[str, Any]]) -> dict[Case, list[dict[str, Any]]]:
    return {case: [launched[r]["cases"][i] for r in range(WORLD)] for i, case in enumerate(CASES)}


# -- a config field the model does not use ------------------------------------------------------
UNUSED_FIELDS = {
    # GPT-2 and OPT read neither field: 4 heads of dim 8 whatever these say
    "gpt2": dict(n_embd=32, n_layer=1, n_head=4, n_positions=64, num_key_value_heads=2,
                 head_dim=16),
    "opt": dict(hidden_size=32, ffn_dim=48, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=64, word_embed_proj_dim=32, num_key_value_heads=2),
}  # fmt: skip


def _unused_fields(ctx: Ctx) -> dict[str, Any]:
    """Per model: generate's tokens and logits and the one-process model's, or the error."""
    out: dict[str, Any] = {}
    for model_type, fields in UNUSED_FIELDS.items():
        config = transformers.AutoConfig.for_model(
            model_type, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=0,
            **fields,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="tokenring")
        model = model.double().eval()
        options = GEN_BASE | {"return_dict_in_generate": True, "output_logits": True}
        try:
            with torch.no_grad():
                got = _generated(hf.generate(_sp(ctx), model, ctx.prompt, **options))
        except Exception as exc:
            out[model_type] = f"{type(exc).__name__}: {exc}"
            continue
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            out[model_type] = (got, _generated(model.generate(ctx.prompt, **options)))
    return out


@pytest.mark.parametrize("model_type", sorted(UNUSED_FIELDS))
def test_generate_sizes_its_cache_by_the_layers_not_unused_config_fields(
    launched: list[dict[str, Any]], model_type: str
) -> None:
    """A GPT-2 or OPT config carrying num_key_value_heads=2 (and head_dim=16), fields those
    models never read: ShardedKVCache sized its K/V from them, and generate failed with "k
    must have shape (rows=4, heads_kv=2, head_dim=8) ...; got (4, 4, 8)", naming neither
    field. The cache now takes its sizes from the keys the layers give: the tokens and the
    logits of every step are the one-process model's."""
    for rank, result in enumerate(launched):
        got = result["unused fields"][model_type]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        assert _distance(*got) <= TOL, f"rank {rank}: {got}"


@pytest.mark.parametrize("mode", ["one", "legal", "bad"])
def test_keywords(outcomes: dict[Case, list[dict[str, Any]]], mode: str) -> None:
    assert_rules_kept(outcomes, mode, lambda case: (_row(case), TOLERANCES.get(case.entry, TOL)))
