"""TokenRing's last pair, lent or returned, predicted by the event simulator on several machines,
and what ``last_pair="auto"`` picks there (benchmarks/results/lab_mesh_100mbit_last_pair.md).

    PYTHONPATH=src python benchmarks/last_pair_table.py
"""

from __future__ import annotations

from tokenring.core.schedule import AttentionShape
from tokenring.model import planner
from tokenring.model.costmodel import PRESETS, measured
from tokenring.model.simulate import simulate

LAB = measured(  # the lab run's own calibration (lab_mesh_100mbit_last_pair.jsonl)
    forward_flops_per_s=12.6e9,
    backward_flops_per_s=11.5e9,
    link_bandwidth_bytes_per_s=12.1e6,
    memory_bandwidth_bytes_per_s=3.4e9,
    dtype="float32",
)
LOOPBACK = measured(
    forward_flops_per_s=9e9,
    backward_flops_per_s=9e9,
    link_bandwidth_bytes_per_s=2e9,
    memory_bandwidth_bytes_per_s=4e9,
    dtype="bfloat16",
)
CASES = [  # name, hardware, P, Hq, Hkv, D, s, dtype
    ("the lab's (12 MB/s mesh, this run's rates)", LAB, 4, 8, 8, 64, 512, "float32"),
    ("h100-nvswitch", PRESETS["h100-nvswitch"], 8, 32, 8, 128, 16384, "bfloat16"),
    ("h100-nvswitch", PRESETS["h100-nvswitch"], 8, 32, 32, 128, 4096, "bfloat16"),
    ("a10-pcie (the paper's case)", PRESETS["a10-pcie"], 4, 32, 32, 128, 6000, "float16"),
    ("CPU loopback (2 GB/s mesh)", LOOPBACK, 4, 8, 8, 64, 1024, "bfloat16"),
]


def main() -> None:
    print(
        "| hardware | P | Hq/Hkv x D | s | dtype | forward lend / return | fwd+bwd lend / return "
        "| last_pair='auto' (training) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, hw, p, hq, hkv, d, s, dtype in CASES:
        shape = AttentionShape(heads_q=hq, heads_kv=hkv, head_dim=d, dtype=dtype)
        call = dict(layout="zigzag", causal=True, world_size=p, seq_local=s)
        ratios = []
        for passes in ("forward", "both"):
            plain, lent = (
                simulate(
                    "token_ring",
                    passes=passes,
                    shape=shape,
                    hardware=hw,
                    lend_last_pair=lend,
                    **call,
                ).call_s
                for lend in (False, True)
            )
            ratios.append(lent / plain)
        lends = planner.lends_last_pair(
            **call, heads_q=hq, heads_kv=hkv, head_dim=d, dtype=dtype, training=True, hardware=hw
        )
        print(
            f"| {name} | {p} | {hq}/{hkv} x {d} | {s} | {dtype} | {ratios[0]:.2f} | "
            f"{ratios[1]:.2f} | {'lend' if lends else 'return'} |"
        )


if __name__ == "__main__":
    main()
