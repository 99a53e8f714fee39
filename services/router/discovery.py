"""Kubernetes discovery: pods from EndpointSlices, watched through the API server.

One watch thread per (role, label selector). Each event re-derives that role's
set of ready endpoints from the slices it has seen (a Service's endpoints can
span several slices) and hands additions and removals to the router's event
loop, which owns the pod table. A watch that ends (timeout, 410 Gone) relists
and rewatches, so the view is level-based, not edge-based.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from kvmesh.common.roles import Role

from .config import PodSpec, RouterConfig

log = logging.getLogger("kvmesh.router.discovery")


def endpoints_from_slice(obj: dict, port_name: str) -> set[tuple[str, int]]:
    """Ready (address, port) pairs of one EndpointSlice in API (camelCase dict) form."""
    ports = obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and ports:
        port = ports[0].get("port")
    if port is None:
        return set()
    out = set()
    for ep in obj.get("endpoints") or []:
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating"):
            continue
        for addr in ep.get("addresses") or []:
            out.add((addr, int(port)))
    return out


class K8sDiscovery:
    def __init__(
        self,
        cfg: RouterConfig,
        loop: asyncio.AbstractEventLoop,
        add: Callable[[PodSpec], None],
        remove: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.add = add
        self.remove = remove
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._known: dict[str, set[str]] = {}  # role -> urls

    def start(self) -> None:
        from kubernetes import config as kconfig

        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            kconfig.load_kube_config()
        for role, selector in self.cfg.k8s_selectors:
            t = threading.Thread(target=self._watch, args=(role, selector), name=f"k8s-{role}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()

    def _spec(self, role: Role, host: str, port: int) -> PodSpec:
        h = f"[{host}]" if ":" in host else host
        c = self.cfg
        return PodSpec(
            f"http://{h}:{port}",
            role,
            f"tcp://{h}:{c.kv_events_port}" if c.kv_events_port else None,
            f"tcp://{h}:{c.kv_replay_port}" if c.kv_replay_port else None,
        )

    def _sync(self, role: Role, slices: dict[str, dict]) -> None:
        eps: set[tuple[str, int]] = set()
        for obj in slices.values():
            eps |= endpoints_from_slice(obj, self.cfg.k8s_port_name)
        specs = {s.url: s for s in (self._spec(role, h, p) for h, p in eps)}
        old = self._known.get(role, set())
        for url in old - specs.keys():
            self.loop.call_soon_threadsafe(self.remove, url)
        for url in specs.keys() - old:
            self.loop.call_soon_threadsafe(self.add, specs[url])
        self._known[role] = set(specs)

    def _watch(self, role: Role, selector: str) -> None:
        from kubernetes import client, watch

        api = client.DiscoveryV1Api()
        ns = self.cfg.k8s_namespace
        while not self._stop.is_set():
            try:
                lst = api.list_namespaced_endpoint_slice(ns, label_selector=selector)
                objs = [api.api_client.sanitize_for_serialization(s) for s in lst.items]
                slices: dict[str, dict] = {o["metadata"]["name"]: o for o in objs}
                assert lst.metadata is not None  # a list response always carries its resourceVersion
                self._sync(role, slices)
                w = watch.Watch()
                for ev in w.stream(
                    api.list_namespaced_endpoint_slice,
                    ns,
                    label_selector=selector,
                    resource_version=lst.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        return
                    obj = api.api_client.sanitize_for_serialization(ev["object"])
                    name = obj["metadata"]["name"]
                    if ev["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    self._sync(role, slices)
            except Exception as e:  # API server restarts, 410 Gone: relist
                log.warning("EndpointSlice watch (%s, %s): %s; relisting", role, selector, e)
                self._stop.wait(2.0)
