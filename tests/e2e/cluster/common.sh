# Shared paths for build.sh / up.sh / down.sh. Sourced, not executed.
# Why a separate file: the three scripts must agree on cache and state locations, and tests
# (conftest.py) read the same defaults through environment variables.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
. "$HERE/versions.env"
KVMESH_CACHE="${KVMESH_CACHE:-$HOME/.cache/kvmesh}"
K8S_BIN="$KVMESH_CACHE/k8s-v$K8S_VERSION/bin"
ETCD_BIN="$KVMESH_CACHE/etcd-v$ETCD_VERSION/bin"
KWOK_BIN="$KVMESH_CACHE/kwok-v$KWOK_VERSION/bin"
TOOLS_DIR="$KVMESH_CACHE/tools-${KUBECTL_LAYER_PKG##*/}-$KUBECTL_LAYER_VERSION"
# Runtime state (data dirs, logs, pids, kubeconfig) lives outside the clone too.
KVMESH_CLUSTER_DIR="${KVMESH_CLUSTER_DIR:-$KVMESH_CACHE/cluster}"
# Loopback ports chosen away from the usual 2379/6443/10250 so a real cluster on the box
# does not clash with the test one.
ETCD_CLIENT_PORT="${ETCD_CLIENT_PORT:-23791}"
ETCD_PEER_PORT="${ETCD_PEER_PORT:-23801}"
APISERVER_PORT="${APISERVER_PORT:-26443}"
KWOK_PORT="${KWOK_PORT:-20247}"
KUBECONFIG_PATH="$KVMESH_CLUSTER_DIR/kubeconfig"
COREDNS_BIN="$KVMESH_CACHE/coredns-v$COREDNS_VERSION/bin"
PROMETHEUS_BIN="$KVMESH_CACHE/prometheus-v$PROMETHEUS_VERSION/bin"
OTELCOL_BIN="$KVMESH_CACHE/otelcol-v$OTELCOL_VERSION/bin"
KEDA_CRDS="$KVMESH_CACHE/keda-v$KEDA_VERSION/crds"
LWS_BIN="$KVMESH_CACHE/lws-v$LWS_VERSION/bin"
LWS_CRDS="$KVMESH_CACHE/lws-v$LWS_VERSION/crds"
# The LWS controller's admission webhook (its pod webhook sets the group/worker labels and the
# LWS_* env vars): served on loopback, where the apiserver (a host process too) calls it.
LWS_WEBHOOK_PORT="${LWS_WEBHOOK_PORT:-20943}"
NODE_IMAGES_DIR="$KVMESH_CACHE/node-images-r$NODE_IMAGES_REV"
# Images of the real node: the sandbox (pause) image and a tiny static probe (HTTP server and
# client, DNS lookup, in-cluster apiserver check) that the smoke test runs.
PAUSE_IMAGE=registry.k8s.io/pause:3.10
PROBE_IMAGE=kvmesh.local/e2e-probe:0.1
RUNC_WRAPPER="$(cd "$HERE/../../.." && pwd)/scripts/oci/runc-wrapper"

# --- The real node (kubelet + containerd + kube-proxy + CoreDNS), unless KVMESH_REAL_NODE=0 ---
KVMESH_REAL_NODE="${KVMESH_REAL_NODE:-1}"
NODE_NAME="${NODE_NAME:-kvmesh-node-0}"
# A bridge of our own; its gateway address is the node IP (kubelet refuses loopback node IPs,
# and `kubectl logs/exec` need an address the apiserver can dial). 10.245.0.0/24: not kwok's
# fake 10.244.0.0/16 and not routed anywhere on this machine (up.sh checks `ip route`).
NODE_BRIDGE="${NODE_BRIDGE:-kvmesh0}"
POD_CIDR="${POD_CIDR:-10.245.0.0/24}"
NODE_IP="${NODE_IP:-10.245.0.1}"
SERVICE_CIDR=10.96.0.0/16
KUBELET_PORT="${KUBELET_PORT:-20250}"
KUBELET_HEALTHZ_PORT="${KUBELET_HEALTHZ_PORT:-20248}"
KUBE_PROXY_HEALTHZ_PORT="${KUBE_PROXY_HEALTHZ_PORT:-20256}"
KUBE_PROXY_METRICS_PORT="${KUBE_PROXY_METRICS_PORT:-20249}"
COREDNS_READY_PORT="${COREDNS_READY_PORT:-20181}"
# Only one real node per machine: kube-proxy owns the machine-wide KUBE-* iptables chains.
# The owner file names the cluster dir that holds it.
REAL_NODE_OWNER=/run/kvmesh-real-node.owner
# containerd's root (content store, unpacked image snapshots) outlives a cluster: re-importing the
# ~8 GB of image tars from `make images` at every cluster-up would cost minutes. It is a cache like
# the binaries: nothing runs from it once the cluster is down (container state lives in the
# cluster dir), and stale containers are removed before the kubelet starts.
NODE_CONTAINERD_ROOT="${NODE_CONTAINERD_ROOT:-$KVMESH_CACHE/node-containerd}"
