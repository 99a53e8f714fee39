"""The decode service: the shared engine with ``role=decode``.

Requests arrive with ``kv_transfer_params={"do_remote_prefill": true, ...}`` from a
prefill pod; the connector pulls those blocks into freshly allocated local
blocks before the request is scheduled, and any failed pull recomputes locally.
Run it with ``kvmesh decode`` (same flags as ``kvmesh serve``).
"""
ROLE = "decode"
