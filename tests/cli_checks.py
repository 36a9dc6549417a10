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


# A process started in the background of a non-interactive shell (a CI runner's job, `cmd &`) inherits SIGINT
# ignored, and Python then keeps ignoring it, as POSIX programs do; so does every process it starts. The tests
# that press Ctrl-C start their command as a terminal's foreground command is started: SIGINT with Python's
# default handler. ARGS are python's own after the interpreter: ["-m", module, ...] or ["-c", code, ...].
_AS_FOREGROUND = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
mode, target, *rest = sys.argv[1:]
if mode == "-m":
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *rest]
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
"""


def as_foreground(args: list[str]) -> list[str]:
    """The python arguments that run `args` (["-m", module, ...] or ["-c", code, ...]) with SIGINT's default
    handler, whatever the test runner inherited."""
    assert args[0] in ("-m", "-c"), args
    return ["-c", _AS_FOREGROUND, *args]
