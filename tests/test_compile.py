"""torch.compile through the attention operator (``tokenring::attention``).

Multi-rank: one launch of 2 gloo ranks loops every strategy, ``fullgraph`` True and False,
and two shardings inside the ranks: a causal zigzag GQA shard whose length is marked dynamic
(two lengths, one graph: no graph break, no recompile) and an uneven non-causal shard (padding:
``seq_len`` given). Out, lse and dq, dk, dv are compared with the float64 oracle within 1e-10.
The groups vary too: the default group, a Communicator, and a fresh ProcessGroup known only
to the module that holds it. In-process (one rank): ``torch.library.opcheck`` of the operator,
and the clear errors of what cannot be compiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import tokenring
import tokenring.api  # registers torch.ops.tokenring.*
from oracle import make_inputs, oracle_with_grads, sharded_positions
from tokenring.runtime import op

STRATEGIES = ["token_ring", "ring", "bidir_ring", "ulysses", "allgather_kv"]
HEAD_DIM = 8
OUT_SCALE = 1.5  # the module scales its output, so the graph holds more than the operator


class _Block(torch.nn.Module):
    """Attention as a model calls it, plus a pointwise op for the compiler to fuse. With a
    ProcessGroup it holds a SequenceParallelAttention (which makes the group known to the
    operator, Note [Handles] in tokenring.runtime.op) and returns no lse."""

    def __init__(self, strategy: str, group: Any, **options: Any) -> None:
        super().__init__()
        self.strategy, self.group, self.options = strategy, group, options
        self.attn = None
        if isinstance(group, dist.ProcessGroup):
            self.attn = tokenring.SequenceParallelAttention(
                strategy=strategy, group=group, **options
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.attn is not None:
            return self.attn(q, k, v) * OUT_SCALE, None
        out, lse = tokenring.sequence_parallel_attn(
            q, k, v, strategy=self.strategy, group=self.group, return_lse=True, **self.options
        )
        return out * OUT_SCALE, lse


def _check(
    module: Any, *, layout: str, causal: bool, seq_len: int, dynamic: bool, seed: int
) -> list[str]:
    """Run ``module`` on this rank's shard of seeded inputs; failures against the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = make_inputs(
        seed=seed, batch=2, seq_global=seq_len, heads_q=6, heads_kv=2, head_dim=HEAD_DIM
    )
    ref = oracle_with_grads(q, k, v, OUT_SCALE * dout, causal=causal, scale=HEAD_DIM**-0.5)
    idx = torch.tensor(sharded_positions(layout, rank, world, seq_len))
    local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
    if dynamic:
        for x in local:
            torch._dynamo.mark_dynamic(x, 1)
    out, lse = module(*local)
    out.backward(dout[:, idx])
    got = {"out": out.detach() / OUT_SCALE, "lse": lse}
    got |= {name: x.grad for name, x in zip(("dq", "dk", "dv"), local, strict=True)}
    want = {"out": ref["out"][:, idx], "lse": ref["lse"][:, :, idx]}
    want |= {name: ref[name][:, idx] for name in ("dq", "dk", "dv")}
    failures = []
    for name, x in got.items():
        if x is None:
            assert name == "lse"  # the module wrapper returns no lse
            continue
        error = (x - want[name]).abs().max().item()
        if not error <= 1e-10:
            failures.append(f"{name}: {error:.3g} > 1e-10")
    if lse is not None and not lse.requires_grad:  # Note [Gradient of lse] in runtime.op
        failures.append("lse carries no gradient")
    return failures


def compiled_grid() -> list[str]:
    """Every strategy, compiled; returns this rank's failures."""
    # Compile in the rank itself: a pool of compile workers per rank costs more (each imports
    # torch) than it saves on these small graphs.
    inductor_config.compile_threads = 1
    # Trust the vector ISAs the CPU reports instead of dry-compiling and dlopen-ing a probe
    # program per ISA (about ten g++ runs, most of this test's time in a fresh cache dir).
    # An ISA the compiler could not build for would fail the kernels' own build, loudly.
    inductor_config.cpp.vec_isa_ok = True
    world = dist.get_world_size()
    groups = {
        "ring": dist.new_group(list(range(world))),  # known to the operator via the module
        "bidir_ring": tokenring.get_communicator(),
    }
    failures = []
    for strategy in STRATEGIES:
        group = groups.get(strategy)
        module = _Block(strategy, group, causal=True, layout="zigzag")
        for fullgraph in (True, False):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("inductor")
            compiled = torch.compile(module, backend=counter, fullgraph=fullgraph)
            for seq_local in (6, 10):  # one graph for both: the length is dynamic
                found = _check(
                    compiled,
                    layout="zigzag",
                    causal=True,
                    seq_len=seq_local * world,
                    dynamic=True,
                    seed=seq_local,
                )
                case = f"{strategy} fullgraph={fullgraph} zigzag causal s={seq_local}"
                failures += [f"{case}: {f}" for f in found]
            if counter.frame_count != 1:
                failures.append(
                    f"{strategy} fullgraph={fullgraph}: {counter.frame_count} graphs for two "
                    "lengths (a graph break or a recompile)"
                )
        seq_len = 5 * world + 1  # uneven: rank 0 holds one token more; the others are padded
        module = _Block(strategy, group, layout="contiguous", seq_len=seq_len)
        compiled = torch.compile(module, backend="inductor", fullgraph=True)
        found = _check(
            compiled, layout="contiguous", causal=False, seq_len=seq_len, dynamic=False, seed=3
        )
        failures += [f"{strategy} padded (seq_len={seq_len}): {f}" for f in found]
    return failures


def test_compiled_matches_oracle_on_two_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache of its own: Inductor's on-disk cache keys on the graph, not on our operator's
    # fake implementation, so code compiled for an older tokenring (another residual count)
    # would be reused (seen: IndexError in the cached code after Ulysses dropped its residuals).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    per_rank = tokenring.launch(compiled_grid, world_size=2, timeout_s=600)
    failures = [f"rank {rank}: {f}" for rank, found in enumerate(per_rank) for f in found]
    assert not failures, "\n".join(failures)


# -- one rank, in-process ----------------------------------------------------------------------


def _qkv(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 6, 6, HEAD_DIM), (2, 6, 2, HEAD_DIM), (2, 6, 2, HEAD_DIM)]
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_(True) for shape in shapes]


@pytest.mark.parametrize("strategy", ["token_ring", "ulysses", "allgather_kv"])
def test_operator_passes_opcheck(single_rank_group: None, strategy: str) -> None:
    """Fake shapes and strides equal the real ones (static and dynamic), the autograd
    registration is complete, and AOT autograd's gradients equal eager ones; one strategy per
    kind of residuals (the ring strategies share theirs)."""
    options = {  # the operator's schema: primitives and handles
        "group": op.DEFAULT_GROUP,
        "strategy": strategy,
        "causal": True,
        "softmax_scale": None,
        "layout": "zigzag",
        "block_kernel": None,
        "last_block_splits": 2 if strategy == "token_ring" else None,
        "last_pair": None,
        "check_ranks": True,
        "hardware": None,
        "seq_len": None,
        "cu_seqlens": None,
        "window_size": None,
        "attention_chunk_size": None,
        "requires_grad": [True, True, True],
        "raw": None,
    }
    torch.library.opcheck(torch.ops.tokenring.attention.default, tuple(_qkv()), options)


def _compiled(fn: Any, *args: Any) -> Any:
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)


def test_what_cannot_be_compiled_says_why(single_rank_group: None) -> None:
    q, k, v = _qkv()

    def auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tokenring.sequence_parallel_attn(q, k, v, strategy="auto")

    with pytest.raises(Exception, match=r"strategy='auto' needs hardware="):
        _compiled(auto, q, k, v)

    def tensor_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tokenring.ring_attn(q, k, v, seq_len=6, cu_seqlens=torch.tensor([0, 2, 6]))

    with pytest.raises(Exception, match=r"cu_seqlens as a tensor under torch.compile"):
        _compiled(tensor_documents, q, k, v)
    group = dist.new_group([0])

    def fresh_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return tokenring.token_ring_attn(q, k, v, group=group)

    with pytest.raises(Exception, match=r"process group '\w+' is not known to tokenring"):
        _compiled(fresh_group, q, k, v)
    tokenring.get_communicator(group)  # now it is
    assert torch.equal(_compiled(fresh_group, q, k, v), fresh_group(q, k, v))


def test_auto_with_hardware_compiles_to_the_eager_pick(single_rank_group: None) -> None:
    q, k, v = _qkv(torch.bfloat16)

    def auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = tokenring.sequence_parallel_attn(
            q, k, v, strategy="auto", hardware="h100-nvswitch", causal=True
        )
        return out.float().square().sum()

    compiled = _compiled(auto, q, k, v)
    compiled.backward()
    grads = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = auto(q, k, v)
    eager.backward()
    assert torch.equal(compiled, eager)
    for got, x in zip(grads, (q, k, v), strict=True):
        assert got is not None and torch.equal(got, x.grad)
