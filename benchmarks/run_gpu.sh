#!/usr/bin/env bash
# Run our GPU benchmarks and the reference anchors in ONE command on one GPU, so ratios are side by side.
# Expects: ./.whl (grain, ml-collections, array-record, FLA wheels) and ./.anchors (the reference scripts)
# carried next to the tree; writes JSON and logs under $OUT.
#   usage: benchmarks/run_gpu.sh [kernels] [attention] [train] [anchors]   (default: all)
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
    fla_train) timeout 150 python3 .anchors/fla_training.py 32 gdn 2>&1 | tee "$OUT/fla_train.log" ;;
  esac
done
