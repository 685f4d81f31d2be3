#!/bin/bash
# The second lease of 2026-11-27 (after tools/gpu/session.sh; run from the repository root): the `cuda` tests again after their fixes, the rows the
# first lease missed, fresh-process captcha cases (the cuBLAS workspace of an earlier case), the allocations alive at
# the peak of torchao's compiled low-bit steps, and full-size bert-large (nvidia-smi) and Llama-2-7B. $OUT/gpu.tgz.
source tools/gpu/lease_setup.sh  # $OUT, $W, elapsed, the wheels in .whl/
( timeout 200 python3 -m pytest -m cuda tests -q -o addopts="" -n 6 --dist load -p no:cacheprovider -rfEs \
    --junitxml="$W/cuda-tests.xml" > "$W/cuda-tests.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/cuda-tests.log" ) &
( timeout 150 python3 - > "$W/verify.txt" 2>&1 <<'EOF'
from bench.run.runner import Case, run_case
for workload, spec in [("captcha_resnet18", "baseline"), ("captcha_resnet18", "cudnn_benchmark"),
                       ("gpt_mini:layers=2:width=64:heads=2:seq_len=64", "offload"),
                       ("gpt_mini:layers=2:width=64:heads=2:seq_len=64", "compile:budget=1.0"),
                       ("gpt_mini:layers=2:width=64:heads=2:seq_len=64", "compile:budget=0.1")]:
    row = run_case(Case(workload, spec, "train", 8, "cuda", data="synthetic", warmup=1, steps=2))
    print(workload, spec, {k: v for k, v in row.items() if k in ("status", "matches_baseline", "message")
                           or "rel_diff" in k or "tolerance" in k})
EOF
) &
timeout 250 python3 tools/gpu/check.py --out "$W" --layers 2 --jobs 3 --deadline-s 200 --case-timeout-s 150 \
  --only torchao-bnb-adamw8bit,torchao-adamw8bit,torchao-adamw4bit,transformers-adam8bit,transformers-adam8bit-all,transformers-adafactor-all \
  --case captcha_resnet18,baseline,eval,8 --case captcha_resnet18,no_grad_eval,eval,8 \
  --case captcha_resnet18,grad_accumulation,train,32 --case captcha_resnet18,baseline,train,32 \
  --snapshot "torchao-adamw8bit,torchao-adamw4bit,captcha_resnet18 grad_accumulation train 32" \
  > "$W/gpu-check-layers2.log" 2>&1 &
A=$!
timeout 250 python3 tools/gpu/check.py --out "$W" --layers 0 --jobs 3 --deadline-s 200 --case-timeout-s 235 \
  --only transformers-vanilla,transformers-fp16,torchao-adamw-fused > "$W/gpu-check-full.log" 2>&1
wait $A
wait
cp -r results/cuda_prediction "$W/" 2>/dev/null
echo "end at $(elapsed) s" >> "$W/timeline.txt"
mkdir -p "$OUT"; tar czf "$OUT/gpu.tgz" -C "$(dirname "$W")" w
