"""A long verify or bench is not silent: on a terminal, rank 0 draws a bar per strategy that moves
with every step, and bench's says when the timed steps begin. In one process (world size 1), with
stderr standing in for a terminal."""
import io
import sys

import pytest
import torch
from distributed import spawn


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress_of_verify_and_bench(rank, world_size):
    import deepspeed

    from zerolens.models.model import PRESETS
    from zerolens.run.config import RunConfig
    from zerolens.run.train import Phase
    from zerolens.run.worker import run_strategy
    deepspeed.init_distributed(dist_backend="gloo")
    sys.stderr = screen = Terminal()
    verify = RunConfig(strategies=("ddp",), baseline="ddp", nproc=1, steps=5, device="cpu", precision="fp32",
                       model=PRESETS["gpt-tiny"])
    run_strategy("ddp", verify, torch.device("cpu"), Phase(), earlier_left=0)
    trained = screen.getvalue()
    bench = RunConfig(strategies=("ddp",), baseline="ddp", nproc=1, steps=3, warmup_steps=2, device="cpu",
                      precision="fp32", model=PRESETS["gpt-tiny"], job="bench")
    run_strategy("ddp", bench, torch.device("cpu"), Phase(), earlier_left=0)
    return trained, screen.getvalue()[len(trained):]


@pytest.mark.slow
def test_each_step_moves_a_bar_on_a_terminal():
    ((trained, benched),) = spawn(progress_of_verify_and_bench, world_size=1, timeout=240)
    assert "ddp" in trained and "5/5" in trained
    assert "ddp (warm-up)" in benched and "ddp (timed)" in benched and "5/5" in benched
