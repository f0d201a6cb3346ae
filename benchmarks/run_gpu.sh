#!/usr/bin/env bash
# Run our GPU benchmarks and the reference anchors in ONE command on one GPU, so ratios are side by side.
# Expects: ./.whl (grain, ml-collections, array-record, FLA wheels) and ./.anchors (the reference scripts)
# carried next to the tree; writes JSON and logs under $OUT.
#   usage: benchmarks/run_gpu.sh PART...   (default: kernels attention train anchors)
#   parts: kernels attention train anchors fla_train | train_all steps300 decode fla_parity (the pending checks)
# Each part has its own time limit; keep one device call under 10 minutes (e.g. 'kernels anchors' in one call,
# 'train fla_train steps300' in the next).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${*:-kernels attention train anchors}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# install this tree (maps kernels/ to hybrid_jax.kernels) without touching the image's packages
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for w in $what; do
  case $w in
    kernels)   timeout 240 python3 benchmarks/kernels.py 2>&1 | tee "$OUT/ours_kernels.log" ;;
    attention) timeout 150 python3 benchmarks/attention.py 2>&1 | tee "$OUT/ours_attention.log" ;;
    train)     timeout 200 python3 benchmarks/train_throughput.py --config configs/zebra_300m_gdn.py 2>&1 \
                 | tee "$OUT/ours_train.log" ;;
    anchors)   timeout 240 python3 .anchors/fla_kernels.py 2>&1 | tee "$OUT/fla_kernels.log"
               timeout 120 python3 .anchors/jax_attention.py 2>&1 | tee "$OUT/jax_attention.log" ;;
    fla_train) timeout 380 python3 .anchors/fla_training.py 32 gdn 2>&1 | tee "$OUT/fla_train.log" ;;
    train_all) for c in zebra_300m_kda zebra_300m_gdn_hybrid zebra_300m_mamba2_hybrid; do
                 timeout 150 python3 benchmarks/train_throughput.py --config configs/$c.py --steps 10 --warmup 2 \
                   --out "$OUT/train_$c.json" 2>&1 | tail -25 | tee "$OUT/train_$c.log"; done ;;
    steps300)  timeout 300 python3 -m hybrid_jax.train --config configs/zebra_300m_gdn.py \
                 --config.train.global_batch_size=32 --config.train.steps=300 --config.train.log_every=25 \
                 --config.train.save_every=300 --config.train.workdir=/tmp/run300 2>&1 | tee "$OUT/steps300.log"
               cp /tmp/run300/metrics.jsonl "$OUT/steps300_metrics.jsonl" ;;
    decode)    timeout 200 python3 benchmarks/decode.py --config configs/zebra_300m_gdn_hybrid.py 2>&1 \
                 | tee "$OUT/decode.log" ;;
    fla_parity) timeout 300 python3 benchmarks/fla_parity.py --out "$OUT/fla_parity.json" 2>&1 | tee "$OUT/fla_parity.log" ;;
  esac
done
