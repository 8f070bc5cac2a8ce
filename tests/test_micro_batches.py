"""A strategy's traces at smaller micro-batches scaled to a larger one (predict/micro_batches.py): equal
to the trace at that micro-batch, figure for figure, for every strategy with a step model; traced
instead where the traces do not lie on a line."""
import argparse

import pytest

from zerolens.commands import plan
from zerolens.predict import micro_batches
from zerolens.predict.micro_batches import MicroBatchScaling, not_on_a_line
from zerolens.predict.peak import predict_or_why_not
from zerolens.run.flags import config_from_args
from zerolens.strategies import registry

PREDICTED = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")


def run_config(flags: list[str]):
    registry.load_plugins()
    parser = argparse.ArgumentParser()
    plan.add_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["plan", "--gpu-memory", "80", "--device", "cuda", *flags]),
                            gpus_visible=0, checked=True)


def scaled_and_traced(name: str, flags: list[str], walk=(1, 2, 4, 8), at: int = 16):
    """The strategy's ranks at micro-batch `at`, scaled by a MicroBatchScaling that traced `walk` before,
    and traced afresh."""
    scaling = MicroBatchScaling()
    for micro_batch in (*walk, at):
        settings = run_config([*flags, "--strategies", name, "--micro-batch", str(micro_batch)]).train_settings()
        scaled = predict_or_why_not(name, run_config(flags).model, settings, cuda_capability=(9, 0), trace=scaling)
    traced = predict_or_why_not(name, run_config(flags).model, settings, cuda_capability=(9, 0))
    return scaled["ranks"], traced["ranks"], scaling


def without_scaled_from(ranks: list[dict]) -> list[dict]:
    return [{key: value for key, value in rank.items() if key != "scaled_from"} for rank in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED)
@pytest.mark.parametrize("flags", [pytest.param(["--preset", "gpt-tiny", "--nproc", "2"], id="gpt-tiny"),
                                   pytest.param(["--preset", "gpt-tiny", "--nproc", "3", "--activation-checkpointing"],
                                                id="gpt-tiny-ckpt-3-ranks", marks=pytest.mark.slow)])
def test_a_scaled_trace_is_the_trace(name, flags):
    """Every rank's figures (peaks per phase, last step, held, the allocator model's reserved peaks and
    smallest caps for both allocator settings) scaled from micro-batches 2, 4 and 8 are the trace's at
    16."""
    scaled, traced, scaling = scaled_and_traced(name, flags)
    assert all(rank["scaled_from"] == [1, 2, 4] for rank in scaled)
    assert without_scaled_from(scaled) == traced
    assert set(scaling.why_not.values()) == {None}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp2"])
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_a_scaled_trace_of_a_hugging_face_model_is_its_trace(name, model):
    pytest.importorskip("transformers")
    flags = ["--model", f"hf:examples/hf/{model}.json", "--nproc", "2"]
    scaled, traced, _ = scaled_and_traced(name, flags)
    # GPT-2's trace at micro-batch 1 makes a different number of allocations than at 2 and beyond
    # (transformers' own code): there the line is drawn from 2, 4 and 8.
    assert all(rank["scaled_from"] in ([1, 2, 4], [2, 4, 8]) for rank in scaled)
    assert without_scaled_from(scaled) == traced


@pytest.mark.slow
def test_traces_off_the_line_are_not_scaled(monkeypatch):
    """An allocation whose bytes are not on the line through the first two traces (here: one made to
    grow with the square of the micro-batch) keeps every larger micro-batch traced."""
    real = micro_batches.traced_rank

    def squared(name, model_config, settings, **options):
        out, record = real(name, model_config, settings, **options)
        ident = next(r[1] for r in record["requests"] if r[0] == "alloc" and r[1] in record["raw"])
        record["raw"][ident] = 512 * settings.micro_batch ** 2
        record["requests"] = [(a, i, micro_batches.cuda_bytes(record["raw"][i]) if i == ident and a == "alloc" else s, st)
                              for a, i, s, st in record["requests"]]
        return out, record

    monkeypatch.setattr(micro_batches, "traced_rank", squared)
    scaled, traced, scaling = scaled_and_traced("ddp", ["--preset", "gpt-tiny", "--nproc", "2"])
    assert not any("scaled_from" in rank for rank in scaled)
    assert "an allocation's bytes are not on a line in the micro-batch" in scaling.why_not.values()
    records = next(iter(scaling.traced.values()))
    assert sorted(records) == [4, 8, 16] and not_on_a_line(records)


@pytest.mark.slow
def test_plan_says_which_rows_were_scaled_and_they_equal_the_trace():
    """plan walks each configuration's micro-batches in one process: those scaled say from which, and
    their figures are what a trace gives."""
    config = run_config(["--preset", "gpt-tiny", "--nproc", "2", "--strategies", "zero2"])
    result = plan.plan(config, memory=80 * 1024 ** 3, micro_batches=[1, 2, 4, 8, 16],
                       reduce_bucket_sizes=[200_000], cuda_capability=(9, 0), depth_search=False)
    rows = {(r["micro_batch"], r["checkpointing"]): r for r in result["fits"]}
    assert {(16, False), (16, True)} <= {key for key, r in rows.items() if "scaled_from" in r}
    assert not any("scaled_from" in rows[(micro_batch, False)] for micro_batch in (1, 2, 4))
    row = rows[(16, False)]
    traced = plan.predicted_peak(plan.Candidate("zero2", 16, False, 200_000).config(config), (9, 0),
                                 memory=80 * 1024 ** 3)
    assert {k: row[k] for k in traced} == traced
