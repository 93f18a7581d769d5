"""Every command's --help, and docs/configuration.md generated from the same help strings."""
from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.config_docs import CONFIGURATION_DOC, configuration_markdown

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, expected", [
    ([], "{up,router,prefill,decode,generate}"),
    (["up"], "--gpu-memory-utilization"),
    (["router"], "--max-stream-interval"),
    (["prefill"], "--chunk-size"),
    (["decode"], "--yield-to-prefill-ms"),
    (["generate"], "--max-new-tokens"),
], ids=["pdserve", "up", "router", "prefill", "decode", "generate"])
def test_help_of_every_command_prints_its_flags(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert expected in " ".join(shown.split())
    assert "Traceback" not in shown


def test_help_shows_a_percent_sign_as_written(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--help"])
    assert "90% of a core" in " ".join(capsys.readouterr().out.split())


def test_configuration_doc_is_up_to_date():
    written = (ROOT / CONFIGURATION_DOC).read_text()
    assert written == configuration_markdown(), "run `make docs`"


def test_configuration_doc_lists_every_flag_of_every_role():
    page = configuration_markdown()
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("up", "router", "prefill", "decode"):
        for action in commands[name]._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, f"{name} {option}"
