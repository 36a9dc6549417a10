"""The verdicts on the issue's five claims (holds / fails / inconclusive / not measured), each with the
numbers it rests on, from the report's sections; RULER's per-sample records for the paired needle claim."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from natsl.miniature.ladder import seeds_of
from natsl.miniature.results import (NOT_MEASURED, SOURCE_TOL, SYNTHETIC, as_number, fmt, fmt_tokens, loss_at,
                                     matched_tokens, seed_spread)

# ----------------------------------------------------------------------------- claims


INCONCLUSIVE = "inconclusive"


def _verdict(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else ("holds" if ok else "fails")


class ForcedMeasure(NamedTuple):
    """One of eval-ruler's teacher-forced measures (natsl.eval.ruler.answer_accuracy)."""

    key: str  # its means in ruler.json
    sample_key: str  # its value per sample in ruler_samples.jsonl
    name: str  # in the claim's numbers
    label: str  # its panel in ruler_by_length.png
    heading: str  # of its table in the report


# In the order the needle claim falls back on them.
TEACHER_FORCED = (
    ForcedMeasure("answer_accuracy", "answer_token_accuracy", "teacher-forced answer-token accuracy",
                  "answer-token accuracy, teacher-forced",
                  "Teacher-forced answer-token accuracy (the prompt followed by the answer in one forward; the "
                  "fraction of the value's tokens predicted exactly; `natsl eval-ruler --answer-accuracy`):"),
    ForcedMeasure("answer_logprob", "answer_logprob", "the answer tokens' mean log-probability, teacher-forced (nats)",
                  "answer log-probability (nats), teacher-forced",
                  "The answer tokens' mean log-probability, teacher-forced (nats; higher retrieves more):"),
)


# eval-ruler's per-sample measures (ruler_samples.jsonl) in the order the needle claim judges on them: the
# first on which not every sample of both systems scores 0 (string match is 0 for every sample of a model too
# weak for the task; the log-probability is never 0). A difference counts where it exceeds NEEDLE_SE standard
# errors of the paired per-sample differences: the samples are the same prompts for every system (eval-ruler
# draws them from its --seed alone).
SAMPLE_MEASURES = (("score", "string match"), *((m.sample_key, m.name) for m in TEACHER_FORCED))
NEEDLE_SE = 2.0
MAX_SAMPLES_BYTES = 64 << 20


def read_ruler_samples(path: Path, problems: list[str]) -> dict | None:
    """(task, length, index) -> that sample's record (answers and SAMPLE_MEASURES) from eval-ruler's
    ruler_samples.jsonl; None when the file is missing or unreadable (noted in `problems`)."""
    from natsl.errors import NatslError
    from natsl.files import parse_json, read_small_text

    if not path.is_file():
        return None
    try:
        text = read_small_text(path, MAX_SAMPLES_BYTES, "the report leaves it out")
        records = [parse_json(line, f"{str(path)!r} line {i}", "the report leaves it out")
                   for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    except (NatslError, OSError) as err:
        problems.append(str(err))
        return None
    samples = {}
    for r in records:
        if isinstance(r, dict) and isinstance(r.get("task"), str) and type(r.get("length")) is int \
                and type(r.get("index")) is int:
            samples[(r["task"], r["length"], r["index"])] = {
                "answers": r.get("answers"), **{key: as_number(r.get(key)) for key, _ in SAMPLE_MEASURES}}
    return samples


def paired_gap(mine: list[dict], theirs: list[dict], key: str, length: int) -> dict | None:
    """The samples of `length` that every one of `mine` (a system's seeds) and of `theirs` (the other's seeds)
    scored on `key`, for the same prompt (equal answers): the mean over samples of (my seeds' mean - their
    seeds' mean), its standard error, both sides' means and the count; None for fewer than two such samples."""
    diffs, ours, others = [], [], []
    for sample_key, first in theirs[0].items():
        if sample_key[1] != length:
            continue
        mine_at, theirs_at = [m.get(sample_key) for m in mine], [t.get(sample_key) for t in theirs]
        if any(s is None or s.get(key) is None or s.get("answers") != first.get("answers")
               for s in mine_at + theirs_at):
            continue
        ours.append(sum(s[key] for s in mine_at) / len(mine_at))
        others.append(sum(s[key] for s in theirs_at) / len(theirs_at))
        diffs.append(ours[-1] - others[-1])
    n = len(diffs)
    if n < 2:
        return None
    gap = sum(diffs) / n
    se = math.sqrt(sum((d - gap) ** 2 for d in diffs) / (n - 1) / n)
    return {"gap": gap, "se": se, "mine": sum(ours) / n, "theirs": sum(others) / n, "n": n}


def needle_claim_from_samples(samples: dict, lengths: list[int]) -> dict | None:
    """The needle claim judged on the paired per-sample differences between the NAtS-L Hybrid (the mean of
    its seeds) and the GDN Hybrid at every RULER length >= 4K, on the first SAMPLE_MEASURES that tells them
    apart: holds where the NAtS-L Hybrid is ahead by more than NEEDLE_SE standard errors at every length, fails
    where it is behind by more at some length, else inconclusive. None without both systems' samples."""
    mine = [samples[n] for n in seeds_of("natsl_hybrid", samples) if samples.get(n)]
    theirs = [samples[n] for n in seeds_of("gdn_hybrid", samples) if samples.get(n)]
    if not samples.get("natsl_hybrid") or not samples.get("gdn_hybrid") or not lengths:
        return None
    seeds = f"{len(mine)} seed(s)" + (f", gdn_hybrid of its {len(theirs)}" if len(theirs) > 1 else "")
    for i, (key, what) in enumerate(SAMPLE_MEASURES):
        gaps = {n: paired_gap(mine, theirs, key, n) for n in lengths}
        if any(g is None for g in gaps.values()):
            return None
        if all(g["mine"] == g["theirs"] == 0 and g["se"] == 0 for g in gaps.values()):
            continue  # a floor tells the systems apart no more than a ceiling: the next measure
        ahead = [g["gap"] > NEEDLE_SE * g["se"] for g in gaps.values()]
        behind = [g["gap"] < -NEEDLE_SE * g["se"] for g in gaps.values()]
        verdict = "holds" if all(ahead) else "fails" if any(behind) else INCONCLUSIVE
        skipped = [w for _, w in SAMPLE_MEASURES[:i]]
        numbers = ((f"{' and '.join(skipped)} {'is' if len(skipped) == 1 else 'are'} 0 for every sample of both: "
                    if skipped else "")
                   + f"judged on {what}, paired per sample (the same prompts), natsl_hybrid the mean of its {seeds}: "
                   + "; ".join(f"{n}: natsl_hybrid {fmt(g['mine'])} vs gdn_hybrid {fmt(g['theirs'])}, difference "
                               f"{g['gap']:+.3f} +- {g['se']:.3f} (standard error, {g['n']} samples)"
                               for n, g in gaps.items())
                   + f" (a difference counts beyond {NEEDLE_SE:g} standard errors)")
        return {"verdict": verdict, "numbers": numbers}
    return None


def claims(t1, ppl, ruler, routing, compare, window=None, samples=None) -> list[dict]:
    """The verdicts on the issue's five claims, each with the numbers it rests on.

    Args:
        t1: table1's result; ppl, ruler, routing, compare: the sections' results.
        window: eval-ppl's window (ppl.json max_len), for the extrapolation claim.
        samples: name -> read_ruler_samples, for the needle claim on paired samples (without them, on the
            means over samples in `ruler`).
    Returns:
        [{"claim", "verdict", "numbers"}] in the issue's order.
    """
    out = []
    rows = t1["rows"]
    # 1. validation perplexity, at the largest token count that the claim's runs (the NAtS-L Hybrid's seeds, the
    # Transformer, the GDN Hybrid) all reached: runs stopped by deadlines differ, and a slower system left out of
    # the claim need not hold it back
    # the Transformer and the GDN Hybrid over their own seeds where they trained several (--seed-systems), each
    # judged by its mean as the NAtS-L Hybrid is
    others = ("transformer", "gdn_hybrid")
    mine_names = seeds_of("natsl_hybrid", rows)
    their_names = {o: seeds_of(o, rows) for o in others}
    claim_rows = {n: rows[n] for n in (*mine_names, *[n for o in others for n in their_names[o]])}
    matched = matched_tokens({n: r["val_curve"] for n, r in claim_rows.items()}) if claim_rows and all(
        r["val_curve"] for r in claim_rows.values()) else None
    at = {n: (loss_at(r["val_curve"], matched) if matched is not None else None) for n, r in claim_rows.items()}

    def losses(names: list[str]) -> list[float]:
        return [at[n] for n in names if at.get(n) is not None]

    mine_losses = losses(mine_names)
    mine = seed_spread(mine_losses)
    their = {o: seed_spread(losses(their_names[o])) for o in others}
    theirs = {o: (t["mean"] if t else None) for o, t in their.items()}
    claim = "NAtS-L Hybrid's validation perplexity is at most the Transformer's and GDN Hybrid's"
    if matched is not None and mine and all(v is not None for v in theirs.values()):
        ok = mine["mean"] <= min(theirs.values())
        # judged on the seeds' mean, and said how many seeds hold it alone: one seed's run can move by more than
        # the systems differ (docs/miniature.md, Table 1)
        below = sum(v <= min(theirs.values()) for v in mine_losses)
        cut = t1["cut_short"]
        numbers = (f"validation loss at {fmt_tokens(matched)} tokens, the most these runs all reached"
                   + (" (runs cut short by deadlines; trained: " + ", ".join(
                       f"{n} {fmt_tokens(rows[n]['tokens'])}" for n in ("natsl_hybrid", *others) if n in rows) + ")"
                      if cut else "")
                   + f": natsl_hybrid {fmt(mine['mean'])} (ppl {fmt(math.exp(mine['mean']))}; mean of "
                   f"{mine['n']} seed(s), min {fmt(mine['min'])}, max {fmt(mine['max'])}; {below} of "
                   f"{mine['n']} seed(s) at most both), "
                   + ", ".join(f"{n} {fmt(v)} (ppl {fmt(math.exp(v))}"
                               + (f"; mean of {their[n]['n']} seeds, min {fmt(their[n]['min'])}, max "
                                  f"{fmt(their[n]['max'])}" if their[n]["n"] > 1 else "") + ")"
                               for n, v in theirs.items()))
        out.append({"claim": claim, "verdict": _verdict(ok), "numbers": numbers})
    else:
        systems = ("natsl_hybrid", *others)
        vals = {n: (rows.get(n) or {}).get("perplexity") for n in systems}
        source = "final validation perplexity of training (no validation curves to match tokens)"
        long = {n: (ppl.get(n) or {}).get("ppl") for n in systems}
        if any(v is None for v in vals.values()) and all(v is not None for v in long.values()):
            vals, source = long, "eval-ppl perplexity over the long windows (no training result for all three)"
        ok = None if any(v is None for v in vals.values()) else vals["natsl_hybrid"] <= min(vals["transformer"],
                                                                                               vals["gdn_hybrid"])
        out.append({"claim": claim, "verdict": _verdict(ok),
                    "numbers": f"{source}: " + ", ".join(f"{n} {fmt(v)}" for n, v in vals.items())})
    # 2. extrapolation: only a window longer than the training length measures it
    three = ("natsl_hybrid", "transformer", "gdn_hybrid")
    claim = "NAtS-L Hybrid extrapolates better than both (loss at 8x the training length)"
    lens = [(ppl.get(n) or {}).get("train_seq_len") or 0 for n in three if n in ppl]
    train = max(lens) if lens else 0
    missing = [n for n in three if (ppl.get(n) or {}).get("loss_last_bucket") is None]
    if missing:
        out.append({"claim": claim, "verdict": NOT_MEASURED,
                    "numbers": f"eval-ppl measured no {', '.join(missing)}"})
    elif not window or not train or window <= train:
        out.append({"claim": claim, "verdict": NOT_MEASURED,
                    "numbers": f"not measured (eval-ppl windows of {window or '?'} tokens are within the training "
                               f"length {train or '?'})"})
    else:
        # the NAtS-L Hybrid's seeds that eval-ppl measured too: judged on their mean, as claim 1
        # and the baselines' seeds, each baseline by its mean
        def runs_of(system: str) -> list[str]:
            return [n for n in seeds_of(system, ppl) if (ppl.get(n) or {}).get("loss_last_bucket") is not None]

        measured = runs_of("natsl_hybrid")
        their_runs = {o: runs_of(o) for o in three[1:]}
        last = {n: ppl[n]["loss_last_bucket"] for n in (*measured, *[n for o in three[1:] for n in their_runs[o]])}
        spans = {tuple(ppl[n]["last_bucket"] or ()) for n in last}
        beyond = all((ppl[n]["last_bucket"] or [0])[0] >= (ppl[n]["train_seq_len"] or 0) for n in last)
        mean = sum(last[n] for n in measured) / len(measured)
        their_mean = {o: sum(last[n] for n in runs) / len(runs) for o, runs in their_runs.items()}
        best_other = min(their_mean.values())
        ok = mean < best_other if beyond else None
        span = ppl["natsl_hybrid"]["last_bucket"]
        where = f"tokens {span[0]}-{span[1]}" if span else "the last bucket"
        seeds = ("" if len(measured) == 1 else
                 f"natsl_hybrid mean of {len(measured)} seeds {fmt(mean)} ({sum(last[n] < best_other for n in measured)}"
                 f" of {len(measured)} seeds below both); ")
        numbers = (f"loss at {where} ({window / train:g}x the training length {train}"
                   + ("" if beyond else "; the last bucket is not beyond it for all")
                   + ("" if len(spans) == 1 else "; the systems' last buckets differ") + "): " + seeds
                   + "".join(f"{o} mean of {len(runs)} seeds {fmt(their_mean[o])}; "
                             for o, runs in their_runs.items() if len(runs) > 1)
                   + ", ".join(f"{n} {fmt(last[n])} ({fmt(ppl[n]['last_vs_within'])}x its loss within the "
                               "training length)" for n in last))
        out.append({"claim": claim, "verdict": _verdict(ok), "numbers": numbers})
    # 3. needles at 4K and beyond
    mine, theirs = (ruler.get(n, {}).get("lengths") or {} for n in ("natsl_hybrid", "gdn_hybrid"))
    lengths = sorted(int(n) for n in mine if int(n) >= 4096 and str(n) in theirs)
    pairs = [(n, as_number(mine[str(n)]), as_number(theirs[str(n)])) for n in lengths]
    pairs = [p for p in pairs if p[1] is not None and p[2] is not None]
    ok = None if not pairs else all(a > b for _, a, b in pairs)
    ran = sorted({int(n) for n in mine} | {int(n) for n in theirs})
    if pairs:
        numbers = "; ".join(f"{n}: natsl_hybrid {fmt(a, 2)} vs gdn_hybrid {fmt(b, 2)}" for n, a, b in pairs)
    elif ran and max(ran) < 4096:
        numbers = f"not measured (RULER ran at {', '.join(map(str, ran))} only)"
    elif ran:
        numbers = "no RULER length >= 4096 for both natsl_hybrid and gdn_hybrid"
    else:
        numbers = "no RULER result for natsl_hybrid and gdn_hybrid"
    verdict = _verdict(ok)
    paired = needle_claim_from_samples(samples or {}, [n for n, _, _ in pairs]) if pairs else None
    if paired is not None:  # the per-sample records: paired, over the seeds, beyond their noise
        verdict, numbers = paired["verdict"], paired["numbers"]
    elif pairs and all(a == b == 0 for _, a, b in pairs):  # a floor tells the systems apart no more than a ceiling
        verdict = INCONCLUSIVE
        numbers += " (both score 0 at every length: the task is beyond these models and cannot tell them apart)"
        # the teacher-forced scores still rank them (natsl.eval.ruler.answer_accuracy): the answer tokens
        # predicted, and where both predict none, their log-probability; judged on the first that tells
        # them apart, and said so
        for measure in TEACHER_FORCED:
            mine, theirs = ((ruler.get(n, {}).get(measure.key) or {}).get("lengths") or {}
                            for n in ("natsl_hybrid", "gdn_hybrid"))
            forced = [(n, as_number(mine.get(str(n))), as_number(theirs.get(str(n)))) for n, _, _ in pairs]
            forced = [p for p in forced if p[1] is not None and p[2] is not None]
            if not forced or len(forced) != len(pairs):
                break
            numbers += (f"; judged instead by {measure.name}: "
                        + "; ".join(f"{n}: natsl_hybrid {fmt(a, 3)} vs gdn_hybrid {fmt(b, 3)}" for n, a, b in forced))
            if not all(a == b == 0 for _, a, b in forced):
                verdict = _verdict(all(a > b for _, a, b in forced))
                break
    out.append({"claim": "NAtS-L Hybrid beats GDN Hybrid on the needle tasks at 4K and beyond (RULER mean over tasks)",
                "verdict": verdict, "numbers": numbers})
    # 4. KV bytes
    mine = routing.get("natsl_hybrid")
    held = [d for d in (mine or {}).get("datasets", []) if d["kv_ratio"] is not None and SYNTHETIC not in str(d["name"])]
    whole = [e for e in compare if e.get("system") == "natsl_hybrid" and e.get("method") == "router"
             and e.get("kv_vs_transformer") is not None]
    parts = []
    if held:
        ok = max(d["kv_ratio"] for d in held) <= 0.5
        parts.append("NAtS-L layers' KV against a Transformer layer's on the held-out sources (inspect-routing): "
                     + ", ".join(f"{d['name']} {fmt(d['kv_ratio'])}" for d in held))
    elif whole:
        ok = max(e["kv_vs_transformer"] for e in whole) <= 0.5
    else:
        ok = None
    if whole:
        parts.append("whole model against the Transformer's full cache (compare, random prompt): "
                     + ", ".join(f"{e['context']} tokens {fmt(e['kv_vs_transformer'])}" for e in whole))
    out.append({"claim": "NAtS-L Hybrid keeps at most half of the Transformer's KV bytes", "verdict": _verdict(ok),
                "numbers": "; ".join(parts) or "neither inspect-routing nor compare measured natsl_hybrid"})
    # 5. routing per source in every seed
    seeds = seeds_of("natsl_hybrid", routing)
    spreads = {n: routing[n].get("max_spread_over_sources") for n in seeds}
    # the seeds trained (Table 1) that inspect-routing did not measure
    missing = [n for n in seeds_of("natsl_hybrid", {*rows, "natsl_hybrid"}) if n not in routing]
    ok = None if not seeds or any(v is None for v in spreads.values()) else all(v > SOURCE_TOL for v in spreads.values())
    if missing and ok:  # "every seed" is not shown by fewer seeds; a seed that fails it is shown
        ok = None
    out.append({"claim": "NAtS-L Hybrid routes differently per data source in every seed",
                "verdict": _verdict(ok),
                "numbers": (", ".join(f"{n}: largest spread of a group's kept fraction over sources {fmt(v)}"
                                      for n, v in spreads.items()) or "no seed's routing measured")
                + (f" (threshold {SOURCE_TOL}; not measured: {', '.join(missing)})" if missing else
                   f" (threshold {SOURCE_TOL})")})
    return out
