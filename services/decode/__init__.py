"""The decode pod: the engine behind the OpenAI API in the decode role (`kvmesh decode`, `entry.py`:
the API server's flags with ``--role decode`` as the default).

What a decode pod does (its `RolePolicy`, ``policy_for("decode")`` in kvmesh/common/roles.py, is what the
connectors and the shutdown ask):
- takes a request with a prefill pod's ``kv_transfer_params``, pulls the prompt's blocks (NIXL reads
  them from the prefill pod's memory, or Redis loads them) and admits them only if they verify: the
  side channel's MAC with the run's KV-path key, the same model identity and block layout
  (engine/connectors/); a block that does not verify is recomputed, never used. `admission.py`: the
  API side of that admission and where the rest happens;
- serves no reads of its own blocks (it saves nothing to Redis unless asked to, and runs no side channel);
- drains by finishing its streams: on SIGTERM it stops taking requests and finishes the open ones;
- exports the ITL histogram and the running/waiting gauges the planner scales it by
  (services/api/metrics.py, names in kvmesh/common/metric_names.py).
"""
