#!/usr/bin/env bash
# Stop everything up.sh started (each component in its own process group) and delete the
# cluster's state, so the next up.sh starts clean. Safe to run twice or with nothing running.
# KEEP_LOGS=1 keeps the component logs in $KVMESH_CLUSTER_DIR.logs for post-mortems.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
D="$KVMESH_CLUSTER_DIR"
log() { echo "[cluster-down] $*" >&2; }
if [[ -f "$D/pids" ]]; then
  # Reverse start order: the clients go before the apiserver, the apiserver before etcd.
  tac "$D/pids" | while read -r name pid; do
    [[ -n "${pid:-}" ]] || continue
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$name ($pid) ignored TERM; killing"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    fi
    log "stopped $name"
  done
fi
if [[ -d "$D" ]]; then
  if [[ "${KEEP_LOGS:-0}" == 1 && -d "$D/logs" ]]; then
    rm -rf "$D.logs"; cp -r "$D/logs" "$D.logs"
  fi
  rm -rf "$D"
fi
log "down"
