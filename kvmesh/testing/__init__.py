"""Test support: real servers on loopback for the tests and the benchmarks, never imported by the product.

* servers.py: `ServerProcess`, a `kvmesh serve` process in its own process group, and /proc helpers
  (`children`, `descendants`, `alive`) to check that none is left behind.
* pods.py: `ThreadServer` (uvicorn on a thread), `FakePod` (a scripted OpenAI-style pod),
  `start_router`, `IdTokenizer`, `wait_for`, and the KV-event outsider probes.

Installed with the package so the benchmarks (``kvmesh bench``) can start servers too; the product
(engine, services, operator, kvmesh.common) imports nothing from here (tests/unit/test_import_boundaries.py).
"""
