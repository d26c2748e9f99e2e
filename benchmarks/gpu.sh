#!/usr/bin/env bash
# The GPU check of vllm-hs: on a CUDA machine with access to PyPI, from the
# repository root, in one go (aim: under 10 minutes, most of it pip installs):
#   1. a fresh virtual environment with upstream vllm==0.32.0 (CUDA) and vllm-hs
#      with its [extract,test] extras;
#   2. the patched wheel: vllm-hs wheel --vllm vllm==0.32.0 --install; status;
#   3. tests/engine/test_gpu.py (Model Runner V2, both engine modes, against
#      HF), JUnit XML into the results;
#   4. the benchmark suites on a Llama-3.1-8B-shaped model (dummy weights,
#      bf16, compiled with CUDA graphs) on Model Runner V2 (vLLM's GPU default,
#      forced; hidden states are an AuxOutput kind, which needs it: an engine
#      on Model Runner V1 refuses hidden_states_config), into
#      benchmarks/results/v0.32.0-gpu/mrv2/.
# Commit what lands under the results folder.
#
# Usage: benchmarks/gpu.sh [--dry-run] [--venv DIR] [--out DIR] [--suites LIST]
#                          [--rounds N] [--skip-install] [--skip-tests]
#   --dry-run       print every step's command, run nothing (CPU check of the
#                   script: tests/test_gpu_script.py)
#   --venv DIR      the environment to create or reuse (default: .venv-gpu)
#   --out DIR       results root (default: benchmarks/results/v0.32.0-gpu)
#   --suites LIST   benchmark suites (default: capture,decode,transport,native)
#   --rounds N      alternating rounds per suite (default: 3)
#   --skip-install  reuse --venv as it is (a second run on the same machine)
#   --skip-tests    benchmarks only
#
# Not runnable on this project's lent H200 (see its device notes): that
# machine reaches no package index, holds no vLLM, and its torch (2.11) is not
# the one vLLM 0.32.0 is built against; the wheels needed exceed what a call
# can carry (64 MiB). Run it on a CUDA machine with PyPI access.
set -euo pipefail

VLLM_SPEC="vllm==0.32.0"
SHAPE="llama-3.1-8b"
VENV=".venv-gpu"
OUT="benchmarks/results/v0.32.0-gpu"
SUITES="capture,decode,transport,native"
ROUNDS=3
DRY=0
INSTALL=1
TESTS=1

usage() { sed -n '/^# Usage:/,/^#   --skip-tests/p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --venv) VENV="${2:?--venv needs a directory}"; shift ;;
    --out) OUT="${2:?--out needs a directory}"; shift ;;
    --suites) SUITES="${2:?--suites needs a list}"; shift ;;
    --rounds)
      ROUNDS="${2:?--rounds needs a number}"; shift
      [[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds: not a positive number: $ROUNDS" >&2; exit 2; } ;;
    --skip-install) INSTALL=0 ;;
    --skip-tests) TESTS=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { echo "== $*"; }
run() {
  # Print the command; run it unless --dry-run.
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY -eq 0 ]]; then "$@"; fi
}

PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_HS_CACHE="${VLLM_HS_CACHE:-$PWD/.gpu-cache}"
started=$SECONDS

if [[ $DRY -eq 0 ]]; then
  command -v nvidia-smi >/dev/null || { echo "gpu.sh: no nvidia-smi: not a CUDA machine" >&2; exit 1; }
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi

if [[ $INSTALL -eq 1 ]]; then
  step "environment $VENV: upstream $VLLM_SPEC (CUDA), vllm-hs[extract,test]"
  run python3 -m venv "$VENV"
  run "$PY" -m pip install -q --upgrade pip
  run "$PY" -m pip install -q "$VLLM_SPEC"
  run "$PY" -m pip install -q ".[extract,test]"
  step "patched wheel"
  run "$VENV/bin/vllm-hs" wheel --vllm "$VLLM_SPEC" --out dist --install
fi
run "$VENV/bin/vllm-hs" status

if [[ $TESTS -eq 1 ]]; then
  step "tests/engine/test_gpu.py (MRV2, in-process and multiprocess)"
  run env VLLM_HS_EXPECT_PATCHED=1 "$PY" -m pytest -q tests/engine/test_gpu.py \
    --junitxml "$OUT/test_gpu.xml"
fi

step "model shape $SHAPE (config only: --load-format dummy)"
MODEL="$VLLM_HS_CACHE/shapes/$SHAPE"
run "$PY" -m benchmarks.model_shapes "$SHAPE" "$MODEL"

step "suites $SUITES on mrv2"
run env VLLM_USE_V2_MODEL_RUNNER=1 "$PY" -m benchmarks run \
  --suites "$SUITES" --model "$MODEL" --load-format dummy --dtype bfloat16 \
  --compile --prompts 32 --prompt-len 1024 --max-tokens 32 \
  --rounds "$ROUNDS" --out "$OUT/mrv2"

step "done in $((SECONDS - started)) s; results under $OUT"
