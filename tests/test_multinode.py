"""Two "nodes" on one CPU host: two torchrun processes (--nnodes 2, one rank each, c10d rendezvous
on 127.0.0.1) give the same summary as a one-node run of the same world size."""
import json
import os
import subprocess
import sys

import pytest
from conftest import free_port, zerolens


@pytest.mark.slow
def test_two_torchrun_nodes_match_one_node(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "zerolens-test", "-m", "zerolens.worker", "--device", "cpu", "--steps", "6",
         "--fail-exit-code", "0", "--out", str(tmp_path / "two-nodes")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        pytest.fail("the two-node run did not finish within 300 s")
    assert [node.returncode for node in nodes] == [0, 0], outputs
    one = zerolens("verify", "--device", "cpu", "--steps", "6", "--out", str(tmp_path / "one-node"), timeout=300,
                   env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stdout + one.stderr  # 6 steps: "loss fell" is not checked
    two = json.loads((tmp_path / "two-nodes" / "summary.json").read_text())
    single = json.loads((tmp_path / "one-node" / "summary.json").read_text())
    assert two["world_size"] == single["world_size"] == 2
    for name, s in single["strategies"].items():
        assert two["strategies"][name]["losses"] == s["losses"]
        for key in ("grad_bytes_after_backward", "grad_partition_elements", "param_bytes", "optimizer_state_bytes"):
            assert [r[key] for r in two["strategies"][name]["ranks"]] == [r[key] for r in s["ranks"]], key
    assert [(c["name"], c["passed"]) for c in two["checks"]] == [(c["name"], c["passed"]) for c in single["checks"]]
