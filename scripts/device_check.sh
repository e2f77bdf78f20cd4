#!/usr/bin/env bash
# The project's device check, on a machine with one NVIDIA GPU, from a fresh clone: set-up, then
# scripts/device_check.py (captures and S on the GPU against the CPU, one gpu-local adaptation run timed per step,
# OutRo's decoding overhead). Writes measurements/gpu/<date>.json; commit it.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
make setup
.venv/bin/python scripts/device_check.py --device "${DEVICE:-cuda}" "$@"
echo "[device check] done in $(( $(date +%s) - start )) s"
