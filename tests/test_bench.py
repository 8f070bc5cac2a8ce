"""`zerolens bench` end to end on 2 CPU processes, and the GPT preset's task."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import zerolens

from zerolens.models.data import lm_batch
from zerolens.models.model import PRESETS, build_model, num_params, parameter_shapes, training_flops_per_token
from zerolens.report.bench import datasheet_peak
from zerolens.units import GiB as GIB


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run"
    # No --steps: bench's own default (10 timed steps) must reach the workers.
    # No --preset: on the CPU bench's default model is gpt-tiny (gpt-100m's steps take minutes there).
    result = zerolens("bench", "--strategies", "ddp,zero2", "--warmup", "3", "--peak-tflops", "1", "--out", str(out),
                      timeout=300)
    return result, out


@pytest.mark.slow
def test_bench_writes_json_table_and_plot(bench_run):
    result, out = bench_run
    assert result.returncode == 0, result.stdout + result.stderr
    bench = json.loads((out / "bench.json").read_text())
    assert "bench's model on the CPU: gpt-tiny (on GPUs gpt-100m)" in result.stdout + result.stderr
    assert bench["preset"] == "gpt-tiny" and bench["timed_steps"] == 10 and bench["warmup_steps"] == 3
    assert bench["tokens_per_step"] == 8 * 2 * 64
    assert bench["peak_tflops"] == 1 and bench["peak_tflops_source"] == "--peak-tflops"
    # Three rounds by default, interleaved, each strategy of each round in processes of its own, and
    # beside each its reference loop, written without zerolens, in processes of its own too.
    assert bench["rounds_run"] == 3
    assert [(r["round"], r["strategy"]) for r in bench["rounds"]] == [
        (k, name) for k in (1, 2, 3) for name in ("ddp", "zero2")]
    assert len({tuple(r["process_ids"]) for r in bench["rounds"]}) == 6
    results = out / "results"
    assert sorted(p.name for p in results.iterdir()) == sorted(
        f"{name}{'' if k == 1 else f'.round{k}'}.json" for k in (1, 2, 3)
        for name in ("ddp", "reference-ddp", "zero2", "reference-zero2"))
    for name in ("ddp", "zero2"):
        mine, loop = (json.loads((results / f"{n}.round2.json").read_text())["ranks"][0] for n in (name, f"reference-{name}"))
        # The same model, batches and settings: the loop written without zerolens trains the same losses, bit for bit.
        assert loop["losses"] == mine["losses"] and loop["process_id"] != mine["process_id"]
        s = bench["strategies"][name]
        overheads = [a / b - 1 for a, b in zip(s["round_step_times_s"], s["reference_round_step_times_s"])]
        assert s["harness_overhead"] == pytest.approx(sorted(overheads)[1])
        assert s["harness_overhead_range"] == pytest.approx([min(overheads), max(overheads)])
    assert "The harness's overhead against loops written without zerolens: ddp" in result.stdout
    for name in ("ddp", "zero2"):
        s = bench["strategies"][name]
        assert len(s["step_times_s"]) == 3 * 10 and s["step_time_s"] > 0
        assert s["round_step_times_s"] == [r["step_time_s"] for r in bench["rounds"] if r["strategy"] == name]
        # Where a step's time goes: each phase's (the CPU's host time) and the rest, which the phases leave.
        assert all(s["phase_seconds"][phase] > 0 for phase in ("forward", "backward", "step"))
        assert s["phase_seconds"]["other"] >= 0
        assert s["tokens_per_s"] == pytest.approx(bench["tokens_per_step"] / s["step_time_s"])
        assert s["mfu"] == pytest.approx(s["tflops_per_gpu"] / 1)
        # The CPU's peak: the last warm-up step's, followed tensor by tensor, beside the last traced step's.
        assert s["peak_bytes"] > 0 and abs(s["peak_prediction_error"]) < 0.01, s
        assert [r["phase"] for r in s["phase_peaks"]] == ["forward", "backward", "step"] * 2
        assert all(abs(r["error"]) < 0.01 for r in s["phase_peaks"]), s["phase_peaks"]
        assert set(s["vs_ddp"]) == {"step_time", "step_time_range", "step_time_rounds", "step_time_differs",
                                    "peak_bytes"}
        assert len(s["losses"]) == 13
    # TFLOP/s from the model's own FLOP count, recomputed here.
    config = PRESETS["gpt-tiny"]
    flops = training_flops_per_token(config, num_params(build_model(config, 0)))
    assert bench["flops_per_token"] == flops
    for s in bench["strategies"].values():
        assert s["tflops_per_gpu"] == pytest.approx(flops * bench["tokens_per_step"] / 2 / s["step_time_s"] / 1e12)
    zero2, ddp = bench["strategies"]["zero2"], bench["strategies"]["ddp"]
    ratios = [a / b for a, b in zip(zero2["round_step_times_s"], ddp["round_step_times_s"])]
    assert zero2["vs_ddp"]["step_time"] == pytest.approx(sorted(ratios)[1])
    assert zero2["vs_ddp"]["step_time_range"] == pytest.approx([min(ratios), max(ratios)])
    # Same model, data and seed: the two strategies' losses agree (bf16).
    assert max(abs(a - b) for a, b in zip(bench["strategies"]["ddp"]["losses"],
                                          bench["strategies"]["zero2"]["losses"])) < 0.05
    assert "| zero2 |" in (out / "bench.md").read_text() and "Where a step's time goes" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
    assert result.stdout.count("zerolens bench:") == 1 and result.stdout.count("Report:") == 1  # rank 0 alone
    lines = result.stdout.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 100, result.stdout
    table = next(line for line in lines if line.startswith("zero2 "))
    assert f"{bench['strategies']['zero2']['peak_bytes'] / 2**20:.2f}" in table  # peak MiB, and predicted beside it
    assert "predicted MiB" in result.stdout


@pytest.mark.slow
def test_bench_a_lora_model_under_gradient_accumulation(tmp_path):
    """A user's LoRA model (every weight frozen but rank-2 adapters and the head) at --grad-accum 2, an
    ordinary bench run: each step two micro-batches, and the loops written without zerolens train the same
    losses, bit for bit, reported alike (the mean of each step's micro-batch losses; they reported the last
    micro-batch's, DDP's divided by the accumulation)."""
    out = tmp_path / "run"
    result = zerolens("bench", "--model", "zerolens_test_models:lora_classifier", "--batch",
                      "zerolens_test_models:tiny_batch", "--strategies", "ddp,zero2", "--grad-accum", "2",
                      "--rounds", "1", "--warmup", "1", "--steps", "3", "--peak-tflops", "1", "--out", str(out),
                      timeout=300, env={"PYTHONPATH": str(Path(__file__).parent)})
    assert result.returncode == 0, result.stdout + result.stderr
    bench = json.loads((out / "bench.json").read_text())
    assert bench["grad_accum"] == 2 and bench["tokens_per_step"] == 2 * 2 * bench["micro_batch"] * 6
    for name in ("ddp", "zero2"):
        mine, loop = (json.loads((out / "results" / f"{n}.json").read_text())["ranks"][0]
                      for n in (name, f"reference-{name}"))
        assert len(mine["losses"]) == 4 and loop["losses"] == mine["losses"]


def test_bench_rejects_bad_flags(cli):
    result = cli("bench", "--steps", "0")
    assert result.returncode == 2 and "--steps" in result.stderr and "Traceback" not in result.stderr
    result = cli("bench", "--ds-override", "{not json")
    assert result.returncode == 2 and "--ds-override is not valid JSON" in result.stderr
    result = cli("maxsize", "--device", "cpu")
    assert result.returncode == 2 and "maxsize needs GPUs" in result.stderr
    assert "zerolens plan predicts it" in result.stderr  # not --device cuda, which says use the CPU without GPUs


def test_an_unknown_flag_points_to_its_commands_help():
    result = zerolens("verify", "--nosuchflag")
    assert result.returncode == 2 and "(see zerolens verify --help)" in result.stderr, result.stderr


def test_lm_task_follows_its_successor_rule():
    tokens, labels = lm_batch(3, seed=0, batch_size=64, seq_len=32, vocab_size=97, signal=0.8)
    again, _ = lm_batch(3, seed=0, batch_size=64, seq_len=32, vocab_size=97, signal=0.8)
    assert torch.equal(tokens, again)  # a pure function of (seed, step)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next tokens
    successor = torch.randperm(97, generator=torch.Generator().manual_seed(0))
    follows = (labels == successor[tokens]).float().mean().item()
    assert 0.75 < follows < 0.85  # signal 0.8, plus the odd uniform draw that lands on the successor


def test_lm_task_without_signal_is_its_noise():
    """At signal 0 (the peak trace's batch) each next token is the noise's, made without the loop over the
    sequence: the same tokens as the loop makes, draw for draw."""
    tokens, labels = lm_batch(5, seed=2, batch_size=3, seq_len=40, vocab_size=97, signal=0.0)
    gen = torch.Generator().manual_seed(2 * 1_000_003 + 5)
    first = torch.randint(97, (3,), generator=gen)
    noise = torch.randint(97, (3, 40), generator=gen)
    assert torch.equal(tokens[:, 0], first) and torch.equal(labels, noise)
    assert torch.equal(tokens[:, 1:], noise[:, :-1])


def test_gpt_presets_sizes_and_flops():
    assert 0.9e9 < sum(s.numel() for s in parameter_shapes(PRESETS["gpt-1b"])) < 1.0e9
    config = PRESETS["gpt-tiny"]
    model = build_model(config, 0)
    params = num_params(model)
    assert params == sum(s.numel() for s in parameter_shapes(config))
    d, L, T, V = config.d_model, config.num_layers, config.seq_len, config.vocab_size
    assert training_flops_per_token(config, params) == 6 * (params - V * d - T * d) + 12 * L * d * T
    logits = model(torch.zeros(2, T, dtype=torch.long))
    assert logits.shape == (2, T, V)


def test_datasheet_peaks():
    assert datasheet_peak("NVIDIA H200", "bf16") == 989.4
    assert datasheet_peak("NVIDIA H200", "fp32") is None
    assert datasheet_peak("Some GPU", "bf16") is None
    assert datasheet_peak("NVIDIA H100 NVL", "bf16") is None  # not the SXM part: no guess


def test_the_workers_get_the_config_the_cli_resolved(tmp_path):
    """The CLI resolves the flags once and writes config.json; the workers load that file: the
    configuration is the one the CLI resolved, whatever the flags, bench's defaults included."""
    from zerolens.cli import ArgumentParser
    from zerolens.commands import bench
    from zerolens.run.config import load_config, save_config
    from zerolens.run.flags import config_from_args
    parser = ArgumentParser(prog="zerolens")
    bench.add_parser(parser.add_subparsers(dest="command"))
    argv = ["bench", "--preset", "gpt-tiny", "--strategies", "ddp,zero2", "--nproc", "3", "--device", "cpu",
            "--precision", "fp32", "--width", "32", "--depth", "3", "--heads", "2", "--seq-len", "16",
            "--activation-checkpointing", "--lr", "0.01", "--seed", "5", "--micro-batch", "2",
            "--reduce-bucket-size", "1e6", "--gradient-clipping", "0.5", "--fused-adam",
            "--ds-override", '{"zero_optimization":{"overlap_comm":true}}', "--warmup", "2", "--steps", "7",
            "--peak-tflops", "10", "--memory-limit-gib", "4", "--timeout", "60", "--out", str(tmp_path / "x")]
    for flags in (argv, ["bench", "--device", "cpu"]):
        config = config_from_args(parser.parse_args(flags))
        save_config(config, tmp_path / "config.json", command="zerolens " + " ".join(flags))
        assert load_config(str(tmp_path / "config.json")) == config
    defaults = config_from_args(parser.parse_args(["bench", "--device", "cpu"]))
    assert defaults.warmup_steps == 3 and defaults.steps == 10 and defaults.job == "bench"


def test_bench_shows_each_ranks_phase_peaks_beside_the_prediction():
    """On CUDA bench reads each phase's allocator peak (StepTimer.phase) and sets it beside the
    peak predicted before training, per rank, with the error; the table goes to bench.md."""
    from zerolens.models.model import PRESETS
    from zerolens.report.bench import bench_summary, render_bench
    from zerolens.run.config import RunConfig
    config = RunConfig(strategies=("ddp",), baseline="ddp", nproc=2, device="cuda", precision="bf16", steps=2,
                       warmup_steps=1, job="bench", preset="gpt-tiny", model=PRESETS["gpt-tiny"])
    measured = {"forward": 1000, "backward": 2000, "step": 1500}

    def rank_result(scale):
        return {"name": "ddp", "seconds": [0.1, 0.1, 0.1], "losses": [6.0, 5.0, 4.0], "settings": {}, "notes": [],
                "peak_bytes": 2000 * scale, "setup_peak_bytes": 10, "allocated_at_start_bytes": 0,
                **{f"peak_during_{p}": v * scale for p, v in measured.items()}}
    phases = {f"peak_during_{p}": v * 1.01 for p, v in measured.items()}
    predicted = {"ddp": {"ranks": [phases | {"peak_bytes": 2020, "last_step": phases} for _ in range(2)]}}
    summary = bench_summary(config, [[[rank_result(1)], [rank_result(2)]]], 10_000, "NVIDIA H200", {}, predicted)
    rows = summary["strategies"]["ddp"]["phase_peaks"]
    assert len(rows) == 2 * 3 and rows[1] == {"rank": 0, "phase": "backward", "measured_bytes": 2000,
                                             "predicted_bytes": 2020.0, "error": pytest.approx(0.01)}
    assert rows[4]["measured_bytes"] == 4000 and rows[4]["error"] == pytest.approx(2020 / 4000 - 1)
    text = render_bench(summary, "zerolens bench")
    assert "Peaks per phase, predicted before training and measured" in text and "| ddp | 1 | step |" in text
    cpu = bench_summary(dataclasses.replace(config, device="cpu"), [[[rank_result(1)], [rank_result(1)]]], 10_000,
                        "cpu", {}, predicted)
    assert cpu["strategies"]["ddp"]["phase_peaks"] == [] and "Peaks per phase" not in render_bench(cpu, "x")


def test_bench_sets_the_reserved_peak_beside_the_allocator_models(monkeypatch):
    """On CUDA bench reads the allocator's reserved peak over the steps (StepTimer) and sets it beside
    the one predicted for the run's allocator setting, the largest rank's of each."""
    from zerolens.models.model import PRESETS
    from zerolens.report.bench import bench_summary, render_bench
    from zerolens.run.config import RunConfig
    config = RunConfig(strategies=("ddp",), baseline="ddp", nproc=2, device="cuda", precision="bf16", steps=2,
                       warmup_steps=1, job="bench", preset="gpt-tiny", model=PRESETS["gpt-tiny"])

    def rank_result(reserved):
        return {"name": "ddp", "seconds": [0.1, 0.1, 0.1], "losses": [6.0, 5.0, 4.0], "settings": {}, "notes": [],
                "peak_bytes": 2000, "setup_peak_bytes": 10, "allocated_at_start_bytes": 0,
                "reserved_peak_bytes": reserved}
    predicted = {"ddp": {"ranks": [{"peak_bytes": 2000, "reserved_peak_bytes": {"default": 4 * GIB, "expandable_segments": 3 * GIB},
                                    **{f"peak_during_{p}": 2000 for p in ("forward", "backward", "step")}}] * 2}}
    for conf, predicted_reserved in (("", 4 * GIB), ("expandable_segments:True", 3 * GIB)):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        summary = bench_summary(config, [[[rank_result(3 * GIB)], [rank_result(5 * GIB)]]], 10_000, "NVIDIA H200", {},
                                predicted)
        ddp = summary["strategies"]["ddp"]
        assert ddp["reserved_peak_bytes"] == 5 * GIB and ddp["predicted_reserved_peak_bytes"] == predicted_reserved
        assert ddp["reserved_prediction_error"] == pytest.approx(predicted_reserved / (5 * GIB) - 1)
        text = " ".join(render_bench(summary, "zerolens bench").split())
        assert f"ddp 5.000 GiB measured, {predicted_reserved / GIB:.3f} predicted" in text


def test_a_ratio_is_the_median_of_the_rounds_with_their_range():
    """Three rounds of ddp and zero2 on one rank: zero2's round medians against ddp's of the same round
    give its ratio (their median) and range; a range that holds 1.0 is "no difference", one that does
    not is a difference, and the steps of every round are pooled for the step time."""
    from zerolens.models.model import PRESETS
    from zerolens.report.bench import bench_summary, bench_terminal_lines, render_bench
    from zerolens.run.config import RunConfig
    config = RunConfig(strategies=("ddp", "zero2"), baseline="ddp", nproc=1, device="cuda", precision="bf16", steps=3,
                       warmup_steps=1, job="bench", preset="gpt-tiny", model=PRESETS["gpt-tiny"], rounds=3)

    def result(name, step):
        phases = {"forward": step / 4, "backward": step / 2, "step": step / 8}
        return {"name": name, "process_id": 100, "seconds": [9.0] + [step] * 3, "losses": [6.0], "settings": {},
                "notes": [], "peak_bytes": 2000, "setup_peak_bytes": 10, "allocated_at_start_bytes": 0,
                "phase_seconds": [{}] + [phases] * 3}

    def summary_of(zero2_steps):
        rounds = [[[result("ddp", 1.0), result("zero2", step)]] for step in zero2_steps]
        return bench_summary(config, rounds, 10_000, "NVIDIA H200", {})

    mixed = summary_of([0.95, 1.02, 1.10])
    vs = mixed["strategies"]["zero2"]["vs_ddp"]
    assert vs["step_time"] == pytest.approx(1.02) and vs["step_time_range"] == pytest.approx([0.95, 1.10])
    assert vs["step_time_differs"] is False
    assert mixed["strategies"]["zero2"]["step_time_s"] == pytest.approx(1.02)  # the median of the 9 pooled steps
    assert [(r["round"], r["strategy"]) for r in mixed["rounds"]] == [(1, "ddp"), (1, "zero2"), (2, "ddp"),
                                                                     (2, "zero2"), (3, "ddp"), (3, "zero2")]
    assert "| zero2 | 1020.0 | 1.020 (0.950-1.100), no difference |" in render_bench(mixed, "zerolens bench")
    # Where the step's time goes: each phase's median over the pooled steps, and the rest.
    assert mixed["strategies"]["zero2"]["phase_seconds"] == pytest.approx(
        {"forward": 1.02 / 4, "backward": 1.02 / 2, "step": 1.02 / 8, "other": 1.02 / 8})
    assert "| zero2 | 255.0 | 510.0 | 127.5 | 127.5 |" in render_bench(mixed, "zerolens bench")
    slower = summary_of([1.20, 1.25, 1.30])["strategies"]["zero2"]["vs_ddp"]
    assert slower["step_time"] == pytest.approx(1.25) and slower["step_time_differs"] is True
    from rich.console import Console
    console = Console(width=100, record=True, file=open(os.devnull, "w"))
    for line in bench_terminal_lines(summary_of([1.20, 1.25, 1.30]), Path("out")):
        console.print(line)
    text = console.export_text()
    assert "1.25 (1.20-1.30)" in text and "x 3 interleaved rounds" in text



def test_an_overhead_whose_rounds_hold_zero_is_none_measurable():
    """Tiny steps on a CPU: zerolens faster than the reference loop in one round, slower in another."""
    from zerolens.report.bench import overhead_text
    assert overhead_text({"harness_overhead": 0.01, "harness_overhead_range": [-0.02, 0.05]}) == \
        "+1.00% (-2.00% to +5.00%, none measurable)"
    assert overhead_text({"harness_overhead": 0.01, "harness_overhead_range": [0.005, 0.05]}) == \
        "+1.00% (+0.50% to +5.00%)"

@pytest.mark.slow
def test_fsdp2s_reference_loop_trains_what_fsdp2_trains(tmp_path):
    """FSDP2's reference loop (fully_shard per block and the root, written without zerolens) beside
    fsdp2 in its own processes: the same losses, bit for bit, and the harness's overhead reported."""
    out = tmp_path / "bench"
    result = zerolens("bench", "--strategies", "fsdp2", "--rounds", "1", "--warmup", "1", "--steps", "2",
                      "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    mine, loop = (json.loads((out / "results" / f"{n}.json").read_text())["ranks"][0]
                  for n in ("fsdp2", "reference-fsdp2"))
    assert loop["losses"] == mine["losses"] and loop["process_id"] != mine["process_id"]
    fsdp2 = json.loads((out / "bench.json").read_text())["strategies"]["fsdp2"]
    assert fsdp2["reference_loop"].startswith("fully_shard") and fsdp2["harness_overhead_range"][0] is not None


def test_bench_on_gpus_trains_as_fast_training_does_unless_told_not_to(monkeypatch):
    """bench on CUDA defaults to fused AdamW and, for a GPT preset, compiled blocks (issue 25's MFU);
    --no-fused-adam / --no-compile turn them off; on the CPU, in verify and in maxsize both stay off.
    A strategy that cannot compile trains the model uncompiled, and its notes say so; where torch.compile
    has no GPU backend (no Triton) the blocks are not compiled unless --compile says so."""
    import dataclasses

    from zerolens.cli import ArgumentParser
    from zerolens.commands import bench, maxsize, verify
    from zerolens.run import flags
    from zerolens.run.flags import config_from_args
    from zerolens.strategies import registry
    monkeypatch.setattr(flags, "gpu_compiler", lambda: True)  # as where Triton is installed
    parser = ArgumentParser(prog="zerolens")
    subparsers = parser.add_subparsers(dest="command")
    for command in (bench, verify, maxsize):
        command.add_parser(subparsers)

    def resolved(*argv):
        config = config_from_args(parser.parse_args(list(argv)), gpus_visible=1, checked=True)
        return config.fused_adam, config.model.compile_blocks, config.micro_batch

    cuda = ("--nproc", "1", "--device", "cuda")
    assert resolved("bench", *cuda, "--preset", "gpt-1b") == (True, True, 32)
    assert resolved("bench", *cuda, "--preset", "gpt-1b", "--no-compile", "--micro-batch", "4") == (True, False, 4)
    assert resolved("bench", *cuda, "--preset", "gpt-1b", "--no-fused-adam") == (False, True, 32)
    assert resolved("bench", *cuda, "--preset", "case-study") == (True, False, 8)  # not a GPT: nothing to compile
    assert resolved("bench", "--device", "cpu", "--preset", "gpt-tiny") == (False, False, 8)
    assert resolved("verify", *cuda, "--preset", "gpt-1b") == (False, False, 8)
    assert resolved("verify", *cuda, "--preset", "gpt-1b", "--compile", "--fused-adam") == (True, True, 8)
    assert resolved("maxsize", *cuda) == (False, False, 8)
    monkeypatch.setattr(flags, "gpu_compiler", lambda: False)
    assert resolved("bench", *cuda, "--preset", "gpt-1b") == (True, False, 32)
    assert resolved("bench", *cuda, "--preset", "gpt-1b", "--compile") == (True, True, 32)
    monkeypatch.setattr(flags, "gpu_compiler", lambda: True)

    config = config_from_args(parser.parse_args(["bench", *cuda, "--preset", "gpt-1b", "--strategies", "ddp,zero3"]),
                              gpus_visible=1, checked=True)
    assert config.model_for("ddp").compile_blocks and config.compile_note("ddp") is None
    assert not config.model_for("zero3").compile_blocks
    assert registry.spec("zero3").not_compiled in config.compile_note("zero3")
    # the loss is compiled where the model is, in the strategy's loop and its reference loop alike
    assert config.train_settings("ddp").compile_loss and not config.train_settings("zero3").compile_loss
    uncompiled = dataclasses.replace(config, model=dataclasses.replace(config.model, compile_blocks=False))
    assert all(uncompiled.compile_note(n) is None for n in registry.names())


def test_bench_on_gpus_turns_deepspeeds_bf16_overflow_check_off_unless_told_otherwise(tmp_path, monkeypatch):
    """bench on CUDA in bf16 writes bf16.check_grad_overflow false into DeepSpeed's config (its host
    synchronisation is what made ZeRO-2's step slower than DDP's at N=1); verify, the CPU and fp16 leave
    DeepSpeed's default; the flag and a DeepSpeed config of the user's own decide over the default, and
    disagreeing, the flag in another precision or without ZeRO-1/2, is a user error. The step models read
    nothing of it that they do not follow."""
    from zerolens.cli import ArgumentParser
    from zerolens.commands import bench, verify
    from zerolens.errors import UserError
    from zerolens.run.flags import config_from_args
    from zerolens.strategies import make_strategy, registry
    parser = ArgumentParser(prog="zerolens")
    subparsers = parser.add_subparsers(dest="command")
    for command in (bench, verify):
        command.add_parser(subparsers)

    def config(*argv):
        return config_from_args(parser.parse_args(list(argv)), gpus_visible=1, checked=True)

    def bf16_section(*argv):
        return make_strategy("zero2", config(*argv).train_settings()).ds_config().get("bf16")

    cuda = ("--nproc", "1", "--device", "cuda", "--preset", "gpt-tiny", "--no-compile")
    assert bf16_section("bench", *cuda) == {"enabled": True, "check_grad_overflow": False}
    assert bf16_section("bench", *cuda, "--grad-overflow-check") == {"enabled": True, "check_grad_overflow": True}
    assert bf16_section("verify", *cuda) == {"enabled": True}  # DeepSpeed's own default
    assert bf16_section("bench", "--device", "cpu", "--preset", "gpt-tiny") == {"enabled": True}
    assert config("bench", *cuda, "--precision", "fp16").grad_overflow_check is None
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"bf16": {"enabled": "auto", "check_grad_overflow": True}}))
    assert bf16_section("bench", *cuda, "--ds-config", str(user)) == {"enabled": True, "check_grad_overflow": True}
    assert bf16_section("bench", *cuda, "--ds-override", '{"bf16": {"check_grad_overflow": true}}') == {
        "enabled": True, "check_grad_overflow": True}
    assert config("bench", *cuda, "--ds-config", str(user)).grad_overflow_check is True  # what ran, recorded
    with pytest.raises(UserError, match="disagrees with the DeepSpeed config's bf16.check_grad_overflow true"):
        config("bench", *cuda, "--ds-config", str(user), "--no-grad-overflow-check")
    legacy = tmp_path / "legacy.json"  # DeepSpeed's older name of the section
    legacy.write_text(json.dumps({"bfloat16": {"enabled": True, "check_grad_overflow": True}}))
    assert config("bench", *cuda, "--ds-config", str(legacy)).grad_overflow_check is True
    auto = tmp_path / "auto.json"  # "auto" sets nothing: bench's default stands
    auto.write_text(json.dumps({"bf16": {"enabled": "auto", "check_grad_overflow": "auto"}}))
    assert bf16_section("bench", *cuda, "--ds-config", str(auto)) == {"enabled": True, "check_grad_overflow": False}
    with pytest.raises(UserError, match="sets what zero1, zero2 do; the run has none of them"):
        config("bench", *cuda, "--strategies", "ddp,zero3", "--no-grad-overflow-check")
    with pytest.raises(UserError, match="DeepSpeed's bf16 setting; the run's precision is fp16"):
        config("verify", *cuda, "--precision", "fp16", "--no-grad-overflow-check")
    settings = config("bench", *cuda, "--ds-override", '{"bf16": {"check_grad_overflow": false}}').train_settings()
    assert all(registry.spec(n).not_modelled(settings) == [] for n in ("zero0", "zero1", "zero2", "zero3"))
    # Before 0.17.1 DeepSpeed never checks bf16 gradients (stage_1_and_2.py: only in fp16): asking it to is a
    # user error
    import zerolens.compat
    installed = zerolens.compat.installed_version
    for release in ("0.16.9", "0.17.0"):
        monkeypatch.setattr(zerolens.compat, "installed_version",
                            lambda package: release if package == "deepspeed" else installed(package))
        with pytest.raises(UserError, match=f"DeepSpeed {release} never checks bf16 gradients"):
            config("bench", *cuda, "--grad-overflow-check")
        assert config("bench", *cuda, "--no-grad-overflow-check").grad_overflow_check is False
    monkeypatch.setattr(zerolens.compat, "installed_version",
                        lambda package: "0.17.1" if package == "deepspeed" else installed(package))
    assert config("bench", *cuda, "--grad-overflow-check").grad_overflow_check is True


def test_mfu_is_also_set_against_the_matmul_rate_measured_in_the_run():
    """Each strategy's processes measure the GPU's matrix-product rate (measure/matmul.py); bench takes the
    slowest rank's of each process group, the median over them, and sets every strategy's TFLOP/s against
    it beside the datasheet's MFU. Without a measured rate (the CPU) there is none."""
    from zerolens.models.model import PRESETS
    from zerolens.report.bench import bench_summary, bench_terminal_lines, render_bench
    from zerolens.run.config import RunConfig
    config = RunConfig(strategies=("ddp", "zero2"), baseline="ddp", nproc=2, device="cuda", precision="bf16", steps=2,
                       warmup_steps=1, job="bench", preset="gpt-tiny", model=PRESETS["gpt-tiny"])

    def rank_result(name, seconds, rate):
        return {"name": name, "seconds": [seconds] * 3, "losses": [6.0, 5.0, 4.0], "settings": {}, "notes": [],
                "peak_bytes": 2000, "setup_peak_bytes": 10, "allocated_at_start_bytes": 0, "matmul_tflops": rate,
                "phase_seconds": [{"forward": seconds / 4, "backward": seconds / 2, "step": seconds / 8}] * 3,
                "communication": None if rate is None else {"communication": 0.003, "communication_not_overlapped": 0.001}}
    params = sum(shape.numel() for shape in parameter_shapes(PRESETS["gpt-tiny"]))
    rounds = [[[rank_result("ddp", 0.1, 700.0), rank_result("zero2", 0.2, 800.0)],
               [rank_result("ddp", 0.1, 600.0), rank_result("zero2", 0.2, 720.0)]]]
    summary = bench_summary(config, rounds, params, "NVIDIA H200", {})
    assert summary["measured_matmul_tflops"] == pytest.approx(660.0)  # median of the slowest ranks' 600 and 720
    for name in ("ddp", "zero2"):
        s = summary["strategies"][name]
        assert s["mfu_vs_measured_matmul"] == pytest.approx(s["tflops_per_gpu"] / 660.0)
        assert s["mfu_vs_measured_matmul"] > s["mfu"]  # 660 TFLOP/s measured, 989.4 on the datasheet
    line = "Against the matrix-product rate measured in this run, 660.0 TFLOP/s"
    assert line in " ".join(render_bench(summary, "zerolens bench").split())
    assert any(line in str(text) for text in bench_terminal_lines(summary, Path("out")))
    # the profiled warm-up step's communication, in the breakdown
    assert summary["strategies"]["zero2"]["communication_not_overlapped_s"] == 0.001
    assert "| zero2 | 50.0 | 100.0 | 25.0 | 25.0 | 3.0 | 1.0 |" in render_bench(summary, "zerolens bench")
    rounds[0][1][0]["matmul_tflops"] = None  # a process group without a measured rate is left out
    assert bench_summary(config, rounds, params, "NVIDIA H200", {})["measured_matmul_tflops"] == pytest.approx(720.0)
    cpu = bench_summary(dataclasses.replace(config, device="cpu"), [[[rank_result("ddp", 0.1, None),
                                                                     rank_result("zero2", 0.2, None)]] * 2],
                        params, "cpu", {})
    assert cpu["measured_matmul_tflops"] is None and cpu["strategies"]["ddp"]["mfu_vs_measured_matmul"] is None
