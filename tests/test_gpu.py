"""On GPUs: on one, a single-rank verify and bench and every family's memory checks, and the note that says
why verify runs on CPU processes there; on two, the default verify (fp16, NCCL) with its peak checks,
failures over NCCL, and fresh processes after memory left behind."""
import json

import pytest
from conftest import zerolens

# One GPU test at a time, whatever pytest-xdist does with the rest: they share the GPUs.
pytestmark = pytest.mark.xdist_group("gpu")


@pytest.mark.gpu(2)
def test_verify_on_two_gpus(tmp_path):
    out = tmp_path / "run"
    result = zerolens("verify", "--nproc", "2", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["precision"] == "fp16"
    for name in ("zero0", "zero2"):
        for rank in summary["strategies"][name]["ranks"]:
            assert rank["peak_bytes"] > 0 and rank["allocated_after_backward"] > 0
    # The peak anatomy: every phase's peak replayed and attributed within 5%.
    replayed = [c for c in summary["checks"] if c["name"].startswith("peak replayed")]
    assert len(replayed) == 2 * 2 * 3  # 2 strategies x 2 ranks x 3 phases
    # The peak predicted before training: within 3% of the allocator's, each phase within 5%.
    predicted = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(predicted) == 2 * 2  # 2 strategies x 2 ranks
    peak_checks = replayed + predicted
    assert all(c["passed"] for c in peak_checks), [c["detail"] for c in peak_checks if not c["passed"]]


@pytest.mark.gpu(2)
def test_bench_on_two_gpus(tmp_path):
    out = tmp_path / "bench"
    result = zerolens("bench", "--preset", "gpt-tiny", "--strategies", "ddp,zero2", "--warmup", "1", "--steps", "3",
                      "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    bench = json.loads((out / "bench.json").read_text())
    assert bench["device"] == "cuda" and bench["memory_limit_bytes"] > 0
    for s in bench["strategies"].values():
        assert s["peak_bytes"] > 0 and all(p > 0 for p in s["peak_bytes_per_rank"])
        if bench["peak_tflops"] is not None:  # a GPU with a datasheet figure (H100/H200/A100 SXM)
            assert 0 < s["mfu"] < 1
    assert bench["strategies"]["zero2"]["vs_ddp"]["peak_bytes"] > 0


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.gpu(1)), pytest.param(2, marks=pytest.mark.gpu(2))])
def test_every_family_memory_checks(tmp_path, nproc):
    """DDP, ZeRO-2 and both FSDP2 modes on a GPT: census = prediction, allocator = census (in whole
    blocks) + workspaces, every peak explained and as predicted."""
    out = tmp_path / "gpt"
    zerolens("verify", "--preset", "gpt-tiny", "--strategies", "ddp,zero2,fsdp2-grad,fsdp2", "--steps", "10",
             "--nproc", str(nproc), "--device", "cuda", "--out", str(out), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    memory = [c for c in summary["checks"] if not c["name"].startswith("loss ")]
    assert any(c["name"].startswith("allocator agrees") for c in memory)
    assert all(c["passed"] for c in memory), [c["detail"] for c in memory if not c["passed"]]


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.gpu(1)), pytest.param(2, marks=pytest.mark.gpu(2))])
def test_gradient_accumulation_memory_checks(tmp_path, nproc):
    """--grad-accum 3: every memory check passes, ZeRO-2's accumulated gradients are named in its
    peaks' anatomy, and every strategy's peaks are as predicted."""
    out = tmp_path / "accumulated"
    zerolens("verify", "--preset", "gpt-tiny", "--strategies", "ddp,zero2,fsdp2", "--grad-accum", "3", "--steps", "4",
             "--nproc", str(nproc), "--device", "cuda", "--out", str(out), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    memory = [c for c in summary["checks"] if not c["name"].startswith("loss ")]
    assert all(c["passed"] for c in memory), [c["detail"] for c in memory if not c["passed"]]
    predicted = {c["name"].split("(")[1].split(",")[0] for c in memory if c["name"].startswith("peak as predicted")}
    assert predicted == {"ddp", "zero2", "fsdp2"}


@pytest.mark.gpu(2)
def test_no_peak_holds_an_earlier_strategys_memory(tmp_path):
    """DDP first: whatever it leaves allocated after its teardown (its buckets have), the strategies
    after it start from nothing, in fresh processes when needed."""
    out = tmp_path / "ddp-first"
    result = zerolens("verify", "--preset", "gpt-tiny", "--strategies", "ddp,zero0,zero2", "--steps", "6",
                      "--out", str(out), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS", result.stdout + result.stderr
    first = [r["allocated_at_start"] for r in summary["strategies"]["ddp"]["ranks"]]  # as in a fresh process
    for name in ("zero0", "zero2"):
        ranks = summary["strategies"][name]["ranks"]
        assert [r["allocated_at_start"] for r in ranks] == first
        assert all(r["earlier_strategies_left_bytes"] == 0 and r["peak_bytes"] > 0 for r in ranks)
    assert not any("started with memory of earlier strategies" in n for n in summary["notes"])
    if summary["strategies"]["ddp"]["left_allocated_after_teardown_bytes"]:
        assert any("ran in fresh worker processes" in n for n in summary["notes"])


@pytest.mark.gpu(2)
def test_a_hang_on_nccl_names_the_rank_that_stopped(tmp_path):
    out = tmp_path / "hang"
    result = zerolens("verify", "--steps", "6", "--timeout", "20", "--out", str(out), timeout=300,
                      env={"ZEROLENS_FAULT": "rank=1,step=3,phase=backward,kind=hang"})
    assert result.returncode == 1
    assert "rank 1 during backward of zero0 at step 3 stopped answering" in result.stderr, result.stderr
    assert "rank 0 during" in result.stderr and "was waiting for it" in result.stderr


@pytest.mark.gpu(2)
def test_memory_left_behind_on_a_gpu_starts_the_next_strategy_afresh(tmp_path):
    """A strategy that leaves CUDA memory allocated (1 MiB, a `leak` fault on rank 0) ends its launch;
    the next starts in new processes, with what a fresh process has allocated."""
    out = tmp_path / "leak"
    result = zerolens("verify", "--preset", "gpt-tiny", "--strategies", "ddp,zero2", "--steps", "6", "--out", str(out),
                      timeout=600, env={"ZEROLENS_FAULT": "rank=0,step=1,phase=step,kind=leak"})
    summary = json.loads((out / "summary.json").read_text())
    # The leaked MiB is in no census: on rank 0 the allocator check finds it, in each strategy.
    assert result.returncode == 1, result.stdout + result.stderr
    assert [c["name"] for c in summary["checks"] if not c["passed"]] == [
        "allocator agrees with the census (ddp, rank 0)", "allocator agrees with the census (zero2, rank 0)"]
    assert summary["strategies"]["ddp"]["left_allocated_after_teardown_bytes"] == 2**20
    ddp, zero2 = (summary["strategies"][n]["ranks"] for n in ("ddp", "zero2"))
    assert [r["allocated_at_start"] for r in zero2] == [r["allocated_at_start"] for r in ddp]
    assert any("ran in fresh worker processes" in n for n in summary["notes"])


@pytest.mark.gpu(1)
def test_a_single_rank_verify_on_one_gpu(tmp_path):
    """--nproc 1 --device cuda: the default verify on one GPU passes with its peak checks."""
    out = tmp_path / "n1"
    result = zerolens("verify", "--nproc", "1", "--device", "cuda", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["world_size"] == 1
    peak_checks = [c for c in summary["checks"] if c["name"].startswith(("peak replayed", "peak as predicted"))]
    assert len(peak_checks) == 2 * 3 + 2 and all(c["passed"] for c in peak_checks)  # 2 strategies: 3 phases + 1


@pytest.mark.gpu(1)
def test_bench_on_one_gpu_with_its_defaults(tmp_path):
    """bench on one GPU with its defaults there (fused AdamW, the preset's blocks and loss compiled, reference
    loops), in two interleaved rounds, each process compiling; the rounds' arithmetic is tested on the CPU
    (test_bench.py). MFU is also set against the matrix-product rate measured in the run."""
    bench = tmp_path / "bench"
    result = zerolens("bench", "--preset", "gpt-tiny", "--nproc", "1", "--device", "cuda", "--warmup", "1",
                      "--steps", "3", "--rounds", "2", "--out", str(bench), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((bench / "bench.json").read_text())
    assert all(s["peak_bytes"] > 0 for s in summary["strategies"].values())
    assert summary["model"]["compile_blocks"] and "fused" in summary["strategies"]["ddp"]["settings"]["optimizer"]
    assert summary["micro_batch"] == 32 and summary["rounds_run"] == 2
    assert all("harness_overhead" in s for s in summary["strategies"].values())
    assert summary["measured_matmul_tflops"] > 0
    assert all(0 < s["mfu_vs_measured_matmul"] for s in summary["strategies"].values())
    # the profiled warm-up step: one rank, no NCCL kernel to wait for
    assert all(s["communication_not_overlapped_s"] == 0 for s in summary["strategies"].values())


@pytest.mark.gpu(1)
def test_with_one_gpu_visible_verify_says_why_it_runs_on_cpu_processes(tmp_path):
    out = tmp_path / "one-gpu"
    result = zerolens("verify", "--steps", "4", "--out", str(out), timeout=600, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    said = " ".join(result.stdout.split())  # the terminal folds lines at 100 columns
    assert ("zerolens: 1 GPU visible: running on CPU processes (gloo), because without --device zerolens takes GPUs "
            "only when there are 2 or more (ZeRO shards over at least 2 ranks, and NCCL needs a GPU for each); for a "
            "single-rank measurement on the GPU, add --nproc 1 --device cuda") in said
    assert json.loads((out / "summary.json").read_text())["device"] == "cpu"
