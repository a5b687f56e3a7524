#!/usr/bin/env bash
# Profile a benchmark run with Nsight Systems and print its NVTX and kernel summaries.
#
#   scripts/profile_nsys.sh [python -m bench arguments...]
#   scripts/profile_nsys.sh --quick --models qwen3 --T 1024 --backends ts_moe,torch_grouped_mm
#
# nsys comes from $NSYS or PATH; the Python from $PYTHON (default: python).
# Only the benchmark is captured: the harness brackets its case loop with
# cudaProfilerStart/Stop (--capture-range=cudaProfilerApi), after the roofs.
# Sampling, context-switch tracing and backtraces are off: they make
# multi-GB captures that do not import.  The run is passed --no-save (timings
# under a profiler are not results); the report lands in
# bench/results/profile-<time>.nsys-rep (+ .sqlite), both gitignored.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
nsys_bin=${NSYS:-$(command -v nsys || true)}
if [ -z "$nsys_bin" ] || [ ! -x "$nsys_bin" ]; then
    echo "profile_nsys.sh: nsys not found; put it on PATH or set NSYS=/path/to/nsys" >&2
    exit 1
fi

mkdir -p bench/results
report=bench/results/profile-$(date +%Y%m%d-%H%M%S)

# --capture-range-end=stop: end the capture at cudaProfilerStop but let the
# run finish (the default, stop-shutdown, would kill it there)
"$nsys_bin" profile \
    --trace=cuda,nvtx --sample=none --cpuctxsw=none --backtrace=none \
    --capture-range=cudaProfilerApi --capture-range-end=stop \
    --force-overwrite=true --output="$report" \
    "${PYTHON:-python}" -m bench --no-save "$@"

"$nsys_bin" stats --report nvtx_sum,cuda_gpu_kern_sum "$report.nsys-rep"
