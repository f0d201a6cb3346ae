#!/usr/bin/env bash
# The GPU machine's entry point: install the carried wheels (once per machine) and this tree (every run, so that a
# second run on a warm machine times the tree as it is now), then run 'python -m benchmarks "$@"'.
#   benchmarks/device.sh kernels --only gdn_anchor kda_anchor
#   benchmarks/device.sh run 'kernels --only kda_anchor' 'fla_reference --only kda_anchor --no-attention'
# Expects ./.whl/*.whl (grain, ml-collections, array-record, tensorboardX, FLA ...) carried next to the tree, and
# ./.anchors for the 'anchor' part. Records go to $OUT (python -m benchmarks --help lists the parts).
set -euo pipefail
SITE=/tmp/site  # the wheels and this tree, installed without touching the image's packages
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ! -e "$SITE/.installed" ] && [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  touch "$SITE/.installed"
fi
# the installed tree, not the source checkout, is what 'import hybrid_jax' finds (no current directory on sys.path:
# PYTHONSAFEPATH), so a run times what pip installed; benchmarks/ importable from a side folder that links to them
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . >/dev/null
mkdir -p /tmp/bench && ln -sfn "$PWD/benchmarks" /tmp/bench/benchmarks
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE:/tmp/bench:${PYTHONPATH:-}
exec python3 -m benchmarks "$@"
