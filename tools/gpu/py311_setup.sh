#!/usr/bin/env bash
# Python 3.11 + Paddle 2.6.2 (cp311) -- DEVICE side (no internet), run from the project root after the cp312 kit's
# `device-setup.sh setup` (Paddle 2.6.2 in <tmp>/site, CUDA links in <tmp>/cudalinks). The pieces come from
# tools/gpu/py311_prepare.sh.
#   stage : copy the carried .gpu311/part* (and py311.sha256) into <tmp>/stage311 (it lives while the machine is warm)
#   setup : stage, reassemble + check sha256, unpack into <tmp>/py311, hard-link the Paddle files shared with the
#           cp312 tree from <tmp>/site (size and sha256 checked), keep only the libraries the device lacks, write the
#           `py311` command (Python 3.11 without the 3.12 PYTHONPATH), check that Paddle and its SOT import
#   env   : print the env line (eval "$(bash tools/gpu/py311_setup.sh env)"): py311 on PATH
# Env (for a dry run elsewhere): GPU311 (.gpu311), STAGE311 (<tmp>/stage311), PY311_PREFIX (<tmp>/py311),
# SITE312 (<tmp>/site), CUDALINKS (<tmp>/cudalinks), UNZSTD=python (unpack with the zstandard module, as the device
# has no zstd command).
set -uo pipefail
T=/tmp  # device-setup.sh's folders are under /tmp
SRC=${GPU311:-.gpu311}
STAGE=${STAGE311:-$T/stage311}
PREFIX=${PY311_PREFIX:-$T/py311}
SITE312=${SITE312:-$T/site}
LINKS=${CUDALINKS:-$T/cudalinks}
SP=$PREFIX/lib/python3.11/site-packages
mkdir -p "$STAGE"

env_line() { echo "export PATH=$PREFIX/bin:\$PATH"; }

stage() {
  if ls "$SRC"/part* >/dev/null 2>&1; then cp "$SRC"/part* "$STAGE"/; fi
  [[ -f $SRC/py311.sha256 ]] && cp "$SRC/py311.sha256" "$STAGE"/
  echo "staged: $(ls "$STAGE" | tr '\n' ' ')"
}

unpack() {  # archive -> $PREFIX.new (the kit's tree: py311/, paddle-delta/, paddle-shared.txt)
  local dst=$1
  if [[ ${UNZSTD:-} != python ]] && command -v zstd >/dev/null; then
    zstd -dc --long=30 -q "$STAGE/py311.tar.zst" | tar -C "$dst" -xf - || return 1
  else
    PYTHONPATH=$SITE312 python3 - "$STAGE/py311.tar.zst" "$dst" <<'PY' || return 1
import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f:
    d = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(f)
    tarfile.open(fileobj=d, mode="r|").extractall(sys.argv[2])
PY
  fi
}

# Paddle's files equal to the cp312 tree's: hard links (copies across file systems), size and sha256 checked.
link_shared() {
  python3 - "$1" "$SITE312" "$SP" <<'PY'
import concurrent.futures as cf, hashlib, os, shutil, sys
manifest, base, sp = sys.argv[1:]
rows = [l.split(" ", 2) for l in open(manifest).read().splitlines() if l]
def one(row):
    want, size, rel = row
    src, dst = os.path.join(base, rel), os.path.join(sp, rel)
    if not os.path.isfile(src) or os.path.getsize(src) != int(size):
        return f"{rel}: missing or another size in {base}"
    h = hashlib.sha256()
    with open(src, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    if h.hexdigest() != want:
        return f"{rel}: sha256 differs from the cp312 tree this kit was made against"
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return None
with cf.ThreadPoolExecutor(16) as ex:
    bad = [e for e in ex.map(one, rows) if e]
print(f"paddle: {len(rows) - len(bad)} of {len(rows)} files linked from {base}")
for e in bad[:20]:
    print("  ", e)
sys.exit(1 if bad else 0)
PY
}

cuda_links() {  # as device-setup.sh makes them, when it has not
  [[ -d $LINKS ]] && return 0
  local nv; nv=$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null) || { echo "no nvidia pip libraries: no $LINKS"; return 0; }
  mkdir -p "$LINKS"
  for d in "$nv"/*/lib; do for f in "$d"/*.so*; do [[ -e $f ]] && ln -sf "$f" "$LINKS"/; done; done
  ( cd "$LINKS" || exit
    for pair in libcublas.so.11:libcublas.so.13 libcublasLt.so.11:libcublasLt.so.13 libcurand.so.10:libcurand.so.10 \
                libcusolver.so.11:libcusolver.so.12 libcusparse.so.11:libcusparse.so.12 libcudnn.so.8:libcudnn.so.9 \
                libnccl.so:libnccl.so.2; do
      a=${pair%%:*}; b=${pair##*:}; [[ -e $b && ! -e $a ]] && ln -sf "$b" "$a"
    done )
}

setup() {
  stage
  if [[ -x $PREFIX/bin/py311 ]]; then echo "setup: already unpacked"; env_line; return 0; fi
  [[ -f $SITE312/paddle/base/libpaddle.so ]] || { echo "no Paddle in $SITE312: run device-setup.sh setup first"; return 1; }
  cat "$STAGE"/part* > "$STAGE/py311.tar.zst"
  local want got t0=$SECONDS; want=$(cat "$STAGE/py311.sha256"); got=$(sha256sum "$STAGE/py311.tar.zst" | cut -d' ' -f1)
  [[ $want == "$got" ]] || { echo "sha256 MISMATCH (want $want got $got): a piece is missing; restage"; return 1; }
  rm -rf "$PREFIX.new" && mkdir -p "$PREFIX.new"
  unpack "$PREFIX.new" || { echo "unpack failed"; return 1; }
  rm -f "$STAGE/py311.tar.zst"
  rm -rf "$PREFIX" && mv "$PREFIX.new/py311" "$PREFIX"
  cp -a "$PREFIX.new/paddle-delta/." "$SP"/
  link_shared "$PREFIX.new/paddle-shared.txt" || return 1
  rm -rf "$PREFIX.new"
  # Ship-along libraries: keep only those this machine has not (so none shadows the device's own).
  for f in "$PREFIX"/lib/deps/*; do
    [[ -e $f ]] && ldconfig -p | grep -q "^[[:space:]]*$(basename "$f") " && rm -f "$f"
  done
  echo "kept from lib/deps (missing here): $(ls "$PREFIX/lib/deps" | tr '\n' ' ')"
  cuda_links
  # build.py looks for libcudart / cuBLAS in sys.path's site-packages/nvidia: a folder holding only that link
  local nv; nv=$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null) \
    && mkdir -p "$PREFIX/nvsite/site-packages" && ln -sfn "$nv" "$PREFIX/nvsite/site-packages/nvidia"
  cat > "$PREFIX/bin/py311" <<EOF
#!/bin/sh
# Python 3.11 with its own site-packages: the 3.12 Paddle's PYTHONPATH (<tmp>/site) is replaced by PY311_PATH.
unset PYTHONHOME PYTHONSTARTUP
export PYTHONNOUSERSITE=1
if [ -n "\${PY311_PATH:-}" ]; then export PYTHONPATH="\$PY311_PATH"; else unset PYTHONPATH; fi
export LD_LIBRARY_PATH="$PREFIX/lib:$PREFIX/lib/deps:$LINKS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$PREFIX/bin/python3.11" "\$@"
EOF
  chmod +x "$PREFIX/bin/py311"
  echo "unpacked in $((SECONDS - t0)) s; shared-library problems (none expected):"
  LD_LIBRARY_PATH="$PREFIX/lib:$PREFIX/lib/deps:$LINKS" ldd "$PREFIX/bin/python3.11" "$PREFIX"/lib/python3.11/lib-dynload/*.so \
    "$SP/paddle/base/libpaddle.so" 2>&1 | grep -E "not found|^ldd|GLIBC" | sed 's/^/  /'
  "$PREFIX/bin/py311" -c "import sys, paddle, paddle.jit.sot; print('python', sys.version.split()[0], 'paddle', paddle.__version__, 'cuda build', paddle.is_compiled_with_cuda(), 'sot ok')" \
    2>&1 | grep -v -E "^W[0-9]{4} |has been registered" | tail -20
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "PY311 FAILED: Python 3.11 or its Paddle does not start here (error above)"; return 1; }
  env_line
}

case "${1:-setup}" in
  stage) stage ;;
  setup) setup ;;
  env) env_line ;;
  *) echo "usage: py311_setup.sh stage|setup|env"; exit 2 ;;
esac
