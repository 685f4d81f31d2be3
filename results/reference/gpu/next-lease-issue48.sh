#!/bin/bash
# Issue 48's next lease, prepared on 2026-11-30 (not yet run): what the lease of that day left undone
# (h200-20261130/README.md, "For the next lease"). From the repository root, with the captcha wheel in .whl/:
#   OUT=$OUT WORK=/tmp/gw LIMIT=540 bash results/reference/gpu/next-lease-issue48.sh
# Memory first, in parallel: the captcha `cuda` tests (each case in a fresh process now), the convolution probes for
# the batch sizes the workspace table lacks, what processes hold outside the allocator. Then alone on the GPU:
# plan's front confirmed, `compare --strategies checkpoint,amp`, and `make bench DEVICE=cuda` until the deadline.
# Only tables, logs, reports and charts are packed into $OUT/gpu.tgz (the second lease of 2026-11-30 packed its
# whole folder and nothing came back).
source tools/gpu/lease_setup.sh  # $OUT, $W, elapsed, the wheels in .whl/
LIMIT=${LIMIT:-540}
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))" \
  > "$W/env.txt" 2>&1
( timeout 240 python3 -m pytest -m cuda tests/test_cuda_prediction.py -q -o addopts="" -n 6 --dist load \
    -p no:cacheprovider -rfEsx > "$W/cuda-tests.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/cuda-tests.log" ) &
for workload in unet timm:resnet18; do
  ( timeout 150 python3 tools/gpu/conv_workspace.py --out "$W/conv-${workload//:/_}-sizes.csv" --workload "$workload" \
      --strategies baseline,amp,cudnn_benchmark --phases train --batch-sizes 1,2,4,16,25,50,64,100 \
      > "$W/conv-${workload//:/_}-sizes.log" 2>&1 ) &
done
( timeout 200 python3 tools/gpu/context_memory.py --out "$W/context-memory.csv" > "$W/context-memory.log" 2>&1 ) &
wait
echo "memory done at $(elapsed) s" >> "$W/timeline.txt"
timeout 120 python3 -m bench plan --workload gpt_mini --batch-size 16 --gpu H200 --confirm-front --out "$W/plan" \
  > "$W/plan.log" 2>&1
echo "plan (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
timeout 90 python3 -m bench compare --strategies checkpoint,amp --device cuda --out "$W/compare" > "$W/compare.log" 2>&1
echo "compare (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
# make's .venv/bin/python: the machine's python3 itself (a symbolic link to a venv's python runs outside that venv)
mkdir -p .venv/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > .venv/bin/python \
  && chmod +x .venv/bin/python && touch .venv/.installed
LEFT=$(( LIMIT - 30 - $(elapsed) ))
[ "$LEFT" -gt 30 ] && timeout "$LEFT" make bench DEVICE=cuda OUT="$W/bench" > "$W/make-bench.log" 2>&1
echo "make bench (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
ls "$W/bench"/*.csv >/dev/null 2>&1 && [ ! -f "$W/bench/REPORT.md" ] && \
  timeout 20 python3 -m bench report --results "$W/bench" --budget 4GiB >> "$W/make-bench.log" 2>&1
cp -r results/cuda_prediction "$W/" 2>/dev/null
mkdir -p "$OUT"
(cd "$(dirname "$W")" && find w -type f \( -name '*.csv' -o -name '*.md' -o -name '*.log' -o -name '*.txt' \
   -o -name '*.png' -o -name '*.html' \) -size -8M -print0 | tar czf "$OUT/gpu.tgz" --null -T -)
