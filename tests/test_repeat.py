"""A trace's third step written from its second (predict/repeat.py): the same requests as the third step
traced, and the same figures, for every strategy that passes the check; traced where it does not."""
import dataclasses

import pytest

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict.peak import rank_outcome, traced_rank
from zerolens.predict.repeat import ALLOCS, FREES, repeated_step
from zerolens.strategies import TrainSettings

H200 = (9, 0)
PREDICTED = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")


def test_a_step_that_leaves_what_it_found_is_written_again_with_fresh_ids():
    setup = [("alloc", 0, 4096, 0)]
    # Step 0 makes a state (1) that stays and two gradients (3, 5) that the next step frees, one early and
    # one late; step 1 frees them and leaves its own (6, 7), on the streams where the first were.
    first = [("phase", (0, "forward"), None, 0), ("alloc", 1, 512, 0), ("alloc", 2, 1024, 0), ("free", 2, 0, 0),
             ("kernel_alloc", 9, 2048, 1), ("kernel_free", 9, 2048, 1), ("alloc", 3, 1024, 1), ("alloc", 5, 1024, 1)]
    second = [("phase", (1, "forward"), None, 0), ("alloc", 4, 1024, 0), ("begin", "pieces", 3, 0),
              ("free", 3, 0, 1), ("end", "pieces", 3, 0), ("free", 4, 0, 0), ("alloc", 6, 1024, 1),
              ("kernel_alloc", 10, 2048, 1), ("kernel_free", 10, 2048, 1), ("free", 5, 0, 1), ("alloc", 7, 1024, 1)]
    requests = setup + first + second
    starts = [len(setup), len(setup) + len(first), len(requests)]
    raw, inside = {4: 1000, 6: 1001}, {10: ("rule", (1, 2))}
    written = repeated_step(requests, starts, raw, inside)
    assert written == [("phase", (2, "forward"), None, 0), ("alloc", 11, 1024, 0), ("begin", "pieces", 3, 0),
                       ("free", 6, 0, 1), ("end", "pieces", 3, 0), ("free", 11, 0, 0), ("alloc", 12, 1024, 1),
                       ("kernel_alloc", 13, 2048, 1), ("kernel_free", 13, 2048, 1), ("free", 7, 0, 1),
                       ("alloc", 14, 1024, 1)]
    assert raw[11] == 1000 and raw[12] == 1001 and inside[13] == ("rule", (1, 2))


def test_a_step_that_does_not_leave_what_it_found_is_not_written():
    setup = [("alloc", 0, 4096, 0)]
    first = [("phase", (0, "step"), None, 0), ("alloc", 1, 1024, 0)]
    starts = [1, 3]
    frees_the_setup = [("phase", (1, "step"), None, 0), ("free", 0, 0, 0), ("free", 1, 0, 0), ("alloc", 2, 1024, 0)]
    keeps_one_more = [("phase", (1, "step"), None, 0), ("free", 1, 0, 0), ("alloc", 2, 1024, 0), ("alloc", 3, 8, 0)]
    other_stream = [("phase", (1, "step"), None, 0), ("free", 1, 0, 0), ("alloc", 2, 1024, 1)]
    for second in (frees_the_setup, keeps_one_more, other_stream):
        assert repeated_step(setup + first + second, starts + [3 + len(second)], {}, {}) is None
    assert repeated_step(setup + first, starts, {}, {}) is None  # one step: nothing to write from


def same_requests(written: list, traced: list) -> bool:
    """Equal up to the requests' ids, each run of consecutive frees taken as a set: storages released
    together (a dict of them dropped) are freed in an order that differs from one trace to the next."""
    if len(written) != len(traced):
        return False
    ids, k = {}, 0
    while k < len(written):
        a, b = written[k], traced[k]
        if a[0] in FREES and b[0] in FREES:
            end = k
            while end < len(written) and written[end][0] in FREES and traced[end][0] in FREES:
                end += 1
            if sorted((r[0], ids.get(r[1]), r[3]) for r in written[k:end]) != \
                    sorted((r[0], r[1], r[3]) for r in traced[k:end]):
                return False
            k = end
            continue
        if (a[0], a[2], a[3]) != (b[0], b[2], b[3]) or (a[0] not in ALLOCS and a[1] != b[1]):
            return False
        if a[0] in ALLOCS:
            ids[a[1]] = b[1]
        k += 1
    return True


def written_and_traced(name: str, model_config: ModelConfig, settings: TrainSettings):
    brackets = name in ("zero1", "zero2")  # the spliced trace's marks are written too
    return [traced_rank(name, model_config, settings, cuda_capability=H200, brackets=brackets, outcome=False,
                        repeat=repeat)[1] for repeat in (True, False)]


def check_written_is_traced(name: str, model_config: ModelConfig, settings: TrainSettings):
    written, traced = written_and_traced(name, model_config, settings)
    assert written["repeated_steps"] == (0 if name == "ddp" else 1)  # DDP's second step rebuilds its buckets
    assert same_requests(written["requests"], traced["requests"])
    assert written["phase_peaks"] == traced["phase_peaks"] and written["held"] == traced["held"]
    if name not in ("zero1", "zero2"):
        assert rank_outcome(written) == rank_outcome(traced)  # the peaks, and the allocator model's figures


def test_zero2s_third_step_written_is_its_third_step_traced():
    check_written_is_traced("zero2", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED)
@pytest.mark.parametrize("case", ["gpt-tiny-3-ranks-ckpt-fp16", "llama-tiny-accum-2", "gpt-tiny-1-rank"])
def test_the_third_step_written_is_the_third_step_traced(name, case):
    if case == "gpt-tiny-3-ranks-ckpt-fp16":
        model = dataclasses.replace(PRESETS["gpt-tiny"], activation_checkpointing=True)
        settings = TrainSettings(precision="fp16", micro_batch=3, world_size=3)
    elif case == "llama-tiny-accum-2":
        model = ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=None, seq_len=64))
        settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2, grad_accum=2)
    else:
        model, settings = PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=1)
    check_written_is_traced(name, model, settings)
