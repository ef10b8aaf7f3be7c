#!/usr/bin/env bash
# Model validation and planner hit rate on the emulated lab (needs root + iproute2):
# 4 ranks on a mesh at two link rates x two sequence lengths, MHA and GQA, causal or not,
# every strategy, forward and forward+backward. Then summarises prediction errors and the
# planner's hit rate into model_validation.md.
set -euo pipefail
cd "$(dirname "$0")/results"
rm -f validation_*.jsonl
for rate in 50mbit 100mbit; do
  for seq in 1024 2048; do
    tokenring bench --link "$rate" --topology mesh --seq "$seq" --iters 3 \
      --strategies token_ring,ring,bidir_ring \
      --out "validation_${rate}_${seq}.jsonl" --markdown "validation_${rate}_${seq}.md"
  done
done
python ../summarize_validation.py validation_*.jsonl > model_validation.md
