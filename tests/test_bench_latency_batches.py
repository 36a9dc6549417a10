"""`natsl bench-latency --batch-size 1,4,16,64`: each batch size measured in turn into OUT/batch_N/ (the decode rows
of batched serving and evaluation, docs/inference.md), one batch size into OUT/ as always, bad lists refused."""

import json

import pytest
from typer.testing import CliRunner

from cli_checks import assert_one_line_error
from natsl.cli.main import app

TINY = ["bench-latency", "--recipe", "tiny_hybrid", "--min-len", "32", "--max-len", "32", "--decode-tokens", "2",
        "--repeats", "1", "--device", "cpu", "--no-progress"]


def test_several_batch_sizes_each_measured_into_its_own_folder(tmp_path):
    result = CliRunner().invoke(app, [*TINY, "--batch-size", "1,3", "--out", str(tmp_path / "bench")])
    assert result.exit_code == 0, result.output + result.stderr
    assert not (tmp_path / "bench" / "latency.json").exists()
    for batch in (1, 3):
        folder = tmp_path / "bench" / f"batch_{batch}"
        data = json.loads((folder / "latency.json").read_text())
        assert data["batch"] == batch and (folder / "latency.png").is_file()
        ((point,),) = [m["points"] for m in data["models"]]
        assert "error" not in point and point["prefill_s"] > 0 and point["decode_ms"] > 0
    assert result.output.count("wrote ") == 2


def test_one_batch_size_writes_into_out_itself(tmp_path):
    result = CliRunner().invoke(app, [*TINY, "--batch-size", "2", "--out", str(tmp_path / "bench")])
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((tmp_path / "bench" / "latency.json").read_text())["batch"] == 2


@pytest.mark.parametrize("value, fragment", [
    ("4,4", "give one batch size or distinct ones"),
    ("1,x", "is not a comma-separated list of whole numbers"),
    ("1,0", "--batch-size must be at least 1, got 0"),
])
def test_bad_batch_lists_are_one_line_errors(tmp_path, value, fragment):
    result = CliRunner().invoke(app, [*TINY, "--batch-size", value, "--out", str(tmp_path / "bench")])
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "bench").exists()
