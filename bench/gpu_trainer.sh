#!/usr/bin/env bash
# The learner benchmark on one GPU, as one prepared script (bench/trainer.py does the measuring):
#   1. a few seconds' check of the sharded path on a small Qwen2 shape (NCCL, FSDP2, bf16);
#   2. the ~1.5B Qwen2-shaped model (random weights, built on the GPU, no hub) with the sharded learner
#      under torchrun --nproc-per-node 1: bf16 compute, fp32 master weights and reduction; MFU;
#   3. the same model and batch with the plain learner, as `swarm train` runs it today (fp32).
# The batch: 8 prompts x 8 samples x (256 prompt + 768 completion tokens), micro-batches of 16 (8 plain).
# Figures and the log go to $OUT (trainer-gpu.json, runs/*.json, gpu_trainer.log). Under 6 minutes: every
# step has its own time limit, and a step that fails or runs out is reported and the rest still run.
# Without a GPU it runs the same steps on the small shape on CPU (so it is known to run anywhere).
# Needs torch, transformers, safetensors, prometheus-client, numpy, msgspec and cryptography (swarm_common's
# keys: the learner's config imports the audit's protocol). The GPU machine's image lacks the last two (and
# cryptography's cffi and pycparser), so wheels/*.whl, when that folder exists, are installed first (pip
# --no-deps). Fill it here, for the device's Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d wheels msgspec==0.23.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
# and carry it: run(command="mkdir -p $OUT && OUT=$OUT bash bench/gpu_trainer.sh", carry=["wheels"]).
set -euo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT/runs"
exec > >(tee -a "$OUT/gpu_trainer.log") 2>&1
PY="${PYTHON:-python3}"
START=$(date +%s)
echo "== $(date -u +%FT%TZ) bench/gpu_trainer.sh, figures in $OUT"

if [ -d wheels ] && compgen -G "wheels/*.whl" >/dev/null; then
  timeout 60 "$PY" -m pip install -q --no-deps wheels/*.whl || echo "pip install of wheels/ failed (exit $?)"
fi
"$PY" -c "import cryptography, msgspec, safetensors, torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  MODEL=qwen1.5b
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
else
  MODEL=qwen-mini
  export SWARM_DIST_DEVICE=cpu
  echo "no GPU: the small shape on CPU"
fi

# run LIMIT_S CMD...: the command under a time limit; a failure is reported, not fatal.
run() {
  local limit=$1 code=0
  shift
  echo "== $(( $(date +%s) - START )) s: $*"
  timeout --kill-after=15 "$limit" "$@" || code=$?
  [ "$code" = 0 ] || echo "!! FAILED (exit $code, 124: out of time): $*"
}
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
W=(bench/trainer.py --worker --out "$OUT/runs" --timeout 120)

if [ "$MODEL" != qwen-mini ]; then
  run 45 "${TORCHRUN[@]}" "${W[@]}" --model qwen-mini --mode fsdp --steps 2
fi
run 120 "${TORCHRUN[@]}" "${W[@]}" --model "$MODEL" --mode fsdp --steps 3
run 120 "$PY" "${W[@]}" --model "$MODEL" --mode plain --steps 2 --micro-batch 8

"$PY" bench/trainer.py --report "$OUT/runs" --json "$OUT/trainer-gpu.json"
echo "== done in $(( $(date +%s) - START )) s"
