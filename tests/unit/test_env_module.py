"""The product's KVMESH_* variables: read only through kvmesh/common/env.py, parsed by type, documented.

A read of ``os.environ``/``getenv`` with a ``KVMESH_`` name (a literal, or a constant) anywhere else in
the product fails here, naming file:line: such a read would bypass the one declaration (name, type,
default, doc) and be re-parsed per call.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from kvmesh.common import env as ev
from kvmesh.common.env import Env, env_table, from_environ
from kvmesh.operator.config import PREFIX as OPERATOR_PREFIX
from kvmesh.operator.config import OperatorConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "kernels", "services", "operator", "kvmesh")  # bench/ is not the product
EXCLUDED = (
    "kvmesh/common/env.py",  # the one reader
    "kvmesh/bench_*.py",  # benchmarks, not the product
)


def _kvmesh_name(node: ast.AST, consts: dict[str, str]) -> str | None:
    """The KVMESH_ variable ``node`` names: a literal, an f-string or sum starting with one, or a constant
    (this module's ``NAME = "KVMESH_..."``; an imported one in capitals counts, its value unknown)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if node.value.startswith("KVMESH_") else None
    if isinstance(node, ast.JoinedStr) and node.values:
        return _kvmesh_name(node.values[0], consts)
    if isinstance(node, ast.BinOp):
        return _kvmesh_name(node.left, consts)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name is not None and re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
        return consts.get(name, name)
    return None


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "environ") or (
        isinstance(node, ast.Attribute) and node.attr == "environ"
    )


def env_reads(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each read of a KVMESH_ variable from the process environment in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name) and n.value.value.startswith("KVMESH_")
    }
    out = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value):
                arg = node.args[0]
            elif getattr(f, "attr", None) == "getenv" or getattr(f, "id", None) == "getenv":
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            arg = node.left  # "KVMESH_X" in os.environ
        name = _kvmesh_name(arg, consts) if arg is not None else None
        if name is not None:
            out.append((node.lineno, name))
    return out


def product_files() -> list[Path]:
    files = []
    for folder in PRODUCT:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not any(fnmatch.fnmatch(rel, x) for x in EXCLUDED):
                files.append(p)
    return files


def test_the_product_reads_kvmesh_variables_only_through_the_env_module():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in product_files() for line, name in env_reads(p)]
    assert not bad, "read KVMESH_* variables through kvmesh.common.env.env(), not os.environ:\n  " + "\n  ".join(bad)


def test_the_scan_sees_each_form_of_read(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        'import os\nNAME = "KVMESH_X"\n'
        'a = os.environ.get("KVMESH_A")\nb = os.getenv(NAME)\nc = os.environ["KVMESH_C"]\n'
        'd = "KVMESH_D" in os.environ\ne = os.environ.get(ev.CPU_THREADS)\n'
        'os.environ["KVMESH_W"] = "1"\nf = os.environ.get("POD_NAME")\n'
    )
    assert env_reads(f) == [(3, "KVMESH_A"), (4, "KVMESH_X"), (5, "KVMESH_C"), (6, "KVMESH_D"), (7, "CPU_THREADS")]


def test_values_are_parsed_by_type():
    e = Env.from_environ(
        {
            "KVMESH_CPU_THREADS": " 4 ",
            "KVMESH_ENFORCE_EAGER": "yes",
            "KVMESH_UVLOOP": "0",
            "KVMESH_API_KEY": "a, b,,",
            "KVMESH_LOG_LEVEL": "debug",
            "KVMESH_CACHE": "",  # empty: unset
            "KVMESH_NOT_A_SETTING": "x",
        }
    )
    assert (e.cpu_threads, e.enforce_eager, e.uvloop, e.api_key) == (4, True, False, ("a", "b"))
    assert (e.log_level, e.cache) == ("debug", "~/.cache/kvmesh")
    assert Env.from_environ({}) == Env()
    cfg = OperatorConfig.from_env({"KVMESH_OPERATOR_RESYNC_SECONDS": "2.5", "KVMESH_OPERATOR_WATCH_CHILDREN": "false"})
    assert (cfg.resync_seconds, cfg.watch_children) == (2.5, False)


@pytest.mark.parametrize(
    "name, value, want",
    [
        ("KVMESH_CPU_THREADS", "four", "want an integer"),
        ("KVMESH_CPU_THREADS", "0", "want at least 1"),
        ("KVMESH_ENFORCE_EAGER", "maybe", "want one of"),
        ("KVMESH_LOG_LEVEL", "LOUD", "not a log level"),
    ],
)
def test_a_bad_value_names_its_variable(name, value, want):
    with pytest.raises(ValueError, match=rf"\${name}: {want}"):
        Env.from_environ({name: value})


def test_a_bad_operator_value_names_its_variable():
    with pytest.raises(ValueError, match=r"\$KVMESH_OPERATOR_RESYNC_SECONDS: want a number"):
        from_environ(OperatorConfig, {"KVMESH_OPERATOR_RESYNC_SECONDS": "10s"}, OPERATOR_PREFIX)


def test_secrets_stay_out_of_the_repr():
    e = Env(api_key=("api-secret",), kv_auth_key="kv-secret", redis_password="pw-secret", upstream_api_key="up-secret")
    assert "secret" not in repr(e)


def test_names_of_settings():
    assert ev.CPU_THREADS == "KVMESH_CPU_THREADS" and ev.KV_AUTH_KEY == "KVMESH_KV_AUTH_KEY"
    with pytest.raises(AttributeError):
        ev.name_of(Env, "cpu_thread")


@pytest.mark.parametrize(
    "doc, table",
    [("docs/serving.md", env_table), ("docs/operator.md", lambda: env_table(OperatorConfig, OPERATOR_PREFIX))],
)
def test_the_docs_table_is_the_declared_one(doc, table):
    """Each doc holds its variables' table between the markers, as `env_table` writes it."""
    text = (ROOT / doc).read_text()
    m = re.search(r"<!-- env-table -->\n(.*?)<!-- /env-table -->", text, re.S)
    assert m, f"{doc}: no <!-- env-table --> ... <!-- /env-table --> block"
    assert m.group(1) == table(), f"{doc}: regenerate the table with kvmesh.common.env.env_table"
