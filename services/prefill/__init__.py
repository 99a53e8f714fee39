"""The prefill service: the shared engine with ``role=prefill``.

It computes prompts for requests that carry ``kv_transfer_params={"do_remote_decode": true}``,
answers with the first token and the params a decode pod needs, and keeps the
blocks (under a lease) until the decode pod has read them. There is no prefill
specific scheduler: the role only changes the connector's answers.
Run it with ``kvmesh prefill`` (same flags as ``kvmesh serve``).
"""
ROLE = "prefill"
