"""A trace's third step written from its second, and its second from its first (predict/repeat.py): the same
requests as the steps traced, and the same figures, for every strategy that passes the check; traced where it
does not."""
import dataclasses

import pytest

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict import peak
from zerolens.predict.peak import rank_outcome, traced_rank
from zerolens.predict.repeat import (
    CARRIED,
    ONCE,
    alike,
    repeated_step,
    second_step,
    second_step_follows,
    third_step_once,
    third_step_once_follows,
)
from zerolens.strategies import TrainSettings

H200 = (9, 0)
PREDICTED = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")


@pytest.fixture(autouse=True)
def no_verdicts_of_earlier_tests(monkeypatch):
    """Each test starts as a fresh process does: no full trace has told it how later steps follow."""
    monkeypatch.setattr(peak, "SECOND_STEP_FOLLOWS", {})
    monkeypatch.setattr(peak, "THIRD_STEP_ONCE", {})


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


def written_and_traced(name: str, model_config: ModelConfig, settings: TrainSettings):
    brackets = name in ("zero1", "zero2")  # the spliced trace's marks are written too
    return [traced_rank(name, model_config, settings, cuda_capability=H200, brackets=brackets, outcome=False,
                        repeat=repeat)[1] for repeat in (True, False)]


def learned_third_step_once(name: str, model_config: ModelConfig, settings: TrainSettings) -> bool:
    """Whether a full trace (three steps traced: none before it told this process otherwise) finds its third
    step to be its second written by third_step_once (peak.THIRD_STEP_ONCE)."""
    brackets = name in ("zero1", "zero2")
    key = peak.second_step_key(name, model_config, settings, rank=0, seed=0, cuda_capability=H200, trace_on=None,
                               brackets=brackets)
    peak.THIRD_STEP_ONCE.pop(key, None)
    full = traced_rank(name, model_config, settings, cuda_capability=H200, brackets=brackets, outcome=False)[1]
    return peak.THIRD_STEP_ONCE.get(key, False) if not full["repeated_steps"] else False


def check_written_is_traced(name: str, model_config: ModelConfig, settings: TrainSettings):
    if name == "ddp":  # its second step rebuilds its buckets: its third is written once a full trace showed it
        assert learned_third_step_once(name, model_config, settings)
    written, traced = written_and_traced(name, model_config, settings)
    assert written["repeated_steps"] == 1 and traced["repeated_steps"] == 0
    assert alike(written["requests"], traced["requests"])
    assert written["phase_peaks"] == traced["phase_peaks"] and written["held"] == traced["held"]
    if name not in ("zero1", "zero2"):
        assert rank_outcome(written) == rank_outcome(traced)  # the peaks, and the allocator model's figures


def test_a_third_step_is_its_second_without_what_the_second_changed_once():
    # DDP's second step frees the set-up's bucket (0) and allocates the rebuilt ones (6, 7), which stay; its
    # third does neither, and makes and frees what the second made and freed (4).
    setup = [("alloc", 0, 4096, 0), ("alloc", 1, 1024, 0)]
    first = [("phase", (0, "forward"), None, 0), ("alloc", 2, 2048, 0), ("free", 2, 0, 0), ("alloc", 3, 512, 0)]
    second = [("phase", (1, "forward"), None, 0), ("free", 0, 0, 0), ("alloc", 6, 3072, 0), ("alloc", 7, 1024, 0),
              ("alloc", 4, 2048, 0), ("free", 4, 0, 0)]
    requests = setup + first + second
    starts = [len(setup), len(setup) + len(first), len(requests)]
    written = third_step_once(requests, starts, {}, {})
    assert written == [("phase", (2, "forward"), None, 0), ("alloc", 8, 2048, 0), ("free", 8, 0, 0)]
    assert third_step_once_follows(requests + written, starts + [len(requests)])
    rebuilt_again = written[:1] + [("alloc", 9, 3072, 0)] + written[1:]
    assert not third_step_once_follows(requests + rebuilt_again, starts + [len(requests)])
    assert not third_step_once_follows(requests, starts[:2])  # two steps: nothing to compare


def test_a_full_ddp_trace_tells_later_traces_to_write_their_third_step():
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    assert learned_third_step_once("ddp", dataclasses.replace(PRESETS["gpt-tiny"], num_layers=1), settings)
    deeper = dataclasses.replace(settings, micro_batch=3)
    later, traced = [traced_rank("ddp", PRESETS["gpt-tiny"], deeper, cuda_capability=H200, outcome=False,
                                 repeat=repeat)[1] for repeat in (True, False)]
    assert later["repeated_steps"] == 1 and traced["repeated_steps"] == 0
    assert alike(later["requests"], traced["requests"])
    assert later["phase_peaks"] == traced["phase_peaks"] and later["held"] == traced["held"]
    assert rank_outcome(later) == rank_outcome(traced)


def test_ddps_third_step_written_is_its_third_step_traced():
    check_written_is_traced("ddp", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2))


def test_zero2s_third_step_written_is_its_third_step_traced():
    check_written_is_traced("zero2", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2))


@pytest.mark.parametrize("name", ["fsdp2", "ddp"])
def test_a_deep_models_first_trace_takes_its_verdicts_from_a_shallow_trace_of_its_own(name):
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    deep = dataclasses.replace(PRESETS["gpt-tiny"], num_layers=peak.SHALLOW_FIRST_FROM)
    key = peak.second_step_key(name, deep, settings, rank=0, seed=0, cuda_capability=H200, trace_on=None,
                               brackets=False)
    first = traced_rank(name, deep, settings, cuda_capability=H200, outcome=False)[1]
    # The verdicts of a full trace two blocks deep: FSDP2's second step is its first written again, DDP's
    # third its second without the bucket rebuild
    assert key in peak.SECOND_STEP_FOLLOWS and first["repeated_steps"] == 1
    assert first["second_step_written"] == (name == "fsdp2")
    assert bool(peak.THIRD_STEP_ONCE.get(key)) == (name == "ddp")
    whole = traced_rank(name, deep, settings, cuda_capability=H200, outcome=False, second_from_first=False,
                        repeat=False)[1]
    assert alike(first["requests"], whole["requests"])
    assert first["phase_peaks"] == whole["phase_peaks"] and first["held"] == whole["held"]
    assert rank_outcome(first) == rank_outcome(whole)


def test_a_model_below_the_depth_worth_a_shallow_trace_or_a_users_own_is_traced_whole():
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    shallow = dataclasses.replace(PRESETS["gpt-tiny"], num_layers=peak.SHALLOW_FIRST_FROM - 1)
    assert peak.shallow_model(shallow) is None
    assert not traced_rank("fsdp2", shallow, settings, cuda_capability=H200, outcome=False)[1]["second_step_written"]
    assert peak.shallow_model(dataclasses.replace(shallow, kind="user", factory="m:f", batch="m:b",
                                                  num_layers=peak.SHALLOW_FIRST_FROM)) is None
    # Nor where fewer than three steps are traced (a bench of one step): no verdict could come of them
    peak.SECOND_STEP_FOLLOWS.clear()
    deep = dataclasses.replace(PRESETS["gpt-tiny"], num_layers=peak.SHALLOW_FIRST_FROM)
    traced_rank("fsdp2", deep, settings, cuda_capability=H200, outcome=False, steps=2)
    assert not peak.SECOND_STEP_FOLLOWS


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED)
@pytest.mark.parametrize("case", ["gpt-tiny-3-ranks-ckpt-fp16", "llama-tiny-accum-2", "gpt-tiny-1-rank"])
def test_the_third_step_written_is_the_third_step_traced(name, case):
    check_written_is_traced(name, *case_of(case))


def case_of(case: str) -> tuple[ModelConfig, TrainSettings]:
    """A case's model and settings."""
    if case == "gpt-tiny-3-ranks-ckpt-fp16":
        return (dataclasses.replace(PRESETS["gpt-tiny"], activation_checkpointing=True),
                TrainSettings(precision="fp16", micro_batch=3, world_size=3))
    if case == "llama-tiny-accum-2":
        return (ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=None, seq_len=64)),
                TrainSettings(precision="bf16", micro_batch=2, world_size=2, grad_accum=2))
    if case == "mixtral-tiny":
        return (ModelConfig(**model_config_fields("examples/hf/mixtral-tiny.json", depth=None, seq_len=64)),
                TrainSettings(precision="bf16", micro_batch=2, world_size=2))
    return PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=1)


# Set-up: a weight (0) and the first micro-batch (1). The first step frees the micro-batch in its backward,
# makes an optimizer state (4) that it keeps, and leaves the next micro-batch (5) for the next step to free.
SETUP = [("alloc", 0, 4096, 0), ("alloc", 1, 1024, 0)]
FIRST = [("phase", (0, "forward"), None, 0), ("alloc", 2, 2048, 0), ("kernel_alloc", 3, 512, 1),
         ("kernel_free", 3, 512, 1), ("phase", (0, "backward"), None, 0), ("free", 1, 0, 0), ("free", 2, 0, 0),
         ("phase", (0, "step"), None, 0), ("alloc", 4, 4096, 0), ("alloc", 5, 1024, 0)]


def test_a_second_step_is_its_first_without_the_state_the_first_made():
    raw, inside = {2: 2000}, {3: ("rule", (1,))}
    written = second_step(SETUP + FIRST, [len(SETUP), len(SETUP) + len(FIRST)], raw, inside)
    # No state made again; the micro-batch the first left (5) freed where the first freed the set-up's (1)
    assert written == [("phase", (1, "forward"), None, 0), ("alloc", 6, 2048, 0), ("kernel_alloc", 7, 512, 1),
                       ("kernel_free", 7, 512, 1), ("phase", (1, "backward"), None, 0), ("free", 5, 0, 0),
                       ("free", 6, 0, 0), ("phase", (1, "step"), None, 0), ("alloc", 8, 1024, 0)]
    assert raw[6] == 2000 and inside[7] == ("rule", (1,))


def test_a_first_step_that_leaves_no_counterpart_of_what_it_freed_is_not_written_again():
    # What it leaves last (the state, 4096 bytes) is not what it freed of the set-up (1024 bytes)
    first = FIRST[:-2] + [("alloc", 5, 1024, 0), ("alloc", 4, 4096, 0)]
    assert second_step(SETUP + first, [len(SETUP), len(SETUP) + len(first)], {}, {}) is None
    on_another_stream = FIRST[:-1] + [("alloc", 5, 1024, 1)]
    assert second_step(SETUP + on_another_stream, [len(SETUP), len(SETUP) + len(FIRST)], {}, {}) is None


def test_set_up_storages_a_first_step_frees_once_are_not_freed_again():
    # The first step swaps the set-up's micro-batch (1) for a storage of another size (5: what FSDP2's padded
    # shards become at the first forward) and keeps it and a state (4): the second makes neither again,
    # nor frees anything of the set-up.
    first = [*FIRST[:-2], ("alloc", 4, 4096, 0), ("alloc", 5, 960, 0)]
    starts = [len(SETUP), len(SETUP) + len(first)]
    assert second_step(SETUP + first, starts, {}, {}) is None  # CARRIED: no counterpart of what it freed
    written = second_step(SETUP + first, starts, {}, {}, ONCE)
    assert written == [("phase", (1, "forward"), None, 0), ("alloc", 6, 2048, 0), ("kernel_alloc", 7, 512, 1),
                       ("kernel_free", 7, 512, 1), ("phase", (1, "backward"), None, 0), ("free", 6, 0, 0),
                       ("phase", (1, "step"), None, 0)]
    # A full trace whose second step is that says which rule held; one whose second step frees 5 again, none
    assert second_step_follows(SETUP + first + written, starts + [starts[1] + len(written)]) == ONCE
    frees_it = written + [("free", 5, 0, 0)]
    assert second_step_follows(SETUP + first + frees_it, starts + [starts[1] + len(frees_it)]) is None


def test_whether_a_traced_second_step_is_its_first_written_again():
    second = second_step(SETUP + FIRST, [len(SETUP), len(SETUP) + len(FIRST)], {}, {})
    starts = [len(SETUP), len(SETUP) + len(FIRST), len(SETUP) + len(FIRST) + len(second)]
    assert second_step_follows(SETUP + FIRST + second, starts) == CARRIED
    remade = second[:-1] + [("alloc", 9, 4096, 0), second[-1]]  # the second step makes a state again
    assert second_step_follows(SETUP + FIRST + remade, starts[:2] + [starts[2] + 1]) is None
    assert second_step_follows(SETUP + FIRST, starts[:2]) is None  # one step traced: nothing to compare


def check_second_written_is_traced(name: str, model_config: ModelConfig, settings: TrainSettings):
    brackets = name in ("zero1", "zero2")
    written, traced = [traced_rank(name, model_config, settings, cuda_capability=H200, brackets=brackets,
                                   outcome=False, second_from_first=first)[1] for first in (True, False)]
    assert written["second_step_written"] and not traced["second_step_written"]
    assert alike(written["requests"], traced["requests"])
    assert written["phase_peaks"] == traced["phase_peaks"] and written["held"] == traced["held"]
    if not brackets:
        assert rank_outcome(written) == rank_outcome(traced)


def test_zero2s_second_step_written_is_its_second_step_traced():
    check_second_written_is_traced("zero2", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2,
                                                                              world_size=2))


def test_a_full_trace_tells_later_traces_at_other_depths_and_micro_batches_to_write_their_second_step():
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    shallow = dataclasses.replace(PRESETS["gpt-tiny"], num_layers=1)
    first = traced_rank("fsdp2", shallow, settings, cuda_capability=H200, outcome=False)[1]
    later = traced_rank("fsdp2", PRESETS["gpt-tiny"], dataclasses.replace(settings, micro_batch=3),
                        cuda_capability=H200, outcome=False)[1]
    assert not first["second_step_written"] and later["second_step_written"]
    other_rank = traced_rank("fsdp2", PRESETS["gpt-tiny"], settings, rank=1, cuda_capability=H200, outcome=False)[1]
    assert not other_rank["second_step_written"]  # no full trace of that rank yet


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED)
@pytest.mark.parametrize("case", ["gpt-tiny-3-ranks-ckpt-fp16", "llama-tiny-accum-2", "mixtral-tiny"])
def test_the_second_step_written_is_the_second_step_traced_where_a_full_trace_says_so(name, case):
    model, settings = case_of(case)
    brackets = name in ("zero1", "zero2")
    full = traced_rank(name, model, settings, cuda_capability=H200, brackets=brackets, outcome=False,
                       second_from_first=False)[1]
    key = peak.second_step_key(name, model, settings, rank=0, seed=0, cuda_capability=H200, trace_on=None,
                               brackets=brackets)
    # ZeRO-3's first step records the order its prefetch follows from the second; DDP's second rebuilds its buckets
    assert peak.SECOND_STEP_FOLLOWS[key] == (None if name in ("ddp", "zero3") else CARRIED)
    if peak.SECOND_STEP_FOLLOWS[key]:
        check_second_written_is_traced(name, model, settings)
    else:  # the verdict keeps the next trace whole
        again = traced_rank(name, model, settings, cuda_capability=H200, brackets=brackets, outcome=False)[1]
        assert not again["second_step_written"] and alike(again["requests"], full["requests"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "fsdp2-grad"])
def test_a_padded_ranks_second_step_written_is_its_second_step_traced(name):
    # gpt-tiny's 512 rows of embedding over 3 ranks: rank 2 holds 170 of 171, padded, and swaps its padded
    # shards for unpadded ones at its first forward (repeat.ONCE); rank 0 holds 171 (CARRIED)
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=3)
    for rank, rule in ((0, CARRIED), (2, ONCE)):
        traced_rank(name, PRESETS["gpt-tiny"], settings, rank=rank, cuda_capability=H200, outcome=False,
                    second_from_first=False)
        key = peak.second_step_key(name, PRESETS["gpt-tiny"], settings, rank=rank, seed=0, cuda_capability=H200,
                                   trace_on=None, brackets=False)
        assert peak.SECOND_STEP_FOLLOWS[key] == rule
        written, traced = [traced_rank(name, PRESETS["gpt-tiny"], settings, rank=rank, cuda_capability=H200,
                                       outcome=False, second_from_first=first)[1] for first in (True, False)]
        assert written["second_step_written"] and not traced["second_step_written"]
        assert alike(written["requests"], traced["requests"])
        assert written["phase_peaks"] == traced["phase_peaks"] and written["held"] == traced["held"]
        assert rank_outcome(written) == rank_outcome(traced)
