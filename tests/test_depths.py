"""A deep model's trace scaled from shallow ones (predict/depths.py): equal to its own trace, request
for request, where the shallow traces allow; traced whole where they do not."""
import dataclasses
import json

import pytest

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig, gpt
from zerolens.predict import depths
from zerolens.predict.peak import rank_outcome, traced_rank
from zerolens.predict.without_gpu import cuda_bytes
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.base import Blocks

H200 = (9, 0)


def llama_tiny(depth: int) -> ModelConfig:
    return ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=depth, seq_len=64))


def shallow_records(name, model_config, settings):
    return {d: traced_rank(name, dataclasses.replace(model_config, num_layers=d), settings, cuda_capability=H200)[1]
            for d in depths.TRACED_DEPTHS}


def test_tokens_name_no_allocation_and_decode_back_to_the_same_pairing():
    # Two blocks of one size alive; the older freed first, then a kernel's buffer inside an operation.
    requests = [("alloc", 7, 1024, 0), ("alloc", 9, 1024, 0), ("phase", (0, "step"), None, 0), ("free", 7, 0, 0),
                ("kernel_alloc", 11, 512, 1), ("kernel_free", 11, 512, 1), ("alloc", "cublas-forward-0", 4096, 0),
                ("free", 9, 0, 0)]
    written = depths.tokens(requests, {7: 1000, 9: 1000})
    assert written[3] == ("free", 0, 1024, (1, 0), 1000)  # one newer alive, none older; its bytes before rounding
    assert depths.decode(written) == [("alloc", 0, 1024, 0), ("alloc", 1, 1024, 0), ("phase", (0, "step"), None, 0),
                                      ("free", 0, 0, 0), ("kernel_alloc", 2, 512, 1), ("kernel_free", 2, 512, 1),
                                      ("alloc", "cublas-forward-0", 4096, 0), ("free", 1, 0, 0)]
    assert depths.decode([("free", 0, 1024, ("newest", 0))]) is None  # nothing of that size alive


def straddling(blocks: int) -> list[tuple]:
    """A run of allocations, one per block, then their frees, oldest first: what one more block inserts
    straddles the two runs."""
    return ([("alloc", 0, 512, 4, None)] * blocks + [("alloc", 0, 2048, 2048, None)]
            + [("free", 0, 512, (blocks - 1 - i, 0), 4) for i in range(blocks)] + [("free", 0, 2048, (0, 0), 2048)])


def test_a_run_inserted_across_two_runs_grows_both():
    shape, why = depths.structure(straddling(2), straddling(3), straddling(4))
    assert why is None
    lines = depths.fit_counts(shape, straddling(4), straddling(5))
    for blocks in (6, 9, 40):
        assert depths.extended_by_counts(shape, blocks - 3, lines) == depths.decode(straddling(blocks))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_scaled_equals_traced_request_for_request(name):
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    shallow = depths.ShallowTraces(shallow_records(name, llama_tiny(2), settings))
    assert shallow.deepened(8)[1] is None  # another depth first: what the traces say is found once for both
    record, why = shallow.deepened(9)
    assert why is None
    traced = traced_rank(name, llama_tiny(9), settings, cuda_capability=H200)[1]
    assert record["requests"] == depths.decode(depths.tokens(traced["requests"], traced["raw"]))
    assert record["phase_peaks"] == traced["phase_peaks"] and record["held"] == traced["held"]
    assert rank_outcome(record) == rank_outcome(traced)  # peaks, reserved peaks and smallest caps alike


@pytest.mark.slow
def test_a_rank_holding_no_rows_of_the_embedding_is_scaled_from_alignments_found_from_the_end(tmp_path):
    # 225 embedding rows on 16 ranks: 15 each, none for rank 15 (as Llama-2-70B's 32,000 at 512 ranks for
    # ranks 508-511), whose blocks' runs of frees begin as the final norm's: difflib's matches found from
    # the start cut them at different places at 2, 3 and 4 blocks.
    config = tmp_path / "llama-225.json"
    config.write_text(json.dumps(json.loads(open("examples/hf/llama-tiny.json").read()) | {"vocab_size": 225}))

    def model(depth):
        return ModelConfig(**model_config_fields(str(config), depth=depth, seq_len=64))
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=16)
    records = {d: traced_rank("fsdp2", model(d), settings, rank=15, cuda_capability=H200)[1]
               for d in depths.TRACED_DEPTHS}
    seq = {d: depths.tokens(records[d]["requests"], records[d]["raw"]) for d in (2, 3, 4)}
    assert depths.structure(seq[2], seq[3], seq[4], depths.inserted_runs)[0] is None
    record, why = depths.ShallowTraces(records).deepened(9)
    assert why is None
    traced = traced_rank("fsdp2", model(9), settings, rank=15, cuda_capability=H200)[1]
    assert record["requests"] == depths.decode(depths.tokens(traced["requests"], traced["raw"]))
    assert record["phase_peaks"] == traced["phase_peaks"] and rank_outcome(record) == rank_outcome(traced)


def test_a_buffer_growing_by_bytes_off_the_rounding_is_rounded_from_its_bytes_on_the_line():
    # 500 + 72 bytes a block: 1024 bytes rounded at 2 to 6 blocks, 1536 at 9 (ZeRO-3 has such a buffer)
    def blocks(n):
        grown = 500 + 72 * n
        return ([("alloc", 0, cuda_bytes(grown), grown, None)] + [("alloc", 0, 512, 4, None)] * n
                + [("free", 0, cuda_bytes(grown), (0, 0), grown)])
    shape, why = depths.structure(blocks(2), blocks(3), blocks(4))
    assert why is None
    lines = depths.fit_counts(shape, blocks(4), blocks(5))
    assert depths.extended_by_counts(shape, 6 - 3, lines) == depths.decode(blocks(6))
    extended = depths.extended_by_counts(shape, 9 - 3, lines)
    assert extended == depths.decode(blocks(9)) and extended[0] == ("alloc", 0, 1536, 0)


def test_a_buffer_whose_rounded_bytes_are_on_no_line_is_laid_out_from_its_bytes_before_rounding():
    # 700 bytes a block, rounded to 512: 2560, 3584, 4096, 4608 and 5632 bytes at 2 to 6 blocks, on no
    # line (ZeRO-3's fp32 copy of Llama-2-70B's shards at 512 ranks grows by 3,342,400 bytes a block)
    def blocks(n):
        grown = 1000 + 700 * n
        return ([("alloc", 0, cuda_bytes(grown), grown, None)] + [("alloc", 0, 512, 4, None)] * n
                + [("free", 0, cuda_bytes(grown), (0, 0), grown)])
    assert len({cuda_bytes(1000 + 700 * (n + 1)) - cuda_bytes(1000 + 700 * n) for n in range(2, 6)}) > 1
    shape, why = depths.structure(blocks(2), blocks(3), blocks(4))
    assert why is None
    lines = depths.fit_counts(shape, blocks(4), blocks(5))
    assert lines is not None
    for depth in (6, 9, 80):
        assert depths.extended_by_counts(shape, depth - 3, lines) == depths.decode(blocks(depth))


def test_runs_moved_to_the_start_fall_at_the_same_place_at_every_depth():
    # Each block allocates two parameters alike, between an embedding's and a head's: one more block's
    # pair can be inserted after any block, and leftmost_inserted_runs puts it after the embedding.
    def blocks(n):
        return ([("alloc", 0, 4096, 4096, None)] + [("alloc", 0, 512, 512, None), ("alloc", 0, 1024, 1024, None)] * n
                + [("alloc", 0, 2048, 2048, None)])
    for depth in (2, 3, 4):
        out, why = depths.leftmost_inserted_runs(blocks(depth), blocks(depth + 1))
        assert why is None
        assert [(e[1], e[2]) for e in out if e[0] == "insert"] == [(1, 1)]
    shape, why = depths.structure(blocks(2), blocks(3), blocks(4), depths.leftmost_inserted_runs)
    assert why is None
    lines = depths.fit_counts(shape, blocks(4), blocks(5))
    assert depths.extended_by_counts(shape, 9 - 3, lines) == depths.decode(blocks(9))


@pytest.mark.slow
@pytest.mark.parametrize("name, width, ranks, moved", [("fsdp2-grad", 1024, 8, "leftmost_inserted_runs"),
                                                       ("fsdp2", 512, 8, "rightmost_inserted_runs")])
def test_blocks_whose_runs_difflib_places_differently_are_scaled_from_runs_moved(monkeypatch, name, width, ranks,
                                                                                 moved):
    # GPT blocks allocate their parameters alike at set-up: aligned from the start or from the end, one
    # more block's falls after the second block from 2 to 3 blocks and elsewhere from 3 to 4 (gpt-1b's
    # as well). Which place of those that make the same sequence gives each free's count on a line
    # depends on the strategy and the width: at these, FSDP2-grad's runs moved to the start, FSDP2's
    # moved to the end, and only so (gpt-1b's alike).
    model = gpt(width, 2, 4, vocab_size=512, seq_len=64)
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=ranks)
    records = shallow_records(name, model, settings)
    seq = {d: depths.tokens(records[d]["requests"], records[d]["raw"]) for d in (2, 3, 4)}
    assert all(depths.structure(seq[2], seq[3], seq[4], align)[0] is None
               for align in (depths.inserted_runs, depths.inserted_runs_from_the_end))
    record, why = depths.ShallowTraces(records).deepened(9)
    assert why is None
    traced = traced_rank(name, dataclasses.replace(model, num_layers=9), settings, cuda_capability=H200)[1]
    assert record["requests"] == depths.decode(depths.tokens(traced["requests"], traced["raw"]))
    assert record["phase_peaks"] == traced["phase_peaks"] and record["held"] == traced["held"]
    assert rank_outcome(record) == rank_outcome(traced)
    # Without the alignment that moves runs so, not scaled
    monkeypatch.setattr(depths, "ALIGNMENTS", tuple(a for a in depths.ALIGNMENTS if a.__name__ != moved))
    assert depths.ShallowTraces(records).deepened(9)[0] is None


@pytest.mark.slow
def test_a_model_whose_blocks_do_not_repeat_alike_is_not_scaled():
    # gpt-tiny under DDP: one bucket holds every block's gradients, so one more block changes it
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    record, why = depths.ShallowTraces(shallow_records("ddp", PRESETS["gpt-tiny"], settings)).deepened(9)
    assert record is None and why


def test_depth_scaling_traces_whole_what_it_does_not_scale():
    asked = []

    def inner(name, model_config, settings, **options):
        asked.append((model_config.num_layers, options.get("brackets", False)))
        return {"traced": True}, {}

    scaling = depths.DepthScaling(inner)
    settings = TrainSettings(precision="bf16", micro_batch=1, world_size=2)
    deep = dataclasses.replace(PRESETS["gpt-tiny"], num_layers=depths.SCALED_FROM)
    assert scaling("zero2", deep, settings, cuda_capability=H200, brackets=True)[0] == {"traced": True}
    assert scaling("ddp", dataclasses.replace(deep, num_layers=depths.SCALED_FROM - 1), settings,
                   cuda_capability=H200)[0] == {"traced": True}
    assert scaling("ddp", deep, settings, cuda_capability=None)[0] == {"traced": True}  # a CPU target
    # Each traced whole at its own depth (the shallow trace that gives a deep one's verdicts is traced_rank's)
    assert asked == [(depths.SCALED_FROM, True), (depths.SCALED_FROM - 1, False), (depths.SCALED_FROM, False)]


def recording_inner(calls: list):
    """traced_rank's signature, recording the depths traced; its records name no allocation sequence."""
    def inner(name, model_config, settings, **options):
        calls.append(model_config.num_layers)
        return {"peak_bytes": model_config.num_layers}, {"requests": None, "brackets": False}
    return inner


def test_a_strategy_seen_never_to_repeat_per_block_is_traced_whole_at_once():
    settings = TrainSettings(precision="bf16", micro_batch=1, world_size=8)
    deep = llama_tiny(depths.SCALED_FROM)
    calls = []
    out, _ = depths.DepthScaling(recording_inner(calls))("zero0", deep, settings, cuda_capability=H200)
    assert calls == [depths.SCALED_FROM]
    assert out["why_not_depth_scaled"] == registry.spec("zero0").not_depth_scaled
    calls.clear()  # FSDP2 is tried: five shallow traces, here refused (no sequence), then the whole
    out, _ = depths.DepthScaling(recording_inner(calls))("fsdp2", deep, settings, cuda_capability=H200)
    assert calls == [*depths.TRACED_DEPTHS, depths.SCALED_FROM]
    assert out["why_not_depth_scaled"] == "the traces record no allocation sequence"
    calls.clear()  # a CPU target is not tried, and says nothing of it
    out, _ = depths.DepthScaling(recording_inner(calls))("zero3", deep, settings)
    assert calls == [depths.SCALED_FROM] and "why_not_depth_scaled" not in out


def model_blocks(block, depth, *, weight_bytes=4, world_size=8, outside=((1024, True),), **settings) -> Blocks:
    """Blocks of a model of `depth` copies of `block` ((elements, trains) per parameter) and `outside`."""
    return Blocks(tuple(block), tuple(outside) + tuple(block) * depth, weight_bytes,
                  TrainSettings(precision="bf16", world_size=world_size, **settings))


def test_ddp_buckets_part_alike_per_block_where_a_gradient_of_each_block_fills_one():
    ddp = registry.spec("ddp")
    assert ddp.parted_across_blocks(model_blocks([(7 * 2**20, True), (100, True)], 80)) is None  # 28 MiB
    assert "DDP's gradient buckets" in ddp.parted_across_blocks(model_blocks([(2**20, True)] * 3, 80))  # 4 MiB each
    # The same elements in bf16 weights (and gradients): 14 MiB, less than a bucket
    assert ddp.parted_across_blocks(model_blocks([(7 * 2**20, True)], 80, weight_bytes=2)) is not None
    assert ddp.parted_across_blocks(model_blocks([(2**20, False)] * 3, 80)) is None  # a frozen block: no gradients
    assert ddp.parted_across_blocks(model_blocks([(1000, True)], 30)) is None  # all in DDP's first bucket (1 MiB)


LLAMA2_70B_BLOCK = [(67108864, True), (8388608, True), (8388608, True), (67108864, True), (234881024, True),
                    (234881024, True), (234881024, True), (8192, True), (8192, True)]


def test_zero3_windows_part_alike_per_block_within_two_blocks_or_past_the_whole_model():
    pytest.importorskip("deepspeed")
    zero3 = registry.spec("zero3")
    # DeepSpeed's defaults: parameters reused within 1e9 elements kept, at most two of Llama-2-70B's blocks
    assert zero3.parted_across_blocks(model_blocks(LLAMA2_70B_BLOCK, 80, world_size=512)) is None
    # At 64 ranks a rank's shards (1.08e9 elements) fill two optimizer sub-groups of 1e9, and no block's one
    assert "sub_group_size" in zero3.parted_across_blocks(model_blocks(LLAMA2_70B_BLOCK, 80, world_size=64))
    # gpt-1b's blocks (50M elements): parameters reused within 1e9 elements kept, 20 blocks of 24
    gpt_1b = depths.blocks_of(dataclasses.replace(PRESETS["gpt-1b"], num_layers=24), TrainSettings(precision="bf16"))
    assert "max_reuse_distance" in zero3.parted_across_blocks(gpt_1b)
    # Blocks of 25M elements in a model of 300M: a prefetch bucket of two blocks, a reuse distance past the
    # walk over the modules (three times the model), but none of their gradients fills a reduce bucket of 5e7
    assert "reduce_bucket_size" in zero3.parted_across_blocks(model_blocks([(12_500_000, True)] * 2, 12))
    # A model smaller than every limit: nothing parts, at any depth, where max_live_parameters holds the
    # whole model twice over; where not, what is gathered at once moves with the depth
    assert zero3.parted_across_blocks(model_blocks([(10_000, True)] * 4, 40)) is None
    # A reuse distance past the model (1.6M elements) but not past its walk over the modules: the forward's
    # parameters are kept for the backward at shallow depths, not at 40 blocks
    reuse = {"zero_optimization": {"stage3_max_reuse_distance": 3_000_000}}
    assert "max_reuse_distance" in zero3.parted_across_blocks(model_blocks([(10_000, True)] * 4, 40,
                                                                           ds_override=reuse))
    live = {"zero_optimization": {"stage3_max_live_parameters": 1_000_000}}
    assert "max_live_parameters" in zero3.parted_across_blocks(model_blocks([(10_000, True)] * 4, 40,
                                                                            ds_override=live))


def test_a_strategy_whose_groups_across_blocks_move_with_depth_is_traced_whole_at_once():
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2)
    # Width 128: 25 blocks' fp32 gradients to one of DDP's 25 MiB buckets
    narrow = dataclasses.replace(PRESETS["gpt-tiny"], d_model=128, ffn_dim=512, num_layers=40)
    calls = []
    out, _ = depths.DepthScaling(recording_inner(calls))("ddp", narrow, settings, cuda_capability=H200)
    assert calls == [40]
    assert out["why_not_depth_scaled"] == registry.spec("ddp").parted_across_blocks(depths.blocks_of(narrow, settings))
    assert "DDP's gradient buckets" in out["why_not_depth_scaled"]


@pytest.mark.slow
def test_zero3_within_two_blocks_is_scaled_equal_to_its_trace():
    pytest.importorskip("deepspeed")
    # llama-tiny's blocks hold 181,504 elements: parameters reused within 300,000 kept, at most two blocks'
    # (those of 20,000 elements or fewer persistent; no prefetch). Llama-2-70B's own at 512 and 4096
    # ranks: docs/results/cpu-2proc/issue22/zero3-scaled/.
    limits = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 300_000,
              "stage3_param_persistence_threshold": 20_000}
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2, ds_override={"zero_optimization": limits})
    assert sum(elements for elements, _ in depths.blocks_of(llama_tiny(9), settings).block) == 181_504
    assert registry.spec("zero3").parted_across_blocks(depths.blocks_of(llama_tiny(30), settings)) is None
    record, why = depths.ShallowTraces(shallow_records("zero3", llama_tiny(2), settings)).deepened(9)
    assert why is None
    traced = traced_rank("zero3", llama_tiny(9), settings, cuda_capability=H200)[1]
    assert record["requests"] == depths.decode(depths.tokens(traced["requests"], traced["raw"]))
    assert record["phase_peaks"] == traced["phase_peaks"] and rank_outcome(record) == rank_outcome(traced)


@pytest.mark.slow
def test_zero3_with_windows_past_the_whole_model_is_scaled_equal_to_its_trace():
    pytest.importorskip("deepspeed")
    # DeepSpeed's own prefetch bucket (5e7 elements) and reuse distance (1e9) reach past llama-tiny's whole walk
    # over its modules at every depth, and max_live_parameters (1e9) holds the model twice over: what the
    # coordinator gathers and keeps is the whole model at each depth. Parameters of more than 1,000 elements
    # go through it (DeepSpeed's persistence threshold, 1e5, would keep each of llama-tiny's whole).
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=2,
                             ds_override={"zero_optimization": {"stage3_param_persistence_threshold": 1_000}})
    blocks = depths.blocks_of(llama_tiny(9), settings)
    assert sum(elements for elements, _ in blocks.block if elements > 1_000) > 100_000  # gathered, not persistent
    assert 3 * sum(elements for elements, _ in blocks.params) < 50_000_000
    assert registry.spec("zero3").parted_across_blocks(blocks) is None
    record, why = depths.ShallowTraces(shallow_records("zero3", llama_tiny(2), settings)).deepened(9)
    assert why is None
    traced = traced_rank("zero3", llama_tiny(9), settings, cuda_capability=H200)[1]
    assert record["requests"] == depths.decode(depths.tokens(traced["requests"], traced["raw"]))
    assert record["phase_peaks"] == traced["phase_peaks"] and rank_outcome(record) == rank_outcome(traced)


def test_sizes_whose_lines_meet_at_the_models_depth_are_not_scaled():
    # A buffer of 1000 bytes and 700 more a block, rounded to 512 (3584 bytes at 3 blocks, 4096 at 4: 512
    # a block on its line), and one of 8704 bytes: their lines meet at 13 blocks, where a free's count,
    # fitted among the allocations of its bytes, would name the other
    def sequence(n):
        grown = 1000 + 700 * n
        requests = ([("alloc", 0, cuda_bytes(grown), 0), ("alloc", 1, 8704, 0)]
                    + [("alloc", 2 + i, 512, 0) for i in range(n)]
                    + [("free", 0, 0, 0), ("free", 1, 0, 0)] + [("free", 2 + i, 0, 0) for i in range(n)])
        return depths.tokens(requests, {0: grown, 1: 8704} | {2 + i: 4 for i in range(n)})
    shape, why = depths.structure(sequence(2), sequence(3), sequence(4))
    assert why is None
    lines = depths.fit_counts(shape, sequence(4), sequence(5))
    assert depths.extended_by_counts(shape, 6 - 3, lines) == depths.decode(sequence(6))
    assert depths.same_grouping(shape, sequence(4), sequence(5), 12 - 3)
    assert not depths.same_grouping(shape, sequence(4), sequence(5), 13 - 3)
