"""Audit of the hybrid strategy and the diffusers integration: one rank's call that differs
from its peers' (another option, a bad argument, other K/V) must raise on every rank, naming
the cause, instead of leaving the peers waiting out the timeout or aborting in gloo; and the
next call on the same groups still matches the float64 oracle.

Each launch runs every case inside the ranks, with a short process-group timeout so that a
hang fails fast; the messages come back and are checked here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tokenring
from oracle import full_attention, make_inputs, oracle_with_grads, sharded_positions
from tokenring.hybrid import hybrid_attn, hybrid_mesh

PG_TIMEOUT_S = 10.0  # a case that hangs fails within this, not the default 30 s


def _message(call: Callable[[], Any]) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "no error"


# -- hybrid_attn: one rank's bad option -----------------------------------------------------


def _hybrid_positions(outer_rank: int, inner_rank: int, seq: int) -> list[int]:
    """Positions of a rank of the 2 x 2 mesh, zigzag (from the layout's definition)."""
    shard = sharded_positions("zigzag", outer_rank, 2, seq)
    half = (len(shard) + 1) // 2
    return shard[:half] if inner_rank == 0 else shard[half:]


def _hybrid_ranks() -> dict[str, Any]:
    """2 x 2: a non-bool return_lse or check_ranks and a softmax_scale that is not a number
    on one rank (before: that rank raised alone, or a TypeError, and the others waited out
    the timeout; a failed flag check before the first call built the groups' communicators
    in another order than the peers, and every rank waited); then a good call."""
    rank = dist.get_rank()
    mesh = hybrid_mesh(2, 2)
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    found: dict[str, Any] = {}
    for name, bad in (("return_lse", 1), ("check_ranks", "yes"), ("softmax_scale", "x")):
        options = {name: bad} if rank == (1 if name == "softmax_scale" else 0) else {}
        found[name] = _message(functools.partial(hybrid_attn, q, q, q, mesh=mesh, **options))
    seq = 16
    q, k, v, dout = make_inputs(seed=5, batch=2, seq_global=seq, heads_q=4, heads_kv=2, head_dim=8)
    ref = oracle_with_grads(q, k, v, dout, causal=True, scale=8**-0.5)
    idx = torch.tensor(_hybrid_positions(rank // 2, rank % 2, seq))
    local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
    out = hybrid_attn(*local, mesh=mesh, causal=True, layout="zigzag", outer_strategy="ring")
    assert isinstance(out, torch.Tensor)
    out.backward(dout[:, idx])
    grads = [x.grad for x in local]
    errors = [out.detach() - ref["out"][:, idx]]
    errors += [
        g - ref[n][:, idx] for g, n in zip(grads, ("dq", "dk", "dv"), strict=True) if g is not None
    ]
    found["error"] = max(float(e.abs().max()) for e in errors)
    found["num_grads"] = len(errors) - 1
    found["lse_loss_errors"] = _hybrid_lse_loss_errors(mesh, q, k, v, dout, idx=idx)
    return found


def _hybrid_lse_loss_errors(
    mesh: Any, *inputs: torch.Tensor, idx: torch.Tensor
) -> dict[str, float]:
    """A loss of out and lse, and one of lse alone (Note [Gradient of lse] in
    tokenring.runtime.op; before: lse carried no gradient, its term was dropped): the largest
    error of each gradient against float64 autograd."""
    q, k, v, dout = inputs
    dlse = torch.randn(
        q.shape[0], q.shape[2], q.shape[1], generator=torch.Generator().manual_seed(9)
    )
    errors = {}
    for name, with_out in (("out_and_lse", True), ("lse_alone", False)):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref_out, ref_lse = full_attention(*leaves, causal=True, scale=8**-0.5)
        ref_loss = (ref_lse * dlse.double()).sum() + (ref_out * dout).sum() * with_out
        want = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
        local = [x[:, idx].clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = hybrid_attn(*local, mesh=mesh, causal=True, layout="zigzag", return_lse=True)
        loss = (lse * dlse[:, :, idx]).sum() + ((out * dout[:, idx]).sum() if with_out else 0)
        loss.backward()
        for leaf, ref, grad in zip(local, want, ("dq", "dk", "dv"), strict=True):
            expected = torch.zeros_like(leaf) if ref is None else ref[:, idx]
            got = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            errors[f"{name} {grad}"] = float((got - expected).abs().max())
    return errors


def test_one_ranks_bad_hybrid_option_raises_on_every_rank() -> None:
    per_rank = tokenring.launch(
        _hybrid_ranks, world_size=4, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S
    )
    for rank, found in enumerate(per_rank):
        assert "return_lse must be a bool; got 1" in found["return_lse"], (rank, found)
        assert "check_ranks must be a bool; got 'yes'" in found["check_ranks"], (rank, found)
        assert "softmax_scale must be a finite number > 0 or None; got x" in found["softmax_scale"]
        assert found["num_grads"] == 3 and found["error"] < 1e-10, (rank, found)
        assert max(found["lse_loss_errors"].values()) < 1e-10, (rank, found["lse_loss_errors"])


@pytest.mark.usefixtures("single_rank_group")
def test_hybrid_mesh_of_another_type_is_named() -> None:
    # Before: AttributeError "'ProcessGroup' object has no attribute 'inner_size'".
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"mesh must be a HybridMesh .* got ProcessGroup"):
        hybrid_attn(q, q, q, mesh=dist.group.WORLD)  # type: ignore[arg-type]
    # Before: TypeError ("'>' not supported between 'str' and 'int'") out of the rank check.
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0 or None"):
        tokenring.sequence_parallel_attn(q, q, q, softmax_scale="x")  # type: ignore[arg-type]


# -- tokenring.diffusers: one rank's other call ---------------------------------------------


def _flux_call(text: str, text_seq_len: int | None) -> Any:
    """A tiny Flux model (tests/test_diffusers.py's) on this rank's image rows."""
    from test_diffusers import TEXT, build_model, contiguous_rows, make_inputs
    from tokenring.diffusers import FluxSequenceParallelProcessor

    comm = tokenring.get_communicator()
    inputs = make_inputs()
    img = contiguous_rows(inputs["hidden_states"].shape[1], comm.rank, comm.world_size)
    keep = (
        slice(None) if text == "replicated" else contiguous_rows(TEXT, comm.rank, comm.world_size)
    )
    model = build_model()
    model.set_attn_processor(FluxSequenceParallelProcessor(text=text))
    kwargs = {} if text_seq_len is None else {"text_seq_len": text_seq_len}
    return model(
        hidden_states=inputs["hidden_states"][:, img],
        encoder_hidden_states=inputs["encoder_hidden_states"][:, keep],
        pooled_projections=inputs["pooled_projections"],
        timestep=inputs["timestep"],
        img_ids=inputs["img_ids"][img],
        txt_ids=inputs["txt_ids"][keep],
        joint_attention_kwargs=kwargs,
    )


def _diffusers_ranks() -> dict[str, Any]:
    """2 ranks; rank 1's call differs from rank 0's. Before: other K/V heads, dtype or
    head dim under kv="sharded" aborted both processes in gloo (a size mismatch); K/V that
    need a gradient on one rank only hung in the backward's all-reduce; a bad argument on
    one rank (cross or joint) or another text placement or text_seq_len in the Flux
    processor left the other rank waiting out the timeout; another text placement in
    joint_attn raised a message about the attention call's fields, not the placement."""
    from tokenring.diffusers import cross_attn, joint_attn

    rank = dist.get_rank()
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    kv = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    odd = rank == 1
    cases: dict[str, Callable[[], Any]] = {
        "heads": lambda: cross_attn(q, kv[:, :, : 1 + odd], kv[:, :, : 1 + odd], kv="sharded"),
        "dtype": lambda: cross_attn(*(x.float() if odd else x for x in (q, kv, kv)), kv="sharded"),
        "grad": lambda: cross_attn(q, kv.clone().requires_grad_(odd), kv, kv="sharded"),
        "bad k": lambda: cross_attn(q, kv[0] if odd else kv, kv, kv="sharded"),
        "text": lambda: joint_attn(q, q, q, num_text=2, text="sharded" if odd else "replicated"),
        "num_text": lambda: joint_attn(q, q, q, num_text=9 if odd else 2, text="replicated"),
        "flux text": lambda: _flux_call("sharded" if odd else "replicated", 12),
        "flux text_seq_len": lambda: _flux_call("replicated", None if odd else 12),
    }
    found: dict[str, Any] = {name: _message(call) for name, call in cases.items()}
    # then sharded K/V of uneven parts (rank 1: none) against SDPA on the whole, float64
    gen = torch.Generator().manual_seed(7)
    qg, kg, vg, dout = (torch.randn(2, 8, 4, 8, generator=gen, dtype=torch.float64) for _ in "qkvd")
    kg, vg = kg[:, :5, :2], vg[:, :5, :2]  # Skv = 5, GQA
    rows, kv_rows = slice(4 * rank, 4 * rank + 4), slice(0, 5) if rank == 0 else slice(5, 5)
    local = [qg[:, rows].clone().requires_grad_(True)]
    local += [x[:, kv_rows].clone().requires_grad_(True) for x in (kg, vg)]
    out = cross_attn(*local, kv="sharded")
    out.backward(dout[:, rows])
    whole = [x.clone().requires_grad_(True) for x in (qg, kg, vg)]
    want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in whole), enable_gqa=True)
    want.transpose(1, 2).backward(dout)
    pairs = [(out.detach(), want.transpose(1, 2)[:, rows].detach())]
    for got, ref, r in zip(local, whole, (rows, kv_rows, kv_rows), strict=True):
        assert got.grad is not None and ref.grad is not None
        pairs.append((got.grad, ref.grad[:, r]))
    found["error"] = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in pairs)
    return found


def test_one_ranks_other_diffusers_call_raises_on_every_rank() -> None:
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    per_rank = tokenring.launch(
        _diffusers_ranks, world_size=2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S
    )
    disagree = "ranks disagree on this cross-attention call: "
    want = {
        "heads": disagree + "heads_kv: rank 0 has 1, rank 1 has 2",
        "dtype": "dtype: rank 0 has torch.float64, rank 1 has torch.float32",
        "grad": "k needs grad: rank 0 has False, rank 1 has True",
        "text": "text: rank 0 has replicated, rank 1 has sharded",
        "flux text": "text: rank 0 has replicated, rank 1 has sharded",
        "flux text_seq_len": "text_seq_len: rank 0 has 12, rank 1 has None",
    }
    for rank, found in enumerate(per_rank):
        for name, message in want.items():
            assert message in found[name], (rank, name, found[name])
        bad_k = "k must be a 4-D tensor (B, seq, H, D); got (3, 2, 8)"
        num_text = "num_text must be in [0, 6] (q.shape[1]); got 9"
        for name, message in (("bad k", bad_k), ("num_text", num_text)):
            where = (
                ""
                if rank == 1
                else f"rank 1 cannot run this {'cross' if name == 'bad k' else 'joint'}"
            )
            assert message in found[name] and where in found[name], (rank, name, found[name])
        assert found["error"] < 1e-10, (rank, found["error"])
