"""KV connector implementations (NIXL, Redis) on the interface in `kvmesh.engine.connector`."""
