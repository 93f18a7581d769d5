"""Flags derived from the config dataclasses (pdserve/config.py), so each is declared once.

A field ``chunk_size`` is the flag ``--chunk-size``; its type, default and help come from the
field. A bool that defaults to False is a switch (``--disable-cuda-graph``); one that defaults
to True also has its ``--no-`` form (``--no-layerwise-transfer``). A list is comma-separated.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _settings(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """The fields of ``cls`` that are flags (not nested configs), with their resolved types."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(hints[f.name])]


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def changed(config: Any) -> list[str]:
    """The names of ``config``'s settings that differ from their defaults."""
    return [f.name for f, _ in _settings(type(config)) if getattr(config, f.name) != _default(f)]


def flags_of(cls: type, skip: Iterable[str] = ()) -> list[str]:
    """The flag names of ``cls``'s settings (without nested configs)."""
    return [flag_name(f.name) for f, _ in _settings(cls) if f.name not in set(skip)]


def flag_kinds(cls: type) -> dict[str, str]:
    """Each flag of ``cls`` (without dashes) and how it takes a value: "value" (``--x=V``),
    "switch" (``--x``, off by default) or "toggle" (``--x`` / ``--no-x``)."""
    kinds = {}
    for f, kind in _settings(cls):
        name = flag_name(f.name)[2:]
        kinds[name] = ("toggle" if _default(f) else "switch") if kind is bool else "value"
    return kinds


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: Iterable[str] = (),
              defaults: dict[str, Any] | None = None) -> None:
    """Adds one flag per setting of ``cls`` to ``parser`` (or an argument group); ``defaults``
    overrides a field's default for this parser."""
    skipped, overrides = set(skip), defaults or {}
    for f, kind in _settings(cls):
        if f.name in skipped:
            continue
        default = overrides.get(f.name, _default(f))
        options = {k: v for k, v in f.metadata.items() if k != "help"}
        shown = ",".join(default) if isinstance(default, list) else default
        help_text = f.metadata.get("help", "") + (f" (default: {shown})" if shown != "" else "")
        help_text = help_text.replace("%", "%%")   # argparse formats help with %: "90%" is text
        if kind is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(flag_name(f.name), dest=f.name, action=action, default=default,
                                help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag_name(f.name), dest=f.name, type=comma_list, default=default,
                                help=help_text, **options)
        else:
            options.setdefault("type", kind)
            parser.add_argument(flag_name(f.name), dest=f.name, default=default,
                                help=help_text, **options)


def from_args(cls: type[T], args: argparse.Namespace, **nested: Any) -> T:
    """``cls`` from parsed flags (settings absent from ``args`` keep their defaults);
    ``nested`` gives its nested configs."""
    values = {f.name: getattr(args, f.name) for f, _ in _settings(cls) if hasattr(args, f.name)}
    return cls(**values, **nested)


def to_argv(config: Any, skip: Iterable[str] = ()) -> list[str]:
    """The flags that give a process ``config``'s settings (those that differ from the
    defaults; nested configs are not included)."""
    given = set(changed(config)) - set(skip)
    argv: list[str] = []
    for f, kind in _settings(type(config)):
        value = getattr(config, f.name)
        if f.name not in given:
            continue
        if kind is bool:
            argv.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif typing.get_origin(kind) is list:
            argv += [flag_name(f.name), ",".join(value)]
        else:
            argv += [flag_name(f.name), str(value)]
    return argv
