#!/usr/bin/env bash
# Start a throwaway Kubernetes cluster: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, the LeaderWorkerSet controller (with its CRD and admission webhooks) and kwok
# (fake nodes with GPUs, tainted nvidia.com/gpu, pods reach Running),
# plus one real node (containerd + kubelet + kube-proxy + CoreDNS on a bridge of its own) that
# runs the CPU pods for real. KVMESH_REAL_NODE=0: control plane and kwok only, all on loopback.
#
# Prints the kubeconfig path on stdout (last line); everything else goes to stderr.
# Idempotent: if the cluster in $KVMESH_CLUSTER_DIR is already up, just prints the path.
# Env: KVMESH_CACHE, KVMESH_CLUSTER_DIR, ETCD_CLIENT_PORT, ETCD_PEER_PORT, APISERVER_PORT,
#      KWOK_NODES (default 3), KWOK_GPUS_PER_NODE (default 8), KVMESH_REAL_NODE (default 1),
#      NODE_NAME, NODE_BRIDGE, POD_CIDR, NODE_IP, KUBELET_PORT, LWS_WEBHOOK_PORT (see common.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
D="$KVMESH_CLUSTER_DIR"
log() { echo "[cluster-up] $*" >&2; }
KUBECTL="$TOOLS_DIR/bin/kubectl"
TOKEN=kvmesh-e2e-admin-token
# With a real node the apiserver listens on the node IP (pods reach it through the
# `kubernetes` Service, whose endpoint is that address); without one, on loopback as before.
if [[ "$KVMESH_REAL_NODE" != 0 ]]; then API_IP="$NODE_IP"; else API_IP=127.0.0.1; fi
SERVER="https://$API_IP:$APISERVER_PORT"

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
wait_for() {  # wait_for WHAT SECONDS CMD... (on time-out: logs, teardown, exit 1)
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

# ---------------------------------------------------------------------------------------------
# The real node. Everything it makes lives under $D/node, except what cannot: the bridge, the
# blackhole route, iptables chains (KUBE-*, CNI-*, KVMESH-*) and a few sysctls; down.sh
# removes or restores each of those.
N="$D/node"
CTR_SOCK="$N/containerd/containerd.sock"
export CONTAINERD_ADDRESS="$CTR_SOCK"   # for load-images.sh and anyone debugging with ctr

node_claim() {
  # kube-proxy rewrites the machine-wide KUBE-SERVICES chains, so two real nodes would fight.
  if [[ -f "$REAL_NODE_OWNER" ]]; then
    local other; other="$(cat "$REAL_NODE_OWNER")"
    local name pid
    if [[ "$other" != "$D" && -f "$other/pids" ]]; then
      while read -r name pid; do
        if kill -0 "$pid" 2>/dev/null; then
          log "the real node is held by the cluster in $other ($name is running):"
          log "run its down.sh (KVMESH_CLUSTER_DIR=$other), or start with KVMESH_REAL_NODE=0"
          exit 1
        fi
      done < "$other/pids"
    fi
  fi
  echo "$D" > "$REAL_NODE_OWNER"
  mkdir -p "$N"
  # Check that the ranges we route collide with nothing on this machine (other than ours).
  ip -4 route show | python3 -c '
import ipaddress, sys
mine = [ipaddress.ip_network(n) for n in sys.argv[1:]]
for line in sys.stdin:
    dst = line.split()[0] if not line.startswith(("blackhole", "unreachable")) else line.split()[1]
    if dst == "default" or " dev '"$NODE_BRIDGE"' " in line or line.startswith("blackhole '"$SERVICE_CIDR"'"):
        continue
    net = ipaddress.ip_network(dst, strict=False)
    for m in mine:
        if net.overlaps(m):
            sys.exit(f"route {line.strip()!r} overlaps {m}: set POD_CIDR/NODE_IP")
' "$POD_CIDR" "$SERVICE_CIDR" >&2 || exit 1
}

node_network() {
  # Save the sysctls we (or kubelet, see setupKernelTunables) change, for down.sh to restore.
  local k
  for k in net.ipv4.ip_forward vm.overcommit_memory vm.panic_on_oom kernel.panic \
           kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
    echo "$k=$(sysctl -n "$k")"
  done > "$N/sysctl.saved"
  # Which iptables (nf_tables) tables exist now: kube-proxy/kubelet create the rest, down.sh
  # deletes those again once empty. And whether kubelet's fixed device-plugin dir exists.
  for k in iptables ip6tables; do
    "$k-save" 2>/dev/null | awk -v f="$k" '/^\*/{print f, substr($1, 2)}'
  done > "$N/iptables-tables.before"
  [[ -e /var/lib/kubelet ]] || touch "$N/var-lib-kubelet.created"
  # Fixed paths containerd's CRI/shims and libcni use regardless of our config.
  local p
  for p in /run/containerd /var/lib/cni /sys/fs/cgroup/memory/k8s.io; do
    [[ -e "$p" ]] || echo "$p"
  done > "$N/fixed-paths.created"
  # First of all: an unprogrammed ClusterIP must never follow the default route off the box.
  # The blackhole is the fallback (high metric); the bridge route below takes precedence
  # while the bridge exists, because the host's own connections to a ClusterIP need a route
  # that does not fail before kube-proxy's OUTPUT DNAT runs (a blackhole fails connect()).
  # Either way a Service address stays on this machine: nobody answers ARP for it on the bridge.
  ip route replace blackhole "$SERVICE_CIDR" metric 4242
  ip link add "$NODE_BRIDGE" type bridge 2>/dev/null || true
  ip addr replace "$NODE_IP/${POD_CIDR#*/}" dev "$NODE_BRIDGE"
  ip link set "$NODE_BRIDGE" up
  ip route replace "$SERVICE_CIDR" dev "$NODE_BRIDGE" src "$NODE_IP" metric 100
  # pod -> ClusterIP -> pod is DNATed on the host and routed back onto the bridge.
  sysctl -qw net.ipv4.ip_forward=1
  # ... so forwarding is on: allow it only bridge-to-bridge. Nothing from a pod leaves the
  # machine and nothing from outside reaches a pod; pods still reach the node IP (INPUT).
  iptables -N KVMESH-FORWARD 2>/dev/null || iptables -F KVMESH-FORWARD
  iptables -A KVMESH-FORWARD -i "$NODE_BRIDGE" -o "$NODE_BRIDGE" -j ACCEPT
  iptables -A KVMESH-FORWARD -i "$NODE_BRIDGE" -j DROP
  iptables -A KVMESH-FORWARD -o "$NODE_BRIDGE" -j DROP
  iptables -C FORWARD -j KVMESH-FORWARD 2>/dev/null || iptables -I FORWARD 1 -j KVMESH-FORWARD
  # Bridged pod-to-pod replies of a DNATed connection need br_netfilter to be un-NATed; where
  # the kernel has no module, kube-proxy's --masquerade-all (below) sends replies via the host.
  [[ -d /proc/sys/net/bridge ]] || modprobe br_netfilter 2>/dev/null || true
}

node_pki() {
  # apiserver -> kubelet (logs, exec, port-forward) authenticates with a client cert of this CA;
  # the kubelet accepts only that (no anonymous access from pods on the bridge).
  local P="$D/pki"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 30 \
    -subj "/CN=kvmesh-e2e-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout "$P/kubelet-client.key" -out "$P/kubelet-client.csr" \
    -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
  openssl x509 -req -in "$P/kubelet-client.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" \
    -CAcreateserial -out "$P/kubelet-client.crt" -days 30 2>/dev/null
}

node_containerd() {
  mkdir -p "$N/containerd" "$N/cni/net.d" "$N/cni/ipam"
  # Own root, state, socket and opt dir; netns mounts under the state dir, not /run/netns.
  cat > "$N/containerd/config.toml" <<TOML
version = 2
root = "$NODE_CONTAINERD_ROOT/root"
state = "$N/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$CTR_SOCK"
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$N/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$N/containerd/runc"    # runc's state, instead of /run/containerd/runc
        # No CAP_SYS_RESOURCE here: the wrapper drops negative oomScoreAdj, clamps rlimits.
        BinaryName = "$RUNC_WRAPPER"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/net.d"
TOML
  # host-local keeps its leases under our dir; hairpinMode lets a pod reach itself via its
  # Service. ipMasq off: pod traffic has nowhere to go but this machine.
  cat > "$N/cni/net.d/10-kvmesh.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "kvmesh-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": true, "ipMasq": false,
     "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$N/cni/ipam",
              "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
JSON
  start containerd containerd --config "$N/containerd/config.toml"
  wait_for containerd 60 ctr -a "$CTR_SOCK" version
  # Containers an earlier, aborted cluster left in the persistent root's metadata (none after a
  # clean cluster-down): the new kubelet must start from an empty node.
  local stale
  stale="$(ctr -a "$CTR_SOCK" -n k8s.io containers ls -q 2>/dev/null || true)"
  [[ -z "$stale" ]] || ctr -a "$CTR_SOCK" -n k8s.io containers rm $stale >&2 || true
  "$HERE/load-images.sh" >&2
}

node_kubelet() {
  mkdir -p "$N/kubelet" "$N/pod-logs"
  echo "nameserver $NODE_IP" > "$N/resolv.conf"   # even dnsPolicy: Default stays on the box
  cat > "$N/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$D/pki/ca.crt"}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$CTR_SOCK
podLogsDir: $N/pod-logs
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: $N/resolv.conf
podCIDR: $POD_CIDR
# cgroup v1 without systemd; no CAP_SYS_RESOURCE: no QoS cgroups, no negative OOM scores.
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
localStorageCapacityIsolation: false
# Images are imported, never pulled: never garbage-collect them; never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 0s
YAML
  start kubelet "$K8S_BIN/kubelet" --config="$N/kubelet.yaml" --kubeconfig="$KUBECONFIG_PATH" \
    --root-dir="$N/kubelet" --cert-dir="$N/kubelet/pki" --hostname-override="$NODE_NAME" \
    --node-ip="$NODE_IP" --node-labels=kvmesh.io/real-node=true
}

node_kube_proxy() {
  # --masquerade-all: replies of pod -> ClusterIP -> pod on one bridge return via the host
  # whether or not br_netfilter is there. Conntrack and localhost-nodeport sysctls left as
  # they are (0 = don't touch): the machine is not ours to tune.
  start kube-proxy "$K8S_BIN/kube-proxy" --kubeconfig="$KUBECONFIG_PATH" \
    --hostname-override="$NODE_NAME" --proxy-mode=iptables --cluster-cidr="$POD_CIDR" \
    --masquerade-all --nodeport-addresses="$NODE_IP/32" --iptables-localhost-nodeports=false \
    --conntrack-max-per-core=0 --conntrack-min=0 --conntrack-tcp-timeout-established=0 \
    --conntrack-tcp-timeout-close-wait=0 --oom-score-adj=0 \
    --healthz-bind-address="127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT" \
    --metrics-bind-address="127.0.0.1:$KUBE_PROXY_METRICS_PORT" --profiling=false
}

node_coredns() {
  # A host process on the node IP. No `forward`: names outside the cluster get NXDOMAIN
  # instead of a query to a resolver off this machine.
  cat > "$N/Corefile" <<COREFILE
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
  bind $NODE_IP
  errors
  ready 127.0.0.1:$COREDNS_READY_PORT
  kubernetes cluster.local in-addr.arpa ip6.arpa {
    kubeconfig $KUBECONFIG_PATH kvmesh-e2e
    pods insecure
  }
  cache 5
}
.:53 {
  bind $NODE_IP
  template ANY ANY {
    rcode NXDOMAIN
  }
}
COREFILE
  start coredns "$COREDNS_BIN/coredns" -conf "$N/Corefile"
}

node_start() {
  node_containerd
  node_kubelet
  node_kube_proxy
  node_coredns
}

kube_proxy_synced() {  # the kubernetes Service is programmed (KUBE-SERVICES -> KUBE-SVC-...)
  iptables -t nat -S KUBE-SERVICES 2>/dev/null | grep -q 'default/kubernetes:https cluster IP'
}
dns_answers() {
  [[ "$("$NODE_IMAGES_DIR/probe-bin" resolve kubernetes.default.svc.cluster.local "$NODE_IP:53" 2>/dev/null)" == 10.96.0.1 ]]
}
node_wait_ready() {
  wait_for "node $NODE_NAME Ready" 120 "$KUBECTL" wait --for=condition=Ready "node/$NODE_NAME" --timeout=5s
  # The kubelet's podCIDR setting is local; publish it on the Node (no KCM CIDR allocator).
  "$KUBECTL" patch node "$NODE_NAME" --type=merge \
    -p "{\"spec\":{\"podCIDR\":\"$POD_CIDR\",\"podCIDRs\":[\"$POD_CIDR\"]}}" >&2
  wait_for "kube-proxy rules" 60 kube_proxy_synced
  wait_for "CoreDNS ready" 60 curl -fs --max-time 2 "http://127.0.0.1:$COREDNS_READY_PORT/ready" -o /dev/null
  wait_for "DNS answers" 30 dns_answers
}

# ---------------------------------------------------------------------------------------------
# LeaderWorkerSet: its CRD and its controller manager, a host process like the KCM (admin
# kubeconfig, no leader election, no metrics or probe listeners). Its webhooks cannot be left
# off: the pod webhook is what gives LWS pods their group/worker index labels and the
# LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX env (the pod controller refuses pods
# without the worker-index label), and the LWS webhook defaults restartPolicy and the rollout
# strategy. So they run, on loopback with a certificate of our own CA (the manager's internal
# cert rotation wants an in-cluster Service and Secret), and are registered by URL with the
# rules of upstream's config/webhook (manifests.yaml plus its objectSelector patches: only pods
# labelled leaderworkerset.sigs.k8s.io/name go through them, so a stopped LWS controller never
# blocks other pods).
lws_start() {
  local P="$D/pki/lws-webhook" url="https://127.0.0.1:$LWS_WEBHOOK_PORT"
  mkdir -p "$P"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -days 30 \
    -subj "/CN=kvmesh-e2e-lws-webhook-ca" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout "$P/tls.key" -out "$P/tls.csr" -subj "/CN=127.0.0.1" 2>/dev/null
  openssl x509 -req -in "$P/tls.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial \
    -out "$P/tls.crt" -days 30 -extfile <(echo "subjectAltName=IP:127.0.0.1") 2>/dev/null
  cat > "$D/lws-config.yaml" <<YAML
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {host: 127.0.0.1, port: $LWS_WEBHOOK_PORT, certDir: "$P"}
metrics: {bindAddress: "0"}
health: {healthProbeBindAddress: "0"}
YAML
  # server-side: the CRD (1.3 MB) is too large for client-side apply's annotation
  "$KUBECTL" apply --server-side --force-conflicts -f "$LWS_CRDS/" >&2
  wait_for "LWS CRD established" 60 "$KUBECTL" wait --for=condition=Established \
    crd/leaderworkersets.leaderworkerset.x-k8s.io --timeout=5s
  start lws-controller env ENABLE_WEBHOOKS=true "$LWS_BIN/lws-controller" \
    --kubeconfig="$KUBECONFIG_PATH" --config="$D/lws-config.yaml" --leader-elect=false
  wait_for "LWS webhook server" 60 curl -s --max-time 2 --cacert "$P/ca.crt" -o /dev/null "$url/"
  local ca; ca="$(base64 -w0 < "$P/ca.crt")"
  "$KUBECTL" apply -f - >&2 <<YAML
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: lws-mutating-webhook-configuration}
webhooks:
- name: mleaderworkerset.kb.io
  clientConfig: {url: "$url/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", caBundle: $ca}
  rules: [{apiGroups: [leaderworkerset.x-k8s.io], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [leaderworkersets]}]
  admissionReviewVersions: [v1]
  failurePolicy: Fail
  sideEffects: None
- name: mpod.kb.io
  clientConfig: {url: "$url/mutate--v1-pod", caBundle: $ca}
  objectSelector: {matchExpressions: [{key: leaderworkerset.sigs.k8s.io/name, operator: Exists}]}
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  admissionReviewVersions: [v1]
  failurePolicy: Fail
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: lws-validating-webhook-configuration}
webhooks:
- name: vleaderworkerset.kb.io
  clientConfig: {url: "$url/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", caBundle: $ca}
  rules: [{apiGroups: [leaderworkerset.x-k8s.io], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [leaderworkersets]}]
  admissionReviewVersions: [v1]
  failurePolicy: Fail
  sideEffects: None
- name: vpod.kb.io
  clientConfig: {url: "$url/validate--v1-pod", caBundle: $ca}
  objectSelector: {matchExpressions: [{key: leaderworkerset.sigs.k8s.io/name, operator: Exists}]}
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE, UPDATE], resources: [pods]}]
  admissionReviewVersions: [v1]
  failurePolicy: Fail
  sideEffects: None
YAML
}

openssl genrsa -out "$D/pki/sa.key" 2048 2>/dev/null
if [[ "$KVMESH_REAL_NODE" != 0 ]]; then
  node_claim          # one real node per machine; fails if another cluster holds it
  node_network        # blackhole the Service range, bridge + node IP, forwarding guard
  node_pki            # CA + apiserver's kubelet-client cert (kubelet authn is x509/webhook)
  KUBELET_CLIENT_FLAGS=(--kubelet-client-certificate="$D/pki/kubelet-client.crt"
    --kubelet-client-key="$D/pki/kubelet-client.key" --kubelet-preferred-address-types=InternalIP)
  # The apiserver writes its own endpoint into the `kubernetes` Service (lease reconciler,
  # the default): in-cluster clients then reach it at https://10.96.0.1 through kube-proxy.
  RECONCILER=(--endpoint-reconciler-type=lease)
else
  KUBELET_CLIENT_FLAGS=()
  # A loopback advertise address cannot be written into the `kubernetes` Endpoints.
  RECONCILER=(--endpoint-reconciler-type=none)
fi
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

# ExtendedResourceToleration: pods that request nvidia.com/gpu get a toleration for the kwok
# nodes' nvidia.com/gpu taint (as on managed GPU clusters), so only CPU pods land on the real
# node. PodNodeSelector + PodTolerationRestriction: a namespace's annotations pin its pods to
# the kwok nodes (the kwok tier's namespaces, tests/e2e/conftest.py). OwnerReferencesPermissionEnforcement: the operator sets
# blockOwnerDeletion, so the test checks it holds the finalizers permission this plugin demands.
start kube-apiserver "$K8S_BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address="$API_IP" --advertise-address="$API_IP" --secure-port="$APISERVER_PORT" \
  --cert-dir="$D/pki" --token-auth-file="$D/pki/tokens.csv" --authorization-mode=Node,RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$D/pki/sa.key" --service-account-signing-key-file="$D/pki/sa.key" \
  --service-cluster-ip-range=10.96.0.0/16 --allow-privileged=true \
  "${RECONCILER[@]}" "${KUBELET_CLIENT_FLAGS[@]}" \
  --enable-admission-plugins=OwnerReferencesPermissionEnforcement,ExtendedResourceToleration,PodNodeSelector,PodTolerationRestriction \
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
lws_start             # LWS CRD, controller manager, its webhooks (registered once it serves)
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
spec:
  # CPU pods without a toleration go to the real node; GPU workloads tolerate nvidia.com/gpu.
  taints: [{key: nvidia.com/gpu, value: present, effect: NoSchedule}]
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", nvidia.com/gpu: "$GPUS"}
NODE
done > "$D/nodes.yaml"
wait_for "default namespace" 60 "$KUBECTL" get ns default -o name
"$KUBECTL" apply -f "$D/nodes.yaml" >&2
if [[ "$KVMESH_REAL_NODE" != 0 ]]; then
  node_start          # containerd (+ images), kubelet, kube-proxy, CoreDNS
fi
wait_for "nodes Ready" 120 "$KUBECTL" wait --for=condition=Ready node --all --timeout=5s
wait_for "default service account" 60 "$KUBECTL" get serviceaccount default -o name
if [[ "$KVMESH_REAL_NODE" != 0 ]]; then
  node_wait_ready     # kube-proxy rules for default/kubernetes, DNS answers
fi

t1=$(date +%s.%N)
python3 -c "print(f'{$t1-$t0:.1f}')" > "$D/startup_seconds"
log "cluster up in $(cat "$D/startup_seconds")s; export KUBECONFIG=$KUBECONFIG_PATH"
echo "$KUBECONFIG_PATH"
