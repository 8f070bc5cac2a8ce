"""Whether search.py's trace is what `zerolens bench` predicts for (and allocates in) the GPU run

  zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies S --micro-batch MB
      [--activation-checkpointing] --no-compile --no-fused-adam --warmup 2 --steps 2 --rounds 1 --no-reference

For each configuration given (S:ckpt:MB, ckpt 0 or 1): bench's RunConfig from bench's own parser
(config_from_args, as if one GPU were visible); its TrainSettings against search.py's; its prediction as
the run makes it (predict.peak.predicted_peaks(config, (9, 0)): what run/prediction.py writes to
predicted_peaks.json, 3 steps = min(STEPS, warm-up + timed)); the sequence it replays against search.py's
(ids renumbered, in order of first appearance); and the run's own 4 steps traced (bench's settings),
with its smallest cap, reserved peak and windows (search.py's scan). Then each cap given (--caps) tried
under the 3-step and the 4-step sequences (runs_under, default allocator, both address orders).

  python3 bench_check.py ddp:0:1 [--caps ddp:0:1=C1,C2,C3 ...] > bench_check.jsonl"""
import argparse
import dataclasses
import json
import sys
import time

from zerolens.commands import bench
from zerolens.predict import peak as PK
from zerolens.predict import allocator as A
from zerolens.predict.without_gpu import cuda_bytes
from zerolens.run.flags import config_from_args
from zerolens.strategies import TrainSettings, registry

import search as S


def bench_config(name, ckpt, mb):
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    bench.add_parser(subparsers)
    argv = ["bench", "--nproc", "1", "--device", "cuda", "--preset", "gpt-1b", "--strategies", name,
            "--micro-batch", str(mb), *(["--activation-checkpointing"] if ckpt else []), "--no-compile",
            "--no-fused-adam", "--warmup", "2", "--steps", "2", "--rounds", "1", "--no-reference"]
    return config_from_args(parser.parse_args(argv), gpus_visible=1), argv


def renumbered(sequence):
    """The sequence with each id replaced by its order of first appearance (ids are the trace's own)."""
    ids, out = {}, []
    for action, ident, size, stream in sequence:
        if action == "phase":
            out.append((action, tuple(ident), None, stream))
            continue
        out.append((action, ids.setdefault(ident, len(ids)), size, stream))
    return out


def bench_sequence(name, model, settings, steps):
    """The sequence bench's prediction replays: ZeRO-1/2's spliced from a bracketed trace (spliced_ranks),
    the others' traced_rank's."""
    spec = registry.spec(name)
    if spec.flat_partition and hasattr(spec.step_model_class(), "rank_requests"):
        _, record = PK.traced_rank(name, model, settings, cuda_capability=S.CAPABILITY, steps=steps,
                                   brackets=True, outcome=False)
        return PK.plain_requests(PK.spliced_requests(record["requests"], record["step_model"].rank_requests(0),
                                                     cuda_bytes))
    _, record = PK.traced_rank(name, model, settings, cuda_capability=S.CAPABILITY, steps=steps, outcome=False)
    return PK.plain_requests(record["requests"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+", help="S:ckpt:MB, e.g. ddp:0:1")
    p.add_argument("--caps", nargs="*", default=[], help="S:ckpt:MB=C1,C2,... caps (bytes) to try")
    args = p.parse_args()
    caps = {k: [int(c) for c in v.split(",")] for k, v in (x.split("=") for x in args.caps)}
    for key in args.configs:
        t = time.time()
        name, ckpt, mb = key.split(":")
        ckpt, mb = bool(int(ckpt)), int(mb)
        config, argv = bench_config(name, ckpt, mb)
        row = {"config": key, "bench_argv": argv}
        mine = TrainSettings(precision="bf16", world_size=1, micro_batch=mb)
        theirs = config.train_settings(name)
        row["settings_differ"] = {f.name: [getattr(mine, f.name), getattr(theirs, f.name)]
                                  for f in dataclasses.fields(TrainSettings)
                                  if getattr(mine, f.name) != getattr(theirs, f.name)}
        model = dataclasses.replace(S.PRESETS["gpt-1b"], activation_checkpointing=ckpt)
        row["model_differs"] = {f.name: [getattr(model, f.name), getattr(config.model, f.name)]
                                for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(config.model, f.name)}
        row["bench_prediction_steps"] = min(PK.STEPS, config.steps + config.warmup_steps)
        row["bench_run_steps"] = config.steps + config.warmup_steps
        row["fused_adam"], row["warmup_steps"], row["steps"] = config.fused_adam, config.warmup_steps, config.steps
        # bench's own prediction (run/prediction.py's predicted_peaks.json)
        predicted = PK.predicted_peaks(config, S.CAPABILITY)[name]
        rank = predicted["ranks"][0] if "ranks" in predicted else predicted
        row["bench_predicted"] = {k: rank.get(k) for k in ("peak_bytes", "min_allocator_cap_bytes", "reserved_peak_bytes")}
        # the sequences
        search_seq, _ = S.traced(name, ckpt, mb)
        bench3 = bench_sequence(name, config.model, theirs, 3)
        row["bench_3step_sequence_equals_search"] = renumbered(bench3) == renumbered(search_seq)
        row["requests"] = {"search": len(search_seq), "bench_3": len(bench3)}
        bench4 = bench_sequence(name, config.model, theirs, 4)
        row["requests"]["bench_4"] = len(bench4)
        row["bench_4step_starts_with_3step"] = renumbered(bench4)[:len(bench3)] == renumbered(bench3)
        for label, seq in (("search_3step", search_seq), ("bench_3step", bench3), ("bench_4step", bench4)):
            cap, reserved, allocated = S.default_needs(seq)
            windows, _, _ = S.scan(seq, cap, reserved)
            row[label] = {"min_allocator_cap_bytes": cap, "reserved_peak_bytes": reserved,
                          "allocator_allocated_peak_bytes": allocated, "windows": windows,
                          "windows_mib": [round(S.width(w) / S.MiB) for w in windows]}
            if key in caps:
                row[label]["runs_under"] = {str(c): A.runs_under(seq, c, {}) for c in caps[key]}
                row[label]["runs_under_by_order"] = {
                    str(c): {order: A.runs(seq, c, addresses=order) for order in A.ADDRESS_ORDERS} for c in caps[key]}
        row["seconds"] = round(time.time() - t, 1)
        print(json.dumps(row), flush=True)
        print(f"{key} done in {row['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
