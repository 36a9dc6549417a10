"""Data parallelism for real: two CPU processes under torchrun (gloo) run `natsl train` with DDP and
with FSDP2; the ranks see different samples, end with identical weights, and match a one-process run
of the same steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ARGS = [str(ROOT / "recipes" / "tiny_hybrid.yaml"), "--set", "train.seq_len=128", "train.micro_batch_size=2",
        "train.tokens_per_step=512", "train.save_every=3", "--max-steps", "3", "--device", "cpu",
        "--backend", "chunked", "--no-progress"]


@pytest.fixture(scope="session")
def cache_env(natsl_cache_dir):
    return {"NATSL_CACHE_DIR": natsl_cache_dir, "OMP_NUM_THREADS": "1"}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def val_losses(out: Path) -> list[float]:
    return [r["val_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]


def cli(args: list, env: dict):
    from typer.testing import CliRunner

    from natsl.cli.main import app

    return CliRunner().invoke(app, ["train", *args], env=env)


def one_then_two_ranks(tmp_path, cache_env, *extra):
    """The same 3 steps in one process (OUT one/) and in two under torchrun (OUT two/); the one-process
    run goes first (it also builds the embedded-corpus cache the two ranks then share). Returns the
    two-rank run's stdout and each rank's debug record."""
    env = {**os.environ, **cache_env}
    env.pop("NATSL_FAULT", None)
    single = cli([*ARGS, *extra, "--out", str(tmp_path / "one")], cache_env)
    assert single.exit_code == 0, single.stderr
    debug = tmp_path / "ranks"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "natsl.cli.main", "train", *ARGS, *extra, "--out", str(tmp_path / "two")],
        capture_output=True, text=True, env={**env, "NATSL_DEBUG_DIR": str(debug)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [json.loads((debug / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_see_different_data_and_end_identical(tmp_path, cache_env):
    stdout, ranks = one_then_two_ranks(tmp_path, cache_env)
    assert "(2 x 128 x 1 accum x 2 ranks, ddp)" in stdout
    assert stdout.count("done: step 3/") == 1  # rank 0 alone reports
    assert [r["world_size"] for r in ranks] == [2, 2]
    a, b = set(ranks[0]["samples"]), set(ranks[1]["samples"])
    assert len(a) == len(b) == 6 and not a & b and a | b == set(range(12))
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    # the same global batches as one process with 2 accumulation steps: the same losses up to rounding
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert (tmp_path / "two" / "checkpoints" / "step_000003" / "model.safetensors").is_file()


def test_fsdp_two_ranks_match_one_process_and_write_a_whole_checkpoint(tmp_path, cache_env):
    """train.parallel=fsdp (FSDP2, fully_shard per block): the ranks read disjoint data, the gathered
    weights agree across ranks and with a one-process run, rank 0 writes full tensors in the usual
    format, and a one-process run resumes from that checkpoint."""
    from safetensors.torch import load_file

    # 5 validation windows of 128 tokens: rank 0 holds 3 (two micro-batches), rank 1 two (one); with
    # FSDP both must run two forwards (a forward gathers weights), else the ranks wait on each other.
    stdout, ranks = one_then_two_ranks(tmp_path, cache_env, "train.parallel=fsdp", "train.eval_tokens=640")
    assert "(2 x 128 x 1 accum x 2 ranks, fsdp)" in stdout
    assert not set(ranks[0]["samples"]) & set(ranks[1]["samples"])
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    assert val_losses(tmp_path / "two") == pytest.approx(val_losses(tmp_path / "one"), rel=1e-4)
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step_000003" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "checkpoints" / "step_000003" / "model.safetensors"))
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        assert two[name].shape == tensor.shape  # whole tensors, not shards
        assert torch.allclose(two[name], tensor, rtol=1e-3, atol=1e-5), name
    resumed = cli([*ARGS[:-7], "--max-steps", "4", "--device", "cpu", "--backend", "chunked", "--no-progress",
                   "--resume", "auto", "--out", str(tmp_path / "two")], cache_env)
    assert resumed.exit_code == 0, resumed.stderr
    assert "done: step 4/" in resumed.stdout
