#!/usr/bin/env bash
# GPU checks and benchmarks in one call, from the repository root on a CUDA machine:
#   bash bench/gpu_checks.sh [OUT_DIR]
# On the offline device machine, prepare first, here: `bash bench/gpu_prepare.sh`, then call the device with
# carry [".whl", ".gpu_model"] and the command `GRPO_COMMIT=<git rev-parse --short HEAD here> bash bench/gpu_checks.sh "$OUT"`
# (the result files record that commit where the tree has no git history).
# Setup: installs .whl/ (the Python packages the device lacks) into $GRPO_SITE and puts it on PYTHONPATH; if the
# default model is not in $GRPO_HOME (it cannot travel or be fetched there), builds one from .gpu_model/ with the
# same config and tokenizer and RANDOM weights (seed 0), and the step speed runs on that, labelled as such.
# Parts: 0) the CUDA-graph decode step's tests (tests/test_graph_decode.py, graphs on) and the bf16 packed
# update's on the device, 1) step speed bf16 on CUDA,
# ours and TRL side by side (ours alone if the TRL run fails), G = 8, MAX_NEW new tokens (default 256), at the default
# model's shapes and, if STEP_1B=1 (default), at Llama-3.2-1B's (random weights, the default model's tokenizer),
# 1b) one decode step at 16 rows: the lean forward against the CUDA-graph step and the weight-streaming floor
# (bench/decode_step.py), 2) peak memory of one GRPO step for the ~1B Llama-style model (target < 16 GB), 3) the core
# tests against the device's torch and transformers, 4) the vLLM backend smoke (only if vllm is installed), 5) the
# memory and seconds of one update step for the sizes users train (bench/memory.py --matrix: 6 models x gradient
# checkpointing x cast_lm_head_to_fp32, bf16, with the GPU estimate of docs/speed.md next to each; SIZES=0 skips it).
# Each part has its own timeout and all of them one overall deadline (TOTAL seconds, default 480); a failing part does
# not stop the others (part 5 comes last and gets what the others leave of TOTAL).
# OUT gets at most 9 files: summary.txt, log.txt (everything), tests.txt, memory.json, speed_cuda_bf16.json,
# speed_cuda_bf16_1b.json, decode_step.json, speed_vllm.json and memory_sizes.json. Knobs (environment): GRPO_COMMIT,
# PY, GRPO_HOME, GRPO_SITE, TOTAL, T_GRAPH_TESTS, T_SPEED, T_DECODE, T_MEMORY, T_TESTS, T_VLLM, T_SIZES, SIZES,
# STEP_1B, MAX_NEW, DEVICE (cuda; cpu for a dry run of the script without a GPU), STEPS, WARMUP, TRL (0: never run TRL).
set -u
OUT=${1:-${OUT:-bench-out}}
if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd); then echo "cannot create OUT=$OUT" >&2; exit 1; fi
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
TOTAL=${TOTAL:-480} T_SPEED=${T_SPEED:-150} T_MEMORY=${T_MEMORY:-100} T_TESTS=${T_TESTS:-150} T_VLLM=${T_VLLM:-120}
T_SIZES=${T_SIZES:-240} T_DECODE=${T_DECODE:-90} T_GRAPH_TESTS=${T_GRAPH_TESTS:-90}
STEPS=${STEPS:-3} WARMUP=${WARMUP:-1} MAX_NEW=${MAX_NEW:-256} STEP_1B=${STEP_1B:-1}
SITE=${GRPO_SITE:-/tmp/site}
DEFAULT_MODEL=smollm2-135m-instruct
export GRPO_HOME=${GRPO_HOME:-$PWD/.grpo_home} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
FAILED=0
TMPD=$(mktemp -d) || exit 1
trap 'rm -rf "$TMPD"' EXIT
rm -f "$OUT/summary.txt" "$OUT/speed_cuda_bf16.json" "$OUT/speed_cuda_bf16_1b.json" "$OUT/decode_step.json" \
  "$OUT/memory.json" "$OUT/speed_vllm.json" "$OUT/memory_sizes.json"

say() { echo "$*" | tee -a "$OUT/summary.txt"; }

# Seconds part may run: its own limit, cut to what is left of the overall deadline (0: none left).
limit() {
  local left=$((TOTAL - SECONDS - 10))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# run_part NAME SECONDS CMD...: runs CMD under its limit, streams its output and keeps it in $TMPD/NAME.log;
# says how it ended and counts a failure in FAILED. Returns CMD's exit status (124: timed out).
run_part() {
  local name=$1 t rc t0=$SECONDS; t=$(limit "$2"); shift 2
  if [ "$t" = 0 ]; then say "   $name: SKIPPED (overall deadline of ${TOTAL}s reached)"; : > "$TMPD/$name.log"; return 125; fi
  timeout -k 10 "$t" "$@" 2>&1 | tee "$TMPD/$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then say "   $name: TIMED OUT after ${t}s"
  elif [ "$rc" != 0 ]; then say "   $name: FAILED (exit $rc) after $((SECONDS - t0))s; see log.txt"
  else say "   $name: ok in $((SECONDS - t0))s"; fi
  return "$rc"
}

setup_packages() {
  if [ -z "$(ls .whl/*.whl 2>/dev/null)" ]; then
    say "wheels: no .whl/ here (run bench/gpu_prepare.sh and carry .whl); using the installed packages only"
    return
  fi
  # Only wheels this Python can use and does not already have (typing-extensions also if the image's is newer).
  local picked
  picked=$($PY - .whl/*.whl <<'EOF'
import importlib.metadata as md, os, sys
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
from packaging.version import Version
ours = set(sys_tags())
for f in sys.argv[1:]:
    name, version, _, tags = parse_wheel_filename(os.path.basename(f))
    try:
        have = Version(md.version(name))
    except md.PackageNotFoundError:
        have = None
    if not tags & ours:
        print(f"wheels: {os.path.basename(f)} does not fit this Python ({sys.version.split()[0]}): skipped",
              file=sys.stderr)
    elif have == version or (have is not None and have > version and name == "typing-extensions"):
        print(f"wheels: {name} {have} already installed: kept", file=sys.stderr)
    else:
        print(f)
EOF
) || { say "wheels: could not read .whl/ with $PY"; return; }
  [ -n "$picked" ] || return
  # shellcheck disable=SC2086  # wheel paths have no spaces
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $picked; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    say "wheels: installed into $SITE: $(for f in $picked; do basename "$f" | cut -d- -f1-2; done | tr '\n' ' ')"
  else
    say "wheels: pip install --target $SITE FAILED; the parts needing them (pydantic: all of ours) will fail"
  fi
}

# The model for the step speed: the real default model if it is in $GRPO_HOME, else random weights on its config
# and tokenizer (.gpu_model/), built once. Sets MODEL_ARGS and WEIGHTS.
setup_model() {
  MODEL_ARGS=() WEIGHTS=pretrained
  local real="$GRPO_HOME/models/$DEFAULT_MODEL" rand="$GRPO_HOME/models/$DEFAULT_MODEL-random-weights"
  if [ -f "$real/config.json" ] && [ -n "$(ls "$real"/*.safetensors 2>/dev/null)" ]; then
    say "model: $DEFAULT_MODEL, pretrained weights ($real)"; return
  fi
  if [ ! -f .gpu_model/config.json ]; then
    say "model: $DEFAULT_MODEL is not in $GRPO_HOME and there is no .gpu_model/ (run bench/gpu_prepare.sh, carry it)"
    WEIGHTS=none; return
  fi
  if [ ! -f "$rand/model.safetensors" ]; then
    run_part build_random_model 120 $PY bench/random_model.py .gpu_model "$rand" || { WEIGHTS=none; return; }
  fi
  MODEL_ARGS=(--model "$rand") WEIGHTS=random
  say "model: $DEFAULT_MODEL config and tokenizer with RANDOM weights ($rand): the default model cannot travel;"
  say "       figures are speed only (sampling runs to the token limit, rewards are meaningless)"
}

# A Llama-3.2-1B-shaped model with random weights (bf16) and the default model's tokenizer, for the 1B step speed.
# Sets MODEL_1B (empty where it cannot be built).
setup_model_1b() {
  MODEL_1B="$GRPO_HOME/models/llama-3.2-1b-shapes-random"
  [ -f "$MODEL_1B/model.safetensors" ] && return
  if [ ! -f .gpu_model/config.json ]; then MODEL_1B=""; return; fi
  run_part build_1b_model 180 $PY bench/random_model.py .gpu_model "$MODEL_1B" --shapes llama-3.2-1b || MODEL_1B=""
}

main() {
  say "== setup ($(date -u +%FT%TZ))"
  if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
  fi
  say "commit: ${GRPO_COMMIT:-unknown} (GRPO_COMMIT: the copy of the tree on a device machine has no git history)"
  setup_packages
  $PY - "$DEVICE" <<'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import importlib.metadata as md, platform, sys
names = ["torch", "transformers", "peft", "accelerate", "trl", "datasets", "pydantic", "pydantic-core",
         "typing-extensions", "huggingface-hub", "pyarrow", "pandas", "fsspec", "tokenizers", "pytest", "vllm"]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("python", platform.python_version(), sys.executable, "|", ", ".join(f"{n} {v(n)}" for n in names))
import torch
cuda = torch.cuda.is_available()
print("cuda:", torch.version.cuda, torch.cuda.get_device_name() if cuda else "NOT AVAILABLE")
if sys.argv[1] == "cuda" and not cuda:
    sys.exit("torch sees no CUDA device: the parts below will fail")
EOF
  setup_model

  say "== 0. the CUDA-graph decode step against the model's own forward (graphs on), the packed bf16 update on $DEVICE"
  run_part graph_tests "$T_GRAPH_TESTS" $PY -m pytest -q -p no:cacheprovider tests/test_graph_decode.py \
    "tests/test_logprobs.py::test_the_packed_lean_path_in_bf16_on_the_device"
  cat "$TMPD/graph_tests.log" > "$OUT/tests.txt"
  grep -E "passed|failed|error" "$TMPD/graph_tests.log" | tail -3 | sed 's/^/   /' | tee -a "$OUT/summary.txt"

  # step_speed MODEL_ARGS... -> part NAME with figures in JSON (ours and TRL interleaved; ours alone if TRL fails)
  step_speed() {
    local name=$1 json=$2 label=$3; shift 3
    local speed=(bench/step_speed.py --device "$DEVICE" --bf16 --steps "$STEPS" --warmup "$WARMUP"
                 --max-new-tokens "$MAX_NEW" "$@" --json "$json")
    local trl=""
    if [ "${TRL:-1}" != 0 ]; then
      if $PY -c "import trl, datasets" 2>"$TMPD/trl.err"; then trl=--trl
      else say "   TRL not importable ($(tail -1 "$TMPD/trl.err")): ours only"; fi
    fi
    run_part "$name" "$T_SPEED" $PY "${speed[@]}" $trl
    if [ ! -s "$json" ] && [ -n "$trl" ]; then
      say "   the run with TRL gave no figures: ours alone"
      run_part "${name}_ours" "$((T_SPEED / 2))" $PY "${speed[@]}"
      cat "$TMPD/${name}_ours.log" >> "$TMPD/$name.log"
    fi
    grep -E "^ +(ours|TRL)|speed-up|RSS|sampler|peak CUDA" "$TMPD/$name.log" | sed "s/^/   [$label] /" | tee -a "$OUT/summary.txt"
  }

  say "== 1. step speed on $DEVICE, bf16, G=8, $MAX_NEW new tokens, ours$( [ "${TRL:-1}" != 0 ] && echo ' vs TRL') [weights: $WEIGHTS]"
  if [ "$WEIGHTS" = none ]; then
    say "   step speed: SKIPPED (no model)"
  else
    step_speed step_speed "$OUT/speed_cuda_bf16.json" "$WEIGHTS weights" ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"}
    if [ "$WEIGHTS" = random ] && [ -s "$OUT/speed_cuda_bf16.json" ]; then
      $PY - "$OUT/speed_cuda_bf16.json" <<'EOF'
import json, sys
p = sys.argv[1]
r = json.load(open(p))
r = {"weights": "random", "weights_note": "smollm2-135m-instruct's config and tokenizer with random weights (seed 0): "
     "the pretrained weights cannot travel to this machine; speed only, completions run to the token limit", **r}
json.dump(r, open(p, "w"), indent=2)
EOF
    fi
  fi
  if [ "$STEP_1B" = 1 ]; then
    setup_model_1b
    if [ -n "$MODEL_1B" ]; then
      step_speed step_speed_1b "$OUT/speed_cuda_bf16_1b.json" "1B shapes, random weights" --model "$MODEL_1B"
    else
      say "   1B step speed: SKIPPED (no .gpu_model/ tokenizer, or the 1B model could not be built)"
    fi
  fi

  say "== 1b. one decode step, 16 rows, bf16: lean forward vs CUDA-graph step vs the weight-streaming floor"
  run_part decode_step "$T_DECODE" $PY bench/decode_step.py --device "$DEVICE" --json "$OUT/decode_step.json"
  grep -E "^(device|smollm2|llama)" "$TMPD/decode_step.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"

  say "== 2. peak memory, 1B Llama-style, LoRA, G=8, 256 new tokens, gradient checkpointing, bf16"
  run_part memory "$T_MEMORY" $PY bench/memory.py --device "$DEVICE" --json "$OUT/memory.json"
  grep -E "layers=|ESTIMATE" "$TMPD/memory.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"

  # These tests pin device=cpu: on the GPU machine they check the code against its torch/transformers versions.
  # (The CUDA-graph step's own tests ran first, in part 0.)
  say "== 3. core tests with the device's packages"
  local xdist=()
  if $PY -c "import xdist" 2>/dev/null; then xdist=(-n 4); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}; fi
  run_part tests "$T_TESTS" $PY -m pytest -q -x -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} \
    tests/test_loss.py tests/test_logprobs.py tests/test_update.py tests/test_rollout.py tests/test_policy.py \
    tests/test_lean_decode.py tests/test_learning_toy.py
  cat "$TMPD/tests.log" >> "$OUT/tests.txt"
  grep -E "passed|failed|error" "$TMPD/tests.log" | tail -3 | sed 's/^/   /' | tee -a "$OUT/summary.txt"
  unset OMP_NUM_THREADS

  if [ "$DEVICE" = cuda ] && $PY -c "import vllm" 2>/dev/null; then
    say "== 4. vLLM backend [weights: $WEIGHTS]"
    run_part vllm "$T_VLLM" $PY bench/step_speed.py --device cuda --bf16 --steps 2 --warmup 1 --backend vllm \
      ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --json "$OUT/speed_vllm.json"
    grep -E "^ +ours|RSS" "$TMPD/vllm.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
  else
    say "== 4. vLLM not installed: skipped"
  fi

  if [ "${SIZES:-1}" != 0 ]; then
    # The table of docs/speed.md "Memory of the sizes users train", here in bf16 (the CPU's is bench/results/).
    say "== 5. memory and seconds per update step of the sizes users train: LoRA, G=8, 256 new tokens, bf16"
    run_part sizes "$T_SIZES" $PY bench/memory.py --matrix --device "$DEVICE" --dtype bfloat16 --skip-generate \
      --chunk-rows 4 --json "$OUT/memory_sizes.json"
    sed -n '/^model /,$p' "$TMPD/sizes.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
  fi
  say "== done in ${SECONDS}s, $FAILED part(s) failed or timed out; figures in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  [ "$FAILED" = 0 ]
}

main 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
