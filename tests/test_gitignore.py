"""Every folder a command writes by default (its `--out` default, train's `train.out_dir`) is git-ignored,
so that a run in a checkout leaves `git status` clean."""

from pathlib import Path

import typer

from natsl.cli.main import app
from natsl.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def default_out_folders() -> dict[str, str]:
    """{command: the top folder of its default output}."""
    folders = {"train": TrainConfig().out_dir.split("/")[0]}
    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            if param.name in ("out", "output", "out_dir", "data") and isinstance(param.default, str) and param.default:
                folders[name] = Path(param.default).parts[0]
    return folders


def test_every_default_output_folder_is_git_ignored():
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    folders = default_out_folders()
    assert {"compare", "eval_recall", "eval_ppl", "runs", "data"} <= set(folders.values())  # the scan finds them
    missing = {command: folder for command, folder in folders.items() if folder not in ignored}
    assert not missing, f"add these default output folders to .gitignore: {missing}"
