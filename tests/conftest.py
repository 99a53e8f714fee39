"""Shared fixtures: the embedded model loaded once per session, and the HF oracle on the same weights.

Every test carries exactly one tier marker (pyproject's markers say what each tier may do); a test
without one would silently fall out of every `make test-*` selection, so collection refuses it.
"""
from __future__ import annotations

import os
import warnings

import pytest

TIERS = ("unit", "integration", "e2e", "gpu")
# The e2e session fixture builds the Kubernetes binaries and images and starts the cluster inside the
# first e2e test's setup (each step bounded by its own subprocess timeout); the others keep
# pyproject's per-test timeout.
E2E_TIMEOUT_S = 3 * 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            bad.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier marker'}")
        elif tiers == ["e2e"] and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
    if bad:
        raise pytest.UsageError(f"each test needs exactly one tier marker of {', '.join(TIERS)} "
                                "(pytestmark = pytest.mark.<tier> in its module):\n  " + "\n  ".join(bad))


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
