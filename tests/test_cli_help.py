"""`natsl --help` and every `natsl CMD --help` read whole in an 80-column terminal: no line wider, nothing
cut (rich's '…', click's '...' after a cut summary), every option's and command's help text complete."""

import inspect

import pytest
import typer
from typer.testing import CliRunner

from natsl.cli.main import app

CLICK_APP = typer.main.get_command(app)
COMMANDS = sorted(CLICK_APP.commands)


def help_of(*args) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.stdout


def squeezed(text: str) -> str:
    """The text without whitespace: a wrapped line (or a long word broken across lines) joins up again."""
    return "".join(text.split())


def check_not_cut(text: str) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, line
        assert "…" not in line, line


def test_main_help_lists_each_command_with_its_whole_summary():
    text = help_of()
    check_not_cut(text)
    for name in COMMANDS:
        summary = inspect.cleandoc(CLICK_APP.commands[name].help).split("\n\n")[0]
        assert squeezed(f"{name}{summary}") in squeezed(text), name


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help_is_whole_at_80_columns(name):
    text = help_of(name)
    check_not_cut(text)
    command = CLICK_APP.commands[name]
    assert squeezed(inspect.cleandoc(command.help).split("\n\n")[0]) in squeezed(text)
    for param in command.params:
        if param.help:
            assert squeezed(param.help) in squeezed(text), (name, param.name)
        for option in [*param.opts, *param.secondary_opts]:
            if option.startswith("-"):
                assert option in text, (name, option)
