#!/usr/bin/env bash
# Every check of the single-GPU path in one go (README "On one GPU"; `make gpu-check`):
#
#   1. install what the machine lacks from wheels carried in the working tree (build/wheels/,
#      filled elsewhere by `make gpu-wheels`): bitsandbytes and pydantic's stack, nothing else —
#      the GPU path never imports polars, altair, marimo or trl (the CPU smoke run proves it by
#      making them unimportable);
#   2. the CUDA-marked tests (`pytest -m cuda`, in the files that have them);
#   3. benchmarks/bench_gpu.py on a Qwen2.5-0.5B-shaped random model: NF4 QLoRA and bf16 LoRA,
#      peak memory of policy-only training against policy + KL reference + GRM on one base,
#      rollout tokens/s at B = 64 through the fast engine and through `generate`, update tokens/s,
#      then a few iterations of recipes/gpu_qwen_qlora.yaml pointed at that model;
#   4. a summary read back through kitchen.decide (the format notebook 00's calculator reads).
#
# Results: <gpu>.json (e.g. h200.json) and gpu_check.log (plus pytest_cuda.xml) in $OUT when it is
# set, else the record in data/throughput/ and the logs in build/gpu-check/. Every step runs even
# when an earlier one failed; the exit status is 1 when any failed. At most about 8 minutes on one
# GPU: GPU_CHECK_BUDGET_S (default 450 seconds) bounds the whole run.
#
#   benchmarks/gpu_check.sh                 on a CUDA machine
#   benchmarks/gpu_check.sh --cpu --small   the same steps, small, on a CPU (tests/test_gpu_check.py)
#   benchmarks/gpu_check.sh --no-tests -- --methods nf4 --iterations 2
#                                           a shorter rerun: no tests, and these bench_gpu.py options
#   benchmarks/gpu_check.sh --wheels        here, where pip reaches PyPI: fill build/wheels/
#   benchmarks/gpu_check.sh --slim-wheel W  keep only the CUDA 13 and CPU libraries of a
#                                           bitsandbytes wheel (part of --wheels)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -n "${KITCHEN_PYTHON:-}" ]]; then PY="$KITCHEN_PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
WHEELS="${GPU_WHEELS:-build/wheels}"
# The GPU machine: Python 3.12, x86-64, CUDA 13 (../shared/NOTES.md); bitsandbytes keeps the
# libraries for this CUDA major version and its CPU one.
GPU_PYTHON="${GPU_PYTHON:-3.12}"
GPU_CUDA="${GPU_CUDA:-13}"
# What travels to the GPU machine (tracked files + carried paths) is limited to 64 MiB.
TRAVEL_LIMIT=$((64 * 1024 * 1024))
CARRIED="bitsandbytes pydantic pydantic-core annotated-types typing-inspection typing-extensions"

slim_wheel() {  # slim_wheel WHEEL: drop bitsandbytes' libraries for other CUDA/ROCm/XPU versions
  "$PY" - "$1" "^libbitsandbytes_(cpu|cuda${GPU_CUDA}[0-9]*)\.so$" <<'PYEOF'
import os, re, sys, zipfile

src, keep = sys.argv[1], re.compile(sys.argv[2])
lib = re.compile(r"libbitsandbytes_[A-Za-z0-9_.]+\.so$")
with zipfile.ZipFile(src) as zin:
    names = zin.namelist()
    drop = {n for n in names if lib.search(n) and not keep.search(n.rsplit("/", 1)[-1])}
    tmp = src + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # the list of files must match
                rows = data.decode().splitlines(keepends=True)
                data = "".join(r for r in rows if r.split(",", 1)[0] not in drop).encode()
            zout.writestr(info, data)
os.replace(tmp, src)
kept = sorted(n.rsplit("/", 1)[-1] for n in names if lib.search(n) and n not in drop)
print(f"{os.path.basename(src)}: kept {', '.join(kept)}; dropped {len(drop)} libraries")
PYEOF
}

download_wheels() {  # the exact versions installed here (the ones the tests ran with)
  local pins
  pins=$("$PY" -c 'import importlib.metadata as m, sys
print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' $CARRIED) || {
    echo "gpu_check: cannot read the installed versions of: $CARRIED (run make install first)"; return 1; }
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || return 1
  echo "gpu_check: downloading $pins for CPython $GPU_PYTHON, manylinux x86-64 → $WHEELS"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" $pins || return 1
  for w in "$WHEELS"/bitsandbytes-*.whl; do slim_wheel "$w" || return 1; done
  local wheels tracked
  wheels=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
  tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  awk -v n="$(ls "$WHEELS"/*.whl | wc -l)" -v w="$wheels" -v t="$tracked" -v l="$TRAVEL_LIMIT" \
    'BEGIN { printf "gpu_check: %d wheels, %.1f MiB; with the tracked files %.1f MiB of the %d MiB that travel\n", n, w / 2^20, (w + t) / 2^20, l / 2^20 }'
  if (( wheels + tracked > TRAVEL_LIMIT )); then
    echo "gpu_check: too large to travel: carry fewer wheels"; return 1
  fi
}

CPU=0 SMALL=0 TESTS=1 BENCH_ARGS=() ARGS=("$@")
case "${1:-}" in
  --wheels) download_wheels; exit $? ;;
  --slim-wheel) slim_wheel "$2"; exit $? ;;
esac
while (( $# )); do
  case "$1" in
    --cpu) CPU=1 ;;
    --small) SMALL=1 ;;
    --no-tests) TESTS=0 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "gpu_check: unknown option $1 (see the header of $0)"; exit 2 ;;
  esac
  shift
done

if [[ -n "${OUT:-}" ]]; then RESULTS="$OUT" LOGS="$OUT"
elif (( CPU || SMALL )); then RESULTS=build/gpu-check-cpu LOGS=build/gpu-check-cpu
else RESULTS=data/throughput LOGS=build/gpu-check; fi
mkdir -p "$RESULTS" "$LOGS"
LOG="$LOGS/gpu_check.log"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
START=$SECONDS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KITCHEN_RUNS="${KITCHEN_RUNS:-$(mktemp -d)}"  # nothing lands in runs/
FAILED=()

step() { echo; echo "=== gpu_check [$((SECONDS - START)) s] $*"; }
left() { echo $((BUDGET - (SECONDS - START))); }

main() {
  step "environment"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')); the library" \
    "versions are in the record's 'hardware'"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi

  step "1. dependencies the kit needs here"
  if "$PY" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(n) is None for n in ("pydantic", "bitsandbytes")))'; then
    echo "pydantic and bitsandbytes are installed: nothing to install"
  elif compgen -G "$WHEELS/*.whl" >/dev/null; then
    local site="${GPU_SITE:-/tmp/kitchen-site}"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$WHEELS"/*.whl; then
      export PYTHONPATH="$site:$PYTHONPATH"
      echo "installed into $site: $(ls "$WHEELS" | tr '\n' ' ')"
      "$PY" -c 'import pydantic, bitsandbytes, kitchen.train; print("kitchen.train imports")' \
        2> >(grep -v "gemm_4bit_forward" >&2) || FAILED+=("imports")
    else
      FAILED+=("install")
    fi
  else
    echo "pydantic or bitsandbytes is missing and $WHEELS/ holds no wheels: run"
    echo "'make gpu-wheels' where pip reaches PyPI and carry $WHEELS to this machine"
    FAILED+=("install")
  fi

  step "2. the CUDA-marked tests"
  local files
  if (( ! TESTS )); then echo "skipped (--no-tests)"; fi
  files=$(grep -l "pytest.mark.cuda" tests/test_*.py | tr '\n' ' ')
  echo "files: $files"
  if (( ! TESTS )); then :
  elif (( CPU )); then  # no GPU: check that the selection collects (the tests skip without CUDA)
    # shellcheck disable=SC2086
    "$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider $files | tail -3 \
      || FAILED+=("pytest -m cuda (collect)")
  else
    # test_gpu_memory_of_shared_base runs bench_gpu.py, which step 3 runs anyway.
    # shellcheck disable=SC2086
    timeout 180 "$PY" -m pytest -m cuda -q -rA -p no:cacheprovider $files \
      --deselect tests/test_train.py::test_gpu_memory_of_shared_base \
      --junitxml "$LOGS/pytest_cuda.xml" || FAILED+=("pytest -m cuda")
  fi

  step "3. bench_gpu.py (budget $(left) s)"
  local args=(--out-dir "$RESULTS" --command "benchmarks/gpu_check.sh $*")
  if (( CPU )); then args+=(--cpu --without polars,altair,marimo,trl,vl_convert); fi
  if (( SMALL )); then args+=(--small --iterations 2 --recipe-iterations 1); fi
  args+=("${BENCH_ARGS[@]}")  # the caller's options come last and win
  # It stops starting new work a minute before the budget ends, and is killed at the end. The
  # record is rewritten after every phase, so a run cut short keeps what it measured.
  local marker budget
  marker=$(mktemp) budget=$(( $(left) > 90 ? $(left) - 60 : 30 ))
  timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PY" benchmarks/bench_gpu.py "${args[@]}" \
    --budget-s "$budget" || FAILED+=("bench_gpu.py")

  step "4. summary"
  local record
  record=$(find "$RESULTS" -maxdepth 1 -name '*.json' -newer "$marker" | head -1)
  rm -f "$marker"
  if [[ -z "$record" ]]; then
    echo "no record was written"; FAILED+=("record")
  else
    "$PY" - "$record" <<'PYEOF' 2> >(grep -v "gemm_4bit_forward" >&2) || FAILED+=("record")
import json, sys

from kitchen.decide import read_throughput

path = sys.argv[1]
doc, rec = json.loads(open(path).read()), read_throughput(path)
print(f"{path}: {rec.device}, {rec.model}, {rec.parameters:,} parameters")
print(f"  phases: {doc['phases']}")
print(f"  rollout {rec.rollout_tokens_per_s:,.0f} tokens/s, update {rec.update_tokens_per_s:,.0f} "
      f"tokens/s, {rec.reviews_per_s or 0:.2f} reviews/s (medians after warm-up)")
for key in ("rollout_fast_tokens_per_s", "rollout_generate_tokens_per_s", "fast_over_generate",
            "peak_gb_policy_only", "peak_gb_policy_ref_grm", "ratio", "qlora_vs_lora"):
    if key in doc:
        print(f"  {key}: {doc[key]}")
if doc.get("ratio") is not None:
    print(f"  shared base: {doc['ratio']:.2f}x policy-only memory (goal <= 1.2x): "
          + ("met" if doc["ratio"] <= 1.2 else "NOT met"))
bad = [k for k, v in doc["phases"].items() if not v.startswith("ok")]
sys.exit(f"phases not ok: {bad}" if bad else 0)
PYEOF
  fi

  step "done in $((SECONDS - START)) s"
  if (( ${#FAILED[@]} )); then echo "failed: ${FAILED[*]}"; return 1; fi
  echo "all steps passed"
}

main "${ARGS[@]}" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
