"""The evaluation stage of `natsl miniature`: natsl's own evaluation commands on the trained systems, run as
resumable subprocesses, several at once (28M-parameter models leave a GPU mostly idle).

`eval_jobs` turns the training run folders (name -> folder; every command takes a run folder and reads its
newest step) into the jobs below, each a `python -m natsl.cli.main ...` argv with its own output folder
under OUT and the JSON file whose presence (complete: see EvalJob.done) means it is done:

| job                 | command                                                          | output                   |
|---------------------|------------------------------------------------------------------|--------------------------|
| ppl                 | eval-ppl of every checkpoint, validation split, 16384-token windows (8x the 2048 of training: Fig. 3) | OUT/ppl |
| ruler_NAME          | eval-ruler, 2k-16k, all 8 NIAH tasks (Table 2), per ladder system and seed | OUT/ruler_NAME |
| routing_NAME        | inspect-routing on each held-out source and a synthetic one (Figs. 5/6), per NAtS-L checkpoint | OUT/routing_NAME |
| compare             | compare at matched KV bytes: NAtS-L (router, forced budgets) vs Transformer presses and GDN+SWA | OUT/compare |
| latency             | bench-latency of the trained natsl_hybrid, transformer, gdn_hybrid, 2K-32K; alone, first | OUT/latency |
| lm_eval_NAME        | eval-lm on the local tasks of natsl.miniature.lm_task (only where lm_eval imports) | OUT/lm_eval_NAME |

`run_jobs` runs the pending ones (a job whose JSON is there is done and skipped: a second call resumes),
at most `max_parallel` at once, each in its own process group with its output in OUT/logs/NAME.log, and
keeps OUT/eval_status.json (written atomically) up to date: {"jobs": {name: {"status", "argv", "out",
"log", "seconds", "systems"}}, "quick": bool, "updated": ...}. Near the deadline it starts nothing more; at it, it ends
the running jobs (SIGTERM to their process groups, SIGKILL after a grace).
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from natsl.errors import NatslError
from natsl.files import read_json
from natsl.miniature.ladder import ABLATIONS, is_known, is_routed, natsl_command, ordered, split_seed

COMPARED = ("natsl_hybrid", "natsl")  # NAtS-L at matched KV bytes against ...
BASELINES = ("transformer", "gdn_swa")  # ... the Transformer's eviction presses and the sliding window
TIMED = ("natsl_hybrid", "transformer", "gdn_hybrid")  # bench-latency, trained routers
NEEDLE_PAIR = ("natsl_hybrid", "gdn_hybrid")  # RULER's claim compares these two

PPL_MAX_LEN = 16384  # 8x the 2048-token training length: the paper's Fig. 3 extrapolation
# RULER: the longest expected answer is four 7-digit numbers (niah_multivalue / multiquery: about 40 characters
# with their separators) or one 36-character UUID; 64 new tokens hold either even at one character a token, with
# room for the words a small model writes before it. 8 tasks x 4 lengths x 5 samples = 160 prompts, about 1-2
# minutes for a 28M model on an H100 (a prefill of <= 16K tokens plus <= 64 cached decode steps each).
RULER_LENGTHS = "2048,4096,8192,16384"
RULER_SAMPLES = 5
RULER_NEW_TOKENS = 64
ROUTING_SEQ_LEN = 2048
# A held-out source smaller than this many bytes per routed token cannot give one full window (a token of a
# 32K BPE is 3-5 bytes of text; JSON escapes add more): inspect-routing would refuse the whole job for it.
ROUTING_MIN_BYTES_PER_TOKEN = 8
BUDGETS = "0.125,0.25,0.5,1"
PRESSES = "snapkv,pyramidkv,adakv"
SYNTHETIC_DOCS = 24
SYNTHETIC_PAIRS = 400


@dataclass
class EvalJob:
    """One evaluation command.

    Attributes:
        name: the job's name (its log is OUT/logs/NAME.log).
        argv: the subprocess command.
        out: its output folder.
        done_file: the JSON file whose presence means it is done.
        root: the evaluation folder (OUT), where logs/ and eval_status.json go.
        systems: the checkpoint names it evaluates, in the order of the command.
        done_key: a key the JSON must hold to count as done (compare and bench-latency write theirs as
            they go, and add "finished" at the end); None: its presence is enough.
        skipped: why the job is not run here (its argv is the command to run elsewhere); None: it runs.
        note: what the job leaves out, said in the status (e.g. sources too small to route).
        quick: whether it runs eval_jobs' quick (smoke) settings; eval_status.json says so for the report.
        exclusive: it runs alone, after every other job (a timing: jobs beside it on the GPU and the CPU would
            be in its figures).
        stamp: what it evaluates, {system: the checkpoint step its folder resolves to, "quick": bool}: a job
            done on other checkpoints (training went on since) or in the other mode is run again.
    """

    name: str
    argv: list[str]
    out: Path
    done_file: Path
    root: Path
    systems: list[str] = field(default_factory=list)
    done_key: str | None = None
    skipped: str | None = None
    note: str | None = None
    quick: bool = False
    exclusive: bool = False
    stamp: dict = field(default_factory=dict)

    def done(self) -> bool:
        """Whether the job's JSON is there (and complete, for a job with a done_key)."""
        if not self.done_file.is_file():
            return False
        if self.done_key is None:
            return True
        try:
            data = read_json(self.done_file, "run the job again")
        except (OSError, NatslError):  # unreadable, too large, not JSON, nested too deeply: not done
            return False
        return isinstance(data, dict) and data.get(self.done_key) is not None and not data.get("interrupted")


def shown(argv: list[str]) -> str:
    """A job's command as a person types it (`natsl eval-lm ...` rather than this host's interpreter)."""
    import shlex

    if argv[1:3] == ["-m", "natsl.cli.main"]:
        return "natsl " + shlex.join(argv[3:])
    return shlex.join(argv)


def lm_eval_missing() -> str | None:
    """Why lm-eval jobs cannot run in this Python (None: they can)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        return f"lm-evaluation-harness is not importable here ({err}); run the command on a host with `natsl[lm-eval]`"
    return None


def write_synthetic(path, *, seed: int = 0, docs: int = SYNTHETIC_DOCS, pairs: int = SYNTHETIC_PAIRS) -> Path:
    """The synthetic routing source, written once (kept when it exists): MQAR-like associative-recall text.

    Each document lists `pairs` key-value pairs ("amber-falcon: 4821;", keys from natsl.eval.haystack's
    adjective-noun words, values random 4-digit numbers), then asks for a random half of the keys again
    ("amber-falcon? 4821."), so that a model must look back to the pair to continue; unlike the held-out
    code and prose, nothing in it is predictable from nearby text. About 2,500 tokens a document for a
    32K BPE, seeded.

    Args:
        path: the .jsonl file to write ({"text": ...} per line).
        seed: the seed of the draws.
        docs: documents.
        pairs: key-value pairs per document.
    Returns:
        `path`.
    """
    from natsl.atomic import write_jsonl
    from natsl.eval.haystack import KEY_WORDS

    path = Path(path)
    if path.is_file():
        return path
    rng = random.Random(f"natsl-mini-synthetic/{seed}")
    rows = []
    for _ in range(docs):
        keys = rng.sample(KEY_WORDS, min(pairs, len(KEY_WORDS)))
        values = {k: rng.randint(1000, 9999) for k in keys}
        listed = " ".join(f"{k}: {values[k]};" for k in keys)
        asked = " ".join(f"{k}? {values[k]}." for k in rng.sample(keys, len(keys) // 2))
        rows.append({"text": f"Remember these pairs. {listed}\nNow recall them. {asked}"})
    return write_jsonl(path, rows)


def routing_sources(corpus: Path, synthetic: Path, seq_len: int) -> tuple[list[Path], list[str]]:
    """(the .jsonl files to route: the held-out sources that give a window of seq_len tokens, then the
    synthetic one; the names of the sources left out as too small).

    A file of at least ROUTING_MIN_BYTES_PER_TOKEN bytes a token surely gives one; a smaller one is tokenized
    with the corpus's tokenizer and counted as inspect-routing joins it (each document, then an EOS), since
    a bytes rule alone left out the held-out prose of a real corpus (2 documents, 5,276 tokens, 14.6 KB).
    """
    from natsl.data import TokenData
    from natsl.eval.data import read_text_documents

    tokenizer = None
    sources, small = [], []
    for path in sorted((Path(corpus) / "validation_texts").glob("*.jsonl")):
        if path.stat().st_size < seq_len * ROUTING_MIN_BYTES_PER_TOKEN:
            tokenizer = tokenizer or TokenData(corpus).tokenizer()
            docs = read_text_documents(path)
            if sum(len(ids) + 1 for ids in tokenizer.encode_batch(docs)) < seq_len:
                small.append(path.name)
                continue
        sources.append(path)
    return sources + [Path(synthetic)], small


def eval_jobs(checkpoints: dict, corpus, out, *, device: str, quick: bool = False) -> list[EvalJob]:
    """The evaluation jobs of the miniature (see the module doc); writes OUT/synthetic.jsonl, OUT/checkpoints.json
    (name -> run folder, for the report) and, where lm_eval imports or not, the local lm-eval task folder OUT/lm_tasks.

    Args:
        checkpoints: name -> training run folder (or checkpoint folder): ladder systems, their seeds
            (SYSTEM_sN) and ablations, any may be missing (a job whose checkpoints are all missing is left out;
            other names are ignored).
        corpus: the `natsl tokenize` folder (its validation split and validation_texts/).
        out: the evaluation folder.
        device: --device of every command (cpu, cuda, cuda:N).
        quick: tiny settings (a smoke test of the stage: short windows, one sample, few points).
    Returns:
        The jobs, in the order they are best started: long single jobs first, then the short routing jobs and
        RULER (the claim's pair first), so that a deadline leaves out what the claims need least;
        bench-latency runs first and alone (exclusive): its timings want a quiet GPU, and it takes seconds, so a
        deadline at the end of the stage never leaves it out.
    """
    from natsl.atomic import write_json
    from natsl.miniature.lm_task import build_lm_tasks

    corpus, out = Path(corpus), Path(out)
    have = {name: Path(checkpoints[name]) for name in ordered(checkpoints)
            if is_known(name) and checkpoints.get(name) is not None}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "checkpoints.json", {name: str(path) for name, path in have.items()})
    dev = ["--device", device]
    jobs: list[EvalJob] = []

    steps = {name: _step_of(path) for name, path in have.items()}

    def job(name, argv, done_name, systems, **kw):
        folder = out / name
        stamp = {**{n: steps[n] for n in systems}, "quick": quick}
        jobs.append(EvalJob(name, argv, folder, folder / done_name, out, list(systems), quick=quick, stamp=stamp,
                            **kw))

    names = list(have)
    if names:
        max_len, windows = (512, 2) if quick else (PPL_MAX_LEN, 8)
        job("ppl", natsl_command("eval-ppl", *[have[n] for n in names], "--data", corpus, "--split", "validation",
                                 "--max-len", max_len, "--windows", windows, "--concat", "--no-progress",
                                 "--out", out / "ppl", *dev), "ppl.json", names)
    compared = [n for n in COMPARED if n in have]
    baselines = [n for n in BASELINES if n in have]
    if compared and baselines:
        systems = compared + baselines
        if quick:
            settings = ["--budgets", "0.25,1", "--methods", "snapkv", "--max-len", 256, "--windows", 1,
                        "--context", 256, "--decode-tokens", 4, "--repeats", 1]
        else:
            settings = ["--budgets", BUDGETS, "--methods", PRESSES, "--max-len", 2048, "--windows", 4,
                        "--context", "2048,16384", "--decode-tokens", 16, "--repeats", 3]
        job("compare", natsl_command("compare", *[have[n] for n in systems], "--no-recall", "--data", corpus,
                                     *settings, "--no-progress", "--out", out / "compare", *dev),
            "compare.json", systems, done_key="finished")
    timed = [n for n in TIMED if n in have]
    if timed:
        lengths = ["--min-len", 128, "--max-len", 256, "--repeats", 1, "--decode-tokens", 4] if quick else \
            ["--min-len", 2048, "--max-len", 32768, "--repeats", 2, "--decode-tokens", 16]
        job("latency", natsl_command("bench-latency", *[x for n in timed for x in ("--checkpoint", have[n])],
                                     *lengths, "--no-progress", "--out", out / "latency", *dev),
            "latency.json", timed, done_key="finished", exclusive=True)
    routed = [n for n in have if is_routed(n)]
    if routed:
        seq_len = 256 if quick else ROUTING_SEQ_LEN
        synthetic = write_synthetic(out / "synthetic.jsonl")
        sources, small = routing_sources(corpus, synthetic, seq_len)
        note = f"left out as smaller than one {seq_len}-token window: {', '.join(small)}" if small else None
        if len(sources) == 1:  # the synthetic source alone
            note = (f"{str(corpus)!r} has no held-out source of a {seq_len}-token window (validation_texts/, written by "
                    "natsl tokenize --val-texts): routed on the synthetic source alone")
        for name in routed:
            job(f"routing_{name}", natsl_command("inspect-routing", have[name], *sources, "--seq-len", seq_len,
                                                 *(["--samples", 2] if quick else []),
                                                 "--out", out / f"routing_{name}", *dev),
                "routing.json", [name], note=note)
    # the claim's pair first: a deadline that cuts the stage leaves the systems it does not compare
    for name in sorted((n for n in have if n not in ABLATIONS), key=lambda n: split_seed(n)[0] not in NEEDLE_PAIR):
        # quick: a tiny test vocabulary spells the longest prompt (niah_multiquery) in about 500 tokens
        lengths, samples, new = ("1024,2048", 1, 48) if quick else (RULER_LENGTHS, RULER_SAMPLES, RULER_NEW_TOKENS)
        job(f"ruler_{name}", natsl_command("eval-ruler", have[name], "--lengths", lengths, "--tasks", "all",
                                           "--samples", samples, "--max-new-tokens", new, "--no-progress",
                                           "--out", out / f"ruler_{name}", *dev), "ruler.json", [name])
    lm_systems = [n for n in have if n not in ABLATIONS]
    if lm_systems and not (corpus / "validation_texts").is_dir():
        why = (f"{str(corpus)!r} has no validation_texts/ to build lm-eval's local tasks from; tokenize the corpus "
               "with --val-texts (the corpus stage does) to measure them")
        for name in lm_systems:
            job(f"lm_eval_{name}", [], "lm_eval.json", [name], skipped=why)
    elif lm_systems:
        items, docs = (8, 2) if quick else (400, 25)
        tasks = build_lm_tasks(corpus / "validation_texts", out / "lm_tasks", items=items, docs_per_source=docs,
                               max_chars=2000 if quick else 16000)
        missing = lm_eval_missing()
        for name in lm_systems:
            job(f"lm_eval_{name}", natsl_command("eval-lm", have[name], "--tasks", ",".join(tasks["tasks"]),
                                                 "--include-path", tasks["include_path"], "--batch-size", 8,
                                                 *(["--limit", 4] if quick else []),
                                                 "--out", out / f"lm_eval_{name}", *dev),
                "lm_eval.json", [name], skipped=missing)
    return jobs


def _step_of(folder: Path) -> str:
    """The checkpoint a run folder resolves to now (its newest complete step), as the evaluation commands read it."""
    from natsl.checkpoint import resolve_checkpoint_folder

    try:
        return str(resolve_checkpoint_folder(folder))
    except NatslError:
        return str(folder)


# ----------------------------------------------------------------------------- running


def _stop(procs: list, grace_s: float) -> None:
    """End jobs and what they started (natsl.training.sweep's worker handling: their process groups)."""
    from natsl.training.sweep import stop_workers

    stop_workers(procs, grace_s)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _earlier_jobs(status_path: Path) -> dict:
    """job name -> its entry in an earlier eval_status.json (none, or unreadable: {})."""
    try:
        record = read_json(status_path, "remove it")
    except (OSError, NatslError):  # none yet, unreadable, too large, not JSON, nested too deeply
        return {}
    jobs = record.get("jobs") if isinstance(record, dict) else None
    return {n: j for n, j in jobs.items() if isinstance(j, dict)} if isinstance(jobs, dict) else {}


def run_jobs(jobs: list[EvalJob], *, max_parallel: int, deadline_s: float | None = None, log=print,
             start_margin_s: float = 60.0, grace_s: float = 5.0, clock=time.monotonic, env: dict | None = None) -> dict:
    """Run the pending jobs, at most `max_parallel` at once; resumable (a done job is not run again).

    Args:
        jobs: eval_jobs' list (all of one evaluation folder).
        max_parallel: jobs running at once (at least 1).
        deadline_s: seconds from now for the whole stage (None: no deadline). No job starts within
            `start_margin_s` of it; at it, the running jobs are ended and recorded as killed.
        log: a function of one line (the progress lines: done/total, running, ETA).
        start_margin_s: see deadline_s.
        grace_s: seconds between SIGTERM and SIGKILL when jobs are ended.
        clock: the time source (tests).
        env: the environment of the jobs (default: this process's).
    Returns:
        {job name: status}: "done", "done already", "skipped: why", "failed (exit code N; see LOG)",
        "killed (deadline)", "not started (deadline)".
    """
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")
    if not jobs:
        return {}
    from natsl.atomic import write_json

    root = jobs[0].root
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    began = clock()
    end = None if deadline_s is None else began + deadline_s
    status: dict[str, str] = {}
    seconds: dict[str, float] = {}
    # what each job's output was made from (the stamp of its last finished run): a job is done only where
    # that is what it would evaluate now
    earlier = _earlier_jobs(root / "eval_status.json")
    evaluated = {n: j["evaluated"] for n, j in earlier.items() if isinstance(j.get("evaluated"), dict)}
    # jobs this call does not run (natsl miniature --evals left them out) keep their earlier entries
    names = {j.name for j in jobs}
    others = {n: e for n, e in earlier.items() if n not in names}

    def save() -> None:
        write_json(root / "eval_status.json", {
            "jobs": {**others, **{j.name: {"status": status.get(j.name, "pending"), "argv": j.argv, "out": str(j.out),
                                           "log": str(logs / f"{j.name}.log"), "seconds": seconds.get(j.name),
                                           "systems": j.systems, "evaluated": evaluated.get(j.name),
                                           **({"note": j.note} if j.note else {})} for j in jobs}},
            "quick": any(j.quick for j in jobs), "updated": time.strftime("%Y-%m-%d %H:%M:%S")})

    pending = []
    for j in sorted(jobs, key=lambda j: not j.exclusive):  # the exclusive ones first (a stable sort: order kept)
        if j.skipped:
            status[j.name] = f"skipped: {j.skipped}"
        elif j.done() and (not j.stamp or evaluated.get(j.name) == j.stamp):
            status[j.name] = "done already"
        else:
            if j.done():
                log(f"{j.name}: its output is of other checkpoints or settings than now: run again")
            pending.append(j)
    total = len([j for j in jobs if not j.skipped])
    log(f"eval: {len(jobs)} jobs, {total - len(pending)} done already, {len(pending)} to run, "
        f"at most {max_parallel} at once" + (f", {len(jobs) - total} skipped" if total < len(jobs) else ""))
    for j in jobs:
        if j.skipped:
            log(f"{j.name}: skipped ({j.skipped})" + (f"; to run it elsewhere: {shown(j.argv)}" if j.argv else ""))
    running: dict[str, tuple] = {}
    finished_s: list[float] = []

    def progress() -> None:
        done = sum(1 for s in status.values() if s.startswith("done"))
        left = len(pending) + len(running)
        eta = ""
        if finished_s and left:
            eta = f", ETA ~{_minutes(sum(finished_s) / len(finished_s) * left / min(max_parallel, left))}"
        log(f"eval: {done}/{total} done, {len(running)} running, {len(pending)} waiting{eta}")

    save()
    try:
        while pending or running:
            now = clock()
            if end is not None and now >= end:
                break
            while pending and len(running) < max_parallel:
                if end is not None and end - now < start_margin_s:
                    break
                if any(r.exclusive for _, r, _, _ in running.values()) or (pending[0].exclusive and running):
                    break  # an exclusive job runs alone
                j = pending.pop(0)
                j.out.parent.mkdir(parents=True, exist_ok=True)
                fh = open(logs / f"{j.name}.log", "a", encoding="utf-8")
                fh.write(f"$ {' '.join(j.argv)}\n")
                fh.flush()
                # its own process group, as the sweep's workers: ending it ends what it started
                proc = subprocess.Popen(j.argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                        env=env if env is not None else dict(os.environ), start_new_session=True)
                running[j.name] = (proc, j, fh, clock())
                status[j.name] = "running"
                log(f"{j.name}: started")
                save()
            if end is not None and pending and not running and end - now < start_margin_s:
                break  # nothing runs and nothing may start: wait no longer
            for name, (proc, j, fh, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                fh.close()
                del running[name]
                seconds[name] = clock() - started
                if proc.returncode == 0 and j.done():
                    status[name] = "done"
                    evaluated[name] = j.stamp
                    finished_s.append(seconds[name])
                elif proc.returncode == 0:
                    status[name] = f"failed (exit code 0 but no {j.done_file.name}; see {logs / (name + '.log')})"
                else:
                    status[name] = f"failed (exit code {proc.returncode}; see {logs / (name + '.log')})"
                log(f"{name}: {status[name]} after {_minutes(seconds[name])}")
                progress()
                save()
            time.sleep(0.2)
    finally:  # the deadline, Ctrl-C or an error here: the jobs (in sessions of their own) go first
        why = "deadline" if end is not None and clock() >= end - start_margin_s else "stopped"
        if running:
            log(f"eval: {why}: ending {len(running)} running job(s)")
            _stop([proc for proc, _, _, _ in running.values()], grace_s)
            for name, (proc, j, fh, started) in running.items():
                fh.close()
                seconds[name] = clock() - started
                status[name] = f"killed ({why})"
            running.clear()
        for j in pending:
            status[j.name] = f"not started ({why})"
        save()
    progress()
    return {j.name: status.get(j.name, "pending") for j in jobs}
