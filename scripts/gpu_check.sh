#!/usr/bin/env bash
# The GPU check of issues 23 and 36: one command for a machine with one NVIDIA GPU, or two of one type
# (steps 1-3 use the first; the serve step plans and serves them all).
#
#   bash scripts/gpu_check.sh [--dry-run] [--mps] [--wheels DIR] [--out DIR] [--work DIR] [--reps N] [--levels 1,2,3,4]
#                             [--steps profile,serve,chain,handoff] [--gpu-type H100] [--profile-budget-s 150]
#
# What it prints, in <= 8 minutes on one or two GPUs (the time limits below add up to 8 minutes):
#   0. the GPU tests: pytest -m gpu over the files that hold them;
#   1. the built-in ResNet-50, Inception-v2 and DenseNet-121 profiled on this GPU with the
#      torch backend (batches 1-8, every level the spec sheet offers; MPS levels where an MPS
#      daemon runs, time-sliced otherwise, as the provenance says), next to the roofline's
#      estimate for this GPU type (median and p90 error), then the roofline calibrated for
#      this GPU type on these timings (roofline_<type>.json in --out);
#  1c. serve: ResNet-50 and Inception-v2 planned on the local-gpu cluster (this machine's GPUs) with
#      step 1's profiles, served by `ppipe serve --launcher local --backend torch` (no Ray), one
#      answer checked against onnxruntime on the CPU, then both models driven by `ppipe bench
#      --binary` at 0.5, 0.8 and 1.0 of the plan's rate: each point's SLO attainment next to
#      `ppipe simulate`'s for the same plan and profiles (at most 150 s, its own limit);
#   2. each model's blocks chained on the GPU against the whole model on the CPU: fp32, and
#      fp16 served as two partitions with CUDA graphs (top-1 agreement, max error);
#   3. a two-worker handoff on one GPU by CUDA IPC (bytes equal, latency).
# --mps starts an MPS control daemon (nvidia-cuda-mps-control -d) for steps 1 and 1c and stops it
# after: the levels are then the PPipe paper's vGPUs. Steps 0, 2 and 3 run without it.
# The JSON summary goes to --out (default $OUT when set, else gpu_check_out)/gpu_check.json; the
# profiles and block files to --work (default $TMPDIR/ppipe-gpu-check), which stays out of $OUT.
#
# What the machine needs: python3 with torch (a CUDA build), onnx, onnxruntime, onnxscript,
# numpy, scipy, click, PyYAML, rich, tqdm, pytest, httpx, nvidia-ml-py: the device machines of this
# workplace have them. ppipe also needs pydantic, and `ppipe serve` (step 1c) uvicorn, starlette,
# httptools, msgspec and orjson, which they lack: carry their wheels and pass --wheels DIR.
# They are installed with pip --no-index --no-deps --target into a folder put on PYTHONPATH
# (nothing is fetched; the machine has no network). Fetch them here, for Python 3.12 x86-64:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions==4.16.0 \
#     uvicorn==0.55.0 starlette==1.10.0 httptools==0.9.0 msgspec==0.23.0 orjson==3.13.0
#
# (about 3.9 MB). --dry-run does no GPU work: it checks the packages, the models and the
# spec sheet, builds the serve step's commands and has the ppipe CLI parse them, and says what
# each step would do and what it skips; CI runs it. `python scripts/gpu_check.py
# --rehearse-serve-on-cpu` runs the serve step alone on the CPU (local-cpu, --backend ort).
set -u -o pipefail

DRY_RUN=0
MPS=0
WHEELS=""
OUT_DIR="${OUT:-gpu_check_out}"
WORK_DIR="${TMPDIR:-/tmp}/ppipe-gpu-check"
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; PASS+=(--dry-run) ;;
    --mps) MPS=1 ;;
    --wheels) WHEELS="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    --work) WORK_DIR="$2"; shift ;;
    --reps|--levels|--steps|--gpu-type|--profile-budget-s) PASS+=("$1" "$2"); shift ;;
    -h|--help) sed -n '2,44p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
PY="${PYTHON:-python3}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PPIPE_CACHE="${PPIPE_CACHE:-$WORK_DIR/cache}"
T0=$(date +%s)

say() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }

# -- carried wheels (pydantic and its kin) ------------------------------------------------------------
if [ -n "$WHEELS" ]; then
  if [ "$DRY_RUN" = 1 ]; then
    say "would install $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels from $WHEELS into a --target folder on PYTHONPATH"
  else
    SITE="${TMPDIR:-/tmp}/ppipe-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$SITE:$PYTHONPATH"
    say "installed the wheels of $WHEELS into $SITE"
  fi
fi
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  if [ "$DRY_RUN" = 1 ]; then
    say "pydantic is missing here: on the device machine pass --wheels DIR (see the top of this script)"
  else
    say "pydantic is missing: carry its wheels and pass --wheels DIR (see the top of this script)"; exit 2
  fi
fi

# -- 0. the GPU tests ---------------------------------------------------------------------------------------
# every test file that holds a GPU test (pytest collects only what it is given: the rest of the suite needs Ray)
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' "pytest.mark.gpu" tests | sort)
if [ "$DRY_RUN" = 1 ]; then
  say "would run: $PY -m pytest -q -m gpu ${GPU_TESTS[*]} (skipped: dry run)"
else
  say "== 0. pytest -m gpu"
  timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}"
  say "pytest -m gpu exit status $?"
fi

# -- 1-3. profile, chain, handoff -----------------------------------------------------------------------------
rm -f "$OUT_DIR/gpu_check.json"
if [ "$DRY_RUN" = 1 ] || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  [ "$MPS" = 1 ] && say "would start an MPS control daemon for steps 1 and 1c (skipped: $([ "$DRY_RUN" = 1 ] && echo "dry run" || echo "no CUDA device"))"
  timeout 120 "$PY" scripts/gpu_check.py --out "$OUT_DIR" --work "$WORK_DIR" "${PASS[@]}"
  rc=$?
elif [ "$MPS" = 1 ]; then
  CTL="$(command -v nvidia-cuda-mps-control || true)"
  if [ -z "$CTL" ] || ! timeout 20 "$CTL" -d; then
    say "--mps: no MPS control daemon could be started (nvidia-cuda-mps-control ${CTL:-not found})"; exit 2
  fi
  say "started an MPS control daemon for steps 1 and 1c"
  timeout 330 "$PY" scripts/gpu_check.py --out "$OUT_DIR" --work "$WORK_DIR" "${PASS[@]}" --steps profile,serve
  rc=$?
  echo quit | timeout 10 "$CTL"
  say "stopped the MPS control daemon"
  timeout 60 "$PY" scripts/gpu_check.py --out "$OUT_DIR" --work "$WORK_DIR" "${PASS[@]}" --steps chain,handoff --merge
  rc2=$?
  [ "$rc" = 0 ] && rc=$rc2
else
  timeout 390 "$PY" scripts/gpu_check.py --out "$OUT_DIR" --work "$WORK_DIR" "${PASS[@]}"
  rc=$?
fi
say "done (exit status $rc) in $(( $(date +%s) - T0 )) s"
exit $rc
