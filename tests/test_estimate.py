"""`zerolens estimate`: the ZeRO paper's Figure 1, presets, user models, JSON, errors."""
import json
import multiprocessing
import subprocess
import sys

import pytest

from zerolens.cli import main
from zerolens.models.model import PRESETS, build_model
from zerolens.strategies.registry import predict_retained


def run_json(capsys, *args):
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_reproduces_figure_1_of_the_zero_paper(capsys):
    # Psi = 7.5B on 64 GPUs: 120 GB baseline, 31.4 (P_os), 16.6 (P_os+g), 1.9 (P_os+g+p).
    result = run_json(capsys, "--params", "7.5e9", "--nproc", "64")
    gb = {name: round(e["paper_model_states_bytes"] / 1e9, 1) for name, e in result["strategies"].items()}
    assert [gb["zero0"], gb["zero1"], gb["zero2"], gb["zero3"]] == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_estimator_counts_the_fp32_gradient_copy(capsys):
    result = run_json(capsys, "--params", "1e9", "--nproc", "4", "--strategies", "zero2")
    assert result["strategies"]["zero2"]["deepspeed_estimator_bytes"] == 2e9 + 18e9 / 4


@pytest.mark.slow
def test_preset_prediction_is_the_layout_per_rank(capsys):
    result = run_json(capsys, "--preset", "case-study", "--nproc", "3", "--precision", "bf16")
    numels = [p.numel() for p in build_model(PRESETS["case-study"], 0).parameters()]
    assert result["params"] == sum(numels) == 525_834
    ranks = result["strategies"]["zero2"]["ranks"]
    assert len(ranks) == 3
    for r in ranks:
        want = predict_retained("zero2", numels, 3, r["rank"], "bf16")
        assert r["grad_bytes_after_backward"] == want["grad_bytes_after_backward"]
    assert ranks[0]["transient_reduce_bucket_bytes"] == 2 * 50_000_000


def test_user_model_is_built_on_the_meta_device(capsys):
    # 3 x (Linear(4096, 4096)) = 50M parameters would take 200 MB if it were materialised.
    result = run_json(capsys, "--model", "zerolens_test_models:three_big_layers", "--nproc", "2")
    assert result["params"] == 3 * (4096 * 4096 + 4096)


@pytest.mark.slow  # every strategy's trace through the command
def test_table_output_labels_units(cli):
    result = cli("estimate", "--nproc", "2")
    assert result.returncode == 0
    assert "MiB" in result.stdout and "zero2" in result.stdout


def test_unknown_model_path_is_a_user_error(cli):
    result = cli("estimate", "--model", "no_such_module:factory")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("zerolens: cannot load no_such_module:factory")


def test_a_model_fsdp2_cannot_shard_is_a_user_error(capsys):
    assert main(["estimate", "--model", "zerolens_test_models:with_a_scalar", "--strategies", "fsdp2"]) == 2
    err = capsys.readouterr().err
    assert "0-dimensional parameter cannot be sharded" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_parameter_count_uses_the_same_layouts_as_the_sizes(capsys):
    """--params: DDP keeps fp32 weights, gradients and its bucket copy, as in the layout mode."""
    result = run_json(capsys, "--params", "1e9", "--nproc", "4")
    ddp = result["strategies"]["ddp"]["components"]
    assert (ddp["param_bytes"], ddp["grad_bytes_after_backward"], ddp["comm_buffer_bytes_after_backward"]) == (4e9,) * 3
    sized = run_json(capsys, "--preset", "gpt-tiny", "--nproc", "4", "--precision", "fp16")
    psi = sized["params"]
    assert sized["strategies"]["ddp"]["ranks"][0]["param_bytes"] == 4 * psi  # fp32 in both modes
    fp32 = run_json(capsys, "--params", "1e9", "--nproc", "4", "--precision", "fp32")
    assert fp32["strategies"]["zero2"]["components"]["param_bytes"] == 4e9


def test_the_default_precision_is_what_verify_runs_on_gpus(capsys, unpredicted_strategy):
    # A strategy without a step model: no peak is traced (the precision is what this tests).
    assert run_json(capsys, "--preset", "gpt-1b", "--strategies", unpredicted_strategy)["precision"] == "bf16"
    assert run_json(capsys, "--preset", "case-study", "--strategies", unpredicted_strategy)["precision"] == "fp16"


@pytest.mark.slow
def test_one_unit_per_table(capsys):
    # Two of gpt-1b's 16 layers: its figures still reach GiB (the fp32 logits alone are 1 GiB), and the
    # trace is an eighth as long.
    assert main(["estimate", "--preset", "gpt-1b", "--depth", "2"]) == 0
    out = capsys.readouterr().out
    assert "Per rank, GiB (1024-based)" in out and " MiB" not in out


@pytest.mark.slow
def test_the_peak_of_every_rank_is_predicted_where_there_is_a_step_model(capsys, unpredicted_strategy):
    from zerolens.models.model import PRESETS
    from zerolens.predict.peak import predict_peaks
    from zerolens.strategies import TrainSettings
    result = run_json(capsys, "--preset", "gpt-tiny", "--strategies", f"ddp,zero2,zero3,{unpredicted_strategy}",
                      "--nproc", "3", "--micro-batch", "4", "--device", "cpu")
    assert result["micro_batch"] == 4 and result["device"] == "cpu"
    settings = TrainSettings(precision="bf16", world_size=3, micro_batch=4)
    for name in ("ddp", "zero2", "zero3"):
        for rank in result["strategies"][name]["ranks"]:
            expected = predict_peaks(name, PRESETS["gpt-tiny"], settings, rank=rank["rank"])
            assert {k: rank[k] for k in expected if k.startswith("peak")} == {
                k: v for k, v in expected.items() if k.startswith("peak")}
            assert rank["peak_bytes"] > rank["retained_total_bytes"]
    unpredicted = result["strategies"][unpredicted_strategy]
    assert f"does not predict {unpredicted_strategy}" in unpredicted["peak_not_predicted"]
    assert "peak_bytes" not in unpredicted["ranks"][0]


def test_a_model_without_a_batch_function_gets_no_peak(capsys):
    result = run_json(capsys, "--model", "zerolens_test_models:tiny_classifier", "--strategies", "ddp")
    assert "--batch" in result["strategies"]["ddp"]["peak_not_predicted"]
    result = run_json(capsys, "--model", "zerolens_test_models:tiny_classifier", "--batch",
                      "zerolens_test_models:tiny_batch", "--strategies", "ddp")
    assert result["strategies"]["ddp"]["ranks"][0]["peak_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch", "0"], "--micro-batch must be at least 1"),
    (["--batch", "zerolens_test_models:tiny_batch"], "--batch goes with --model"),
    (["--params", "1e9", "--activation-checkpointing"], "need a model"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 is not supported on CPU"),
    (["--preset", "gpt-tiny", "--jobs", "0"], "--jobs must be at least 1"),
    # The user's factory fails: one line, as verify says it (without --batch it was a traceback)
    (["--model", "zerolens_test_models:broken_factory"], "--model: RuntimeError: missing checkpoint file"),
    # A model and batch that break zerolens's contract: refused as verify refuses them (estimate said "No peak")
    (["--model", "zerolens_test_models:tuple_output", "--batch", "zerolens_test_models:tiny_batch"],
     "the model returned a tuple"),
    (["--model", "zerolens_test_models:tiny_classifier", "--batch", "zerolens_test_models:wrong_batch"],
     "--model/--batch"),
])
def test_peak_flags_that_cannot_work_are_user_errors(argv, message, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_strategies_predicted_in_parallel_processes_give_the_same_figures(capsys, monkeypatch, start):
    """Workers forked from this process (where it has no other thread and no CUDA) or fresh interpreters."""
    from zerolens.commands import workers
    if start not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {start} here")
    monkeypatch.setattr(workers, "start_method", lambda: start)
    argv = ("--preset", "gpt-tiny", "--strategies", "ddp,zero2,fsdp2", "--nproc", "2", "--micro-batch", "2")
    alone = run_json(capsys, *argv, "--jobs", "1")
    together = run_json(capsys, *argv, "--jobs", "2")
    assert {k: v for k, v in together.items() if k != "seconds"} == {k: v for k, v in alone.items() if k != "seconds"}


@pytest.mark.skipif(sys.platform != "linux", reason="workers fork only on Linux")
def test_workers_fork_only_from_a_process_without_other_threads_or_cuda(monkeypatch):
    import threading

    import torch

    from zerolens.commands.workers import start_method
    fresh = subprocess.run([sys.executable, "-c", "import torch; from zerolens.commands.workers import start_method; "
                            "print(start_method())"], capture_output=True, text=True, timeout=120)
    assert fresh.stdout.strip() == "fork", fresh.stderr  # a command's process, torch imported, nothing else
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert start_method() == "spawn"  # a thread's locks would be held, forever, in the child
    finally:
        release.set()
        thread.join()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method() == "spawn"  # a forked child cannot use its parent's CUDA context


def test_where_the_peaks_were_traced_is_said(capsys):
    """Where a CUDA target was traced (on the GPU, or on the CPU where none is visible): the JSON and
    the table say so."""
    import torch
    result = run_json(capsys, "--preset", "case-study", "--strategies", "zero2", "--device", "cuda")
    expected = "gpu" if torch.cuda.is_available() else "cpu"
    assert result["traced_on"] == expected and result["device"] == "cuda"
    assert main(["estimate", "--preset", "case-study", "--strategies", "zero2"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    said = {"gpu": "traced on fake tensors of this machine's GPU", "cpu": "traced on the CPU as no GPU is visible"}
    assert said[expected] in table
    assert run_json(capsys, "--params", "1e9", "--strategies", "zero2")["traced_on"] is None  # nothing traced


@pytest.mark.slow
def test_what_each_rank_needs_from_the_allocator_is_given(capsys, monkeypatch):
    """On CUDA each rank's reserved peak and smallest allocator cap, with and without expandable
    segments, and the memory outside the allocator; the table's "needs" follows the user's setting."""
    from zerolens.predict.allocator import OUTSIDE_ALLOCATOR_MEASURED
    result = run_json(capsys, "--preset", "case-study", "--strategies", "ddp,zero2", "--device", "cuda")
    for name, entry in result["strategies"].items():
        for rank in entry["ranks"]:
            for key in ("reserved_peak_bytes", "min_allocator_cap_bytes"):
                assert set(rank[key]) == {"default", "expandable_segments"}
            for setting in ("default", "expandable_segments"):
                # never below the allocated peak, never above the reserve with no cap
                assert rank["peak_bytes"] <= rank["min_allocator_cap_bytes"][setting] <= rank["reserved_peak_bytes"][setting]
            assert rank["outside_allocator_bytes"] == OUTSIDE_ALLOCATOR_MEASURED["deepspeed" if name == "zero2" else "torch"]
    cpu = run_json(capsys, "--preset", "case-study", "--strategies", "ddp", "--device", "cpu")
    assert "min_allocator_cap_bytes" not in cpu["strategies"]["ddp"]["ranks"][0]  # no allocator on the CPU
    rank = result["strategies"]["ddp"]["ranks"][0]
    for conf, setting in (("", "default"), ("expandable_segments:True", "expandable_segments")):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        assert main(["estimate", "--preset", "case-study", "--strategies", "ddp", "--device", "cuda"]) == 0
        table = " ".join(capsys.readouterr().out.split())
        needs = (rank["min_allocator_cap_bytes"][setting] + rank["outside_allocator_bytes"]) / 2**20
        assert "needs" in table and f"{needs:.2f}" in table.replace(",", "")
    # The user's own options: followed where the model has them, named where it has not.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,roundup_power2_divisions:[1:1,>:4],"
                                                  "release_lock_on_cudamalloc:True")
    own = run_json(capsys, "--preset", "case-study", "--strategies", "ddp", "--device", "cuda")
    caps = own["strategies"]["ddp"]["ranks"][0]["min_allocator_cap_bytes"]
    assert set(caps) == {"default", "expandable_segments", "PYTORCH_CUDA_ALLOC_CONF"}
    assert main(["estimate", "--preset", "case-study", "--strategies", "ddp", "--device", "cuda"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "release_lock_on_cudamalloc:True not modelled" in table and "max_split_size_mb" not in table
    assert f"{(caps['PYTORCH_CUDA_ALLOC_CONF'] + rank['outside_allocator_bytes']) / 2**20:.2f}" in table.replace(",", "")


def test_a_rank_the_allocator_model_did_not_replay_says_so(capsys, monkeypatch):
    """Past ALLOCATOR_REPLAYS distinct rank sequences (ZeRO-2 at many ranks), a rank without allocator figures
    says why, in the JSON and under the table; the others keep theirs."""
    monkeypatch.setattr("zerolens.predict.peak.ALLOCATOR_REPLAYS", 1)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    args = ["--preset", "gpt-tiny", "--nproc", "7", "--strategies", "zero2", "--reduce-bucket-size", "2e4",
            "--micro-batch", "2"]
    ranks = run_json(capsys, *args)["strategies"]["zero2"]["ranks"]
    without = [r for r in ranks if "min_allocator_cap_bytes" not in r]
    assert without and len(without) < len(ranks)
    assert all("allocator model replayed the 1 with the highest" in r["allocator_not_replayed"] for r in without)
    assert main(["estimate", *args]) == 0
    table = " ".join(capsys.readouterr().out.split())
    shown_without = [r["rank"] for r in without if r["rank"] in (0, max(ranks, key=lambda r: (
        r["grad_bytes_after_backward"], -r["rank"]))["rank"])]
    assert shown_without  # the table shows rank 0 and the rank holding the most gradients
    for rank in shown_without:
        assert f'No "needs" for zero2 rank {rank}: the 7 ranks make' in table
    # ... and the rank that needs the most, where the question is whether the job fits
    neediest = max((r for r in ranks if "min_allocator_cap_bytes" in r),
                   key=lambda r: (r["min_allocator_cap_bytes"]["default"], -r["rank"]))
    assert f"zero2 {neediest['rank']} " in table and "the rank that needs the most" in table


def test_the_table_shows_the_rank_that_needs_the_most(capsys, monkeypatch):
    """Beside rank 0 and the rank holding the most gradients, the table shows the rank whose need (smallest
    cap plus what is outside the allocator) is the highest: whether a job fits is that rank's question."""
    from zerolens.commands.estimate import render_estimate
    from zerolens.report.tables import say
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    result = run_json(capsys, "--preset", "gpt-tiny", "--nproc", "4", "--strategies", "zero2", "--micro-batch", "2")
    ranks = result["strategies"]["zero2"]["ranks"]
    largest = max(ranks, key=lambda r: (r["grad_bytes_after_backward"], -r["rank"]))["rank"]
    other = next(r for r in ranks if r["rank"] not in (0, largest))
    other["min_allocator_cap_bytes"]["default"] = max(r["min_allocator_cap_bytes"]["default"] for r in ranks) + 2**20
    say(*render_estimate(result))
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines() if line.startswith("zero2 ")]
    assert rows == [["zero2", "0"], ["zero2", str(largest)], ["zero2", str(other["rank"])]]


@pytest.mark.slow
def test_gradient_accumulation_is_estimated_for_every_strategy(cli):
    """--grad-accum 2 (what the trace does with it: test_predict_peak): DDP's, ZeRO-2's and ZeRO-3's
    peaks are predicted."""
    result = cli("estimate", "--strategies", "ddp,zero2,zero3", "--device", "cpu", "--json", "--grad-accum", "2")
    assert result.returncode == 0, result.stderr
    estimated = json.loads(result.stdout)
    assert estimated["grad_accum"] == 2 and estimated["strategies"]["ddp"]["ranks"][0]["peak_bytes"] > 0
    assert estimated["strategies"]["zero2"]["ranks"][0]["peak_bytes"] > 0
    assert estimated["strategies"]["zero3"]["ranks"][0]["peak_bytes"] > 0  # modelled: tests/test_zero3_grad_accum.py


def test_depth_scaling_is_said_per_rank_where_layouts_differ_in_it():
    """FSDP2's ranks of different layouts are traced apart, and one layout's traces may scale by depth where
    another's do not: each rank says which, and the strategy how many ranks' traces were scaled."""
    from zerolens.commands.estimate import add_peaks
    peaks = {k: 1 for k in ("peak_during_forward", "peak_during_backward", "peak_during_step", "peak_bytes",
                            "cublas_workspace_bytes")}
    scaled, whole = peaks | {"depth_scaled_from": [2, 3, 4, 5, 6]}, peaks | {"why_not_depth_scaled": "because"}
    entry = {"ranks": [{"rank": r} for r in range(3)]}
    add_peaks(entry, "fsdp2", {"ranks": [scaled, scaled, whole]}, None)
    assert (entry["depth_scaled_from"], entry["why_not_depth_scaled"], entry["depth_scaled_ranks"]) == \
        ([2, 3, 4, 5, 6], "because", 2)
    assert [("depth_scaled_from" in r, "why_not_depth_scaled" in r) for r in entry["ranks"]] == \
        [(True, False), (True, False), (False, True)]
    entry = {"ranks": [{"rank": r} for r in range(2)]}
    add_peaks(entry, "fsdp2", {"ranks": [scaled, scaled]}, None)
    assert "depth_scaled_ranks" not in entry and "why_not_depth_scaled" not in entry


def test_a_reduce_bucket_larger_than_the_gradients_is_said(capsys):
    """verify's bucket note, before any run: ZeRO's bucket of 5e7 elements against a small model's gradients,
    with the peaks where they are predicted (here they are not: a parameter count)."""
    assert main(["estimate", "--params", "2e6", "--nproc", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("zero1, zero2, zero3: the reduce bucket, 5e+07 elements (95.4 MiB in fp16), outweighs all 3.81 MiB of "
            "this model's gradients. Try --reduce-bucket-size 5e+05") in out
    assert main(["estimate", "--params", "2e6", "--nproc", "4", "--reduce-bucket-size", "5e5"]) == 0
    assert "outweighs" not in capsys.readouterr().out
    assert run_json(capsys, "--params", "2e6", "--nproc", "4")["trained_params"] == 2e6


def test_the_bucket_note_puts_the_peaks_beside_the_baselines():
    from zerolens.commands.estimate import bucket_note
    ranks = lambda *peaks: [{"peak_bytes": p} for p in peaks]  # noqa: E731
    result = {"precision": "bf16", "reduce_bucket_size": 5e7, "trained_params": 3950, "world_size": 2,
              "strategies": {"ddp": {"ranks": ranks(65 * 2**20, 65 * 2**20)},
                             "zero2": {"ranks": ranks(150 * 2**20, 160 * 2**20)}, "fsdp2": {"ranks": ranks(64 * 2**20)}}}
    assert bucket_note(result) == (
        "zero2: the reduce bucket, 5e+07 elements (95.4 MiB in bf16), outweighs all 7.71 KiB of this model's "
        "gradients; peak 160 MiB under zero2, against 65.0 MiB under ddp. Try --reduce-bucket-size 1e+03: at most "
        "one rank's share of the gradients.")
