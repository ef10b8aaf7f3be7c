"""The peers benchmark (benchmarks/peers.py): its CPU stand-in for flash-attn's private kernel
entry points against the float64 oracle, and, when ring-flash-attn is installed (the
``peers`` extra), one small run of the whole benchmark."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from oracle import oracle_with_grads
from tokenring.model.netlab import lab_unavailable_reason

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import flash_attn_cpu  # noqa: E402  (benchmarks/)


def _inputs(sq: int, sk: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(2, sq, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, sk, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("sq", "sk", "causal"), [(40, 40, True), (40, 40, False), (24, 56, False)])
def test_stand_in_matches_the_oracle(dtype: torch.dtype, sq: int, sk: int, causal: bool) -> None:
    q, k, v, do = _inputs(sq, sk, dtype, seed=sq + sk + causal)
    scale = 0.3
    want = oracle_with_grads(q, k, v, do, causal=causal, scale=scale, dtype=dtype)
    x = [t.to(dtype) for t in (q, k, v, do)]
    out, lse, s_dmask, rng = flash_attn_cpu._flash_attn_forward(
        x[0], x[1], x[2], 0.0, scale, causal, -1, -1, 0.0, None, False
    )
    assert (s_dmask, rng) == (None, None)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 3, sq)  # flash-attn's layout
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    dq, dk, dv = (torch.full(t.shape, float("nan"), dtype=dtype) for t in x[:3])
    softmax_d = flash_attn_cpu._flash_attn_backward(
        x[3], x[0], x[1], x[2], out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None
    )
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    if dtype == torch.float64:  # a schedule or layout bug shows as ~0.1
        for name, value in got.items():
            assert (value.double() - want[name]).abs().max().item() < 1e-10, name
    else:
        for name, value in got.items():
            torch.testing.assert_close(value, want[name].to(value.dtype), msg=name)
    delta = (want["out"] * x[3].double()).sum(-1).transpose(1, 2)  # (B, H, sq)
    torch.testing.assert_close(softmax_d.double(), delta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dropout_p": 0.1}, "dropout_p must be 0"),
        ({"window_size_left": 8}, r"window_size must be \(-1, -1\)"),
        ({"softcap": 1.0}, "softcap must be 0"),
        ({"alibi_slopes": torch.zeros(3)}, "alibi_slopes must be None"),
        ({"causal": True, "sk": 24}, "causal=True needs equal query and key lengths"),
    ],
)
def test_stand_in_refuses_what_it_does_not_serve(change: dict, match: str) -> None:
    sk = change.pop("sk", 16)
    q, k, v, _ = _inputs(16, sk, torch.float32, seed=0)
    args = {"dropout_p": 0.0, "softmax_scale": 0.25, "causal": False, **change}
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_cpu._flash_attn_forward(q.float(), k.float(), v.float(), **args)
    with pytest.raises(NotImplementedError, match="varlen"):
        flash_attn_cpu._flash_attn_varlen_forward(q)


needs_peer = pytest.mark.skipif(
    importlib.util.find_spec("ring_flash_attn") is None,
    reason="ring-flash-attn is not installed (pip install --no-deps ring-flash-attn, or the "
    "'peers' extra)",
)


@needs_peer
def test_peers_benchmark_checks_every_row(tmp_path) -> None:
    """One small run: our rows match float64, ring-flash-attn's forward does, and the rows
    carry what the table prints (its fp32 gradients are reported as they are)."""
    import json

    import peers

    out = tmp_path / "rows.jsonl"
    argv = [
        "--world-size", "2", "--seq", "64", "--heads", "2", "--head-dim", "16",
        "--dtypes", "float32", "--warmup", "0", "--iters", "1", "--timeout", "240",
        "--one-process-threads", "1", "--out", str(out),
    ]  # fmt: skip
    assert peers.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {(r["impl"], r["pass"]) for r in rows}
    for impl in [*peers.OURS, peers.PEER, peers.ONE_PROCESS]:
        assert {(impl, "fwd"), (impl, "fwd+bwd")} <= kinds, impl
    for r in rows:
        if r["impl"] in peers.OURS:
            assert r["ok"] is True, r
        if r["impl"] == peers.PEER:
            assert r["max_error"]["out"] <= peers.TOLERANCE["float32"], r
        assert r["median_ms"] > 0


_NO_LAB = lab_unavailable_reason()


@needs_peer
@pytest.mark.skipif(_NO_LAB is not None, reason=_NO_LAB or "")
def test_peers_benchmark_runs_inside_the_lab(tmp_path) -> None:
    """``--link``: the ranks run inside the emulated-interconnect lab (tokenring's messages on
    gloo's sockets over the emulated links, not shared memory), every row of ours and the
    peer's forward still match float64, and the rows name the lab."""
    import json

    import peers

    out = tmp_path / "rows.jsonl"
    argv = [
        "--world-size", "2", "--seq", "64", "--heads", "2", "--head-dim", "16",
        "--dtypes", "float32", "--warmup", "0", "--iters", "1", "--timeout", "240",
        "--one-process-threads", "1", "--link", "20mbit", "--out", str(out),
    ]  # fmt: skip
    assert peers.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for r in rows:
        assert r["settings"]["lab"]["rate_bits_per_s"] == 20e6, r["settings"]
        assert r["settings"]["comm_path"] == "gloo", r["settings"]
        if r["impl"] in peers.OURS:
            assert r["ok"] is True, r
        if r["impl"] == peers.PEER:
            assert r["max_error"]["out"] <= peers.TOLERANCE["float32"], r


def shims_beside_the_originals() -> list[str]:
    """On each rank: ring-flash-attention's own ring_flash_attn_func and
    zigzag_ring_flash_attn_func (on the CPU stand-in) and tokenring.compat's, called alike
    with ``return_attn_probs=True``; what differs in the returns' form or values. Forward
    only: on float32 the originals' backward keeps writing the kernel's gradient buffers
    into its sums (``dq = dq_buffer.to(torch.float32)`` does not copy; dk, dv alike), so
    their gradients are off; test_compat.py checks ours against float64."""
    import importlib

    import torch.distributed as dist

    from oracle import make_inputs, sharded_positions
    from tokenring import compat

    rank, world = dist.get_rank(), dist.get_world_size()
    flash_attn_cpu.load_ring_flash_attn()
    failures = []
    for name, layout in (
        ("ring_flash_attn_func", "contiguous"),
        ("zigzag_ring_flash_attn_func", "zigzag"),  # the original refuses causal=False
    ):
        module = importlib.import_module(f"ring_flash_attn.{name.removesuffix('_func')}")
        q, k, v, _ = make_inputs(
            seed=7, batch=2, seq_global=8 * world, heads_q=2, heads_kv=2, head_dim=16
        )
        idx = torch.tensor(sharded_positions(layout, rank, world, 8 * world))
        local = [x[:, idx].float() for x in (q, k, v)]
        # dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
        # return_attn_probs, group: positionally, as the original's users may
        args = (0.0, 0.3, True, (-1, -1), None, False, True, None)
        theirs = getattr(module, name)(*local, *args)
        ours = getattr(compat, name)(*local, *args)
        if not isinstance(ours, tuple) or len(ours) != len(theirs) or ours[2] is not theirs[2]:
            failures.append(f"{name}: returns {type(ours).__name__}, the original {theirs!r}")
            continue
        for what, a, b in zip(("out", "softmax_lse"), ours[:2], theirs[:2], strict=True):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                failures.append(f"{name}: {what} {a.shape} {a.dtype}, original {b.shape} {b.dtype}")
            else:
                err = (a - b).abs().max().item()
                if err > 2e-6:
                    failures.append(f"{name} rank {rank}: {what} differs by {err:.3g}")
    return failures


@needs_peer
def test_shims_return_what_the_originals_return() -> None:
    """The form (out, softmax_lse (B, H, s) float32, None) and values of ring-flash-attention's
    own functions, on 2 gloo ranks."""
    from tokenring import launch

    per_rank = launch(shims_beside_the_originals, world_size=2, timeout_s=120)
    failures = [f for fails in per_rank for f in fails]
    assert not failures, "\n".join(failures)
