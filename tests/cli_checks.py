"""Assertions and fault helpers shared by the CLI tests."""


def assert_one_line_error(result, *fragments):
    """A typer CliRunner result of bad input: exit code 2, no traceback, one `error:` line on stderr
    holding every fragment."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def kill_after_commit(monkeypatch, module, commit: int) -> type:
    """Make `natsl tokenize` (`module`: natsl.data.tokenize) raise the returned exception right after its
    `commit`-th committed chunk, where NATSL_FAULT=kill_after_commit:N would SIGKILL it."""
    class Killed(Exception):
        pass

    def die(name, value):
        if name == "kill_after_commit" and value == commit:
            raise Killed

    monkeypatch.setattr(module, "fault_point", die)
    return Killed
