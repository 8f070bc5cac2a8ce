"""The max-size search against synthetic memory models: it must return the exact boundary, having
seen it fit and the next depth fail, whatever the memory's shape."""
import pytest

from zerolens.commands.maxsize import largest_fitting_depth, max_fitting

GiB = 2**30


def linear(fixed, per_layer, limit):
    def trial(depth):
        peak = fixed + per_layer * depth
        return peak if peak <= limit else None
    return trial


@pytest.mark.parametrize("fixed,per_layer,limit", [
    (6 * GiB, int(1.67 * GiB), 141 * GiB),  # DDP-like on an H200
    (6 * GiB, GiB, 24 * GiB),
    (1, 1, 10),
    (23 * GiB, GiB, 24 * GiB),  # exactly one layer
])
def test_finds_the_exact_boundary_of_a_linear_model(fixed, per_layer, limit):
    search = largest_fitting_depth(linear(fixed, per_layer, limit), lambda: limit)
    best = max_fitting(search)
    assert best == (limit - fixed) // per_layer
    assert search.trials[best] is not None and search.trials[best + 1] is None
    assert len(search.trials) <= 12


def test_a_guess_that_is_far_off_still_ends_at_the_boundary():
    # Memory grows slowly for the first layers, then jumps (e.g. a bucket or fragmentation):
    # the straight line through depths 1 and 2 overshoots a lot.
    def trial(depth):
        peak = depth if depth <= 2 else 2 + 50 * (depth - 2)
        return peak if peak <= 1000 else None
    search = largest_fitting_depth(trial, lambda: 1000)
    assert max_fitting(search) == 21 and search.trials[22] is None


def test_a_flat_start_does_not_jump_to_a_huge_model():
    # Depths 1 and 2 peak the same: the straight line is flat and would point at the cap.
    tried = []

    def trial(depth):
        tried.append(depth)
        peak = 100 if depth <= 2 else 100 + 10 * depth
        return peak if peak <= 3000 else None
    search = largest_fitting_depth(trial, lambda: 3000)
    assert max_fitting(search) == 290 and max(tried) <= 2 * 290


def test_nothing_fits_and_everything_fits():
    assert max_fitting(largest_fitting_depth(lambda d: None, lambda: 100)) == 0
    search = largest_fitting_depth(lambda d: d, lambda: 10**9, max_depth=64)
    assert max_fitting(search) == 64 and 65 not in search.trials


def fake_bench(limit_bytes, per_layer, fixed, oom_message="rank 1 ran out of GPU memory during zero2 step 0 backward"):
    """zerolens.run.jobs.run_job for a search without GPUs: a trial's peak grows with its depth, and a
    depth beyond the limit fails as an out-of-memory rank does (WorkersFailed naming it)."""
    from zerolens.run.launch import WorkersFailed
    calls = []

    def run_job(point, command, quiet=False):
        depth, name = point.model.num_layers, point.strategies[0]
        calls.append((name, depth, point.steps, point.warmup_steps, point.out, command, quiet))
        peak = fixed[name] + per_layer[name] * depth
        if peak > limit_bytes:
            raise WorkersFailed(oom_message)
        return {"memory_limit_bytes": limit_bytes, "strategies": {name: {"peak_bytes": peak}}}
    return run_job, calls


def test_run_maxsize_searches_each_strategy_and_writes_its_files(tmp_path, monkeypatch, capsys):
    import json

    from zerolens.commands.maxsize import run_maxsize
    from zerolens.models.model import PRESETS
    from zerolens.run import jobs
    from zerolens.run.config import RunConfig
    run_job, calls = fake_bench(24 * GiB, {"ddp": 2 * GiB, "zero2": GiB}, {"ddp": 2 * GiB, "zero2": 2 * GiB})
    monkeypatch.setattr(jobs, "run_job", run_job)
    config = RunConfig(strategies=("ddp", "zero2"), baseline="ddp", device="cuda", job="bench", steps=1,
                       preset="gpt-tiny", model=PRESETS["gpt-tiny"])
    assert run_maxsize(config, tmp_path, "zerolens maxsize --preset gpt-tiny") == 0
    summary = json.loads((tmp_path / "maxsize.json").read_text())
    assert summary["strategies"]["ddp"]["max_depth"] == 11 and summary["strategies"]["zero2"]["max_depth"] == 22
    assert summary["strategies"]["ddp"]["first_failing_depth"] == 12
    assert summary["strategies"]["zero2"]["params_vs_ddp"] == summary["strategies"]["zero2"]["params"] / \
        summary["strategies"]["ddp"]["params"] > 1.5
    assert summary["memory_limit_bytes"] == 24 * GiB and summary["schema_version"] >= 1
    # Each trial: one strategy, one warm-up and one timed step, in its own new folder, quietly.
    assert all(steps == 1 and warmup == 1 and quiet for _, _, steps, warmup, _, _, quiet in calls)
    assert len({out for *_, out, _, _ in calls}) == len(calls)
    assert all((tmp_path / "trials" / f"{name}-depth{depth}").is_dir() for name, depth, *_ in calls)
    assert "| ddp | 11 |" in (tmp_path / "maxsize.md").read_text()
    assert "zero2" in capsys.readouterr().out


def test_run_maxsize_stops_on_a_failure_that_is_not_out_of_memory(tmp_path, monkeypatch, capsys):
    import json

    from zerolens.commands.maxsize import run_maxsize
    from zerolens.models.model import PRESETS
    from zerolens.run import jobs
    from zerolens.run.config import RunConfig
    run_job, _ = fake_bench(24 * GiB, {"ddp": 2 * GiB, "zero2": GiB}, {"ddp": 2 * GiB, "zero2": 2 * GiB},
                            oom_message="rank 0 failed during zero2 step 0 forward: RuntimeError: boom")
    monkeypatch.setattr(jobs, "run_job", run_job)
    config = RunConfig(strategies=("ddp",), baseline="ddp", device="cuda", job="bench", steps=1,
                       preset="gpt-tiny", model=PRESETS["gpt-tiny"])
    assert run_maxsize(config, tmp_path, "zerolens maxsize") == 1
    summary = json.loads((tmp_path / "maxsize.json").read_text())
    assert "boom" in summary["failure"] and not (tmp_path / "maxsize.md").exists()
    assert "zerolens: FAILED:" in capsys.readouterr().err
