#!/usr/bin/env bash
# Print a fingerprint of the machine state that up.sh/down.sh touch, to diff before `up.sh`
# and after `down.sh`:  check-clean.sh > before; up; down; check-clean.sh > after; diff.
# Volatile parts are normalised away (interface indexes, iptables counters and timestamps,
# PIDs); what remains must be identical after a clean teardown.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
section() { echo "== $*"; }

section links;   ip -o link show | sed -E 's/^[0-9]+: //; s/ qlen [0-9]+//; s/ link\/.*//' | sort
section addrs;   ip -o addr show | awk '{print $2, $3, $4}' | sort
section routes;  ip route show table all | grep -v '^local\|^broadcast\|^multicast' | sort
section blackhole-routes; ip route show type blackhole
for ipt in iptables ip6tables; do
  section "$ipt"
  "$ipt-save" 2>/dev/null | grep -v '^#' | sed -E 's/\[[0-9]+:[0-9]+\]/[-]/'
done
section sysctls
sysctl net.ipv4.ip_forward vm.overcommit_memory vm.panic_on_oom kernel.panic \
  kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes \
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables 2>&1
section "mounts under $KVMESH_CACHE and netns/containerd mounts"
awk -v d="$KVMESH_CACHE" 'index($2, d) == 1 || $2 ~ /netns|containerd|kubelet/ {print $1, $2, $3}' /proc/self/mounts
section "processes started from $KVMESH_CACHE or talking to a containerd socket there"
for p in /proc/[0-9]*; do
  exe="$(readlink "$p/exe" 2>/dev/null)" || continue
  cmd="$(tr '\0' ' ' 2>/dev/null < "$p/cmdline")"
  [[ "$exe" == "$KVMESH_CACHE"* || "$cmd" == *"$KVMESH_CACHE"*containerd* || "$exe" == */containerd* ]] \
    && echo "$exe :: $cmd"
done | sort
section "cgroups (the harness's process_api/ and podman/buildah's own left out)"
find /sys/fs/cgroup -mindepth 1 -maxdepth 3 -type d 2>/dev/null | grep -vE 'process_api|buildah-|libpod' | sort
section "state dirs containerd/CNI/kubelet would use by default"
ls -d /run/containerd /run/netns /var/run/netns /var/lib/cni /var/lib/kubelet /var/log/pods \
  /opt/containerd /etc/cni "$REAL_NODE_OWNER" 2>/dev/null
ls -A /run/containerd/s /var/lib/cni 2>/dev/null
