#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the package into it.
# Usage: NVFP4_JAX_EXTRAS=test source scripts/setup_env.sh   (extras: default none)
# Sets PY to the environment's python. VENV overrides the location (default: .venv);
# NVFP4_JAX_PYTHON_BASE the interpreter it is made from (default: the newest Python 3.10-3.12).
# The extras come from NVFP4_JAX_EXTRAS, never from arguments: a script that sources this file
# without arguments passes its own ("steps=5") through as $1.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$_root/.venv}"
_extras="${NVFP4_JAX_EXTRAS:-}"
if [[ ! "$_extras" =~ ^[A-Za-z0-9_,-]*$ ]]; then
  echo "[setup] error: NVFP4_JAX_EXTRAS='$_extras' is not a comma-separated list of extras (e.g. test)" >&2
  return 2 2>/dev/null || exit 2
fi
# The base interpreter: NVFP4_JAX_PYTHON_BASE (a path, or a version such as 3.11), else the
# newest supported Python found (3.12, 3.11, 3.10: on PATH as pythonX.Y, or in pyenv's
# versions), else python3. Python 3.12 gets JAX 0.12, 3.10-3.11 JAX 0.10.2 (pyproject.toml).
_supported() { "$1" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null; }
_find_python() {  # the newest interpreter of version $1 (X.Y) found, or nothing
  local root c
  root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  for c in "$(command -v "python$1" 2>/dev/null || true)" $(ls -d "$root/versions/$1".*/bin/"python$1" 2>/dev/null | sort -V -r); do
    if [ -n "$c" ] && _supported "$c"; then echo "$c"; return; fi
  done
}
_base="${NVFP4_JAX_PYTHON_BASE:-}"
if [[ "$_base" =~ ^3\.[0-9]+$ ]]; then
  _base="$(_find_python "$_base")"
  [ -n "$_base" ] || _base="python$NVFP4_JAX_PYTHON_BASE"
fi
if [ -n "$_base" ]; then
  if ! _supported "$_base"; then
    echo "[setup] error: NVFP4_JAX_PYTHON_BASE='$NVFP4_JAX_PYTHON_BASE' is not (or names no) Python 3.10, 3.11 or 3.12 interpreter" >&2
    return 2 2>/dev/null || exit 2
  fi
else
  for _v in 3.12 3.11 3.10; do
    _base="$(_find_python "$_v")"
    [ -n "$_base" ] && break
  done
  if [ -z "$_base" ]; then
    if _supported python3; then _base=python3; else
      echo "[setup] error: no Python 3.10-3.12 found; set NVFP4_JAX_PYTHON_BASE to one" >&2
      return 2 2>/dev/null || exit 2
    fi
  fi
fi
_base_version="$("$_base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ -x "$VENV/bin/python" ]; then
  _venv_version="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)"
  if [ "$_venv_version" != "$_base_version" ]; then
    echo "[setup] $VENV has Python $_venv_version, not $_base_version ($_base): recreating it"
    rm -rf "$VENV"
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV with Python $_base_version ($_base)"
  "$_base" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Reinstall only when pyproject.toml changed since the last install (or extras differ).
# The stamp holds one line per install: "<pyproject hash> extras=[...]". A plain install is
# satisfied by any install of the same pyproject.
_stamp="$VENV/.nvfp4_jax_installed"
_hash="$(sha256sum "$_root/pyproject.toml" | cut -d' ' -f1)"
_want="$_hash extras=[$_extras]"
_have=1
if [ -f "$_stamp" ]; then
  if grep -qxF "$_want" "$_stamp" || { [ -z "$_extras" ] && grep -q "^$_hash " "$_stamp"; }; then
    _have=0
  fi
fi
if [ "$_have" != 0 ]; then
  echo "[setup] installing nvfp4_jax${_extras:+[$_extras]} (first run takes a few minutes)"
  "$PY" -m pip install -q --upgrade pip >/dev/null
  if [ -n "$_extras" ]; then
    "$PY" -m pip install -q -e "$_root[$_extras]"
  else
    "$PY" -m pip install -q -e "$_root"
  fi
  # Keep the other installs of this pyproject (their extras are still there); drop stale ones.
  { grep "^$_hash " "$_stamp" 2>/dev/null || true; echo "$_want"; } > "$_stamp.new"
  mv "$_stamp.new" "$_stamp"
fi
export PY
