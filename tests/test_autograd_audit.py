"""An audit of how a user's autograd graph reaches the attention entry points.

test_grad_audit covers views of separate leaves, some inputs without grad, retain_graph, odd
upstream gradients, lse in the loss and tiled kernels. This file covers the graph around the
call: q, k and v that alias (one tensor passed three times, k and v the same, views of one
packed qkv, overlapping views, GQA K/V made with ``expand``: stride 0), inputs that are the
result of a matmul (the gradient reaches the weight), replicated text in joint attention; the
entry points beside ``sequence_parallel_attn`` (the module, the flash-attn shims,
``joint_attn``); and the modes around it: checkpointing (reentrant or not), no_grad and
inference_mode, grads accumulating over two calls, ``torch.autograd.grad`` of one input, hooks,
an output changed in place, create_graph (double backward), forward-mode AD (used to give a
tangent of zeros without a word) and autocast (used to run the reference and tiled kernels'
matmuls in bfloat16 for float32 inputs).

Oracle: float64 autograd of plain attention (``oracle.full_attention``) over the same graph
built on the whole sequence; every rank's leaves are the global tensors, so the sum of the
ranks' leaf gradients is the gradient (1e-10 in float64). The cases of one world size run in
one launch.

Legend: B batch, S global seq, s local seq, T text tokens, H heads, D head dim, P world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

import tokenring
from oracle import full_attention, sharded_positions
from test_random_calls import _hardware
from tokenring import compat, diffusers

B, H, D = 2, 2, 4
STRATEGIES = ("token_ring", "ring", "bidir_ring", "bidir_token_ring", "ulysses", "allgather_kv")
Graph = Callable[[list[torch.Tensor], Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _same(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    t = x[0][:, rows]  # one tensor object as q, k and v
    return t, t, t


def _kv_same(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    kv = x[1][:, rows]
    return x[0][:, rows], kv, kv


def _qk_same(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    qk = x[0][:, rows]
    return qk, qk, x[1][:, rows]


def _unbind(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    return x[0][:, rows].unbind(2)  # (B, s, 3, H, D) -> three strided views


def _index(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    qkv = x[0][:, rows]
    return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]


def _split(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    return x[0][:, rows].split(D, dim=-1)  # (B, s, H, 3D) -> three views of the head dim


def _overlap(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    wide = x[0][:, rows]  # (B, s, H, D + 2): q, k, v share most of their elements
    return wide[..., :D], wide[..., 1 : D + 1], wide[..., 2:]


def _expand(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    k, v = (t[:, rows].expand(-1, -1, 2, -1) for t in x[1:])  # (B, s, 1, D) -> stride 0 heads
    return x[0][:, rows], k, v


def _batch_expand(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    k, v = (t[:, rows].expand(B, -1, -1, -1) for t in x[1:])  # one K/V row for every batch
    return x[0][:, rows], k, v


def _matmul(x: list[torch.Tensor], rows: Any) -> tuple[torch.Tensor, ...]:
    hidden = x[0][:, rows]  # (B, s, C)
    return (hidden @ x[1]).unflatten(-1, (3, H, D)).unbind(2)  # the grad reaches W


# name -> (the leaves' shapes, S for the sequence dim), the graph from leaves to q, k, v
GRAPHS: dict[str, tuple[Callable[[int], list[tuple[int, ...]]], Graph]] = {
    "same": (lambda s: [(B, s, H, D)], _same),
    "kv_same": (lambda s: [(B, s, H, D)] * 2, _kv_same),
    "qk_same": (lambda s: [(B, s, H, D)] * 2, _qk_same),
    "unbind": (lambda s: [(B, s, 3, H, D)], _unbind),
    "index": (lambda s: [(B, s, 3, H, D)], _index),
    "split": (lambda s: [(B, s, H, 3 * D)], _split),
    "overlap": (lambda s: [(B, s, H, D + 2)], _overlap),
    "expand": (lambda s: [(B, s, 4, D), (B, s, 1, D), (B, s, 1, D)], _expand),
    "batch_expand": (lambda s: [(B, s, H, D), (1, s, H, D), (1, s, H, D)], _batch_expand),
    "matmul": (lambda s: [(B, s, 6), (6, 3 * H * D)], _matmul),
}


def _entry(name: str, strategy: str, layout: str, causal: bool) -> Callable[..., torch.Tensor]:
    """An attention entry point with its options fixed: q, k, v -> out."""
    options: dict[str, Any] = {"causal": causal, "layout": layout, "strategy": strategy}
    if name == "module":
        return tokenring.SequenceParallelAttention(**options)
    if name == "flash":
        return lambda q, k, v: compat.flash_attn_func(q, k, v, **options)
    if name == "joint":  # sharded text: one non-causal call over [text_r, image_r]
        assert not causal and layout == "contiguous"
        return lambda q, k, v: diffusers.joint_attn(
            q, k, v, num_text=0, text="sharded", strategy=strategy
        )
    assert name == "spa"
    return lambda q, k, v: tokenring.sequence_parallel_attn(q, k, v, **options)


def _rows(layout: str, rank: int, world: int, seq_len: int) -> Any:
    """This rank's rows of the global sequence: a slice (so q is a view of the leaf itself)
    for contiguous shards, an index (a copy) for zigzag."""
    pos = sharded_positions(layout, rank, world, seq_len, None)
    if layout == "contiguous":
        return slice(pos[0], pos[-1] + 1)
    return torch.tensor(pos)


def _seeded(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=torch.float64, generator=gen) for shape in shapes]


def _summed(grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each rank's partial leaf gradients summed over the ranks."""
    total = [g.clone() for g in grads]
    for g in total:
        dist.all_reduce(g)
    return total


def _off(got: list[torch.Tensor], want: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> float:
    return max(float((a - b).detach().abs().max()) for a, b in zip(got, want, strict=True))


def graph_case(graph: str, entry: str, strategy: str, layout: str) -> list[str]:
    """One graph through one entry point: out and the leaves' gradients against float64
    autograd of the same graph over the whole sequence."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len, causal = 4 * world, entry != "joint"
    shapes, build = GRAPHS[graph]
    values = _seeded(shapes(seq_len), seed=len(graph))
    rows = _rows(layout, rank, world, seq_len)
    # the oracle: the same graph on the whole sequence
    ref_leaves = [x.clone().requires_grad_(True) for x in values]
    ref_out, _ = full_attention(*build(ref_leaves, slice(None)), causal=causal, scale=D**-0.5)
    (dout,) = _seeded([tuple(ref_out.shape)], seed=99)
    want = torch.autograd.grad((ref_out * dout).sum(), ref_leaves)
    leaves = [x.clone().requires_grad_(True) for x in values]
    out = _entry(entry, strategy, layout, causal)(*build(leaves, rows))
    grads = _summed(torch.autograd.grad((out * dout[:, rows]).sum(), leaves))
    label = f"{graph} via {entry} ({strategy}, {layout})"
    failures = []
    if _off([out], [ref_out[:, rows]]) > 1e-10:
        failures.append(f"{label}: out off by {_off([out], [ref_out[:, rows]]):.3g}")
    if _off(grads, want) > 1e-10:
        failures.append(f"{label}: leaf gradients off by {_off(grads, want):.3g}")
    return failures


def joint_replicated_case() -> list[str]:
    """joint_attn(x, x, x) with replicated text: x is [the whole text, this rank's image
    rows], one tensor as q, k and v; the text's gradient is partial on each rank (each rank
    weighs its copy of the text rows by 1 / P, so the ranks' losses add up to one loss)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    num_text, seq_len = 3, 2 * world
    text, image = _seeded([(B, num_text, H, D), (B, seq_len, H, D)], seed=5)
    rows = _rows("contiguous", rank, world, seq_len)
    ref_text, ref_image = (x.clone().requires_grad_(True) for x in (text, image))
    x_ref = torch.cat([ref_text, ref_image], dim=1)
    ref_out, _ = full_attention(x_ref, x_ref, x_ref, causal=False, scale=D**-0.5)
    (dout,) = _seeded([tuple(ref_out.shape)], seed=6)
    want = torch.autograd.grad((ref_out * dout).sum(), (ref_text, ref_image))
    leaves = [x.clone().requires_grad_(True) for x in (text, image)]
    x = torch.cat([leaves[0], leaves[1][:, rows]], dim=1)  # (B, T + s, H, D)
    out = diffusers.joint_attn(x, x, x, num_text=num_text, text="replicated")
    mine = torch.cat([dout[:, :num_text] / world, dout[:, num_text:][:, rows]], dim=1)
    grads = _summed(torch.autograd.grad((out * mine).sum(), leaves))
    want_out = torch.cat([ref_out[:, :num_text], ref_out[:, num_text:][:, rows]], dim=1)
    failures = []
    if _off([out], [want_out]) > 1e-10:
        failures.append(f"joint_attn(x, x, x) replicated: out off by {_off([out], [want_out]):.3g}")
    if _off(grads, want) > 1e-10:
        failures.append(f"joint_attn(x, x, x) replicated: grads off by {_off(grads, want):.3g}")
    return failures


def _plain(strategy: str, **extra: Any) -> Callable[..., Any]:
    options: dict[str, Any] = {"causal": True, "layout": "zigzag", "strategy": strategy}
    if strategy == "auto":
        options["hardware"] = _hardware("float64")
    return lambda q, k, v: tokenring.sequence_parallel_attn(q, k, v, **options, **extra)


def modes_case(strategy: str) -> list[str]:
    """The modes around one call of ``strategy`` (zigzag, causal, float64) against float64
    autograd: checkpointing, no_grad, inference_mode then training, grads accumulating,
    autograd.grad of v alone, a hook on q, create_graph, in-place changes of out."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len = 4 * world
    values = _seeded([(B, seq_len, H, D)] * 4, seed=11)
    rows = _rows("zigzag", rank, world, seq_len)
    ref = [x.clone().requires_grad_(True) for x in values[:3]]
    ref_out, _ = full_attention(*ref, causal=True, scale=D**-0.5)
    dout = values[3]
    want = [g[:, rows] for g in torch.autograd.grad((ref_out * dout).sum(), ref)]
    want_out, dout = ref_out.detach()[:, rows], dout[:, rows]
    attn = _plain(strategy)
    failures: list[str] = []

    def check(what: str, out: torch.Tensor | None, grads: Any, times: int = 1) -> None:
        if out is not None and _off([out.detach()], [want_out]) > 1e-10:
            failures.append(f"{strategy} {what}: out off by {_off([out.detach()], [want_out]):.3g}")
        if grads is not None and (
            any(g is None for g in grads) or _off(list(grads), [times * w for w in want]) > 1e-10
        ):
            failures.append(f"{strategy} {what}: gradients wrong")

    def leaves() -> list[torch.Tensor]:
        return [x[:, rows].clone().requires_grad_(True) for x in values[:3]]

    for reentrant in (False, True):
        q, k, v = leaves()
        out = checkpoint.checkpoint(attn, q, k, v, use_reentrant=reentrant)
        (out * dout).sum().backward()
        check(f"checkpoint(use_reentrant={reentrant})", out, (q.grad, k.grad, v.grad))
    q, k, v = leaves()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = attn(q, k, v)
        if out.requires_grad or out.grad_fn is not None:
            failures.append(f"{strategy} {mode.__name__}: the output keeps a graph")
        check(mode.__name__, out, None)
    for _ in range(2):  # after inference_mode: .grad accumulates over two calls
        (attn(q, k, v) * dout).sum().backward()
    check("two backwards into .grad", None, (q.grad, k.grad, v.grad), times=2)
    q, k, v = leaves()
    (dv,) = torch.autograd.grad((attn(q, k, v) * dout).sum(), (v,))
    if _off([dv], [want[2]]) > 1e-10:
        failures.append(f"{strategy} autograd.grad of v alone: off by {_off([dv], [want[2]]):.3g}")
    seen: list[torch.Tensor] = []
    q.register_hook(lambda g: seen.append(g) or 3 * g)
    (attn(q, k, v) * dout).sum().backward()
    if len(seen) != 1 or _off([seen[0], q.grad], [want[0], 3 * want[0]]) > 1e-10:
        failures.append(f"{strategy} hook on q: did not see dq, or its result was not used")
    failures += _create_graph(strategy, attn, leaves(), dout, want)
    failures += _in_place(strategy, attn, leaves(), dout, want_out)
    return failures


def _create_graph(
    strategy: str, attn: Callable[..., Any], qkv: list[torch.Tensor], dout: torch.Tensor, want: Any
) -> list[str]:
    """create_graph=True: the gradients are right; differentiating them again raises
    NotImplementedError naming the double backward (it used to tell the caller to register an
    autograd formula for tokenring's operator)."""
    grads = torch.autograd.grad((attn(*qkv) * dout).sum(), qkv, create_graph=True)
    failures = []
    if _off([g.detach() for g in grads], want) > 1e-10:
        failures.append(f"{strategy} create_graph=True: gradients wrong")
    try:
        torch.autograd.grad(sum((g**2).sum() for g in grads), qkv)
        failures.append(f"{strategy} double backward ran (it is not implemented)")
    except (NotImplementedError, RuntimeError) as error:
        if not isinstance(error, NotImplementedError) or "double backward" not in str(error):
            failures.append(f"{strategy} double backward: unclear error {error}")
    return failures


def _in_place(
    strategy: str,
    attn: Callable[..., Any],
    qkv: list[torch.Tensor],
    dout: torch.Tensor,
    want_out: torch.Tensor,
) -> list[str]:
    """out changed in place: without a backward it works (it used to raise at once for the
    ring strategies alone: their out was a view of a kernel's buffer); a backward, which reads
    the saved out, raises as PyTorch's own attention does."""
    out = attn(*qkv)
    out.mul_(2)  # no backward follows
    failures = []
    if _off([out.detach()], [2 * want_out]) > 1e-10:
        failures.append(f"{strategy} out.mul_(2): wrong values")
    out = attn(*qkv)
    out.view(-1)[0] = 5.0  # through a view of out
    try:
        (out * dout).sum().backward()
        failures.append(f"{strategy} backward after out changed in place: no error")
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            failures.append(f"{strategy} in-place change of out: {str(error)[:200]}")
    return failures


def autocast_case(strategy: str) -> list[str]:
    """float32 inputs under autocast(cpu, bfloat16) with the reference and tiled kernels:
    computed in float32 (they ran their matmuls in bfloat16: out 1e-2 off, returned as float32);
    inputs of two dtypes raise ValueError naming k and autocast, on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len = 8 * world
    values = _seeded([(B, seq_len, H, 8)] * 4, seed=21)
    rows = _rows("zigzag", rank, world, seq_len)
    ref = [x.float().double().requires_grad_(True) for x in values[:3]]
    ref_out, _ = full_attention(*ref, causal=True, scale=8**-0.5)
    dout = values[3].float()
    want = [g[:, rows].float() for g in torch.autograd.grad((ref_out * dout).sum(), ref)]
    failures = []
    for kernel in ("reference", "tiled"):
        qkv = [x[:, rows].float().requires_grad_(True) for x in values[:3]]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _plain(strategy, kernel=kernel)(*qkv)
            (out * dout[:, rows]).sum().backward()
        try:
            torch.testing.assert_close(out, ref_out[:, rows].float())
            for x, w in zip(qkv, want, strict=True):
                torch.testing.assert_close(x.grad, w)
        except AssertionError as error:
            failures.append(f"{strategy} {kernel} under autocast: {str(error).splitlines()[0]}")
    q, k, v = (x[:, rows].float() for x in values[:3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = q @ torch.eye(8)  # bfloat16: autocast's matmul
        try:
            _plain(strategy)(q, k, v)
            failures.append(f"{strategy} bfloat16 q with float32 k under autocast: ran")
        except ValueError as error:
            if "k.dtype" not in str(error) or "autocast" not in str(error):
                failures.append(f"{strategy} mixed dtypes under autocast: {error}")
    return failures


def forward_ad_case(strategy: str) -> list[str]:
    """A dual q (forward-mode AD) on rank 0 alone raises NotImplementedError on every rank
    at once; torch.func.jvp on every rank too. Both used to run and give a tangent of None
    (forward_ad) or zeros (jvp)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = _seeded([(B, 4 * world, H, D)] * 3, seed=31)
    q, k, v = (x[:, :4] for x in (q, k, v))
    attn = _plain(strategy)
    failures = []
    start = time.perf_counter()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q)) if rank == 0 else q
        try:
            out = attn(dual, k, v)
            failures.append(f"{strategy} forward AD ran: tangent {fwAD.unpack_dual(out).tangent}")
        except (NotImplementedError, ValueError) as error:
            if "forward-mode" not in str(error):
                failures.append(f"{strategy} forward AD: unclear error {error}")
    seconds = time.perf_counter() - start
    if seconds > 10:
        failures.append(f"{strategy} forward AD on rank 0 alone: raised after {seconds:.1f} s")
    try:
        _, tangent = torch.func.jvp(lambda x: attn(x, k, v), (q,), (torch.ones_like(q),))
        failures.append(f"{strategy} torch.func.jvp ran: |tangent| {float(tangent.abs().max())}")
    except NotImplementedError as error:
        if "forward-mode" not in str(error):
            failures.append(f"{strategy} jvp: unclear error {error}")
    return failures


def run_world(offset: int) -> list[str]:
    """Every case of this world size on this rank: its failures (``offset`` turns which
    strategy and entry point each graph gets)."""
    world = dist.get_world_size()
    entries = ("spa", "module", "flash", "joint")
    failures: list[str] = []

    def run(case: Callable[..., list[str]], *args: Any) -> None:
        try:
            failures.extend(case(*args))
        except Exception as error:  # every case is run; the same on every rank
            failures.append(f"{case.__name__}{args} raised {type(error).__name__}: {error}")

    for i, graph in enumerate(GRAPHS):
        strategy = STRATEGIES[(i + offset) % len(STRATEGIES)]
        entry = entries[(i + offset) % len(entries)]
        layout = "contiguous" if entry == "joint" or (i + offset) % 3 == 0 else "zigzag"
        run(graph_case, graph, entry, strategy, layout)
    if world > 1:
        run(joint_replicated_case)
    for strategy in (*STRATEGIES, "auto")[offset % 2 :: 2]:
        run(modes_case, strategy)
    run(autocast_case, STRATEGIES[offset % len(STRATEGIES)])
    run(forward_ad_case, STRATEGIES[(offset + 1) % len(STRATEGIES)])
    return failures


def _assert_clean(per_rank: list[list[str]]) -> None:
    bad = [f"rank {rank}: {f}" for rank, failures in enumerate(per_rank) for f in failures]
    assert not bad, f"{len(bad)} failures:\n" + "\n".join(bad[:40])


def test_autograd_on_one_rank(single_rank_group: None) -> None:
    _assert_clean([run_world(offset=0)])


@pytest.mark.parametrize("world_size", [2, 3])
def test_autograd_on_two_and_three_ranks(world_size: int) -> None:
    _assert_clean(tokenring.launch(run_world, world_size, world_size=world_size, timeout_s=300))


def test_zero_batch_names_q(single_rank_group: None) -> None:
    """A batch of 0 raises naming q's batch dim (it said "batch and head_dim")."""
    q, k, v = (torch.zeros(0, 4, H, D, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match=r"q\.shape\[0\] \(batch\)"):
        tokenring.sequence_parallel_attn(q, k, v)
