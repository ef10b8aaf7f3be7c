"""Achieved rate of the block kernels: TFLOP/s per dtype, forward and backward, on a full block
and on a causal diagonal block, with the kernel ``tokenring`` selects for the device.

FLOPs are counted as the cost model counts them (``tokenring.core.schedule.piece_flops``): 4 * B *
Hq * D per visible (query, key) pair forward, 2.5x that backward. Each rate is the median of
``--iters`` timed calls after ``--warmup``; CUDA calls are timed with CUDA events.

    python benchmarks/kernel_rates.py --device cuda --out rates.json --preset h200-nvswitch

``--preset NAME`` also writes the record where ``tokenring.model.costmodel`` reads the rates of that
preset (``src/tokenring/kernel_rates/NAME.json``).

Legend: B batch, s rows of the block, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from tokenring.model.costmodel import KERNEL_RATES_DIR, PRESETS, load_kernel_rates
from tokenring.runtime.kernels import accumulation_dtype, select_kernel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_s(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    *,
    device: torch.device,
    dtype: torch.dtype,
    seq: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    causal: bool,
    warmup: int,
    iters: int,
) -> dict[str, object]:
    """Forward and backward TFLOP/s of one ``(1, seq, H, D)`` block and the operators run."""
    kernel = select_kernel(device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(1, seq, heads, head_dim, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = randn(heads_q), randn(heads_kv), randn(heads_kv), randn(heads_q)
    scale = head_dim**-0.5
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2).contiguous()
    acc = accumulation_dtype(dtype)
    grads = tuple(torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
    kernel.ran.clear()
    fwd_s = _median_s(
        lambda: kernel.forward(q, k, v, causal=causal, scale=scale), device, warmup, iters
    )
    bwd_s = _median_s(
        lambda: kernel.backward_into(grads, dout, q, k, v, lse, delta, causal=causal, scale=scale),
        device,
        warmup,
        iters,
    )
    pairs = seq * (seq + 1) / 2 if causal else seq * seq
    forward_flops = 4.0 * heads_q * head_dim * pairs
    return {
        "forward_tflops": forward_flops / fwd_s / 1e12,
        "backward_tflops": 2.5 * forward_flops / bwd_s / 1e12,
        "forward_ms": 1e3 * fwd_s,
        "backward_ms": 1e3 * bwd_s,
        "kernel": kernel.name,
        "operators": sorted(kernel.ran),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--seq", type=int, default=8192, help="rows of the block (s)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", required=True, help="write the JSON record here")
    parser.add_argument("--preset", help="also write it where this cost-model preset reads it")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.preset is not None and args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)}; got {args.preset!r}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    for name in dtypes:
        if name not in _DTYPES:
            raise SystemExit(f"--dtypes must name {sorted(_DTYPES)}; got {name!r}")
    device = torch.device(args.device)
    rates: dict[str, dict[str, object]] = {}
    for name in dtypes:
        rates[name] = {
            block: measure(
                device=device,
                dtype=_DTYPES[name],
                seq=args.seq,
                heads_q=args.heads,
                heads_kv=args.kv_heads,
                head_dim=args.head_dim,
                causal=block == "causal",
                warmup=args.warmup,
                iters=args.iters,
            )
            for block in ("full", "causal")
        }
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {
            "batch": 1,
            "seq": args.seq,
            "heads_q": args.heads,
            "heads_kv": args.kv_heads,
            "head_dim": args.head_dim,
        },
        "command": "python benchmarks/kernel_rates.py " + " ".join(argv or sys.argv[1:]),
        "rates": rates,
    }
    paths = [args.out]
    if args.preset is not None:
        paths.append(str(KERNEL_RATES_DIR / f"{args.preset}.json"))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        load_kernel_rates(path)  # what the cost model will read
    for name, blocks in rates.items():
        for block, r in blocks.items():
            print(
                f"kernel rate {name:<9} {block:<6} fwd {r['forward_tflops']:9.4g} TFLOP/s  "
                f"bwd {r['backward_tflops']:9.4g} TFLOP/s  ({r['kernel']}: "
                f"{', '.join(r['operators'])})"  # type: ignore[arg-type]
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
