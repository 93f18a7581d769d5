"""docs/configuration.md, generated from the config dataclasses (``make docs`` writes it; a test
fails when it is stale).

Each help string is expanded by argparse itself, as ``--help`` shows it, so a help string that
argparse cannot format breaks the generation as it would break ``--help``.
"""
from __future__ import annotations

import argparse
import dataclasses

from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    LauncherConfig,
    PrefillConfig,
    RouterConfig,
    ServerConfig,
)
from pdserve.settings import add_flags

CONFIGURATION_DOC = "docs/configuration.md"

# Each section: its config, a title, and the commands that take its flags.
SECTIONS: tuple[tuple[type, str, str], ...] = (
    (LauncherConfig, "pdserve up", "`pdserve up`"),
    (ServerConfig, "Every server process", "`pdserve router`, `pdserve prefill`, "
     "`pdserve decode` (`up` sets them for its children)"),
    (EngineConfig, "Model and KV cache", "`pdserve prefill`, `pdserve decode`, `pdserve up`"),
    (PrefillConfig, "Prefill workers", "`pdserve prefill`, `pdserve up`"),
    (DecodeConfig, "Decode workers", "`pdserve decode`, `pdserve up`"),
    (RouterConfig, "Router", "`pdserve router`, `pdserve up` (but the addresses and ports, "
     "which `up` sets itself)"),
)

HEADER = """# Configuration

Every flag of every `pdserve` command, with its default. Generated from the config dataclasses
in `pdserve/config.py` by `make docs`; do not edit by hand (a test fails when this page is
stale). `pdserve COMMAND --help` shows the same text.

A boolean that is off by default is a switch (`--disable-cuda-graph`); one that is on by default
also has a `--no-` form (`--no-layerwise-transfer`). A list is comma-separated. A configuration
mistake is refused with one line and exit code 2.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(cls: type, title: str, commands: str) -> list[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser, cls)
    formatter = parser._get_formatter()
    doc = " ".join((cls.__doc__ or "").split())
    lines = [f"## {title}", "", f"{doc} Taken by {commands}.", "",
             "| flag | help |", "| --- | --- |"]
    for action in parser._actions:
        flags = ", ".join(f"`{option}`" for option in action.option_strings)
        if action.choices and not isinstance(action, argparse.BooleanOptionalAction):
            flags += " {" + ",".join(str(choice) for choice in action.choices) + "}"
        lines.append(f"| {flags} | {_cell(formatter._expand_help(action))} |")
    return lines + [""]


def configuration_markdown() -> str:
    """The whole page."""
    lines = [HEADER]
    for cls, title, commands in SECTIONS:
        assert dataclasses.is_dataclass(cls)
        lines += _section(cls, title, commands)
    return "\n".join(lines).rstrip() + "\n"
