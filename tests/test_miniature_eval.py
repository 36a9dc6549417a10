"""`natsl miniature`'s evaluation stage and report: the jobs it plans, running and resuming them, the report's
tables and claims from the commands' own JSON, and the local lm-eval task builder."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.config import apply_overrides
from natsl.data import TokenData
from natsl.eval.haystack import essay_text
from natsl.eval.ruler import summarize
from natsl.miniature.evaluate import EvalJob, eval_jobs, run_jobs
from natsl.miniature.lm_task import build_lm_tasks
from natsl.miniature.report import write_report

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {"natsl_hybrid": [], "transformer": ["model.base_layer=attention", "model.natsl_layers=[]"]}


def code_file(i: int) -> str:
    return "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(30))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A `natsl tokenize --val-texts` folder of two sources (Python code, prose) and two run folders
    (untrained tiny models with the corpus's tokenizer, saved as a training run's newest step)."""
    root = tmp_path_factory.mktemp("mini")
    for i in range(30):
        (root / "in" / "code").mkdir(parents=True, exist_ok=True)
        (root / "in" / "code" / f"m{i:02d}.py").write_text(code_file(i), encoding="utf-8")
        (root / "in" / "docs").mkdir(parents=True, exist_ok=True)
        (root / "in" / "docs" / f"d{i:02d}.md").write_text(essay_text(6, seed=i), encoding="utf-8")
    result = CliRunner().invoke(app, ["tokenize", str(root / "in" / "code"), str(root / "in" / "docs"), "--out",
                                      str(root / "corpus"), "--train-tokenizer", "--vocab-size", "300",
                                      "--val-fraction", "0.3", "--val-texts", "--no-progress",
                                      "--include", "*.py", "--include", "*.md"])
    assert result.exit_code == 0, result.output
    tokenizer = TokenData(root / "corpus").tokenizer()
    runs = {}
    for i, (name, overrides) in enumerate(SYSTEMS.items()):
        recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), ["model.vocab_size=300", "train.seq_len=128",
                                                                    *overrides])
        torch.manual_seed(3 + i)  # random weights route blocks both ways
        run = root / "runs" / name
        save_model_folder(run / "checkpoints" / "step_000010", natsl.build_model(recipe), recipe, tokenizer)
        (run / "result.json").write_text(json.dumps({
            "status": "done", "val_loss": 5.0 + i, "perplexity": math.exp(5.0 + i), "tokens": 20480,
            "parameters": 123456 + i, "val_curve": [[10240, 5.5 + i], [20480, 5.0 + i]]}))
        runs[name] = run
    return root, root / "corpus", runs


def env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_jobs_run_resume_and_report(corpus):
    root, data, runs = corpus
    out = root / "eval"
    jobs = eval_jobs({**runs, "gdn": None}, data, out, device="cpu", quick=True)
    by_name = {j.name: j for j in jobs}
    assert set(by_name) == {"ppl", "compare", "latency", "ruler_natsl_hybrid", "ruler_transformer",
                            "routing_natsl_hybrid", "lm_eval_natsl_hybrid", "lm_eval_transformer"}
    ppl = by_name["ppl"]
    assert ppl.argv[:4] == [sys.executable, "-m", "natsl.cli.main", "eval-ppl"]
    assert ppl.argv[4:6] == [str(runs["transformer"]), str(runs["natsl_hybrid"])]  # the ladder's order
    assert "--concat" in ppl.argv and ppl.argv[ppl.argv.index("--max-len") + 1] == "512"
    assert ppl.done_file == out / "ppl" / "ppl.json" and ppl.systems == ["transformer", "natsl_hybrid"]
    routing = by_name["routing_natsl_hybrid"]
    sources = [a for a in routing.argv if a.endswith(".jsonl")]
    assert [Path(s).name for s in sources] == ["00_code.jsonl", "01_docs.jsonl", "synthetic.jsonl"]
    assert "Remember these pairs." in (out / "synthetic.jsonl").read_text()
    compare = by_name["compare"]
    assert "--no-recall" in compare.argv and compare.done_key == "finished"
    assert compare.systems == ["natsl_hybrid", "transformer"]
    assert json.loads((out / "checkpoints.json").read_text()) == {n: str(p) for n, p in runs.items()}
    assert {"natsl_mini_next_line", "natsl_mini_docs"} <= {p.stem for p in (out / "lm_tasks").glob("*.yaml")}

    lines = []
    status = run_jobs([ppl, routing], max_parallel=2, deadline_s=None, log=lines.append, env=env())
    assert status == {"ppl": "done", "routing_natsl_hybrid": "done"}, (out / "logs" / "ppl.log").read_text()[-2000:]
    assert any(line.startswith("eval: 2/2 done") for line in lines)
    report = json.loads((out / "ppl" / "ppl.json").read_text())
    assert [Path(r["path"]).parent.parent for r in report["checkpoints"]] == [runs["transformer"], runs["natsl_hybrid"]]
    saved = json.loads((out / "eval_status.json").read_text())
    assert saved["jobs"]["ppl"]["status"] == "done"
    size = (out / "logs" / "ppl.log").stat().st_size
    again = run_jobs([ppl, routing], max_parallel=2, log=lines.append, env=env())  # resumed: nothing to run
    assert again == {"ppl": "done already", "routing_natsl_hybrid": "done already"}
    assert (out / "logs" / "ppl.log").stat().st_size == size

    (root / "checkpoints.json").write_text(json.dumps({n: str(p) for n, p in runs.items()}))
    (root / "sweep").mkdir()
    (root / "sweep" / "summary.json").write_text(json.dumps({"best_lm": [
        {"system": "natsl_hybrid", "best_lr": 0.004, "val_loss": 5.2, "ranking": []},
        {"system": "transformer", "best_lr": 0.002, "val_loss": 6.2, "ranking": []}]}))
    rows = [{"task": "niah_single_1", "length": n, "score": s} for n, s in ((2048, 1.0), (4096, 0.5), (8192, 0.5))]
    for name, rows_of in (("natsl_hybrid", rows), ("gdn_hybrid", [{**r, "score": r["score"] / 2} for r in rows])):
        (out / f"ruler_{name}").mkdir()
        (out / f"ruler_{name}" / "ruler.json").write_text(json.dumps(summarize(rows_of, ["niah_single_1"],
                                                                               [2048, 4096, 8192])))
    path = write_report(root)
    text = path.read_text()
    tables = json.loads((root / "report" / "tables.json").read_text())
    ppl_of = {Path(r["path"]).parent.parent.name: r["ppl"] for r in report["checkpoints"]}
    assert set(tables["ppl"]) == {"natsl_hybrid", "transformer"}
    assert tables["ppl"]["natsl_hybrid"]["ppl"] == pytest.approx(ppl_of["natsl_hybrid"])
    assert f"| natsl_hybrid | {ppl_of['natsl_hybrid']:.3f} |" in text
    assert "| natsl_hybrid | 0.1M | 0.004 | 5.200 | 5.000 | 148.413 | 20480 |" in text  # Table 1
    assert tables["table1"]["transformer"]["best_lr"] == 0.002
    routing_table = tables["routing"]["natsl_hybrid"]
    assert [d["name"] for d in routing_table["datasets"]] == ["00_code", "01_docs", "synthetic"]
    assert routing_table["routing"] != "not measured"
    claims = {c["claim"].split(" ")[2]: c for c in tables["claims"]}
    assert tables["claims"][0]["verdict"] == "not measured"  # no GDN Hybrid training result
    needle = next(c for c in tables["claims"] if "needle" in c["claim"])
    assert needle["verdict"] == "holds" and "4096: natsl_hybrid 0.50 vs gdn_hybrid 0.25" in needle["numbers"]
    assert claims and "## Latency" in text and "## Quality at matched KV bytes (compare)\n\nnot measured" in text
    assert "## lm-eval on the local tasks\n\nnot measured" in text
    for png in ("val_curves.png", "loss_vs_position.png", "ruler_by_length.png", "routing_by_source.png"):
        assert (root / "report" / png).stat().st_size > 1000, png


def test_run_jobs_keeps_the_deadline(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    jobs = [EvalJob(f"sleep{i}", sleeper, tmp_path / f"sleep{i}", tmp_path / f"sleep{i}" / "x.json", tmp_path)
            for i in range(2)]
    lines = []
    status = run_jobs(jobs, max_parallel=1, deadline_s=1.0, start_margin_s=0.0, grace_s=0.5, log=lines.append)
    assert status == {"sleep0": "killed (deadline)", "sleep1": "not started (deadline)"}
    assert json.loads((tmp_path / "eval_status.json").read_text())["jobs"]["sleep0"]["status"] == "killed (deadline)"
    skipped = EvalJob("lm", ["natsl", "eval-lm"], tmp_path / "lm", tmp_path / "lm" / "lm_eval.json", tmp_path,
                      skipped="no lm_eval here")
    assert run_jobs([skipped], max_parallel=1, log=lines.append) == {"lm": "skipped: no lm_eval here"}
    assert any("to run it elsewhere: natsl eval-lm" in line for line in lines)


def test_lm_task_builder_is_deterministic_and_right(tmp_path):
    texts = tmp_path / "validation_texts"
    texts.mkdir()
    sources = {"00_code": [code_file(i) for i in range(4)], "01_docs": [essay_text(3, seed=i) for i in range(4)]}
    for name, docs in sources.items():
        (texts / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    first = build_lm_tasks(texts, tmp_path / "a", items=30, context_lines=5)
    build_lm_tasks(texts, tmp_path / "b", items=30, context_lines=5)
    assert first["tasks"] == ["natsl_mini_next_line", "natsl_mini_docs"] and first["items"] == 30
    for data in ("next_line.jsonl", "docs.jsonl"):
        assert (tmp_path / "a" / data).read_bytes() == (tmp_path / "b" / data).read_bytes()
    items = [json.loads(line) for line in (tmp_path / "a" / "next_line.jsonl").read_text().splitlines()]
    assert {item["source"] for item in items} == {"00_code", "01_docs"}
    for item in items:
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        truth = item["choices"][item["answer"]]
        doc = sources[item["source"]][item["doc"]]
        assert (item["context"] + truth) in doc  # the true line follows the context in its file
        assert truth.strip() and "\n" not in truth and item["context"].strip()
    yaml = (tmp_path / "a" / "natsl_mini_next_line.yaml").read_text()
    assert 'target_delimiter: ""' in yaml and str((tmp_path / "a" / "next_line.jsonl").resolve()) in yaml


def test_report_of_nothing_says_not_measured(tmp_path):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval_status.json").write_text(json.dumps({"jobs": {
        "lm_eval_natsl_hybrid": {"status": "skipped: lm-evaluation-harness is not importable here"},
        "ppl": {"status": "killed (deadline)"}}}))
    (tmp_path / "eval" / "compare").mkdir()
    (tmp_path / "eval" / "compare" / "compare.json").write_text("{not json")
    text = write_report(tmp_path).read_text()
    tables = json.loads((tmp_path / "report" / "tables.json").read_text())
    assert [c["verdict"] for c in tables["claims"]] == ["not measured"] * 5
    assert "## Fig. 3 in miniature: loss against position\n\nnot measured (killed (deadline))" in text
    assert "not measured (skipped: lm-evaluation-harness is not importable here)" in text
    assert "## Files that could not be read" in text and "compare.json" in text and not tables["figures"]
