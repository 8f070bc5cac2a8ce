"""The case study's script under the real `deepspeed` launcher, on 2 CPU processes."""
import importlib.util
import re
import sys

import pytest
from conftest import REPO, free_port, remove_deepspeed_shared_memory, run


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("mode, steps", [("stage2", 20), ("stage2", 20), ("baseline", 3)])
def test_case_study_script_prints_true_gradient_memory(mode, steps):
    # The `deepspeed` command of this interpreter's DeepSpeed, not whichever is first on PATH. Run
    # more than once: it must exit 0 every time, not only most times.
    port = free_port()
    try:
        result = run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus=2", f"--master_port={port}",
                      str(REPO / "examples" / "train_zero_stage2.py"), mode, "--steps", str(steps)], timeout=240)
    finally:
        remove_deepspeed_shared_memory(port)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "terminate called" not in result.stdout + result.stderr
    lines = re.findall(r"^step=(\d+) loss=([\d.]+) grad_mem_rank0=([\d.]+)MB", result.stdout, re.M)
    assert [int(s) for s, _, _ in lines] == list(range(steps))
    assert all(float(mb) > 0 for _, _, mb in lines)  # the case study printed 0.00MB here
    per_rank = re.search(r"rank0=([\d.]+) MiB, rank1=([\d.]+) MiB", result.stdout)
    r0, r1 = float(per_rank[1]), float(per_rank[2])
    if mode == "baseline":
        assert r0 == r1  # full gradients on every rank
    else:
        assert r0 > r1  # rank 0's buffer keeps the parameters straddling the boundary whole
