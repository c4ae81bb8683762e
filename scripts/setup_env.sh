#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the package into it.
# Usage: NVFP4_JAX_EXTRAS=test source scripts/setup_env.sh   (extras: default none)
# Sets PY to the environment's python. VENV overrides the location (default: .venv).
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
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV"
  python3 -m venv "$VENV"
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
