"""`natsl warmup`: a prefill and decode steps at each length, and what they added to the compile caches."""

from pathlib import Path

import torch
from typer.testing import CliRunner

from natsl.cli.main import app

from cli_checks import assert_one_line_error

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_hybrid.yaml"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_warmup_runs_each_length_on_the_cpu_and_names_the_caches():
    result = run("warmup", RECIPE, "--lengths", "64,96", "--decode-tokens", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [64, 96] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert "TRITON_CACHE_DIR" in result.stdout and "TORCHINDUCTOR_CACHE_DIR" in result.stdout
    assert "nothing is compiled" in result.stdout  # the CPU's chunked backend says it just ran


def test_warmup_refuses_bad_lengths_in_one_line():
    assert_one_line_error(run("warmup", RECIPE, "--lengths", "64,abc", "--device", "cpu"), "is not a length")
    assert_one_line_error(run("warmup", RECIPE, "--lengths", "64,100000000", "--device", "cpu"), "max_seq_len")
    assert_one_line_error(run("warmup", RECIPE, "--lengths", "64", "--decode-tokens", "0", "--device", "cpu"),
                          "--decode-tokens must be at least 1")


def test_warm_up_counts_what_each_length_added_to_the_caches(tmp_path, monkeypatch):
    """Files that appear in the cache folders during a length's calls are that length's compiles."""
    import natsl
    from natsl.inference import warmup

    dirs = {"triton": tmp_path / "triton", "inductor": tmp_path / "inductor"}
    monkeypatch.setattr(warmup, "cache_dirs", lambda: dirs)
    real = warmup.first_call

    def compiling(model, ids, cache, steps, device):  # the first call at each length "compiles" a kernel
        dirs["triton"].mkdir(exist_ok=True)
        (dirs["triton"] / f"kernel{ids.shape[1]}.so").write_bytes(b"")
        return real(model, ids, cache, steps, device)

    monkeypatch.setattr(warmup, "first_call", compiling)
    torch.manual_seed(0)
    model = natsl.build_model(natsl.load_recipe(RECIPE)).eval()
    model.set_backend("chunked")
    records = warmup.warm_up(model, [32, 48], device=torch.device("cpu"), decode_steps=1)
    assert [(r["length"], r["new_triton_files"], r["new_inductor_files"]) for r in records] == [(32, 1, 0), (48, 1, 0)]
    assert all(r["first_prefill_s"] > 0 and r["warm_prefill_s"] > 0 and r["decode_s"] > 0 and r["ragged_prefill_s"] > 0
               for r in records)


def test_warm_up_at_max_seq_len_decodes_after_a_shorter_prompt(monkeypatch):
    """`--lengths` at the model's max_seq_len leaves no room after the prompt: the full-length prefill
    still runs, and the decode steps follow a prompt `decode_steps` shorter (warming their kernels)."""
    import natsl
    from natsl.inference import warmup

    calls = []
    real = warmup.first_call

    def recording(model, ids, cache, steps, device):
        calls.append((ids.shape[1], steps))
        return real(model, ids, cache, steps, device)

    monkeypatch.setattr(warmup, "first_call", recording)
    recipe = natsl.load_recipe(RECIPE)
    recipe.model.max_seq_len = 128
    torch.manual_seed(0)
    model = natsl.build_model(recipe).eval()
    model.set_backend("chunked")
    records = warmup.warm_up(model, [128], device=torch.device("cpu"), decode_steps=3)
    assert calls == [(128, 0), (125, 3)]
    assert records[0]["decode_s"] > 0 and records[0]["first_prefill_s"] > 0


def test_warmup_command_accepts_the_max_seq_len_and_refuses_decode_tokens_that_leave_no_prompt(tmp_path):
    import yaml

    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["model"]["max_seq_len"] = 96
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(recipe))
    result = run("warmup", short, "--lengths", "96", "--decode-tokens", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output + result.stderr
    assert_one_line_error(run("warmup", short, "--lengths", "64", "--decode-tokens", "96", "--device", "cpu"),
                          "leaves no prompt")
