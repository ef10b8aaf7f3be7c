"""Audit of statements the rest of the suite never ran (fourth part): each reached here and
checked against an independent oracle or the documented error; those no caller can reach were
removed from src/.

- The attention operator's fake implementation (``torch._subclasses.FakeTensorMode``, the
  meta device, torch.compile): K on the meta device among real tensors is named with its
  device; a 3-D q traces (the fake answers) and the compiled call raises, naming q's shape.
  Options that a graph would keep as tensors are refused naming the option and the Python
  value to pass instead; a stale handle (a graph that outlived its Communicator) and the
  default group passed by object under torch.compile (never remembered while tracing).
  The lines that run only while dynamo traces (``torch.compiler.is_compiling()`` branches of
  ``_op_options`` and ``_tangent_problem``) are traced, not run, so coverage never marks
  them; tests/test_compile_audit.py checks what they do (a window of tensors refused).
- An int ``window_size`` (w means (w, w)) eagerly, against float64 attention.
- The planner with no candidate it can predict, calibrate's heads check, no cached candidates;
  the simulator's vectorised engine given a mask, a cu_seqlens that is not a sequence,
  ``strategy_schedule``'s hybrid without its spec, both lengths, a plain mask on a collective.
- ``tokenring.core.sketch``: a complex tensor sketches as its real view, an empty one adds
  nothing, a non-finite sketch is infinitely far from any.
- launch: a rank that returned its result and then exited with a non-zero code is named so.
- ``tokenring bench --mode memory`` end to end on 2 ranks: its JSON rows' minimum bytes from
  the shapes, and its table.

Legend: B batch, S global seq, Hq / Hkv heads, D head dim, P world size.
"""

from __future__ import annotations

import atexit
import gc
import json
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import tokenring
import tokenring.api  # registers torch.ops.tokenring.*
from oracle import error_of, full_attention, visible_mask
from tokenring.cli import main
from tokenring.core.schedule import AttentionShape
from tokenring.core.sketch import Sketch, replicated_rtol, sketch
from tokenring.model import planner
from tokenring.model.costmodel import PRESETS
from tokenring.model.simulate import simulate, strategy_schedule
from tokenring.runtime import op
from tokenring.strategies.hybrid import HybridSpec

SEQ = 8


def _qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, SEQ, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3)]


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: Any) -> torch.Tensor:
    causal = mask.pop("causal", False)
    visible = visible_mask(SEQ, causal=causal, **mask)
    return full_attention(q, k, v, causal=causal, scale=0.5, mask=visible)[0]


def _compile(fn: Any) -> Any:
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


# -- the operator's fake implementation, torch.compile --------------------------------------------


def test_fake_tensors_meta_device_and_shapes(single_rank_group: None) -> None:
    q, k, v = _qkv()
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out, lse = tokenring.sequence_parallel_attn(fq, fk, fv, strategy="ring", return_lse=True)
        assert (out.shape, lse.shape, lse.dtype) == (q.shape, (1, 2, SEQ), torch.float64)
        meta_k = torch.empty(k.shape, dtype=k.dtype, device="meta")
        got = error_of(lambda: tokenring.ring_attn(fq, meta_k, fv))
        assert got == "ValueError: k.device must equal q.device (cpu); got meta", got
        # a 3-D q: the fake answers (the operator raises when it runs, on every rank)
        assert tokenring.ring_attn(fq[0], fk[0], fv[0]).shape == (SEQ, 2, 4)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tokenring.ring_attn(q, k, v)

    got = error_of(lambda: _compile(attend)(q[0], k[0], v[0]))
    assert got.startswith("ValueError: q must have 4 dims") and "(8, 2, 4)" in got, got
    got = error_of(lambda: _compile(attend)(q, k.to("meta"), v))
    assert "k.device must equal q.device (cpu); got meta" in got, got


@pytest.mark.parametrize("name", ["seq_len", "attention_chunk_size", "last_block_splits"])
def test_a_tensor_option_under_compile_names_it(single_rank_group: None, name: str) -> None:
    q, k, v = _qkv()
    strategy = "token_ring" if name == "last_block_splits" else "ring"

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: Any) -> torch.Tensor:
        return tokenring.sequence_parallel_attn(q, k, v, strategy=strategy, **{name: x})

    got = error_of(lambda: _compile(attend)(q, k, v, torch.tensor(SEQ if name == "seq_len" else 2)))
    assert got.startswith(f"NotImplementedError: {name} as a tensor under torch.compile"), got
    assert f"pass a Python value ({name}.item() outside the compiled function)" in got, got


def test_stale_handle_world_group_and_int_window(single_rank_group: None) -> None:
    q, k, v = _qkv()
    comm = tokenring.Communicator(timeout_s=10)
    handle = op.object_handle(comm)  # what a compiled graph holds for it
    del comm
    gc.collect()
    options = dict(
        group=handle, strategy="ring", causal=False, softmax_scale=None, layout="contiguous",
        block_kernel=None, last_block_splits=None, last_pair=None, check_ranks=True,
        hardware=None, seq_len=None, cu_seqlens=None, window_size=None,
        attention_chunk_size=None, requires_grad=[False] * 3, raw=None,
    )  # fmt: skip
    got = error_of(lambda: torch.ops.tokenring.attention(q, k, v, **options))
    assert got.startswith(f"RuntimeError: {handle} was passed to tokenring's attention"), got

    def world(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tokenring.ring_attn(q, k, v, group=dist.group.WORLD, softmax_scale=0.5)

    # as in a process that never named it eagerly: dynamo's tracing does not remember it
    op._GROUPS.pop(dist.group.WORLD.group_name, None)
    assert (_compile(world)(q, k, v) - _oracle(q, k, v)).abs().max().item() < 1e-12
    for window in (0, 2, -1):  # w means (w, w)
        got = tokenring.ring_attn(q, k, v, window_size=window, softmax_scale=0.5)
        want = _oracle(q, k, v, window=(window, window))
        assert (got - want).abs().max().item() < 1e-12, window


# -- planner and simulator: a pure table --------------------------------------------------------

GQA = AttentionShape(batch=1, heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16")
CALL: dict[str, Any] = dict(world_size=4, seq_local=64, heads_q=8, heads_kv=2, head_dim=64)
CALL |= dict(dtype="bfloat16", causal=True, hardware="h100-nvswitch")
SCHED: dict[str, Any] = dict(layout="zigzag", causal=True, world_size=4, heads_q=8, heads_kv=2)
PASS: dict[str, Any] = dict(layout="zigzag", causal=True, world_size=4, seq_local=64, shape=GQA)
PASS["hardware"] = PRESETS["h100-nvswitch"]

# (call, the start of its error, fragments it must name)
MODEL_ERRORS: list[tuple[Callable[[], object], str, list[str]]] = [
    (
        lambda: planner.explain(**CALL, strategies=["hybrid"]),
        "NotImplementedError: no candidate strategy can be predicted here",
        ["hybrid=HybridSpec(inner=..."],
    ),
    (
        lambda: planner.explain(**CALL, strategies=["ulysses"]),
        "NotImplementedError: no candidate strategy can be predicted here",
        ["'direct' collective routing"],
    ),
    (
        lambda: planner.choose_cached_strategy(
            planner.uniform_shards(world_size=2, batch=1, cached=64, new=1, block_size=16),
            **dict(heads_q=8, heads_kv=2, head_dim=64, dtype="bfloat16", candidates=[]),
            hardware=PRESETS["h100-nvswitch"],
        ),
        "ValueError: candidates must name at least one strategy",
        ["got none"],
    ),
    (
        lambda: simulate("ring", **PASS, mode="vectorised", window_size=(8, 0)),
        "NotImplementedError: the vectorised engine replays",
        ["mode='vectorised'", "world_size=4", "mode='event'"],
    ),
    (
        lambda: simulate("ring", **PASS, mode="event", cu_seqlens=5),
        "ValueError: cu_seqlens",
        ["5"],
    ),
    (
        lambda: strategy_schedule("ring", "forward", **SCHED, seq_local=64, seq_len=256),
        "ValueError: give exactly one of seq_local and seq_len",
        ["seq_local=64", "seq_len=256"],
    ),
    (
        lambda: strategy_schedule("hybrid", "forward", **SCHED, seq_local=64),
        "ValueError: hybrid must give the inner size and outer strategy",
        ["got None"],
    ),
    (
        lambda: strategy_schedule("hybrid", "forward", **SCHED, seq_len=256, window_size=(8, 0)),
        "ValueError: hybrid must give the inner size and outer strategy",
        ["got None"],
    ),
]


@pytest.mark.parametrize("index", range(len(MODEL_ERRORS)))
def test_model_errors_name_their_argument(index: int) -> None:
    call, start, fragments = MODEL_ERRORS[index]
    got = error_of(call)
    assert got.startswith(start), got
    for fragment in fragments:
        assert fragment in got, (fragment, got)


def test_calibrate_names_heads_that_do_not_divide(single_rank_group: None) -> None:
    got = error_of(lambda: planner.calibrate(tokenring.get_communicator(), heads_q=8, heads_kv=3))
    assert got == "ValueError: heads_kv must divide heads_q; got heads_q=8, heads_kv=3", got


def _same(a: Any, b: Any) -> bool:
    return (a.steps, a.transfers, a.sharding, a.mask) == (b.steps, b.transfers, b.sharding, b.mask)


def test_strategy_schedule_with_a_plain_mask_is_the_plain_schedule() -> None:
    """A window of (-1, 0) on a causal call masks nothing: the collective's and the hybrid's
    schedules are those without the keyword."""
    for strategy in ("ulysses", "allgather_kv"):
        plain = strategy_schedule(strategy, "forward", **SCHED, seq_local=64)
        masked = strategy_schedule(strategy, "forward", **SCHED, seq_local=64, window_size=(-1, 0))
        assert _same(masked, plain), strategy
    spec = HybridSpec(inner=2, outer_strategy="token_ring")
    plain = strategy_schedule("hybrid", "forward", **SCHED, seq_len=256, hybrid=spec)
    masked = strategy_schedule(
        "hybrid", "forward", **SCHED, seq_len=256, hybrid=spec, window_size=(-1, 0)
    )
    assert _same(masked, plain)


# -- sketches -------------------------------------------------------------------------------------


def test_sketch_of_complex_empty_and_non_finite_values() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.complex128, generator=gen)
    y = torch.randn(7, generator=gen, dtype=torch.float64)
    assert sketch(x, y, rtol=0.1) == sketch(torch.view_as_real(x), y, rtol=0.1)
    assert sketch(y, torch.empty(0, 4), rtol=0.1) == sketch(y, rtol=0.1)
    finite = sketch(y, rtol=replicated_rtol(y.dtype))
    assert finite.distance(sketch(y * (1 + 1e-15), rtol=0)) < finite.rtol
    for bad in (math.inf, math.nan):
        other = Sketch(values=(bad, *finite.values[1:]), rtol=finite.rtol)
        assert finite.distance(other) == math.inf and other.distance(finite) == math.inf, bad


# -- launch ---------------------------------------------------------------------------------------


def _exit_three_after_returning() -> int:
    atexit.register(os._exit, 3)
    return dist.get_rank()


def test_a_rank_that_exits_badly_after_its_result_is_named() -> None:
    got = error_of(
        lambda: tokenring.launch(_exit_three_after_returning, world_size=1, timeout_s=60)
    )
    assert "rank 0 returned its result but then exited with code 3" in got, got


# -- tokenring bench --mode memory ----------------------------------------------------------------


def test_bench_memory_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """2 ranks, s = 16, Hq = 2, Hkv = 1, D = 8, float32: the minimum is q, out, dout, dq
    (B s Hq D each), k, v, dk, dv (B s Hkv D each), 4 bytes a value, and lse (B Hq s float32)."""
    out = tmp_path / "memory.jsonl"
    argv = ["bench", "--mode", "memory", "--world-size", "2", "--seq-local", "16"]
    argv += ["--strategies", "ring", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]
    assert main([*argv, "--out", str(out)]) == 0
    b, s, hq, hkv, d = 1, 16, 2, 1, 8
    minimum = 4 * (4 * b * s * hq * d + 4 * b * s * hkv * d) + 4 * b * hq * s
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["strategy"], row["world_size"], row["seq_local"], row["seq"]) == ("ring", 2, 16, 32)
    assert row["minimum_bytes"] == minimum, row
    assert row["ratio"] == row["peak_bytes"] / minimum, row
    table = capsys.readouterr().out.splitlines()
    assert "peak memory per rank, fwd+bwd: P=2 B=1 Hq=2 Hkv=1 D=8 float32 causal" in table[-3]
    assert table[-1].split() == [
        "ring", "16", f"{row['peak_bytes'] / 2**20:.1f}", f"{minimum / 2**20:.1f}",
        f"{row['ratio']:.2f}",
    ]  # fmt: skip
