#!/usr/bin/env bash
# Stop everything up.sh started (each component in its own process group) and delete the
# cluster's state, so the next up.sh starts clean. Safe to run twice or with nothing running.
# With a real node it also undoes what up.sh did to the machine: pods first (while the API is
# up), then the node's processes, the container shims (by the PIDs found under our own
# containerd state dir, never by name), mounts under the cluster dir, the bridge and veths,
# the KUBE-*/CNI-*/KVMESH-* iptables chains, the blackhole route and the sysctls it changed.
# `check-clean.sh` prints a fingerprint to diff before up.sh and after down.sh.
# KEEP_LOGS=1 keeps the component logs in $KVMESH_CLUSTER_DIR.logs for post-mortems.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
D="$KVMESH_CLUSTER_DIR"
N="$D/node"
log() { echo "[cluster-down] $*" >&2; }

pid_of() { awk -v n="$1" '$1==n{print $2}' "$D/pids" 2>/dev/null | tail -1; }
stop() {  # stop NAME PID: TERM the process group, KILL after 5 s
  local name="$1" pid="$2"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name ($pid) ignored TERM; killing"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
  fi
  log "stopped $name"
}

real_node=0
[[ -d "$N" ]] && real_node=1

if (( real_node )) && [[ -f "$D/pids" ]]; then
  # 1. Pods first, while the API and kubelet are up, so the kubelet tears down each sandbox
  #    (CNI DEL: veth, IP lease) itself. Controllers and scheduler go first so nothing
  #    recreates or reschedules them meanwhile.
  for c in kube-controller-manager lws-controller kube-scheduler; do
    p="$(pid_of "$c")"; [[ -n "$p" ]] && stop "$c" "$p"
  done
  KUBECTL="$TOOLS_DIR/bin/kubectl"
  export KUBECONFIG="$KUBECONFIG_PATH"
  if [[ -x "$KUBECTL" ]] && "$KUBECTL" get --raw /readyz >/dev/null 2>&1; then
    sel="spec.nodeName=$NODE_NAME"
    "$KUBECTL" delete pods -A --field-selector "$sel" --grace-period=2 --wait=false >/dev/null 2>&1
    for _ in $(seq 1 60); do
      [[ -z "$("$KUBECTL" get pods -A --field-selector "$sel" -o name 2>/dev/null)" ]] && break
      sleep 0.5
    done
    left="$("$KUBECTL" get pods -A --field-selector "$sel" -o name 2>/dev/null)"
    [[ -n "$left" ]] && log "pods still on $NODE_NAME after 30 s (forcing): $left"
  fi
fi

# 2. Every recorded process, in reverse start order: CoreDNS, kube-proxy, kubelet,
#    containerd, then the control plane's clients before the apiserver, the apiserver
#    before etcd.
if [[ -f "$D/pids" ]]; then
  tac "$D/pids" | while read -r name pid; do
    [[ -n "${pid:-}" ]] && stop "$name" "$pid"
  done
fi

if (( real_node )); then
  # 3. Container shims outlive containerd. Find them, and the container processes, by what
  #    our own containerd state dir names: each task's bundle holds init.pid and shim.pid.
  #    Also any process whose command line names our socket (a shim whose bundle is gone).
  pids=()
  for f in "$N"/containerd/state/io.containerd.runtime.v2.task/*/*/{init,shim}.pid; do
    [[ -f "$f" ]] && pids+=("$(cat "$f")")
  done
  for p in /proc/[0-9]*; do
    tr '\0' ' ' 2>/dev/null < "$p/cmdline" | grep -qF -- "$N/containerd/containerd.sock" \
      && pids+=("${p#/proc/}")
  done
  if (( ${#pids[@]} )); then
    log "stopping ${#pids[@]} container/shim process(es): ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null
    for _ in $(seq 1 30); do
      alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      (( alive )) || break; sleep 0.1
    done
  fi
  # 4. Mounts under the cluster dir (pod volumes, overlay rootfs, netns bind mounts, shm),
  #    deepest first; lazily, so a busy one cannot stop the rest.
  awk -v d="$D/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
  # 5. Container cgroups that runc made (named after the container ids in our state dir) if
  #    the shim was killed before it could remove them.
  for id in $(ls "$N"/containerd/state/io.containerd.runtime.v2.task/*/ 2>/dev/null); do
    find /sys/fs/cgroup -mindepth 2 -maxdepth 4 -type d -name "*$id*" 2>/dev/null | sort -r \
      | xargs -r rmdir 2>/dev/null
  done
fi

# 6. Machine-wide network state of the real node. Done whenever we own it (or nobody does
#    but our bridge exists), even without $N, so a half-finished up.sh is undone too.
owner="$(cat "$REAL_NODE_OWNER" 2>/dev/null || true)"
if (( real_node )) || [[ "$owner" == "$D" ]]; then
  for v in $(ip -o link show master "$NODE_BRIDGE" 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
    ip link del "$v" 2>/dev/null
  done
  ip link del "$NODE_BRIDGE" 2>/dev/null && log "deleted bridge $NODE_BRIDGE"
  # iptables: first the rules in built-in chains that jump to our chains, then our chains
  # (flush all before deleting any: they reference each other).
  for ipt in iptables ip6tables; do
    for t in filter nat mangle raw; do
      "$ipt-save" -t "$t" 2>/dev/null | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE|CNI|KVMESH)-' \
        | sed 's/^-A /-D /' | while read -r rule; do
          eval "$ipt -t $t $rule" 2>/dev/null
        done
      chains="$("$ipt-save" -t "$t" 2>/dev/null | awk '/^:(KUBE|CNI|KVMESH)-/{print substr($1, 2)}')"
      for c in $chains; do "$ipt" -t "$t" -F "$c" 2>/dev/null; done
      for c in $chains; do "$ipt" -t "$t" -X "$c" 2>/dev/null; done
    done
  done
  # Tables that did not exist before up.sh and are empty now (iptables-nft leaves them).
  if [[ -f "$N/iptables-tables.before" ]] && command -v nft >/dev/null; then
    for ipt in iptables ip6tables; do
      fam=ip; [[ "$ipt" == ip6tables ]] && fam=ip6
      for t in filter nat mangle raw; do
        grep -qx "$ipt $t" "$N/iptables-tables.before" && continue
        "$ipt-save" -t "$t" 2>/dev/null | grep -q '^\*' || continue
        # empty: no rules, no user chains, every policy ACCEPT
        "$ipt-save" -t "$t" | grep -vE '^(#|\*|COMMIT|:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) ACCEPT )' \
          | grep -q . || nft delete table "$fam" "$t" 2>/dev/null
      done
    done
  fi
  # kubelet's device manager socket has a fixed path, outside --root-dir.
  if [[ -f "$N/var-lib-kubelet.created" ]]; then
    rm -f /var/lib/kubelet/device-plugins/kubelet.sock
    rmdir /var/lib/kubelet/device-plugins /var/lib/kubelet 2>/dev/null
  fi
  # Fixed paths that did not exist before up.sh: the shims' socket dir, libcni's result cache
  # (our network's entries), the k8s.io parent cgroups runc made (empty once tasks are gone).
  if [[ -f "$N/fixed-paths.created" ]]; then
    grep -qx /run/containerd "$N/fixed-paths.created" && { rmdir /run/containerd/s /run/containerd/runc/k8s.io /run/containerd/runc /run/containerd 2>/dev/null; }
    if grep -qx /var/lib/cni "$N/fixed-paths.created"; then
      rm -f /var/lib/cni/results/kvmesh-e2e-* ; rmdir /var/lib/cni/results /var/lib/cni 2>/dev/null
    fi
    if grep -qx /sys/fs/cgroup/memory/k8s.io "$N/fixed-paths.created"; then
      find /sys/fs/cgroup/*/k8s.io -depth -type d 2>/dev/null | xargs -r rmdir 2>/dev/null
    fi
  fi
  ip route del "$SERVICE_CIDR" dev "$NODE_BRIDGE" 2>/dev/null   # gone with the bridge anyway
  ip route del blackhole "$SERVICE_CIDR" metric 4242 2>/dev/null && log "removed blackhole route $SERVICE_CIDR"
  if [[ -f "$N/sysctl.saved" ]]; then
    while IFS== read -r k v; do sysctl -qw "$k=$v" 2>/dev/null; done < "$N/sysctl.saved"
  fi
  [[ "$owner" == "$D" ]] && rm -f "$REAL_NODE_OWNER"
fi

if [[ -d "$D" ]]; then
  if [[ "${KEEP_LOGS:-0}" == 1 && -d "$D/logs" ]]; then
    rm -rf "$D.logs"; cp -r "$D/logs" "$D.logs"
  fi
  rm -rf "$D" 2>/dev/null || { sleep 1; rm -rf "$D" || log "could not remove all of $D"; }
fi
log "down"
