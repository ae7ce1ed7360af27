#!/usr/bin/env bash
# GPU check for kvrelay's kernels, run from the repo root on a lent GPU (budget: 8 minutes).
#   1. environment (reuses .venv, else makes one that can see the machine's CUDA torch)
#   2. device copy bandwidth + decode benchmark table (CUDA, Triton, gather+SDPA, FlexAttention)
#   3. CUDA kernel build (JIT, torch cpp_extension), GPU tests, a short engine run
# Prints a summary table last. Record it, with the date, in kernels/README.md.
set -euo pipefail

START=$(date +%s)
LOG_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
elapsed() { echo $(($(date +%s) - START)); }
step() { echo; echo "== [$(elapsed)s] $*"; }

PY=.venv/bin/python
step "environment"
if ! "$PY" -c "import torch, kvrelay_kernels" 2>/dev/null; then
    # --system-site-packages: a machine image's CUDA torch is reused rather than downloaded.
    python3 -m venv --system-site-packages .venv
    "$PY" -m pip install -q -e '.[dev]'
fi
"$PY" - <<'PYEOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available={torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
PYEOF
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

step "build the CUDA kernels (torch.utils.cpp_extension, cached)"
BUILD=ok
timeout 240 "$PY" -c "
import logging, time
logging.basicConfig(level=logging.INFO)
t = time.time()
from kvrelay_kernels import cuda_backend
assert cuda_backend.is_available(), 'CUDA kernels did not build'
print(f'built in {time.time() - t:.0f} s')
" || BUILD=failed

step "GPU tests"
TESTS=ok
timeout 150 "$PY" -m pytest -q -m gpu tests/kernels/test_gpu_backends.py -p no:cacheprovider \
    2>&1 | tee "$LOG_DIR/gpu_tests.txt" | tail -25 || TESTS=failed
TEST_LINE=$(tail -1 "$LOG_DIR/gpu_tests.txt")

step "decode attention benchmark"
BENCH=ok
REMAINING=$((460 - $(elapsed)))
timeout $((REMAINING > 60 ? REMAINING - 40 : 60)) "$PY" benchmarks/gpu_decode_bench.py \
    --budget-s $((REMAINING > 100 ? REMAINING - 100 : 30)) --json "$LOG_DIR/decode_bench.json" \
    2>&1 | tee "$LOG_DIR/decode_bench.txt" || BENCH=failed

step "engine on random weights (auto backend)"
ENGINE=ok
timeout 60 "$PY" benchmarks/gpu_engine_smoke.py 2>&1 | tail -5 || ENGINE=failed

step "summary ($(elapsed)s)"
echo "date: $(date -u +%Y-%m-%d)  build: $BUILD  tests: $TESTS ($TEST_LINE)  bench: $BENCH  engine: $ENGINE"
sed -n '/^decode attention,/,$p' "$LOG_DIR/decode_bench.txt" || true
[[ $BUILD == ok && $TESTS == ok && $BENCH == ok && $ENGINE == ok ]]
