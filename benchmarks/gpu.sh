#!/usr/bin/env bash
# Issue 6 on a lent accelerator (an H200 with JAX[cuda], flax, optax and PyTorch
# preinstalled; nothing can be installed there). From the repository root:
#
#   benchmarks/gpu.sh             # on the GPU machine
#   benchmarks/gpu.sh --dry-run   # anywhere: CPU, tiny sizes, a LayerNorm parity subset
#
# Steps: 1. environment; 2. LayerNorm bandwidth vs a device copy, and the GPT-2
# 124M bf16 training step's tokens/s and MFU (benchmarks/gpu_bench.py); 2b. the
# GPT-2 124M float32 training step and generation, the chapter-10 encoder-decoder step
# and the chapter-14 music throughput against torch on the same GPU (benchmarks/run.py
# rows gpt2-train-step, gpt2-generate, encdec-train-step, music-throughput; one --quick
# row in the dry run), within ROWS_TIMEOUT seconds (default 300); 3. the
# parity suite with JAX on the GPU at matmul precision "highest"
# (parity_tests/conftest.py sets it). The measurements
# come first so that a slow parity run cannot cost them. If $OUT is set (the device
# tool's output folder), the JSON rows and the logs are written there as well.
# Environment: PYTHON (default python), ROWS_TIMEOUT seconds (default 300), PARITY_TIMEOUT seconds (default 420),
# FLAX_LN_HYPOTHESIS_EXAMPLES (default 25 here: each example is a fresh compile).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN="--dry-run" ;;
    *) echo "usage: benchmarks/gpu.sh [--dry-run]" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python}"
OUT_DIR="${OUT:-}"
[[ -n "$OUT_DIR" ]] && mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the repo copy, installed or not
export FLAX_LN_HYPOTHESIS_EXAMPLES="${FLAX_LN_HYPOTHESIS_EXAMPLES:-25}"
if [[ -n "$DRY_RUN" ]]; then export JAX_PLATFORMS=cpu; fi
status=0

echo "== 1. environment"
date
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import jax, flax, torch; print('jax', jax.__version__, jax.devices(), '| flax', flax.__version__, '| torch', torch.__version__)" \
  || { echo "cannot import jax/flax/torch" >&2; exit 1; }

echo "== 2. LayerNorm bandwidth and the GPT-2 124M bf16 training step (tokens/s, MFU)"
"$PY" benchmarks/gpu_bench.py $DRY_RUN ${OUT_DIR:+--json "$OUT_DIR/gpu_bench.json"} || status=1

echo "== 2b. GPT-2 124M training and generation, encoder-decoder step, music throughput vs torch on the same GPU"
if [[ -n "$DRY_RUN" ]]; then  # the wiring only: benchmarks/run.py --quick (a test) covers every row's code
  ROWS=(gpt2-train-step); ROW_ARGS=(--quick)
else
  ROWS=(gpt2-train-step gpt2-generate encdec-train-step music-throughput)
  ROW_ARGS=(--repeats 10 --max-wait 0 --quiet-load "$(nproc)")
fi
timeout "${ROWS_TIMEOUT:-300}" "$PY" benchmarks/run.py "${ROW_ARGS[@]}" --only "${ROWS[@]}" \
  | tee ${OUT_DIR:+"$OUT_DIR/rows.md"} || { echo "rows: FAILED or timed out (rc $?)"; status=1; }

echo "== 3. parity suite, JAX on $( [[ -n "$DRY_RUN" ]] && echo "the CPU (dry run: LayerNorm float32/float64 subset)" || echo "the GPU" ), matmul precision highest"
if [[ -n "$DRY_RUN" ]]; then
  PARITY=(parity_tests/test_layernorm.py -k "test_float32_close or test_float64_exact")
else
  PARITY=(parity_tests)
  "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" \
    || { echo "JAX does not see a GPU: refusing to call this a GPU parity run" >&2; exit 1; }
fi
# -n 0: one process. pyproject's -n auto would start a worker per core, and on a GPU machine each worker's JAX
# would preallocate most of the one GPU's memory.
timeout "${PARITY_TIMEOUT:-420}" "$PY" -m pytest "${PARITY[@]}" -q -x -n 0 -p no:cacheprovider \
  ${OUT_DIR:+--junitxml "$OUT_DIR/parity.xml"} || { echo "parity: FAILED or timed out (rc $?)"; status=1; }

echo "== done (status $status)"
exit $status
