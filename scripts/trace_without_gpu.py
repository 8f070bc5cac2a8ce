"""A CUDA target's peak trace on the GPU and on CPU tensors (as where no GPU is visible), on a GPU machine.

python3 scripts/trace_without_gpu.py --out traces.json [--jobs 12] [--quick | --points A,B] [--fixture F]
Each point's strategies traced at N=2 on fake tensors of the GPU ("gpu") and on CPU tensors
("cpu": predict/without_gpu.py): every rank's peaks per phase and its allocator needs, and per point
the largest difference from the GPU's trace. --fixture F also writes the GPU's trace of the small
points to F, the fixture tests/test_without_gpu.py checks the CPU trace against
(tests/fixtures/gpu_trace/peaks.json): record it again when a step model changes.
"""
import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

ALL = "ddp,zero0,zero1,zero2,zero3,fsdp2-grad,fsdp2"
# (label, plan-style flags, strategies): the peak matrix's points (scripts/peak_matrix.py) at N=2, and
# Hugging Face models.
POINTS = [
    *[(f"case-study-mb{mb}", ["--preset", "case-study", "--precision", "fp16", "--micro-batch", str(mb)], ALL)
      for mb in (4, 8, 16)],
    *[(f"gpt-100m-mb{mb}{'-ckpt' if ckpt else ''}", ["--preset", "gpt-100m", "--micro-batch", str(mb)]
       + (["--activation-checkpointing"] if ckpt else []), ALL) for mb in (4, 8, 16) for ckpt in (False, True)],
    ("gpt-1b-mb8", ["--preset", "gpt-1b", "--micro-batch", "8"], "ddp,zero2,zero3,fsdp2"),
    ("gpt-1b-mb4-ckpt", ["--preset", "gpt-1b", "--micro-batch", "4", "--activation-checkpointing"], "ddp,zero2,fsdp2"),
    ("hf-gpt2-tiny-mb4", ["--model", "hf:examples/hf/gpt2-tiny.json", "--micro-batch", "4"], ALL),
    ("hf-llama-tiny-mb4", ["--model", "hf:examples/hf/llama-tiny.json", "--micro-batch", "4"], ALL),
    ("hf-gpt2-mb8", ["--model", "hf:gpt2", "--micro-batch", "8", "--seq-len", "1024"], "ddp,zero2,fsdp2"),
    ("hf-tinyllama-1.1b-mb4", ["--model", "hf:examples/hf/tinyllama-1.1b.json", "--micro-batch", "4"],
     "ddp,zero2,fsdp2"),
]
QUICK = {"case-study-mb16", "gpt-100m-mb8", "hf-llama-tiny-mb4"}
# The fixture's points and strategies (None: all), small enough for a CPU test.
FIXTURE = {"case-study-mb16": None, "hf-gpt2-tiny-mb4": ["ddp", "zero2", "fsdp2"],
           "hf-llama-tiny-mb4": ["ddp", "zero3", "fsdp2"]}


def trace(flags: list[str], strategy: str, mode: str) -> dict:
    import argparse as ap

    import torch

    from zerolens.commands import plan
    from zerolens.predict.peak import predict_or_why_not
    from zerolens.run.flags import config_from_args
    from zerolens.strategies import registry
    registry.load_plugins()
    parser = ap.ArgumentParser()
    plan.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--gpu-memory", "80", "--device", "cuda", "--nproc", "2", "--strategies",
                              strategy, *flags])
    config = config_from_args(args, gpus_visible=0, checked=True)
    assert mode == "cpu" or torch.cuda.is_available()
    started = time.perf_counter()
    result = predict_or_why_not(strategy, config.model, config.train_settings(), seed=config.seed,
                                cuda_capability=(9, 0), trace_on="cpu" if mode == "cpu" else None, steps=3)
    if "why_not" in result:
        return {"why_not": result["why_not"], "traceback": result.get("traceback")}
    keep = ("peak_during_forward", "peak_during_backward", "peak_during_step", "peak_bytes", "reserved_peak_bytes",
            "min_allocator_cap_bytes", "traced_on")
    return {"seconds": round(time.perf_counter() - started, 1),
            "ranks": [{k: r[k] for k in keep} for r in result["ranks"]]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--points", default=None, help="comma-separated labels of POINTS (default: all)")
    parser.add_argument("--fixture", default=None)
    args = parser.parse_args()
    chosen = QUICK if args.quick else set(args.points.split(",")) if args.points else {label for label, *_ in POINTS}
    points = [p for p in POINTS if p[0] in chosen]
    jobs = [(label, flags, s, mode) for label, flags, strategies in points for s in strategies.split(",")
            for mode in ("gpu", "cpu")]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [(pool.submit(trace, flags, s, mode), label, s, mode) for label, flags, s, mode in jobs]
        out: dict = {}
        for future, label, s, mode in futures:
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 (a lab script: keep the others' results)
                result = {"error": f"{type(e).__name__}: {e}"}
            out.setdefault(label, {}).setdefault(s, {})[mode] = result
            print(label, s, mode, result.get("seconds", result.get("why_not", result.get("error"))), flush=True)
    summary = {}
    for label, strategies in out.items():
        for s, modes in strategies.items():
            gpu = modes["gpu"].get("ranks")
            for mode in ("cpu",):
                other = modes[mode].get("ranks")
                if not gpu or not other:
                    continue
                errors = [other[r][k] / gpu[r][k] - 1 for r in range(len(gpu))
                          for k in ("peak_during_forward", "peak_during_backward", "peak_during_step")]
                summary.setdefault(mode, {})[f"{label} {s}"] = max(errors, key=abs)
    worst = {mode: max(v.items(), key=lambda kv: abs(kv[1])) for mode, v in summary.items()}
    json.dump({"command": " ".join(["python3", *sys.argv]), "points": out, "largest_phase_error": summary,
               "worst": worst}, open(args.out, "w"), indent=1)
    print(json.dumps(worst, indent=1))
    if args.fixture:
        write_fixture(args.fixture, out, " ".join(["python3", *sys.argv]))


def write_fixture(path: str, traced: dict, command: str) -> None:
    import torch
    flags = {label: f for label, f, _ in POINTS}
    points = {}
    for label, strategies in FIXTURE.items():
        if label not in traced:
            continue
        chosen = strategies or list(traced[label])
        points[label] = {"flags": flags[label], "strategies": {
            s: [{k: r[k] for k in ("peak_during_forward", "peak_during_backward", "peak_during_step",
                                   "min_allocator_cap_bytes")} for r in traced[label][s]["gpu"]["ranks"]]
            for s in chosen}}
    json.dump({"source": f"{command}: each strategy's peaks per phase and rank traced on fake tensors of "
                         f"{torch.cuda.get_device_name()} (torch {torch.__version__}, N=2)", "streams": True,
               "points": points},
              open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
