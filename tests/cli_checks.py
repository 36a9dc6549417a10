"""Assertions shared by the CLI tests."""


def assert_one_line_error(result, *fragments):
    """A typer CliRunner result of bad input: exit code 2, no traceback, one `error:` line on stderr
    holding every fragment."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
