#!/usr/bin/env bash
# Run our GPU benchmarks and the reference's in ONE command, each pair on the same GPU, so ratios are side by side.
# Expects: ./.whl (grain, ml-collections, array-record, tensorboardX, FLA wheels) and ./.anchors (the reference's
# anchor scripts) carried next to the tree; writes JSON and logs under $OUT.
#   usage: benchmarks/run_gpu.sh PART... [// PART... ...]
# Groups separated by '//' run at the same time, group i on GPU i (CUDA_VISIBLE_DEVICES=i), at most one group per GPU
# (JAX jobs sharing a GPU run out of memory); the parts of a group run one after the other on its GPU. A part
# NAME=VALUE sets an environment variable for the group's later parts ('+' in VALUE becomes a space), e.g.
# 'KDA_SHAPES=kda_300m+kda_1b kda'; OUT=NAME writes the group's later parts under $OUT/NAME. Parts (each has its own
# time limit):
#   kernels fla_ref          our recurrent kernels / FLA's at the same shapes (benchmarks/shapes.py)
#   fla_ref_rest             FLA at the shapes its autotuning left out of fla_ref (FLA KDA: fla_ref_kda, env
#                            FLA_KDA_SHAPES: a subset of its three shapes; FLA's autotuning takes minutes per shape)
#   kda kda_autotune         our KDA kernels (the table's chunk, chunks 32/64, fused or split gradient pass) beside our
#                            GDN (env KDA_SHAPES, KDA_VARIANTS: set and empty for none); a launch sweep at KDA
#                            shapes (env KDA_TUNE_SHAPES, KDA_TUNE_BUDGET seconds, KDA_START, e.g. chunk=64: from
#                            that entry, KDA_TUNE_FIELDS: only these fields, in this order); KDA_TIMEOUT: kda's limit
#                            in seconds (default 300); KDA_TRACE=DIR: also trace each shape's and each variant's
#                            forward+backward there and print where the device time goes
#   attention sdpa           our attention vs cuDNN / PyTorch SDPA at the same shapes
#   anchors                  the reference's own anchor scripts (FLA kernels + SDPA, JAX attention)
#   train train_kda train_hybrids train_1b    our training throughput (300M GDN, 300M KDA, 300M hybrids, 1B GDN)
#   train_kda_chunks         300M KDA at chunk 32 and 64 (model.chunk_size)
#   profile                  300M GDN / KDA / Mamba2 hybrid throughput (env PROFILE_CONFIGS picks), then a traced
#                            step summary (top device ops)
#   fla_train fla_train_kda  FLA's 300M GDN / KDA training (the reference's anchor script)
#   small_ops sublayers max_batch             fused-op roofline, time per sublayer kind, largest micro-batch
#   fits fits_remat          real steps at growing micro-batches, per config up to the first size that fails, without
#                            remat / with full remat (env FITS_PLAN / FITS_REMAT_PLAN: "CONFIG=SIZE,SIZE... ...",
#                            defaults 300M GDN 96-128 and 1B GDN 32-48 / 300M GDN 192-320 and 1B GDN 64-128)
#   steps300 decode fla_parity loss_parity    a 300-step run, decoding, FLA-side parity, 200-step loss parity
#                            (env PARITY_REFERENCE fla|hf, PARITY_BATCH; PARITY_DATA: token shards from
#                            'python -m hybrid_jax.prepare', carried, instead of mock batches; with fla, FLA's Hopper
#                            guard is lifted only if its kernel passes loss_parity's check; PARITY_REFERENCE_LOSSES:
#                            the reference curve of an earlier run, loss_parity_fla_reference.json, instead of
#                            training the reference again)
#   scaling                  300M GDN on one GPU, then data parallel on all GPUs with and without ZeRO-1
set -uo pipefail
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}  # where the wheels and this tree are installed; BENCH: where benchmarks/ is linked
BENCH=${BENCH:-/tmp/bench}  # (other values let two trees' runs share a machine)
if [ ! -e "$SITE/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  touch "$SITE/.installed"
fi
# this tree (maps kernels/ to hybrid_jax.kernels), without touching the image's packages; every run, so that a second
# run on the same machine times the tree as it is now, not as it was at the first
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . >/dev/null
# the installed tree, not the source checkout, must be what 'import hybrid_jax' finds (the source has no
# hybrid_jax.kernels): no current directory on sys.path; benchmarks importable from a side folder
mkdir -p "$BENCH" && ln -sfn "$PWD/benchmarks" "$BENCH/benchmarks"
export PYTHONSAFEPATH=1
export PYTHONPATH=$SITE:$BENCH:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1

ours_train() {  # config, extra flags...
  local c=$1; shift
  timeout 200 python3 -m benchmarks.train_throughput --config "configs/$c.py" --steps 10 --warmup 2 \
    --out "$OUT/train_$c.json" "$@" 2>&1 | tail -120 | tee "$OUT/train_$c.log"
}

fits() {  # remat, "CONFIG=SIZE,SIZE..." entries: real train steps at each size until one fails (out of memory)
  local remat=$1 entry c sizes m; shift
  for entry in "$@"; do
    c=${entry%%=*}; sizes=${entry#*=}
    for m in ${sizes//,/ }; do
      echo "--- fits $c micro-batch $m remat $remat $(date +%T)"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 ours_train "$c" --config.train.micro_batch_size="$m" --steps 3 --warmup 1 \
        --config.model.remat="$remat" --out "$OUT/fits_${c}_remat_${remat}_m$m.json" || break
    done
  done
}

run_part() {
  case $1 in
    kernels)   timeout 330 python3 -m benchmarks.kernels --other-grad 2>&1 | tee "$OUT/ours_kernels.log" ;;
    fla_ref)   timeout 270 python3 -m benchmarks.fla_reference --no-attention 2>&1 | tee "$OUT/fla_reference.log" ;;
    fla_ref_rest) timeout 560 python3 -m benchmarks.fla_reference --no-attention --only ssd_anchor gdn_300m gdn_1b \
                 mamba2_300m kda_anchor kda_300m kda_1b 2>&1 | tee "$OUT/fla_reference_rest.log" ;;
    fla_ref_kda) # shellcheck disable=SC2086
               timeout 560 python3 -m benchmarks.fla_reference --no-attention \
                 --only ${FLA_KDA_SHAPES:-kda_anchor kda_300m kda_1b} 2>&1 | tee "$OUT/fla_reference_kda.log" ;;
    kda)       local v variants=()
               for v in ${KDA_VARIANTS-chunk=32 chunk=64 chunk=32,split_grad_from=none split_grad_from=none}; do
                 variants+=(--variant "$v"); done
               # shellcheck disable=SC2086
               timeout "${KDA_TIMEOUT:-300}" python3 -m benchmarks.kernels \
                 --only ${KDA_SHAPES:-gdn_anchor kda_anchor kda_300m kda_1b} \
                 "${variants[@]}" ${KDA_TRACE:+--trace "$KDA_TRACE"} 2>&1 | tee "$OUT/kda_kernels.log" ;;
    kda_autotune) # shellcheck disable=SC2086
                 timeout $((${KDA_TUNE_BUDGET:-200} + 40)) python3 -m benchmarks.autotune \
                 --shape ${KDA_TUNE_SHAPES:-kda_300m kda_1b kda_anchor} --budget-s "${KDA_TUNE_BUDGET:-200}" \
                 --repeats 5 --start "${KDA_START:-}" ${KDA_TUNE_FIELDS:+--fields $KDA_TUNE_FIELDS} 2>&1 \
                 | tee "$OUT/kda_autotune.log" ;;
    attention) timeout 150 python3 -m benchmarks.attention 2>&1 | tee "$OUT/ours_attention.log" ;;
    sdpa)      timeout 90 python3 -m benchmarks.fla_reference --attention-only 2>&1 | tee "$OUT/sdpa.log" ;;
    anchors)   timeout 240 python3 .anchors/fla_kernels.py 2>&1 | tee "$OUT/fla_kernels.log"
               timeout 120 python3 .anchors/jax_attention.py 2>&1 | tee "$OUT/jax_attention.log" ;;
    train)     ours_train zebra_300m_gdn ;;
    train_kda) ours_train zebra_300m_kda ;;
    train_kda_chunks) for c in 32 64; do ours_train zebra_300m_kda --config.model.chunk_size=$c \
                 --out "$OUT/train_zebra_300m_kda_chunk$c.json"; done ;;
    train_hybrids) ours_train zebra_300m_gdn_hybrid; ours_train zebra_300m_mamba2_hybrid ;;
    train_1b)  ours_train zebra_1b_gdn ;;
    profile)   for c in ${PROFILE_CONFIGS:-zebra_300m_gdn zebra_300m_kda zebra_300m_mamba2_hybrid}; do
                 ours_train $c --profile "/tmp/trace_$c"; done ;;
    fla_train) timeout 300 python3 .anchors/fla_training.py 32 gdn 2>&1 | tee "$OUT/fla_train.log"
               mv "$OUT/fla_model.json" "$OUT/fla_train_gdn.json" ;;
    fla_train_kda) timeout 540 python3 .anchors/fla_training.py 32 kda 2>&1 | tee "$OUT/fla_train_kda.log"
               mv "$OUT/fla_model.json" "$OUT/fla_train_kda.json" ;;
    fits)      fits none ${FITS_PLAN:-zebra_300m_gdn=96,112,128 zebra_1b_gdn=32,40,48} ;;
    fits_remat) fits full ${FITS_REMAT_PLAN:-zebra_300m_gdn=192,256,320 zebra_1b_gdn=64,96,128} ;;
    small_ops) timeout 200 python3 -m benchmarks.small_ops --ce-chunks 2048,8192 2>&1 | tee "$OUT/small_ops.log" ;;
    sublayers) timeout 200 python3 -m benchmarks.sublayers --config configs/zebra_300m_gdn_hybrid.py \
                 --config configs/zebra_300m_mamba2_hybrid.py --config configs/zebra_300m_kda.py 2>&1 \
                 | tee "$OUT/sublayers.log" ;;
    max_batch) XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 520 python3 -m benchmarks.max_batch \
                 --config configs/zebra_300m_gdn.py,configs/zebra_1b_gdn.py --remat none,full --jobs 2 \
                 --extra-compiles 1 2>&1 | tee "$OUT/max_batch.log" ;;
    loss_parity) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 590 python3 -m benchmarks.loss_parity \
                 --reference "${PARITY_REFERENCE:-fla}" --batch "${PARITY_BATCH:-8}" --lift-fla-guard \
                 ${PARITY_DATA:+--data "$PARITY_DATA"} ${PARITY_REFERENCE_LOSSES:+--reference-losses \
                 "$PARITY_REFERENCE_LOSSES"} 2>&1 | tee "$OUT/loss_parity.log" ;;
    steps300)  timeout 300 python3 -m hybrid_jax.train --config configs/zebra_300m_gdn.py \
                 --config.train.global_batch_size=32 --config.train.steps=300 --config.train.log_every=25 \
                 --config.train.save_every=300 --config.train.workdir=/tmp/run300 2>&1 | tee "$OUT/steps300.log"
               cp /tmp/run300/metrics.jsonl "$OUT/steps300_metrics.jsonl" ;;
    decode)    timeout 200 python3 benchmarks/decode.py --config configs/zebra_300m_gdn_hybrid.py 2>&1 \
                 | tee "$OUT/decode.log" ;;
    fla_parity) timeout 300 python3 benchmarks/fla_parity.py --out "$OUT/fla_parity.json" 2>&1 \
                 | tee "$OUT/fla_parity.log" ;;
    scaling)   local n; n=$(nvidia-smi -L | wc -l)
               CUDA_VISIBLE_DEVICES=0 ours_train zebra_300m_gdn; mv "$OUT/train_zebra_300m_gdn.json" "$OUT/scaling_1gpu.json"
               for z in False True; do
                 ours_train zebra_300m_gdn --config.mesh.data="$n" --config.train.zero1=$z
                 mv "$OUT/train_zebra_300m_gdn.json" "$OUT/scaling_${n}gpu_zero1_$z.json"; done ;;
    *)         echo "unknown part: $1" >&2; return 2 ;;
  esac
}

run_group() {
  local p
  for p in "$@"; do
    if [[ $p == OUT=* ]]; then OUT=$OUT/${p#OUT=}; mkdir -p "$OUT"; continue; fi
    if [[ $p == *=* ]]; then local value=${p#*=}; export "${p%%=*}=${value//+/ }"; continue; fi
    echo "=== $p $(date +%T)"; run_part "$p"
  done
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
groups=(); current=""
for a in "${@:-kernels attention train anchors}"; do
  if [ "$a" = "//" ]; then groups+=("$current"); current=""; else current="$current $a"; fi
done
groups+=("$current")
if [ ${#groups[@]} -eq 1 ]; then
  run_group ${groups[0]}
else
  ngpu=$(nvidia-smi -L | wc -l)
  if [ ${#groups[@]} -gt "$ngpu" ]; then echo "${#groups[@]} groups for $ngpu GPUs: one group per GPU" >&2; exit 2; fi
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    (export CUDA_VISIBLE_DEVICES=$i; run_group ${groups[$i]} > "$OUT/gpu$i.log" 2>&1) &
  done
  wait
fi
