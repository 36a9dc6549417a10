"""The README's Python example runs as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_example_runs(monkeypatch):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has no python example"
    monkeypatch.chdir(ROOT)  # run from the checkout root, as a reader would
    for block in blocks:
        scope: dict = {}
        exec(compile(block, "README.md", "exec"), scope)  # a name it never defines fails here
        # the example ends with the ops' outputs: real tensors, no NaN
        assert scope["o"].isfinite().all() and scope["state"].isfinite().all()
