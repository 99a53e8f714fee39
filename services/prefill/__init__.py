"""The prefill pod: the engine behind the OpenAI API in the prefill role (`kvmesh prefill`, `entry.py`:
the API server's flags with ``--role prefill`` as the default).

What a prefill pod does (its `RolePolicy`, ``policy_for("prefill")`` in kvmesh/common/roles.py, is what the
connectors and the shutdown ask):
- computes a prompt's KV and answers with the first token and ``kv_transfer_params`` naming where the
  blocks are (the router then sends the request to a decode pod);
- keeps those blocks for the reader, under a lease a claim extends: NIXL's side channel serves them
  (engine/connectors/nixl_connector.py), or the Redis connector saves them to the store;
- drains by holding on: on SIGTERM it stops taking requests, finishes its open ones, then keeps
  stepping until every held block is pulled or its lease ends (`drain.py`, called by the engine
  process), so a decode pod mid-read never finds its source gone;
- exports what the planner scales it by: ``kvmesh:prompt_tokens_pending``, ``kvmesh:kv_held_requests``
  and the TTFT histogram (`metrics.py` declares the first two; every pod exports them).
"""
