"""From the per-rank results gathered on rank 0 to summary.json: figures, predictions, checks, notes."""
from __future__ import annotations

import os
from statistics import median

from zerolens.models.model import trained_elements
from zerolens.predict.allocator import allocator_setting
from zerolens.report.checks import (
    MIN_STEPS_TO_JUDGE_LEARNING,
    allocator_check,
    loss_fell,
    loss_matches,
    peak_check,
    peak_prediction_check,
    prediction_check,
    zero_gradient_checks,
)
from zerolens.report.tables import SCHEMA_VERSION
from zerolens.strategies import registry
from zerolens.strategies.layout import ELEMENT_BYTES, RETAINED_KEYS, deepspeed_layout, deepspeed_step_bytes
from zerolens.units import size


def median_step_seconds(records: list[dict]) -> float | None:
    """Forward + backward + step wall time (CUDA: synchronised), median over the steps between the
    first (warm-up: the optimizer's states are allocated there) and the last (measured in detail,
    slower). None with fewer than 3 steps."""
    middle = records[1:-1]
    if not middle:
        return None
    return median(r["seconds_forward"] + r["seconds_backward"] + r["seconds_step"] for r in middle)


def rank_summary(rank: int, records: list[dict]) -> dict:
    """Retained figures from the last step; peaks over all steps (None where not measured)."""
    last = records[-1]

    def peak(key):
        values = [r[key] for r in records if key in r]
        return max(values) if values else None

    phases = ("forward", "backward", "step")
    # CUDA: the allocator's peak per phase, every step; CPU: the tracker's, on the last step.
    peaks = [p for p in (peak(f"peak_during_{ph}") for ph in phases) if p is not None]
    reserved = [p for p in (peak(f"reserved_peak_during_{ph}") for ph in phases) if p is not None]
    return {
        "rank": rank,
        "grad_bytes_after_backward": last["grad_bytes_after_backward"],
        "grad_bytes_after_step": last["grad_bytes_after_step"],
        "grad_partition_elements": last["grad_partition_elements_after_backward"],
        "param_bytes": last["param_bytes_after_step"],
        "optimizer_state_bytes": last["optimizer_state_bytes_after_step"],
        "comm_buffer_bytes_after_backward": last["comm_buffer_bytes_after_backward"],
        "comm_buffer_bytes_after_step": last["comm_buffer_bytes_after_step"],
        "activation_bytes_after_forward": last["activation_bytes_after_forward"],
        "allocated_after_backward": last.get("allocated_after_backward"),
        "allocated_after_step": last.get("allocated_after_step"),
        "cublas_workspace_bytes": last.get("cublas_workspace_bytes"),
        "census_block_rounding_after_step": last.get("census_block_rounding_after_step"),
        "leftover_bytes_at_end": last.get("leftover_bytes_at_end"),
        "reserved_after_step": last.get("reserved_after_step"),
        "outside_allocator_after_step": last.get("outside_allocator_after_step"),
        "peak_during_forward": peak("peak_during_forward"),
        "peak_during_backward": peak("peak_during_backward"),
        "peak_during_step": peak("peak_during_step"),
        "peak_bytes": max(peaks) if peaks else None,
        # CUDA: what the allocator had reserved from the driver at its highest in each phase. Less the
        # allocated peak, that is the fragmentation the peak prediction does not predict.
        **{f"reserved_peak_during_{ph}": peak(f"reserved_peak_during_{ph}") for ph in phases},
        "reserved_peak_bytes": max(reserved) if reserved else None,
        "peak_anatomy": last.get("peak_anatomy"),
        # CPU, the last step: what a collective's own thread freed in each phase (checks.peak_prediction_check)
        "freed_by_other_threads": {ph: last[f"freed_by_other_threads_during_{ph}"] for ph in phases
                                   if f"freed_by_other_threads_during_{ph}" in last},
        "median_step_seconds": median_step_seconds(records),
        "alloc_retries": last.get("alloc_retries"),
        "ooms": last.get("ooms"),
    }


PEAK_KEYS = ("peak_during_forward", "peak_during_backward", "peak_during_step", "peak_bytes", "reserved_peak_bytes",
             "reserved_peak_during_forward", "reserved_peak_during_backward", "reserved_peak_during_step",
             "peak_anatomy")


def without_earlier_memory(rank: dict, earlier_left: int) -> dict:
    """No figure reported as a strategy's peak may hold another strategy's memory. Under zerolens's
    own launcher a strategy never starts with any (run_strategies); under another launcher one
    can, and then its peaks are moved aside, under a name that says what they include."""
    if not earlier_left or rank["peak_bytes"] is None:
        return rank
    return {**rank, **dict.fromkeys(PEAK_KEYS),
            "peaks_including_earlier_strategies": {k: rank.get(k) for k in PEAK_KEYS if k != "peak_anatomy"}}


def build_summary(config, gathered: list[list[dict]], param_numels: list[int],
                  versions: dict, param_shapes: list[tuple[int, ...]] | None = None,
                  metrics: dict | None = None, predicted_peaks: dict | None = None, weight_bytes: int = 4,
                  trainable: list[bool] | None = None) -> dict:
    """gathered[rank] is that rank's list of per-strategy results, in config.strategies order.
    `predicted_peaks` is predict.peak.predicted_peaks of the run; `weight_bytes`, the element size of
    the model's weights as built (models.model.weight_bytes); `trainable`, which parameters train
    (models.model.trainable_flags; None: all).
    FSDP2's predictions need the parameters' shapes as well as their sizes. `metrics` is the check
    of the ranks' own metrics files (checks.metrics_complete)."""
    strategies = {}
    for i, name in enumerate(config.strategies):
        per_rank = [gathered[r][i] for r in range(config.nproc)]
        rank0 = per_rank[0]
        strategies[name] = {
            "losses": rank0["losses"],
            "skipped_steps": sum(not rec["step_applied"] for rec in rank0["records"]),
            "seconds": max(p["seconds"] for p in per_rank),
            "settings": rank0["settings"],
            "ranks": [without_earlier_memory(rank_summary(r, p["records"]), p.get("earlier_strategies_left_bytes", 0))
                      | {"allocated_at_start": p["allocated_at_start"],
                         "earlier_strategies_left_bytes": p.get("earlier_strategies_left_bytes", 0)}
                      for r, p in enumerate(per_rank)],
            "left_allocated_after_teardown_bytes": rank0.get("left_allocated_by_this_strategy_bytes", 0),
        }
        step_bytes = deepspeed_step_bytes(config.ds_config, config.ds_override)  # DeepSpeed's FusedAdam: none
        for r, rank in enumerate(strategies[name]["ranks"]):
            predicted = registry.predict_retained(name, param_numels, config.nproc, r, config.precision,
                                         reduce_bucket_size=config.reduce_bucket_size, param_shapes=param_shapes,
                                         deepspeed=deepspeed_layout(versions.get("deepspeed")),
                                         param_persistence_threshold=config.param_persistence_threshold,
                                         weight_bytes=weight_bytes, trainable=trainable,
                                         deepspeed_step_bytes=step_bytes)
            rank["predicted"] = {k: predicted[k] for k in RETAINED_KEYS}
        prediction = (predicted_peaks or {}).get(name, {"why_not": "not predicted in this run"})
        if "ranks" in prediction:
            for r, rank in enumerate(strategies[name]["ranks"]):
                rank["predicted_peaks"] = prediction["ranks"][r]
        else:
            strategies[name]["peak_not_predicted"] = prediction["why_not"]
    base = strategies[config.baseline]
    checks = []
    for name, s in strategies.items():
        if registry.spec(name).flat_partition and config.nproc > 1:
            trained = param_numels if trainable is None else [n for n, t in zip(param_numels, trainable) if t]
            checks += zero_gradient_checks(name, s["ranks"], base["ranks"], trained, config.precision)
    checks += [prediction_check(name, rank) for name, s in strategies.items() for rank in s["ranks"]]
    # A rank whose peaks hold an earlier strategy's memory (another launcher) has none to compare.
    # The allocator's settings the ranks ran under (CUDA), which its model's prediction follows.
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if config.device == "cuda" else None
    setting = allocator_setting(alloc_conf or "")[0]
    checks += [peak_prediction_check(name, rank, setting, accumulating=config.grad_accum > 1)
               for name, s in strategies.items() for rank in s["ranks"]
               if "predicted_peaks" in rank and rank.get("peak_bytes") is not None]
    if config.device == "cuda":
        for name, s in strategies.items():
            for rank in s["ranks"]:
                # Under another launcher, memory an earlier strategy left can be released in the middle
                # of this one; what is left of it at the end is subtracted by the allocator check.
                checks.append(allocator_check(name, rank))
                checks += [peak_check(name, rank["rank"], phase, anatomy)
                           for phase, anatomy in (rank["peak_anatomy"] or {}).items()]
    not_checked = [{"name": f"peak as predicted ({name})", "why": s["peak_not_predicted"]}
                   for name, s in strategies.items() if "peak_not_predicted" in s]
    if config.steps >= MIN_STEPS_TO_JUDGE_LEARNING:
        checks += [loss_fell(name, s["losses"]) for name, s in strategies.items()]
    else:
        not_checked.append({"name": "loss fell", "why": f"{config.steps} steps are too few to tell whether the loss "
                            f"falls: run --steps {MIN_STEPS_TO_JUDGE_LEARNING} or more for that (the memory checks "
                            "do not need it)"})
    checks += [loss_matches(name, s["losses"], config.baseline, base["losses"], config.precision)
               for name, s in strategies.items() if name != config.baseline]
    if metrics is not None:
        checks.append(metrics)
    notes = [note for note in (config.device_note, config.precision_note) if note]
    notes += [note for i in range(len(config.strategies)) for note in gathered[0][i]["notes"]]
    trained_psi = trained_elements(param_numels, trainable)
    long, headline_notes = bucket_notes(config, strategies, trained_psi)  # a frozen one has no gradient
    notes += long
    notes += persistent_parameter_notes(config, strategies)
    notes += leftover_notes(config, strategies, gathered)
    skipped = {n: s["skipped_steps"] for n, s in strategies.items() if s["skipped_steps"]}
    if skipped:
        notes.append("fp16 dynamic loss scaling skipped steps that overflowed (strategy: steps): "
                     + ", ".join(f"{n}: {k}" for n, k in skipped.items()))
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": "PASS" if all(c["passed"] for c in checks) else "FAIL",
        "world_size": config.nproc, "device": config.device, "precision": config.precision,
        "baseline": config.baseline, "steps": config.steps, "grad_accum": config.grad_accum,
        "param_count": sum(param_numels),
        "notes": notes, "headline_notes": headline_notes, "checks": checks, "not_checked": not_checked,
        "strategies": strategies, "versions": versions,
        "alloc_conf": alloc_conf,
    }


def leftover_notes(config, strategies: dict, gathered: list[list[dict]]) -> list[str]:
    """What a strategy left allocated after its teardown, and what zerolens did about it."""
    notes = []
    names = list(strategies)
    for i, name in enumerate(names):
        left = strategies[name]["left_allocated_after_teardown_bytes"]
        if not left or i + 1 == len(names):
            continue
        later = names[i + 1:]
        if any(r["earlier_strategies_left_bytes"] for s in later for r in strategies[s]["ranks"]):
            notes.append(f"{name} left {size(left)} allocated after its teardown, and {', '.join(later)} ran "
                         "after it in the same processes (a launcher other than zerolens's): their peaks are not "
                         "reported as theirs (summary.json keeps them as peaks_including_earlier_strategies); run "
                         "one strategy per launch, or use zerolens verify, for clean peaks")
        else:
            notes.append(f"{name} left {size(left)} allocated after its teardown; {', '.join(later)} ran in "
                         "fresh worker processes, so that none of their figures includes it")
    for i, name in enumerate(config.strategies):
        if gathered[0][i].get("leftover_sources"):
            notes.append(f"{name} started with memory of earlier strategies allocated, on rank 0: "
                         f"{leftover_text(gathered[0][i]['leftover_sources'])}")
    return notes


def leftover_text(sources: dict[str, int]) -> str:
    """The three largest allocating sites of leftover memory, then what still refers to it."""
    sized = [f"allocated by {src} {size(b)}" for src, b in sources.items() if b][:3]
    return ", ".join(sized + [src for src, b in sources.items() if not b])


def recommended_bucket(psi: int, world_size: int) -> int:
    """A reduce bucket no larger than one rank's share of the gradients, rounded down to one
    significant digit: large enough to batch the reductions, small enough not to dominate."""
    share = max(1, psi // world_size)
    scale = 10 ** (len(str(share)) - 1)
    return share // scale * scale


def advised_bucket(reduce_bucket_size: float, psi: int, world_size: int) -> int | None:
    """The bucket verify, estimate and plan advise where `reduce_bucket_size` outweighs all the gradients
    (`psi` elements that train; ZeRO's bucket alone can then need more than the baseline's whole step):
    recommended_bucket; None where it does not."""
    return recommended_bucket(int(psi), world_size) if reduce_bucket_size > psi else None


def bucket_notes(config, strategies: dict, psi: int) -> tuple[list[str], list[str]]:
    """The case study's pitfall: a reduce bucket larger than all gradients (ZeRO-1/2 allocate it on
    every backward, ZeRO-3 keeps one: the registry says which), measured against the baseline's peak
    where the allocator can tell. `psi`: the elements of the parameters that train. (The notes for
    report.md, and one line each for the terminal where the strategy's peak is above the baseline's
    or was not measured: a bucket that outweighs the gradients while sharding still saves memory is no alarm.)"""
    advised = advised_bucket(config.reduce_bucket_size, psi, config.nproc)
    if advised is None:
        return [], []
    element = ELEMENT_BYTES[config.precision]
    bucket, grads = config.reduce_bucket_size * element, psi * element
    notes, headlines = [], []
    base = strategies[config.baseline]["ranks"][0]["peak_bytes"]
    lifetime = {"every backward": "allocated on every backward", "whole run": "kept for the whole run"}
    recommended = f"{advised:.0e}"
    try_bucket = (f"Try zero_optimization.reduce_bucket_size {recommended} in the --ds-config file" if config.ds_config
                  else f"Try --reduce-bucket-size {recommended}")
    for name in strategies:
        if registry.spec(name).reduce_bucket is None:
            continue
        # Against the baseline's peak, unless it is the baseline
        peak = None if name == config.baseline else strategies[name]["ranks"][0]["peak_bytes"]
        kept = lifetime[registry.spec(name).reduce_bucket]
        measured = ("" if peak is None or base is None else
                    f" Measured on rank 0: peak {size(peak)} under {name} against "
                    f"{size(base)} under {config.baseline}"
                    + (", so sharding costs memory here." if peak > base else "."))
        # The terminal's line where the bucket costs memory, or where that was not measured; report.md's note always
        if peak is None or base is None or peak > base:
            headlines.append(
                f"{name}: its {size(bucket)} reduce bucket ({kept}) "
                f"outweighs all {size(grads)} of gradients"
                + ("" if peak is None or base is None else f"; peak {size(peak)} against {size(base)}")
                + f". {try_bucket}.")
        notes.append(
            f"{name}: reduce_bucket_size {config.reduce_bucket_size:.3g} elements is a {size(bucket)} "
            f"buffer {kept}, while all of this model's gradients take {size(grads)}."
            f"{measured} {try_bucket}: at most one "
            "rank's share of the gradients.")
    return notes, headlines


def persistent_parameter_notes(config, strategies: dict) -> list[str]:
    """Why ZeRO-3 can hold more parameter bytes than the baseline on a small model."""
    if config.nproc == 1:
        return []
    base = max(r["param_bytes"] for r in strategies[config.baseline]["ranks"])
    notes = []
    for name, s in strategies.items():
        held = max(r["param_bytes"] for r in s["ranks"])
        if registry.spec(name).keeps_small_params_whole and held > base:
            notes.append(f"{name} holds {size(held)} of parameters per rank against {size(base)} "
                         f"under {config.baseline}: beside its 1/{config.nproc} shards, it keeps every parameter of "
                         f"at most {config.param_persistence_threshold:,} elements (DeepSpeed's param_persistence_threshold) "
                         "gathered whole on every rank after its first use, which on a small model is most of it")
    return notes
