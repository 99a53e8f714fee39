"""Shared fixtures: the embedded model loaded once per session, and the HF oracle on the same weights."""
from __future__ import annotations

import os
import warnings

import pytest


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2 GGUF, dequantized once (weights, config, tokenizer)."""
    from kvmesh.engine.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers built from the same GGUF: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.loader import embedded_model_path

    warnings.filterwarnings("ignore")
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def make_llm(smol):
    """Build an offline LLM over the already loaded model, with any engine settings."""
    from kvmesh import LLM

    def _make(**kw):
        kw.setdefault("num_kv_blocks", 1024)
        return LLM(loaded=smol, **kw)

    return _make
