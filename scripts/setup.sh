#!/usr/bin/env bash
# Create .venv with Python 3.12 (from PATH, or from pyenv) and install jaxcp with its test and
# bench extras. Extra arguments are extras to add, e.g. `bash scripts/setup.sh cuda12`.
# JAX_VERSION=0.11.2 pins jax and jaxlib (CI tests the version the GPU machines run).
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
[ -x .venv/bin/python ] || $PY -m venv .venv
extras="test,bench"
for e in "$@"; do extras="$extras,$e"; done
.venv/bin/python -m pip install -q --upgrade pip
pins=()
if [ -n "${JAX_VERSION:-}" ]; then pins=("jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"); fi
.venv/bin/python -m pip install -q -e ".[$extras]" ${pins[@]+"${pins[@]}"}
.venv/bin/python -c "import jax, jaxcp; print('jaxcp', jaxcp.__version__, 'jax', jax.__version__, jax.default_backend())"
