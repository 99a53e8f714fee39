"""The ``spec.engine`` properties of the InferenceService CRD, written from `EngineArgs`.

The settings an InferenceService exposes are declared on the engine's fields (engine/args.py,
`CrdProperty`); ``python -m kvmesh.operator.crd`` rewrites their block of crds/inferenceservices.yaml
(the chart's crds/ links to that folder) and leaves the rest of the file, comments included, as it
is. tests/unit/test_operator_render.py checks that the checked-in file is what this writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvmesh.common.fields import CLI, scalar_type
from kvmesh.engine.args import CRD, CrdProperty, EngineArgs

CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "inferenceservices.yaml"
ENGINE_KEY = "                engine:"  # spec.versions[].schema.openAPIV3Schema.properties.spec.properties.engine
TYPES = {int: "integer", float: "number", str: "string"}


def engine_properties() -> dict[str, dict[str, Any]]:
    """The OpenAPI schema of each exposed setting, keys in the order the file lists them."""
    out: dict[str, dict[str, Any]] = {}
    for f in EngineArgs.crd_fields():
        p: CrdProperty = f.metadata[CRD]
        schema: dict[str, Any] = {"type": TYPES[scalar_type(EngineArgs, f)]}
        choices = f.metadata[CLI].get("choices")
        enum = p.enum or (tuple(c for c in (p.unset, *choices) if c is not None) if choices else None)
        if enum:
            schema["enum"] = list(enum)
        for key in ("minimum", "maximum"):
            if getattr(p, key) is not None:
                schema[key] = getattr(p, key)
        schema["default"] = p.default
        if p.description:
            schema["description"] = p.description
        out[p.name] = schema
    return out


def _scalar(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, str):
        import yaml

        return v if yaml.safe_load(v) == v else json.dumps(v)  # plain where YAML reads it back unchanged
    return json.dumps(v)


def with_engine_properties(text: str) -> str:
    """``text`` (the CRD file) with the properties under ``spec.engine`` replaced by `engine_properties`."""
    lines = text.splitlines(keepends=True)
    start = lines.index(ENGINE_KEY + "\n")
    indent = len(ENGINE_KEY) - len(ENGINE_KEY.lstrip())
    props = next(i for i in range(start + 1, len(lines)) if lines[i] == " " * (indent + 2) + "properties:\n")
    end = next(
        i
        for i in range(props + 1, len(lines))  # the next key of the engine object, or after it
        if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent + 2
    )
    pad = " " * (indent + 4)
    block = []
    for name, schema in engine_properties().items():
        block.append(f"{pad}{name}:\n")
        block += [f"{pad}  {k}: {_scalar(v)}\n" for k, v in schema.items()]
    return "".join(lines[: props + 1] + block + lines[end:])


def main() -> int:
    text = CRD_FILE.read_text()
    new = with_engine_properties(text)
    if new != text:
        CRD_FILE.write_text(new)
        print(f"wrote {CRD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
