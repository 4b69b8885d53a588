#!/usr/bin/env bash
# Everything megamoe checks on a Hopper machine (set up as docs/benchmarks.md, "Setting up a GPU
# machine", says), logs and CSVs under ${OUT:-gpu-out}:
#   bash scripts/gpu-check.sh [tests] [kernel-tests] [demo] [bench] [multirank]
# (no argument: all of them). A short summary is printed last. With pytest-xdist importable the
# tests run in ${GPU_WORKERS:-6} worker processes sharing the GPU, which compile their kernels in
# parallel (the kernels' 807 GPU tests took 246 s in 8 workers on an H100), and the real-size
# layers of tests/test_gpu_layer.py alone after them (DeepSeek-V3's and its fp32 oracle take
# most of an 80 GB GPU; where workers run them, the module's lock takes them one at a time).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernel-tests demo bench multirank)
summary=()
record() { summary+=("$(printf '%-13s %s' "$1" "$2")"); }
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_WORKERS:-6}")

for step in "${steps[@]}"; do
  case "$step" in
    tests)  # the layer, CUDA graphs, HF interop on the GPU (the kernels' own suite is kernel-tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider ${workers[@]+"${workers[@]}"} tests \
        packages/megamoe-runtime/tests packages/megamoe-torch/tests \
        --deselect tests/test_gpu_layer.py 2>&1 | tee "$out/gpu-tests.log" | tail -n 8
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_layer.py 2>&1 \
        | tee "$out/gpu-layer-tests.log" | tail -n 4
      record tests "$(tail -n 1 "$out/gpu-tests.log"); real sizes: $(tail -n 1 "$out/gpu-layer-tests.log")" ;;
    kernel-tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider ${workers[@]+"${workers[@]}"} packages/megamoe-kernels/tests 2>&1 \
        | tee "$out/kernel-tests.log" | tail -n 8
      record kernel-tests "$(tail -n 1 "$out/kernel-tests.log")" ;;
    demo)
      python3 -m megamoe_torch.cli demo --tokens 512 2>&1 | grep -v 'it/s' | tee "$out/demo.log" | tail -n 14
      record demo "$(tail -n 1 "$out/demo.log")" ;;
    bench)
      python3 -m megamoe_torch.cli bench --backends cutedsl grouped_mm --modes kernels layer \
        --weight-dtype bf16 fp8 --targets --repeats 20 --out "$out" 2>&1 | grep -v "it/s" > "$out/bench.log"
      python3 -m megamoe_torch.cli bench --backends cutedsl --geometry qwen3-30b-a3b --tokens 8192 \
        --capacity-sweep --out "$out/sweep" 2>&1 | grep 'capacity sweep' | tee "$out/capacity-sweep.log"
      record bench "$(grep -cE ' cutedsl(\+fp8)? +kernels ' "$out/bench.log") cutedsl points, table in $out/bench.log, targets in $out/targets.md" ;;
    multirank)
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        torchrun --standalone --nproc-per-node 2 -m pytest -q -m multirank -p no:cacheprovider tests 2>&1 \
          | tee "$out/multirank.log" | tail -n 5
        record multirank "$(grep -E 'passed|failed' "$out/multirank.log" | tail -n 1)"
      else
        record multirank "skipped: fewer than 2 GPUs"
      fi ;;
    *) echo "unknown step $step (tests kernel-tests demo bench multirank)"; exit 2 ;;
  esac
done
printf '\n%s\n' "${summary[@]}"
