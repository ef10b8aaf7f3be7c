"""The device checks of ``scripts/device_check.sh``: every kernel, dtype and mask class against
float64, forward and backward, on the device; every strategy at P = 2 and 4 on the one device
(CUDA tensors over gloo through host buffers: Note [Staged path] in tokenring.runtime.comm).

Marked ``gpu``: they run on CUDA when it is there, or on the device named by
``TOKENRING_TEST_DEVICE`` (``cpu``: the same checks, small, for CI; ``TOKENRING_QUICK=1``
trims the grid).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tokenring
from oracle import DTYPES, make_inputs, oracle_with_grads, sharded_positions, tolerance_failures
from oracle import visible_mask as oracle_mask
from test_kernels import _MASK_CASES, _case, _float64_block, _inputs
from tokenring.runtime.kernels import CpuFlashKernel, CudaFusedKernel, accumulation_dtype

DEVICE = os.environ.get("TOKENRING_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
QUICK = os.environ.get("TOKENRING_QUICK") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not DEVICE, reason="needs CUDA (or TOKENRING_TEST_DEVICE=cpu)"),
]


def _device_kernel(flex: bool = False) -> tokenring.runtime.kernels.BlockKernel:
    """The device's kernel with small tiles, so every tile class occurs in a 300-row block."""
    if DEVICE == "cuda":
        return CudaFusedKernel(tile_rows=128, masked_tile_rows=64, flex=flex)
    return CpuFlashKernel(tile_rows=128)


@pytest.mark.parametrize("flex", [False, True] if DEVICE == "cuda" else [False])
def test_kernel_every_dtype_and_mask_class(flex: bool) -> None:
    """Forward and backward of the device's kernel against float64 autograd by the tolerance
    rule: bf16/fp16 within twice the error of plain attention in that dtype (SDPA's math on
    the CPU) plus one rounding step; float32 ``assert_close`` defaults; float64 1e-10."""
    failures = []
    ran: set[str] = set()
    # FlexAttention compiles per dtype: two of them say whether it works, in less time
    dtypes = ["float32", "bfloat16"] if QUICK or flex else list(DTYPES)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for case in _MASK_CASES:
            kernel = _device_kernel(flex)
            causal, mask, visible = _case(*case, sq=300, sk=300)
            q, k, v, do = _inputs(300, 300, 4, 2, dtype, seed=11)
            want_out, want_lse, want_grads = _float64_block(
                q, k, v, do, causal=causal, scale=0.25, visible=visible
            )
            acc = accumulation_dtype(dtype)
            dev = [x.to(DEVICE) for x in (q, k, v, do)]
            delta = (do.double() * want_out).sum(-1).transpose(1, 2).to(acc)
            out, lse = kernel.forward(*dev[:3], causal=causal, scale=0.25, mask=mask)
            grads = kernel.backward(
                dev[3],
                *dev[:3],
                want_lse.to(acc).to(DEVICE),
                delta.to(DEVICE),
                causal=causal,
                scale=0.25,
                mask=mask,
            )
            ran |= set(kernel.ran)
            got = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
            want = {"out": want_out, "dq": want_grads[0], "dk": want_grads[1], "dv": want_grads[2]}
            seen = torch.isfinite(want_lse)
            lse_err = (lse.double().cpu()[seen] - want_lse[seen]).abs().max().item()
            if lse_err > (1e-10 if dtype == torch.float64 else 1e-3):
                failures.append(f"{dtype_name} {case[0]} lse: {lse_err:.3g}")
            for name, x in got.items():
                err = (x.double().cpu() - want[name]).abs().max().item()
                if dtype == torch.float64:
                    bound = 1e-10
                elif dtype == torch.float32:
                    bound = 1e-5 + 1.3e-6 * want[name].abs().max().item()  # assert_close's
                else:
                    plain = _plain_error(q, k, v, do, want, name, dtype, causal, visible)
                    bound = 2 * plain + torch.finfo(dtype).eps * want[name].abs().max().item()
                if x.dtype != dtype or not err <= bound:
                    failures.append(f"{dtype_name} {case[0]} {name}: {err:.3g} > {bound:.3g}")
    print(f"operators that ran (flex={flex}): {sorted(ran)}")
    assert not failures, "\n".join(failures)


def _plain_error(q, k, v, do, want, name, dtype, causal, visible) -> float:
    """Max error of plain attention in ``dtype`` (SDPA's math on the CPU) against float64."""
    groups = q.shape[2] // k.shape[2]
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    qh = leaves[0].transpose(1, 2)
    kh = leaves[1].transpose(1, 2).repeat_interleave(groups, 1)
    vh = leaves[2].transpose(1, 2).repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=visible, is_causal=causal, scale=0.25
    ).transpose(1, 2)
    out.backward(do)
    got = {"out": out, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    x = got[name].double().nan_to_num(0.0)  # rows that see nothing: SDPA gives NaN
    return (x - want[name]).abs().max().item()


# (layout, causal, window, cu_seqlens as fractions of S) of the strategy checks
_CONFIGS = [
    ("zigzag", True, (-1, -1), None),
    ("contiguous", False, (-1, -1), None),
    ("contiguous", True, (12, 0), None),
    ("zigzag", True, (-1, -1), (0.0, 0.4, 1.0)),
]


def _strategies_rank(device_name: str, dtype_names: list[str], quick: bool) -> dict[str, Any]:
    """Every strategy, fwd + bwd, against the oracle on this rank (on ``device_name``)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU: the staged path
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = tokenring.get_communicator()
    failures = []
    seq = 24 * world
    configs = _CONFIGS[::3] if quick else _CONFIGS
    for strategy in ("token_ring", "ring", "bidir_ring", "ulysses", "allgather_kv"):
        for layout, causal, window, fractions in configs:
            cu = None if fractions is None else [round(f * seq) for f in fractions]
            mask = None
            if cu is not None or window != (-1, -1):
                mask = oracle_mask(seq, causal=causal, cu_seqlens=cu, window=window)
            for dtype_name in dtype_names:
                dtype = DTYPES[dtype_name]
                q, k, v, dout = make_inputs(
                    seed=5, batch=1, seq_global=seq, heads_q=4, heads_kv=2, head_dim=16
                )
                scale = 16**-0.5
                ref = oracle_with_grads(
                    q, k, v, dout, causal=causal, scale=scale, dtype=dtype, mask=mask
                )
                idx = torch.tensor(sharded_positions(layout, rank, world, seq, cu))
                local = [x[:, idx].to(dtype).to(device).requires_grad_(True) for x in (q, k, v)]
                out, lse = tokenring.sequence_parallel_attn(
                    *local,
                    strategy=strategy,
                    causal=causal,
                    layout=layout,
                    return_lse=True,
                    seq_len=seq,
                    cu_seqlens=cu,
                    window_size=window if window != (-1, -1) else None,
                )
                out.backward(dout[:, idx].to(dtype).to(device))
                got = {
                    "out": out.detach().cpu(),
                    "lse": lse.cpu(),
                    "dq": local[0].grad.cpu(),
                    "dk": local[1].grad.cpu(),
                    "dv": local[2].grad.cpu(),
                }
                want = {
                    "out": ref["out"][:, idx],
                    "lse": ref["lse"][:, :, idx],
                    "dq": ref["dq"][:, idx],
                    "dk": ref["dk"][:, idx],
                    "dv": ref["dv"][:, idx],
                }
                got["lse"] = got["lse"].masked_fill(~torch.isfinite(want["lse"]), 0.0)
                want["lse"] = want["lse"].nan_to_num(0.0, neginf=0.0)
                failures += [
                    f"rank {rank} {strategy} {layout} causal={causal} {window} docs={cu} "
                    f"{dtype_name}: {f}"
                    for f in tolerance_failures(
                        got,
                        want,
                        dtype=dtype,
                        inputs=(q, k, v, dout),
                        reference=ref,
                        causal=causal,
                        scale=scale,
                        mask=mask,
                    )
                ]
    return {"path": comm.path(device), "failures": failures}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_on_one_device(world_size: int) -> None:
    dtype_names = ["float32", "bfloat16"] if QUICK else list(DTYPES)
    per_rank = tokenring.launch(
        _strategies_rank,
        DEVICE,
        dtype_names,
        QUICK,
        world_size=world_size,
        timeout_s=600,
        pg_timeout_s=120,
    )
    paths = {r["path"] for r in per_rank}
    print(f"P={world_size}: path {sorted(paths)}")
    assert paths == {"gloo-staged" if DEVICE == "cuda" else "gloo-shm"}
    failures = [f for r in per_rank for f in r["failures"]]
    assert not failures, "\n".join(failures[:40])
