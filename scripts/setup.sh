#!/usr/bin/env bash
# Create .venv in the repository root with a Python 3.12 interpreter and install hybrid-jax into it.
# Usage: scripts/setup.sh [EXTRAS]   (default extras: dev,notebook,data,export,eval)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev,notebook,data,export,eval}"

is_312() { "$@" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ] && is_312 "$PYTHON"; then echo "$PYTHON"; return; fi
  for c in python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && is_312 "$c"; then command -v "$c"; return; fi
  done
  # pyenv installs: the shim only works with PYENV_VERSION set, so use the interpreter itself.
  for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*; do
    if [ -x "$d/bin/python3.12" ] && is_312 "$d/bin/python3.12"; then echo "$d/bin/python3.12"; return; fi
  done
  if command -v uv >/dev/null 2>&1; then
    p=$(uv python find 3.12 2>/dev/null || true)
    if [ -n "$p" ] && is_312 "$p"; then echo "$p"; return; fi
  fi
  return 1
}

if [ -x .venv/bin/python ] && is_312 .venv/bin/python; then
  py=.venv/bin/python
else
  if ! base=$(find_python); then
    echo "error: no Python 3.12 interpreter found (JAX >= 0.11 needs 3.12)." >&2
    echo "Install one (e.g. 'pyenv install 3.12', 'uv python install 3.12' or your OS package python3.12)," >&2
    echo "or point PYTHON=/path/to/python3.12 at it, then run this again." >&2
    exit 1
  fi
  echo "using $base ($("$base" --version 2>&1))"
  rm -rf .venv
  "$base" -m venv .venv
  py=.venv/bin/python
fi
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -e ".[${extras}]"
echo "installed hybrid-jax into .venv ($("$py" --version))"
