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
matmuls in bfloat16 for float32 inputs). The entry points that run attention outside the
training operator get autocast, forward-mode AD, no_grad and inference_mode too: hybrid_attn,
cached_attn (every cached strategy), cross_attn, joint_attn and the llama3 shim.

Oracle: float64 autograd of plain attention (``oracle.full_attention``) over the same graph
built on the whole sequence; every rank's leaves are the global tensors, so the sum of the
ranks' leaf gradients is the gradient (1e-10 in float64). The cases of one world size run in
one launch.

Legend: B batch, S global seq, s local seq, T text tokens, H heads, D head dim, P world size.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

import tokenring
from oracle import full_attention, sharded_positions, visible_mask
from test_random_calls import _hardware
from tokenring import compat, diffusers
from tokenring.hybrid import hybrid_attn, hybrid_mesh, hybrid_positions
from tokenring.inference import cached_attn
from tokenring.kvcache import DistributedKVCache

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


# -- the entry points beside the training operator -------------------------------------------


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """float32 against the float64 oracle: assert_close's float32 tolerance (bfloat16 matmuls
    are 1e-2 off), and in float32."""
    if got.dtype != torch.float32:
        return [f"{what}: came back as {got.dtype}, not float32"]
    try:
        torch.testing.assert_close(got, want.float())
    except AssertionError as error:
        return [f"{what}: {str(error).splitlines()[0]} (max {_off([got], [want.float()]):.2g})"]
    return []


def _refused_everywhere(
    what: str, call: Callable[..., Any], q: torch.Tensor, *rest: torch.Tensor
) -> list[str]:
    """Forward-mode AD: ``call(q, *rest)`` with a dual q on rank 0 alone must raise on every
    rank at once, naming forward mode: NotImplementedError on rank 0, the peers learn it."""
    rank = dist.get_rank()
    start = time.perf_counter()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q)) if rank == 0 else q
        try:
            out = call(dual, *rest)
            tangent = fwAD.unpack_dual(out if isinstance(out, torch.Tensor) else out[0]).tangent
            return [f"{what}: a dual input on rank 0 ran (tangent {tangent})"]
        except (NotImplementedError, ValueError) as error:
            wanted = NotImplementedError if rank == 0 else (NotImplementedError, ValueError)
            if not isinstance(error, wanted) or "forward-mode" not in str(error):
                return [f"{what}: unclear error {type(error).__name__}: {error}"]
    seconds = time.perf_counter() - start
    return [f"{what}: raised after {seconds:.1f} s"] if seconds > 10 else []


def _jvp_refused(
    what: str, call: Callable[..., Any], q: torch.Tensor, *rest: torch.Tensor
) -> list[str]:
    """torch.func.jvp in q on every rank raises NotImplementedError naming forward mode (it
    raised 'Cannot access data pointer', or a tangent of nothing came back)."""
    try:
        _, tangent = torch.func.jvp(lambda x: call(x, *rest), (q,), (torch.ones_like(q),))
        return [f"{what}: torch.func.jvp ran (|tangent| {float(tangent.abs().max())})"]
    except Exception as error:
        if not isinstance(error, NotImplementedError) or "forward-mode" not in str(error):
            return [f"{what}: torch.func.jvp: {type(error).__name__}: {str(error)[:200]}"]
    return []


def hybrid_case() -> list[str]:
    """hybrid_attn (its own autograd.Function and runner) on a (P, 1) mesh, and (1, 2) on two
    ranks: float32 under autocast with the reference and tiled kernels (out 1e-2 off float64
    attention on one rank; on two, the partials failed the header check: 136 payload bytes
    where 144 were expected), gradients too; forward-mode AD refused (it gave torch's "You must
    implement the jvp function" on the dual ranks alone, and under torch.func.jvp "Cannot access
    data pointer"); no_grad and inference_mode."""
    world = dist.get_world_size()
    seq_len, heads = 4 * world, 2
    values = _seeded([(B, seq_len, heads, 8)] * 4, seed=41)
    ref = [x.clone().requires_grad_(True) for x in values[:3]]
    ref_out, _ = full_attention(*ref, causal=True, scale=8**-0.5)
    want = torch.autograd.grad((ref_out * values[3]).sum(), ref)
    failures = []
    for outer, inner in [(world, 1)] + ([(1, 2)] if world == 2 else []):
        mesh = hybrid_mesh(outer, inner)
        pos = hybrid_positions(
            outer_rank=dist.get_rank(mesh.outer),
            inner_rank=dist.get_rank(mesh.inner),
            outer=outer,
            inner=inner,
            layout="zigzag",
            seq_len=seq_len,
        )
        options: dict[str, Any] = {"mesh": mesh, "causal": True, "layout": "zigzag"}
        label = f"hybrid_attn {outer}x{inner}"
        for kernel in ("reference", "tiled"):
            qkv = [x[:, pos].float().requires_grad_(True) for x in values[:3]]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = hybrid_attn(*qkv, kernel=kernel, **options)
                (out * values[3][:, pos].float()).sum().backward()
            failures += _close(f"{label} {kernel} under autocast: out", out, ref_out[:, pos])
            for name, x, w in zip("qkv", qkv, want, strict=True):
                assert x.grad is not None
                failures += _close(f"{label} {kernel} under autocast: d{name}", x.grad, w[:, pos])
        q, k, v = (x[:, pos].float() for x in values[:3])
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                out = hybrid_attn(q, k, v, **options)
            failures += _close(f"{label} {mode.__name__}", out, ref_out[:, pos])
        call = functools.partial(hybrid_attn, k=k, v=v, **options)
        failures += _refused_everywhere(f"{label} forward AD", call, q)
        failures += _jvp_refused(f"{label} jvp", call, q)
    return failures


def cached_case() -> list[str]:
    """cached_attn, every strategy, on a prompt then one token: float32 under autocast with the
    reference and tiled kernels, in no_grad and in inference_mode (out 6e-3 off float64
    attention, returned as float32: the plans' kernel calls ran in bfloat16); a zigzag first
    prefill (the training ring) too. Forward-mode AD refused on every rank (it failed inside
    the plan, which left the communicator unusable for every later call); K/V of the wrong
    dtype under autocast name autocast."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_len, heads = 4 * world, 2
    q_all, k_all, v_all = _seeded([(seq_len + 1, heads, 8)] * 3, seed=43)
    ref_out, _ = full_attention(
        *(x[None] for x in (q_all, k_all, v_all)), causal=True, scale=8**-0.5
    )
    failures = []

    def new_cache(zigzag: bool = False) -> DistributedKVCache:
        return DistributedKVCache(
            num_layers=1, batch=1, heads_kv=heads, head_dim=8, block_size=2,
            zigzag_first_prefill=zigzag,
        )  # fmt: skip

    def rows(cache: DistributedKVCache, new: int) -> tuple[torch.Tensor, ...]:
        pos = cache.begin_step((new,)).positions(rank)
        return pos, *(x[pos].float() for x in (q_all, k_all, v_all))

    runs = [(s, kernel, False) for s in ("pass_q", "pass_kv", "direct", "tree")
            for kernel in ("reference", "tiled")] + [("pass_q", "tiled", True)]  # fmt: skip
    for i, (strategy, kernel, zigzag) in enumerate(runs):
        cache = new_cache(zigzag)
        mode = (torch.no_grad, torch.inference_mode)[i % 2]
        label = f"cached_attn {strategy} {kernel}{' zigzag' if zigzag else ''} {mode.__name__}"
        for new in (seq_len, 1) if zigzag else (seq_len - 1, 1):
            pos, q, k, v = rows(cache, new)
            with torch.autocast("cpu", dtype=torch.bfloat16), mode():
                out = cached_attn(q, k, v, cache=cache, layer=0, strategy=strategy, kernel=kernel)
            failures += _close(f"{label} under autocast, {new} new", out, ref_out[0, pos])
    cache = new_cache()
    pos, q, k, v = rows(cache, seq_len - 1)
    options: dict[str, Any] = {"cache": cache, "layer": 0, "strategy": "direct"}
    call = functools.partial(cached_attn, k=k, v=v, **options)
    failures += _refused_everywhere("cached_attn forward AD", call, q)
    failures += _jvp_refused("cached_attn jvp", call, q)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            cached_attn(q, k, v.bfloat16(), **options)  # a model's v under autocast
        failures.append("cached_attn bfloat16 v with a float32 cache under autocast: ran")
    except ValueError as error:
        if "v must be torch.float32" not in str(error) or "autocast" not in str(error):
            failures.append(f"cached_attn v of another dtype under autocast: {error}")
    out = cached_attn(q, k, v, **options)  # the communicator still works, the layer runs
    failures += _close("cached_attn after the refusals", out, ref_out[0, pos])
    return failures


def diffusers_case() -> list[str]:
    """cross_attn (PyTorch's attention, called itself) and joint_attn: float32 under autocast
    (cross_attn came back in bfloat16, 5e-3 off), no_grad and inference_mode; forward-mode
    AD refused on every rank (cross_attn gave the fused kernel's error on the dual rank, and
    under torch.func.jvp 'Cannot access data pointer')."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s, num_text, heads = 4, 3, 2
    q_all, k_all, v_all = _seeded([(B, s * world, heads, 8)] * 3, seed=47)
    text = _seeded([(B, num_text, heads, 8)] * 3, seed=48)
    kv_all = _seeded([(B, 5, heads, 8)] * 2, seed=49)
    mine = slice(rank * s, (rank + 1) * s)
    kv_rows = slice(min(rank, 5), min(rank + 1, 5) if rank < world - 1 else 5)  # sharded K/V
    q = q_all[:, mine].float()
    cross_ref, _ = full_attention(q_all, *kv_all, causal=False, scale=8**-0.5)
    joint_qkv = [torch.cat([t, x], dim=1) for t, x in zip(text, (q_all, k_all, v_all), strict=True)]
    joint_ref, _ = full_attention(*joint_qkv, causal=False, scale=8**-0.5)
    joint_rows = torch.cat([torch.arange(num_text), num_text + torch.arange(s * world)[mine]])
    joint_in = [
        torch.cat([t, x[:, mine]], dim=1).float()  # (B, T + s, H, D)
        for t, x in zip(text, (q_all, k_all, v_all), strict=True)
    ]
    calls: dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...], torch.Tensor]] = {
        "cross_attn replicated": (
            lambda a, b, c: diffusers.cross_attn(a, b, c, kv="replicated"),
            (q, *(x.float() for x in kv_all)),
            cross_ref[:, mine],
        ),
        "cross_attn sharded": (
            lambda a, b, c: diffusers.cross_attn(a, b, c, kv="sharded"),
            (q, *(x[:, kv_rows].float() for x in kv_all)),
            cross_ref[:, mine],
        ),
        "joint_attn replicated": (
            lambda a, b, c: diffusers.joint_attn(a, b, c, num_text=num_text, text="replicated"),
            tuple(joint_in),
            joint_ref[:, joint_rows],
        ),
    }
    failures = []
    for name, (call, args, want) in calls.items():
        leaves = [x.clone().requires_grad_(True) for x in args]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            failures += _close(f"{name} under autocast", call(*leaves), want)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                failures += _close(f"{name} {mode.__name__}", call(*args), want)
        first, *rest = args
        failures += _refused_everywhere(f"{name} forward AD", call, first, *rest)
        failures += _jvp_refused(f"{name} jvp", call, first, *rest)
    return failures


def llama3_case() -> list[str]:
    """ring-flash-attention's llama3 shim (which exchanges the documents' boundaries before
    the attention call): float32 under autocast; torch.func.jvp raised 'Cannot access data
    pointer' in that exchange, and now NotImplementedError; a dual q on rank 0 alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    s = 4
    q_all, k_all, v_all = _seeded([(s * world, H, D)] * 3, seed=53)
    cu = torch.tensor([0, 3, s * world], dtype=torch.int32)
    mask = visible_mask(s * world, causal=True, cu_seqlens=[0, 3, s * world])
    qkv = (x[None] for x in (q_all, k_all, v_all))
    ref_out, _ = full_attention(*qkv, causal=True, scale=D**-0.5, mask=mask)
    local = compat.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    mine = slice(rank * s, (rank + 1) * s)
    q, k, v = (x[mine].float() for x in (q_all, k_all, v_all))

    def call(a: torch.Tensor) -> Any:
        return compat.llama3_flash_attn_varlen_func(a, k, v, *local[:4], 1, local[4], causal=True)

    failures = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        failures += _close("llama3 shim under autocast", call(q), ref_out[0, mine])
    failures += _refused_everywhere("llama3 shim forward AD", call, q)
    failures += _jvp_refused("llama3 shim jvp", call, q)
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
    for case in (hybrid_case, cached_case, diffusers_case, llama3_case):
        run(case)
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
