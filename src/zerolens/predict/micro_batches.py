"""One strategy's traces at three micro-batches standing for its trace at any larger one.

A training step allocates, at each micro-batch, the same storages in the same order, on the same
streams; what changes is the activations' bytes, in proportion to the micro-batch, while the
parameters, gradients, optimizer states and the backends' buffers stay as they are. Where that holds,
each allocation's bytes are a + b x micro-batch, and the trace at any micro-batch follows from two.
plan asks for the same strategy at micro-batches 1, 2, 4, 8, ... (commands/plan.py): its traces cost
seconds each on a 1B model, the scaled sequence a fraction of that.

Nothing is taken on trust: the line through the first two traces must give the third exactly
(every allocation and free in the same order, on the same stream, each size on the line, the
tracker's peaks beside the sequence and what it holds after the step too); else every micro-batch is
traced. The sizes are scaled before the tracker's rounding to 512 bytes and rounded as it rounds, so a
small tensor whose rounded bytes look constant over the first three is not taken to be.
tests/test_micro_batches.py checks scaled against traced for every strategy that has a step model.
"""
from __future__ import annotations

import dataclasses

from zerolens.models.model import ModelConfig
from zerolens.predict.kernel_workspaces import buffer_bytes
from zerolens.predict.peak import rank_outcome, sequence_peaks, traced_rank, without_workspaces
from zerolens.predict.without_gpu import cuda_bytes
from zerolens.strategies import TrainSettings

# The traces a scaling needs: two that draw the line, a third that checks it.
TRACES = 3


class MicroBatchScaling:
    """traced_rank, but for a micro-batch larger than those of the last TRACES traces of the same
    rank, strategy, model and settings (the micro-batch aside), where their allocations lie on a line
    in the micro-batch, the record is scaled from them (`scaled_from` in the outcome says from
    which), not traced. Where they do not, this one is traced and joins them in place of the oldest
    (micro-batch 1 often allocates otherwise: a copy that is a view at 1 and not beyond). For CUDA
    targets (plan's): a CPU target's allocation sequence is not recorded."""

    def __init__(self):
        self.traced: dict[str, dict[int, dict]] = {}  # what a trace is of -> micro-batch -> its record
        self.why_not: dict[tuple, str | None] = {}  # (what, the micro-batches) -> why they are not on a line

    def __call__(self, name: str, model_config: ModelConfig, settings: TrainSettings, *,
                 cuda_capability: tuple[int, int] | None = None, **options) -> tuple[dict, dict]:
        micro_batch = settings.micro_batch
        # repr: a Hugging Face model's configuration holds dicts, which do not hash
        key = repr((name, model_config, dataclasses.replace(settings, micro_batch=0), cuda_capability,
                    sorted(options.items())))
        records = self.traced.setdefault(key, {})
        if cuda_capability is not None and len(records) == TRACES and micro_batch > max(records):
            window = (key, tuple(sorted(records)))
            if window not in self.why_not:
                self.why_not[window] = not_on_a_line(records)
            record = None if self.why_not[window] else scaled_record(records, micro_batch)
            if record is not None:
                return rank_outcome(record, options.get("try_cap")) | {"scaled_from": sorted(records)}, record
        out, record = traced_rank(name, model_config, settings, cuda_capability=cuda_capability,
                                  **options)
        if record["requests"] is not None and (not records or micro_batch > max(records)):
            records[micro_batch] = record
            if len(records) > TRACES:
                del records[min(records)]
        return out, record


def in_order(requests: list) -> list:
    """The requests with each run of frees (no allocation or mark between them) sorted by stream and
    request: Python frees the objects of a collection it drops in an order that is not always the
    same from trace to trace, and neither the totals nor the caching allocator's blocks after the run
    (free blocks merge with free neighbours, whatever the order) depend on it."""
    out, run = [], []
    for request in requests:
        if request[0] == "free":
            run.append(request)
            continue
        out += sorted(run, key=lambda r: (r[3], r[1]))
        run = []
        out.append(request)
    return out + sorted(run, key=lambda r: (r[3], r[1]))


def not_on_a_line(records: dict[int, dict]) -> str | None:
    """Why the three records are not one sequence whose sizes lie on a line in the micro-batch, or
    None where they are: the third equals the line through the first two, every request, size, stream
    and mark (runs of frees in any order: in_order), and the tracker's figures beside the sequence."""
    (b1, first), (b2, second), (b3, third) = sorted(records.items())
    if not len(first["requests"]) == len(second["requests"]) == len(third["requests"]):
        return "the traces make different numbers of allocations"
    if third["phase_peaks"].keys() != first["phase_peaks"].keys():
        return "the traces have different phases"
    for r1, r2, r3 in zip(*(in_order(record["requests"]) for record in (first, second, third))):
        if r1[0] != r2[0] or r1[0] != r3[0] or r1[1] != r2[1] or r1[1] != r3[1] or r1[3] != r2[3] or r1[3] != r3[3]:
            return "the traces allocate in different orders"
        if r1[0] == "kernel_alloc":  # a kernel's own buffer: the numbers its bytes follow from on the line
            rules = [record["inside"].get(r[1], (None,))[0] for record, r in ((first, r1), (second, r2), (third, r3))]
            numbers = [record["inside"][r[1]][1] for record, r in ((first, r1), (second, r2), (third, r3))
                       if r[1] in record["inside"]]
            if len(set(rules)) != 1 or len(numbers) != 3 or len({len(n) for n in numbers}) != 1:
                return "a kernel's buffer is not the same kind in the traces"
            if [on_line(x, y, b1, b2, b3) for x, y in zip(numbers[0], numbers[1])] != list(numbers[2]):
                return "a kernel's buffer's shapes are not on a line in the micro-batch"
            continue
        if r1[0] == "kernel_free":  # its bytes are its allocation's
            continue
        if r1[0] == "alloc":
            sizes = [record["raw"].get(r[1]) for record, r in ((first, r1), (second, r2), (third, r3))]
            if None in sizes:  # the cuBLAS workspaces, which are no storage: the same at every micro-batch
                if not r1[2] == r2[2] == r3[2]:
                    return "a workspace's size differs between the traces"
                continue
            if any(r[2] != cuda_bytes(size) for r, size in zip((r1, r2, r3), sizes)):
                return "the tracker's bytes are not the storages' rounded to 512"
            if on_line(sizes[0], sizes[1], b1, b2, b3) != sizes[2]:
                return "an allocation's bytes are not on a line in the micro-batch"
        elif r1[0] != "free" and (r1[2] != r2[2] or r1[2] != r3[2]):
            return "a mark's payload differs between the traces"
    counted = [figures(record) for record in (first, second, third)]
    for figure in ("beside", "held_beside", "batch_bytes"):
        values = [each[figure] for each in counted]
        if on_line(values[0], values[1], b1, b2, b3) != values[2]:
            return f"the tracker's {figure.replace('_', ' ')} are not on a line in the micro-batch"
    return None


def on_line(value1, value2, b1: int, b2: int, b: int):
    """The value at micro-batch `b` on the line through (b1, value1) and (b2, value2), where that is a
    whole number (None where not); a dict: per key."""
    if isinstance(value1, dict):
        if value1.keys() != value2.keys():
            return None
        values = {key: on_line(value1[key], value2[key], b1, b2, b) for key in value1}
        return None if None in values.values() else values
    rise = (value2 - value1) * (b - b1)
    if rise % (b2 - b1):
        return None
    return value1 + rise // (b2 - b1)


def figures(record: dict) -> dict:
    """What the tracker counted beside the recorded sequence: per (step, phase) its peak less the
    sequence's, and what it holds after the step less the sequence's end (the sequence without the
    cuBLAS workspaces, which are in no figure of the tracker's: without_workspaces)."""
    peaks, end = sequence_peaks(without_workspaces(record["requests"]))
    return {"beside": {key: peak - peaks[key] for key, peak in record["phase_peaks"].items()},
            "held_beside": record["held"] - end, "batch_bytes": record["batch_bytes"]}


def scaled_record(records: dict[int, dict], micro_batch: int) -> dict | None:
    """The record of a trace at `micro_batch`, from the line through the first two of `records`
    (not_on_a_line found it true of the third), or None where a size on it would be negative."""
    (b1, first), (b2, second) = sorted(records.items())[:2]
    requests, raw, inside = [], {}, {}
    for r1, r2 in zip(in_order(first["requests"]), in_order(second["requests"])):
        if r1[0] in ("kernel_alloc", "kernel_free"):  # its bytes computed again from its numbers
            rule, numbers = first["inside"][r1[1]]
            numbers = tuple(on_line(x, y, b1, b2, micro_batch) for x, y in zip(numbers, second["inside"][r2[1]][1]))
            if None in numbers or min(numbers) < 0:
                return None
            inside[r1[1]] = (rule, numbers)
            requests.append((r1[0], r1[1], cuda_bytes(buffer_bytes(rule, numbers, first["geometry"])), r1[3]))
        elif r1[0] == "alloc" and r1[1] in first["raw"]:
            size = on_line(first["raw"][r1[1]], second["raw"][r2[1]], b1, b2, micro_batch)
            if size is None or size < 0:
                return None
            raw[r1[1]] = size
            requests.append((r1[0], r1[1], cuda_bytes(size), r1[3]))
        else:
            requests.append(r1)
    beside = on_line(figures(first), figures(second), b1, b2, micro_batch)
    if beside is None:
        return None
    return with_sequence(first, requests, raw, inside, beside) | {"step_model": records[max(records)]["step_model"]}


def with_sequence(record: dict, requests: list, raw: dict, inside: dict, beside: dict) -> dict:
    """`record` with another allocation sequence (`raw`, `inside` as traced_rank's) and the tracker's
    figures beside it (`beside`, as figures() gives them): its peaks and what it holds worked out again."""
    peaks, end = sequence_peaks(without_workspaces(requests))
    return record | {"requests": requests, "raw": raw, "inside": inside, "batch_bytes": beside["batch_bytes"],
                     "phase_peaks": {key: peaks[key] + beside["beside"][key] for key in peaks},
                     "held": end + beside["held_beside"]}
