#!/usr/bin/env bash
# Benchmark 6's verdict on one CUDA GPU, in one command (about 4 minutes on an H100), where only
# torch and transformers are installed and there is no network:
#
#   bash scripts/gpu-wheels.sh    # first, where PyPI is reachable: fills .whl/ (pydantic, hjson, DeepSpeed's sdist)
#   bash bench/gpu_check.sh       # on the GPU machine, from the repository root (.whl/ copied along)
#
# It installs .whl/ into a scratch folder, then runs: the GPU tests (varlen flash attention equal
# to the masked row, the trainer's bf16 forward equal to stock HF, the micro-batch loop under
# sync debug mode "error", the NCCL weight transport on one GPU); benchmark 6 at 0.5B (stock HF,
# plain PyTorch, ZeRO-1, ZeRO-3, with a profile) and at 1.5B (stock HF, ZeRO-1), a 1.5B step with
# 16,384-token micro-batches, and a timed 1.5B weight update. Each part goes on if another fails;
# the VERDICT lines say what the targets came to. Results: bench/results/gpu_*.json (and $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/pipelinerl-gpu-site}
start=$(date +%s)
part() { echo; echo "== $1 (at $(( $(date +%s) - start )) s)"; }

part "install .whl/ into $SITE"
ls .whl/*.whl .whl/deepspeed-*.tar.gz >/dev/null || { echo "no .whl/: run scripts/gpu-wheels.sh first"; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 2
DS_BUILD_OPS=0 $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" \
  .whl/deepspeed-*.tar.gz || exit 2
export PYTHONPATH="$SITE:$PWD:$PWD/operator:$PWD/services/generator:$PWD/services/preprocessor:$PWD/services/trainer:$PWD/cli"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)"

part "GPU tests"
$PY -m pytest -q -p no:cacheprovider tests/gpu tests/integration/test_weight_group.py -k "gpu or nccl" 2>&1 | tail -25

part "benchmark 6, 0.5B"
timeout 150 $PY -m bench.gpu_trainer --size 0.5B --samples 64 --repeats 2 --profile --targets 1.5,0.20 2>&1 \
  | grep -v -e "Warning" -e "warn(" -e "^\s*$" | tail -30

part "benchmark 6, 1.5B"
timeout 150 $PY -m bench.gpu_trainer --size 1.5B --samples 64 --repeats 2 --sides stock,zero1 --targets 1.5,0.30 2>&1 \
  | grep -v -e "Warning" -e "warn(" -e "^\s*$" | tail -12

part "1.5B with 16,384-token micro-batches (must fit in the GPU)"
timeout 120 $PY -m bench.gpu_trainer --size 1.5B --samples 64 --repeats 1 --micro-batch-tokens 16384 --sides zero1 \
  --tag -16k 2>&1 | grep -v -e "Warning" -e "warn(" -e "^\s*$" | tail -6

part "timed 1.5B weight update (pack from DeepSpeed, NCCL broadcast, receive)"
timeout 120 $PY -m bench.gpu_weight_update --size 1.5B --rounds 2 2>&1 | grep -v -e "Warning" -e "warn(" | tail -8

part "done"
if [ -n "${OUT:-}" ]; then cp bench/results/gpu_*.json "$OUT"/ 2>/dev/null; fi
