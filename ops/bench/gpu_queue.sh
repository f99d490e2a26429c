#!/usr/bin/env bash
# Device work longer than one call (the lent GPU machine runs a command for at most 600 s and
# is given back 30 s after a call returns): start the commands detached on the machine, then
# collect them over back-to-back calls.
#
#   bash ops/bench/gpu_queue.sh start 540 'CMD1' ['CMD2' ...]
#       writes the queue under $GPU_QUEUE (/root/q), starts it under setsid (it outlives the
#       call) and waits up to 540 s like `poll`; command n runs with OUT=$GPU_QUEUE/c<n> and
#       PERF=$GPU_QUEUE/p<n> (gpu.sh's result folders), its output in c<n>.log
#   bash ops/bench/gpu_queue.sh poll 540
#       waits up to 540 s for the queue to finish, prints its progress and packs everything
#       it wrote (traces and weights left out) into $OUT/q.tgz. Exits 3 at once on a machine
#       with no queue: the last call returned more than 30 s ago and the machine was given
#       back (a fresh one has nothing to wait for; do not spend the call waiting).
#
# E.g. (carry [".whl", ".gpu"]; the second call within 30 s of the first one's return):
#   bash ops/bench/gpu_queue.sh start 540 \
#     'GPU_TESTS=0 BENCH=perf STAGES=gputests,profile,eagle3-2048 PERF_BUDGET=1200 bash ops/bench/gpu.sh' \
#     'GPU_TESTS=0 BENCH=perf STAGES=capture bash ops/bench/gpu.sh'
#   bash ops/bench/gpu_queue.sh poll 540
set -uo pipefail
cd "$(dirname "$0")/../.."
Q=${GPU_QUEUE:-/root/q}
OUT=${OUT:-runs/gpu}

poll() {  # seconds
  [ -f "$Q/progress.txt" ] || { echo "fresh machine: no queue at $Q (the last one went with its machine)"; exit 3; }
  local end=$((SECONDS + $1))
  while [ ! -f "$Q/done" ] && [ $SECONDS -lt "$end" ]; do sleep 2; done
  cat "$Q/progress.txt"
  cat "$Q"/p*/stages.txt 2>/dev/null
  mkdir -p "$OUT"
  tar czf "$OUT/.q.tgz" -C "$Q" --exclude='*.json.gz' --exclude='*.pt' --exclude='*.safetensors' . \
    && mv "$OUT/.q.tgz" "$OUT/q.tgz"
  [ -f "$Q/done" ] && echo "queue done" || echo "queue still running: poll again within 30 s"
}

case "${1:-}" in
  start)
    [ $# -ge 3 ] || { echo "usage: $0 start SECONDS CMD [CMD ...]"; exit 2; }
    wait_s=$2; shift 2
    [ ! -f "$Q/progress.txt" ] || [ -f "$Q/done" ] || { echo "a queue is running at $Q: poll it"; exit 2; }
    rm -rf "$Q"; mkdir -p "$Q"
    {
      echo 'set -uo pipefail'
      echo "cd $(printf %q "$PWD")"
      n=0
      for cmd in "$@"; do
        n=$((n + 1))
        printf 'echo "c%s start $(date -u +%%T)" >> %q/progress.txt\n' "$n" "$Q"
        printf 'OUT=%q/c%s PERF=%q/p%s bash -c %q > %q/c%s.log 2>&1\n' "$Q" "$n" "$Q" "$n" "$cmd" "$Q" "$n"
        printf 'echo "c%s exit $? $(date -u +%%T)" >> %q/progress.txt\n' "$n" "$Q"
      done
      printf 'touch %q/done\n' "$Q"
    } > "$Q/run.sh"
    echo "queue of $# commands started $(date -u +%T)" > "$Q/progress.txt"
    setsid nohup bash "$Q/run.sh" > "$Q/queue.log" 2>&1 < /dev/null &
    poll "$wait_s" ;;
  poll)
    [ $# -eq 2 ] || { echo "usage: $0 poll SECONDS"; exit 2; }
    poll "$2" ;;
  *)
    sed -n '2,21p' "$0"; exit 2 ;;
esac
