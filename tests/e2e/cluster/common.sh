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
TOOLS_DIR="$KVMESH_CACHE/tools-${KUBECTL_LAYER_PKG##*/}"
# Runtime state (data dirs, logs, pids, kubeconfig) lives outside the clone too.
KVMESH_CLUSTER_DIR="${KVMESH_CLUSTER_DIR:-$KVMESH_CACHE/cluster}"
# Loopback ports chosen away from the usual 2379/6443/10250 so a real cluster on the box
# does not clash with the test one.
ETCD_CLIENT_PORT="${ETCD_CLIENT_PORT:-23791}"
ETCD_PEER_PORT="${ETCD_PEER_PORT:-23801}"
APISERVER_PORT="${APISERVER_PORT:-26443}"
KWOK_PORT="${KWOK_PORT:-20247}"
KUBECONFIG_PATH="$KVMESH_CLUSTER_DIR/kubeconfig"
