#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
#
# Everything this project checks and measures on a GPU machine without vLLM, in
# one go (about 3 minutes on the H200 before the ipc check; never run since): the GPU
# check (tools/testing/gpu_check), its ipc check again under MPS where MPS starts, then a
# layer call through shm with CUDA tensors against the staging floor (and with the
# staged path's variants: the send as before, blocking receives), then the same
# on that host's CPU (benchmarks/layer_call.py). Run from the repository
# root; needs CUDA torch and nvcc, and msgspec (where it is missing, a wheel for
# that machine's Python in .whl/ is installed into /tmp/site). Writes to $OUT
# (default /tmp/afd-gpu-out); exits with the GPU check's status.
#
#   bash tools/testing/gpu_check/device_run.sh
#
# The wheel, fetched beforehand on a machine with an index (.whl/ is git-ignored
# locally: echo /.whl/ >> .git/info/exclude), for the device's CPython 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0
set -u
OUT=${OUT:-/tmp/afd-gpu-out}
mkdir -p "$OUT"
if ! python3 -c "import msgspec" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/msgspec-*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nvcc --version | tail -1; lscpu | grep -E 'Model name|^CPU\(s\)'; } 2>&1 | tee "$OUT/machine.txt"
timeout 300 python3 tools/testing/gpu_check --out "$OUT/gpu-check.json" 2>&1 \
  | tee "$OUT/gpu-check.log"
status=${PIPESTATUS[0]}
# The ipc check again under MPS where it starts: its two processes then share the
# GPU without time slices (the 2proc figures beside the time-sliced ones above).
if command -v nvidia-cuda-mps-control >/dev/null 2>&1 \
    && nvidia-cuda-mps-control -d >"$OUT/mps.txt" 2>&1; then
  timeout 240 python3 tools/testing/gpu_check --only ipc --out "$OUT/gpu-check-ipc-mps.json" \
    2>&1 | tee "$OUT/gpu-check-ipc-mps.log"
  echo quit | nvidia-cuda-mps-control
else
  echo "MPS did not start" | tee -a "$OUT/mps.txt"
fi
# The op library the check built, for the benchmark's processes (kernels/ops.py).
export VLLM_AFD_OP_LIBRARY=${AFD_GPU_CHECK_BUILD:-/tmp/afd-gpu-check-build}/cuda/afd_C.so
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -f "$VLLM_AFD_OP_LIBRARY" ]; then
  timeout 150 python3 benchmarks/layer_call.py --device cuda --through exchange \
    --tokens 1,8,64 --steps 300 --ubatches 2 --out "$OUT/layer_call_cuda.json"
  # The staged send as before 2026-12-05 (copy, event, wait), to compare with the run above.
  timeout 100 python3 benchmarks/layer_call.py --device cuda --through exchange \
    --tokens 1,8 --steps 300 --ubatches '' --staged-write events \
    --out "$OUT/layer_call_cuda_events.json"
  # Staged receives as one blocking copy each (no event), to compare likewise.
  timeout 100 python3 benchmarks/layer_call.py --device cuda --through exchange \
    --tokens 1,8 --steps 300 --ubatches '' --staged-read blocking \
    --out "$OUT/layer_call_cuda_blocking_reads.json"
  timeout 150 python3 benchmarks/layer_call.py --device cpu --through exchange \
    --tokens 1,8 --steps 300 --ubatches 2 --out "$OUT/layer_call_cpu.json"
fi
exit "$status"
