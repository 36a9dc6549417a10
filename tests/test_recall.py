"""Synthetic recall: the MQAR / passkey generators, training on a task, eval-recall and the sweep runner."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from natsl.data.tasks import IGNORE, TaskData, parse_task
from natsl.errors import NatslError

ROOT = Path(__file__).resolve().parent.parent


def test_mqar_follows_zoology():
    """Keys from [1, V/2), values from [V/2, V), the pairs first, each key asked once after them at an
    even offset, the answer (its value) the only target; reproducible from (seed, indices)."""
    vocab, length, pairs = 64, 48, 6
    data = TaskData(f"task:mqar?vocab={vocab}&seq_len={length}&pairs={pairs}&random_non_queries=0", 128, 64, 3, "cpu")
    x, y = data.batch(list(range(16)))
    assert x.shape == y.shape == (16, 64)
    assert (y[:, length:] == IGNORE).all() and (x[:, length:] == 0).all()  # padding
    for row_x, row_y in zip(x, y):
        keys, values = row_x[0:2 * pairs:2], row_x[1:2 * pairs:2]
        assert keys.unique().numel() == pairs and values.unique().numel() == pairs
        assert ((keys >= 1) & (keys < vocab // 2)).all() and ((values >= vocab // 2) & (values < vocab)).all()
        asked = (row_y != IGNORE).nonzero().flatten()
        assert len(asked) == pairs and ((asked - 2 * pairs) % 2 == 0).all() and (asked >= 2 * pairs).all()
        answer = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(row_x[asked].tolist()) == sorted(keys.tolist())
        assert all(answer[k] == v for k, v in zip(row_x[asked].tolist(), row_y[asked].tolist()))
        rest = torch.ones(64, dtype=torch.bool)
        rest[:2 * pairs] = False
        rest[asked] = False
        assert (row_x[rest] == 0).all()  # random_non_queries=0 leaves the filler at 0
    again, _ = data.batch(list(range(16)))
    other, _ = data.batch(list(range(16, 32)))
    assert torch.equal(again, x) and not torch.equal(other, x)


def test_mqar_power_law_gaps_and_noise():
    def mean_gap(power):
        data = TaskData(f"task:mqar?vocab=256&seq_len=256&pairs=8&power_a={power}", 256, 256, 0, "cpu")
        x, y = data.batch(list(range(64)))
        return float(((y != IGNORE).nonzero()[:, 1] - 16).float().mean()), x
    near, x = mean_gap(0.01)
    far, _ = mean_gap(1.0)
    assert near < 0.6 * far  # power law: queries come soon after the pairs; 1.0 is uniform
    assert (x[:, 16:] != 0).float().mean() > 0.9  # random filler by default (Zoology's random_non_queries)


def test_mixture_and_passkey():
    data = TaskData("task:mqar?vocab=128&seq_len=32,64&pairs=4,16&weights=1,3", 128, 64, 0, "cpu")
    _, y = data.batch(list(range(64)))
    counts = (y != IGNORE).sum(1)
    assert set(counts.tolist()) == {4, 16} and (counts == 16).sum() > (counts == 4).sum()
    assert ((counts == 4) <= (y[:, 32:] == IGNORE).all(1)).all()  # the short part is padded
    key = TaskData("task:passkey?vocab=64&seq_len=40&digits=4", 64, 40, 0, "cpu")
    x, y = key.batch([0, 1, 2])
    for row_x, row_y in zip(x, y):
        needle = (row_x == 1).nonzero().flatten()
        assert len(needle) == 1 and row_x[36] == 2  # the question, then the digits again
        code = row_x[needle + 1:needle + 5]
        assert ((code >= 3) & (code < 13)).all()
        assert torch.equal(row_y[36:40], code) and torch.equal(row_x[37:40], code[:3]) and (row_y[:36] == IGNORE).all()


@pytest.mark.parametrize("spec, message", [
    ("task:mqar?seq_len=64&pairs=32", "at least 4 x pairs"),
    ("task:mqar?seq_len=128&pairs=4", "more than train.seq_len"),
    ("task:mqar?seq_len=64", "needs pairs"),
    ("task:mqar?seq_len=64&pairs=4&colour=red", "unknown key 'colour'"),
    ("task:mqar?seq_len=64&pairs=4&vocab=4096", "more than model.vocab_size"),
    ("task:copy?seq_len=64", "unknown task 'copy'"),
    ("task:mqar?mix=zoology&pairs=4", "mix=zoology"),
])
def test_bad_task_specs_name_the_problem(spec, message):
    with pytest.raises(NatslError, match=message.replace("(", r"\(")):
        parse_task(spec, 1024, 64)


def test_zoology_mixture():
    task = parse_task("task:mqar?mix=zoology", 8192, 256)
    assert [(p.seq_len, p.pairs, p.weight) for p in task.parts] == [
        (64, 4, 100000.0), (128, 8, 20000.0), (256, 16, 20000.0), (256, 32, 20000.0), (256, 64, 20000.0)]


def _sweep_cpu_without_wall_clock_limits(tmp_path) -> Path:
    """recipes/recall/sweep_cpu.yaml with an hour for each run and for the sweep (a loaded machine must not cut
    its 4 steps short); its recipes named as shipped recipes."""
    data = yaml.safe_load((ROOT / "recipes/recall/sweep_cpu.yaml").read_text())
    data["systems"] = {name: f"recall/{Path(path).stem}" for name, path in data["systems"].items()}
    data["budget"].update(run_s=3600, deadline_s=3600)
    spec = tmp_path / "sweep_cpu.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def test_sweep_trains_evaluates_and_summarises(tmp_path):
    """The CPU sweep (2 runs x 4 steps) through the module entry point: results and summary."""
    out = tmp_path / "sweep"
    spec = _sweep_cpu_without_wall_clock_limits(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "natsl.training.sweep", str(spec),
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["status"] for r in summary["runs"]} == {"done"} and len(summary["runs"]) == 2
    for run in summary["runs"]:
        assert run["steps"] == 4 and 0.0 <= run["recall_accuracy"] <= 1.0 and run["parameters"] > 0
        assert [(p["seq_len"], p["count"]) for p in run["recall_points"]] == [(64, 4), (64, 8), (128, 4), (128, 8)]
        recall = json.loads((out / "runs" / run["id"] / "eval" / "recall.json").read_text())
        assert recall["trained_on"].startswith("task:mqar") and recall["points"][0]["samples"] == 8
        records = [json.loads(line) for line in (out / "runs" / run["id"] / "train" / "metrics.jsonl").open()]
        assert any("val_accuracy" in r for r in records)
        # how the worker ran: its switches and environment (the runner's OMP_NUM_THREADS=1 among them)
        made = json.loads((out / "runs" / run["id"] / "result.json").read_text())["provenance"]
        assert made["environment"]["OMP_NUM_THREADS"] == "1" and "fused_mix" in made["switches"]
    hybrid = next(r for r in summary["runs"] if r["system"] == "natsl_hybrid")
    assert hybrid["keep_fraction"] is not None and set(hybrid["keep_groups_last_step"]) == {"3"}
    assert len(hybrid["keep_groups_last_step"]["3"]) == 2  # per routing group
    assert {p["system"] for p in summary["best"]} == {"natsl_hybrid", "gdn"}
    # matched in steps (the spec gives max_steps): each trained its 4 steps, one seed, none short
    assert summary["match"] == "steps" and summary["seeds"] == [0]
    assert all(p["seeds_finished"] == p["seeds_total"] == 1 and p["short"] == 0 and p["seeds"][0]["steps"] == 4
               for p in summary["best"])
    assert (out / "summary.png").stat().st_size > 1000
    # Each run leaves its trained model as a bf16 inference folder (what natsl compare reads), with the
    # training checkpoint's weights rounded to bf16.
    from safetensors.torch import load_file

    from natsl.checkpoint import load_checkpoint, resolve_checkpoint_folder

    for run in summary["runs"]:
        folder = out / "runs" / run["id"]
        exported = load_file(str(folder / "model" / "model.safetensors"))
        trained = load_file(str(resolve_checkpoint_folder(folder / "train") / "model.safetensors"))
        assert exported.keys() == trained.keys()
        for name, tensor in trained.items():
            assert exported[name].dtype == (torch.bfloat16 if tensor.is_floating_point() else tensor.dtype), name
            assert torch.equal(exported[name], tensor.to(exported[name].dtype)), name
        assert load_checkpoint(folder / "model")[0].recipe.name == load_checkpoint(folder / "train")[0].recipe.name
    # A forced budget (eval-recall --keep-fraction) rules the routes the evaluation reports.
    from natsl.cli.eval_recall import run_eval_recall

    for fraction in (0.0, 1.0):
        report = run_eval_recall(str(out / "runs" / hybrid["id"] / "train"), samples=4, batch_size=4,
                                 keep_fraction=fraction, out=str(tmp_path / f"budget{fraction}"), device="cpu",
                                 progress=False, quiet=True)
        assert report["forced_keep_fraction"] == fraction and report["mean_keep_fraction"] == fraction
    # A deadline that has passed: no grid point is evaluated (a sweep's worker then ranks by validation).
    import time

    late = run_eval_recall(str(out / "runs" / hybrid["id"] / "train"), samples=4, batch_size=4, device="cpu",
                           out=str(tmp_path / "late"), progress=False, quiet=True, deadline=time.time())
    assert late["points"] == [] and late["complete"] is False and late["mean_accuracy"] is None
    assert summary["stopped"] is None
    # A second call finds every run done and only rebuilds the summary.
    again = subprocess.run([sys.executable, "-m", "natsl.training.sweep", str(spec),
                            "--out", str(out), "--no-progress"], capture_output=True, text=True, cwd=ROOT,
                           env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=3000)
    assert again.returncode == 0 and "2 of 2 runs done" in again.stdout
    assert "sweep recall_cpu: 2 runs (2 done already, 0 to run), at most 2 at once, matched in steps" in again.stdout


def test_sweep_spec_errors(tmp_path):
    from natsl.training.sweep import load_spec

    bad = tmp_path / "bad.yaml"
    bad.write_text("systems: {gdn: recall/gdn}\nwidths: [10]\nlrs: [0.001]\n"
                   "tasks: {t: 'task:mqar?seq_len=64&pairs=4'}\n")
    with pytest.raises(NatslError, match="not a whole number"):
        load_spec(bad, tmp_path / "out")
    # a task that is not task:... is a language-model task (a natsl tokenize folder, or builtin)
    bad.write_text("systems: {gdn: recall/gdn}\nwidths: [64]\nlrs: [0.001]\ntasks: {t: builtin}\n")
    assert [r.kind for r in load_spec(bad, tmp_path / "out").runs] == ["lm"]


def test_sweep_learning_rates_by_width_and_system_and_the_deadline_flag(tmp_path):
    """`lrs` as a mapping width -> list, or system -> (a list, or width -> list): a width left out is not run
    for that system; mistakes are one-line errors. --deadline (load_spec's deadline_s) beats the spec's."""
    from natsl.training.sweep import load_spec

    spec = tmp_path / "s.yaml"
    base = ("systems: {gdn: recall/gdn, natsl_hybrid: recall/natsl_hybrid}\nwidths: [64, 128]\n"
            "tasks: {t: 'task:mqar?seq_len=64&pairs=4'}\nbudget: {deadline_s: 100}\n")

    def runs(lrs, **kw):
        spec.write_text(base + f"lrs: {lrs}\n")
        return [(r.system, r.width, r.lr) for r in load_spec(spec, tmp_path / "out", **kw).runs]

    assert runs("{64: [0.001, 0.003], 128: [0.0003]}") == [
        ("gdn", 64, 1e-3), ("natsl_hybrid", 64, 1e-3), ("gdn", 64, 3e-3), ("natsl_hybrid", 64, 3e-3),
        ("gdn", 128, 3e-4), ("natsl_hybrid", 128, 3e-4)]
    assert runs("{gdn: {64: [0.001]}, natsl_hybrid: [0.0003]}") == [
        ("gdn", 64, 1e-3), ("natsl_hybrid", 64, 3e-4), ("natsl_hybrid", 128, 3e-4)]
    for lrs, message in (("{256: [0.001]}", "names width 256"), ("{gdn: [0.001]}", "no learning rates for system 'natsl_hybrid'"),
                         ("{gdn: [0.001], natsl_hybrid: [0.001], tf: [0.1]}", "names system 'tf'"),
                         ("{gdn: {64: [0.001]}, natsl_hybrid: {64: []}}", r"'lrs' for 'natsl_hybrid'\[64\] must be"),
                         ("{64: [0.001], x: [0.1]}", "key it by width"), ("[-0.1]", "positive numbers")):
        with pytest.raises(NatslError, match=message):
            runs(lrs)
    spec.write_text(base + "lrs: [0.001]\n")
    assert load_spec(spec, tmp_path / "out").deadline_s == 100
    assert load_spec(spec, tmp_path / "out", deadline_s=7.5).deadline_s == 7.5
    with pytest.raises(NatslError, match="deadline must be a positive number"):
        load_spec(spec, tmp_path / "out", deadline_s=-1)
    widths = load_spec(ROOT / "recipes/recall/sweep_h200_widths.yaml", tmp_path / "out").runs
    assert {(r.width, r.system.startswith("natsl_hybrid_")) for r in widths} == {(64, False), (128, True), (256, False)}
    assert len(widths) == 22


def _tiny(**changes):
    import dataclasses

    import natsl

    base = natsl.load_recipe(ROOT / "recipes" / "tiny_hybrid.yaml").model
    torch.manual_seed(0)
    return natsl.build_model(dataclasses.replace(base, backend="chunked", block_size=16, **changes))


def test_router_options_are_off_by_default_and_training_only():
    ids = torch.randint(0, 1024, (2, 96), generator=torch.Generator().manual_seed(0))
    plain, noisy = _tiny(), _tiny(router_noise=5.0)
    plain.train()
    noisy.train()
    with torch.no_grad():
        plain(ids)
        noisy(ids)
    layers = list(plain.natsl_layers().values())
    assert all(layer.aux_loss is None for layer in layers)
    routes = [layer.last_keep for layer in layers]
    assert any(not torch.equal(a, b.last_keep) for a, b in zip(routes, noisy.natsl_layers().values()))
    noisy.eval()  # evaluation: the plain router, whatever the training options
    with torch.no_grad():
        noisy(ids)
    assert all(torch.equal(a, b.last_keep) for a, b in zip(routes, noisy.natsl_layers().values()))


def test_router_balance_pulls_the_keep_probability_to_its_target():
    model = _tiny(router_balance=1.0, router_target_keep=0.0)
    model.train()
    ids = torch.randint(0, 1024, (2, 96), generator=torch.Generator().manual_seed(1))
    model(ids)
    layer = model.natsl_layers()[1]
    keep_prob = layer.aux_loss.detach()
    assert keep_prob > 0.1  # the mean keep probability is about 0.5, the target 0
    layer.aux_loss.backward()
    grad = layer.router.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    with torch.no_grad():  # a step against the gradient moves the keep probability towards the target
        layer.router.weight -= 5.0 * grad
    model(ids)
    assert layer.aux_loss < 0.9 * keep_prob


def test_router_option_validation_and_old_checkpoints(tmp_path):
    import natsl
    from natsl.checkpoint import checkpoint_recipe

    with pytest.raises(NatslError, match="router_target_keep"):
        natsl.config.recipe_from_dict({"model": {"router_target_keep": 1.5}})
    with pytest.raises(NatslError, match="router_noise"):
        natsl.config.recipe_from_dict({"model": {"router_noise": -1}})
    recipe = natsl.load_recipe(ROOT / "recipes" / "tiny_hybrid.yaml").to_dict()
    for key in ("router_noise", "router_balance", "router_target_keep"):  # a checkpoint from before them
        del recipe["model"][key]
    loaded = checkpoint_recipe(tmp_path, {"recipe": recipe})
    assert (loaded.model.router_noise, loaded.model.router_balance) == (0.0, 0.0)


def test_sweep_compiles_with_cuda_graphs_on_cuda_unless_the_spec_says_compile(tmp_path):
    """No `compile:` key: compile + CUDA graphs for runs on CUDA (before the spec's `set:`, which may
    undo it), eager on the CPU; `compile: false` is kept as written."""
    from natsl.training.sweep import load_spec

    spec = ROOT / "recipes/recall/sweep_cpu.yaml"
    for run in load_spec(spec, tmp_path / "a", device="cuda").runs:
        assert run.compile and run.device == "cuda"
        at = run.overrides.index("train.cuda_graphs=true")
        assert at < run.overrides.index("train.log_every=2")  # the spec's set: items come after it
    assert not any(r.compile or "train.cuda_graphs=true" in r.overrides for r in load_spec(spec, tmp_path / "b").runs)
    data = yaml.safe_load(spec.read_text())
    data.update(device="cuda", compile=False,  # the recipes lie beside the spec: named as shipped recipes here
                systems={name: f"recall/{Path(path).stem}" for name, path in data["systems"].items()})
    written = tmp_path / "compile_off.yaml"
    written.write_text(yaml.safe_dump(data))
    written_runs = load_spec(written, tmp_path / "c").runs
    assert not any(r.compile or "train.cuda_graphs=true" in r.overrides for r in written_runs)
    assert {r.device for r in written_runs} == {"cuda"}


def test_sweep_mps_flag_starts_and_stops_the_daemon(tmp_path, monkeypatch):
    """--mps is off by default; on, a sweep of several CUDA workers runs `nvidia-cuda-mps-control -d` with
    its own pipe folder (given to the workers) and sends it `quit` at the end; here against a stand-in
    program that records its calls. With one worker, CPU runs or no program, no daemon is started."""
    import natsl.training.sweep as S

    seen = []
    monkeypatch.setattr(S, "load_spec", lambda *a, **k: "sweep")
    monkeypatch.setattr(S, "run_sweep", lambda sweep, progress, mps: seen.append(mps))
    assert S.main(["spec.yaml", "--out", str(tmp_path)]) == 0 and S.main(["spec.yaml", "--out", str(tmp_path), "--mps"]) == 0
    assert seen == [False, True]
    from typer.testing import CliRunner

    from natsl.cli.main import app

    for flags in ([], ["--mps"]):
        result = CliRunner().invoke(app, ["sweep", "spec.yaml", "--out", str(tmp_path), *flags])
        assert result.exit_code == 0, result.output
    assert seen == [False, True, False, True]  # `natsl sweep` passes --mps on the same way
    monkeypatch.undo()

    sweep = S.load_spec(ROOT / "recipes/recall/sweep_cpu.yaml", tmp_path / "out", device="cuda")
    calls = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / S.MPS_CONTROL
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; '
                    f'else read line; echo "$line" >> {calls}; fi\n')
    fake.chmod(0o755)
    monkeypatch.setattr(S, "MPS_DEFAULT_PIPE", tmp_path / "no-daemon-here")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    logged = []
    with S.mps_daemon(sweep, env, logged.append) as worker_env:
        pipe = Path(worker_env["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.is_dir() and Path(worker_env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert calls.read_text().splitlines() == [f"start {pipe}", "quit"]
    assert not pipe.exists()  # its temporary folder is removed afterwards
    one = S.Sweep(sweep.name, sweep.runs, 1, None, 30.0, tmp_path)
    cpu = S.Sweep(sweep.name, [dataclasses.replace(r, device="cpu") for r in sweep.runs], 2, None, 30.0, tmp_path)
    assert "one worker" in S.mps_skip_reason(one, env) and "CPU" in S.mps_skip_reason(cpu, env)
    assert "not on the PATH" in S.mps_skip_reason(sweep, {"PATH": "/nowhere"})
    with S.mps_daemon(sweep, {"PATH": "/nowhere"}, logged.append) as worker_env:
        assert "CUDA_MPS_PIPE_DIRECTORY" not in worker_env
    assert logged[-1].startswith("--mps: nvidia-cuda-mps-control is not on the PATH")


# A runner over fake workers (no training): `quick` writes a result and ends; `stubborn` ignores SIGTERM
# and leaves a child that ignores it too; `watchful` is a Python worker with the real watchdog, which says
# when its watchdog runs. None of them ends by itself within the tests' generous waits (sleep 3600): a
# worker that is gone was ended by the runner or its watchdog.
FAKE_WORKER = """#!/bin/sh
dir=$(dirname "$1")
case "$dir" in
  *quick) printf '{"status": "done", "recall_accuracy": 0.5}' > "$dir/result.json" ;;
  *stubborn*) trap '' TERM INT; sleep 3600 & echo $! > "$dir/child.pid"; wait; wait ;;
  *watchful) echo $$ > "$dir/child.pid"
             exec "$PYTHON" -c 'import sys, time, natsl.cli.sweep as W; W.watch(sys.argv[1])
open(sys.argv[2], "w").close()
time.sleep(3600)' "$1" "$dir/watching" ;;
esac
"""
# The runner reads its deadline from a clock that jumps past it once the test creates OUT/../deadline_passed:
# the deadline comes when the test says, never by how fast a loaded machine runs.
FAKE_RUNNER = """import sys, time
from pathlib import Path
import natsl.training.sweep as S
out, deadline, grace, worker = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
S.WORKER = ["/bin/sh", worker]
runs = [S.RunSpec(name, "fake", "none", 32, 1e-3, "t", "task:none", [], 1, 60.0, {}, False, "cpu",
                  str(out / "runs" / name)) for name in sys.argv[5:]]
passed = out.parent / "deadline_passed"
sweep = S.Sweep("fake", runs, len(runs), deadline or None, 0.0, out, min_train_s=0.0, grace_s=grace,
                clock=lambda: time.time() + (10**9 if passed.exists() else 0))
sys.exit(S.exit_code(S.run_sweep(sweep, progress=False)))
"""
WAIT_S = 300.0  # how long a test waits for what must happen: only a broken runner ever reaches it


def _fake_sweep(tmp_path, deadline, grace, runs=("quick", "stubborn1", "stubborn2")):
    import os

    (tmp_path / "worker.sh").write_text(FAKE_WORKER)
    (tmp_path / "runner.py").write_text(FAKE_RUNNER)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(out), str(deadline), str(grace),
                             str(tmp_path / "worker.sh"), *runs], cwd=ROOT, stdout=(tmp_path / "runner.log").open("w"),
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable,
                                 "PYTHONUNBUFFERED": "1"})
    return proc, out


def _wait_for(condition, seconds=WAIT_S):
    import time

    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:  # a zombie (killed, not yet reaped by whoever inherited it) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(out, names=("stubborn1", "stubborn2")):
    _wait_for(lambda: all((out / "runs" / n / "child.pid").is_file() and (out / "runs" / n / "child.pid").read_text()
                          for n in names))
    return [int((out / "runs" / n / "child.pid").read_text()) for n in names]


def _quick_done(out):
    _wait_for(lambda: (out / "summary.json").is_file() and '"done"' in (out / "summary.json").read_text())


def test_sweep_deadline_kills_workers_that_ignore_sigterm(tmp_path):
    """At the deadline the runner kills every worker's process group (SIGKILL after the grace: these ignore
    SIGTERM and their children sleep an hour), writes the summary with what finished, exit code 0."""
    proc, out = _fake_sweep(tmp_path, deadline=3600, grace=1)
    children = _children(out)
    _quick_done(out)
    assert proc.poll() is None and all(_alive(pid) for pid in children)  # nothing ends before the deadline
    (tmp_path / "deadline_passed").touch()
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "runner.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "deadline" and (out / "summary.png").is_file()
    runs = {r["id"]: r for r in summary["runs"]}
    assert runs["quick"]["status"] == "done" and "killed" not in runs["quick"]
    assert runs["stubborn1"]["killed"] == runs["stubborn2"]["killed"] == "deadline"
    _wait_for(lambda: not any(_alive(pid) for pid in children))  # the workers' children went with them


@pytest.mark.parametrize("signals, grace, code", [(["SIGTERM"], 1.0, 143), (["SIGINT", "SIGINT"], 3600.0, 130)])
def test_sweep_runner_stops_on_a_signal(tmp_path, signals, grace, code):
    """SIGTERM / SIGINT: the workers are killed, the summary of what finished written, exit 128 + signal; a
    second signal exits at once (here during an hour's grace, sent once the runner has said it is stopping),
    the workers killed outright. The summary is rewritten as each run ends (quick's result is in it before
    any signal)."""
    import signal

    proc, out = _fake_sweep(tmp_path, deadline=0, grace=grace)
    children = _children(out)
    _quick_done(out)
    log = tmp_path / "runner.log"
    for name in signals:
        proc.send_signal(getattr(signal, name))
        _wait_for(lambda: f"{name}: stopping 2 workers" in log.read_text() or proc.poll() is not None)
    assert proc.wait(timeout=WAIT_S) == code, log.read_text()  # far less than the grace of the second case
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["id"]: r for r in summary["runs"]}
    assert runs["quick"]["status"] == "done"
    if len(signals) == 1:
        assert summary["stopped"] == "SIGTERM" and runs["stubborn1"]["killed"] == "SIGTERM"
    _wait_for(lambda: not any(_alive(pid) for pid in children))


def test_sweep_worker_ends_when_its_runner_is_killed(tmp_path):
    """kill -9 of the runner: the summary written when the quick run ended stands, and the worker's watchdog
    ends the orphaned worker (which would otherwise sleep an hour)."""
    import signal

    proc, out = _fake_sweep(tmp_path, deadline=0, grace=1, runs=("quick", "watchful"))
    worker, = _children(out, ("watchful",))
    _quick_done(out)
    _wait_for(lambda: (out / "runs" / "watchful" / "watching").is_file())  # its watchdog runs
    assert _alive(worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=WAIT_S)
    _wait_for(lambda: not _alive(worker))
    runs = {r["id"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["quick"]["status"] == "done" and runs["watchful"]["status"] == "not run"


def test_recall_plot_legend_sits_beside_the_bars(tmp_path, monkeypatch):
    """eval-recall's PNG: the legend of layers and groups lies outside the bars' axes, so that no bar (here
    every kept fraction is 1, bars to the top) is hidden behind it; a long legend wraps into columns."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    import natsl.eval.common as common
    from natsl.eval.recall import plot_recall

    figures = []
    saved = common.save_figure
    monkeypatch.setattr(common, "save_figure", lambda fig, path: (figures.append(fig), saved(fig, path))[1])
    for layers, groups in ((1, 2), (3, 8)):
        keep = {str(i): {"keep_fraction": 1.0, "group_keep_fraction": [1.0] * groups} for i in range(layers)}
        points = [{"seq_len": n, "count": c, "accuracy": 0.5, "sample_accuracy": 0.25, "keep": keep}
                  for n in (64, 128) for c in (4, 8)]
        path = plot_recall({"task": "mqar", "count_name": "pairs", "points": points}, tmp_path / f"{groups}.png", "t")
        assert path.stat().st_size > 1000
        fig = figures[-1]
        canvas = FigureCanvasAgg(fig)  # the saved figure is closed: draw it again to measure it
        canvas.draw()
        renderer = canvas.get_renderer()
        bars = next(ax for ax in fig.axes if ax.get_title() == "routing on the same inputs")
        legend = bars.get_legend()
        assert len(legend.get_texts()) == layers * groups
        assert not legend.get_window_extent(renderer).overlaps(bars.get_window_extent(renderer))
