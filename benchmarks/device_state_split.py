"""The two sequential gated-delta kernels at an 800M training micro-batch with and without their last
round split off (config.STATE_FWD / STATE_BWD["SPLIT_LAST_ROUND"], state.batch_launches), on the GPU.

    PYTHONPATH=. python3 benchmarks/device_state_split.py [--batch 8] [--rounds 5] [--out state_split.json]

Fixed inputs from device_gated_delta.stage_runner (H=6, K=192, V=384, T=4096, bf16 intermediates);
each stage's outputs with the split are compared with one launch (max relative error, 0 = bitwise),
then both ways are timed `--rounds` times alternately (medians of do_bench each); the table gives the
median over rounds and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="state_split.json")
    args = parser.parse_args()
    import device_gated_delta as dgd

    from natsl.devices import sm_count
    from natsl.fast.gated_delta import config
    from natsl.fast.gated_delta.state import batch_launches
    from natsl.provenance import provenance

    import torch

    config.INTERMEDIATE = "input"
    stages = dgd.stage_runner(args.seq_len, args.batch)
    rows = []
    for name in ("STATE_FWD", "STATE_BWD"):
        cfg = getattr(config, name)
        plan = batch_launches(args.batch, dgd.H, dgd.V, {**cfg, "SPLIT_LAST_ROUND": True}, sm_count(torch.device("cuda")),
                              dgd.DT)
        fn, outs, times = stages[name], {}, {False: [], True: []}
        for split in (False, True):
            cfg["SPLIT_LAST_ROUND"] = split
            outs[split] = [x.float().clone() for x in dgd.first_tensors(fn())]
        err = max(dgd.rel(a, b) for a, b in zip(outs[True], outs[False]))
        bitwise = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
        for _ in range(args.rounds):
            for split in (False, True):
                cfg["SPLIT_LAST_ROUND"] = split
                times[split].append(dgd.median_ms(fn))
        cfg["SPLIT_LAST_ROUND"] = False
        row = {"stage": name, "B": args.batch, "plan": plan, "one_launch_ms": statistics.median(times[False]),
               "split_ms": statistics.median(times[True]), "rounds": {str(k): v for k, v in times.items()},
               "max_rel_err": err, "bitwise_equal": bitwise}
        rows.append(row)
        print(f"{name} B={args.batch} plan {plan}: one launch {row['one_launch_ms']:.3f} ms, split "
              f"{row['split_ms']:.3f} ms ({row['split_ms'] / row['one_launch_ms']:.3f}x); outputs bitwise equal "
              f"{bitwise} (max rel err {err:.1e})", flush=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
