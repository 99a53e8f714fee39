"""Every package folder ships in the wheel the images install.

pyproject maps folders into one namespace and lists its packages by hand; a new subpackage
missing from that list works in the editable checkout and is absent from `pip install .`
(the images), so the miss would only show in a pod.
"""

from __future__ import annotations

import pathlib
import tomllib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    folder_of = {name: ROOT / folder for name, folder in mapping.items()}
    found = set()
    for name, folder in folder_of.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(folder).parts
            package = ".".join((name, *rel)) if rel else name
            # a folder mapped by its own entry belongs to that entry, not to a parent's walk
            if any(init.parent == f for n, f in folder_of.items() if n != name) and rel:
                continue
            found.add(package)
    assert found - listed == set(), f"package folders missing from [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"[tool.setuptools] packages without a folder: {sorted(listed - found)}"
