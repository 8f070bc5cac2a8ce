"""`zerolens plan`: which configurations fit a GPU's memory, and the deepest model each strategy can
train there, predicted (predict/peak.py) before any GPU is used.

Pure computation (`plan`) apart from presentation (`render_plan`) and from the short benches of
`--check` (`check_candidates`), which confirm on GPUs that the best candidates fit.

A configuration is a strategy, a micro-batch per rank, activation checkpointing on or off, and (for
strategies with a reduce bucket) a bucket size. It fits when what its neediest rank needs, the
smallest cap under which the caching allocator runs its predicted allocations plus the memory the
process holds outside the allocator, is at most the GPU's memory. Candidates with room come first,
then by what they cost per step besides the model's own compute: recomputation first (checkpointing
runs about one more forward per step), then the bytes each rank sends per sample (the registry's
`communication`, per step, over the samples of a step), then the need.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from zerolens.commands.workers import InProcess, default_jobs, pool
from zerolens.errors import UserError
from zerolens.models.model import CHECKPOINTABLE_KINDS, parameter_shapes
from zerolens.predict.peak import target_capability, trace_caveat, trace_device, traced_on
from zerolens.report.files import write_json
from zerolens.report.tables import say
from zerolens.run.config import RunConfig, bucket_elements
from zerolens.run.deepspeed_config import deepspeed_zero_setting
from zerolens.run.flags import (
    DEFAULT_REDUCE_BUCKET,
    add_verify_arguments,
    config_from_args,
    visible_gpus,
)
from zerolens.run.jobs import run_folder
from zerolens.run.validate import check_config
from zerolens.strategies import registry
from zerolens.units import GiB, MiB, count

# A configuration whose predicted need leaves less than this share of the memory fits only if the
# prediction errs by less. The allocator model replays recorded allocator histories exactly, but the
# allocations of zerolens's own trace are not yet the GPU's: on one H200, gpt-1b's smallest cap was
# predicted up to 0.47% low for DDP, and its reserved peak 13.8% high for ZeRO-2 with the default
# allocator (docs/results/1xh200/issue21/). Such configurations are ranked after those with more room.
PREDICTION_MARGIN = 0.05

MEMORY_UNITS = {"": GiB, "gib": GiB, "mib": MiB, "tib": 1024 * GiB, "gb": 10**9, "mb": 10**6, "tb": 10**12}
MAX_DEPTH = 512  # the depth search's cap: each depth tried is traced, and a trace's time grows with depth


def parse_memory(text: str) -> int:
    """'80GiB', '81920MiB', '80GB' (10^9 bytes) or a plain number of GiB -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in MEMORY_UNITS or not float(match.group(1)) > 0:
        raise UserError(f"--gpu-memory takes a size such as 80GiB, 81920MiB or 80GB (10^9 bytes), got {text!r}")
    return int(float(match.group(1)) * MEMORY_UNITS[unit])


@dataclass(frozen=True)
class Candidate:
    strategy: str
    micro_batch: int
    checkpointing: bool
    reduce_bucket_size: int | None  # None: the strategy has no reduce bucket, so its size does not matter

    def config(self, base: RunConfig) -> RunConfig:
        """The run this candidate is: `base` with its strategy, micro-batch, checkpointing and bucket."""
        return dataclasses.replace(
            base, strategies=(self.strategy,), baseline=self.strategy, micro_batch=self.micro_batch,
            reduce_bucket_size=self.reduce_bucket_size or base.reduce_bucket_size,
            model=dataclasses.replace(base.model, activation_checkpointing=self.checkpointing))

    def label(self) -> str:
        return (f"{self.strategy}-mb{self.micro_batch}" + ("-ckpt" if self.checkpointing else "")
                + (f"-bucket{self.reduce_bucket_size:.0e}".replace("+", "") if self.reduce_bucket_size else ""))


def predicted_peak(config: RunConfig, cuda_capability: tuple[int, int], trace=None, memory: int | None = None) -> dict:
    """What a one-strategy config needs on each GPU, for its rank that needs the most: the smallest cap
    under which the caching allocator runs its allocations (the allocator setting of this process's
    PYTORCH_CUDA_ALLOC_CONF) plus what the process holds outside the allocator (`needs_bytes`), the
    same with expandable segments (`needs_expandable_bytes`; with `memory`, only where the process's own
    setting does not fit it, else None), and its allocated peaks; or why it is not
    predicted (`why_not`). With `memory` (a GPU's), whether every rank's allocations also run under that
    memory less what the process holds outside the allocator (`runs_in_memory`, and with expandable
    segments `runs_in_memory_expandable`): runs are not monotonic in the cap (allocator.runs_under), so
    a need within the memory does not say it alone. `trace`: as peak.predict_or_why_not (`scaled_from`
    says where a MicroBatchScaling scaled the trace from others, `depth_scaled_from` where a DepthScaling
    scaled it from shallower models)."""
    from zerolens.predict.allocator import allocator_setting, outside_allocator_bytes
    from zerolens.predict.peak import predicted_peaks
    registry.load_plugins()  # in a pool's fresh process too
    name = config.strategies[0]
    outside = outside_allocator_bytes(registry.spec(name).needs_deepspeed)
    # Of ZeRO-1/2's ranks, the smallest caps only of those that could need the most (peak.spliced_ranks)
    predicted = predicted_peaks(config, cuda_capability, trace=trace, allocator_caps="neediest",
                                try_cap=None if memory is None else memory - outside)[name]
    if "ranks" not in predicted:
        return {"why_not": predicted["why_not"]}
    setting, _ = allocator_setting()
    ranks = predicted["ranks"]

    def searched(setting_: str) -> list[int]:  # the ranks whose smallest cap under the setting was searched
        return [r for r in range(config.nproc) if setting_ in ranks[r].get("min_allocator_cap_bytes", {})]
    # With expandable segments: replayed where the own setting does not fit the memory (neediest_needs), else None
    expandable = searched("expandable_segments")
    runs = {} if memory is None else {
        "runs_in_memory": all(r["runs_under_cap"][setting] for r in ranks),
        "runs_in_memory_expandable": all(r["runs_under_cap"]["expandable_segments"] for r in ranks)
        if expandable else None}
    rank = max(searched(setting), key=lambda r: (ranks[r]["min_allocator_cap_bytes"][setting], ranks[r]["peak_bytes"]))
    peaks = ranks[rank]
    return {"needs_bytes": peaks["min_allocator_cap_bytes"][setting] + outside, "rank": rank,
            "min_allocator_cap_bytes": peaks["min_allocator_cap_bytes"][setting], "outside_allocator_bytes": outside,
            "needs_expandable_bytes": max(ranks[r]["min_allocator_cap_bytes"]["expandable_segments"]
                                          for r in expandable) + outside if expandable else None,
            "reserved_peak_bytes": peaks["reserved_peak_bytes"][setting], "peak_bytes": peaks["peak_bytes"],
            **{k: peaks[k] for k in ("peak_during_forward", "peak_during_backward", "peak_during_step")},
            **{key: peaks[key] for key in ("scaled_from", "depth_scaled_from") if key in peaks}, **runs}


def fits(peak: dict, memory: int) -> bool:
    """Whether a predicted_peak (of `memory`) fits: its need within the memory, and its allocations run
    under the memory itself (they can need no more than it and still run out of memory there)."""
    return peak["needs_bytes"] <= memory and peak.get("runs_in_memory", True)


def fits_with_expandable_segments(peak: dict, memory: int) -> bool | None:
    """Whether a predicted_peak fits `memory` with expandable segments; None where they were not replayed
    (it fits with the process's own setting)."""
    if peak["needs_expandable_bytes"] is None:
        return None
    return peak["needs_expandable_bytes"] <= memory and peak.get("runs_in_memory_expandable", True)


def with_depth(config: RunConfig, depth: int) -> RunConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=depth))


def largest_depth(config: RunConfig, memory: int, cuda_capability: tuple[int, int], *, predict=None,
                  known=None, progress=None) -> dict:
    """The deepest model of the config's width whose predicted need fits `memory`, for its one
    strategy (deepest_fitting, from the config's own depth; `traced`: every depth predicted and its need;
    `depth_scaled_from`: the depths whose trace was scaled from shallower ones (predict/depths.py), and from which).
    `predict(config, cuda_capability, memory)`: where each trial is predicted (predicted_peak, or a pool's
    worker); `known(depth)`: a depth's prediction made already (plan's grid has the config's own depth),
    else None; `progress(line)` hears of each trial. A depth whose need is within the memory but whose
    allocations run out of memory under the memory itself (predicted_peak's `runs_in_memory`) does not
    fit: the search takes its need as one byte more than the memory."""
    traced: dict[int, int] = {}
    scaled: dict[int, list[int]] = {}  # a depth whose trace was scaled from shallower ones -> their depths
    why_not = []
    name = config.strategies[0]

    def need(depth: int) -> int | None:
        try:
            predicted = (known and known(depth)) or (predict or predicted_peak)(with_depth(config, depth),
                                                                               cuda_capability, memory=memory)
        except UserError as e:  # a model that cannot be built at this depth (hf.at_depth): the search ends here
            predicted = {"why_not": str(e)}
        if "why_not" in predicted:
            why_not.append(predicted["why_not"])
            return None
        traced[depth] = predicted["needs_bytes"]
        if "depth_scaled_from" in predicted:
            scaled[depth] = predicted["depth_scaled_from"]
        fitting = fits(predicted, memory)
        if progress:
            progress(f"{name}: {depth} layer{'' if depth == 1 else 's'} need{'s' if depth == 1 else ''} "
                     f"{traced[depth] / GiB:.3f} GiB"
                     + ("" if fitting else ", more than the memory" if traced[depth] > memory
                        else ", but run out of memory under the memory itself")
                     + (f" (scaled from traces of {min(scaled[depth])} to {max(scaled[depth])} layers)"
                        if depth in scaled else ""))
        return traced[depth] if fitting else max(traced[depth], memory + 1)

    depth = deepest_fitting(need, memory, MAX_DEPTH, start=config.model.num_layers)
    params = sum(s.numel() for s in parameter_shapes(with_depth(config, depth).model)) if depth else 0
    return {"max_depth": depth, "at_search_cap": depth == MAX_DEPTH, "params": params,
            "needs_bytes": traced.get(depth), "next_needs_bytes": traced.get(depth + 1),
            "traced": {str(d): p for d, p in sorted(traced.items())},
            "depth_scaled_from": {str(d): s for d, s in sorted(scaled.items())},
            **({"why_not": why_not[0]} if why_not else {})}


def deepest_fitting(need, memory: int, max_depth: int, start: int | None = None) -> int:
    """The deepest depth up to `max_depth` whose `need(depth)` is within `memory`; 0 where one layer does
    not fit or a need is not known (None). Needs are taken to grow with depth, as a bisection takes them.
    The answer was seen to fit, and one layer more not to (or is the cap).

    A trial costs more the deeper it is, so the search aims at the pair of trials that ends it. After one
    layer and `start` (the config's own depth, where given), each trial is drawn from the line through
    the two trials nearest the boundary (each trial's need is known whether it fits or not, and grows
    about linearly with depth), drawn again after every trial: the layer past the deepest depth the line
    says fits, or, where that one was tried, that depth itself. Where two trials did not halve the
    bracket, its middle is tried too, so that a need far from a line still ends in about as many rounds
    as a bisection. For a linear need: one layer, `start` and the pair. (Drawn once for both of the pair,
    the line had FSDP2-grad's gpt-1b at 8 ranks in 24 GiB try 31, 30, 28 and 29 layers; drawn again,
    31, 28 and 29: docs/results/cpu-2proc/issue21/plan-time/.)"""
    needs: dict[int, int] = {}
    lo, hi = 1, max_depth + 1  # lo fits; hi does not, or is past the cap (not tried)

    def tried(depth: int) -> bool | None:
        nonlocal lo, hi
        if depth not in needs:
            value = need(depth)
            if value is None:
                return None
            needs[depth] = value
        if needs[depth] <= memory:
            lo = max(lo, depth)
        else:
            hi = min(hi, depth)
        return needs[depth] <= memory

    first = tried(1)
    if not first:
        return 0
    if start is not None and 1 < start <= max_depth and tried(start) is None:
        return 0
    while hi - lo > 1:
        before = hi - lo
        for _ in range(2):
            if hi - lo <= 1:
                break
            # The line through lo and hi where hi was tried, else through the two deepest that fit.
            a, b = (lo, hi) if hi in needs else (max((d for d in needs if d < lo), default=lo), lo)
            slope = (needs[b] - needs[a]) / (b - a) if b != a else 0
            guess = lo + int((memory - needs[lo]) // slope) if slope > 0 else 2 * lo
            if hi not in needs:  # beyond every trial the line is an extrapolation: at most 16 times lo
                guess = min(guess, 16 * lo)
            guess = min(max(guess, lo), hi - 1)
            # The layer past the deepest the line says fits, else (tried: hi) that depth itself
            if tried(guess + 1 if guess + 1 < hi else guess) is None:
                return 0
        if hi - lo > 1 and hi <= max_depth and hi - lo > before / 2 and tried((lo + hi) // 2) is None:
            return 0
    return lo


def checkpointing_options(config: RunConfig) -> tuple[bool, ...]:
    """Activation checkpointing off and on where the model has it (GPT presets, Hugging Face models)."""
    return (False, True) if config.model.kind in CHECKPOINTABLE_KINDS else (False,)


def communication_bytes(name: str, params: int, world_size: int, precision: str) -> float | None:
    from zerolens.strategies.layout import ELEMENT_BYTES
    communication = registry.spec(name).communication
    return None if communication is None else communication(params, world_size, ELEMENT_BYTES[precision])


def cost_key(row: dict) -> tuple:
    """Those with room first (more than PREDICTION_MARGIN of the memory left), then the cheapest: no
    recomputation, fewer bytes sent per sample (unknown last), a lower need."""
    per_sample = row["sent_per_sample_bytes"]
    return (row["barely"], row["checkpointing"], per_sample is None, per_sample or 0, row["needs_bytes"])


def plan(config: RunConfig, *, memory: int, micro_batches: list[int], reduce_bucket_sizes: list[int],
         cuda_capability: tuple[int, int], jobs: int = 1, depth_search: bool = True, progress=None) -> dict:
    """Every candidate of the grid predicted (strategies x checkpointing x bucket sizes, micro-batches
    from the smallest until one does not fit), and, for a preset, the deepest model per strategy at
    the config's micro-batch and checkpointing. `jobs` processes trace in parallel."""
    params = sum(s.numel() for s in parameter_shapes(config.model))
    grid = [(name, ckpt, bucket) for name in config.strategies for ckpt in checkpointing_options(config)
            for bucket in (reduce_bucket_sizes if registry.spec(name).reduce_bucket else [None])]
    # The pool inside the searches' threads: left by an interrupt, it ends its workers first (workers.Pool),
    # their futures fail and the threads, waiting on them, end before the thread pool waits for them.
    with ThreadPoolExecutor(len(config.strategies)) if jobs > 1 else InProcess() as searches, \
            pool(jobs) if jobs > 1 else InProcess() as executor:
        if progress:
            progress(f"{len(grid)} configurations, each at micro-batches {', '.join(map(str, sorted(micro_batches)))} "
                     "until one does not fit")
        # Each strategy's walks in one job (strategy_walks): the later meets in its process what the earlier
        # traced (torch's caches of operations and shapes, what a backend makes once per process). Per
        # element of the grid, the future of its strategy's walks.
        per_strategy = {name: executor.submit(strategy_walks, config, [e for e in grid if e[0] == name],
                                              micro_batches, memory, cuda_capability) for name in config.strategies}
        walks = {element: per_strategy[element[0]] for element in grid}
        depths = ({name: searches.submit(deepest_of, config, name, memory, cuda_capability, executor, walks,
                                       progress) for name in config.strategies} if depth_search else {})
        rows, too_large, not_predicted = grid_rows(config, walks, memory, params, progress)
        deepest = {name: future.result() for name, future in depths.items()}
    rows.sort(key=cost_key)
    from zerolens.predict.allocator import allocator_setting
    return {"model": config.preset, "params": params, "width": config.model.d_model, "world_size": config.nproc,
            "precision": config.precision, "gpu_memory_bytes": memory, "allocator_setting": allocator_setting()[0],
            "cuda_capability": ".".join(map(str, cuda_capability)), "traced_on": traced_on(trace_device(cuda_capability)),
            "micro_batches": sorted(micro_batches),
            "reduce_bucket_sizes": reduce_bucket_sizes, "fits": rows,
            "does_not_fit": sorted(too_large, key=lambda r: (r["strategy"], r["checkpointing"])),
            "not_predicted": not_predicted,
            "deepest": {"micro_batch": config.micro_batch, "checkpointing": config.model.activation_checkpointing,
                        "strategies": deepest} if depth_search else None}


def deepest_of(config: RunConfig, name: str, memory: int, cuda_capability: tuple[int, int], executor, walks: dict,
               progress) -> dict:
    """Strategy `name`'s deepest model (largest_depth), each trial predicted in `executor`; the config's own
    depth taken from the grid's walk of the config's own checkpointing and bucket (`walks`), where it
    reached the config's micro-batch, not traced again. In a thread of its own: it asks for one trial at
    a time, and the trials share the pool with the grid, each told as it ends."""
    element = (name, config.model.activation_checkpointing,
               config.reduce_bucket_size if registry.spec(name).reduce_bucket else None)

    def known(depth: int) -> dict | None:
        if depth != config.model.num_layers or element not in walks:
            return None
        return dict(walks[element].result()[element]).get(config.micro_batch)
    return largest_depth(dataclasses.replace(config, strategies=(name,), baseline=name), memory, cuda_capability,
                         predict=lambda c, cap, memory: executor.submit(depth_trial, c, cap, memory).result(),
                         known=known,
                         progress=progress and (lambda line: progress(f"depth search, {line}")))


@functools.cache
def depth_scaling():
    """This process's DepthScaling, which keeps the shallow traces it made for the depth search's later trials."""
    from zerolens.predict.depths import DepthScaling
    return DepthScaling()


def depth_trial(config: RunConfig, cuda_capability: tuple[int, int], memory: int) -> dict:
    """predicted_peak of one depth the depth search tries: a model of at least depths.SCALED_FROM blocks
    scaled from shallow traces where its strategy's allocations repeat per block (predict/depths.py), the
    shallow traces made once per process (gpt-1b at 8 ranks, FSDP2-grad: five traces of 2 to 6 blocks for
    its trials at 28, 29 and 31)."""
    return predicted_peak(config, cuda_capability, trace=depth_scaling(), memory=memory)


def grid_rows(config: RunConfig, walks: dict, memory: int, params: int, progress) -> tuple[list, list, dict]:
    """The grid's candidates predicted, each (strategy, checkpointing, bucket) walked in one process from
    the smallest micro-batch until its first that does not fit (`walks`: each one's future of its
    strategy's walks, strategy_walks): the rows that fit, those that do not, and why a strategy is not
    predicted. `params`: the model's parameter count."""
    rows, too_large, not_predicted = [], [], {}
    for (name, ckpt, bucket), walk in walks.items():
        predicted = walk.result()[(name, ckpt, bucket)]
        for micro_batch, peak in predicted:
            c = Candidate(name, micro_batch, ckpt, bucket)
            if "why_not" in peak:
                not_predicted.setdefault(c.strategy, peak["why_not"])
                continue
            sent = communication_bytes(c.strategy, params, config.nproc, config.precision)
            row = {**dataclasses.asdict(c), **peak, "headroom_bytes": memory - peak["needs_bytes"],
                   "barely": memory - peak["needs_bytes"] < PREDICTION_MARGIN * memory,
                   "fits_with_expandable_segments": fits_with_expandable_segments(peak, memory),
                   "sent_per_step_bytes": sent,
                   "sent_per_sample_bytes": None if sent is None else sent / c.micro_batch}
            (rows if fits(peak, memory) else too_large).append(row)
        if progress and predicted:
            fitting = [mb for mb, peak in predicted if "why_not" not in peak and fits(peak, memory)]
            scaled = sum("scaled_from" in peak for _, peak in predicted)
            progress(f"{Candidate(name, 0, ckpt, bucket).label().replace('-mb0', '')}: "
                     + (f"fits up to micro-batch {max(fitting)}" if fitting else "does not fit")
                     + (f" ({scaled} of {len(predicted)} scaled from the traces of smaller ones)" if scaled else ""))
    return rows, too_large, not_predicted


def strategy_walks(config: RunConfig, elements: list[tuple], micro_batches: list[int], memory: int,
                   cuda_capability: tuple[int, int]) -> dict[tuple, list[tuple[int, dict]]]:
    """micro_batch_walk of each of one strategy's elements of the grid, in this process, in order."""
    return {element: micro_batch_walk(config, element, micro_batches, memory, cuda_capability) for element in elements}


def micro_batch_walk(config: RunConfig, element: tuple, micro_batches: list[int], memory: int,
                     cuda_capability: tuple[int, int]) -> list[tuple[int, dict]]:
    """One (strategy, checkpointing, bucket) of the grid predicted at each micro-batch from the smallest
    until the first that does not fit (a larger one would need more still), or is not predicted: per
    micro-batch its predicted_peak. In one process, so that, where a strategy's last three traces lie
    on a line in the micro-batch, the larger micro-batches are scaled from them, not traced
    (predict/micro_batches.py)."""
    from zerolens.predict.micro_batches import MicroBatchScaling
    name, ckpt, bucket = element
    scaling = MicroBatchScaling()
    walked = []
    for micro_batch in sorted(micro_batches):
        peak = predicted_peak(Candidate(name, micro_batch, ckpt, bucket).config(config), cuda_capability,
                              trace=scaling, memory=memory)
        walked.append((micro_batch, peak))
        if "why_not" in peak or not fits(peak, memory):
            break
    return walked


def bucket_text(size: int | None) -> str:
    return "-" if size is None else f"{size:.0e}".replace("+", "")


def render_plan(result: dict, top: int) -> list:
    """The plan for the terminal: the cheapest `top` configurations that fit, what does not fit, the
    deepest model per strategy; --json has every figure."""
    from zerolens.predict.allocator import outside_allocator_source
    from zerolens.report.tables import in_unit, terminal_table, unit_for
    memory = result["gpu_memory_bytes"]
    unit, label = unit_for([memory])
    setting = result["allocator_setting"].replace("_", " ")
    lines = [f"zerolens plan: {result['model']} ({count(result['params'])} parameters), {result['world_size']} "
             f"ranks, {result['precision']}, {in_unit(memory, unit, 2)} {label} per GPU (CUDA, compute capability "
             f"{result['cuda_capability']}), the {setting} allocator; one micro-batch per optimizer step "
             "(plan does not search gradient accumulation; estimate --grad-accum predicts it)"]
    if result.get("advised_bucket"):
        lines.append(f"The default reduce bucket outweighs all this model's gradients: ZeRO planned with bucket "
                     f"{bucket_text(result['advised_bucket'])} too, at most one rank's share of them "
                     "(as verify advises).")
    fits = result["fits"]
    if fits:
        shown = fits[:top]
        sent_unit, sent_label = unit_for([r["sent_per_step_bytes"] for r in shown])
        rows = [[r["strategy"], r["micro_batch"], "on" if r["checkpointing"] else "off",
                 bucket_text(r["reduce_bucket_size"]), in_unit(r["peak_bytes"], unit, 2),
                 in_unit(r["needs_bytes"], unit, 2), in_unit(r["headroom_bytes"], unit, 2) + (" barely" if r["barely"]
                                                                                             else ""), r["rank"],
                 in_unit(r["sent_per_step_bytes"], sent_unit, 2),
                 in_unit(r["sent_per_sample_bytes"], MiB, 1)] for r in shown]
        lines += [f"{len(fits)} configurations fit" + (f"; the {top} cheapest" if len(fits) > top else "") +
                  ": those with room first (\"barely\": less than "
                  f"{PREDICTION_MARGIN:.0%} of the memory left, about the prediction's own error), then without "
                  "recomputation (ckpt: activation checkpointing), then by the bytes each rank sends per sample "
                  "(ring all-reduce, all-gather and reduce-scatter volumes), then by what they need. Peak: the "
                  f"highest rank's allocated peak, predicted on fake tensors{trace_caveat(result['traced_on'])}; "
                  "needs: the smallest cap the caching allocator runs that rank's allocations under, plus what "
                  f"the process holds outside it ({outside_allocator_source()}).",
                  terminal_table(["strategy", "micro-batch", "ckpt", "bucket", f"peak {label}", f"needs {label}",
                                  f"headroom {label}", "rank", f"sent/step {sent_label}", "sent/sample MiB"], rows,
                                 right={1, 4, 5, 6, 7, 8, 9})]
    else:
        lines.append("No configuration fits.")
    smallest_failing = {}
    for r in result["does_not_fit"]:
        key = (r["strategy"], r["checkpointing"], r["reduce_bucket_size"])
        if key not in smallest_failing or r["needs_bytes"] < smallest_failing[key]["needs_bytes"]:
            smallest_failing[key] = r
    if smallest_failing:
        lines.append("Does not fit, nor would a larger micro-batch: " + "; ".join(
            f"{name}{' with ckpt' if ckpt else ''}{'' if bucket is None else f' (bucket {bucket_text(bucket)})'} at "
            f"micro-batch {r['micro_batch']} (needs {in_unit(r['needs_bytes'], unit, 2)} {label}"
            + (", but runs out of memory under the GPU's own: the allocator's runs are not monotonic in its cap"
               if r["needs_bytes"] <= memory else "") + ")"
            for (name, ckpt, bucket), r in smallest_failing.items()) + ".")
    if result["allocator_setting"] == "default":
        rescued = [r for r in result["does_not_fit"] if r["fits_with_expandable_segments"]]
        if rescued:
            lines.append("With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True these would fit: " + "; ".join(
                f"{r['strategy']}{' with ckpt' if r['checkpointing'] else ''} at micro-batch {r['micro_batch']} "
                f"(needs {in_unit(r['needs_expandable_bytes'], unit, 2)} {label}, "
                f"{in_unit(r['needs_bytes'] - r['needs_expandable_bytes'], MiB, 0)} MiB less)" for r in rescued) + ".")
    for name, why in result["not_predicted"].items():
        lines.append(f"Not predicted: {name}: {why}.")
    deepest = result["deepest"]
    if deepest:
        at = f"micro-batch {deepest['micro_batch']}, ckpt {'on' if deepest['checkpointing'] else 'off'}"
        searched = {name: d for name, d in deepest["strategies"].items() if "why_not" not in d}
        if searched and all(d["max_depth"] == 0 for d in searched.values()):
            # Not one layer fits under any strategy: a line says it, where a table would hold only zeros
            # (a large vocabulary's logits at the default micro-batch, say).
            least = min(searched, key=lambda name: searched[name]["next_needs_bytes"])
            fitting = [r["micro_batch"] for r in fits if r["checkpointing"] == deepest["checkpointing"]]
            lines.append(f"The deepest {result['model']} each strategy can train at {at}: none, not one layer fits "
                         f"(one layer needs {in_unit(searched[least]['next_needs_bytes'], unit, 2)} {label} under "
                         f"{least}, the least)" + (f"; at the model's own depth micro-batch {max(fitting)} fits "
                                                   f"(above): --micro-batch {max(fitting)} searches the depth there"
                                                   if fitting else "") + ".")
        else:
            capped = [name for name, d in searched.items() if d.get("at_search_cap")]
            rows = [[name, f"≥ {d['max_depth']}" if d.get("at_search_cap") else d["max_depth"], count(d["params"]),
                     in_unit(d["needs_bytes"], unit, 2), in_unit(d["next_needs_bytes"], unit, 2)]
                    for name, d in deepest["strategies"].items()]
            lines += [f"The deepest {result['model']} (width {result['width']}) each strategy can train, predicted, "
                      f"at {at}:",
                      terminal_table(["strategy", "layers", "parameters", f"needs {label}", f"one layer more {label}"],
                                     rows, right={1, 2, 3, 4})]
            if capped:
                lines.append(f"≥ {MAX_DEPTH}: {', '.join(capped)} still fit{'s' if len(capped) == 1 else ''} at "
                             f"{MAX_DEPTH} layers, where the search stops; a deeper model may fit too.")
        lines += [f"Not predicted: {name}'s depth: {d['why_not']}." for name, d in deepest["strategies"].items()
                  if "why_not" in d]
    lines.append("--check runs the best candidates on this machine's GPUs, the allocator capped at each one's "
                 "predicted smallest cap (it should run) and 1% below it (it should run out of memory).")
    return lines


def check_candidates(config: RunConfig, result: dict, top: int, out, command: str, say) -> list[dict]:
    """Short benches (one warm-up step, two timed) of the `top` best fitting candidates, each twice:
    the caching allocator capped at the candidate's predicted smallest cap (it should run) and 1% below
    it (it should run out of memory). Per candidate: whether each ran, the measured and predicted
    peaks, the step time; where it ran out of memory, what the launcher said of it (the rank, phase, step
    and bytes asked). A rank that runs out of memory is a result; any other failure ends the check."""
    from zerolens.run.folder import new_run_folder
    from zerolens.run.jobs import run_job
    from zerolens.run.launch import OUT_OF_MEMORY, WorkersFailed
    checked = []
    for row in result["fits"][:top]:
        candidate = Candidate(row["strategy"], row["micro_batch"], row["checkpointing"], row["reduce_bucket_size"])
        cap = row["min_allocator_cap_bytes"]
        entry = {**dataclasses.asdict(candidate), "predicted_peak_bytes": row["peak_bytes"],
                 "predicted_cap_bytes": cap}
        below = int(cap * 0.99) // (2 * MiB) * (2 * MiB)  # the allocator reserves whole 2 MiB
        for name, limit in (("at_cap", cap), ("below_cap", below)):
            point = dataclasses.replace(candidate.config(config), job="bench", warmup_steps=1, steps=2,
                                        memory_limit_gib=limit / GiB,
                                        out=str(new_run_folder(out / "check" / f"{candidate.label()}-{name}")))
            say(f"zerolens plan --check: {candidate.label()}, allocator capped at {limit / GiB:.3f} GiB ...")
            try:
                bench = run_job(point, command=f"{command} (check: {candidate.label()}, {name})", quiet=True)
            except WorkersFailed as e:
                if OUT_OF_MEMORY not in str(e):
                    raise
                entry[f"runs_{name}"] = False
                # where it ran out and what it asked for: how far the prediction is from running
                entry[f"out_of_memory_{name}"] = " ".join(str(e).split())
                continue
            entry[f"runs_{name}"] = True
            if name == "at_cap":
                measured = bench["strategies"][candidate.strategy]
                entry |= {"measured_peak_bytes": measured["peak_bytes"],
                          "measured_reserved_peak_bytes": measured.get("reserved_peak_bytes"),
                          "step_time_s": measured["step_time_s"], "tokens_per_s": measured["tokens_per_s"]}
        entry["as_predicted"] = entry["runs_at_cap"] and not entry["runs_below_cap"]
        checked.append(entry)
    return checked


def render_checks(checked: list[dict]) -> list:
    from zerolens.report.tables import in_unit, terminal_table
    rows = [[c["strategy"], c["micro_batch"], "on" if c["checkpointing"] else "off", in_unit(c["predicted_cap_bytes"], GiB, 3),
             "yes" if c["runs_at_cap"] else "NO (out of memory)", "yes" if c["runs_below_cap"] else "no (out of memory)",
             "yes" if c["as_predicted"] else "NO", in_unit(c.get("measured_peak_bytes"), GiB, 3),
             "-" if c.get("step_time_s") is None else f"{c['step_time_s']:.3f}"] for c in checked]
    return ["Checked on this machine's GPUs (one warm-up and two timed steps each), the caching allocator capped at "
            "the predicted smallest cap and 1% below it:",
            terminal_table(["strategy", "micro-batch", "ckpt", "cap GiB", "runs at cap", "runs 1% below",
                            "as predicted", "measured peak GiB", "step s"], rows, right={1, 3, 7, 8})]


def check_micro_batches(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UserError(f"--micro-batches takes whole numbers, comma-separated, got {text!r}") from None
    if not values or values[0] < 1:
        raise UserError(f"--micro-batches needs positive values, got {text!r}")
    return values


def finite_bucket_sizes(text: str) -> list[int]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"--reduce-bucket-sizes takes element counts, comma-separated, got {text!r}")
    return sorted({bucket_elements(v, "--reduce-bucket-sizes") for v in values})


# --- The command line ------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="which configurations fit a GPU's memory, predicted before training",
                              description="Predict each rank's peak for every strategy, micro-batch, activation "
                                          "checkpointing and bucket size; list what fits --gpu-memory, cheapest "
                                          "first, and the deepest model of the preset's width each strategy can "
                                          "train there. No GPU is used, except by --check.")
    add_verify_arguments(p, trains=False)  # --check's short benches take the training flags' defaults
    p.add_argument("--gpu-memory", required=True, metavar="SIZE",
                   help="each GPU's memory: 80GiB, 81920MiB, 80GB (10^9 bytes); a plain number is GiB. A "
                        "configuration fits when its predicted smallest allocator cap plus the memory the process "
                        "holds outside the allocator is within it")
    p.add_argument("--micro-batches", default="1,2,4,8,16,32,64",
                   help="micro-batches per rank to try (default 1,2,4,8,16,32,64; each from the smallest until "
                        "one does not fit)")
    p.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated bucket sizes for the strategies that have one (default: --reduce-bucket-size)")
    p.add_argument("--top", type=int, default=15, help="configurations shown (default 15; --json has all)")
    p.add_argument("--no-depth", action="store_true", help="skip the search for the deepest model")
    p.add_argument("--jobs", type=int, default=None, help="processes tracing in parallel (default: cores, at most 4)")
    p.add_argument("--check", type=int, nargs="?", const=3, default=0, metavar="K",
                   help="run short benches of the K best fitting configurations (default 3) on this machine's "
                        "GPUs, the allocator capped at each one's predicted smallest cap and 1%% below it, to "
                        "confirm the prediction on both sides and time them")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of tables")
    p.set_defaults(func=command, device="cuda", strategies=",".join(registry.names()), preset="gpt-1b")


def command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.device != "cuda":
        raise UserError("plan predicts what fits on GPUs (--device cuda); on the CPU nothing runs out of memory")
    memory = parse_memory(args.gpu_memory)
    micro_batches = check_micro_batches(args.micro_batches)
    if args.top < 1 or (args.jobs is not None and args.jobs < 1) or args.check < 0:
        raise UserError("--top and --jobs must be at least 1, --check at least 0")
    gpus = visible_gpus() if args.check else None
    config = config_from_args(args, gpus_visible=gpus if args.check else 0, checked=True)
    # A DeepSpeed config of the user's own decides reduce_bucket_size: its own, or DeepSpeed's default where
    # it has none (run/deepspeed_config.py, deepspeed_zero_setting): the grid has that one size.
    ds_bucket = deepspeed_zero_setting(config.ds_config, config.ds_override, "reduce_bucket_size", 0) or None
    if ds_bucket and args.reduce_bucket_sizes:
        raise UserError("--reduce-bucket-sizes: with the DeepSpeed config (--ds-config/--ds-override), DeepSpeed "
                        f"would use reduce_bucket_size {ds_bucket}; plan with that one size")
    buckets = finite_bucket_sizes(args.reduce_bucket_sizes or str(ds_bucket or args.reduce_bucket_size))
    # Beside the default bucket (not one the user chose), for strategies that have one, where it outweighs all
    # the model's gradients: the bucket verify and estimate advise (report.summary.advised_bucket)
    advised = None
    if not (args.reduce_bucket_sizes or ds_bucket or args.reduce_bucket_size != DEFAULT_REDUCE_BUCKET) \
            and any(registry.spec(name).reduce_bucket for name in config.strategies):
        from zerolens.models.model import trainable_flags, trained_elements
        from zerolens.report.summary import advised_bucket
        trained = trained_elements([math.prod(shape) for shape in parameter_shapes(config.model)],
                                   trainable_flags(config.model))
        advised = advised_bucket(buckets[0], trained, config.nproc)
    buckets = sorted({*buckets, *([advised] if advised else [])})
    if args.check and gpus < config.nproc:
        raise UserError(f"--check runs the candidates on {config.nproc} GPUs, but {gpus} are visible; plan without "
                        "--check, or on the machine that will train")
    check_config(config, gpus_visible=gpus, running=bool(args.check))
    out = run_folder(config, args.overwrite) if args.check else None
    command = shlex.join(["zerolens", *argv])

    def progress(line: str) -> None:
        if not args.json:
            say(f"zerolens plan: {line}", stderr=True)
    started = time.perf_counter()
    result = plan(config, memory=memory, micro_batches=micro_batches, reduce_bucket_sizes=buckets,
                       cuda_capability=target_capability("cuda"), jobs=args.jobs or default_jobs(),
                       depth_search=not args.no_depth and config.model.kind != "user", progress=progress)
    result["command"] = command
    result["advised_bucket"] = advised
    result["seconds"] = round(time.perf_counter() - started, 1)  # the prediction's, before any --check
    if args.check:
        result["checked"] = check_candidates(config, result, args.check, out, command, progress)
        write_json(out / "plan.json", result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    say(*render_plan(result, args.top), f"Predicted in {result['seconds']:.1f} s.",
        *(render_checks(result["checked"]) if args.check else []),
        *([f"plan.json: {out / 'plan.json'}"] if out else []))
    return 0
