"""The console script starts without the heavy libraries: `natsl --help` must not wait for torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "matplotlib", "datasets", "tokenizers", "numpy", "natsl.models")


def loaded_after(code: str) -> list[str]:
    script = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_the_cli_loads_no_heavy_module():
    assert loaded_after("import natsl.cli.main") == []


def test_help_of_every_command_loads_no_heavy_module():
    code = ("from typer.testing import CliRunner\nfrom natsl.cli.main import app\n"
            "for cmd in ([], ['info'], ['generate'], ['eval-ppl'], ['eval-ruler'], ['inspect-routing'],\n"
            "            ['bench-latency'], ['train'], ['tokenize'], ['convert'], ['warmup']):\n"
            "    result = CliRunner().invoke(app, cmd + ['--help'])\n"
            "    assert result.exit_code == 0, (cmd, result.output)")
    assert loaded_after(code) == []


def test_the_public_names_still_resolve():
    import natsl

    assert natsl.load_recipe("tiny_hybrid").model.num_layers > 0
    assert {"Recipe", "ModelConfig", "load_recipe", "build_model", "load_checkpoint"} <= set(dir(natsl))
    from natsl.config import ModelConfig, Recipe

    assert natsl.ModelConfig is ModelConfig and natsl.Recipe is Recipe
    assert callable(natsl.build_model) and callable(natsl.load_checkpoint)
    try:
        natsl.no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("natsl.no_such_name resolved")
