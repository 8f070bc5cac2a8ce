"""A long verify or bench is not silent: on a terminal, rank 0 draws a bar per strategy that moves
with every step, and bench's says when the timed steps begin. In one process (world size 1), with
stderr standing in for a terminal."""
import io
import sys

import torch

from distributed import spawn


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress_of_verify_and_bench(rank, world_size):
    import deepspeed
    from zerolens.bench import bench_batches, bench_strategy
    from zerolens.config import RunConfig
    from zerolens.model import PRESETS
    from zerolens.strategies import make_strategy
    from zerolens.train import Phase, train_strategy
    deepspeed.init_distributed(dist_backend="gloo")
    sys.stderr = screen = Terminal()
    config = RunConfig(strategies=("ddp",), baseline="ddp", nproc=1, steps=3, warmup_steps=2, device="cpu",
                          precision="fp32", model=PRESETS["gpt-tiny"], job="bench")
    train_strategy(make_strategy("ddp", config.train_settings()), model_config=config.model, steps=5, seed=0,
                   signal=0.8, micro_batch=2, device=torch.device("cpu"), phase=Phase())
    trained = screen.getvalue()
    bench_strategy(make_strategy("ddp", config.train_settings()), config, bench_batches(config),
                   torch.device("cpu"), Phase())
    return trained, screen.getvalue()[len(trained):]


def test_each_step_moves_a_bar_on_a_terminal():
    ((trained, benched),) = spawn(progress_of_verify_and_bench, world_size=1, timeout=240)
    assert "ddp" in trained and "5/5" in trained
    assert "ddp (warm-up)" in benched and "ddp (timed)" in benched and "5/5" in benched
