#!/usr/bin/env bash
# Builds fdlite's custom all-reduce on the GPU machine and runs every test and benchmark
# that machine allows, in priority order, each under its own time limit so that one hang
# cannot eat the whole call. Logs and JSON results go to $OUT (default $TMPDIR/fdar_out, TMPDIR defaulting to /tmp).
#   bash tools/gpu/run_allreduce_tests.sh            (from the repository root or anywhere)
# Env: BUDGET_S (default 560): stop starting steps once this many seconds have gone;
#      REPLAYS (default 10000): graph replays per world size in the sim test;
#      ONLY (a bash regex, default all): run only the steps whose names match.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/fdar_out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-560}
REPLAYS=${REPLAYS:-10000}
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RES=$(mktemp -d)
H=tools/gpu/allreduce_harness.py
declare -a SUMMARY

step() {  # step NAME LIMIT_S CMD...: run if time is left, record the outcome
  local name=$1 limit=$2; shift 2
  if [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]]; then return; fi
  local left=$((BUDGET_S - SECONDS))
  if (( left < 20 )); then SUMMARY+=("$name: SKIPPED (time budget)"); echo "== $name skipped"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, t=${SECONDS}s)"
  timeout -k 5 "$limit" "$@"
  local rc=$?
  case $rc in
    0) SUMMARY+=("$name: ok (${SECONDS}s)") ;;
    124|137) SUMMARY+=("$name: TIMEOUT after ${limit}s") ;;
    *) SUMMARY+=("$name: FAILED rc=$rc") ;;
  esac
}

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
nvcc --version | tail -1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"

# Release build (benchmarks) and a build whose barriers trap after 20 s instead of
# hanging (tests), both with the machine's nvcc for sm_90.
step build_release 120 tools/gpu/build_ops.sh build/fdar_release
step build_debug 120 env FDAR_DEBUG=1 tools/gpu/build_ops.sh build/fdar_debug
REL=build/fdar_release/libfdlite_allreduce.so
DBG=build/fdar_debug/libfdlite_allreduce.so
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")

# The real thing, first when the machine has the GPUs: one process per GPU, CUDA IPC
# over NVLink/P2P, NCCL as reference and baseline (correctness, 10,000 graph replays
# with rewritten inputs, then latency 4 KiB..64 MiB eager and in a graph).
for W in 2 4 8; do
  if (( NGPU >= W )); then
    step "dist_nccl_W${W}" 240 env FDLITE_OPS_LIB=$REL python3 $H dist --world $W --backend nccl \
      --bench --replays "$REPLAYS" --out "$RES/dist_nccl_W${W}.json"
  else
    SUMMARY+=("dist_nccl_W${W}: BLOCKED (${NGPU} GPU(s) here, needs ${W})")
  fi
done

for W in 1 2 4 8; do
  step "sim_W${W}_correctness_graph" 150 env FDLITE_OPS_LIB=$DBG python3 $H sim --world $W \
    --tests correctness,graph,gather --replays "$REPLAYS" --out "$RES/sim_W${W}.json"
done
step dist_nccl_W1 150 env FDLITE_OPS_LIB=$REL python3 $H dist --world 1 --backend nccl --bench \
  --replays "$REPLAYS" --out "$RES/dist_nccl_W1.json"
# CUDA IPC between processes that share one GPU (gloo for the handle exchange and the
# reference): the cross-process path of a real multi-GPU run, minus NVLink.
step dist_gloo_W2_one_gpu 120 env FDLITE_OPS_LIB=$DBG python3 $H dist --world 2 --backend gloo \
  --gloo-replays 200 --out "$RES/dist_gloo_W2.json"
step dist_gloo_W4_one_gpu 120 env FDLITE_OPS_LIB=$DBG python3 $H dist --world 4 --backend gloo \
  --gloo-replays 50 --dtypes bfloat16 --out "$RES/dist_gloo_W4.json"
for W in 1 2 4 8; do
  step "sim_W${W}_bench" 90 env FDLITE_OPS_LIB=$REL python3 $H sim --world $W --tests bench \
    --out "$RES/bench_sim_W${W}.json"
done
step paddle_binding_cuda_compile 60 bash tools/gpu/check_paddle_binding.sh

python3 - "$RES" "$OUT/results.json" <<'PY'
import json, os, sys
res, out = sys.argv[1], sys.argv[2]
allr = {}
for f in sorted(os.listdir(res)):
    with open(os.path.join(res, f)) as fh:
        allr[f[:-5]] = json.load(fh)
with open(out, "w") as fh:
    json.dump(allr, fh, indent=1)
print("results:", ", ".join(allr))
PY
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
