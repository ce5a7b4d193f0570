#!/usr/bin/env bash
# Device: build and run a standalone cuBLASLt / kernel probe; no Paddle needed. PROBE names it: gemv_pdl_bench (the
# default: the row-dot GEMV and PDL probe), lt_algo_probe (cuBLASLt's first heuristic vs its fastest candidate),
# lt_l2_probe (the decode GEMMs with their weights in L2, and an L2 prefetch of them during an HBM-bound kernel),
# lt_search_probe (cuBLASLt's enumerable configurations searched, against its heuristic's first) or hbm_read_probe
# (HBM read bandwidth: linear, in scattered chunks over pools up to 64 GB, by cp.async.bulk).
# Usage (from the project root, on the GPU machine): OUT=dir [PROBE=lt_algo_probe] bash tools/gpu/run_gemv_probe.sh
set -u
PROBE=${PROBE:-gemv_pdl_bench}
OUT=${OUT:-${TMPDIR:-/tmp}/gemv_probe_out}
BIN=$(mktemp -d)/$PROBE
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
flags=()
# cuBLASLt from the CUDA toolkit, or from the pip wheel PyTorch brought
for d in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
for p in site.getsitepackages():
    for c in glob.glob(os.path.join(p, "nvidia", "cu13")) + glob.glob(os.path.join(p, "nvidia", "cublas")):
        print(c)
PY
); do flags+=("-I$d/include" "-L$d/lib" "-Xlinker" "-rpath=$d/lib"); done
nvcc -O3 -std=c++20 -gencode=arch=compute_90,code=sm_90 "$here/$PROBE.cu" "${flags[@]}" -lcublasLt \
  -o "$BIN" 2>&1 | tail -5
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
"$BIN" | tee "$OUT/$PROBE.jsonl"
[ "$PROBE" = gemv_pdl_bench ] || exit 0
cuobjdump --dump-sass "$BIN" 2>/dev/null | awk '/Function : .*rowdotILi1ELi12ELi1ELb0/{p=1} /Function : .*rowdotILi1ELi12ELi1ELb1/{p=2} /Function/ && !/rowdotILi1ELi12ELi1/{p=0} p' \
  | grep -nE "Function|LDG|LDGSTS|DEPBAR|ACQ|griddep|PREEXIT|BAR|FFMA" | head -80 > "$OUT/sass_order.txt"
