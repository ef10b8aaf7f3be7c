#!/usr/bin/env bash
# Regenerates the committed results in benchmarks/results/ (needs root + iproute2 for the lab).
# Every strategy of the registry, the hybrid as 2 x 2 around TokenRing; a quiet machine please:
# the lab's links are emulated, its kernels and TCP copies share the CPU with everything else.
set -euo pipefail
cd "$(dirname "$0")/results"
rm -f lab_mesh_100mbit_mha.jsonl lab_mesh_100mbit_gqa.jsonl no_emulation.jsonl
tokenring bench --link 100mbit --topology mesh --seq 2048 --causal yes --heads 8 --kv-heads 8 --iters 5 \
  --hybrid-inner 2 --hybrid-outer token_ring \
  --out lab_mesh_100mbit_mha.jsonl --markdown lab_mesh_100mbit_mha.md --plot lab_mesh_100mbit_mha.png
tokenring bench --link 100mbit --topology mesh --seq 2048 --causal yes --heads 8 --kv-heads 2 --iters 5 \
  --hybrid-inner 2 --hybrid-outer token_ring \
  --out lab_mesh_100mbit_gqa.jsonl --markdown lab_mesh_100mbit_gqa.md --plot lab_mesh_100mbit_gqa.png
python ../summarize_lab.py lab_mesh_100mbit_mha.jsonl lab_mesh_100mbit_gqa.jsonl > lab_mesh_100mbit.md
python ../probe_collectives.py --world-sizes 2 3 4 --bytes 2097152 > gloo_collectives.md
tokenring bench --seq 2048 --iters 5 --out no_emulation.jsonl --markdown no_emulation.md --plot no_emulation.png
