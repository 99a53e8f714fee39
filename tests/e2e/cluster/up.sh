#!/usr/bin/env bash
# Start a throwaway Kubernetes control plane on loopback: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok (fake nodes with GPUs, pods reach Running).
#
# Prints the kubeconfig path on stdout (last line); everything else goes to stderr.
# Idempotent: if the cluster in $KVMESH_CLUSTER_DIR is already up, just prints the path.
# Env: KVMESH_CACHE, KVMESH_CLUSTER_DIR, ETCD_CLIENT_PORT, ETCD_PEER_PORT, APISERVER_PORT,
#      KWOK_NODES (default 3), KWOK_GPUS_PER_NODE (default 8).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
D="$KVMESH_CLUSTER_DIR"
log() { echo "[cluster-up] $*" >&2; }
KUBECTL="$TOOLS_DIR/bin/kubectl"
TOKEN=kvmesh-e2e-admin-token
SERVER="https://127.0.0.1:$APISERVER_PORT"

readyz() { curl -fsk --max-time 3 -H "Authorization: Bearer $TOKEN" "$SERVER/readyz" >/dev/null 2>&1; }

if [[ -f "$D/pids" ]] && readyz; then
  log "already running"
  echo "$KUBECONFIG_PATH"; exit 0
fi
if [[ -f "$D/pids" ]]; then
  log "stale state in $D: tearing it down first"
  "$HERE/down.sh" >&2
fi

"$HERE/build.sh" all >&2
t0=$(date +%s.%N)
mkdir -p "$D/logs" "$D/pki"
: > "$D/pids"

start() {  # start NAME CMD...: own session (setsid) so down.sh can kill the whole group
  local name="$1"; shift
  setsid "$@" >"$D/logs/$name.log" 2>&1 < /dev/null &
  echo "$name $!" >> "$D/pids"
}
wait_for() {  # wait_for WHAT SECONDS CMD...
  local what="$1" secs="$2"; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >&2; do
    if (( $(date +%s) > deadline )); then
      log "timed out waiting for $what; last log lines:"; tail -n 30 "$D"/logs/*.log >&2 || true
      "$HERE/down.sh" >&2 || true
      exit 1
    fi
    sleep 0.3
  done
}

openssl genrsa -out "$D/pki/sa.key" 2048 2>/dev/null
echo "$TOKEN,kvmesh-admin,kvmesh-admin,\"system:masters\"" > "$D/pki/tokens.csv"
cat > "$KUBECONFIG_PATH" <<KC
apiVersion: v1
kind: Config
clusters:
- name: kvmesh-e2e
  cluster: {server: "$SERVER", insecure-skip-tls-verify: true}
users:
- name: kvmesh-admin
  user: {token: $TOKEN}
contexts:
- name: kvmesh-e2e
  context: {cluster: kvmesh-e2e, user: kvmesh-admin}
current-context: kvmesh-e2e
KC
chmod 600 "$KUBECONFIG_PATH"

start etcd "$ETCD_BIN/etcd" --name=kvmesh-e2e --data-dir="$D/etcd" \
  --listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster="kvmesh-e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
  --listen-metrics-urls="" --unsafe-no-fsync --quota-backend-bytes=2147483648
wait_for etcd 60 curl -fs --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health" -o /dev/null

# --endpoint-reconciler-type=none: a loopback advertise address cannot be written into the
# `kubernetes` Endpoints. OwnerReferencesPermissionEnforcement: the operator sets
# blockOwnerDeletion, so the test checks it holds the finalizers permission this plugin demands.
start kube-apiserver "$K8S_BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$APISERVER_PORT" \
  --cert-dir="$D/pki" --token-auth-file="$D/pki/tokens.csv" --authorization-mode=Node,RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$D/pki/sa.key" --service-account-signing-key-file="$D/pki/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 --allow-privileged=true \
  --endpoint-reconciler-type=none \
  --enable-admission-plugins=OwnerReferencesPermissionEnforcement \
  --profiling=false
wait_for kube-apiserver 180 readyz

start kube-controller-manager "$K8S_BIN/kube-controller-manager" \
  --kubeconfig="$KUBECONFIG_PATH" --leader-elect=false --secure-port=0 \
  --service-account-private-key-file="$D/pki/sa.key" --root-ca-file="$D/pki/apiserver.crt" \
  --use-service-account-credentials=false --concurrent-gc-syncs=5 \
  --horizontal-pod-autoscaler-sync-period=5s --profiling=false
start kube-scheduler "$K8S_BIN/kube-scheduler" \
  --kubeconfig="$KUBECONFIG_PATH" --leader-elect=false --secure-port=0 --profiling=false
start kwok "$KWOK_BIN/kwok" --kubeconfig="$KUBECONFIG_PATH" \
  --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr=10.244.0.1/16 --node-ip=10.240.0.10 --server-address="127.0.0.1:$KWOK_PORT" \
  --node-lease-duration-seconds=40

export KUBECONFIG="$KUBECONFIG_PATH"
NODES="${KWOK_NODES:-3}"; GPUS="${KWOK_GPUS_PER_NODE:-8}"
for i in $(seq 0 $((NODES - 1))); do
  cat <<NODE
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels:
    type: kwok
    kubernetes.io/hostname: kwok-gpu-$i
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    nvidia.com/gpu.present: "true"
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS"}
NODE
done > "$D/nodes.yaml"
wait_for "default namespace" 60 "$KUBECTL" get ns default -o name
"$KUBECTL" apply -f "$D/nodes.yaml" >&2
wait_for "nodes Ready" 120 "$KUBECTL" wait --for=condition=Ready node --all --timeout=5s
wait_for "default service account" 60 "$KUBECTL" get serviceaccount default -o name

t1=$(date +%s.%N)
python3 -c "print(f'{$t1-$t0:.1f}')" > "$D/startup_seconds"
log "control plane up in $(cat "$D/startup_seconds")s; export KUBECONFIG=$KUBECONFIG_PATH"
echo "$KUBECONFIG_PATH"
