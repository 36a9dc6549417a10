"""`natsl generate` and `natsl bench-latency` on a tiny checkpoint / recipe, through the real CLI."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.tokenizer import train_bpe

from cli_checks import assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
MAX_SEQ_LEN = 96

WORDS = "the a cat dog sat on mat ran far and then slept under warm sun while birds sang songs".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny NAtS-L Hybrid (random weights) with a BPE tokenizer, saved as a model folder."""
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=gen)) for _ in range(200)]
    tokenizer = train_bpe(texts, vocab_size=320)
    recipe = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml")
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(
        recipe.model, vocab_size=tokenizer.vocab_size, block_size=8, max_seq_len=MAX_SEQ_LEN))
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    return save_model_folder(tmp_path_factory.mktemp("ckpt") / "tiny", model, recipe, tokenizer)


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result


def generate(checkpoint, *args):
    result = run("generate", checkpoint, "--device", "cpu", "--backend", "chunked", *args)
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


def test_generate_streams_text_and_is_deterministic_with_a_seed(checkpoint):
    args = ("--prompt", "the cat sat on", "--max-new-tokens", "20", "--temperature", "0.8", "--top-k", "50",
            "--top-p", "0.95")
    first = generate(checkpoint, *args, "--seed", "7")
    assert first.strip() and first == generate(checkpoint, *args, "--seed", "7")
    others = {generate(checkpoint, *args, "--seed", str(s)) for s in (1, 2, 3)}
    assert len(others | {first}) > 1  # the seed matters


def test_generate_reports_time_to_first_token_and_decode_rate_in_one_line(checkpoint):
    result = run("generate", checkpoint, "--device", "cpu", "--backend", "chunked", "--prompt", "the cat",
                 "--max-new-tokens", "5", "--temperature", "0", "--ignore-eos")
    assert result.exit_code == 0, result.output + result.stderr
    (line,) = [x for x in result.stderr.splitlines() if "time to first token" in x]
    first = float(re.search(r"time to first token ([0-9.]+) s", line).group(1))
    prefill = float(re.search(r"prefilled in ([0-9.]+) s", line).group(1))
    assert first >= prefill - 0.005  # prefill is printed to 0.01 s
    assert re.search(r"\(([0-9.]+) tok/s decode\)", line)


def test_warmup_takes_a_checkpoint_folder(checkpoint):
    result = run("warmup", checkpoint, "--lengths", "16,40", "--decode-tokens", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout.startswith("warming up tiny on cpu")
    assert [line.split()[0] for line in result.stdout.splitlines()[3:5]] == ["16", "40"]
    # at the max_seq_len the decode steps follow a shorter prompt (tests/test_warmup.py); beyond it: refused
    assert_one_line_error(run("warmup", checkpoint, "--lengths", str(MAX_SEQ_LEN + 1), "--device", "cpu"),
                          "max_seq_len")


def test_generate_stops_at_a_stop_string(checkpoint):
    greedy = ("--prompt", "a dog ran", "--max-new-tokens", "30", "--temperature", "0", "--ignore-eos")
    text = generate(checkpoint, *greedy).rstrip("\n")
    assert len(text) > 10
    stop = text[6:9]
    stopped = generate(checkpoint, *greedy, "--stop", stop).rstrip("\n")
    assert stopped == text[:text.find(stop)]


def test_jsonl_prompts_decode_in_a_batch_as_they_would_alone(checkpoint, tmp_path):
    prompts = ["the cat", "a dog ran far and then slept under the warm sun", "birds"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt" if i % 2 else "text": p}) for i, p in enumerate(prompts)) + "\n")
    out = tmp_path / "out.jsonl"
    common = ("--max-new-tokens", "12", "--temperature", "0", "--ignore-eos")
    generate(checkpoint, "--prompt-file", path, "--batch-size", "2", "--output", out, *common)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts and all(r["new_tokens"] == 12 for r in rows)
    # each row carries its batch's time to first token and decode rate (batches of 2, then 1)
    assert rows[0]["time_to_first_token_s"] == rows[1]["time_to_first_token_s"] > 0
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)
    for row in rows:
        alone = generate(checkpoint, "--prompt", row["prompt"], *common).rstrip("\n")
        assert row["completion"] == alone


def test_generate_rejects_bad_input_in_one_line(checkpoint, tmp_path):
    assert_one_line_error(run("generate", tmp_path / "nowhere", "--prompt", "hi", "--device", "cpu"), "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert_one_line_error(run("generate", checkpoint, "--prompt-file", empty, "--device", "cpu"), "is empty")
    long = tmp_path / "long.txt"
    long.write_text(" ".join(WORDS * 10))
    assert_one_line_error(run("generate", checkpoint, "--prompt-file", long, "--device", "cpu"),
                          f"at most {MAX_SEQ_LEN}", "max_seq_len")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    assert_one_line_error(run("generate", checkpoint, "--prompt-file", bad, "--device", "cpu"), "bad.jsonl:2")
    assert_one_line_error(run("generate", checkpoint, "--device", "cpu"), "exactly one of")
    assert_one_line_error(run("generate", checkpoint, "--prompt", "x", "--top-p", "0", "--device", "cpu"), "--top-p")
    assert_one_line_error(run("generate", checkpoint, "--prompt", "x", "--temperature", "nan", "--device", "cpu"),
                          "--temperature")
    assert_one_line_error(run("generate", checkpoint, "--prompt", "x", "--output", tmp_path, "--device", "cpu"),
                          "is a folder")
    assert_one_line_error(run("generate", checkpoint, "--prompt", "x", "--output", empty / "out.jsonl",
                              "--device", "cpu"), "is a file, not a folder")


def test_console_script_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "generate", str(tmp_path / "missing"),
                           "--prompt", "hi", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1


def test_bench_latency_runs_on_the_cpu_and_writes_json_and_png(tmp_path):
    result = run("bench-latency", "--recipe", RECIPES / "tiny_hybrid.yaml", "--min-len", "64", "--max-len", "128",
                 "--device", "cpu", "--decode-tokens", "3", "--repeats", "1", "--out", tmp_path, "--no-progress")
    assert result.exit_code == 0, result.output + result.stderr
    data = json.loads((tmp_path / "latency.json").read_text())
    (model,) = data["models"]
    assert model["name"] == "tiny_hybrid" and model["forced_keep_fraction"] == 0.5
    assert [p["context"] for p in model["points"]] == [64, 128]
    for point in model["points"]:
        assert "error" not in point, point
        assert point["prefill_s"] > 0 and point["decode_ms"] > 0 and point["cold_prefill_s"] > 0
        assert point["prefill_floor_s"] > 0 and point["decode_floor_ms"] > 0
        assert 0 < point["cache_bytes"] <= point["cache_allocated_bytes"]
    assert data["rates"]["matmul_flops_per_s"] > 0 and data["rates"]["copy_bytes_per_s"] > 0
    assert data["provenance"]["natsl"] == natsl.__version__ and data["provenance"]["torch"] == torch.__version__
    if (ROOT / ".git").exists():  # a source checkout names its commit
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", data["provenance"]["git"])
    from natsl.provenance import source_hash

    assert data["provenance"]["source_sha256"] == source_hash()
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert model["warmup_s"] > 0
    assert "tiny_hybrid" in result.stdout and "decode ms" in result.stdout and "cold s" in result.stdout


def test_bench_latency_never_times_the_first_call_at_a_length(monkeypatch):
    """The first prefill at each length is timed apart (cold_prefill_s); prefill_s is the median of the
    `repeats` calls after it, so --repeats 1 is one warm call."""
    from natsl.inference import bench

    spec = bench.BenchModel("recipe", str(RECIPES / "tiny_hybrid.yaml"), 0.5)
    model, _, _ = bench.load_model(spec, torch.device("cpu"), torch.float32, "chunked", 0)
    calls = []
    forward = type(model).forward_cached

    def slow_first(self, ids, cache, **kwargs):  # the first prefill of each length "compiles" for 0.2 s
        if ids.shape[1] > 1:
            if ids.shape[1] not in calls:
                __import__("time").sleep(0.2)
            calls.append(ids.shape[1])
        return forward(self, ids, cache, **kwargs)

    monkeypatch.setattr(type(model), "forward_cached", slow_first)
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: (model, "tiny", 1))
    result = bench.run_benchmark([spec], [64, 96], device=torch.device("cpu"), dtype=torch.float32,
                                 backend="chunked", decode_tokens=2, repeats=1, progress=False)
    assert [c for c in calls if c in (64, 96)] == [64, 64, 96, 96]  # one cold + one warm call per length
    for point in result["models"][0]["points"]:
        assert point["cold_prefill_s"] >= 0.2 > point["prefill_s"], point
    assert "cold s" in bench.format_table(result)


def test_bench_latency_time_budget_gives_each_model_a_first_point(monkeypatch):
    """A model whose warm-up (loading, compiling) ate its share of the budget still gets its first
    point while the whole budget lasts; once the whole budget is spent, points are skipped."""
    from natsl.inference import bench

    clock = [0.0]
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock[0])
    load = bench.load_model

    def slow_load(*args, **kwargs):  # each model's warm-up takes 60 of the 100 budgeted seconds
        clock[0] += 60.0
        return load(*args, **kwargs)

    monkeypatch.setattr(bench, "load_model", slow_load)
    spec = bench.BenchModel("recipe", str(RECIPES / "tiny_hybrid.yaml"), 0.5)
    result = bench.run_benchmark([spec, spec], [64, 128], device=torch.device("cpu"), dtype=torch.float32,
                                 backend="chunked", decode_tokens=2, repeats=1, progress=False, time_budget_s=100.0)
    first, second = ([p.get("error") for p in entry["points"]] for entry in result["models"])
    assert first == [None, "skipped: time budget spent"]  # past its share (50 s) at 60 s: one point
    assert second == ["skipped: time budget spent"] * 2  # 120 s: the whole budget is spent


def test_bench_latency_rejects_a_length_beyond_the_model(tmp_path):
    assert_one_line_error(run("bench-latency", "--recipe", RECIPES / "tiny_hybrid.yaml", "--max-len", "1000000",
                              "--device", "cpu", "--out", tmp_path), "max_seq_len")
    assert_one_line_error(run("bench-latency", "--recipe", RECIPES / "tiny_hybrid.yaml", "--min-len", "64",
                              "--max-len", "128", "--time-budget", "-1", "--device", "cpu", "--out", tmp_path), "--time-budget")


CPU_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68705321689 bytes. Error code 12 "
           "(Cannot allocate memory)")


def test_running_out_of_memory_is_one_line(checkpoint, monkeypatch):
    """Out of memory anywhere in a command (here: while picking the device) is a one-line error, exit 2;
    any other RuntimeError stays a bug with its traceback."""
    import natsl.runtime

    def out_of_memory(name):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(natsl.runtime, "pick_device", out_of_memory)
    assert_one_line_error(run("generate", checkpoint, "--prompt", "hi"), "out of memory", "lower the length")
    monkeypatch.setattr(natsl.runtime, "pick_device", lambda name: (_ for _ in ()).throw(RuntimeError("a bug")))
    result = run("generate", checkpoint, "--prompt", "hi")
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)


def test_a_prompt_prefilled_in_pieces_continues_as_in_one_call(checkpoint, monkeypatch):
    """On the CPU long prompts are prefilled CPU_PREFILL_CHUNK tokens at a time (memory); greedy text
    is the same as from one prefill call."""
    import natsl.inference.generate as gen

    args = ("--prompt", " ".join(WORDS), "--max-new-tokens", "12", "--temperature", "0", "--ignore-eos")
    whole = generate(checkpoint, *args)
    monkeypatch.setattr(gen, "CPU_PREFILL_CHUNK", 7)
    assert generate(checkpoint, *args) == whole


def test_bench_latency_below_1024_needs_no_min_len(tmp_path):
    """--min-len defaults to 1024, or to --max-len when that is shorter (a CPU smoke run)."""
    result = run("bench-latency", "--recipe", RECIPES / "tiny_hybrid.yaml", "--max-len", "64", "--device", "cpu",
                 "--decode-tokens", "2", "--repeats", "1", "--out", tmp_path, "--no-progress")
    assert result.exit_code == 0, result.output + result.stderr
    (model,) = json.loads((tmp_path / "latency.json").read_text())["models"]
    assert [p["context"] for p in model["points"]] == [64]


@pytest.fixture(scope="module")
def nan_checkpoint(checkpoint, tmp_path_factory) -> Path:
    model, tokenizer = natsl.load_checkpoint(checkpoint)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return save_model_folder(tmp_path_factory.mktemp("nan") / "nan", model, model.recipe, tokenizer)


def test_generate_edges_of_seed_temperature_and_nan_weights(checkpoint, nan_checkpoint):
    for seed in (-1, 2**63, 2**70):
        assert_one_line_error(run("generate", checkpoint, "--prompt", "the cat", "--seed", seed, "--device", "cpu"),
                              "--seed must be an integer from 0 to 2**63-1")
    args = ("--prompt", "the cat sat on", "--max-new-tokens", "8", "--ignore-eos")
    # Below the greedy floor a temperature is greedy, not a division that overflows into NaN.
    assert generate(checkpoint, *args, "--temperature", "1e-45") == generate(checkpoint, *args, "--temperature", "0")
    for temperature in ("0", "0.8"):  # greedy would "choose" token 0; sampling would fail on a NaN distribution
        result = run("generate", nan_checkpoint, *args, "--temperature", temperature, "--device", "cpu")
        assert_one_line_error(result, str(nan_checkpoint), "non-finite logits")


def test_generate_warns_when_the_model_produces_nothing(checkpoint, monkeypatch):
    import natsl.inference.generate as gen

    _, tokenizer = natsl.load_checkpoint(checkpoint)
    monkeypatch.setattr(gen, "sample", lambda logits, config, generator: torch.full((logits.shape[0],), tokenizer.eos_id))
    result = run("generate", checkpoint, "--prompt", "the cat", "--device", "cpu", "--temperature", "0")
    assert result.exit_code == 0, result.output
    assert "warning: the prompt: the model produced no tokens" in result.stderr


def test_generate_output_keeps_the_umask(checkpoint, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        generate(checkpoint, "--prompt", "the cat", "--max-new-tokens", "2", "--output", tmp_path / "out.jsonl")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out.jsonl").st_mode) == 0o644


def test_info_seed_backend_and_length(tmp_path):
    recipe = RECIPES / "tiny_hybrid.yaml"
    assert "chunked" in run("info", "--help").stdout
    assert_one_line_error(run("info", recipe, "--seed", 2**70), "--seed must be an integer from 0 to 2**63-1")
    assert_one_line_error(run("info", recipe, "--seq-len", 10**9), "--seq-len 1000000000 is beyond the max_seq_len")
    assert_one_line_error(run("info", recipe, "--backend", "nope"), "unknown backend")
    result = run("info", recipe, "--seq-len", "64", "--backend", "chunked")
    assert result.exit_code == 0, result.output
    assert "NAtS-L routing" in result.stdout


def test_bench_latency_seed_and_decode_floor_in_sight(tmp_path, monkeypatch):
    assert_one_line_error(run("bench-latency", "--recipe", RECIPES / "tiny_hybrid.yaml", "--max-len", "64",
                              "--seed", 2**70, "--device", "cpu", "--out", tmp_path), "--seed must be an integer")
    from natsl.inference import bench

    figures = []
    monkeypatch.setattr(bench, "save_figure", lambda fig, path, **kw: figures.append(fig))
    points = [{"context": c, "prefill_s": 0.5, "prefill_floor_s": 0.001, "decode_ms": 20.0, "decode_floor_ms": 0.01}
              for c in (1024, 2048)]
    bench.plot({"models": [{"name": "m", "points": points}], "device": "cpu", "dtype": "fp32", "batch": 1},
               tmp_path / "l.png")
    (fig,) = figures
    decode_axis = fig.axes[1]
    floor = decode_axis.get_lines()[1].get_ydata()
    bottom, top = decode_axis.get_ylim()
    # On a linear axis from 0 the floor (2000x below the step) would lie on the x-axis.
    assert decode_axis.get_yscale() == "log" and bottom < min(floor) and max(floor) < top
    assert (min(floor) / bottom) > 1.01
