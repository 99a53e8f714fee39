"""Import boundaries: the router runs without torch, product code never imports the CLI or test harnesses.

The router imports the engine's shared pieces from `kvmesh.common` (chat rendering, block hashing,
the KV-event codec and its keys, the model's config and tokenizer), never `kvmesh.engine`, whose
loader and runner import torch: so a router starts without loading torch, and its image need not
carry it. Product code (engine, services, operator, kernels, kvmesh.common, and the process helpers
`kvmesh.topology`, `kvmesh.health`, `kvmesh.aio`) imports nothing from the command line
(`kvmesh.cli`, `kvmesh.commands`), the benchmarks (`kvmesh.bench*`, `bench`) or test support
(`kvmesh.testing`, any ``testing`` module): the dependency goes from the command line, the
benchmarks and the tests to the product, never back. A failure names each import by file and line.
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
    from kvmesh.engine.models.loader import load_model

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
    done = _run_blocked("import kvmesh.engine.models.loader\n")
    assert done.returncode != 0
    assert "torch is blocked by test_import_boundaries" in done.stderr


# ---- static: what product modules import ------------------------------------------------------
# Product sources (folders and single files) and the modules they install as (pyproject's package-dir):
# what runs in a pod or under `kvmesh up`, including the process helpers servers and `kvmesh up` share.
PRODUCT = {
    "engine": "kvmesh.engine",
    "services": "kvmesh.services",
    "operator": "kvmesh.operator",
    "kernels": "kvmesh.kernels",
    "kvmesh/common": "kvmesh.common",
    "kvmesh/topology.py": "kvmesh.topology",
    "kvmesh/health.py": "kvmesh.health",
    "kvmesh/aio.py": "kvmesh.aio",
}
# What product code never imports: the command line, the benchmarks and test support (their
# modules and everything below them; `kvmesh.bench*` and any module named ``testing`` by `_forbidden`).
FORBIDDEN = ("kvmesh.cli", "kvmesh.commands", "kvmesh.testing", "bench")


def _product_files() -> list[tuple[Path, str]]:
    """(file, its module name) of every product source file."""
    out = []
    for source, package in PRODUCT.items():
        if source.endswith(".py"):
            out.append((ROOT / source, package))
            continue
        for path in sorted((ROOT / source).rglob("*.py")):
            parts = path.relative_to(ROOT / source).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((path, ".".join((package, *parts))))
    return out


def _imports(path: Path, module: str, text: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` (or ``text``), anywhere in it (functions,
    ``TYPE_CHECKING`` blocks), relative imports resolved; ``from a import b`` counts as both ``a`` and
    ``a.b`` (b may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.append((node.lineno, source))
            out += [(node.lineno, f"{source}.{a.name}") for a in node.names if a.name != "*"]
    return out


def _imported(path: Path, module: str) -> set[str]:
    return {target for _, target in _imports(path, module)}


def _forbidden(target: str) -> str | None:
    """The CLI, bench or testing module ``target`` is or is in (``kvmesh.cli.main`` -> ``kvmesh.cli``),
    or None. A module named ``testing`` counts in our packages and at the top level, not in a
    third-party package's (``numpy.testing`` is that library's own business)."""
    parts = target.split(".")
    if parts[0] == "testing":
        return "testing"
    if parts[0] == "kvmesh" and "testing" in parts:
        return ".".join(parts[: parts.index("testing") + 1])
    if parts[0] == "kvmesh" and len(parts) > 1 and parts[1].startswith("bench"):
        return ".".join(parts[:2])
    return next((m for m in FORBIDDEN if target == m or target.startswith(m + ".")), None)


def _violations(path: Path, module: str, text: str | None = None) -> list[str]:
    """``file:line imports module (forbidden module)`` for each forbidden import in ``path``."""
    return [
        f"{path.relative_to(ROOT)}:{line} imports {target} ({hit})"
        for line, target in sorted(set(_imports(path, module, text)))
        if (hit := _forbidden(target)) is not None
    ]


def test_product_code_imports_neither_the_cli_nor_benches_nor_testing_modules():
    found = [v for path, module in _product_files() for v in _violations(path, module)]
    assert found == [], "product code imports the CLI, a benchmark or test support:\n" + "\n".join(found)


def test_the_walk_covers_every_product_source():
    """Each source in PRODUCT exists and yields files, so a renamed folder cannot empty the check."""
    files = _product_files()
    for source in PRODUCT:
        assert any(p == ROOT / source or ROOT / source in p.parents for p, _ in files), source
    assert (ROOT / "services/router/app.py", "kvmesh.services.router.app") in files


def test_forbidden_names_what_the_product_must_not_import():
    for target, hit in {
        "kvmesh.cli": "kvmesh.cli",
        "kvmesh.cli.main": "kvmesh.cli",
        "kvmesh.commands.up": "kvmesh.commands",
        "kvmesh.bench_router": "kvmesh.bench_router",
        "kvmesh.bench_fuzz.pool_metrics": "kvmesh.bench_fuzz",
        "bench": "bench",
        "bench.pd_serve": "bench",
        "kvmesh.testing": "kvmesh.testing",
        "kvmesh.testing.pods.FakePod": "kvmesh.testing",
        "kvmesh.services.api.testing": "kvmesh.services.api.testing",
        "testing": "testing",
    }.items():
        assert _forbidden(target) == hit, target
    for target in (
        "kvmesh.health",
        "kvmesh.topology",
        "kvmesh.aio",
        "kvmesh.common.chat",
        "kvmesh.clients",
        "benchmark_lib",
        "numpy.testing",
        "kvmesh.services.router.app",
    ):
        assert _forbidden(target) is None, target


def test_a_violation_is_named_with_its_file_and_line():
    """The walk resolves a relative import and reports where it is (a product file's text, made up here)."""
    text = "import json\n\n\ndef f():\n    from .testing import FakePod\n    import kvmesh.cli\n"
    found = _violations(ROOT / "services/router/app.py", "kvmesh.services.router.app", text)
    assert found == [
        "services/router/app.py:5 imports kvmesh.services.router.testing (kvmesh.services.router.testing)",
        "services/router/app.py:5 imports kvmesh.services.router.testing.FakePod (kvmesh.services.router.testing)",
        "services/router/app.py:6 imports kvmesh.cli (kvmesh.cli)",
    ]


def test_no_product_module_imports_a_benchmark():
    """The benchmarks measure the product from outside: neither the product nor the modules of the CLI
    package it may use (`kvmesh up`'s topology, the health wait, the asyncio helpers) import `kvmesh.bench`."""
    files = _product_files() + [(ROOT / "kvmesh" / f"{m}.py", f"kvmesh.{m}") for m in ("topology", "health", "aio")]
    found = {
        (str(path.relative_to(ROOT)), target)
        for path, module in files
        for target in _imported(path, module)
        if target == "kvmesh.bench" or target.startswith("kvmesh.bench.")
    }
    assert found == set()


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


# What the operator's image lacks (docker/operator.Dockerfile installs kopf, kubernetes, pyyaml and
# prometheus-client, and kvmesh without its dependencies): none of it may be imported by the operator.
NOT_IN_OPERATOR_IMAGE = ("torch", "triton", "msgspec", "cbor2", "zmq", "numpy", "tokenizers", "fastapi", "uvicorn")


def test_the_operator_imports_with_only_its_image_packages():
    """The operator's modules (handlers, render, planner) import with every package its image lacks made
    unimportable, so a setting it reads through `EngineArgs` never pulls in the engine's libraries."""
    code = BLOCK_TORCH.replace('("torch", "triton")', repr(NOT_IN_OPERATOR_IMAGE))
    code += "import kvmesh.operator.handlers, kvmesh.operator.render, kvmesh.operator.planner_loop\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-4000:]
