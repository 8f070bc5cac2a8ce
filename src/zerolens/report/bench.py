"""`zerolens bench`: step time, throughput, MFU and peak memory of each strategy, on the same model
and data, in one run.

Each strategy trains `warmup + steps` steps; the timed ones are synchronised (the GPU's queue is
drained before and after each), a step's time is the slowest rank's, and the figure is the median
over the timed steps. Peak memory is the CUDA allocator's peak over every step, warm-up included
(the optimizer's states appear in the first). The steps run in the one training loop (train.py)
with a probe that only times them (measure.StepTimer); this module holds the summary
(`bench_summary`) and its presentation (`render_bench`).
"""
from __future__ import annotations

import os
from statistics import median

from zerolens.measure.matmul import SIZE
from zerolens.models.data import make_batch
from zerolens.models.flops import flops_per_token
from zerolens.report.tables import SCHEMA_VERSION, markdown_table
from zerolens.strategies import registry
from zerolens.strategies.base import PHASES
from zerolens.units import GiB, MiB

# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by the exact name CUDA
# reports. PCIe and NVL parts are slower than SXM: an unknown name gets no MFU (use --peak-tflops).
DATASHEET_PEAK_TFLOPS = {
    "NVIDIA H200": {"bf16": 989.4, "fp16": 989.4},  # SXM
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "fp16": 989.4},  # SXM
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp16": 312.0},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0, "fp16": 312.0},
}


# Every strategy is compared with this one (bench.json's key names it, "vs_<reference>").
REFERENCE = registry.BENCH_REFERENCE
VS = f"vs_{REFERENCE}"


def datasheet_peak(device_name: str, precision: str) -> float | None:
    return DATASHEET_PEAK_TFLOPS.get(device_name, {}).get(precision)


def predicted_peak(config, prediction: dict | None, measured: int | None, measured_reserved: int | None = None,
                   alloc_conf: str = "") -> dict:
    """The largest rank's peak as predicted before training, and its error against the measured one
    (CUDA); on CUDA also the largest rank's reserved peak, predicted for the run's allocator setting
    (`alloc_conf`, its PYTORCH_CUDA_ALLOC_CONF) beside measured; or why it was not predicted."""
    from zerolens.predict.allocator import allocator_setting
    if not prediction or "ranks" not in prediction:
        return {"predicted_peak_bytes": None,
                "peak_not_predicted": (prediction or {}).get("why_not", "not predicted in this run")}
    compared = config.device == "cuda" or cpu_step_is_traced(config)
    peak = max(max(predicted_phases(config, r).values()) for r in prediction["ranks"])
    out = {"predicted_peak_bytes": peak,
           "peak_prediction_error": peak / measured - 1 if compared and measured else None}
    if config.device == "cuda" and all("reserved_peak_bytes" in r for r in prediction["ranks"]):
        setting, _ = allocator_setting(alloc_conf)
        reserved = max(r["reserved_peak_bytes"][setting] for r in prediction["ranks"])
        out |= {"predicted_reserved_peak_bytes": reserved, "allocator_setting": setting,
                "reserved_prediction_error": reserved / measured_reserved - 1 if measured_reserved else None}
    return out


def cpu_step_is_traced(config) -> bool:
    """On the CPU bench measures its last warm-up step (measure/timer.py): from the third step on, the
    steps allocate as the prediction's last traced one (predict/peak.py's STEPS), to compare with."""
    from zerolens.predict.peak import STEPS
    return config.device == "cpu" and config.warmup_steps >= STEPS


def predicted_phases(config, rank: dict) -> dict[str, int]:
    """A rank's predicted peak per phase as bench measures it: on CUDA over every step traced; on the
    CPU, the last traced step's (the warm-up step measured is like it: cpu_step_is_traced)."""
    source = rank["last_step"] if config.device == "cpu" else rank
    return {f"peak_during_{phase}": source[f"peak_during_{phase}"] for phase in PHASES}


def phase_peaks(config, per_rank: list[dict], prediction: dict | None, earlier: int) -> list[dict]:
    """Each rank's peak of each phase, beside the peak predicted before training and its relative
    error: on CUDA over every step (warm-up included), on the CPU of the last warm-up step (where it
    is like the last step traced: cpu_step_is_traced); [] otherwise, or where earlier strategies'
    memory is in the peaks."""
    if (config.device != "cuda" and not cpu_step_is_traced(config)) or earlier:
        return []
    rows = []
    for rank, measured in enumerate(per_rank):
        for phase in PHASES:
            got = measured.get(f"peak_during_{phase}")
            want = (predicted_phases(config, prediction["ranks"][rank])[f"peak_during_{phase}"]
                    if prediction and "ranks" in prediction else None)
            rows.append({"rank": rank, "phase": phase, "measured_bytes": got, "predicted_bytes": want,
                         "error": want / got - 1 if want is not None and got else None})
    return rows


def bench_summary(config, rounds: list[list[list[dict]]], params: int, device_name: str,
                  versions: dict, predicted: dict | None = None, references: dict | None = None) -> dict:
    """rounds[k][rank][i]: rank's result for config.strategies[i] in round k (each round ran every
    strategy, in its own processes). Step times are pooled over the rounds; each ratio to the reference
    is the median of the rounds' ratios (each round's median step against the reference's in the same
    round), with their range. Memory is the first round's: every round allocates alike. `predicted`:
    the run's predicted_peaks.json (predict.peak.predicted_peaks), made before training.
    `references[name][k][rank]`: the results of strategy `name`'s reference loop in round k (run/reference.py),
    against which each round's median step gives the harness's overhead."""
    global_batch = config.micro_batch * config.nproc  # of one micro-batch; a step has config.grad_accum of them
    # A user's model: "tokens" are the elements of its inputs (its FLOPs are counted: models/flops.py).
    tokens_per_step = config.grad_accum * (make_batch(config.model, 0, seed=config.seed, batch_size=global_batch,
                                                      signal=config.signal)[0].numel()
                                           if config.model.kind == "user" else global_batch * config.model.seq_len)
    counted = flops_per_token(config.model, params, micro_batch=config.micro_batch, seed=config.seed)
    per_token = counted["flops_per_token"]  # None: not counted (counted["flop_count"] says why)
    peak_tflops, peak_source = config.peak_tflops, "--peak-tflops"
    if peak_tflops is None:
        peak_tflops = datasheet_peak(device_name, config.precision) if config.device == "cuda" else None
        peak_source = f"NVIDIA datasheet, {device_name}, dense {config.precision}" if peak_tflops else None
    # Each strategy's processes measured the GPU's matrix-product rate after training (measure/matmul.py):
    # the slowest rank's in each, the median over them
    measured_rates = [min(rates) for gathered in rounds for i in range(len(config.strategies))
                      if None not in (rates := [gathered[r][i].get("matmul_tflops") for r in range(config.nproc)])]
    matmul_rate = median(measured_rates) if measured_rates else None
    timed = {name: [round_steps(config, [gathered[r][i] for r in range(config.nproc)]) for gathered in rounds]
             for i, name in enumerate(config.strategies)}
    strategies = {}
    for i, name in enumerate(config.strategies):
        per_rank = [rounds[0][r][i] for r in range(config.nproc)]
        step_times = [t for steps in timed[name] for t in steps["timed"]]
        step_time = median(step_times)
        tflops = per_token * tokens_per_step / config.nproc / step_time / 1e12 if per_token else None
        peaks = [r["peak_bytes"] for r in per_rank]
        # Another launcher ran it after a strategy that left memory allocated: that memory is in these
        # peaks, which are then kept aside under a name that says so, never reported as its own.
        earlier = max(r.get("earlier_strategies_left_bytes", 0) for r in per_rank)
        peak = max(peaks) if None not in peaks and not earlier else None
        reserved_peaks = [r.get("reserved_peak_bytes") for r in per_rank]
        reserved = max(reserved_peaks) if None not in reserved_peaks and not earlier else None
        strategies[name] = {
            "step_time_s": step_time, "step_times_s": step_times,
            "warmup_step_times_s": timed[name][0]["warmup"],
            "round_step_times_s": [median(steps["timed"]) for steps in timed[name]],
            "phase_seconds": phase_breakdown(step_times, [p for steps in timed[name] for p in steps["timed_phases"]]),
            **communication_of(per_rank),
            "tokens_per_s": tokens_per_step / step_time, "tflops_per_gpu": tflops,
            "mfu": tflops / peak_tflops if peak_tflops and tflops else None,
            "mfu_vs_measured_matmul": tflops / matmul_rate if matmul_rate and tflops else None,
            "peak_bytes": peak,
            "peak_bytes_per_rank": peaks if not earlier else [None] * len(peaks),
            "setup_peak_bytes_per_rank": [r["setup_peak_bytes"] for r in per_rank] if not earlier else None,
            "allocated_at_start_bytes_per_rank": [r["allocated_at_start_bytes"] for r in per_rank],
            "earlier_strategies_left_bytes": earlier,
            "peak_bytes_including_earlier_strategies_per_rank": peaks if earlier else None,
            "left_allocated_after_teardown_bytes": per_rank[0].get("left_allocated_by_this_strategy_bytes", 0),
            "losses": per_rank[0]["losses"], "settings": per_rank[0]["settings"], "notes": per_rank[0]["notes"],
            "reserved_peak_bytes": reserved,
            **predicted_peak(config, (predicted or {}).get(name), peak, reserved,
                             os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")),
            "phase_peaks": phase_peaks(config, per_rank, (predicted or {}).get(name), earlier),
        }
    for name, reference in (references or {}).items():
        loop = [median(round_steps(config, per_rank)["timed"]) for per_rank in reference]
        overheads = [mine / theirs - 1 for mine, theirs in zip(strategies[name]["round_step_times_s"], loop, strict=True)]
        strategies[name] |= {"reference_loop": reference[0][0]["settings"]["loop"], "reference_round_step_times_s": loop,
                             "harness_overhead": median(overheads),
                             "harness_overhead_range": [min(overheads), max(overheads)]}
    for s in strategies.values():
        ref = strategies.get(REFERENCE)
        s[VS] = None if ref is None else {
            **step_time_ratio(s["round_step_times_s"], ref["round_step_times_s"]),
            "peak_bytes": s["peak_bytes"] / ref["peak_bytes"] if s["peak_bytes"] and ref["peak_bytes"] else None}
    return {"schema_version": SCHEMA_VERSION, "device": config.device, "device_name": device_name,
            "world_size": config.nproc,
            "precision": config.precision, "preset": config.preset, "model": config.to_json()["model"],
            "params": params, "micro_batch": config.micro_batch, "grad_accum": config.grad_accum,
            "tokens_per_step": tokens_per_step,
            "warmup_steps": config.warmup_steps, "timed_steps": config.steps, "rounds_run": len(rounds),
            "flops_per_token": per_token, "flop_count": counted["flop_count"],
            "peak_tflops": peak_tflops, "peak_tflops_source": peak_source,
            "measured_matmul_tflops": matmul_rate,
            "measured_matmul": (f"{SIZE} x {SIZE} products in {config.precision}, in each strategy's processes after "
                                "its training (the slowest rank's), median over them") if matmul_rate else None,
            "versions": versions, "strategies": strategies,
            "rounds": [{"round": k + 1, "strategy": name, "step_time_s": median(timed[name][k]["timed"]),
                        "step_times_s": timed[name][k]["timed"], "warmup_step_times_s": timed[name][k]["warmup"],
                        "process_ids": [rounds[k][rank][i].get("process_id") for rank in range(config.nproc)]}
                       for k in range(len(rounds)) for i, name in enumerate(config.strategies)]}


def communication_of(per_rank: list[dict]) -> dict:
    """Seconds of communication kernels in the profiled warm-up step (measure/overlap.py), and of those
    no computation overlapped: the largest rank's of each; None where no step was profiled (the CPU, or
    no warm-up step)."""
    found = [r["communication"] for r in per_rank if r.get("communication")]
    return {f"{key}_s": max(c[key] for c in found) if len(found) == len(per_rank) else None
            for key in ("communication", "communication_not_overlapped")}


def round_steps(config, per_rank: list[dict]) -> dict[str, list]:
    """One strategy's step times in one round: a data-parallel step ends when its slowest rank does;
    the warm-up steps apart from the timed ones; and the slowest rank's time in each phase of each
    timed step (`timed_phases`)."""
    steps = range(config.warmup_steps + config.steps)
    slowest = [max(per_rank, key=lambda r: r["seconds"][s]) for s in steps]
    seconds = [rank["seconds"][s] for s, rank in zip(steps, slowest)]
    phases = [rank.get("phase_seconds", [{}] * len(steps))[s] for s, rank in zip(steps, slowest)]
    return {"warmup": seconds[:config.warmup_steps], "timed": seconds[config.warmup_steps:],
            "timed_phases": phases[config.warmup_steps:]}


def phase_breakdown(step_times: list[float], phases: list[dict]) -> dict | None:
    """Where a step's time goes: the median over the timed steps of each phase's time (on CUDA its
    time on the GPU's timeline, between events recorded into the stream; on the CPU the host's) and
    of the rest of the step (zeroing gradients, the loop's own work, what no phase covers)."""
    if not phases or any(p.get(name) is None for p in phases for name in PHASES):
        return None
    return {**{name: median(p[name] for p in phases) for name in PHASES},
            "other": median(t - sum(p[name] for name in PHASES) for t, p in zip(step_times, phases))}


def step_time_ratio(mine: list[float], reference: list[float]) -> dict:
    """A strategy's step time against the reference's: the median of the rounds' ratios (each round's
    median against the reference's of the same round) and their range; a range that holds 1.0 is no
    measurable difference (`step_time_differs` False), as is a ratio of one round alone (None: not
    known)."""
    ratios = [a / b for a, b in zip(mine, reference, strict=True)]
    low, high = min(ratios), max(ratios)
    return {"step_time": median(ratios), "step_time_range": [low, high], "step_time_rounds": ratios,
            "step_time_differs": None if len(ratios) < 2 else not low <= 1.0 <= high}


def render_bench(summary: dict, command: str) -> str:
    rows = []
    for name, s in summary["strategies"].items():
        vs = s[VS] or {}
        rows.append([name, f"{s['step_time_s'] * 1e3:.1f}", step_ratio_text(name, vs),
                     f"{s['tokens_per_s']:,.0f}", "-" if s["tflops_per_gpu"] is None else f"{s['tflops_per_gpu']:.1f}",
                     "-" if s["mfu"] is None else f"{s['mfu']:.1%}",
                     "-" if s["peak_bytes"] is None else f"{s['peak_bytes'] / GiB:.2f}", _ratio(vs.get("peak_bytes")),
                     "-" if s.get("predicted_peak_bytes") is None else f"{s['predicted_peak_bytes'] / GiB:.2f}"
                     + ("" if s.get("peak_prediction_error") is None else f" ({s['peak_prediction_error']:+.2%})"),
                     f"{s['losses'][0]:.3f} -> {s['losses'][-1]:.3f}"])
    table = markdown_table(["strategy", "step (ms, median)", f"vs {REFERENCE}", "tokens/s", "TFLOP/s per rank", "MFU",
                            "peak per rank (GiB, max)", f"vs {REFERENCE}", "peak predicted before training (GiB, error)",
                            "loss"], rows)
    flops = (f"FLOPs per token {summary['flops_per_token']:,.0f}: {summary['flop_count']}." if summary["flops_per_token"]
             else f"FLOPs {summary['flop_count']} (no TFLOP/s or MFU).")
    if summary["model"].get("kind") == "user":
        flops += " A token is one element of the model's inputs."
    accumulated = (f" x {summary['grad_accum']} micro-batches per step (gradient accumulation)"
                   if summary.get("grad_accum", 1) > 1 else "")
    mfu = (f"MFU divides by {summary['peak_tflops']} TFLOP/s ({summary['peak_tflops_source']})."
           if summary["peak_tflops"] else "No MFU: no peak FLOP/s is known for this device (give --peak-tflops).")
    if summary.get("measured_matmul_tflops"):
        mfu += " " + measured_mfu_text(summary)
    peak = ("Peak: the CUDA allocator's peak over all steps, warm-up included; the largest rank."
            if summary["device"] == "cuda" else
            "Peak: the last warm-up step's (not a timed one), every tensor followed by torch's MemTracker as "
            "verify's CPU peaks are (the CPU has no allocator to ask); the largest rank." if summary["strategies"]
            and any(s["peak_bytes"] is not None for s in summary["strategies"].values()) else
            "Peak: measured on the CPU in the last warm-up step, and this run had none (--warmup 0).")
    reserved = [f"{name} {s['reserved_peak_bytes'] / GiB:.3f} GiB measured, {s['predicted_reserved_peak_bytes'] / GiB:.3f} "
                f"predicted" + ("" if s["reserved_prediction_error"] is None else f" ({s['reserved_prediction_error']:+.2%})")
                for name, s in summary["strategies"].items()
                if s.get("predicted_reserved_peak_bytes") is not None and s.get("reserved_peak_bytes") is not None]
    if reserved:
        setting = next(s["allocator_setting"] for s in summary["strategies"].values() if "allocator_setting" in s)
        peak += (" Reserved peak (what the caching allocator held from the driver at its highest; the largest rank), "
                 "predicted by replaying the trace's allocations through a model of the allocator "
                 f"({setting.replace('_', ' ')}): " + "; ".join(reserved) + ".")
    phase_rows = [[name, r["rank"], r["phase"], "-" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / MiB:.1f}",
                   "-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / MiB:.1f}",
                   "-" if r["error"] is None else f"{r['error']:+.2%}"]
                  for name, s in summary["strategies"].items() for r in s.get("phase_peaks", [])]
    measured_where = ("allocator peak of each phase over every step, warm-up included" if summary["device"] == "cuda"
                      else "peak of each phase in the last warm-up step, beside the last traced step's")
    phases = ("\n## Peaks per phase, predicted before training and measured\n\nEach rank's "
              f"{measured_where} (MiB), and the prediction's error.\n\n"
              + markdown_table(["strategy", "rank", "phase", "predicted", "measured", "error"], phase_rows) + "\n"
              if phase_rows else "")
    profiled = any(s.get("communication_s") is not None for s in summary["strategies"].values())
    breakdown_rows = [[name, *(f"{s['phase_seconds'][part] * 1e3:.1f}" for part in (*PHASES, "other")),
                       *([ms(s.get("communication_s")), ms(s.get("communication_not_overlapped_s"))] if profiled else [])]
                      for name, s in summary["strategies"].items() if s.get("phase_seconds")]
    breakdown = ("\n## Where a step's time goes\n\nMedian over the timed steps (ms) of the slowest rank's time in each "
                 "phase: on CUDA on the GPU's timeline, between events recorded into the stream; on the CPU the "
                 "host's. \"other\": the rest of the step (zeroing gradients, the loop's own work)."
                 + (" \"communication\": the time NCCL's kernels ran in the last warm-up step, profiled with "
                    "torch.profiler (never a timed step), and \"not overlapped\": how much of it no computation "
                    "kernel ran beside, the largest rank's." if profiled else "") + "\n\n"
                 + markdown_table(["strategy", *PHASES, "other", *(["communication", "not overlapped"] if profiled
                                                                  else [])], breakdown_rows) + "\n"
                 if breakdown_rows else "")
    overhead_rows = [[name, s["reference_loop"], f"{s['step_time_s'] * 1e3:.1f}",
                      f"{median(s['reference_round_step_times_s']) * 1e3:.1f}", overhead_text(s)]
                     for name, s in summary["strategies"].items() if "harness_overhead" in s]
    overheads = ("\n## The harness's own cost\n\nEach strategy beside a loop written as its users write it, "
                 "without zerolens (run/reference.py), with the same model, batches and settings, timed the same "
                 "way in every round: the overhead is the median over the rounds of zerolens's median step against "
                 "the loop's in the same round, less 1, with its range.\n\n"
                 + markdown_table(["strategy", "reference loop", "step (ms)", "reference step (ms, median of rounds)",
                                   "overhead"], overhead_rows) + "\n" if overhead_rows else "")
    notes = "".join(f"\n- {n}" for s in summary["strategies"].values() for n in s["notes"])
    for name, s in summary["strategies"].items():
        if s["earlier_strategies_left_bytes"]:
            notes += (f"\n- {name}: started with {s['earlier_strategies_left_bytes'] / GiB:.2f} GiB left allocated by "
                      "earlier strategies in the same processes (a launcher other than zerolens's), so its peak is not "
                      "reported; run it in a launch of its own.")
        elif s["left_allocated_after_teardown_bytes"] and name != list(summary["strategies"])[-1]:
            notes += (f"\n- {name} left {s['left_allocated_after_teardown_bytes'] / GiB:.3f} GiB allocated after its "
                      "teardown: the strategies after it ran in fresh processes, so it is in none of their peaks.")
    return f"""# zerolens bench

Command: `{command}`

{summary['preset']} ({summary['params']:,} parameters), {summary['world_size']} x {summary['device_name']},
{summary['precision']}, micro-batch {summary['micro_batch']} per rank{accumulated}, {summary['tokens_per_step']:,} tokens per step.
Step time: median of {summary['timed_steps']} synchronised steps after {summary['warmup_steps']} warm-up steps,
each step's slowest rank{rounds_text(summary)}. {flops} {mfu}
{peak}

{table}
{breakdown}{overheads}{phases}
{"Notes:" + notes if notes else ""}
"""


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def step_ratio_text(name: str, vs: dict | None, digits: int = 3) -> str:
    """The step-time ratio to the reference, with its range over rounds where there are several, and
    "no difference" where that range holds 1.0: "0.953 (0.927-0.997)". The reference's own is 1."""
    if not vs:
        return "-"
    if name == REFERENCE:
        return _ratio(vs["step_time"])
    low, high = vs["step_time_range"]
    text = f"{vs['step_time']:.{digits}f}"
    if vs["step_time_differs"] is None:
        return text
    return f"{text} ({low:.{digits}f}-{high:.{digits}f})" + ("" if vs["step_time_differs"] else ", no difference")


def overhead_text(s: dict) -> str:
    """The overhead's median and range over the rounds; one whose rounds hold 0 (the harness faster in
    some, slower in others: tiny steps on a CPU) is no measurable overhead, as a ratio's range holding 1."""
    low, high = s["harness_overhead_range"]
    return f"{s['harness_overhead']:+.2%}" + ("" if low == high else f" ({low:+.2%} to {high:+.2%}"
                                              + (", none measurable)" if low <= 0 <= high else ")"))


def measured_mfu_text(summary: dict) -> str:
    """MFU against the matrix-product rate measured in the run, one sentence."""
    return (f"Against the matrix-product rate measured in this run, {summary['measured_matmul_tflops']:.1f} TFLOP/s "
            f"({summary['measured_matmul']}): " + ", ".join(
                f"{name} {s['mfu_vs_measured_matmul']:.1%}" for name, s in summary["strategies"].items()
                if s.get("mfu_vs_measured_matmul") is not None) + ".")


def rounds_text(summary: dict) -> str:
    rounds = summary.get("rounds_run", 1)
    if rounds == 1:
        return "; one round: no spread to judge a ratio by (--rounds)"
    return (f"; {rounds} rounds, the strategies interleaved and each in its own processes, the steps pooled; a "
            f"ratio to {REFERENCE} is the median of the rounds' (each round's median step against {REFERENCE}'s "
            "in that round), with their range, and \"no difference\" where that range holds 1.0")


def bench_terminal_lines(summary: dict, out) -> list:
    """bench's result for the terminal: one table, the notes' count, where the files are."""
    from zerolens.report.tables import in_unit, terminal_table, unit_for
    strategies = summary["strategies"]
    unit, label = unit_for([s[k] for s in strategies.values() for k in ("peak_bytes", "predicted_peak_bytes")
                            if s.get(k) is not None])
    rows = []
    for name, s in strategies.items():
        vs = s[VS] or {}
        error = s.get("peak_prediction_error")
        rows.append([name, f"{s['step_time_s'] * 1e3:.1f}", step_ratio_text(name, s[VS], 2), f"{s['tokens_per_s']:,.0f}",
                     "-" if s["mfu"] is None else f"{s['mfu']:.1%}", in_unit(s["peak_bytes"], unit, 2),
                     _ratio(vs.get("peak_bytes")),
                     in_unit(s.get("predicted_peak_bytes"), unit, 2) + ("" if error is None else f" ({error:+.1%})")])
    notes = sum(len(s["notes"]) for s in strategies.values())
    where = ("the last warm-up step's, followed tensor by tensor (the CPU has no allocator to ask)"
             if summary["device"] == "cpu" else "the allocator's over every step")
    rounds = summary.get("rounds_run", 1)
    steps = f"{summary['timed_steps']} timed steps" + (f" x {rounds} interleaved rounds" if rounds > 1 else "")
    ratios = "median (range) over the rounds" if rounds > 1 else "one round"
    return ["", f"{summary['preset']}, {summary['world_size']} x {summary['device_name']}, {summary['precision']}: "
            f"median of {steps}, the slowest rank's; vs {REFERENCE}: {ratios}; peak: the largest rank's, {where}.",
            terminal_table(["strategy", "step (ms)", f"vs {REFERENCE}", "tokens/s", "MFU", f"peak {label}",
                            f"vs {REFERENCE}", f"predicted {label}"], rows, right={1, 2, 3, 4, 5, 6, 7}),
            *([measured_mfu_text(summary)] if summary.get("measured_matmul_tflops") else []),
            *(["The harness's overhead against loops written without zerolens: " + ", ".join(
                f"{name} {overhead_text(s)}" for name, s in strategies.items() if "harness_overhead" in s) + "."]
              if any("harness_overhead" in s for s in strategies.values()) else []),
            f"Report: {out / 'bench.md'} ({notes} note{'' if notes == 1 else 's'} there); bench.json and bench.png "
            "beside it."]
