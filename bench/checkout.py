"""Import kvmesh from this checkout on machines where it is not installed (the lent GPU box).

The device gets a copy of the working tree but cannot pip-install it, and the
pyproject maps folders into one namespace (``kvmesh.engine`` <- ``engine/``), so a
plain ``sys.path`` entry is not enough. ``import_checkout`` loads the mapped
packages by file location once, and does nothing where kvmesh is installed.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"kvmesh": "kvmesh", "kvmesh.kernels": "kernels", "kvmesh.engine": "engine"}


def import_checkout(module: str = "kvmesh.engine.core"):
    """Return ``module``, installed or mapped from this checkout's folders."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    for name in [n for n in sys.modules if n == "kvmesh" or n.startswith("kvmesh.")]:
        del sys.modules[name]
    for name, folder in FOLDERS.items():
        path = os.path.join(ROOT, folder)
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        if "." in name:
            setattr(sys.modules["kvmesh"], name.split(".")[1], mod)
    return importlib.import_module(module)
