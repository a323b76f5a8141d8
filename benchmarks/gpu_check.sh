#!/usr/bin/env bash
# The GPU check for a lent GPU machine (< 8 minutes on one GPU): CUDA step equivalence (fp32, bf16), a bf16 sweep,
# noise, the probe against a real CUDA OOM, the step-overhead benchmark, MFU. One SUMMARY line per check.
# Usage: bash benchmarks/gpu_check.sh [device]   (default cuda; "cpu" dry-runs the same checks)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # On a GPU machine the CUDA build of torch is what we want: no CPU pin here.
  .venv/bin/python -m pip install -q -e .
fi
export PYTHONUNBUFFERED=1
timeout 480 .venv/bin/python benchmarks/gpu_check.py --device "${1:-cuda}"
