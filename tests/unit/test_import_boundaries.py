"""Import boundaries: the router runs without torch, product code never imports the CLI or test harnesses.

The router imports the engine's shared pieces from `kvmesh.common` (chat rendering, block hashing,
the KV-event codec and its keys, the model's config and tokenizer), never `kvmesh.engine`, whose
loader and runner import torch: so a router starts without loading torch, and its image need not
carry it. Product code (engine, services, operator, kernels, kvmesh.common) imports nothing from
the CLI package (`kvmesh.cli`, `kvmesh.commands`, the benches, `kvmesh up`'s topology) or from a
``testing`` module: the dependency goes from the command line to the product, never back.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# Run first in each child: torch and triton look installed (transformers' availability checks find
# them, as in this checkout's venv) but any import of them fails. A finder that refused them in
# `find_spec` itself would break those checks instead of the imports they guard.
BLOCK_TORCH = """
import importlib.abc, importlib.machinery, sys

class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked by test_import_boundaries")

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} is blocked by test_import_boundaries")

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "triton"):
            return importlib.machinery.ModuleSpec(name, _Refuse())
        return None

sys.meta_path.insert(0, _Block())
"""

ROUTER = """
import json, sys
import kvmesh.services.router.app
from kvmesh.services.router.tokens import RouterTokenizer

rt = RouterTokenizer(None)
chat = rt.prompt_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]})
prompt = rt.prompt_ids("/v1/completions", {"prompt": "The capital of France is"})
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "triton") or m.startswith("kvmesh.engine"))
print(json.dumps({"chat": chat, "prompt": prompt, "identity": rt.identity, "loaded": loaded}))
"""

CHAT = [{"role": "user", "content": "Hello there"}]
PROMPT = "The capital of France is"


def _run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_the_router_command_runs_without_torch():
    """`kvmesh router` (the router image's entry point) parses its flags with torch unimportable: the
    CLI registers every command, so no command module may import torch when it is registered."""
    code = "from kvmesh.cli import main\ntry:\n    main(['router', '--help'])\nexcept SystemExit as e:\n"
    code += "    print('exit', e.code)"
    done = _run_blocked(code)
    assert done.returncode == 0 and "exit 0" in done.stdout and "--discovery" in done.stdout, done.stderr[-4000:]


def test_the_router_starts_and_tokenizes_without_torch():
    """The router's app and tokenizer import, load the embedded model's tokenizer and tokenize a chat
    and a prompt with torch unimportable, and load no `kvmesh.engine` module; its ids and hash identity
    are the engine's (computed here, with torch)."""
    from kvmesh.common.chat import render_chat
    from kvmesh.common.model_files import load_model_files
    from kvmesh.engine.loader import load_model

    load_model_files(None)  # converts the GGUF's tokenizer into the cache if this machine has none yet
    done = _run_blocked(ROUTER)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    engine = load_model(None, load_weights=False)
    assert got["chat"] == render_chat(engine.tokenizer, CHAT)
    assert got["prompt"] == list(engine.tokenizer(PROMPT, add_special_tokens=True).input_ids)
    assert got["identity"] == engine.config.identity()


def test_the_torch_block_catches_an_import_of_torch():
    """The same child setup fails on the engine's loader, which does import torch: the check above can fail."""
    done = _run_blocked("import kvmesh.engine.loader\n")
    assert done.returncode != 0
    assert "torch is blocked by test_import_boundaries" in done.stderr


# ---- static: what product modules import ------------------------------------------------------
# Product source folders and the packages they install as (pyproject's package-dir).
PRODUCT = {
    "engine": "kvmesh.engine",
    "services": "kvmesh.services",
    "operator": "kvmesh.operator",
    "kernels": "kvmesh.kernels",
    "kvmesh/common": "kvmesh.common",
}
# The CLI package's modules: the command line, its benches and `kvmesh up`'s process management.
CLI_MODULES = ("kvmesh.cli", "kvmesh.cli_fields", "kvmesh.commands", "kvmesh.topology", "kvmesh.health")

# (importing file, imported module): imports that exist and cannot go yet. This list may only shrink.
KNOWN: dict[tuple[str, str], str] = {}


def _product_files() -> list[tuple[Path, str]]:
    """(file, its module name) of every product source file."""
    out = []
    for folder, package in PRODUCT.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((path, ".".join((package, *parts))))
    return out


def _imported(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions, ``TYPE_CHECKING`` blocks), relative
    imports resolved; ``from a import b`` counts as both ``a`` and ``a.b`` (b may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.add(source)
            out.update(f"{source}.{a.name}" for a in node.names if a.name != "*")
    return out


def _cli_or_testing(target: str) -> str | None:
    """The CLI or testing module ``target`` is or is in (``kvmesh.health.wait_until`` -> ``kvmesh.health``)."""
    parts = target.split(".")
    if parts[0] != "kvmesh":
        return None
    if "testing" in parts:
        return ".".join(parts[: parts.index("testing") + 1])
    if len(parts) > 1 and parts[1].startswith("bench_"):
        return ".".join(parts[:2])
    return next((m for m in CLI_MODULES if target == m or target.startswith(m + ".")), None)


def test_product_code_imports_neither_the_cli_nor_testing_modules():
    found = {
        (str(path.relative_to(ROOT)), hit)
        for path, module in _product_files()
        for target in _imported(path, module)
        if (hit := _cli_or_testing(target)) is not None
    }
    assert found - set(KNOWN) == set(), "product code imports the CLI package or a testing module"
    assert set(KNOWN) - found == set(), "an exception in KNOWN is gone: remove it from the list"


def test_kvmesh_common_imports_no_torch_and_nothing_above_it():
    """`kvmesh.common` is below everything else: the router and the engine import it, not the reverse."""
    above = ("kvmesh.engine", "kvmesh.services", "kvmesh.operator", "kvmesh.kernels", "torch", "triton")
    found = {
        (str(path.relative_to(ROOT)), target)
        for path, module in _product_files()
        if module.startswith("kvmesh.common")
        for target in _imported(path, module)
        if any(target == m or target.startswith(m + ".") for m in above)
    }
    assert found == set()
