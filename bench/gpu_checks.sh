#!/usr/bin/env bash
# GPU checks and benchmarks in one call (run from the repository root on a CUDA machine):
#   bash bench/gpu_checks.sh [OUT_DIR]
# 1) the core tests on CUDA (bf16 autocast paths, device selection), 2) step speed bf16 on CUDA, ours
# and TRL side by side, 3) peak memory of one GRPO step for the ~1B Llama-style model (target < 16 GB),
# 4) the vLLM backend smoke (only if vllm is installed). Each part has its own timeout; figures land in OUT.
set -u
OUT=${1:-${OUT:-bench-out}}
mkdir -p "$OUT"
PY=${PY:-python}
export GRPO_HOME=${GRPO_HOME:-$PWD/.grpo_home} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name())"

echo "== 1. core tests (device auto -> cuda)"
timeout 240 $PY -m pytest -q -x tests/test_loss.py tests/test_logprobs.py tests/test_update.py tests/test_rollout.py \
  tests/test_policy.py tests/test_learning_toy.py 2>&1 | tail -5 | tee "$OUT/tests.txt"

echo "== 2. peak memory, 1B Llama-style, LoRA, G=8, 256 new tokens, gradient checkpointing, bf16"
timeout 240 $PY bench/memory.py --device cuda --json "$OUT/memory.json" 2>&1 | grep -v Warning | tail -3 | tee "$OUT/memory.txt"

echo "== 3. step speed on CUDA, bf16 (ours vs TRL if installed)"
TRL=""; $PY -c "import trl" 2>/dev/null && TRL="--trl"
timeout 240 $PY bench/step_speed.py --device cuda --bf16 --steps 3 --warmup 1 $TRL --json "$OUT/speed_cuda_bf16.json" 2>&1 \
  | grep -E "ours|TRL|speed-up|RSS" | tee "$OUT/speed.txt"

if $PY -c "import vllm" 2>/dev/null; then
  echo "== 4. vLLM backend"
  timeout 240 $PY bench/step_speed.py --device cuda --bf16 --steps 2 --warmup 1 --backend vllm \
    --json "$OUT/speed_vllm.json" 2>&1 | grep -E "ours|RSS" | tee "$OUT/vllm.txt"
else
  echo "== 4. vLLM not installed: skipped" | tee "$OUT/vllm.txt"
fi
