"""requirements.lock names every package pyproject.toml and requirements/*.txt ask for.

`make install` installs exactly the lock (`uv pip sync`): a dependency added to pyproject.toml without
`make lock` would silently not be installed. This fails instead, naming it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "requirements"


def _name(requirement: str) -> str:
    """The normalized project name of a requirement line (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _lines(path: Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def test_the_lock_names_every_requirement_with_hashes():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    wanted |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    wanted |= {_name(r) for f in ("extra.txt", "no-deps.txt", "constraints.txt") for r in _lines(REQS / f)}
    lock = (ROOT / "requirements.lock").read_text()
    pinned = {_name(m) for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock, re.M)}
    assert wanted - pinned == set(), "run `make lock`: these are not in requirements.lock"
    # hash-checked: every pinned entry is followed by at least one --hash
    blocks = re.split(r"\n(?=[A-Za-z0-9])", lock)
    unhashed = [b.split()[0] for b in blocks if re.match(r"[A-Za-z0-9].*==", b) and "--hash=sha256:" not in b]
    assert unhashed == []


def test_constraints_and_the_lock_agree():
    """A version held on purpose (constraints.txt) is the version the lock installs."""
    lock = (ROOT / "requirements.lock").read_text()
    for line in _lines(REQS / "constraints.txt"):
        name, _, version = line.partition("==")
        got = re.search(rf"^{re.escape(name)}==([^ ;\\\n]+)", lock, re.M | re.I)
        assert got and got.group(1) == version, (line, got and got.group(0))
