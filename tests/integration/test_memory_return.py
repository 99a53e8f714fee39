"""A huge request's memory goes back to the system once it is answered (services/request_guard.py calls
kvmesh/common/heap.py's trim after a large body): a real `kvmesh serve` tokenizes a 7 MB prompt, refuses
it as over the context, and its API process ends within 10% of its size before the request. Without the
trim the same run left the process about 80% larger for good."""

from __future__ import annotations

import httpx
import pytest

from kvmesh.testing.pods import wait_for

pytestmark = pytest.mark.integration


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_a_huge_prompt_leaves_no_memory_behind(tmp_path):
    from kvmesh.testing.servers import ServerProcess

    srv = ServerProcess(
        ["--max-model-len", "512", "--num-kv-blocks", "64"],
        env={"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"},
        log_path=str(tmp_path / "serve.log"),
    )
    srv.start()
    try:
        assert srv.proc is not None
        pid = srv.proc.pid  # the API process (the engine is its child)
        ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=120)
        assert ok.status_code == 200
        before = _rss_mib(pid)
        big = "word " * 1_400_000  # 7 MB of text, about 1.4M tokens: under the body limit, over the context
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": big, "max_tokens": 2}, timeout=600)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        assert wait_for(lambda: _rss_mib(pid) <= before * 1.1, timeout=30, poll=0.5), (before, _rss_mib(pid))
        again = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=120)
        assert again.status_code == 200  # and it still serves
    finally:
        srv.stop()
