"""Predictions and picks of the cached-inference cost model on a fixed grid, and on the
committed inference measurements (``benchmarks/results/inference_*.jsonl``), as JSON.

Run it before and after a change of the model and compare the two files::

    python benchmarks/cached_predictions.py --out before.json            # on the old tree
    python benchmarks/cached_predictions.py --out after.json --compare before.json

Legend: P world size, B sequences, C cached and T new tokens per sequence.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import pathlib
import sys
from dataclasses import replace
from typing import Any

from tokenring.cli.models import BENCH_MODELS
from tokenring.model.costmodel import measured, preset
from tokenring.model.planner import choose_cached_strategy
from tokenring.strategies.cached import uniform_shards

RESULTS = pathlib.Path(__file__).parent / "results"


def _test_hardware(**over: float) -> Any:  # tests/test_inference.py's _hardware
    rates: dict[str, Any] = {
        "forward_flops_per_s": 1e10,
        "backward_flops_per_s": 1e10,
        "link_bandwidth_bytes_per_s": 1e9,
        "memory_bandwidth_bytes_per_s": 1e10,
        "latency_s": 1e-5,
    }
    rates.update(over)
    return measured(dtype="bfloat16", **rates)


def _hardwares() -> dict[str, Any]:
    test = _test_hardware()
    return {
        "test": test,
        "test-slow-latency": _test_hardware(
            forward_flops_per_s=1e30,
            memory_bandwidth_bytes_per_s=1e30,
            latency_s=1e-3,
            link_bandwidth_bytes_per_s=1e12,
        ),
        "test-switch": replace(
            test,
            interconnect=replace(
                test.interconnect, topology="switch", port_bandwidth_bytes_per_s=1e9
            ),
        ),
        "test-call-100us": replace(test, kernel_call_s=1e-4),
        "a10-pcie": preset("a10-pcie"),
        "h100-nvswitch": preset("h100-nvswitch"),
        "h100-ib-islands": preset("h100-ib-islands"),
    }


def _grid() -> list[dict[str, Any]]:
    rows = []
    hardwares = _hardwares()
    shapes = {
        **{name: (s.heads_q, s.heads_kv, s.head_dim) for name, s in BENCH_MODELS.items()},
        "llama3-8b": (32, 8, 128),
    }
    cases = [  # (mode, batch, cached, new, block)
        ("decode", 1, 4096, 1, 64),
        ("decode", 4, 4096, 1, 64),
        ("decode", 1, 4096, 16, 1024),
        ("decode", 1, 32768, 4, 1024),
        ("prefill", 1, 4096, 256, 64),
        ("prefill", 1, 1024, 1024, 64),
        ("prefill", 2, 13, 9, 4),
        ("prefill", 1, 0, 4096, 64),
    ]
    for (hw_name, hw), (shape_name, (hq, hkv, d)), world, case in itertools.product(
        hardwares.items(), shapes.items(), (2, 3, 4, 8), cases
    ):
        mode, batch, cached, new, block = case
        if hw_name == "h100-ib-islands" and world < 8:
            continue
        shards = uniform_shards(
            world_size=world, batch=batch, cached=cached, new=new, block_size=block
        )
        dims = {"heads_q": hq, "heads_kv": hkv, "head_dim": d, "dtype": "bfloat16"}
        choice = _choose(shards, **dims, hardware=hw)
        rows.append(
            {
                "hardware": hw_name,
                "shape": shape_name,
                "world_size": world,
                "mode": mode,
                "batch": batch,
                "cached": cached,
                "new": new,
                "block_size": block,
                "total_s": {p.strategy.value: p.total_s for p in choice.predictions},
                "pick": choice.pick.value,
            }
        )
    return rows


def _choose(shards: Any, **kwargs: Any) -> Any:
    """``choose_cached_strategy``, charging the hardware's kernel call cost (the round model
    took it as an argument)."""
    if "kernel_call_s" in inspect.signature(choose_cached_strategy).parameters:
        kwargs["kernel_call_s"] = kwargs["hardware"].kernel_call_s
    return choose_cached_strategy(shards, **kwargs)


def _heads(model: str) -> tuple[int, int, int]:
    """(Hq, Hkv, D) of a row's model label: a BENCH_MODELS name or ``Hq:Hkv x D``."""
    if model in BENCH_MODELS:
        shape = BENCH_MODELS[model]
        return shape.heads_q, shape.heads_kv, shape.head_dim
    heads, d = model.split("x")
    hq, hkv = heads.split(":")
    return int(hq), int(hkv), int(d)


def _measured() -> list[dict[str, Any]]:
    """Every committed measurement group (a model, C and T of one file): the model's
    prediction and pick on the run's own calibration, beside the measured times."""
    groups: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    for path in sorted(RESULTS.glob("inference_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            cal = row["calibration"]
            hw = measured(
                forward_flops_per_s=cal["forward_flops_per_s"],
                backward_flops_per_s=cal["forward_flops_per_s"],
                link_bandwidth_bytes_per_s=cal["link_bytes_per_s"],
                memory_bandwidth_bytes_per_s=cal["memory_bytes_per_s"],
                dtype=row["dtype"],
                topology=cal["topology"],
                port_bandwidth_bytes_per_s=(  # calibrate's 2 x two-way rate is not recorded
                    cal["link_bytes_per_s"] if cal["topology"] == "switch" else None
                ),
                latency_s=cal["latency_s"],
                kernel_call_s=cal["kernel_call_s"],
            )
            hq, hkv, d = _heads(row["model"])
            key = (path.name, row["model"], row["cached"], row["new"])
            if key not in groups:
                shards = uniform_shards(
                    world_size=row["world_size"],
                    batch=row["batch"],
                    cached=row["cached"],
                    new=row["new"],
                    block_size=row["block_size"],
                )
                choice = _choose(
                    shards,
                    heads_q=hq,
                    heads_kv=hkv,
                    head_dim=d,
                    dtype=row["dtype"],
                    hardware=hw,
                )
                groups[key] = {
                    "file": path.name,
                    "model": row["model"],
                    "cached": row["cached"],
                    "new": row["new"],
                    "measured_ms": {},
                    "recorded_model_ms": {},
                    "total_s": {p.strategy.value: p.total_s for p in choice.predictions},
                    "pick": choice.pick.value,
                }
            groups[key]["measured_ms"][row["strategy"]] = row["ms_median"]
            groups[key]["recorded_model_ms"][row["strategy"]] = row["model_ms"]
    for group in groups.values():
        fastest = min(group["measured_ms"], key=group["measured_ms"].get)
        group["fastest"] = fastest
        group["pick_ms_over_fastest"] = (
            group["measured_ms"][group["pick"]] / group["measured_ms"][fastest]
        )
    return list(groups.values())


def _compare(before: dict[str, Any], after: dict[str, Any]) -> None:
    for part in ("grid", "measured"):
        worst = (0.0, None, None)
        changed = []
        for old, new in zip(before[part], after[part], strict=True):
            for strategy, old_s in old["total_s"].items():
                rel = abs(new["total_s"][strategy] - old_s) / old_s if old_s else 0.0
                if rel > worst[0]:
                    worst = (rel, strategy, old)
            if old["pick"] != new["pick"]:
                changed.append((old, new))
        rel, strategy, where = worst
        label = {k: v for k, v in (where or {}).items() if k not in ("total_s", "pick")}
        print(f"{part}: {len(before[part])} cases; max relative difference {rel:.3f}")
        print(f"  at {strategy} {label}")
        print(f"  picks changed: {len(changed)}")
        for old, new in changed:
            case = {k: v for k, v in old.items() if k not in ("total_s", "pick")}
            ms = {
                s: f"{1e3 * old['total_s'][s]:.4g}->{1e3 * new['total_s'][s]:.4g}"
                for s in old["total_s"]
            }
            print(f"  {old['pick']} -> {new['pick']}: {case} ms {ms}")
    for label, data in (("before", before), ("after", after)):
        slow = [g["pick_ms_over_fastest"] for g in data["measured"]]
        hits = sum(x <= 1.1 for x in slow)
        print(
            f"measured ({label}): pick within 10% of the fastest in {hits}/{len(slow)} groups; "
            f"mean measured pick/fastest {sum(slow) / len(slow):.3f}, worst {max(slow):.3f}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None)
    args = parser.parse_args(argv)
    data = {"grid": _grid(), "measured": _measured()}
    parts = (
        f'"{part}": [\n' + ",\n".join(json.dumps(row) for row in data[part]) + "\n]"
        for part in ("grid", "measured")
    )
    pathlib.Path(args.out).write_text("{\n" + ",\n".join(parts) + "\n}\n")  # a case a line
    if args.compare is not None:
        _compare(json.loads(pathlib.Path(args.compare).read_text()), data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
