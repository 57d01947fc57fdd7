#!/usr/bin/env bash
# Benchmark 6's verdict on one CUDA GPU in one command, from the repository root:
#
#   bash scripts/gpu-wheels.sh          # first, where PyPI is reachable: fills .whl/ (pydantic, hjson, DeepSpeed's sdist)
#   bash bench/gpu_check.sh             # on the GPU machine (.whl/ carried along): about 5 minutes, 420 s at most
#   bash bench/gpu_check.sh --smoke     # the same script on CPU (tiny shapes, gloo): checks it between GPU loans
#   bash bench/gpu_check.sh --parts 1.5B-16k,weight-update --budget 240   # a rerun of some parts
#
# Parts (install, GPU tests, 0.5B, 1.5B, 1.5B at 16k-token micro-batches, a 1.5B weight update),
# each in what is left of one budget; the log and every JSON go to $OUT as each part ends. What
# each part does, and why: bench/gpu_check.py. The device call: bench/README.md, benchmark 6.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m bench.gpu_check "$@"
