"""natsl as an lm-evaluation-harness model: scores equal natsl's own, and `natsl eval-lm` runs local tasks."""

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli import convert as _convert, eval_lm, generate as _generate  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.config import apply_overrides
from natsl.errors import NatslError
from natsl.eval.haystack import essay_text
from natsl.inference.generate import generate
from natsl.inference.sampling import SamplingConfig
from natsl.tokenizer import train_bpe

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from natsl.eval.lm_eval_adapter import NatslLM  # noqa: E402


TINY_MAMBA2 = ["model.mamba2_head_dim=16", "model.mamba2_state_size=8", "model.mamba2_groups=2"]
SYSTEMS = {"natsl_hybrid": [],  # tiny_hybrid: GDN + NAtS-L layers
           "mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_layers=[]", "model.intermediate_size=0"],
           "hybrid_mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_state=mamba2"]}


def tiny_checkpoint(folder, system):
    tok = train_bpe([essay_text(100)], vocab_size=300)
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), ["model.vocab_size=300", "train.seq_len=128",
                                                                *SYSTEMS[system]])
    torch.manual_seed(0)
    save_model_folder(folder, natsl.build_model(recipe), recipe, tok)
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lm") / "ckpt", "natsl_hybrid")


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def direct_logprob(model, context, continuation):
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).float(), -1)[0, -len(continuation):]
    return logp.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


@pytest.mark.parametrize("system", ["natsl_hybrid", "mamba2", "hybrid_mamba2"])
def test_adapter_scores_and_generates_as_natsl(ckpt, tmp_path, system):
    folder = ckpt if system == "natsl_hybrid" else tiny_checkpoint(tmp_path / "ckpt", system)
    lm = NatslLM(pretrained=str(folder), device="cpu", batch_size=2, chunk=16)
    model, tok = lm.model, lm.tokenizer
    pairs = [("The old house", " stood still"), ("The old house", " was sold"), ("A river", " ran dry")]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (logp, _) in zip(pairs, got):
        whole = tok.encode(context + continuation)
        n = len(whole) - len(tok.encode(context))
        assert logp == pytest.approx(direct_logprob(model, whole[:-n], whole[-n:]), rel=1e-5)
    # Rolling: a text longer than max_length (128) is scored in windows, each after EOS or the prior tokens.
    text = essay_text(4)[:1500]
    (rolled,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    ids = tok.encode(text)
    assert len(ids) > lm.max_length
    expected = direct_logprob(model, [tok.eos_id], ids[:lm.max_length])
    for end in range(lm.max_length, len(ids), lm.max_length):
        window = ids[:min(end + lm.max_length, len(ids))][-(lm.max_length + 1):]
        n = min(end + lm.max_length, len(ids)) - end
        expected += direct_logprob(model, window[:-n], window[-n:])
    assert rolled == pytest.approx(expected, rel=1e-5)
    # generate_until: natsl generate's greedy text, cut at the stop string.
    (text_out,) = lm.generate_until([request("generate_until", "The garden", {"until": ["."], "max_gen_toks": 10,
                                                                                "do_sample": False})])
    (ours,) = generate(model, tok, [tok.encode("The garden")],
                       SamplingConfig(max_new_tokens=10, temperature=0.0, stop=["."]))
    assert text_out == ours.text


def write_tasks(tasks):
    """A local lm-eval task folder: one multiple-choice, one rolling-perplexity and one generation task."""
    tasks.mkdir()
    rows = [{"question": f"Item {i}:", "choices": [" yes", " no"], "answer": i % 2, "text": essay_text(1)[:200]}
            for i in range(4)]
    (tasks / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / 'data.jsonl'}
        test_split: test
    """
    (tasks / "mc.yaml").write_text(textwrap.dedent("""
        task: natsl_tiny_mc
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
    """) + textwrap.dedent(common))
    (tasks / "ppl.yaml").write_text(textwrap.dedent("""
        task: natsl_tiny_ppl
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
    """) + textwrap.dedent(common))
    (tasks / "gen.yaml").write_text(textwrap.dedent("""
        task: natsl_tiny_gen
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: " yes"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 4
          do_sample: false
        metric_list:
          - metric: exact_match
    """) + textwrap.dedent(common))


def test_a_task_folder_that_would_run_code_is_refused_before_lm_eval_reads_it(ckpt, tmp_path):
    """lm-eval's `!function` imports a Python file of the task folder: natsl runs no code from a file's contents."""
    from cli_checks import assert_one_line_error

    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    marker = tmp_path / "PWNED"
    (tasks / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef proc(docs):\n    return docs\n")
    yaml = (tasks / "mc.yaml").read_text()
    (tasks / "mc.yaml").write_text(yaml + "process_docs: !function evil.proc\n")
    result = CliRunner().invoke(app, ["eval-lm", str(ckpt), "--tasks", "natsl_tiny_mc", "--include-path", str(tasks),
                                      "--limit", "2", "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert_one_line_error(result, "mc.yaml", "uses !function", "natsl runs no code from a task folder")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_eval_lm_runs_local_tasks(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    torch.set_num_threads(2)  # so that --threads 1 shows
    try:
        result = CliRunner().invoke(app, ["eval-lm", str(ckpt), "--tasks", "natsl_tiny_mc,natsl_tiny_ppl,natsl_tiny_gen",
                                          "--include-path", str(tasks), "--out", str(tmp_path / "out"),
                                          "--batch-size", "2", "--device", "cpu", "--threads", "1"])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 1 and "1 CPU thread of " in result.output
    finally:
        torch.set_num_threads(1)
    report = json.loads((tmp_path / "out" / "lm_eval.json").read_text())
    assert 0.0 <= report["results"]["natsl_tiny_mc"]["acc,none"] <= 1.0
    assert report["results"]["natsl_tiny_ppl"]["word_perplexity,none"] > 1.0
    assert "natsl_tiny_gen" in report["results"]
    assert (tmp_path / "out" / "lm_eval.png").stat().st_size > 0
    assert "natsl_tiny_mc" in (tmp_path / "out" / "lm_eval.md").read_text()
    assert "samples: natsl_tiny_mc 4, natsl_tiny_ppl 4, natsl_tiny_gen 4" in result.output
    bad = CliRunner().invoke(app, ["eval-lm", str(ckpt), "--tasks", " ,", "--out", str(tmp_path / "out")])
    assert bad.exit_code == 2 and "--tasks names no task" in bad.stderr


def test_device_in_model_args_or_from_lm_eval(ckpt):
    """lm-eval passes its own device (cuda:0 when --device is not given) and batch_size beside --model_args:
    a model_args value wins over lm-eval's default, two explicit values must agree (merge_model_args)."""
    defaults = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}  # lm_eval's command line, no options
    lm = NatslLM.create_from_arg_string(f"pretrained={ckpt},device=cpu,batch_size=2", defaults)
    assert lm.device.type == "cpu" and lm.batch_size == 2
    assert NatslLM.create_from_arg_string(f"pretrained={ckpt}", {**defaults, "device": "cpu"}).device.type == "cpu"
    assert NatslLM.create_from_arg_string(f"pretrained={ckpt},device=cpu", {**defaults, "device": "cpu"}).device.type == "cpu"
    assert NatslLM.create_from_arg_obj({"pretrained": str(ckpt), "device": "cpu"}, defaults).device.type == "cpu"
    with pytest.raises(NatslError, match=r"device is given twice and differently: device=cpu in --model_args, cuda:1"):
        NatslLM.create_from_arg_string(f"pretrained={ckpt},device=cpu", {**defaults, "device": "cuda:1"})
    with pytest.raises(NatslError, match="batch_size"):
        NatslLM.create_from_arg_string(f"pretrained={ckpt},batch_size=2", {**defaults, "batch_size": 4})


def test_simple_evaluate_takes_device_in_model_args(ckpt, tmp_path, monkeypatch):
    """The way lm-eval's own evaluator builds the model: model_args string and its own device together."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path / "tasks")
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    results = lm_eval.simple_evaluate(model="natsl", model_args=f"pretrained={ckpt},device=cpu", device="cuda:0",
                                      tasks=["natsl_tiny_mc"], limit=2, task_manager=manager)
    assert 0.0 <= results["results"]["natsl_tiny_mc"]["acc,none"] <= 1.0


def test_model_hf_and_model_natsl_score_an_export_alike_by_default(ckpt, tmp_path):
    """One max_length rule (natsl.config.context_length): the export's max_position_embeddings is the
    training length, so lm-eval's `hf` model rolls the same windows as `natsl` and the log-likelihoods agree."""
    pytest.importorskip("accelerate")  # lm-eval's hf model imports it (natsl[lm-eval] brings it)
    pytest.importorskip("transformers")
    from lm_eval.models.huggingface import HFLM  # lm-eval's `--model hf`

    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["convert", str(ckpt), str(out), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 128  # train.seq_len
    defaults = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}  # as lm_eval --device cpu passes them
    hf = HFLM.create_from_arg_string(f"pretrained={out},trust_remote_code=True,dtype=float32", defaults)
    ours = NatslLM.create_from_arg_string(f"pretrained={ckpt}", defaults)
    assert hf.max_length == ours.max_length == 128 and hf.prefix_token_id == ours.prefix_token_id
    texts = [essay_text(8, seed=1)[:3000], essay_text(2, seed=2)[:700], "A short one."]
    assert len(ours.tok_encode(texts[0])) > 3 * 128  # several windows
    requests = [request("loglikelihood_rolling", t) for t in texts]
    theirs = hf.loglikelihood_rolling(requests, disable_tqdm=True)
    assert ours.loglikelihood_rolling(requests, disable_tqdm=True) == pytest.approx(theirs, rel=1e-6)
    # A natsl checkpoint imported back from the export declares the same context.
    back = tmp_path / "back"
    assert CliRunner().invoke(app, ["convert", str(out), str(back), "--from-hf"]).exit_code == 0
    assert NatslLM(pretrained=str(back), device="cpu").max_length == 128


def test_the_lm_eval_extra_brings_what_model_hf_needs():
    """`pip install 'natsl[lm-eval]'` is enough for `lm_eval --model hf` on an export: transformers (natsl[hf])
    and accelerate (lm_eval/models/huggingface.py imports it at the top); the test extra installs the same."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    names = [r.split(">")[0].split("<")[0].split("=")[0] for r in extras["lm-eval"]]
    assert {"natsl[hf]", "lm-eval", "accelerate"} <= set(names)
    assert "natsl[lm-eval]" in extras["test"]
    assert not [r for r in extras["test"] if r.startswith(("transformers", "lm-eval", "accelerate"))]  # one floor each


def run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_lm_eval_command_finds_natsl_once_installed(ckpt, tmp_path):
    """`pip install -e .` (as CI installs natsl) into a fresh venv, then lm-eval's own command runs
    `--model natsl` on a local task: lm-eval 0.4.13 reads no model entry points, natsl-lm-eval.pth does
    the registering (_natsl_lm_eval.py), without importing natsl at start. The regular wheel ships the
    same two files and the entry point."""
    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "src"  # a copy, so the build's egg-info and build/ stay out of the checkout
    shutil.copytree(root / "natsl", source / "natsl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "setup.py", "MANIFEST.in", "natsl-lm-eval.pth", "_natsl_lm_eval.py"):
        shutil.copy(root / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "wheel",
         source])
    (wheel,) = (tmp_path / "wheel").glob("natsl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert {"natsl-lm-eval.pth", "_natsl_lm_eval.py"} <= set(archive.namelist())
        # the wheel's version is natsl.__version__ (pyproject.toml reads it)
        entry_points = archive.read(f"natsl-{natsl.__version__}.dist-info/entry_points.txt").decode()
    assert "[lm_eval.models]\nnatsl = natsl.eval.lm_eval_adapter:NatslLM" in entry_points

    # A venv that sees this environment's packages (lm-eval, torch) behind its own site-packages.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "zz_outer.pth").write_text("import site; " + "; ".join(f"site.addsitedir({p!r})"
                                                                     for p in site.getsitepackages()) + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-build-isolation",
         "-e", source])
    assert (purelib / "natsl-lm-eval.pth").exists()
    loaded = run([python, "-c", "import sys; print(' '.join(m for m in sys.modules if m.startswith(('natsl', 'lm_eval'))))"])
    assert loaded.stdout.strip() == ""  # natsl loads only when lm-eval asks for it
    # lm-eval's console command, as pip writes it for this venv's interpreter
    command = venv / "bin" / "lm_eval"
    command.write_text(f"#!{python}\nimport sys\nfrom lm_eval.__main__ import cli_evaluate\nsys.exit(cli_evaluate())\n")
    command.chmod(0o755)
    write_tasks(tmp_path / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # natsl must come from the install, not from the checkout
    run([command, "--model", "natsl", "--model_args", f"pretrained={ckpt}", "--tasks", "natsl_tiny_mc",
         "--include_path", tmp_path / "tasks", "--limit", "2", "--output_path", tmp_path / "out"], env=env, cwd=tmp_path)
    (results,) = (tmp_path / "out").rglob("results_*.json")
    report = json.loads(results.read_text())
    assert report["config"]["model"] == "natsl"
    assert 0.0 <= report["results"]["natsl_tiny_mc"]["acc,none"] <= 1.0


LM_EVAL_RESULTS = {  # the shape of lm-eval's simple_evaluate results
    "results": {"arc": {"alias": "arc", "name": "arc", "sample_len": 100, "acc,none": 0.4, "acc_stderr,none": 0.05,
                        "acc_norm,none": 0.45, "acc_norm_stderr,none": "N/A"},
                "wiki": {"alias": "wiki", "sample_len": 62, "word_perplexity,none": 35.2,
                         "word_perplexity_stderr,none": "N/A", "bits_per_byte,none": 0.9}},
    "higher_is_better": {"arc": {"acc": True, "acc_norm": True},
                         "wiki": {"word_perplexity": False, "bits_per_byte": False}},
    "n-samples": {"arc": {"original": 1172, "effective": 100}, "wiki": {"original": 62, "effective": 62}},
}


def test_lm_eval_plot_shows_scores_only_on_labelled_axes_of_their_own_scale():
    from natsl.eval.lm_eval_run import sample_counts, score_bars, score_panels

    bars = score_bars(LM_EVAL_RESULTS)
    assert [(b["task"], b["metric"]) for b in bars] == [("arc", "acc"), ("arc", "acc_norm"),
                                                        ("wiki", "word_perplexity"), ("wiki", "bits_per_byte")]
    assert bars[0]["stderr"] == 0.05 and bars[1]["stderr"] is None  # "N/A" is no error bar
    panels = score_panels(bars)
    assert [(label, [b["metric"] for b in group]) for label, group in panels] == [
        ("score (0 to 1)", ["acc", "acc_norm"]),
        ("word_perplexity; lower is better", ["word_perplexity"]),
        ("bits_per_byte; lower is better", ["bits_per_byte"])]
    assert sample_counts(LM_EVAL_RESULTS) == {"arc": 100, "wiki": 62}  # in the table and under the bars


def test_the_scores_are_written_before_lm_evals_table(ckpt, tmp_path, monkeypatch):
    """lm-eval's table needs packages of its own (a GPU image without pytz lost a finished evaluation there):
    the scores are on disk before the table is made."""
    import lm_eval.utils

    from natsl.eval.lm_eval_run import run_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    write_tasks(tasks)

    def no_table(results):
        raise ModuleNotFoundError("No module named 'pytz'")

    monkeypatch.setattr(lm_eval.utils, "make_table", no_table)
    with pytest.raises(ModuleNotFoundError, match="pytz"):
        run_tasks(ckpt, ["natsl_tiny_mc"], tmp_path / "out", include_path=tasks, limit=2, batch_size=2,
                  model_args={"device": "cpu"})
    report = json.loads((tmp_path / "out" / "lm_eval.json").read_text())
    assert 0.0 <= report["results"]["natsl_tiny_mc"]["acc,none"] <= 1.0
