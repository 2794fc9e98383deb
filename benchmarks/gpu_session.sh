#!/usr/bin/env bash
# One device call (the `device` tool's `run`, ~9 minutes): build for this GPU, the kernel and engine tests that
# run natively on CUDA beside gpu_check's methods phase (CUDA == CPU greedy for every method), then gpu_check's
# timings on Llama-3-8B shapes alone on the GPU. Everything lands under $OUT (logs in one tarball).
#
#   bash benchmarks/gpu_session.sh            # on the device machine, from the repository root
#
# Budgets (seconds) can be overridden: BUILD_S, TESTS_S, METHODS_S, TIMINGS_S.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/logs/smi.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
stamp "build for sm_$arch"
TORCH_CUDA_ARCH_LIST=$arch timeout "${BUILD_S:-240}" $PY setup.py build_ext --inplace >"$OUT/logs/build.log" 2>&1
stamp "build rc=$? $(tail -1 "$OUT/logs/build.log")"
$PY -c "import torch, eagle_kernels; from eagle_kernels._ops import has_kernel; print('cuda kernels:', [op for op in ('build_tree', 'tree_accept_greedy', 'tree_accept_sample') if has_kernel(op, torch.device('cuda'))])"

stamp "native tests beside the methods phase"
timeout "${TESTS_S:-170}" $PY -m pytest -q -n 6 -p no:cacheprovider --timeout 120 -rfE \
    tests/test_cuda_engine.py tests/test_tree_build.py tests/test_rejection.py tests/test_attention_kernel.py \
    tests/test_expand.py tests/test_layer_ops.py tests/test_kernels_sync_free.py tests/test_bad_args_subprocess.py >"$OUT/logs/tests.log" 2>&1 &
tests=$!
$PY benchmarks/gpu_check.py --phases methods --budget methods="${METHODS_S:-160}" --no-peer --out "$OUT/logs" \
    >"$OUT/logs/methods.out" 2>&1
stamp "methods rc=$?"
wait $tests
stamp "tests rc=$?"
grep -E "passed|failed|error" "$OUT/logs/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/logs/tests.log" | head -30

stamp "timings (alone on the GPU)"
$PY benchmarks/gpu_check.py --phases timings --budget timings="${TIMINGS_S:-230}" --no-peer --out "$OUT/logs" \
    >"$OUT/logs/timings.out" 2>&1
stamp "timings rc=$?"
sed -n '/^methods /,$p' "$OUT/logs/methods.out"
sed -n '/^timings /,$p' "$OUT/logs/timings.out"
cp "$OUT/logs/gpu_check.json" "$OUT/" 2>/dev/null
so=$(ls eagle_kernels/_C*.so 2>/dev/null | head -1)
[ -n "$so" ] && strip --strip-debug -o "$OUT/$(basename "$so")" "$so" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
stamp "done"
