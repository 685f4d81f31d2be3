#!/bin/bash
# The lease of 2026-11-30 (issue 48), run from the repository root: first everything whose figure is memory, in
# parallel (each process has its own allocator); then, alone on the GPU, everything whose figure is time.
#   A. the captcha `cuda` tests (every strategy, train and eval, batch 8 and 32; results/cuda_prediction/);
#      UNet and timm resnet18 measured beside predict (tools/gpu/check.py), with the allocator's history at the
#      peak for some, C++ frames for two; plan's 16-bit front of gpt_mini at batch 16 the same way;
#      every convolution call's bytes beyond its outputs (tools/gpu/conv_workspace.py), cudnn.benchmark off and on;
#      what the process holds outside the caching allocator after each library's work (tools/gpu/context_memory.py).
#   B. alone: 32 of plan's gpt_mini candidates timed by `compare --no-isolate`; `compare --strategies
#      checkpoint,amp --device cuda`; `make bench DEVICE=cuda` (until the lease's deadline) and its report.
# Everything lands in $W as it goes and is packed into $OUT/gpu.tgz at the end.
source tools/gpu/lease_setup.sh  # $OUT, $W, elapsed, the wheels in .whl/
LIMIT=${LIMIT:-520}
{
  nvidia-smi
  python3 -c "import torch, torchvision, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), 'torchvision', torchvision.__version__, 'timm', timm.__version__)"
  nproc; free -g
} > "$W/env.txt" 2>&1
echo "env at $(elapsed) s" >> "$W/timeline.txt"

# --- A: memory, in parallel -------------------------------------------------------------------------------------
( timeout 170 python3 -m pytest -m cuda tests/test_cuda_prediction.py -q -o addopts="" -n 5 --dist load \
    -p no:cacheprovider -rfEsx > "$W/cuda-tests.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/cuda-tests.log" ) &
CNN_CASES=""
for workload in unet timm:resnet18; do
  for strategy in baseline amp checkpoint cudnn_benchmark grad_accumulation inplace_relu checkpoint+amp; do
    for batch in 8 32; do
      CNN_CASES="$CNN_CASES --case $workload,$strategy,train,$batch"
    done
  done
  for strategy in baseline no_grad_eval amp; do
    for batch in 8 32; do CNN_CASES="$CNN_CASES --case $workload,$strategy,eval,$batch"; done
  done
done
FRONT="amp:dtype=bfloat16 checkpoint:segments=sqrt+amp:dtype=bfloat16 checkpoint+amp:dtype=bfloat16 checkpoint:segments=all+amp:dtype=bfloat16 checkpoint:segments=all+offload+amp:dtype=bfloat16 offload_activations+amp:dtype=bfloat16 offload+amp:dtype=bfloat16 amp:dtype=float16 checkpoint+amp:dtype=float16 baseline"
GPT_CASES=""; GPT_SNAP=""
for strategy in $FRONT; do
  GPT_CASES="$GPT_CASES --case gpt_mini,$strategy,train,16"; GPT_SNAP="$GPT_SNAP,gpt_mini $strategy train 16"
done
SNAP="unet baseline train 32,unet amp train 32,timm:resnet18 baseline train 32,timm:resnet18 amp train 32,captcha_resnet18 grad_accumulation train 32,captcha_resnet18 baseline train 32,captcha_resnet18 amp train 32,captcha_resnet18 baseline eval 8$GPT_SNAP"
( timeout 200 python3 tools/gpu/check.py --out "$W/check" --no-anchors --jobs 5 --deadline-s 180 --case-timeout-s 120 \
    $GPT_CASES --case captcha_resnet18,grad_accumulation,train,32 --case captcha_resnet18,baseline,train,32 \
    --case captcha_resnet18,amp,train,32 --case captcha_resnet18,baseline,eval,8 $CNN_CASES \
    --snapshot "$SNAP" --stacks "gpt_mini amp:dtype=bfloat16 train 16,captcha_resnet18 grad_accumulation train 32" \
    > "$W/check.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/check.log" ) &
for workload in captcha_resnet18 unet timm:resnet18; do
  name=${workload//:/_}
  ( timeout 150 python3 tools/gpu/conv_workspace.py --out "$W/conv-$name.csv" --workload "$workload" \
      --strategies baseline,amp,amp:dtype=bfloat16,cudnn_benchmark,bf16_weights --batch-sizes 8,32 \
      > "$W/conv-$name.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/conv-$name.log" ) &
done
( timeout 150 python3 tools/gpu/conv_workspace.py --out "$W/conv-captcha_resnet18-sizes.csv" \
    --workload captcha_resnet18 --strategies baseline,cudnn_benchmark,amp --phases train --batch-sizes 1,2,4,16,25,50,64,100,128,200,400 \
    > "$W/conv-sizes.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/conv-sizes.log" ) &
( CUDNN_CONV_WSCAP_DBG=1 timeout 100 python3 tools/gpu/conv_workspace.py --out "$W/conv-captcha_resnet18-wscap1.csv" \
    --workload captcha_resnet18 --strategies baseline,cudnn_benchmark --phases train --batch-sizes 32 \
    > "$W/conv-wscap.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/conv-wscap.log" ) &
( timeout 170 python3 tools/gpu/context_memory.py --out "$W/context-memory.csv" > "$W/context-memory.log" 2>&1;
  echo "rc=$? at $(elapsed) s" >> "$W/context-memory.log" ) &
wait
echo "A (memory) done at $(elapsed) s" >> "$W/timeline.txt"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$W/timeline.txt" 2>&1

# --- B: time, alone on the GPU ----------------------------------------------------------------------------------
CANDIDATES="baseline,bf16_weights,amp:dtype=bfloat16,checkpoint:segments=sqrt+amp:dtype=bfloat16,selective_checkpoint+amp:dtype=bfloat16,checkpoint+amp:dtype=bfloat16,amp:dtype=float16+chunked_loss,checkpoint:segments=all+amp:dtype=bfloat16,checkpoint:segments=sqrt+amp:dtype=bfloat16+chunked_loss,selective_checkpoint+amp:dtype=bfloat16+chunked_loss,checkpoint+amp:dtype=bfloat16+chunked_loss,checkpoint:segments=all+amp:dtype=float16+chunked_loss,selective_checkpoint+offload+amp:dtype=bfloat16,checkpoint:segments=all+offload_activations+amp:dtype=float16,checkpoint:segments=all+offload+amp:dtype=bfloat16,optimizer:impl=foreach,selective_checkpoint,chunked_loss,selective_checkpoint:policy=matmul+chunked_loss,checkpoint:segments=sqrt,grad_accumulation,checkpoint:segments=all,selective_checkpoint+offload_activations+chunked_loss,optimizer:impl=for_loop,checkpoint:segments=all+offload_activations+chunked_loss,checkpoint+offload_activations,checkpoint+offload+chunked_loss,offload_activations+amp:dtype=bfloat16,offload+amp:dtype=bfloat16,offload_activations+amp:dtype=float16+chunked_loss,offload_activations,offload+chunked_loss"
timeout 110 python3 -m bench compare --workload gpt_mini --batch-size 16 --device cuda --phases train --no-isolate \
  --strategies "$CANDIDATES" --out "$W/plan_times" > "$W/plan-times.log" 2>&1
echo "plan candidates timed (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
timeout 60 python3 -m bench compare --strategies checkpoint,amp --device cuda --out "$W/compare" \
  > "$W/compare.log" 2>&1
echo "compare (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
# make's .venv/bin/python: the machine's python3 itself (a symbolic link to a venv's python runs outside that venv);
# lease 1 ran with the link, and make bench found no torch
mkdir -p .venv/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > .venv/bin/python \
  && chmod +x .venv/bin/python && touch .venv/.installed
LEFT=$(( LIMIT - 25 - $(elapsed) ))
if [ "$LEFT" -gt 30 ]; then
  if command -v make >/dev/null; then
    timeout "$LEFT" make bench DEVICE=cuda OUT="$W/bench" > "$W/make-bench.log" 2>&1
  else  # the two commands of the Makefile's bench target
    echo "no make on this machine: the bench target's commands" > "$W/make-bench.log"
    timeout "$LEFT" python3 -m bench run --suite bench/suites/default.yaml --device cuda --out "$W/bench" \
      >> "$W/make-bench.log" 2>&1 && python3 -m bench report --results "$W/bench" --budget 4GiB >> "$W/make-bench.log" 2>&1
  fi
  echo "make bench (rc=$?) at $(elapsed) s" >> "$W/timeline.txt"
  ls "$W/bench"/*.csv >/dev/null 2>&1 && [ ! -f "$W/bench/REPORT.md" ] && \
    timeout 20 python3 -m bench report --results "$W/bench" --budget 4GiB >> "$W/make-bench.log" 2>&1
fi
cp -r results/cuda_prediction "$W/" 2>/dev/null
echo "end at $(elapsed) s" >> "$W/timeline.txt"
mkdir -p "$OUT"; tar czf "$OUT/gpu.tgz" -C "$(dirname "$W")" w
