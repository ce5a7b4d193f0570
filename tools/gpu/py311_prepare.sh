#!/usr/bin/env bash
# Python 3.11 + Paddle 2.6.2 (cp311 GPU wheel) for the lent GPUs, where SOT (graph_opt_level 1) can run -- LOCAL side.
# Run from the project root: bash tools/gpu/py311_prepare.sh. Writes git-ignored .gpu311/part* (each <= 40,000,000
# bytes) and .gpu311/py311.sha256; tools/gpu/py311_setup.sh unpacks them on the device, after the cp312 kit's
# device-setup.sh (Paddle 2.6.2 in <tmp>/site).
#
# What the archive holds, and why it is small (about 2 pieces):
# - CPython 3.11 from a local build (PY311, default pyenv's 3.11): the interpreter fdlite's CPU tests run here; its
#   libpython is shared (the py311 wrapper puts it on LD_LIBRARY_PATH). Stdlib only, no tests/idlelib/tkinter/
#   ensurepip/static lib, and the non-glibc libraries its extension modules need under lib/deps (setup keeps only
#   those the device lacks, so none shadows the device's own).
# - Paddle's cp311 wheel slimmed as ../shared/gpu-paddle/prepare.sh slims the cp312 one. After slimming, only
#   libpaddle.so (the Python module) and three metadata files differ from the cp312 tree: the other 2.1 GB
#   (libphi.so, headers, Python files) are hard-linked on the device from <tmp>/site, checked against the
#   size and sha256 listed here in paddle-shared.txt.
# - cp311 wheels of what `import paddle` and the smoke run (tools/gpu/sot_gpu_smoke.py) import, installed here.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
T=${TMPDIR:-/tmp}
WORK=${WORK:-$T/pdl311}
PY311=${PY311:-$(pyenv prefix 3.11.7 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.11.7")}
SHARED=${SHARED:-$ROOT/../shared/gpu-paddle}   # zero_fatbins.py
BASE=${BASE:-$T/pdl/w}                         # the cp312 slimmed tree prepare.sh leaves (its WORK/w)
PIECE=40000000
[[ -x $PY311/bin/python3.11 && -f $PY311/lib/libpython3.11.so.1.0 ]] \
  || { echo "PY311=$PY311: no bin/python3.11 with a shared libpython3.11 (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"; exit 1; }
command -v zstd >/dev/null || { apt-get update -qq && apt-get install -y -qq zstd; }
mkdir -p "$WORK" .gpu311

# slim TAG DIR: download + unzip paddlepaddle-gpu 2.6.2 for cp<TAG> into DIR, as prepare.sh does
slim() {
  local whl=paddlepaddle_gpu-2.6.2-cp$1-cp$1-manylinux1_x86_64.whl
  [[ -f $WORK/$whl ]] || python3 -m pip download -q --no-deps --python-version "${1:0:1}.${1:1}" --only-binary=:all: \
    paddlepaddle-gpu==2.6.2 -d "$WORK"
  rm -rf "$2" && mkdir -p "$2"
  (cd "$2" && unzip -q "$WORK/$whl" \
    && rm -f paddle/libs/libflashattn.so paddle/libs/libwarpctc.so paddle/libs/libwarprnnt.so \
    && python3 "$SHARED/zero_fatbins.py" paddle/libs/libphi.so paddle/base/libpaddle.so >/dev/null)
}
[[ -f $BASE/paddle/base/libpaddle.so ]] || { BASE=$WORK/w312; slim 312 "$BASE"; }
slim 311 "$WORK/w311"

K=$WORK/kit
rm -rf "$K" && mkdir -p "$K/paddle-delta" "$K/py311/bin" "$K/py311/lib/deps"
# Files equal to the cp312 tree's go to the manifest; the others into paddle-delta/.
python3 - "$WORK/w311" "$BASE" "$K" <<'PY'
import hashlib, os, shutil, sys
new, base, kit = sys.argv[1:]
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    return h.hexdigest()
shared, delta = [], []
for root, _, files in os.walk(new):
    for name in files:
        p = os.path.join(root, name); rel = os.path.relpath(p, new); q = os.path.join(base, rel)
        s = sha(p)
        if os.path.isfile(q) and os.path.getsize(q) == os.path.getsize(p) and sha(q) == s:
            shared.append(f"{s} {os.path.getsize(p)} {rel}")
        else:
            delta.append(rel)
            os.makedirs(os.path.dirname(os.path.join(kit, "paddle-delta", rel)), exist_ok=True)
            shutil.copy2(p, os.path.join(kit, "paddle-delta", rel))
open(os.path.join(kit, "paddle-shared.txt"), "w").write("\n".join(sorted(shared, key=lambda l: l.split(" ", 2)[2])) + "\n")
print(f"paddle cp311: {len(shared)} files shared with cp312, {len(delta)} own: {', '.join(sorted(delta))}")
PY

# The interpreter: stdlib only.
cp -a "$PY311/bin/python3.11" "$K/py311/bin/"
cp -a "$PY311/lib/libpython3.11.so.1.0" "$K/py311/lib/"
tar -C "$PY311/lib" -cf - --exclude=site-packages --exclude=__pycache__ --exclude='config-3.11-*' \
  --exclude=test --exclude=tests --exclude=idlelib --exclude=tkinter --exclude=turtledemo --exclude=ensurepip \
  --exclude=lib2to3 --exclude=pydoc_data --exclude='_tkinter*' --exclude='_curses*' --exclude='readline*' \
  --exclude='_dbm*' --exclude='_gdbm*' --exclude='nis.*' --exclude='_test*' --exclude='xxlimited*' \
  --exclude='_ctypes_test*' --exclude='_xxtest*' --exclude='xxsubtype*' --exclude='_crypt*' python3.11 \
  | tar -C "$K/py311/lib" -xf -
mkdir -p "$K/py311/lib/python3.11/site-packages"
# Non-glibc libraries the kept extension modules link (libz is Paddle's own need: the device has it).
ldd "$K"/py311/lib/python3.11/lib-dynload/*.so | awk '$3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libz.so*|libstdc++*|libgcc_s*|libpython*) ;;
    *) cp -L "$lib" "$K/py311/lib/deps/" ;;
  esac
done

# cp311 wheels, the versions fdlite's CPU tests use: what `import paddle` 2.6.2 imports (its paddle.utils imports
# setuptools, httpx and PIL at import time) and fdlite's runtime needs for a tokenizer-less dummy model.
WHEELS="numpy==2.4.6 protobuf==7.36.2 decorator==5.2.1 astor==0.8.1 opt-einsum==3.3.0 setuptools==84.2.1 pillow==13.0.0
        httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1
        typing_extensions==4.16.0 tqdm==4.70.1 pyyaml==6.0.4 safetensors==0.8.0 tokenizers==0.23.3 jinja2==3.1.6
        markupsafe==3.0.4 ${EXTRA_WHEELS:-}"
rm -rf "$WORK/wheels" && mkdir -p "$WORK/wheels"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any --abi abi3 --abi none -d "$WORK/wheels" $WHEELS
"$PY311/bin/python3.11" -m pip install -q --no-deps --no-compile --no-index --target "$K/py311/lib/python3.11/site-packages" \
  "$WORK"/wheels/*.whl
rm -rf "$K/py311/lib/python3.11/site-packages/bin" "$K"/py311/lib/python3.11/site-packages/numpy/*/tests \
  "$K"/py311/lib/python3.11/site-packages/numpy/tests
find "$K" -name __pycache__ -prune -exec rm -rf {} +
# pyenv keeps symbols: strip the interpreter's own objects (not the wheels': they come stripped, some signed).
strip --strip-unneeded "$K/py311/bin/python3.11" "$K/py311/lib/libpython3.11.so.1.0" "$K"/py311/lib/python3.11/lib-dynload/*.so

rm -f .gpu311/part* .gpu311/py311.sha256
(cd "$K" && tar -cf - .) | zstd -19 --long=30 -T0 -q -f -o "$WORK/py311.tar.zst"
split -b $PIECE -d "$WORK/py311.tar.zst" .gpu311/part
sha256sum "$WORK/py311.tar.zst" | cut -d' ' -f1 > .gpu311/py311.sha256
du -sh "$K/py311" "$K/paddle-delta"
ls -l .gpu311
n=$(ls .gpu311/part* | wc -l)
echo "device (after device-setup.sh setup, while warm): for each piece but the last, carrying .gpu311/partNN:"
echo "  bash tools/gpu/py311_setup.sh stage;  with the last piece and .gpu311/py311.sha256: bash tools/gpu/py311_setup.sh setup"
echo "pieces: $n"
