"""`natsl.atomic`: result files get the umask's permissions, and a failed write leaves the old file."""

import json
import os
import stat

import pytest

from natsl.atomic import atomic_open, save_figure, write_json, write_jsonl


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_follow_the_umask_not_mkstemp(tmp_path, umask_027):
    json_path = write_json(tmp_path / "sub" / "r.json", {"a": 1})
    jsonl_path = write_jsonl(tmp_path / "r.jsonl", [{"x": "\u00e9"}, {"x": 2}])
    os.umask(0o022)
    json2 = write_json(tmp_path / "r2.json", [1])
    assert mode(json_path) == 0o640 and mode(jsonl_path) == 0o640 and mode(json2) == 0o644
    assert json.loads(json_path.read_text()) == {"a": 1}
    assert [json.loads(line) for line in jsonl_path.read_text(encoding="utf-8").splitlines()] == [{"x": "\u00e9"}, {"x": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r2.json", "sub"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = write_json(tmp_path / "r.json", {"old": True})
    with pytest.raises(RuntimeError):
        with atomic_open(path) as fh:
            fh.write("half")
            raise RuntimeError("disk on fire")
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_png_follows_the_umask(tmp_path, umask_027):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    path = save_figure(fig, tmp_path / "p.png")
    assert mode(path) == 0o640 and path.read_bytes()[:4] == b"\x89PNG"
    assert not plt.fignum_exists(fig.number)
