#!/usr/bin/env bash
# Issue 57's GPU checks in one run on one lent GPU (H100 or H200), in about
# nine minutes: the Pallas kernels compiled by Triton against the plain
# computations, then the timings docs/performance.md ("Accelerator kernels")
# waits for. From the repository root on the GPU machine, whose python3 holds
# jax[cuda], torch and transformers (eqtrain is read from the checkout):
#
#     bash benchmarks/accelerators.sh [OUT_DIR]     # default: $OUT, else /tmp/accelerators
#
# Each step writes OUT_DIR/<step>.jsonl (its JSON lines) and <step>.err, and
# prints its exit status and last lines. Steps run in order of what matters
# most, each within its own limit and all within DEADLINE seconds (a step
# that would start past it is skipped), so that a ten-minute device call
# returns whatever was measured.

set -uo pipefail
out=${1:-${OUT:-/tmp/accelerators}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$SECONDS
deadline=${DEADLINE:-560}

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - (SECONDS - start)))
    if ((left < 30)); then
        echo "== $name: skipped ($left s left)"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" >"$out/$name.jsonl" 2>"$out/$name.err"
    echo "rc=$? $name after $((SECONDS - start)) s"
    tail -n 3 "$out/$name.jsonl" | cut -c1-1500
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import jax; print(jax.__version__, jax.devices())"

# 1. The kernels compiled by Triton, against the plain attention and the
#    blocked expert products on the same GPU (exact f32 products on both sides).
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest step kernels 150 \
    "$py" -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" -x \
    tests/test_pallas_attention.py tests/test_grouped_gemm.py

# 2. MFU of the 1B Llama, as a user's config runs it (attention "auto": cuDNN).
step mfu_1b 150 "$py" benchmarks/mfu.py --model 1b --steps 5 --rounds 2 --warmup 2

# 3. Gemma 2 against Llama at 125M, 16 x 2048: step time and XLA's memory plan
#    (Gemma 2's soft-capped layers through the Pallas kernels).
step mfu_families 120 "$py" benchmarks/mfu.py --model 125m --family llama,gemma2 \
    --steps 5 --rounds 2 --warmup 2 --remat none

# 4. One layer's attention by kernel: Llama 3.2 1B's heads, and Gemma 2's scores.
step attention_llama 60 "$py" benchmarks/attention.py --kernels blocks,pallas,cudnn \
    --dtype bfloat16 --heads 32 --kv-heads 8 --seqs 2048,8192 --batch 8 --no-torch
step attention_gemma2 60 "$py" benchmarks/attention.py --kernels blocks,pallas \
    --dtype bfloat16 --heads 8 --kv-heads 4 --head-dim 256 --softcap 50 \
    --window 4096 --seqs 2048,8192 --batch 8 --no-torch

# 5. The dropless MoE step through the Pallas grouped products against the
#    dense model of the same active size.
step moe 120 "$py" benchmarks/moe.py --rounds 3 --batch 16 --seq 1024 --hidden 1024 \
    --expert-size 1024 --layers 4 --balance-steps 0 --pallas

# 6. Generation against transformers' generate on the same GPU (bf16), with
#    each side's cache bytes per row.
step generate 120 "$py" benchmarks/generate.py --device cuda --config 1b --rounds 2

# 7. If time is left: a QLoRA step (nf4 base) against a bf16 base on the GPU
#    (issue 56's step time, which the CPU measured at 0.99x).
step qlora_step 90 "$py" benchmarks/qlora.py step --hidden 2048 --layers 8 \
    --batch 8 --seq 1024 --rounds 3

echo "done after $((SECONDS - start)) s; files in $out"
