#!/bin/bash
# One lease of a GPU machine, prepared: its environment, the CUDA context, the `cuda`-marked tests, and every
# single-GPU anchor measured there beside its prediction (tools/gpu/check.py), at 2 layers and then a few at full size.
# Everything is written as it goes under $WORK/w and packed into $OUT/gpu.tgz at the end (one file comes back).
#   OUT=/tmp/out bash tools/gpu/session.sh      (wheels of missing packages in .whl/ are installed first)
source tools/gpu/lease_setup.sh  # $OUT, $W, elapsed, the wheels in .whl/
{
  nvidia-smi
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -m pip list 2>/dev/null | grep -iE "^(pytest|pytest-xdist|torchao|bitsandbytes|timm|pandas|tabulate) "
  nproc; free -g
} > "$W/env.txt" 2>&1
# the CUDA context as nvidia-smi sees it: the process's used memory against what the caching allocator reserved
python3 - > "$W/context.txt" 2>&1 <<'EOF'
import os, subprocess, torch
free0, total = torch.cuda.mem_get_info()
x = torch.ones((1, 1), device="cuda")
def smi():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
free1, _ = torch.cuda.mem_get_info()
print("after torch.ones((1,1)).cuda(): nvidia-smi", smi(), "MiB; reserved", torch.cuda.memory_reserved(),
      "B; mem_get_info used", (total - free1) / 2**20, "MiB; before the first tensor (context only)", (total - free0) / 2**20)
a = torch.randn(4096, 4096, device="cuda"); b = a @ a; torch.cuda.synchronize()
free2, _ = torch.cuda.mem_get_info()
print("after a float32 matmul: nvidia-smi", smi(), "MiB; reserved", torch.cuda.memory_reserved(), "B; used",
      (total - free2) / 2**20, "MiB")
a16 = a.half(); b16 = a16 @ a16; torch.cuda.synchronize()
q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward(); torch.cuda.synchronize()
free3, _ = torch.cuda.mem_get_info()
print("after float16 matmul and bf16 SDPA fwd+bwd: nvidia-smi", smi(), "MiB; reserved", torch.cuda.memory_reserved(),
      "B; used", (total - free3) / 2**20, "MiB")
EOF
echo "env done at $(elapsed) s" >> "$W/timeline.txt"
( timeout 420 python3 -m pytest -m cuda tests -q -o addopts="" -n 8 --dist load -p no:cacheprovider -rA \
    --junitxml="$W/cuda-tests.xml" > "$W/cuda-tests.log" 2>&1; echo "rc=$? at $(elapsed) s" >> "$W/cuda-tests.log" ) &
TESTS=$!
timeout 270 python3 tools/gpu/check.py --out "$W" --layers 2 --jobs 3 --deadline-s 230 --case-timeout-s 200 \
  > "$W/gpu-check-layers2.log" 2>&1
echo "layers=2 done at $(elapsed) s" >> "$W/timeline.txt"
LEFT=$(( 470 - $(elapsed) ))
if [ "$LEFT" -gt 60 ]; then
  timeout $(( LEFT + 10 )) python3 tools/gpu/check.py --out "$W" --layers 0 --jobs 2 --deadline-s $(( LEFT - 40 )) \
    --case-timeout-s $(( LEFT - 5 )) \
    --only transformers-vanilla,transformers-fp16,torchtune-baseline,torchtune-activation-checkpointing,torchtune-chunked-ce,torchao-adamw-fused,transformers-adafactor \
    > "$W/gpu-check-full.log" 2>&1
fi
echo "full size done at $(elapsed) s" >> "$W/timeline.txt"
wait $TESTS
cp -r results/cuda_prediction "$W/" 2>/dev/null
echo "end at $(elapsed) s" >> "$W/timeline.txt"
mkdir -p "$OUT"; tar czf "$OUT/gpu.tgz" -C "$(dirname "$W")" w
