"""The report of `natsl miniature`: the paper's tables and figures in miniature, from what the stages wrote.

`write_report(ROOT)` reads, each where present (a missing piece is "not measured", never an error):

- ROOT/sweep/summary.json: the learning-rate sweep (natsl.training.sweep_lm: `best_lm`, per system its
  best_lr and the ranking of its rates);
- ROOT/checkpoints.json (else ROOT/eval/checkpoints.json): name -> training run folder, and the training
  results beside them (RUN/result.json or a parent's, else ROOT/train/runs/ID/result.json whose run.json
  names the system: val_loss, perplexity, tokens, parameters, val_curve);
- ROOT/eval: ppl/ppl.json (natsl.cli.eval_ppl), ruler_NAME/ruler.json (natsl.cli.eval_ruler),
  routing_NAME/routing.json (natsl.cli.inspect_routing), compare/compare.json (natsl.eval.compare),
  latency/latency.json (natsl.inference.bench), lm_eval_NAME/lm_eval.json (natsl.eval.lm_eval_run) and
  eval_status.json (natsl.miniature.evaluate: why a job did not run);

and writes ROOT/report/report.md (the tables and the verdict on the issue's five claims), tables.json (the
same numbers) and PNG figures beside them. Runs stopped by deadlines train different token counts: Table 1 and
claim 1 compare losses at the largest validation point every ladder run reached; the ablations (trained in the
sweep only) are compared with the sweep's natsl_hybrid point; claims 2 and 3 are judged only where eval-ppl's
windows exceed the training length and RULER reached 4K; quick (smoke) evaluations are said at the top. Paths
the stages wrote relative to the project's folder are found again in a moved or copied ROOT (locate). Figures: validation curves, loss against position to 8x the training
length (Fig. 3), RULER accuracy against length (Table 2), the kept fraction per layer, group and
source of every NAtS-L checkpoint (Figs. 5/6), and the same per layer and group during training, from each NAtS-L
run's metrics.jsonl (`keep_groups`; Fig. 5).
"""


from __future__ import annotations

import time
from pathlib import Path

from natsl.miniature.claims import TEACHER_FORCED, claims, read_ruler_samples
from natsl.miniature.figures import write_figures
from natsl.miniature.ladder import LADDER, ordered, seeds_of, split_seed
from natsl.miniature.results import (NOT_MEASURED, as_number, eval_names, fmt, fmt_tokens, human_bytes, md_table,
                                     read_checkpoints, read_result, read_training)
from natsl.miniature.sections import (ablation_section, compare_section, latency_section, lm_eval_section, ppl_section,
                                      routing_over_training, routing_section, seeds_at, sweep_section, table1)

# ----------------------------------------------------------------------------- the report


def _status_note(status: dict, job: str) -> str:
    entry = (status.get("jobs") or {}).get(job) if isinstance(status, dict) else None
    return f"{NOT_MEASURED} ({entry['status']})" if isinstance(entry, dict) and entry.get("status") not in (
        None, "done", "done already") else NOT_MEASURED


def quick_mode(status: dict) -> bool:
    """Whether the evaluations ran eval_jobs' quick settings: eval_status.json's "quick", else (a folder from before
    it was recorded) the ppl job's window or the RULER jobs' lengths differing from the full protocol's."""
    from natsl.miniature.evaluate import PPL_MAX_LEN, RULER_LENGTHS

    if not isinstance(status, dict):
        return False
    if isinstance(status.get("quick"), bool):
        return status["quick"]
    for name, job in (status.get("jobs") or {}).items():
        argv = [str(a) for a in (job or {}).get("argv") or []] if isinstance(job, dict) else []
        flag = "--max-len" if name == "ppl" else "--lengths" if name.startswith("ruler_") else None
        if flag and flag in argv[:-1]:
            value = argv[argv.index(flag) + 1]
            if value != (str(PPL_MAX_LEN) if name == "ppl" else RULER_LENGTHS):
                return True
    return False


def write_report(root) -> Path:
    """Write ROOT/report/report.md, tables.json and the figures from whatever the stages left (see the module doc).

    Args:
        root: the miniature's output folder (sweep/, train/, eval/, checkpoints.json).
    Returns:
        The path of report.md.
    """
    from natsl.atomic import write_json, write_text

    root = Path(root)
    folder = root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    checkpoints = read_checkpoints(root, problems)
    training = read_training(root, checkpoints, problems)
    sweep = read_result(root / "sweep" / "summary.json", problems)
    sweep = sweep if isinstance(sweep, dict) else None
    status = read_result(root / "eval" / "eval_status.json", problems) or {}
    names = ordered([*checkpoints, *training, *[p.get("system") for p in (sweep or {}).get("best_lm") or []
                                              if isinstance(p, dict) and p.get("system")]])
    t1 = table1(names, training, sweep)
    swept = sweep_section(root, sweep)
    ppl_json = read_result(root / "eval" / "ppl" / "ppl.json", problems)
    ppl_json = ppl_json if isinstance(ppl_json, dict) else None
    ppl = ppl_section(ppl_json, checkpoints, root, problems)
    window = (ppl_json or {}).get("max_len")
    quick = quick_mode(status)
    ruler = {}
    for name in ordered(n for n in eval_names(root, "ruler") if split_seed(n)[0] in LADDER
                      and (root / "eval" / f"ruler_{n}" / "ruler.json").is_file()):
        data = read_result(root / "eval" / f"ruler_{name}" / "ruler.json", problems)
        if isinstance(data, dict):
            ruler[name] = {"tasks": data.get("tasks") or {}, "lengths": data.get("lengths") or {},
                           "mean": data.get("mean"), "samples": data.get("samples"),
                           **{m.key: data.get(m.key) if isinstance(data.get(m.key), dict) else None
                              for m in TEACHER_FORCED}}
    samples = {name: read_ruler_samples(root / "eval" / f"ruler_{name}" / "ruler_samples.jsonl", problems)
               for name in ruler}
    routing = routing_section(root, problems)
    over_training = routing_over_training(checkpoints, training, problems)
    compare_json = read_result(root / "eval" / "compare" / "compare.json", problems)
    compare = compare_section(compare_json if isinstance(compare_json, dict) else None, checkpoints, root)
    latency_json = read_result(root / "eval" / "latency" / "latency.json", problems)
    latency = latency_section(latency_json if isinstance(latency_json, dict) else None, checkpoints, root)
    lm = lm_eval_section(root, problems)
    verdicts = claims(t1, ppl, ruler, routing, compare, window, samples)
    figures = write_figures(folder, t1, ppl, ruler, routing, over_training)

    md = [f"# The paper in miniature: report\n\nWritten {time.strftime('%Y-%m-%d %H:%M:%S')} from {root}. "
          f"\"{NOT_MEASURED}\": the stage left no result for it.\n"]
    if quick:
        md.append("**Evaluations in quick mode (smoke settings): not the paper's protocol.**\n")
    md.append("## Claims\n")
    md.append(md_table(["claim", "verdict", "numbers"], [[c["claim"], f"**{c['verdict']}**", c["numbers"]]
                                                          for c in verdicts]))
    rows, matched = t1["rows"], t1["matched_tokens"]
    md.append("\n## Table 1 in miniature: training" + (" (runs cut short)" if t1["cut_short"] else "") + "\n")
    if any(r["val_loss"] is not None or r["best_lr"] is not None for r in rows.values()):
        if t1["cut_short"]:
            md.append(f"Runs cut short (status other than done): {', '.join(t1['cut_short'])}. They trained different "
                      "token counts, so their final losses do not compare; the matched column does.\n")
        if matched is not None:
            md.append(f"\"val loss at {fmt_tokens(matched)}\": each run's validation loss at the largest token count "
                      f"every run with a validation curve reached ({', '.join(t1['matched_runs'])}; no "
                      "interpolation). \"sweep val loss\": the learning-rate sweep's, at its own (shorter) length.\n")
        matched_head = f"val loss at {matched / 1e6:.1f}M tokens" if matched is not None else "val loss at matched tokens"
        md.append(md_table(["system", "parameters", "best lr", "sweep val loss", "tokens trained", "status",
                            "final val loss", "final val ppl", matched_head],
                           [[n, f"{r['parameters'] / 1e6:.1f}M" if as_number(r["parameters"]) else "-",
                             fmt(r["best_lr"], 3) if r["best_lr"] is not None else "-", fmt(r["sweep_val_loss"]),
                             fmt_tokens(r["tokens"]), str(r["status"] or "-").split(" (")[0], fmt(r["val_loss"]), fmt(r["perplexity"]),
                             fmt(r["val_loss_matched"])] for n, r in rows.items()]))
        for system in ordered(split_seed(n)[0] for n in rows):
            mine = seeds_at(t1, system)
            if mine and mine["n"] > 1:
                md.append(f"\n{system} over its {mine['n']} seeds at {fmt_tokens(matched)} tokens: mean "
                          f"{fmt(mine['mean'])}, min {fmt(mine['min'])}, max {fmt(mine['max'])}.")
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Learning-rate sweep\n")
    if swept:
        lengths = {fmt_tokens(x["tokens"]) for x in swept.values() if x["tokens"]}
        if lengths:
            md.append(f"Each rate's final validation loss after the sweep's {' / '.join(sorted(lengths))} tokens, "
                      "lowest first.\n")
        md.append(md_table(["system", "rates: val loss (lowest first)", "best rate", "best val loss", "note"],
                           [[n, "failed" if x["failed"] else ", ".join(f"{fmt(r['lr'], 3)}: {fmt(r['val_loss'])}"
                                                                       for r in x["ranking"]),
                             fmt(x["best_lr"], 3) if x["best_lr"] is not None else "-", fmt(x["val_loss"]),
                             x["failed"] if x["failed"] else (f"best at the grid's edge: sweep {x['edge']}"
                                                              if x["edge"] else "")]
                            for n, x in swept.items()]))
        grids = {", ".join(fmt(g, 3) for g in x["grid"]) for x in swept.values() if x["grid"]}
        if grids:
            md.append(f"\nRates swept: {' / '.join(sorted(grids))}.")
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Fig. 3 in miniature: loss against position\n")
    if ppl:
        train = max((r["train_seq_len"] or 0) for r in ppl.values())
        md.append(f"Windows of {window} tokens of the validation split (eval-ppl); the last bucket is the longest "
                  "context" + (f"; training length {train}." if train else ".")
                  + (" The windows are within the training length: nothing here measures extrapolation."
                     if train and window and window <= train else "") + "\n")
        md.append(md_table(["system", "ppl (whole window)", "loss within training length", "loss, last bucket",
                            "last / within", "bits/byte"],
                           [[n, fmt(r["ppl"]), fmt(r["loss_within_train_len"]), fmt(r["loss_last_bucket"]),
                             fmt(r["last_vs_within"]), fmt(r["bits_per_byte"])]
                            for n, r in ((n, ppl[n]) for n in ordered(ppl))]))
    else:
        md.append(_status_note(status, "ppl"))
    md.append("\n## Table 2 in miniature: RULER needle-in-a-haystack\n")
    if ruler:
        lengths = sorted({int(n) for r in ruler.values() for n in r["lengths"]})
        md.append(md_table(["system", *map(str, lengths), "mean"],
                           [[n, *[fmt(r["lengths"].get(str(x)), 2) for x in lengths], fmt(r["mean"], 2)]
                            for n, r in ruler.items()]))
        scores = [as_number(v) for r in ruler.values() for v in r["lengths"].values()]
        if scores and all(v == 0 for v in scores):
            md.append("\nEvery system scores 0 at every length: the models are too weak for the task at this "
                      "training length.")
        for measure in TEACHER_FORCED:
            forced = {n: r[measure.key] for n, r in ruler.items() if r.get(measure.key)}
            if forced:
                md.append(f"\n{measure.heading}\n")
                md.append(md_table(["system", *map(str, lengths), "mean"],
                                   [[n, *[fmt((a.get("lengths") or {}).get(str(x)), 3) for x in lengths],
                                     fmt(a.get("mean"), 3)] for n, a in forced.items()]))
        tasks = list(dict.fromkeys(t for r in ruler.values() for t in r["tasks"]))
        for length in lengths:
            md.append(f"\nPer task at {length} tokens:\n")
            md.append(md_table(["task", *ruler], [[t, *[fmt((r["tasks"].get(t) or {}).get(str(length)), 2)
                                                        for r in ruler.values()]] for t in tasks]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Figs. 5/6 in miniature: routing per layer, group and source\n")
    if routing:
        for name, r in routing.items():
            note = ((status.get("jobs") or {}).get(f"routing_{name}") or {}).get("note") if isinstance(status, dict) \
                else None
            md.append(f"\n**{name}** ({r['seq_len']}-token windows): routing {r['routing']}."
                      + (f" ({note})" if note else "") + "\n")
            layers = [layer["layer"] for layer in (r["datasets"][0]["layers"] if r["datasets"] else [])]
            md.append(md_table(["source", "kept", "KV vs Transformer layer", *[f"layer {x} groups" for x in layers]],
                               [[d["name"], fmt(d["keep_fraction"]), fmt(d["kv_ratio"]),
                                 *[" / ".join(fmt(g, 2) for g in layer["group_keep_fraction"] or [])
                                   for layer in d["layers"]]] for d in r["datasets"]]))
        seeds = seeds_of("natsl_hybrid", routing)
        if len(seeds) > 1:
            md.append("\nAcross seeds (kept fraction per source):\n")
            sources = list(dict.fromkeys(d["name"] for n in seeds for d in routing[n]["datasets"]))
            md.append(md_table(["source", *seeds], [[s, *[fmt(next((d["keep_fraction"] for d in routing[n]["datasets"]
                                                                    if d["name"] == s), None)) for n in seeds]]
                                                    for s in sources]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Routing during training (Fig. 5 in miniature)\n")
    if over_training:
        md.append("Kept fraction of each routing group (training batches, from metrics.jsonl), at a quarter, half, "
                  "three quarters and the end of each run's logged tokens:\n")
        for name, run in over_training.items():
            picks = sorted({min(len(run["tokens"]) - 1, max(0, round(f * len(run["tokens"])) - 1))
                            for f in (0.25, 0.5, 0.75, 1.0)})
            md.append(f"\n**{name}**\n")
            md.append(md_table(["group", *[fmt_tokens(run["tokens"][i]) + " tokens" for i in picks]],
                               [[label, *[f"{run['keep'][i][j]:.2f}" for i in picks]]
                                for j, label in enumerate(run["labels"])]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Quality at matched KV bytes (compare)\n")
    if compare:
        md.append(md_table(["system", "variant", "context", "ppl", "KV bytes", "KV vs Transformer", "decode ms",
                            "prefill s"],
                           [[e["system"], e.get("label"), e.get("context"), fmt(e.get("ppl")),
                             human_bytes(e.get("kv_bytes")), fmt(e.get("kv_vs_transformer")),
                             e["error"] if "error" in e else fmt(e.get("decode_ms")), fmt(e.get("prefill_s"))]
                            for e in compare]))
    else:
        md.append(_status_note(status, "compare"))
    md.append("\n## Latency (bench-latency, trained routers)\n")
    if latency:
        contexts = sorted({int(c) for r in latency.values() for c in r})
        md.append(md_table(["system", *[f"{c}: prefill s / decode ms" for c in contexts]],
                           [[n, *[(p.get("error") if "error" in p else f"{fmt(p.get('prefill_s'))} / "
                                   f"{fmt(p.get('decode_ms'))}") if (p := r.get(str(c))) else "-"
                                  for c in contexts]] for n, r in latency.items()]))
    else:
        md.append(_status_note(status, "latency"))
    md.append("\n## lm-eval on the local tasks\n")
    if lm:
        metrics = list(dict.fromkeys(k for scores in lm.values() for k in scores))
        md.append(md_table(["system", *metrics], [[n, *[fmt(lm[n].get(k)) for k in metrics]] for n in ordered(lm)]))
    else:
        skipped = [e["status"] for j, e in (status.get("jobs") or {}).items() if j.startswith("lm_eval_")
                   and isinstance(e, dict)] if isinstance(status, dict) else []
        md.append(f"{NOT_MEASURED} ({skipped[0]})" if skipped else NOT_MEASURED)
    md.append("\n## Ablations (against natsl_hybrid's sweep point)\n")
    ablations = ablation_section(swept, ppl, routing)
    if any(n != "natsl_hybrid" for n in ablations):
        tokens = next((x["tokens"] for x in swept.values() if x["tokens"]), None)
        md.append("The ablations are trained in the learning-rate sweep only: each is compared with natsl_hybrid's "
                  "best sweep point (the same tokens" + (f", {fmt_tokens(tokens)}" if tokens else "") + ", each at "
                  "its own best rate), not with the full training run. eval-ppl and the kept fraction are of the "
                  "ablations' sweep checkpoints, which have no natsl_hybrid counterpart evaluated (its evaluated "
                  "checkpoint is the full run's): they are shown, not compared.\n")
        md.append(md_table(["system", "best rate", "sweep val loss", "vs natsl_hybrid", "eval-ppl ppl",
                            "mean kept fraction"],
                           [[n, fmt(a["best_lr"], 3) if a["best_lr"] is not None else "-",
                             (a["failed"] if a["failed"].startswith("failed") else f"failed: {a['failed']}")
                             if a["failed"] else fmt(a["val_loss"]),
                             f"{a['delta']:+.3f}" if a["delta"] is not None else "-", fmt(a["ppl_long"]),
                             fmt(a["kept"])] for n, a in ablations.items()]))
    else:
        md.append(NOT_MEASURED)
    if figures:
        md.append("\n## Figures\n")
        md.extend(f"![{name}]({name})" for name in figures)
    if problems:
        md.append("\n## Files that could not be read\n")
        md.extend(f"- {p}" for p in problems)
    tables = {"checkpoints": {n: str(p) for n, p in checkpoints.items()}, "table1": t1, "ppl": ppl, "ruler": ruler,
              "routing": routing, "routing_over_training": over_training, "compare": compare, "latency": latency, "lm_eval": lm, "ablations": ablations,
              "sweep": swept, "quick": quick,
              "claims": verdicts, "figures": figures, "problems": problems}
    write_json(folder / "tables.json", tables)
    return write_text(folder / "report.md", "\n".join(md) + "\n")
