"""Command-line flags generated from the fields of a frozen configuration dataclass.

A setting is declared once, as a field: its default is the field's default, and its flag, help
and any argparse specifics travel in the field's metadata (``field(default=..., metadata=cli(...))``).
`add_arguments` turns the fields into flags and `values_from` reads them back, so a command never
re-lists the settings by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Iterator
from typing import Any

CLI = "cli"


def cli(help: str | None = None, *, flag: str | None = None, section: str = "", **argparse_kw: Any) -> dict:
    """Field metadata for a setting with a flag.

    ``flag``: the option string where it is not ``--`` + the field name with dashes; ``section``:
    which of a class's flag sets the field belongs to (`add_arguments` adds one set at a time);
    other keywords go to ``add_argument`` as they are (``choices``, ``action``, ``metavar``...)."""
    return {CLI: {"help": help, "flag": flag, "section": section, **argparse_kw}}


def scalar_type(cls: type, f: dataclasses.Field) -> type:
    """The field's type without ``| None`` (``int | None`` -> ``int``)."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata[CLI]["flag"] or "--" + f.name.replace("_", "-")


def cli_fields(cls: type, section: str | None = "") -> Iterator[dataclasses.Field]:
    """Fields of ``cls`` that have a flag, in declaration order (``section=None``: every section)."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(CLI)
        if spec is not None and (section is None or spec["section"] == section):
            yield f


def add_arguments(
    container: argparse._ActionsContainer, cls: type, section: str = "", only: Collection[str] | None = None
) -> None:
    """One flag per field of ``section``; the flag's dest is the field's name. ``only``: the fields of
    these names instead, whatever their section (a command that takes a few of a class's settings)."""
    fields = cli_fields(cls, section) if only is None else (f for f in cli_fields(cls, None) if f.name in only)
    for f in fields:
        kw = {k: v for k, v in f.metadata[CLI].items() if k not in ("flag", "section")}
        flag = flag_of(f)
        if "action" not in kw:
            t = scalar_type(cls, f)
            if t in (int, float):
                kw["type"] = t
            if "choices" not in kw:  # the metavar argparse derives from the flag, not from the dest
                kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        default: Any = f.default
        if kw.get("action") == "append":
            default = list(default)  # argparse appends to a copy of a list
        container.add_argument(flag, dest=f.name, default=default, **kw)


def values_from(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flag values in ``ns`` by field name, for every field whose flag the parser had."""
    out = {f.name: getattr(ns, f.name) for f in cli_fields(cls, None) if hasattr(ns, f.name)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}  # repeatable flags: tuple fields
