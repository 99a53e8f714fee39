#!/usr/bin/env bash
# Import the images the real node runs into its containerd (`k8s.io` namespace, the one the
# CRI reads), since the node has no registry to pull from: the pause and probe images that
# build.sh makes, and every tar listed in $KVMESH_CACHE/images/manifest* (written by
# `make images`; a line's fields ending in .tar are tar paths, relative to the manifest).
# Run by up.sh; run it again on a live cluster to (re)load images whose tars changed: a tar is
# imported only when its size/mtime differ from what this node last imported.
# Env: KVMESH_CACHE, KVMESH_CLUSTER_DIR; FORCE=1 re-imports everything.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
N="$KVMESH_CLUSTER_DIR/node"
SOCK="$N/containerd/containerd.sock"
STAMPS="$NODE_CONTAINERD_ROOT/images-loaded"  # next to the store they describe
log() { echo "[load-images] $*" >&2; }
[[ -S "$SOCK" ]] || { log "no containerd at $SOCK (is the cluster up with a real node?)"; exit 1; }
mkdir -p "$STAMPS"

tars() {
  echo "$NODE_IMAGES_DIR/pause.tar"
  echo "$NODE_IMAGES_DIR/probe.tar"
  local m
  for m in "$KVMESH_CACHE"/images/manifest*; do
    [[ -f "$m" ]] || continue
    # Tolerant of the manifest's exact layout: any whitespace/quote/comma-separated token
    # ending in .tar outside comments (works for a TSV and for a JSON list alike).
    sed 's/#.*//' "$m" | tr ' \t",:[]{}' '\n' | grep -E '\.tar$' | while read -r t; do
      [[ "$t" = /* ]] && echo "$t" || echo "$(dirname "$m")/$t"
    done
  done
}

n=0
while read -r tar; do
  [[ -f "$tar" ]] || { log "missing $tar (listed in a manifest): skipped"; continue; }
  key="$(stat -c '%s-%Y' "$tar")"
  stamp="$STAMPS/$(echo "$tar" | sha256sum | cut -c1-16)"
  if [[ "${FORCE:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
    continue
  fi
  log "importing $tar"
  ctr -a "$SOCK" -n k8s.io images import "$tar" >&2
  echo "$key" > "$stamp"
  n=$((n + 1))
done < <(tars | awk '!seen[$0]++')
log "$n image tar(s) imported"
