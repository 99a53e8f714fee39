"""The LoRA benchmarks' pieces that need no GPU and no server: the random PEFT adapters they write
(read back by the engine's own loader), bench/gpu_lora_decode.py end to end on the CPU (--smoke),
and `kvmesh bench serve --model a,b,...` taking the models in turn (bench/lora_serve.py's adapter run)."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch
from bench_smoke import run_smoke

from kvmesh.bench import serve as bench_serve
from kvmesh.bench.lora_adapters import write_adapter
from kvmesh.common.model_files import model_config_from_hf
from kvmesh.engine.lora.adapter import LORA_MODULES, load_adapter, module_shape
from kvmesh.engine.models.random_init import scaled_config

pytestmark = pytest.mark.unit


def test_written_adapters_load_as_peft_folders(tmp_path):
    cfg = model_config_from_hf(
        scaled_config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=300,
        ),
        "tiny",
    )  # fmt: skip
    path = write_adapter(str(tmp_path / "a"), cfg, rank=8, alpha=16.0, seed=3)
    ad = load_adapter("a", path, cfg, max_rank=16)
    assert ad.rank == 8 and ad.scaling == 2.0 and ad.modules == sorted(LORA_MODULES)
    assert len(ad.weights) == 3 * len(LORA_MODULES)
    for (_, m), (a, b) in ad.weights.items():
        fin, fout = module_shape(cfg, m)
        assert a.shape == (8, fin) and b.shape == (fout, 8) and b.abs().sum() > 0  # not PEFT's B = 0
    again = load_adapter("a", write_adapter(str(tmp_path / "b"), cfg, rank=8, alpha=16.0, seed=3), cfg, 16)
    other = load_adapter("c", write_adapter(str(tmp_path / "c"), cfg, rank=8, alpha=16.0, seed=4), cfg, 16)
    assert again.digest == ad.digest != other.digest  # a seed is one adapter
    q = write_adapter(str(tmp_path / "q"), cfg, rank=4, modules=("q_proj", "v_proj"), dtype=torch.float32)
    assert load_adapter("q", q, cfg, 16).modules == ["q_proj", "v_proj"]


def test_lora_decode_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    """bench/gpu_lora_decode.py --smoke: every case at every batch size, its token checks passing,
    its table printed and its JSON written."""
    run = run_smoke("gpu_lora_decode", tmp_path, "--repeats", "1", timeout=180)
    assert "8 adapters" in run.stdout and "PASS" in run.stdout
    res = run.results
    assert {(r["case"], r["B"]) for r in res["rows"]} == {
        (c, b) for c in ("base", "none", "one", "eight", "sep_one", "sep_eight") for b in (1, 4, 8)
    }
    c = res["checks"]
    assert c["pass"] and set(c["base_rows"]) == {"1", "4", "8"} and set(c["mixed_eq_one"]) == {"4", "8"}
    assert all(r["decode_tok_s"] > 0 and "tokens" not in r for r in res["rows"])
    assert res["solo"]["rows"] == 4


def test_bench_serve_takes_a_comma_list_of_models_in_turn(monkeypatch):
    seen: list[str] = []

    async def fake_send(client, url, model, req, headers):
        seen.append(model)
        return bench_serve.RequestResult(ok=True, prompt_len=len(req.prompt), output_tokens=1, ttft=0.01, e2e=0.01)

    monkeypatch.setattr(bench_serve, "send_one", fake_send)
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    args = p.parse_args(["--model", "a,b,c", "--num-prompts", "7", "--input-len", "3", "--no-progress"])
    results, _ = asyncio.run(bench_serve.run_benchmark(args, bench_serve.make_dataset(args)))
    assert len(results) == 7 and seen == ["a", "b", "c", "a", "b", "c", "a"]
