#!/usr/bin/env bash
# Prepares, here (where the package index is reachable), what bench/gpu_checks.sh needs on the GPU device
# machine, which has no network at all (run from the repository root):
#   bash bench/gpu_prepare.sh
# .whl/        the py3.12 x86-64 wheels of every package the checks import that the device's image lacks
#              (gpu_checks.sh installs them with pip --no-index --target and puts them on PYTHONPATH)
# .gpu_model/  the default model's config and tokenizer files (~3.5 MB, no weights: those are ~517 MB and cannot
#              travel); gpu_checks.sh builds a model with the same shapes and tokenizer and random weights there
# Both are ignored by git, so they travel only when named in the device call's `carry`. Idempotent: wheels and
# files already in place are kept, wheels of other versions of these packages are removed.
set -u
shopt -s nullglob
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHL=.whl
MODEL_OUT=.gpu_model
DEFAULT_MODEL=smollm2-135m-instruct

# The device (Python 3.12.3, torch 2.11, transformers 5.17, accelerate 1.15, huggingface-hub 1.33, pandas,
# pyarrow, xxhash, fsspec ...) lacks these. Versions are the ones this repository's .venv runs; the import
# closure was traced there (tests of gpu_checks.sh, bench/step_speed.py --trl, bench/memory.py).
PINS=(
  pydantic==2.14.4            # grpo_core.config
  pydantic-core==2.50.5       # pydantic 2.14.4 pins exactly this
  annotated-types==0.8.0      # pydantic >=0.6.0
  typing-inspection==0.4.5    # pydantic >=0.4.4
  typing-extensions==4.16.0   # pydantic and pydantic-core need >=4.16.0; the image's may be older
  trl==1.16.0                 # step_speed.py --trl (transformers>=4.56.2, accelerate>=1.10.1: the device's fit)
  datasets==5.2.0             # trl (>=4.7.0); needs huggingface-hub>=1.31 (device: 1.33)
  dill==0.4.1                 # datasets (<0.4.2)
  multiprocess==0.70.19       # datasets (<0.70.20)
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

die() { echo "gpu_prepare: $*" >&2; exit 1; }
$PY -m pip --version >/dev/null 2>&1 || die "no pip for $PY (set PY=/path/to/python)"
mkdir -p "$WHL" || die "cannot create $WHL"

plat_args=(); for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
keep=()
for pin in "${PINS[@]}"; do
  name=${pin%%==*} version=${pin##*==}
  stem=$(echo "$name" | tr 'A-Z-' 'a-z_')-$version     # wheel file names: lower case, '-' as '_'
  keep+=("$stem")
  if compgen -G "$WHL/$stem-*.whl" >/dev/null; then
    echo "have     $(basename "$(compgen -G "$WHL/$stem-*.whl" | head -1)")"
    continue
  fi
  echo "download $pin"
  if ! $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat_args[@]}" -d "$WHL" "$pin"; then
    die "pip could not download $pin as a Python 3.12 x86-64 wheel (is the package index reachable?)"
  fi
  compgen -G "$WHL/$stem-*.whl" >/dev/null || die "pip reported success but no $stem-*.whl is in $WHL"
done

# One version of each package: a second wheel of one package makes the install on the device fail.
for f in "$WHL"/*; do
  b=$(basename "$f") ok=0
  for s in "${keep[@]}"; do [[ $b == "$s"-*.whl ]] && ok=1; done
  if [ $ok = 0 ]; then echo "remove   $b (not in the pinned set)"; rm -rf "$f"; fi
done
for f in "$WHL"/*.whl; do
  $PY -m zipfile -t "$f" >/dev/null 2>&1 || die "$f is not a valid wheel (zip); delete it and run again"
done

# The default model's small files. resolve_model fetches and converts the model once if it is not there yet.
src=$($PY -c "
import sys; sys.path.insert(0, '.')
from grpo_core.model.loading import resolve_model
print(resolve_model('$DEFAULT_MODEL'))") || die "could not resolve the default model $DEFAULT_MODEL here"
[ -f "$src/config.json" ] || die "the default model directory '$src' has no config.json"
mkdir -p "$MODEL_OUT" || die "cannot create $MODEL_OUT"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  if [ -f "$src/$f" ]; then
    cmp -s "$src/$f" "$MODEL_OUT/$f" || cp "$src/$f" "$MODEL_OUT/$f" || die "cannot copy $src/$f"
  elif [ "$f" != chat_template.jinja ]; then
    die "the default model directory '$src' has no $f"
  fi
done
echo "model files from $src -> $MODEL_OUT"

echo
echo "wheels in $WHL:"; ls -1 "$WHL"
whl_b=$(du -sb "$WHL" | cut -f1) model_b=$(du -sb "$MODEL_OUT" | cut -f1)
tree_b=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "size: $WHL $(mib "$whl_b"), $MODEL_OUT $(mib "$model_b"), working tree $(mib "${tree_b:-0}");" \
     "all that travels: $(mib $((whl_b + model_b + ${tree_b:-0}))) of the 64 MiB limit"
[ $((whl_b + model_b + ${tree_b:-0})) -lt $((64 * 1048576)) ] || die "over the device's 64 MiB limit"
echo 'carry: [".whl", ".gpu_model"]'
echo "run:   GRPO_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) bash bench/gpu_checks.sh \"\$OUT\""
