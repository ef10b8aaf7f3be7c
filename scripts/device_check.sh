#!/usr/bin/env bash
# One-shot device check (issue 12): at most 8 minutes on one H200.
#
#   bash scripts/device_check.sh                # CUDA: writes benchmarks/results/device_check/
#   bash scripts/device_check.sh --device cpu   # the same steps on the CPU, small (CI runs it)
#
# 1. the GPU-marked tests (tests/test_device.py): every kernel, dtype and mask class against
#    float64, forward and backward; every strategy at P = 2 and 4 on the one device (the staged
#    path on CUDA: CUDA tensors over gloo through pinned host buffers);
# 2. peak memory per rank against inputs + outputs + gradients (tokenring bench --mode memory),
#    every strategy, s = 4k..64k per rank on CUDA;
# 3. the block kernels' rates (benchmarks/kernel_rates.py): TFLOP/s per dtype, forward and
#    backward, full and causal-diagonal blocks; on an H200 also written where the cost model's
#    h200-nvswitch preset reads them (src/tokenring/model/kernel_rates/h200-nvswitch.json);
# 4. a one-screen summary (also saved as summary.txt beside the results).
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "device_check.sh: unknown argument $1 (expected --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
if [[ "$device" != cuda && "$device" != cpu ]]; then
  echo "device_check.sh: --device must be cuda or cpu; got $device" >&2; exit 2
fi
if [[ -z "$out" ]]; then
  if [[ "$device" == cuda ]]; then
    out=benchmarks/results/device_check
  else  # a CI run: nothing to keep beyond the summary printed below
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
  fi
fi
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENRING_TEST_DEVICE="$device"
status=0

if [[ "$device" == cuda ]]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "device_check.sh: --device cuda but CUDA is not available" >&2; exit 2; }
  export TOKENRING_QUICK=0
  seq_local=4096,16384,65536
  mem_dtype=bfloat16
  rates=(--seq 8192 --heads 16 --kv-heads 16 --head-dim 128 --dtypes bfloat16,float16,float32)
  preset=()
  if python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)"; then
    preset=(--preset h200-nvswitch)
  fi
else
  export TOKENRING_QUICK=1
  seq_local=512
  mem_dtype=float32
  rates=(--seq 256 --heads 4 --kv-heads 4 --head-dim 32 --dtypes float32,bfloat16 --warmup 1 --iters 2)
  preset=()
fi

echo "== 1/3 device tests ($device)"
python -m pytest -q -m gpu tests/test_device.py -p no:cacheprovider -rA 2>&1 \
  | tee "$out/tests.log" | grep -E "passed|failed|error|operators that ran|path \[" || true
grep -qE "[0-9]+ passed" "$out/tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/tests.log" \
  || status=1

echo "== 2/3 peak memory per rank ($device, s = $seq_local)"
rm -f "$out/memory.jsonl"
python -m tokenring bench --mode memory --device "$device" --world-size 2 \
  --seq-local "$seq_local" --dtype "$mem_dtype" --causal yes --json --out "$out/memory.jsonl" \
  > /dev/null || status=1

echo "== 3/3 kernel rates ($device)"
python benchmarks/kernel_rates.py --device "$device" "${rates[@]}" "${preset[@]}" \
  --out "$out/kernel_rates.json" > /dev/null || status=1

python - "$out" "$status" <<'EOF' | tee "$out/summary.txt"
import json, os, re, sys
out, status = sys.argv[1], int(sys.argv[2])
log = open(os.path.join(out, "tests.log")).read()
print(f"device check: {out}")
tail = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line)]
print("tests:", tail[-1].strip("= ") if tail else "no result")
for line in log.splitlines():
    if "operators that ran" in line or "path [" in line:
        print("  ", line.strip())
path = os.path.join(out, "memory.jsonl")
if os.path.exists(path):
    rows = [json.loads(line) for line in open(path)]
    if rows:
        r0 = rows[0]
        print(f"peak memory per rank / (inputs + outputs + gradients), P={r0['world_size']} "
              f"{r0['dtype']} causal={r0['causal']} over {r0['comm_path']} ({r0['method']}):")
        sizes = sorted({r["seq_local"] for r in rows})
        print("  strategy      " + "".join(f"{'s=' + str(s):>10}" for s in sizes))
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            cells = {r["seq_local"]: r["ratio"] for r in rows if r["strategy"] == strategy}
            print(f"  {strategy:<14}" + "".join(f"{cells.get(s, float('nan')):>9.2f}x" for s in sizes))
path = os.path.join(out, "kernel_rates.json")
if os.path.exists(path):
    record = json.load(open(path))
    print(f"kernel TFLOP/s on {record['device']} (fwd / bwd):")
    for dtype, blocks in record["rates"].items():
        cells = "  ".join(
            f"{block} {b['forward_tflops']:.4g} / {b['backward_tflops']:.4g} ({', '.join(b['operators'])})"
            for block, b in blocks.items()
        )
        print(f"  {dtype:<9} {cells}")
print("RESULT:", "PASS" if status == 0 else "FAIL")
EOF
exit $status
