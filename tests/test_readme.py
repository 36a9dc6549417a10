"""The README's Python example runs as written; its tokenize examples fit the recipes they feed."""

import json
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


def example_commands(text: str) -> list[list[str]]:
    """The `natsl ...` lines of a document's indented code blocks, split into words."""
    return [line.split() for line in text.splitlines() if line.startswith("    natsl ")]


def test_tokenize_examples_fit_the_recipes_they_feed():
    """A `natsl tokenize --vocab-size V --out D` example, then `natsl train R --set data.path=D`: V must fit
    R's model.vocab_size (after the line's own overrides), and the tiny recipe, the one a reader runs on a
    CPU, has such a pair (a 32000-entry corpus is refused by it)."""
    import natsl

    for doc in ("README.md", "docs/training.md"):
        vocab_of, fed = {}, []
        for words in example_commands((ROOT / doc).read_text(encoding="utf-8")):
            if words[1] == "tokenize" and "--vocab-size" in words:
                vocab_of[words[words.index("--out") + 1]] = int(words[words.index("--vocab-size") + 1])
            if words[1] == "train":
                sets = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
                if sets.get("data.path") in vocab_of:
                    model_vocab = int(sets.get("model.vocab_size", natsl.load_recipe(words[2]).model.vocab_size))
                    assert vocab_of[sets["data.path"]] <= model_vocab, (doc, " ".join(words))
                    fed.append(words[2])
        assert "tiny_hybrid" in fed, f"{doc} shows no tokenize example that tiny_hybrid takes"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end > 0 else len(text)]


def test_readme_hugging_face_and_lm_eval_commands_run(tmp_path, monkeypatch):
    """The commands of the README's "Hugging Face and lm-eval" section, word for word, on a tiny model on the
    CPU: only its paths are swapped for a tiny checkpoint, export and authors' folder here, and `--tasks
    wikitext` (a download) for a local rolling-perplexity task, limited to two documents."""
    import sys

    import pytest

    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # lm-eval's `hf` model (natsl[lm-eval] brings it)
    from typer.testing import CliRunner
    from lm_eval.__main__ import cli_evaluate

    import natsl.eval.lm_eval_adapter  # noqa: F401  (registers `natsl`, as the installed .pth does)
    from natsl.cli.main import app
    from test_convert import authors_config, authors_tensors, write_authors_folder
    from test_lm_eval import tiny_checkpoint, write_tasks

    lines = [line.split() for line in section((ROOT / "README.md").read_text(encoding="utf-8"),
                                              "### Hugging Face and lm-eval").splitlines()
             if line.startswith(("    natsl ", "    lm_eval "))]
    assert [w[:2] for w in lines] == [["natsl", "convert"], ["lm_eval", "--model"], ["lm_eval", "--model"],
                                      ["natsl", "convert"]]
    tiny_checkpoint(tmp_path / "runs" / "tiny_hybrid", "natsl_hybrid")
    write_authors_folder(tmp_path / "path-to-authors", ["model.natsl_rope=true"], 5, authors_config, authors_tensors)
    write_tasks(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)  # the README's relative paths: runs/tiny_hybrid, hf-tiny, lm-eval-out
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for words in lines:
        words = [{"path/to/authors-checkpoint": "path-to-authors", "wikitext": "natsl_tiny_ppl"}.get(w, w) for w in words]
        if words[0] == "natsl":
            result = CliRunner().invoke(app, words[1:])
            assert result.exit_code == 0, (words, result.output)
            continue
        monkeypatch.setattr(sys, "argv", [*words, "--include_path", str(tmp_path / "tasks"), "--limit", "2"])
        cli_evaluate()
    assert (tmp_path / "natsl-authors" / "model.safetensors").is_file()
    reports = [json.loads(p.read_text()) for p in (tmp_path / "lm-eval-out").rglob("results_*.json")]
    assert sorted(r["config"]["model"] for r in reports) == ["hf", "natsl"]
    ppl = [r["results"]["natsl_tiny_ppl"]["word_perplexity,none"] for r in reports]
    assert ppl[0] > 1.0 and ppl[0] == pytest.approx(ppl[1], rel=1e-5)  # the same windows, the same scores
