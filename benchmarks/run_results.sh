#!/usr/bin/env bash
# Regenerates the committed results in benchmarks/results/ (needs root + iproute2 for the lab).
set -euo pipefail
cd "$(dirname "$0")/results"
rm -f lab_mesh_100mbit_mha.jsonl lab_mesh_100mbit_gqa.jsonl no_emulation.jsonl
tokenring bench --link 100mbit --topology mesh --seq 2048 --causal yes --heads 8 --kv-heads 8 --iters 5 \
  --out lab_mesh_100mbit_mha.jsonl --markdown lab_mesh_100mbit_mha.md --plot lab_mesh_100mbit_mha.png
tokenring bench --link 100mbit --topology mesh --seq 2048 --causal yes --heads 8 --kv-heads 2 --iters 5 \
  --out lab_mesh_100mbit_gqa.jsonl --markdown lab_mesh_100mbit_gqa.md --plot lab_mesh_100mbit_gqa.png
tokenring bench --seq 2048 --iters 5 --out no_emulation.jsonl --markdown no_emulation.md --plot no_emulation.png
