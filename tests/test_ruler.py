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
from natsl.eval.ruler import NOISE, TASKS, answer_accuracy, answer_text, make_sample, postprocess, string_match_all
from natsl.eval.smoke import save_tiny_checkpoint
from natsl.tokenizer import train_bpe

from cli_checks import assert_one_line_error


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


def test_answer_text_states_the_values_as_the_needles_do():
    assert answer_text(["4821937"]) == (": 4821937", [(2, 9)])
    text, spans = answer_text(["11", "222", "3"])
    assert text == ": 11, 222, 3"
    assert [text[a:b] for a, b in spans] == ["11", "222", "3"]


class _Oracle(torch.nn.Module):
    """Predicts each next token of its own input exactly (logits one-hot on ids[t + 1]), or always `fixed`."""

    def __init__(self, vocab: int, fixed: int | None = None):
        super().__init__()
        self.vocab, self.fixed = vocab, fixed
        self.lm_head = torch.nn.Identity()

    def forward(self, ids):
        nxt = torch.roll(ids, -1, dims=1) if self.fixed is None else torch.full_like(ids, self.fixed)
        return self.lm_head(torch.nn.functional.one_hot(nxt, self.vocab).float() * 30.0)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_3", "niah_multivalue"])
def test_answer_accuracy_is_one_for_an_oracle_and_zero_for_a_constant(task, tok):
    s = make_sample(task, 1024, 0, tok, seed=0, max_new_tokens=32)
    best = answer_accuracy(_Oracle(tok.vocab_size), tok, s, "cpu")
    assert best["answer_token_accuracy"] == 1.0 and best["answer_logprob"] > -1e-6
    ids = tok.encode(answer_text(s.answers)[0])
    assert 0 < best["answer_tokens"] <= len(ids)
    # a token id that spells none of the answer
    unused = next(i for i in range(tok.vocab_size) if i not in ids)
    worst = answer_accuracy(_Oracle(tok.vocab_size, fixed=unused), tok, s, "cpu")
    assert worst["answer_token_accuracy"] == 0.0 and worst["answer_logprob"] < -20


def test_answer_accuracy_matches_the_full_logits_of_a_real_model(tmp_path):
    from natsl.eval.common import load_eval_model

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", steps=10, seed=0)
    em = load_eval_model(ckpt, "cpu", None, None)
    s = make_sample("niah_single_2", 512, 1, em.tokenizer, seed=0, max_new_tokens=16)
    got = answer_accuracy(em.model, em.tokenizer, s, em.device)
    text, spans = answer_text(s.answers)
    enc = em.tokenizer.inner.encode(text, add_special_tokens=False)
    wanted = [i for i, (a, b) in enumerate(enc.offsets) if any(a < e and b > st for st, e in spans)]
    full = torch.tensor([s.prompt_ids + list(enc.ids)])
    with torch.no_grad():
        logits = em.model(full)[0].float()
    at = [len(s.prompt_ids) - 1 + i for i in wanted]
    targets = full[0, [a + 1 for a in at]]
    right = (logits[at].argmax(-1) == targets).float().mean().item()
    logprob = torch.log_softmax(logits[at], -1).gather(1, targets[:, None]).mean().item()
    assert got["answer_tokens"] == len(wanted) > 0
    assert got["answer_token_accuracy"] == pytest.approx(right)
    assert got["answer_logprob"] == pytest.approx(logprob, abs=1e-4)


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


# the miniature ladder's layer patterns at a tiny width: every kind of cache eval-ruler empties and refills
TINY_MINI = ("model.vocab_size=256", "model.hidden_size=32", "model.intermediate_size=64", "model.head_k_dim=16",
             "model.head_v_dim=32", "model.attn_head_dim=16", "model.mamba2_head_dim=16", "model.mamba2_state_size=8",
             "model.attn_window=48", "train.dtype=fp32")


@pytest.mark.parametrize("system", ["gdn", "mamba2", "transformer", "gdn_hybrid", "natsl", "natsl_hybrid", "gdn_swa"])
def test_greedy_decoding_through_one_reused_decode_runner_matches_a_fresh_cache_each(system):
    """eval-ruler decodes every prompt of a length in one DecodeRunner's cache (emptied in between, so that on a
    GPU its graphs serve them all): a longer prompt after a shorter and a shorter after a longer, each crossing
    routed blocks (and GDN + SWA's window), give the tokens a fresh cache gives, and the full forward's, for
    every system of the miniature's ladder."""
    from natsl.config import apply_overrides
    from natsl.inference.decode import DecodeRunner

    recipe = natsl.load_recipe(f"mini/{system}")
    sets = [o for o in TINY_MINI if system == "gdn_swa" or not o.startswith("model.attn_window")]
    recipe = apply_overrides(recipe, sets)
    torch.manual_seed(0)
    model = natsl.build_model(recipe).eval()
    model.set_backend("chunked")
    runner = DecodeRunner(model, model.new_cache(1, max_len=160))
    for n in (70, 130, 5):
        prompt = torch.randint(0, 256, (n,)).tolist()
        fresh = greedy_generate(model, prompt, 20, use_cache=True)
        assert greedy_generate(model, prompt, 20, runner=runner) == fresh, n
        assert greedy_generate(model, prompt, 20, use_cache=False) == fresh, n
    # the runner's own cache held the last prompt and its 19 fed-back tokens (20 generated), not a new one
    assert int(runner.cache.positions.lengths[0]) == 5 + 19


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
        assert 0.0 <= row["answer_token_accuracy"] <= 1.0 and row["answer_tokens"] >= 1
    teacher = report["answer_accuracy"]
    assert teacher["lengths"]["512"] == pytest.approx(sum(r["answer_token_accuracy"] for r in rows) / len(rows))
    assert "teacher-forced answer-token accuracy" in result.stdout
    assert report["answer_logprob"]["lengths"]["512"] == pytest.approx(sum(r["answer_logprob"] for r in rows) / len(rows))
    assert report["answer_logprob"]["lengths"]["512"] < 0 and "mean log-probability (nats), by length: 512 " in result.stdout
    plain = CliRunner().invoke(app, [str(a) for a in args[:-1]] + [str(tmp_path / "plain"), "--no-answer-accuracy",
                                                                   "--tasks", "niah_single_1"])
    assert plain.exit_code == 0, plain.output
    assert "answer_accuracy" not in json.loads((tmp_path / "plain" / "ruler.json").read_text())
    assert (out / "ruler.png").stat().st_size > 1000
    assert "niah_multiquery" in result.stdout and "mean" in result.stdout
    # The estimate comes once, after the first sample, before the rest.
    assert result.stderr.count("eval-ruler: 8 tasks x 1 lengths x 1 samples = 8 prompts") == 1
    assert "in all on this device" in result.stderr
    bad = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--tasks", "niah_single_9", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown RULER task" in bad.stderr and "Traceback" not in bad.output
    short = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--lengths", "100", "--out", str(out)])
    assert short.exit_code == 2 and "too short" in short.stderr
    long = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--lengths", "256k", "--out", str(out)])
    assert_one_line_error(long, "--lengths 262144 is beyond the max_seq_len")
    latin1 = tmp_path / "essays.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me. Une autre phrase ici.\n".encode("latin-1"))
    essays = CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--essay-file", str(latin1), "--out", str(out)])
    assert essays.exit_code == 2 and "not UTF-8" in essays.stderr, essays.output


def test_eval_ruler_edges_are_one_line_and_results_keep_the_umask(tmp_path, monkeypatch):
    import os
    import stat

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", steps=2, seed=0)
    out = tmp_path / "out"

    def run(*args):
        return CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--out", str(out), "--device", "cpu", *map(str, args)])

    for bad in ("inf", "nan", "-inf", "1e400"):
        assert_one_line_error(run("--lengths", bad), "--lengths", "is not a length")
    assert_one_line_error(run("--seed", -1), "--seed must be an integer from 0 to 2**63-1")
    assert_one_line_error(run("--seed", 2**70), "--seed must be an integer from 0 to 2**63-1")

    # NaN weights: one line naming the checkpoint, not a score of 0.
    model, tokenizer = natsl.load_checkpoint(ckpt)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    from natsl.checkpoint import save_model_folder

    nan_ckpt = save_model_folder(tmp_path / "nan", model, model.recipe, tokenizer)
    result = CliRunner().invoke(app, ["eval-ruler", str(nan_ckpt), "--lengths", "512", "--samples", "1", "--tasks",
                                      "niah_single_1", "--max-new-tokens", "2", "--out", str(out), "--no-progress"])
    assert_one_line_error(result, str(nan_ckpt), "non-finite logits")

    old = os.umask(0o022)
    try:
        result = run("--lengths", "512", "--samples", "1", "--tasks", "niah_single_1", "--max-new-tokens", "2")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    for name in ("ruler.json", "ruler_samples.jsonl", "ruler.png"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name


def test_default_lengths_follow_the_training_length(tmp_path, monkeypatch):
    """No --lengths: 1x, 2x, 4x the training length (at least 1024), never beyond max_seq_len; the
    CPU default takes 2 samples."""
    import natsl.eval.ruler as ruler

    seen = {}

    def fake_run(em, tasks, lengths, samples, **kwargs):
        seen.update(lengths=lengths, samples=samples)
        raise SystemExit(0)

    monkeypatch.setattr(ruler, "run_ruler", fake_run)
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", steps=1, seed=0)  # tiny_hybrid: trained at 256
    CliRunner().invoke(app, ["eval-ruler", str(ckpt), "--device", "cpu", "--out", str(tmp_path / "out")])
    assert seen == {"lengths": [1024, 2048, 4096], "samples": 2}


def test_ruler_colour_bar_has_a_label(monkeypatch, tmp_path):
    import natsl.eval.common as common

    figures = []
    monkeypatch.setattr(common, "save_figure", lambda fig, path: figures.append(fig))
    summary = {"tasks": {"niah_single_1": {"512": 0.5}}, "lengths": {"512": 0.5}, "mean": 0.5}
    from natsl.eval.ruler import plot_scores

    plot_scores(summary, ["niah_single_1"], [512], tmp_path / "r.png", "t")
    (fig,) = figures
    assert "score" in fig.axes[-1].get_ylabel()
