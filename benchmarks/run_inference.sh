#!/usr/bin/env bash
# Regenerates benchmarks/results/inference_*: cached prefill and decode with a sharded KV cache
# (tokenring bench --mode ...). The --link runs need root and iproute2 (the emulated lab).
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
tokenring bench --mode prefill-cached --world-size 4 --link 100mbit --topology mesh --cached 2048 --new 128,512,2048 --iters 5 --warmup 1 --out $R/inference_prefill_lab_mesh_100mbit.jsonl --markdown $R/inference_prefill_lab_mesh_100mbit.md
tokenring bench --mode decode --world-size 4 --link 100mbit --topology switch --cached 4096 --new 1,4,16,64,256 --block-size 1024 --heads 8 --kv-heads 2 --iters 7 --warmup 2 --out $R/inference_decode_lab_switch_100mbit.jsonl --markdown $R/inference_decode_lab_switch_100mbit.md
tokenring bench --mode decode --world-size 4 --link 100mbit --topology mesh --cached 4096 --new 1,4,16,64,256 --block-size 1024 --heads 8 --kv-heads 2 --iters 7 --warmup 2 --out $R/inference_decode_lab_mesh_100mbit.jsonl --markdown $R/inference_decode_lab_mesh_100mbit.md
tokenring bench --mode decode --world-size 4 --cached 4096 --new 1,16,128 --iters 20 --warmup 3 --out $R/inference_decode.jsonl --markdown $R/inference_decode.md
tokenring bench --mode prefill-cached --world-size 4 --cached 4096 --new 256,1024,4096 --iters 5 --warmup 1 --out $R/inference_prefill_cached.jsonl --markdown $R/inference_prefill_cached.md
