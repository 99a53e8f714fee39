"""Shared fixtures: the embedded model loaded once per session, and the HF oracle on the same weights.

Every test carries exactly one tier marker (pyproject's markers say what each tier may do), the one
of the folder it sits in: a test without one would silently fall out of every `make test-*`
selection, and one in the wrong folder would run in a process it was not meant for, so collection
refuses both. A unit test that connects or binds a network socket fails. Every test starts with
Python's, numpy's and torch's generators seeded from its fixed seed (tests/seeds.py), and hypothesis
runs derandomized: a result never depends on a seed drawn at run time unless KVMESH_TEST_SEED asks.
"""

from __future__ import annotations

import os
import random
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest
import torch
from seeds import describe, randomized, seed_for

from kvmesh.common.env import env

try:
    from hypothesis import settings
except ImportError:  # a GPU machine's Python may lack it; no test run there uses it
    settings = None

TIERS = ("unit", "integration", "e2e", "gpu")
# The tier of each folder under tests/ (the kernel tests are unit tests with a process of their own).
# tests/bench, the benchmarks' own tests (the one folder whose tests import kvmesh.bench), has unit and
# integration modules side by side: each module's marker says which, and the tiers' targets run both.
FOLDER_TIER = {"unit": "unit", "kernels": "unit", "integration": "integration", "e2e": "e2e", "gpu": "gpu"}
TESTS = Path(__file__).parent
if settings is not None:
    settings.register_profile("kvmesh", derandomize=not randomized())
    settings.load_profile("kvmesh")
# The e2e session fixture builds the Kubernetes binaries and images and starts the cluster inside the
# first e2e test's setup (each step bounded by its own subprocess timeout); the others keep
# pyproject's per-test timeout.
E2E_TIMEOUT_S = 3 * 3600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        want = FOLDER_TIER.get(folder) if folder else None
        if len(tiers) != 1:
            bad.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier marker'}")
        elif want is not None and tiers != [want]:
            bad.append(f"{item.nodeid}: marked {tiers[0]} in tests/{folder}/ (the {want} tier)")
        elif tiers == ["e2e"] and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
    if bad:
        raise pytest.UsageError(
            f"each test needs exactly one tier marker of {', '.join(TIERS)}, the one of its "
            "folder (pytestmark = pytest.mark.<tier> in its module):\n  " + "\n  ".join(bad)
        )


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """The global generators start from the test's own fixed seed (printed: a failure shows it)."""
    seed = seed_for(request.node.nodeid)
    print(describe(request.node.nodeid))
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _fresh_env() -> Iterator[None]:
    """The product reads its KVMESH_* variables once per process (kvmesh.common.env.env); each test
    starts from the environment as its fixtures left it (a test that changes a variable midway
    calls ``env.cache_clear()`` itself)."""
    env.cache_clear()
    yield
    env.cache_clear()


@pytest.fixture(autouse=True)
def _unit_tests_use_no_network(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit tier's promise (no network), kept by refusing connect and bind on IP sockets."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(name: str, real):
        def call(sock: socket.socket, address, *args):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                raise RuntimeError(
                    f"a unit test may not open network sockets ({name} {address!r}): it belongs in tests/integration"
                )
            return real(sock, address, *args)

        return call

    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, refuse(name, getattr(socket.socket, name)))


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2 GGUF, dequantized once (weights, config, tokenizer)."""
    from kvmesh.engine.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers built from the same GGUF: the correctness oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.common.model_files import embedded_model_path

    warnings.filterwarnings("ignore")
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
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
