#!/usr/bin/env bash
# Train on the GPUs of one machine.
#
#   launch/local.sh [-n NPROC] [-e ENV] CONFIG [--config.key=value ...]
#
#   -n NPROC  processes, one per GPU (default 1: one process drives every GPU of the machine, which is the
#             simplest and as fast; use -n 8 to run exactly as on a SLURM cluster, one process per GPU)
#   -e ENV    environment file launch/env/ENV.sh: rocm_mi300x, rocm_mi355x or cuda_h200 (default: detected
#             from the GPUs; "none" to source nothing)
#
# Example: launch/local.sh -e rocm_mi300x configs/zebra_300m_gdn.py --config.train.workdir=runs/gdn300m
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,12p' "$0" >&2; exit 2; }
nproc=1
envname=""
while getopts "n:e:h" opt; do
  case "$opt" in
    n) nproc="$OPTARG" ;;
    e) envname="$OPTARG" ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage
config="$1"
shift

if [ -z "$envname" ]; then
  if command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q gfx950; then envname=rocm_mi355x
  elif command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q gfx942; then envname=rocm_mi300x
  elif command -v nvidia-smi >/dev/null 2>&1; then envname=cuda_h200
  else envname=none
  fi
fi
if [ "$envname" != none ]; then
  # shellcheck source=/dev/null
  source "launch/env/${envname}.sh"
  echo "environment: launch/env/${envname}.sh" >&2
fi

py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" -m hybrid_jax.launch --nproc "$nproc" -- "$py" -m hybrid_jax.train --config "$config" "$@"
