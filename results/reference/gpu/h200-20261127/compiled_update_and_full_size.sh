#!/bin/bash
# The third lease of 2026-11-27: the `cuda` tests after every fix of the first two, torchao's four low-bit rows
# measured and predicted with strategies/compiled_update.py, and the full-size rows the first two did not reach.
#   OUT=/tmp/out bash results/reference/gpu/h200-20261127/compiled_update_and_full_size.sh      ($OUT/gpu.tgz)
source tools/gpu/lease_setup.sh  # $OUT, $W, elapsed, the wheels in .whl/
( timeout 165 python3 -m pytest -m cuda tests -q -o addopts="" -n 6 --dist load -p no:cacheprovider -rfEsx \
    --junitxml="$W/cuda-tests.xml" > "$W/cuda-tests.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/cuda-tests.log" ) &
timeout 165 python3 tools/gpu/check.py --out "$W" --layers 2 --jobs 4 --deadline-s 120 --case-timeout-s 150 \
  --only torchao-adamw8bit,torchao-adamw4bit,transformers-adam8bit,transformers-adam8bit-all \
  > "$W/gpu-check-layers2.log" 2>&1 &
timeout 165 python3 tools/gpu/check.py --out "$W" --layers 0 --jobs 2 --deadline-s 110 --case-timeout-s 150 \
  --only transformers-adafactor,torchtune-packed > "$W/gpu-check-full.log" 2>&1
wait
cp -r results/cuda_prediction "$W/" 2>/dev/null
echo "end at $(elapsed) s" >> "$W/timeline.txt"
mkdir -p "$OUT"; tar czf "$OUT/gpu.tgz" -C "$(dirname "$W")" w
