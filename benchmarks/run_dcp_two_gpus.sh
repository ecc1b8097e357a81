#!/usr/bin/env bash
# Decode context parallelism (DCP) on a two-GPU host (issue 45): the DCP GPU tests, the model-level eval at one
# GPU / TP 2 / TP 2 x DCP 2, and the end-to-end decode step at S 32k under DCP 2 and TP 2.
#
#   benchmarks/run_dcp_two_gpus.sh OUTDIR tests     pytest -m gpu tests/test_vllm_gpu.py -k dcp
#   benchmarks/run_dcp_two_gpus.sh OUTDIR evals     the eval: CUDA graphs (1 GPU, TP 2, TP 2 x DCP 2 with interleave
#                                                   1 and 64 = the block size; bf16 and fp8 KV; q_len 1 and n-gram
#                                                   speculation; 1k/4k/8k) on the eval model widened to 32 heads,
#                                                   then eager on the shipped 16-head model at TP 2 x DCP 2
#   benchmarks/run_dcp_two_gpus.sh OUTDIR bench     bench_e2e at S 32k, B 32/128, one engine per cell: CUTE_MLA at
#                                                   TP 2 x DCP 2 and at TP 2, FLASHMLA and FLASH_ATTN_MLA at TP 2 x DCP 2
#   benchmarks/run_dcp_two_gpus.sh OUTDIR bench-tp  bench_e2e: FLASHMLA and FLASH_ATTN_MLA at TP 2 without DCP
#   benchmarks/run_dcp_two_gpus.sh OUTDIR bench BACKEND:DCP ...   those cells instead (e.g. FLASHMLA:1 CUTE_MLA:2),
#                                                   for a cell a phase skipped (OUTDIR/bench/skipped.txt)
#   benchmarks/run_dcp_two_gpus.sh OUTDIR report    bench_e2e's report of OUTDIR/bench (no GPU)
#
# Run from the repository root on the two-GPU host once vLLM 0.26 and CuTe-DSL are installed. Each GPU phase is
# one device call: it ends within PHASE_S seconds (default 510; every command gets what is left, an eval run its
# --budget-s), so a phase fits a 9-minute call; what finished is written even when the time runs out (eval:
# results.* with the cut conditions marked "cut"; bench: rows.jsonl per engine). Logs, CSVs and tables go under
# OUTDIR/<phase>. NCCL_NVLS_ENABLE=0 (NVLink multicast off) is exported to every process started here.
set -uo pipefail

if [ $# -lt 2 ]; then
    sed -n '2,21p' "$0" >&2
    exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
PHASE=$2
shift 2
CELLS=("$@")
PHASE_S=${PHASE_S:-510}
PROBLEMS=${PROBLEMS:-40}  # per task and context length
END=$(( $(date +%s) + PHASE_S ))
left() { echo $(( END - $(date +%s) )); }

export NCCL_NVLS_ENABLE=0
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

case "$PHASE" in
tests | evals | bench | bench-tp | report) ;;
*)
    echo "run_dcp_two_gpus.sh: phase $PHASE; allowed: tests, evals, bench, bench-tp, report" >&2
    exit 2
    ;;
esac
if [ "$PHASE" != report ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -lt 2 ]; then
        echo "run_dcp_two_gpus.sh: $PHASE needs 2 GPUs, nvidia-smi lists $gpus" >&2
        exit 2
    fi
    mkdir -p "$OUT/$PHASE"
    { date -u; nvidia-smi -L; $PY -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
      git rev-parse HEAD 2>/dev/null; env | grep '^NCCL_' | sort; } > "$OUT/$PHASE/env.txt" 2>&1
fi

# bench_e2e cells: S 32k, B 32 and 128, one timed engine per call; only the warm-up generation prefills
# (--prefix-caching), 4 DeepSeek-V3-width layers
bench() {  # bench BACKEND DCP
    local budget
    budget=$(( $(left) - 15 ))
    if [ "$budget" -lt 120 ]; then
        echo "skipped $1 dcp $2: ${budget} s left in the phase" | tee -a "$OUT/bench/skipped.txt"
        return
    fi
    [ "$budget" -gt 300 ] && budget=300
    $PY benchmarks/bench_e2e.py --backends "$1" --tensor-parallel-size 2 --decode-context-parallel-size "$2" \
        --contexts 32768 --batches 32,128 --spec 0 --layers 4 --prefix-caching --repeats 2 \
        --timeout "$budget" --out-dir "$OUT/bench" 2>&1 | tail -40
}

case "$PHASE" in
tests)
    timeout "$(left)" $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_vllm_gpu.py -k dcp \
        --junitxml "$OUT/tests/junit.xml" 2>&1 | tee "$OUT/tests/pytest.log"
    exit "${PIPESTATUS[0]}"
    ;;
evals)
    # 16 conditions: the 16-head model widened to 32 heads (the same function) so that TP 2 alone leaves 16 heads
    # per rank; CUTE_MLA takes 16/32/64/128 heads per decode call (heads / TP x DCP)
    $PY -m mla_backend_plugin.evals --backends CUTE_MLA --kernels auto --kv-dtypes auto,fp8 --modes graphs \
        --spec 0,3 --tensor-parallel-size 1,2 --decode-context-parallel-size 1,2 --cp-kv-cache-interleave-size 1,64 \
        --widen-heads 2 --lengths 1024,4096,8192 --problems "$PROBLEMS" --jobs 8 --timeout 280 \
        --budget-s "$(( $(left) - 170 ))" --out "$OUT/evals/graphs" 2>&1 | tee "$OUT/evals/graphs.log" | tail -40
    rc_graphs=${PIPESTATUS[0]}
    # 6 conditions, eager: the shipped 16-head model at TP 2 x DCP 2 (8 heads per rank x 2 = 16 per call), with
    # vLLM's FLASH_ATTN_MLA under the same layout as the peer
    $PY -m mla_backend_plugin.evals --backends CUTE_MLA,FLASH_ATTN_MLA --kernels auto --kv-dtypes auto,fp8 \
        --modes eager --spec 0,3 --tensor-parallel-size 2 --decode-context-parallel-size 2 \
        --lengths 1024,4096,8192 --problems "$PROBLEMS" --jobs 6 --timeout 200 --budget-s "$(( $(left) - 15 ))" \
        --out "$OUT/evals/eager" 2>&1 | tee "$OUT/evals/eager.log" | tail -30
    rc_eager=${PIPESTATUS[0]}
    echo "eval exit codes: graphs $rc_graphs, eager $rc_eager (1: a verdict failed or a condition did not finish)"
    [ "$rc_graphs" -eq 0 ] && [ "$rc_eager" -eq 0 ]
    ;;
bench)
    mkdir -p "$OUT/bench"
    [ ${#CELLS[@]} -eq 0 ] && CELLS=(CUTE_MLA:2 CUTE_MLA:1 FLASHMLA:2 FLASH_ATTN_MLA:2)
    for cell in "${CELLS[@]}"; do bench "${cell%%:*}" "${cell##*:}"; done
    $PY benchmarks/bench_e2e.py --report --out-dir "$OUT/bench" >/dev/null && cat "$OUT/bench/results.md"
    ;;
bench-tp)
    mkdir -p "$OUT/bench"
    for backend in FLASHMLA FLASH_ATTN_MLA; do bench "$backend" 1; done
    $PY benchmarks/bench_e2e.py --report --out-dir "$OUT/bench" >/dev/null && cat "$OUT/bench/results.md"
    ;;
report)
    $PY benchmarks/bench_e2e.py --report --out-dir "$OUT/bench" >/dev/null && cat "$OUT/bench/results.md"
    ;;
esac
