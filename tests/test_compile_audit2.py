"""torch.compile through the integrations, with rank 0's model compiled and rank 1's not.

Two launches of two gloo ranks at once, the Llama cases in one, Flux and the Trainer in the
other (communicators with a 60 s timeout: rank 1 waits in each rank check while rank 0
compiles). Oracle: the same float64 model in each rank's process without tokenring (a Llama
with SDPA attention, Flux with diffusers' own processor, transformers' generate, the Trainer
run eagerly); float64 within 1e-10. Defects found:

- ``hf.generate(sp, torch.compile(model), ...)``: generate hooked the compiled wrapper, whose
  ``generate`` is its original module's and calls that module's own forward, so no step ran
  the hooks and the first layer raised "a ShardedKVCache runs inside tokenring.hf.generate
  ... got a model call outside generate's steps". It now generates through the original
  module (uncompiled, as transformers' generate on the wrapper does): the oracle's tokens.
- ``SequenceParallelTrainer`` with ``TrainingArguments(torch_compile=True)`` on 2 processes:
  its check for a model without DDP asked accelerate's ``unwrap_model``, which keeps a
  compiled wrapper by pointing its ``_orig_mod`` at the bare model: it took DDP out of
  ``torch.compile(DDP(model))`` and the Trainer raised "training a model without DDP". It
  now trains: the parameters equal the eager Trainer's.
- dynamo traced tokenring's host code: the rank checks, the communicator's exchanges (shared
  memory included: guards on a peer's message counter and on file descriptors), generate's
  hooks. A 2-layer Llama's first compiled forward compiled 209 frames (12 s, backend
  "eager"), recompiled at the second and third calls, and generate under model.compile()
  hit dynamo's recompile limit in its hooks. That code now runs eagerly (Notes [The attention
  function under torch.compile] in tokenring.hf.attention, [Communication runs eagerly] in
  tokenring.runtime.comm): no tokenring frame is compiled, none recompiles at the third call,
  and fullgraph=True raises saying to compile with fullgraph=False.

Also checked: forward and backward three calls in a row, then a bad option on one compiled
rank (logits_to_keep, a 4-D mask) fails every rank at once and the next call is right; the
Flux model check (timestep on one rank) under a compiled model.

Legend: B batch, S global seq, s local seq, V vocab.
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tokenring-attention[hf]')"
)
pytest.importorskip(
    "diffusers", reason="diffusers is not installed (pip install 'tokenring-attention[diffusers]')"
)

from tiny_flux import TEXT, build_model, local_inputs, model_inputs  # noqa: E402
from tiny_llama import (  # noqa: E402
    generate_models,
    generate_prompt,
    labelled_rows,
    llama_config,
    model_of,
    perturbed_state,
    raised_fast,
    sgd_args,
    timed,
)
from tokenring import diffusers as tr_diffusers  # noqa: E402
from tokenring import hf  # noqa: E402

WORLD, S, V = 2, 8, 32
TIMEOUT_S = 60.0
FAST_S = 20.0  # a fault raises on every rank well within the timeout (rank 0 recompiles)
FP64 = 1e-10


def _compiled_tokenring_code() -> list[str]:
    """tokenring's functions (module level and methods) with code compiled by dynamo."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    found = []
    for name, module in list(sys.modules.items()):
        if name != "tokenring" and not name.startswith("tokenring."):
            continue
        spaces = [vars(module)] + [vars(c) for c in vars(module).values() if inspect.isclass(c)]
        for space in spaces:
            for attr, fn in space.items():
                fn = inspect.unwrap(fn) if callable(fn) else fn
                code = getattr(fn, "__code__", None)
                if code is not None and _debug_get_cache_entry_list(code):
                    found.append(f"{name}.{attr}")
    return sorted(set(found))


def _llama_cases(out: dict[str, Any]) -> None:
    from torch._dynamo.utils import counters

    rank = dist.get_rank()
    config = llama_config(V, hidden=16, layers=2)
    state = perturbed_state(config, seed=0, scale=0.1)
    oracle = model_of(config, state, "sdpa")
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, S, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (oracle(ids).logits * weights).sum().backward()  # (B, S, V)
    want = {"logits": oracle(ids).logits.detach()}
    want |= {name: p.grad for name, p in oracle.named_parameters()}
    sp = hf.SequenceParallel()
    batch = hf.shard_batch(sp, ids)
    local_weights = weights[:, batch.position_ids[0]]  # (B, s, V)
    model = model_of(copy.deepcopy(config), state, "tokenring")
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if rank == 0 else model

    def train_step(**kwargs: Any) -> Callable[[], float]:
        def step() -> float:
            model.zero_grad()
            logits = run(input_ids=batch.input_ids, position_ids=batch.position_ids,
                         sequence_parallel=sp, **kwargs).logits  # fmt: skip
            (logits * local_weights).sum().backward()
            hf.all_reduce_gradients(sp, model)
            got = {"logits": hf.gather_sequence(sp, logits.detach())}
            got |= {name: p.grad for name, p in model.named_parameters()}
            return max(float((got[k] - want[k]).abs().max()) for k in want)

        return step

    for call in range(3):
        counters.clear()
        out[f"call {call}"] = timed(TIMEOUT_S, train_step())
        out[f"frames at call {call}"] = dict(counters["frames"])
    out["compiled tokenring code"] = _compiled_tokenring_code()
    out["logits_to_keep on rank 0"] = timed(
        TIMEOUT_S, train_step(logits_to_keep=1 if rank == 0 else 0)
    )
    prepared = torch.ones(2, 1, S // WORLD, S // WORLD, dtype=torch.bool)  # (B, 1, s, s)
    out["4-D mask on rank 0"] = timed(
        TIMEOUT_S, train_step(attention_mask=prepared if rank == 0 else None)
    )
    out["call after"] = timed(TIMEOUT_S, train_step())
    torch._dynamo.reset()
    full = torch.compile(model, backend="eager", fullgraph=True)
    out["fullgraph"] = timed(
        TIMEOUT_S,
        lambda: full(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sequence_parallel=sp
        ),
    )


def _generate_case(out: dict[str, Any]) -> None:
    model, oracle = generate_models(layers=2)
    prompt = generate_prompt()
    with torch.no_grad():
        want = oracle.generate(prompt, max_new_tokens=4, do_sample=False)
        compiled = torch.compile(model, backend="eager")
        got = timed(
            TIMEOUT_S,
            lambda: hf.generate(
                hf.SequenceParallel(),
                compiled,
                prompt,
                strategy="pass_kv",
                do_sample=False,
                max_new_tokens=4,
            ),
        )
    out["generate"] = got
    out["generate oracle"] = want


def _trainer_case(out: dict[str, Any]) -> None:
    from tokenring.hf.trainer import SequenceParallelTrainer

    rank = dist.get_rank()
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)}
    os.environ.update(env, LOCAL_WORLD_SIZE=str(WORLD))
    config = llama_config(V)
    state = perturbed_state(config, seed=9, scale=0.2)
    data = labelled_rows(4, 3, vocab=V, seq_len=S)
    for compiled in (False, True):
        torch._dynamo.reset()
        options = dict(torch_compile=True, torch_compile_backend="eager") if compiled else {}
        with tempfile.TemporaryDirectory() as tmp:
            args = sgd_args(tmp, per_device_train_batch_size=2, num_train_epochs=1,
                            learning_rate=0.5, **options)  # fmt: skip
            trainer = SequenceParallelTrainer(
                model=model_of(config, state, "tokenring"),
                args=args,
                train_dataset=data,
                sequence_parallel=hf.SequenceParallel(),
            )
            res = timed(TIMEOUT_S, trainer.train)
            res["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            out[f"trainer compiled={compiled}"] = res


def _flux_cases(out: dict[str, Any]) -> None:
    comm = tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    # one block of each kind: two attention layers, the first of which takes the model call's
    # check (Note [The Flux model's own check]), through both of the processor's paths
    oracle = build_model(num_blocks=1)
    with torch.no_grad():
        want = oracle(**model_inputs()).sample  # (B, S, 4)
    model = build_model(num_blocks=1)
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if comm.rank == 0 else model
    mine = local_inputs(model_inputs(), comm.rank, "sharded", text_seq_len=TEXT)

    def call(inputs: dict[str, Any]) -> Callable[[], float]:
        def go() -> float:
            with torch.no_grad():
                got = run(**inputs).sample  # (B, s, 4)
            gathered = torch.cat(comm.all_gather(got.contiguous(), label="test output"), dim=1)
            return float((gathered - want).abs().max())

        return go

    out["flux 0"] = timed(TIMEOUT_S, call(mine))
    out["flux 1"] = timed(TIMEOUT_S, call(mine))
    other = mine | {"timestep": mine["timestep"] + 0.25} if comm.rank == 1 else mine
    out["flux timestep on rank 1"] = timed(TIMEOUT_S, call(other))
    comm = tokenring.get_communicator(None, timeout_s=TIMEOUT_S)  # after a failed check
    model.set_attn_processor(tr_diffusers.FluxSequenceParallelProcessor(group=comm, text="sharded"))
    out["flux after"] = timed(TIMEOUT_S, call(mine))


_CASES = {"llama": (_llama_cases, _generate_case), "flux": (_flux_cases, _trainer_case)}


def run_cases(which: str) -> dict[str, Any]:
    hf.register()
    tokenring.get_communicator(None, timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    for case in _CASES[which]:
        case(out)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """Every case's results per rank. Two launches at once: in each, rank 0 compiles while
    rank 1 waits in the rank checks, so on 2 cores the two take the time of the longer."""
    with ThreadPoolExecutor(max_workers=len(_CASES)) as pool:
        futures = [
            pool.submit(tokenring.launch, run_cases, which, world_size=WORLD, timeout_s=300)
            for which in _CASES
        ]
        launches = [future.result() for future in futures]
    return [a | b for a, b in zip(*launches, strict=True)]


def test_a_compiled_llama_matches_one_process_call_after_call(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 compiled, rank 1 eager: logits and every parameter's gradient equal the float64
    model in one process, three calls in a row and after two refused calls."""
    for rank, res in enumerate(ranks):
        for name in ("call 0", "call 1", "call 2", "call after"):
            assert res[name].get("value", 1.0) < FP64, (rank, name, res[name])


def test_no_tokenring_code_is_compiled_nor_recompiled(ranks: list[dict[str, Any]]) -> None:
    """Compiled rank 0: tokenring's host code runs eagerly (it compiled 209 frames, the
    communicator's and shared memory's among them), and the third call compiles nothing."""
    assert ranks[0]["compiled tokenring code"] == [], ranks[0]["compiled tokenring code"]
    assert ranks[0]["frames at call 0"].get("total", 0) > 0  # rank 0 did compile
    assert ranks[0]["frames at call 2"] == {}, ranks[0]["frames at call 2"]


def test_a_bad_option_on_the_compiled_rank_fails_every_rank(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        raised_fast(res["logits_to_keep on rank 0"], FAST_S, "logits_to_keep=1")
        raised_fast(res["4-D mask on rank 0"], FAST_S, "prepared attention mask", "(2, 1, 4, 4)")


def test_fullgraph_names_what_breaks_the_graph(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert "fullgraph=False" in res["fullgraph"].get("error", ""), res["fullgraph"]


def test_generate_with_a_compiled_model(ranks: list[dict[str, Any]]) -> None:
    """It raised "got a model call outside generate's steps" on every rank."""
    for res in ranks:
        assert "value" in res["generate"], res["generate"]
        assert torch.equal(res["generate"]["value"], res["generate oracle"])


def test_the_trainer_with_torch_compile_keeps_ddp(ranks: list[dict[str, Any]]) -> None:
    """TrainingArguments(torch_compile=True): it raised "training a model without DDP" (its
    own check had taken DDP out of the compiled model); the parameters now equal the eager
    Trainer's."""
    for res in ranks:
        eager, compiled = res["trainer compiled=False"], res["trainer compiled=True"]
        assert "error" not in eager and "error" not in compiled, (eager, compiled)
        for name, p in eager["params"].items():
            err = float((compiled["params"][name] - p).abs().max())
            assert err < FP64, (name, err)


def test_the_flux_model_check_under_compile(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        for name in ("flux 0", "flux 1", "flux after"):
            assert res[name].get("value", 1.0) < FP64, (name, res[name])
        raised_fast(res["flux timestep on rank 1"], FAST_S, "timestep", "rank 1 differs")
