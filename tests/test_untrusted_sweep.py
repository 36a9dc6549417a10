"""Sweep specs and eval-recall options from strangers, one class of bad input at a time, so that no later
change reopens one: nothing in a spec runs code (env:, the workers' sys.path), names no file or folder
outside its place (run folders in --out, recipes beside the spec), crashes with a traceback, is checked
only in the workers, or overwrites another sweep's results; eval-recall refuses values it cannot use.
Every refusal is one line, exit code 2, before anything is written. CPU only, stand-in workers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl.training.sweep as S
from natsl.cli.main import app
from natsl.errors import NatslError

from cli_checks import assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = "systems: {gdn: recall/gdn}\n"
BASE = {"widths": "[64]", "lrs": "[0.001]", "tasks": "{t: 'task:mqar?seq_len=64&pairs=4'}",
        "budget": "{max_steps: 2}"}


def spec_text(systems: str = SYSTEMS, **keys) -> str:
    """A small valid spec, with `keys` (top-level key -> YAML text) added or replacing BASE's."""
    return systems + "".join(f"{key}: {value}\n" for key, value in {**BASE, **keys}.items())


def write_spec(folder: Path, text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def refused(tmp_path, text: str | bytes, *fragments: str) -> None:
    """`natsl sweep` on this spec text: one `error:` line holding every fragment, exit 2, --out never made."""
    spec = write_spec(tmp_path / "spec", text)
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--no-progress"])
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def stand_in_worker(tmp_path, monkeypatch, body: str) -> None:
    """The runner starts `/bin/sh worker.sh RUN.json` instead of a real worker; `$dir` is the run folder."""
    worker = tmp_path / "worker.sh"
    worker.write_text(f'#!/bin/sh\ndir=$(dirname "$1")\n{body}\n')
    monkeypatch.setattr(S, "WORKER", ["/bin/sh", str(worker)])


DONE = 'printf \'{"status": "done", "steps": 2, "recall_accuracy": 0.5}\' > "$dir/result.json"'


# -- code execution: a system's env: and the workers' import path ----------------------------------------

@pytest.mark.parametrize("name", [
    "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH",
    "PATH", "HOME", "BASH_ENV", "TRITON_CACHE_DIR", "TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR", "TORCH_LOGS",
    "TORCH_LOGS_OUT", "CUDA_HOME", "NATSL_CACHE_DIR", "NATSL_DEBUG_DIR", "NATSL_FAULT", "NATSL_BACKEND", "OMP_NUM_THREADS",
    "natsl_fused_mix", "NATSL_FUSED_MIX ",
])
def test_env_allows_only_natsl_switches_and_diagnostics(tmp_path, name):
    refused(tmp_path, f"systems: {{gdn: {{recipe: recall/gdn, env: {{'{name}': '/tmp/x'}}}}}}\n" + spec_text(""), f"env variable {name!r} is not allowed", "NATSL_FUSED_MIX", "CUDA_LAUNCH_BLOCKING",
            "remove it")


@pytest.mark.parametrize("env, message", [
    ("{NATSL_FOLD_CLIP: 2}", "NATSL_FOLD_CLIP='2' is not 0 or 1"),
    ("{NATSL_COMPILE_POINTWISE: sometimes}", "NATSL_COMPILE_POINTWISE='sometimes' is not one of"),
    ("{CUDA_LAUNCH_BLOCKING: maybe}", "CUDA_LAUNCH_BLOCKING='maybe' must be 0 or 1"),
    ("{TORCHINDUCTOR_COMPILE_THREADS: 0}", "TORCHINDUCTOR_COMPILE_THREADS='0' must be a count"),
    ("{TORCH_SHOW_CPP_STACKTRACES: [1]}", "has no plain value"),
    ("{NATSL_CHECK_OPS: -1}", "NATSL_CHECK_OPS='-1' must be 0, 1 or a line limit"),
])
def test_env_values_are_checked_at_load(tmp_path, env, message):
    refused(tmp_path, f"systems: {{gdn: {{recipe: recall/gdn, env: {env}}}}}\n" + spec_text(""), message)


def test_allowed_env_values_read_as_natsl_reads_them():
    """A YAML boolean becomes 1 or 0: natsl reads "false" as on (only "0" is off)."""
    from natsl import switches

    env = S.check_env({"NATSL_CHECK_OPS": 1, "CUDA_LAUNCH_BLOCKING": True, "NATSL_FUSED_MIX": False,
                       "TORCHINDUCTOR_COMPILE_THREADS": 1}, "gdn", "spec.yaml")
    assert env == {"NATSL_CHECK_OPS": "1", "CUDA_LAUNCH_BLOCKING": "1", "NATSL_FUSED_MIX": "0",
                   "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert switches.from_environ(env).fused_mix is False


def test_a_spec_folder_with_sitecustomize_runs_nothing(tmp_path):
    """The attack as found: a system's env: PYTHONPATH to the spec's folder, whose sitecustomize.py every
    worker would run. `natsl sweep` refuses the spec in one line; nothing runs, nothing is written."""
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "ran"
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    spec = write_spec(evil, f"systems: {{gdn: {{recipe: recall/gdn, env: {{PYTHONPATH: {str(evil)!r}}}}}}}\n"
                      + spec_text(""))
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "sweep", str(spec), "--out", str(tmp_path / "out"),
                           "--no-progress"], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'PYTHONPATH' is not allowed" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_workers_import_nothing_from_the_working_folder(tmp_path, monkeypatch):
    """A sweep started in a folder that holds a `natsl` package and a sitecustomize.py (a downloaded spec's
    folder): the real worker command imports natsl from the runner's PYTHONPATH, not from there. Its run
    fails (no recipe 'none'), so the runner also exits 1."""
    here = tmp_path / "here"
    (here / "natsl").mkdir(parents=True)
    marker = tmp_path / "imported"
    for file in (here / "natsl" / "__init__.py", here / "sitecustomize.py"):
        file.write_text(f"open({str(marker)!r}, 'a').write({file.name!r})\n")
    monkeypatch.chdir(here)
    run = S.RunSpec("r0", "fake", "none", 32, 1e-3, "t", "task:none", [], 1, 60.0, {}, False, "cpu",
                    str(tmp_path / "out" / "runs" / "r0"))
    summary = S.run_sweep(S.Sweep("fake", [run], 1, None, 0.0, tmp_path / "out", min_train_s=0.0), progress=False,
                          log=lambda line: None)
    log = (tmp_path / "out" / "runs" / "r0" / "log.txt").read_text()
    assert not marker.exists(), log
    assert summary["runs"][0]["status"] == "failed" and "recipe" in summary["runs"][0]["error"]
    assert S.exit_code(summary) == 1


# -- names and paths: every run folder in --out, every recipe beside the spec ------------------------------

BAD_NAMES = ["../x", "../../etc", "a/b", "/abs", "..", ".hidden", "a..b", "x" * 65, "a b", "a\\b", "", "tab\t", 5, "ü"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_task_names_are_plain(tmp_path, name):
    refused(tmp_path, spec_text(tasks=json.dumps({name: "task:mqar?seq_len=64&pairs=4"}) if isinstance(name, str)
                                else f"{{{name}: 'task:mqar?seq_len=64&pairs=4'}}"),
            f"task name {name!r} is not a plain name")


@pytest.mark.parametrize("name", BAD_NAMES)
def test_system_names_are_plain(tmp_path, name):
    key = json.dumps(name) if isinstance(name, str) else name
    refused(tmp_path, f"systems: {{{key}: recall/gdn}}\n" + spec_text(""), f"system name {name!r} is not a plain name")


@pytest.mark.parametrize("recipe", ["../gdn.yaml", "/etc/passwd", "sub/../../gdn.yaml", "link.yaml"])
def test_recipes_lie_beside_the_spec(tmp_path, recipe):
    outside = tmp_path / "gdn.yaml"
    outside.write_text((ROOT / "recipes/recall/gdn.yaml").read_text())
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "link.yaml").symlink_to(outside)
    refused(tmp_path, f"systems: {{gdn: {recipe!r}}}\n" + spec_text(""), f"recipe {recipe!r} lies outside the spec's folder")


def test_a_recipe_beside_the_spec_or_a_shipped_name_loads(tmp_path):
    folder = tmp_path / "spec"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "mine.yaml").write_text((ROOT / "recipes/recall/gdn.yaml").read_text())
    sweep = S.load_spec(write_spec(folder, "systems: {a: sub/mine.yaml, b: recall/gdn}\n" + spec_text("")),
                        tmp_path / "out")
    assert [r.recipe for r in sweep.runs] == [str((folder / "sub" / "mine.yaml").resolve()), "recall/gdn"]
    refused(tmp_path / "missing", "systems: {a: nowhere.yaml}\n" + spec_text(""), "no file beside the spec")


def test_run_folders_stay_in_out_through_symlinks(tmp_path, monkeypatch):
    """--out/runs a symlink to another folder: refused before the runner writes anything."""
    stand_in_worker(tmp_path, monkeypatch, DONE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs").symlink_to(elsewhere)
    sweep = S.load_spec(write_spec(tmp_path / "spec", spec_text()), tmp_path / "out")
    with pytest.raises(NatslError, match="resolves outside --out"):
        S.run_sweep(sweep, progress=False, log=lambda line: None)
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["runs"]


@pytest.mark.parametrize("item, message", [
    ("data.path=/etc", "the runner sets data.path for every run; use tasks"),
    ("train.out_dir=/tmp/elsewhere", "the runner sets train.out_dir for every run; use --out"),
])
def test_set_cannot_move_the_data_or_the_run(tmp_path, item, message):
    refused(tmp_path, spec_text(set=f"[{item}]"), message)


# -- tracebacks and checks only the workers made: all at load, one line ----------------------------------

@pytest.mark.parametrize("keys, message", [
    ({"set": "[train.micro_batch_size=abc]"}, "train.micro_batch_size' must be an integer or 'auto', got str 'abc'"),
    ({"set": "[train.micro_batch_size=0]"}, "train.micro_batch_size' must be at least 1"),
    ({"set": "[train.micro_batch_size=1.5]"}, "train.micro_batch_size' must be an integer"),
    ({"eval": "[1]"}, "'eval' must be a mapping"),
    ({"eval": "{samples: abc}"}, "eval.samples must be a whole number, at least 1, got 'abc'"),
    ({"eval": "{samples: 0}"}, "eval.samples must be a whole number"),
    ({"eval": "{batch_size: -1}"}, "eval.batch_size must be a whole number"),
    ({"eval": "{batch_size: true}"}, "eval.batch_size must be a whole number"),
    ({"eval": "{seed: -1}"}, "eval.seed must be an integer from 0 to 2**63-1"),
    ({"eval": "{seed: 18446744073709551616}"}, "eval.seed must be an integer from 0 to 2**63-1"),
    ({"eval": "{vocab: 0}"}, "eval.vocab must be a whole number"),
    ({"eval": "{vocab: 100000}"}, "--vocab 100000 is more than the model's vocabulary"),
    ({"eval": "{lengths: abc}"}, "eval.lengths 'abc': 'abc' is not a length"),
    ({"eval": "{lengths: [512]}"}, "eval.lengths must be comma-separated numbers"),
    ({"eval": "{lengths: '16384'}"}, "16384 is beyond the model's max_seq_len"),
    ({"eval": "{pairs: '0'}"}, "eval.pairs '0': counts must be positive"),
    ({"eval": "{pairs: '1000'}"}, "no (length, pairs) point of the grid fits"),
    ({"eval": "{colour: red}"}, "unknown eval key 'colour'"),
    ({"max_parallel": "abc"}, "max_parallel must be a whole number of workers"),
    ({"max_parallel": "0"}, "max_parallel must be a whole number of workers"),
    ({"max_parallel": "true"}, "max_parallel must be a whole number of workers"),
    ({"device": "gpu"}, "device 'gpu' is not one of auto, cpu, cuda, cuda:N"),
    ({"device": "5"}, "device 5 is not one of"),
    ({"compile": "'yes'"}, "'compile' must be true or false"),
    ({"name": "[1]"}, "'name' must be a one-line string"),
    ({"widths": "[true]"}, "'widths' must be a list of positive integers"),
    ({"budget": "{run_s: .inf}"}, "budget.run_s must be a number of seconds"),
    ({"budget": "{deadline_s: .nan}"}, "the deadline must be a positive number of seconds"),
    ({"budget": "{max_steps: 2, max_stepz: 3}"}, "unknown budget key 'max_stepz'"),
    ({"budget": "{max_tokens: abc}"}, "budget.max_tokens must be a whole number of tokens, at least 1"),
    ({"budget": "{max_tokens: 0}"}, "budget.max_tokens must be a whole number of tokens, at least 1"),
    ({"budget": "{max_tokens: true}"}, "budget.max_tokens must be a whole number of tokens"),
    ({"budget": "{max_tokens: 1.5e6}"}, "budget.max_tokens must be a whole number of tokens"),
    ({"budget": "{max_steps: 2, max_tokens: 1000000}"}, "budget gives both max_steps and max_tokens; keep one"),
    ({"budget": "{max_tokens: 3}"}, "budget.max_tokens 3 is less than one step"),
    ({"tasks": "{t: ''}"}, "'tasks' must map names to data paths"),
    ({"tasks": "{t: no/such/folder}"}, "data folder 'no/such/folder' does not exist"),
    ({"colour": "red"}, "unknown key 'colour'"),
])
def test_bad_values_are_one_line_errors_at_load(tmp_path, keys, message):
    refused(tmp_path, spec_text(**keys), message)


@pytest.mark.parametrize("text, message", [
    (spec_text() + "widths: [128]\n", "gives key 'widths' twice (lines 2 and 6); keep one"),
    ("systems: {gdn: recall/gdn, gdn: recall/natsl_hybrid}\n" + spec_text(""), "gives key 'gdn' twice"),
    (spec_text(eval="{samples: 8, samples: 16}"), "gives key 'samples' twice"),
    (spec_text(budget="{max_steps: 2, max_steps: 3}"), "gives key 'max_steps' twice"),
    ("systems: {gdn: {recipe: recall/gdn, set: [], set: [train.log_every=1]}}\n" + spec_text(""), "gives key 'set' twice"),
    ("systems: {gdn: {recipe: recall/gdn, sets: []}}\n" + spec_text(""), "system 'gdn' has unknown key 'sets'"),
    ("systems: [" * 2000 + "]" * 2000 + "\n", "nested too deeply"),
    ("systems: {gdn: recall/gdn\n", "not valid YAML"),
    (b"systems: \xff\xfe\n", "is not UTF-8 text"),
    # widths may be left out only when every task is a language-model folder (each recipe's own width)
    ("systems: {gdn: recall/gdn}\nlrs: [0.001]\ntasks: {t: 'task:mqar?seq_len=64&pairs=4', lm: data}\n",
     "it may be left out only when every task is a natsl tokenize folder"),
])
def test_duplicate_and_unknown_keys_and_broken_files(tmp_path, text, message):
    refused(tmp_path, text, message)


def test_a_cuda_sweep_without_a_gpu_stops_before_any_worker(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    stand_in_worker(tmp_path, monkeypatch, DONE)
    spec = write_spec(tmp_path / "spec", spec_text(device="cuda"))
    sweep = S.load_spec(spec, tmp_path / "out")  # a spec loads anywhere: it runs where its GPU is
    with pytest.raises(NatslError, match="the runs train on cuda, but this machine has no CUDA GPU; pass --device cpu"):
        S.run_sweep(sweep, progress=False, log=lambda line: None)
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--device", "cuda:1"])
    assert_one_line_error(result, "the runs train on cuda:1")


def test_a_run_too_large_for_the_memory_is_refused_before_any_worker(tmp_path):
    """widths: [a million] passes the spec's checks; the memory estimate stops it in one line, not a worker's
    out-of-memory traceback in its log."""
    refused(tmp_path, spec_text(widths="[1048576]", device="cpu"), "run t-gdn-d1048576", "width 1048576",
            "of memory at its peak (estimate)", "lower the spec's widths")


def test_failed_runs_make_the_runner_exit_1(tmp_path, monkeypatch):
    """A worker that fails (its own error, or killed by something else than the runner) is a failed run:
    exit 1 from the module entry point and `natsl sweep`; a sweep whose runs are all done exits 0."""
    spec = write_spec(tmp_path / "spec", spec_text(lrs="[0.001, 0.003]"))
    stand_in_worker(tmp_path, monkeypatch, 'case "$dir" in\n  *lr0.003) kill -9 $$ ;;\n  *) ' + DONE + ' ;;\nesac')
    assert S.main([str(spec), "--out", str(tmp_path / "a"), "--no-progress"]) == 1
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    statuses = {r["id"]: (r["status"], r.get("failed")) for r in summary["runs"]}
    assert statuses == {"t-gdn-d64-lr0.001": ("done", None), "t-gdn-d64-lr0.003": ("not run", "killed by SIGKILL")}
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "b"), "--no-progress"])
    assert result.exit_code == 1, result.output
    stand_in_worker(tmp_path, monkeypatch, 'printf \'{"status": "failed", "error": "X"}\' > "$dir/result.json"')
    assert S.main([str(spec), "--out", str(tmp_path / "c"), "--no-progress"]) == 1
    stand_in_worker(tmp_path, monkeypatch, DONE)
    assert S.main([str(spec), "--out", str(tmp_path / "d"), "--no-progress"]) == 0


# -- data loss: another spec's --out ------------------------------------------------------------------------

def test_a_second_spec_into_the_same_out_is_refused_and_the_same_spec_resumes(tmp_path, monkeypatch):
    stand_in_worker(tmp_path, monkeypatch, DONE)
    out = tmp_path / "out"
    first = write_spec(tmp_path / "first", spec_text(lrs="{64: [0.001]}"))  # integer keys: as JSON reads them back
    assert S.main([str(first), "--out", str(out), "--no-progress"]) == 0
    kept = (out / "summary.json").read_bytes(), (out / "sweep.json").read_bytes()
    second = write_spec(tmp_path / "second", spec_text(widths="[128]"))
    result = CliRunner().invoke(app, ["sweep", str(second), "--out", str(out), "--no-progress"])
    assert_one_line_error(result, f"--out {str(out)!r} holds the sweep 'spec' of another spec ('widths' differs); "
                                  "pass a new --out folder")
    assert ((out / "summary.json").read_bytes(), (out / "sweep.json").read_bytes()) == kept
    assert not (out / "runs" / "t-gdn-d128-lr0.001").exists()
    # the same spec again: a resume, its finished run kept
    logged = []
    S.run_sweep(S.load_spec(first, out), progress=False, log=logged.append)
    assert logged[0].startswith("sweep spec: 1 runs (1 done already, 0 to run)")


def test_a_spec_that_adds_rates_or_systems_grows_the_sweep_and_keeps_its_runs(tmp_path, monkeypatch):
    """More learning rates (or systems), all else equal: the finished runs are kept, only the new ones train."""
    stand_in_worker(tmp_path, monkeypatch, 'echo ran >> "$dir/../../calls"\n' + DONE)
    out = tmp_path / "out"
    first = write_spec(tmp_path / "first", spec_text(lrs="[0.001]"))
    assert S.main([str(first), "--out", str(out), "--no-progress"]) == 0
    first_result = (out / "runs" / "t-gdn-d64-lr0.001" / "result.json").read_bytes()
    grown = write_spec(tmp_path / "grown", spec_text(lrs="[0.001, 0.003]"))
    logged = []
    S.run_sweep(S.load_spec(grown, out), progress=False, log=logged.append)
    assert logged[0] == f"sweep spec: the spec grows the sweep in {out} by 1 runs; its earlier runs are kept"
    assert logged[1].startswith("sweep spec: 2 runs (1 done already, 1 to run)")
    assert (out / "calls").read_text().split() == ["ran", "ran"]  # the first run once, the new one once
    assert (out / "runs" / "t-gdn-d64-lr0.001" / "result.json").read_bytes() == first_result
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["id"] for r in summary["runs"]) == ["t-gdn-d64-lr0.001", "t-gdn-d64-lr0.003"]
    assert json.loads((out / "sweep.json").read_text())["spec"]["lrs"] == [0.001, 0.003]
    # a spec that drops a run, or changes a setting of the runs kept, is another sweep
    for text, why in ((spec_text(lrs="[0.003]"), "run 't-gdn-d64-lr0.001' is left out"),
                      (spec_text(lrs="[0.001, 0.003, 0.01]", set="[optim.grad_clip=0.5]"), "'set' differs")):
        result = CliRunner().invoke(app, ["sweep", str(write_spec(tmp_path / why[:5], text)), "--out", str(out)])
        assert_one_line_error(result, f"of another spec ({why})")
    assert (out / "calls").read_text().split() == ["ran", "ran"]


def test_a_sweep_json_nested_past_the_parser_is_no_sweep_record(tmp_path, monkeypatch):
    stand_in_worker(tmp_path, monkeypatch, DONE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text("[" * 100_000 + "]" * 100_000)
    result = CliRunner().invoke(app, ["sweep", str(write_spec(tmp_path / "spec", spec_text())), "--out", str(out)])
    assert_one_line_error(result, "holds a sweep.json that is no sweep record; pass a new --out folder")


@pytest.mark.parametrize("present", ["summary.json", "summary.png", "sweep.json"])
def test_an_out_folder_of_unknown_origin_is_not_overwritten(tmp_path, monkeypatch, present):
    stand_in_worker(tmp_path, monkeypatch, DONE)
    out = tmp_path / "out"
    out.mkdir()
    (out / present).write_text("mine")
    result = CliRunner().invoke(app, ["sweep", str(write_spec(tmp_path / "spec", spec_text())), "--out", str(out)])
    assert_one_line_error(result, "pass a new --out folder")
    assert (out / present).read_text() == "mine" and sorted(p.name for p in out.iterdir()) == [present]


# -- eval-recall's options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--vocab", "0"], "--vocab must be a positive integer"),
    (["--vocab", "-5"], "--vocab must be a positive integer"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**63-1"),
    (["--seed", str(2**64)], "--seed must be an integer from 0 to 2**63-1"),
    (["--seed", str(2**63)], "--seed must be an integer from 0 to 2**63-1"),
    (["--samples", "0"], "--samples and --batch-size must be at least 1"),
    (["--batch-size", "-3"], "--samples and --batch-size must be at least 1"),
    (["--keep-fraction", "1.5"], "--keep-fraction must lie in [0, 1]"),
    (["--keep-fraction", "nan"], "--keep-fraction must lie in [0, 1]"),
    (["--lengths", "0"], "--lengths '0': lengths must be positive"),
    (["--lengths", "abc"], "'abc' is not a length"),
    (["--pairs", "inf"], "--pairs 'inf': 'inf' is not a count; use e.g. 16,64,256"),
    (["--pairs", ","], "--pairs is empty"),
])
def test_eval_recall_options_are_checked_before_any_work(tmp_path, args, message):
    """Checked before the checkpoint is read (there is none here) and before --out is made."""
    result = CliRunner().invoke(app, ["eval-recall", str(tmp_path / "no-checkpoint"), "--out", str(tmp_path / "out"),
                                      "--device", "cpu", *args])
    assert_one_line_error(result, message)
    assert not (tmp_path / "out").exists()


def test_run_records_survive_result_and_metrics_files_that_are_no_records(tmp_path):
    """A run folder in --out holds what its worker wrote, or anything: a result.json nested past the parser or
    not an object is no result, and metrics.jsonl lines that are not UTF-8, nested past the parser, cut or not
    objects are skipped, where each gave a traceback."""
    import natsl.training.sweep as S

    run = S.RunSpec(id="r", system="gdn", recipe="x", width=64, lr=1e-3, task="t", data="d", overrides=[],
                    max_steps=8, run_s=60.0, eval={}, compile=False, device="cpu", out=str(tmp_path / "r"))
    metrics = tmp_path / "r" / "train" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_bytes(b'{"step": 3, "loss": 2.0}\n\xff\xfe not utf-8\n' + b"[" * 100_000 + b"]" * 100_000
                        + b'\n7\n{"step": 4, "loss": 1.5}\n{"step": 5, "lo')
    for result in ("[" * 100_000 + "]" * 100_000, "[1, 2]"):
        (tmp_path / "r" / "result.json").write_text(result)
        record = S.run_record(run)
        assert record["status"] == "cut off" and record["steps"] == 4, record
