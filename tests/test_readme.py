"""The README's Python example runs as written; its tokenize examples fit the recipes they feed."""

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
