#!/usr/bin/env bash
# Create a virtual environment with Python 3.12 (from PATH, or from pyenv) and install jaxcp with
# its test and bench extras. Extra arguments are extras to add, e.g. `bash scripts/setup.sh cuda12`.
# VENV=dir puts the environment there instead of .venv; JAX_VERSION=0.11.2 pins jax and jaxlib
# (the newest version pyproject.toml allows is installed otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" >/dev/null 2>&1; then
    echo python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python3.12"; return; fi
  fi
  echo "setup.sh: no Python 3.12 found (install python3.12 or a pyenv 3.12.x)" >&2
  exit 1
}
PY=$(find_python)
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
extras="test,bench"
for e in "$@"; do extras="$extras,$e"; done
"$VENV/bin/python" -m pip install -q --upgrade pip
pins=()
if [ -n "${JAX_VERSION:-}" ]; then pins=("jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"); fi
"$VENV/bin/python" -m pip install -q -e ".[$extras]" ${pins[@]+"${pins[@]}"}
"$VENV/bin/python" -c "import jax, jaxcp; print('jaxcp', jaxcp.__version__, 'jax', jax.__version__, jax.default_backend())"
