#!/usr/bin/env bash
# Packs what a GPU machine without a package registry lacks once its other dependencies (torch,
# nvidia-cutlass-dsl, nvshmem4py) are installed some other way: apache-tvm-ffi, which CuTe DSL's
# TVM-FFI launch path needs, and pytest-xdist with execnet, which run the GPU tests in parallel
# workers (scripts/gpu-check.sh). Run where a registry is reachable, from the project root; it
# writes .device-extras/site-cp312.tar.xz (~1.5 MB: tvm_ffi without its headers and its C++,
# Cython and third-party sources, small enough to travel with a copy of the checkout).
# On the GPU machine: source scripts/device-env.sh && <command>
set -euo pipefail
version=$(python3 - <<'PY'
import re, pathlib
text = pathlib.Path("packages/megamoe-kernels/pyproject.toml").read_text()
print(re.search(r'"apache-tvm-ffi([^"]*)"', text).group(1))
PY
)
out=.device-extras
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work" "apache-tvm-ffi$version" "pytest-xdist>=3" "execnet>=2"
for wheel in "$work"/*.whl; do
  python3 -m zipfile -e "$wheel" "$work/site"
done
rm -rf "$work/site/tvm_ffi/"{include,src,share,3rdparty,cython}
mkdir -p "$out"
rm -f "$out/tvm_ffi-cp312.tar.xz"  # the name this archive had when it held tvm_ffi alone
tar -cJf "$out/site-cp312.tar.xz" -C "$work/site" .
grep -qx '/.device-extras/' .git/info/exclude 2>/dev/null || echo '/.device-extras/' >> .git/info/exclude
ls -la "$out"
