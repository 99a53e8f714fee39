"""``kvmesh serve --quantization fp8``: a real server process on loopback quantizes the embedded
SmolLM2 at load and answers through the official OpenAI client."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_serve_quantization_fp8_answers(tmp_path):
    from openai import OpenAI

    from kvmesh.testing.servers import ServerProcess

    log = str(tmp_path / "server.log")
    args = ["--quantization", "fp8", "--max-model-len", "512", "--num-kv-blocks", "64"]
    with ServerProcess(args, log_path=log) as srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert r.choices[0].text.strip(), "an FP8 model should still say something"
    with open(log) as f:
        text = f.read()
    assert "fp8: 120 projection weights in e4m3 (0 from the checkpoint, 120 quantized at load)" in text, text[-2000:]
