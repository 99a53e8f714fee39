"""What the router, the API server, the engine and the operator share, without the engine.

Every module here imports neither torch nor the engine (`kvmesh.engine`), nor the CLI (`kvmesh.cli`,
`kvmesh.commands`): the router and the operator import this package and run in images without
torch, and product code never imports the command line. tests/unit/test_import_boundaries.py
checks both.

* `chat`: conversations to the token ids the model sees (the API server, the router, `LLM`).
* `hashing`: the chained block hashes the engine, the connectors and the router agree on.
* `kv_events`, `kv_events_auth`, `kv_auth`: the KV-event wire codec, its CURVE keys, the KV-path secret.
* `model_files`: a model's config and tokenizer (HF folder or GGUF), without its weights.
* `roles`: the roles a worker serves.
* `fields`: settings declared once as dataclass fields, turned into flags and read back.
"""
