"""`natsl eval-ruler`: RULER NIAH samples (deterministic, needles at their depth), scoring, decoding."""

import json

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.cli import convert, eval_ppl, eval_ruler, inspect_routing  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.eval.decode import greedy_generate
from natsl.eval.haystack import essay_text
from natsl.eval.ruler import NOISE, TASKS, make_sample, postprocess, string_match_all
from natsl.eval.smoke import save_tiny_checkpoint
from natsl.tokenizer import train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_bpe([essay_text(300, seed=1), NOISE * 5], vocab_size=512)


def test_string_match_scores_expected_answers_one_and_wrong_ones_zero():
    assert string_match_all(" 4821937.", ["4821937"]) == 1.0
    assert string_match_all(" 4821936.", ["4821937"]) == 0.0
    assert string_match_all("", ["4821937"]) == 0.0
    assert string_match_all(" 1111111, 2222222 and 9", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    uid = "9c6d3b19-8152-4b9d-9844-8a43768f4e26"
    assert string_match_all(f" {uid.upper()}\x00", [uid]) == 1.0  # case-insensitive, control chars stripped
    assert postprocess("  a\tb\x01 ") == "a\nb"


@pytest.mark.parametrize("task", list(TASKS))
def test_samples_are_deterministic_and_hold_their_answers(task, tok):
    a = make_sample(task, 1024, 3, tok, seed=5, max_new_tokens=32)
    b = make_sample(task, 1024, 3, tok, seed=5, max_new_tokens=32)
    c = make_sample(task, 1024, 3, tok, seed=6, max_new_tokens=32)
    assert a.prompt == b.prompt and a.answers == b.answers and a.prompt_ids == b.prompt_ids
    assert a.prompt != c.prompt
    spec = TASKS[task]
    assert len(a.answers) == spec.num_values * spec.num_queries
    assert len(a.needles) == max(spec.num_keys, spec.num_queries) * spec.num_values
    assert len(a.prompt_ids) + 32 <= 1024
    assert len(a.prompt_ids) + 32 > 1024 - 64  # the haystack fills the budget
    for answer in a.answers:
        assert f"for {a.query.split(', ')[0].removeprefix('and ')}" in a.prompt or spec.num_queries > 1
        assert answer in a.prompt
    plural = spec.num_values * spec.num_queries > 1
    assert a.prompt.rstrip().endswith("mentioned in the provided text " + ("are" if plural else "is"))


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multivalue"])
def test_needles_sit_at_the_stated_depth(task, tok):
    s = make_sample(task, 3072, 0, tok, seed=0, max_new_tokens=16)
    start, end = s.context_token_span
    assert 0 < start < end <= len(s.prompt_ids)
    assert len(s.needle_token_positions) == len(s.depths) == len(s.needles)
    for pos, depth, needle, token_depth in zip(s.needle_token_positions, s.depths, s.needles, s.token_depths()):
        # The tokens at the reported position spell the needle ...
        assert tok.decode(s.prompt_ids[pos:pos + 40]).lstrip().startswith(needle[:30])
        # ... and that position is the stated depth of the haystack (to within one haystack unit).
        assert abs(token_depth - depth / 100) <= 1.5 / s.haystack_units + 0.03, (depth, token_depth)


def test_greedy_decoding_matches_a_plain_argmax_loop():
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe).eval()
    model.set_backend("chunked")
    prompt = torch.randint(0, 1024, (70,)).tolist()
    got = greedy_generate(model, prompt, 5, use_cache=False)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]
    assert greedy_generate(model, prompt, 5, eos_id=got[1], use_cache=False) == got[:2]  # stops after EOS
    assert greedy_generate(model, prompt, 5, use_cache=True) == got


def test_eval_ruler_end_to_end(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", steps=10, seed=0)
    out = tmp_path / "out"
    args = ["eval-ruler", ckpt, "--lengths", "512", "--samples", "1", "--max-new-tokens", "3", "--out", out]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "ruler.json").read_text())
    assert set(report["tasks"]) == set(TASKS)
    for task, per_length in report["tasks"].items():
        assert 0.0 <= per_length["512"] <= 1.0
    assert 0.0 <= report["lengths"]["512"] <= 1.0
    rows = [json.loads(line) for line in (out / "ruler_samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(TASKS)
    for row in rows:
        assert row["score"] == string_match_all(row["prediction"], row["answers"])
        assert row["prompt_tokens"] + 3 <= 512
    assert (out / "ruler.png").stat().st_size > 1000
    assert "niah_multiquery" in result.stdout and "mean" in result.stdout
    bad = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--tasks", "niah_single_9", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown RULER task" in bad.stderr and "Traceback" not in bad.output
    short = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--lengths", "100", "--out", str(out)])
    assert short.exit_code == 2 and "too short" in short.stderr
    long = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--lengths", "256k", "--out", str(out)])
    assert long.exit_code == 2 and "beyond the model's max_seq_len" in long.stderr, long.output
    latin1 = tmp_path / "essays.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me. Une autre phrase ici.\n".encode("latin-1"))
    essays = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--essay-file", str(latin1), "--out", str(out)])
    assert essays.exit_code == 2 and "not UTF-8" in essays.stderr, essays.output
