#!/usr/bin/env bash
# Every GPU acceptance of the open issues in one run of at most ~7 minutes, all results under $OUT.
#
# For a lent GPU machine (its own torch, Triton and pytest; the package from this checkout):
#     OUT=/some/dir bash benchmarks/gpu_check.sh
# Each part has its own time limit, so one that hangs or fails leaves time for the rest; the
# summary ($OUT/summary.txt) says what ran, how long, and with which exit status.
set -u
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: rc=$rc, $((SECONDS - start)) s (limit $limit s): $*" | tee -a "$SUMMARY"
}

part env 30 bash -c "nvidia-smi; $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'; $PY -c 'import triton; print(\"triton\", triton.__version__)'"
# #43: a steady step of the mixed and master plans reads nothing back (CUDA's own sync detector)
part syncs 60 "$PY" benchmarks/gpu_syncs.py
# #43/#44/#45: the CUDA tier on this torch (autocast tables derived from it, graphs, fp8, optimizers)
part cuda_tier 150 "$PY" -m pytest -q -m cuda tests/cuda -x -p no:cacheprovider --junitxml="$OUT/cuda_tier.xml"
# #43/#44/#45: whole training steps of GPT-124M against torch's loop (eager, fused AdamW); fp8-mixed against bf16-mixed
part bench_gpu 150 "$PY" benchmarks/bench_gpu.py --rounds 2 --repeats 8 --warmup 3 --json "$OUT/bench_gpu.json" \
    --plans torch-autocast-bf16 torch-autocast-fp16 bf16-mixed fp16-mixed bf16-master fp16-master bf16-pure bf16-kahan bf16-sr fp8-mixed
# #43: the whole safe step in one CUDA graph (mixprec.graphs.capture_step) against the eager torch loop, batch 8
part bench_graph 60 "$PY" benchmarks/bench_gpu.py --rounds 2 --repeats 8 --warmup 3 --json "$OUT/bench_graph.json" \
    --plans torch-autocast-bf16 bf16-mixed+graph
# #43: what holds the mixed plans' extra peak memory (the allocator's trace at the step's peak, by allocation site)
part memory 60 "$PY" benchmarks/gpu_memory.py --plans torch-autocast-bf16 bf16-mixed --json "$OUT/memory.json"
# #45: the optimizer step alone against torch's fused AdamW: the default routes (the Triton kernel for
# fp32, bf16 and 8-bit moments), the compiled ones, fp8 moments and remainder masters
part bench_optim 90 "$PY" benchmarks/bench_optim.py --device cuda --no-train --fused-inner --repeats 5 \
    --rows "torch-fp32-foreach,torch-fp32-fused,bf16-pure,bf16-kahan,bf16-sr,bf16-pure-bf16-state,bf16-kahan-bf16-state,bf16-sr-bf16-state,bf16-pure-8bit,bf16-kahan-8bit,bf16-sr-8bit,bf16-master-remainders,bf16-kahan-fp8,bf16-pure compiled,bf16-kahan compiled,bf16-sr compiled,bf16-kahan-8bit compiled"
# #44: the fp8 layer (the plan's default statistics, amaxes folded once per step) against bf16 by shape, with the
# fused cast (the plan's default on this GPU) and the eager one: the acceptance shapes (M=8192, K=N=4096 and 8192)
# first, then the sweep; GPU kernels per layer step from the profiler; the measured pay-off table of the fused
# cast for this GPU kind ($OUT/payoff_table.json, for src/mixprec/fp8/payoff_<kind>.json)
part fp8_shapes 120 "$PY" benchmarks/bench_fp8_shapes.py --shapes 8192,4096,4096 8192,8192,8192 \
    --widths 1024 2048 16384 --tokens 8192 --casts auto eager --repeats 10 --warmup 3 \
    --json "$OUT/fp8_shapes.json" --table "$OUT/payoff_table.json"
# #44: fp8-mixed against bf16-mixed on a ~1.3B GPT (24 x 2048, sequence 2048): speed, held-out loss after 100 steps
# (last: the longest part, so a short lease still gets everything above)
part fp8_gpt 150 "$PY" benchmarks/bench_fp8_gpt.py --steps 100 --batch 4 --json "$OUT/fp8_gpt.json"
echo "total: $SECONDS s" | tee -a "$SUMMARY"
