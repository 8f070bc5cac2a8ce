"""zerolens.track inside a user's own loop: the strategy recognised from what the loop built, the phases
found through hooks, and the figures verify reports for the same model and settings, byte for byte."""
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, remove_deepspeed_shared_memory, run, zerolens
from distributed import spawn
from torch import nn

import zerolens as zl
from zerolens.errors import UserError
from zerolens.models.model import PRESETS, build_model
from zerolens.strategies.layout import RETAINED_KEYS

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
STEPS = 4
GROUPED = ("zero1-groups", "zero2-groups", "zero3-groups")
MICRO_BATCH = 2


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """verify's figures for gpt-tiny in bf16 on 2 CPU ranks, and the settings it ran each strategy with."""
    out = tmp_path_factory.mktemp("verify") / "run"
    result = zerolens("verify", "--preset", "gpt-tiny", "--precision", "bf16", "--strategies", ",".join(STRATEGIES),
                      "--steps", str(STEPS), "--micro-batch", str(MICRO_BATCH), "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return (json.loads((out / "summary.json").read_text()),
            json.loads((out / "config.json").read_text())["strategy_settings"])


def two_groups(model: nn.Module) -> list[dict]:
    """AdamW's parameter groups as Hugging Face's Trainer makes them: weight decay for the matrices,
    none for the biases and norms."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def users_loops(rank, world_size, out, strategy_settings):
    """What users write: each backend set up with its own library's calls and the settings verify used
    (its lr, gradient clipping and bf16; for DeepSpeed the config verify wrote), then a plain loop
    inside zerolens.track. Then ZeRO-1/2/3 again with an AdamW of two parameter groups, which DeepSpeed
    flattens and partitions each on its own."""
    import deepspeed
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    deepspeed.init_distributed(dist_backend="gloo")
    config = PRESETS["gpt-tiny"]
    for name in (*STRATEGIES, *GROUPED):
        model = build_model(config, seed=0)
        engine = optimizer = None
        if name in GROUPED:
            ds_config = {k: v for k, v in strategy_settings[name.removesuffix("-groups")]["ds_config"].items()
                         if k != "optimizer"}
            engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                                   optimizer=torch.optim.AdamW(two_groups(model), lr=1e-4))
            trained = engine
        elif name == "ddp":
            trained = nn.parallel.DistributedDataParallel(model)
        elif name == "fsdp2":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            trained = fully_shard(model, mp_policy=policy)
        else:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=strategy_settings[name]["ds_config"])
            trained = engine
        if engine is None:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(rank)
        with zl.track(trained, optimizer, out=out / name, every=1):
            for _ in range(STEPS):
                tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_len))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "ddp"):
                    logits = trained(tokens)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
                if engine is not None:
                    engine.backward(loss)
                    engine.step()
                else:
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if engine is not None:
            engine.destroy()


@pytest.mark.slow
def test_tracked_figures_equal_verifys_for_every_backend(verified, tmp_path):
    summary, strategy_settings = verified
    spawn(users_loops, tmp_path, strategy_settings, timeout=600)
    for name in STRATEGIES:
        tracked = json.loads((tmp_path / name / "summary.json").read_text())
        assert tracked["verdict"] == "FINISHED" and tracked["strategy"] == name
        assert all(c["passed"] for c in tracked["checks"]) and len(tracked["checks"]) == 2
        for mine, theirs in zip(tracked["strategies"][name]["ranks"], summary["strategies"][name]["ranks"],
                                strict=True):
            assert mine["sampled_steps"] == list(range(STEPS))
            assert {k: mine[k] for k in RETAINED_KEYS} == {k: theirs[k] for k in RETAINED_KEYS}, name
        for f in ("config.json", "env.json", "metrics_rank0.jsonl", "metrics_rank1.jsonl", "report.md"):
            assert (tmp_path / name / f).is_file(), (name, f)
        # What the forward computed in, beside the weights' dtype: DDP's loop autocasts, FSDP2 gathers in bf16
        assert tracked["computed_in"] == {"ddp": "autocast bfloat16",
                                          "fsdp2": "FSDP2's MixedPrecisionPolicy: bfloat16"}.get(name), name
    for name in GROUPED:  # predicted group by group, byte for byte
        tracked = json.loads((tmp_path / name / "summary.json").read_text())
        assert len(tracked["checks"]) == 2 and all(c["passed"] for c in tracked["checks"]), tracked["checks"]


def tiny_model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    return model, torch.optim.AdamW(model.parameters())


def train_steps(model, optimizer, steps: int, fail_at: int | None = None) -> None:
    for step in range(steps):
        if step == fail_at:
            raise RuntimeError("the user's loop failed here")
        optimizer.zero_grad()
        tokens = torch.randint(0, 32, (2, 4))
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()


def several_optimizers(rank, world_size, out):
    """DDP loops that step their embedding with an optimizer of its own: two Adams (predicted), AdamW
    with an SGD stepped every other step (not predicted: SGD's momentum is no layout's), and the
    AdamW alone given to track while the SGD steps the embedding (predicted for the AdamW's parameters)."""
    for case in ("two-adams", "adamw-sgd", "adamw-given-alone"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
        embedding, head = list(model[0].parameters()), list(model[1].parameters())
        main = torch.optim.AdamW(head, lr=1e-3)
        other = torch.optim.Adam(embedding, lr=1e-3) if case == "two-adams" else \
            torch.optim.SGD(embedding, lr=0.1, momentum=0.9)
        trained = nn.parallel.DistributedDataParallel(model)
        with zl.track(trained, main if case == "adamw-given-alone" else [main, other], out=out / case, every=2):
            for step in range(5):
                tokens = torch.randint(0, 32, (2, 4))
                nn.functional.cross_entropy(trained(tokens).flatten(0, 1), tokens.flatten()).backward()
                main.step()
                if case == "two-adams" or step % 2 == 0:
                    other.step()
                main.zero_grad()
                other.zero_grad()


def ddp_loops_users_write(rank, world_size, out):
    """DDP as users set it up: gradients as views of the buckets; a layer the forward skips, under
    find_unused_parameters; AMSGrad and NAdam (states the layouts do not model); the wrapper left in
    eval mode around a module in training mode (what Lightning does after a validation)."""
    class Skipping(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
            self.unused = nn.Linear(16, 16)

        def forward(self, tokens):
            return self.inner(tokens)
    for case in ("bucket-view", "unused", "amsgrad", "nadam", "wrapper-in-eval", "late-optimizer"):
        torch.manual_seed(0)
        model = Skipping() if case == "unused" else nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
        trained = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=case == "bucket-view",
                                                      find_unused_parameters=case == "unused")
        optimizer = (torch.optim.NAdam(model.parameters()) if case == "nadam" else
                     torch.optim.AdamW(model.parameters(), amsgrad=case == "amsgrad"))
        if case == "wrapper-in-eval":
            trained.eval()
            model.train()
        if case == "late-optimizer":  # the head's optimizer steps from the second step on: no states at the first
            first, second = two_optimizers(model)
            with zl.track(trained, [first, second], out=out / case, every=100):
                for step in range(3):
                    tokens = torch.randint(0, 32, (2, 4))
                    nn.functional.cross_entropy(trained(tokens).flatten(0, 1), tokens.flatten()).backward()
                    first.step()
                    if step:
                        second.step()
                    first.zero_grad()
                    second.zero_grad()
            continue
        with zl.track(trained, optimizer, out=out / case, every=1):
            train_steps(trained, optimizer, 3)


@pytest.mark.slow  # a process of its own, ~7 s: the slow tier
def test_ddp_set_up_as_users_do_is_predicted_or_says_why_not(tmp_path):
    spawn(ddp_loops_users_write, tmp_path, timeout=240)
    summaries = {case: json.loads((tmp_path / case / "summary.json").read_text())
                 for case in ("bucket-view", "unused", "amsgrad", "nadam", "wrapper-in-eval", "late-optimizer")}
    for case in ("bucket-view", "wrapper-in-eval"):
        summary = summaries[case]
        assert summary["strategies"]["ddp"]["ranks"][0]["sampled_steps"] == [0, 1, 2], case
        assert len(summary["checks"]) == 2 and all(c["passed"] for c in summary["checks"]), (case, summary["checks"])
    assert summaries["bucket-view"]["strategies"]["ddp"]["ranks"][0]["comm_buffer_bytes_after_backward"] == 0
    reasons = {"unused": "2 of the parameters that train had no gradient after a sampled step's backward",
               "amsgrad": "and the loop steps AdamW (amsgrad)", "nadam": "and the loop steps NAdam",
               "late-optimizer": "1 of the optimizers given to track had not stepped yet at the sampled step"}
    for case, reason in reasons.items():
        summary = summaries[case]
        assert summary["checks"] == [] and any(reason in note for note in summary["notes"]), (case, summary["notes"])


def test_ranks_that_hold_the_same_are_not_told_apart_as_the_largest():
    """Two ranks with the same figures fold into one row ("0-1"), and no rank is named the largest."""
    from zerolens.report.render import tracked_terminal_lines
    rank = {k: 1024 for k in ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes",
                              "comm_buffer_bytes_after_backward")} | {
        "grad_bytes_after_step": 0, "comm_buffer_bytes_after_step": 1024, "peak_bytes": None, "reserved_peak_bytes": None}
    summary = {"strategy": "ddp", "checks": [],
               "strategies": {"ddp": {"ranks": [rank | {"rank": 0}, rank | {"rank": 1}]}}}
    lines = tracked_terminal_lines(summary, Path("run"))
    assert "Every rank holds the same." in lines and not any("Largest" in str(line) for line in lines)
    summary["strategies"]["ddp"]["ranks"][1]["param_bytes"] = 2048
    assert "Largest: rank 1." in tracked_terminal_lines(summary, Path("run"))


def two_optimizers(model):
    return torch.optim.AdamW(model[0].parameters()), torch.optim.AdamW(model[1].parameters())


def test_several_optimizers_each_after_a_backward_of_its_own_count_one_step(tmp_path):
    """A loop that steps one optimizer between two backwards (track sees backward only in a sampled step):
    one step per iteration, sampled or not; the same optimizer given twice is one."""
    model, _ = tiny_model_and_optimizer()
    first, second = two_optimizers(model)
    with zl.track(model, [first, second, second], out=tmp_path / "run", every=3):
        for _ in range(6):
            tokens = torch.randint(0, 32, (2, 4))
            logits = model(tokens)
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward(retain_graph=True)
            first.step()
            (2 * nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())).backward()
            second.step()
            first.zero_grad()
            second.zero_grad()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_seen"] == 6 and summary["strategies"]["module"]["ranks"][0]["sampled_steps"] == [0, 3]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"] == "AdamW, AdamW"


def test_a_step_an_error_broke_off_between_two_optimizers_is_not_recorded_whole(tmp_path):
    model, _ = tiny_model_and_optimizer()
    first, second = two_optimizers(model)
    with pytest.raises(RuntimeError, match="between the optimizers"):
        with zl.track(model, [first, second], out=tmp_path / "run", every=1):
            for step in range(3):
                tokens = torch.randint(0, 32, (2, 4))
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                first.step()
                if step == 1:
                    raise RuntimeError("failed between the optimizers")
                second.step()
                first.zero_grad()
                second.zero_grad()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "CRASHED" and summary["steps_seen"] == 1
    assert summary["strategies"]["module"]["ranks"][0]["sampled_steps"] == [0]


def test_what_the_forward_computes_in_can_be_said_by_the_caller(tmp_path):
    """Lightning on one device: its autocast begins after the hook that starts track's forward, so its
    callback says the precision (Trainer(precision="bf16-mixed"))."""
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=1) as tracker:
        tracker.mixed_precision = "Lightning's bf16-mixed (autocast)"
        train_steps(model, optimizer, 1)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["computed_in"] == \
        "Lightning's bf16-mixed (autocast)"


def test_only_a_torch_compile_wrapper_is_looked_inside():
    """A DeepSpeed engine answers any attribute from its module (`_orig_mod` too): it is no compiled wrapper."""
    from zerolens.tracking.track import compiled_inside

    class AnswersEverything(nn.Module):
        def __getattr__(self, name):
            return nn.Linear(1, 1) if name == "_orig_mod" else super().__getattr__(name)
    engine_like = AnswersEverything()
    assert compiled_inside(engine_like) is engine_like
    model = nn.Linear(2, 2)
    assert compiled_inside(torch.compile(model, backend="eager")) is model


@pytest.mark.slow  # a process of its own, ~7 s: the slow tier
def test_a_loop_with_several_optimizers_is_tracked_as_one_step_of_them_all(tmp_path):
    spawn(several_optimizers, tmp_path, timeout=240)
    embedding, head = 32 * 16, 16 * 32 + 32  # elements
    summaries = {case: json.loads((tmp_path / case / "summary.json").read_text())
                 for case in ("two-adams", "adamw-sgd", "adamw-given-alone")}
    for case, summary in summaries.items():
        assert summary["steps_seen"] == 5, case
        rank = summary["strategies"]["ddp"]["ranks"][0]
        assert rank["sampled_steps"] == [0, 2, 4], case
    both = summaries["two-adams"]
    assert [c["passed"] for c in both["checks"]] == [True, True]
    rank = both["strategies"]["ddp"]["ranks"][0]
    assert rank["optimizer_state_bytes"] == 2 * 4 * (embedding + head) + 4 * 3  # both Adams' moments and steps
    assert json.loads((tmp_path / "two-adams" / "config.json").read_text())["optimizer"] == "AdamW, Adam"
    sgd = summaries["adamw-sgd"]
    assert sgd["checks"] == [] and any("and the loop steps SGD" in note for note in sgd["notes"])
    assert sgd["strategies"]["ddp"]["ranks"][0]["optimizer_state_bytes"] == 2 * 4 * head + 4 * 2 + 4 * embedding
    alone = summaries["adamw-given-alone"]
    assert [c["passed"] for c in alone["checks"]] == [True, True]
    assert alone["strategies"]["ddp"]["ranks"][0]["optimizer_state_bytes"] == 2 * 4 * head + 4 * 2
    assert any(note.startswith("1 of the model's trained parameter tensors (requires_grad; 512 elements) in none "
                               "of the optimizers") for note in alone["notes"])

def test_a_loop_that_never_calls_the_tracked_modules_forward_is_told_why(tmp_path, capsys):
    """The loop calls the model's parts, never the model: steps are seen, none measured, and the report says
    what track needs."""
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=1):
        for _ in range(2):
            optimizer.zero_grad()
            tokens = torch.randint(0, 32, (2, 4))
            nn.functional.cross_entropy(model[1](model[0](tokens)).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()
    assert "zerolens.track: no step was measured" in capsys.readouterr().out
    report = " ".join((tmp_path / "run" / "report.md").read_text().split())
    assert "No step was measured: 2 optimizer steps were seen, but no training forward" in report
    assert "Give track the module whose forward the loop calls." in report


def test_a_plain_module_is_tracked_on_the_sampled_steps(tmp_path, capsys):
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=3):
        train_steps(model, optimizer, 7)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rank = summary["strategies"]["module"]["ranks"][0]
    assert summary["verdict"] == "FINISHED" and summary["steps_seen"] == 7
    assert rank["sampled_steps"] == [0, 3, 6]
    assert len(rank["seconds_of_sampled_steps"]) == 3 and all(t > 0 for t in rank["seconds_of_sampled_steps"])
    assert "sampled step (s, median)" in (tmp_path / "run" / "report.md").read_text()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert rank["param_bytes"] == rank["grad_bytes_after_backward"] == params
    # AdamW's two moments, and a 4-byte step counter per parameter
    assert rank["optimizer_state_bytes"] == 2 * params + 4 * len(list(model.parameters()))
    assert rank["grad_bytes_after_step"] == 0  # the census after the step sees the next iteration's zero_grad
    assert "Largest: rank 0." in capsys.readouterr().out
    # What track changed is put back: no hook, no patched function.
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.autograd.backward.__module__ == "torch.autograd"


def test_each_sampled_steps_figures_go_where_the_loop_logs(tmp_path):
    """log_to: a TensorBoard SummaryWriter, or a function of (figures, step), gets rank 0's figures
    of each sampled step, in MiB, at the step's number; the run folder is written as ever."""
    from torch.utils.tensorboard import SummaryWriter
    model, optimizer = tiny_model_and_optimizer()
    writer, logged = SummaryWriter(tmp_path / "tb"), []
    with zl.track(model, optimizer, out=tmp_path / "tb-run", every=2, log_to=writer):
        train_steps(model, optimizer, 5)
    writer.close()
    with zl.track(model, optimizer, out=tmp_path / "run", every=2, log_to=lambda *a: logged.append(a)):
        train_steps(model, optimizer, 3)
    rank = json.loads((tmp_path / "run" / "summary.json").read_text())["strategies"]["module"]["ranks"][0]
    assert [step for _, step in logged] == [0, 2]
    figures = logged[-1][0]
    assert figures["zerolens/param_after_step_MiB"] == rank["param_bytes"] / 2**20
    assert figures["zerolens/grad_after_backward_MiB"] == rank["grad_bytes_after_backward"] / 2**20
    assert figures["zerolens/activation_after_forward_MiB"] > 0 and figures["zerolens/seconds_sampled_step"] > 0
    assert tensorboard_scalars(tmp_path / "tb", "zerolens/param_after_step_MiB") == [
        (step, pytest.approx(rank["param_bytes"] / 2**20)) for step in (0, 2, 4)]


def test_an_evaluation_forward_is_not_a_training_phase(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=1):
        train_steps(model, optimizer, 2)
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 32, (2, 4)))
    rank = json.loads((tmp_path / "run" / "summary.json").read_text())["strategies"]["module"]["ranks"][0]
    assert rank["sampled_steps"] == [0, 1]


def test_a_crash_in_the_loop_leaves_a_readable_partial_report(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    with pytest.raises(RuntimeError, match="failed here"):
        with zl.track(model, optimizer, out=tmp_path / "run", every=1):
            train_steps(model, optimizer, 5, fail_at=3)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["verdict"] == "CRASHED"
    assert summary["errors"] == {"rank0": "RuntimeError: the user's loop failed here"}
    assert summary["strategies"]["module"]["ranks"][0]["sampled_steps"] == [0, 1, 2]
    assert "CRASHED" in (run / "report.md").read_text() and "failed here" in (run / "report.md").read_text()
    assert not model._forward_pre_hooks and torch.autograd.backward.__module__ == "torch.autograd"


@pytest.mark.parametrize("call, message", [
    (lambda m, o, out: zl.track(m, None, out=out), "needs the optimizer"),
    (lambda m, o, out: zl.track(m, [], out=out), "needs the optimizer"),
    (lambda m, o, out: zl.track(m, [o, "sgd"], out=out), "needs the optimizer"),
    (lambda m, o, out: zl.track("model", o, out=out), "cannot track a str"),
    (lambda m, o, out: zl.track(m, o, out=out, every=0), "every=0"),
    (lambda m, o, out: zl.track(m, o, out=out, log_to="tb"), "log_to=str"),
])
def test_what_cannot_be_tracked_is_said_in_one_line(tmp_path, call, message):
    model, optimizer = tiny_model_and_optimizer()
    with pytest.raises(UserError, match=message):
        with call(model, optimizer, tmp_path / "run"):
            pass
    assert not (tmp_path / "run").exists()


def test_a_folder_zerolens_did_not_make_is_left_alone(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    model, optimizer = tiny_model_and_optimizer()
    with pytest.raises(UserError, match="already exists and is not empty; choose another out=, or replace it with "
                                         "overwrite=True"):  # track's own arguments, not verify's flags
        with zl.track(model, optimizer, out=mine):
            pass
    with pytest.raises(UserError, match="overwrite=True: .* not created by zerolens"):
        with zl.track(model, optimizer, out=mine, overwrite=True):
            pass
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def torchrun(script: Path, *args: str, env: dict | None = None) -> None:
    """An example run as its docstring says, with torchrun on 2 CPU processes."""
    port = free_port()
    try:
        result = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                      str(port), str(script), *args], timeout=600, env={"OMP_NUM_THREADS": "1", **(env or {})})
    finally:
        remove_deepspeed_shared_memory(port)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "memory per rank in" in result.stdout and "Report: " in result.stdout  # rank 0's table at exit


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp2_loop.py", "deepspeed_zero2_loop.py",
                                    "deepspeed_zero2_loop.py --deepspeed-adam"])
def test_the_examples_loops_write_their_reports(tmp_path, script):
    """--deepspeed-adam: DeepSpeed's FusedAdam, whose step counts are no tensors, predicted so."""
    script, *flags = script.split()
    torchrun(EXAMPLES / "track" / script, *flags, "--out", str(tmp_path / "run"), "--steps", "5", "--every", "2")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "FINISHED" and summary["steps_seen"] == 5
    assert [r["sampled_steps"] for r in summary["strategies"][summary["strategy"]]["ranks"]] == [[0, 2, 4]] * 2
    assert len(summary["checks"]) == 2 and all(c["passed"] for c in summary["checks"])


@pytest.mark.slow
def test_a_trainer_with_deepspeed_is_tracked_as_verify_measures_it(tmp_path):
    """A real transformers.Trainer with a DeepSpeed ZeRO-2 config (examples/track): with one AdamW
    parameter group, what track reports equals verify's figures for the same model and settings,
    byte for byte; with the Trainer's own two groups, its figures are as predicted group by group,
    and where the Trainer reports to TensorBoard, rank 0's figures go there too."""
    seq_len, steps = "32", "4"
    script = EXAMPLES / "track" / "hf_trainer_deepspeed.py"
    torchrun(script, "--out", str(tmp_path / "one"), "--steps", steps, "--every", "1", "--seq-len", seq_len,
             "--one-param-group")
    torchrun(script, "--out", str(tmp_path / "two"), "--steps", steps, "--every", "2", "--seq-len", seq_len,
             "--report-to", "tensorboard", env={"TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb")})
    result = zerolens("verify", "--model", f"hf:{EXAMPLES / 'hf' / 'llama-tiny.json'}", "--ds-config",
                      str(EXAMPLES / "track" / "ds_zero2.json"), "--strategies", "zero2", "--precision", "bf16",
                      "--micro-batch", "2", "--seq-len", seq_len, "--steps", steps, "--out", str(tmp_path / "verify"),
                      timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    verified = json.loads((tmp_path / "verify" / "summary.json").read_text())["strategies"]["zero2"]["ranks"]
    for folder in ("one", "two"):
        summary = json.loads((tmp_path / folder / "summary.json").read_text())
        assert summary["verdict"] == "FINISHED" and summary["strategy"] == "zero2"
        assert len(summary["checks"]) == 2 and all(c["passed"] for c in summary["checks"]), summary["checks"]
    tracked = json.loads((tmp_path / "one" / "summary.json").read_text())["strategies"]["zero2"]["ranks"]
    for mine, theirs in zip(tracked, verified, strict=True):
        assert {k: mine[k] for k in RETAINED_KEYS} == {k: theirs[k] for k in RETAINED_KEYS}
    two = json.loads((tmp_path / "two" / "summary.json").read_text())["strategies"]["zero2"]["ranks"]
    assert two[0]["optimizer_state_bytes"] == tracked[0]["optimizer_state_bytes"] + 4  # a step counter per group
    # The Trainer logs at its global step (the steps done when each measured step's record was whole),
    # under "train/" as it logs its own loss.
    optimizer_states = tensorboard_scalars(tmp_path / "tb", "train/zerolens/optimizer_state_after_step_MiB")
    assert [step for step, _ in optimizer_states] == [1, 3]
    assert optimizer_states[-1][1] == pytest.approx(two[0]["optimizer_state_bytes"] / 2**20)


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every scalar `tag` in the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    scalars = []
    for events in sorted({path.parent for path in folder.rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            scalars += [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return scalars


@pytest.mark.slow
def test_a_lightning_trainer_is_tracked_through_its_callback(tmp_path):
    """Lightning's DDP on 2 CPU processes: its optimizer steps with a closure that runs forward and
    backward inside `step`, and zeroes the gradients only after the next forward; the phases are
    found all the same, and the gradients it keeps through that forward are predicted and said."""
    result = run([sys.executable, str(EXAMPLES / "track" / "lightning_loop.py"), "--out", str(tmp_path / "run"),
                  "--steps", "5", "--every", "2", "--csv-logs", str(tmp_path / "csv")], timeout=600,
                 env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "FINISHED" and summary["strategy"] == "ddp"
    ranks = summary["strategies"]["ddp"]["ranks"]
    assert [r["sampled_steps"] for r in ranks] == [[0, 2, 4]] * 2
    assert len(summary["checks"]) == 2 and all(c["passed"] for c in summary["checks"])
    assert all(r["grad_bytes_after_step"] == r["grad_bytes_after_backward"] > 0 for r in ranks)
    assert any("still held at the next step's forward" in note for note in summary["notes"])
    # Rank 0's figures in the Trainer's logger too, at its global step.
    import csv
    logged = [row for row in csv.DictReader(next((tmp_path / "csv").rglob("metrics.csv")).open())
              if row.get("zerolens/grad_after_backward_MiB")]
    assert [int(row["step"]) for row in logged] == [1, 3, 5]
    assert float(logged[-1]["zerolens/grad_after_backward_MiB"]) == ranks[0]["grad_bytes_after_backward"] / 2**20


@pytest.mark.slow
def test_a_lightning_module_left_unwrapped_is_tracked_though_its_forward_never_runs(tmp_path):
    """One device: Lightning calls training_step itself, which calls a submodule (self.model), never the
    LightningModule's own forward; the callback takes each forward from the batch's start to backward
    (nothing was measured before)."""
    result = run([sys.executable, str(EXAMPLES / "track" / "lightning_loop.py"), "--out", str(tmp_path / "run"),
                  "--steps", "5", "--every", "2", "--devices", "1", "--strategy", "auto"], timeout=300,
                 env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    [rank] = next(iter(summary["strategies"].values()))["ranks"]
    assert rank["sampled_steps"] == [0, 2, 4]
    assert rank["activation_bytes_after_forward"] > 0 and rank["grad_bytes_after_backward"] > 0


def test_an_error_of_zerolens_in_a_hook_ends_the_measuring_not_the_training(tmp_path, capsys):
    from zerolens.measure.census import MeasurementError
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=1) as tracker:
        train_steps(model, optimizer, 2)

        def broken():
            raise MeasurementError("a buffer moved")
        tracker.strategy.holdings = broken
        train_steps(model, optimizer, 3)  # goes on: step 1's census after the step fails in step 2's forward
    assert "rank 0: zerolens.track stopped measuring at step 2: MeasurementError: a buffer moved" in \
        capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["verdict"] == "FINISHED" and summary["steps_seen"] == 2  # no step counted once it stopped
    assert summary["strategies"]["module"]["ranks"][0]["sampled_steps"] == [0]  # step 1's record was not whole
    assert "a buffer moved" in summary["errors"]["rank0"]
    assert not model._forward_pre_hooks and torch.autograd.backward.__module__ == "torch.autograd"


def test_an_error_of_zerolens_before_the_first_step_ended_is_what_the_report_says(tmp_path):
    """Not "the optimizer took no step": the report names zerolens's own error, which ended the measuring."""
    from zerolens.measure.census import MeasurementError
    model, optimizer = tiny_model_and_optimizer()
    with zl.track(model, optimizer, out=tmp_path / "run", every=1) as tracker:
        def broken():
            raise MeasurementError("a buffer moved")
        tracker.strategy.holdings = broken
        train_steps(model, optimizer, 2)
    report = " ".join((tmp_path / "run" / "report.md").read_text().split())
    assert "rank0: zerolens.track stopped measuring at step 0: MeasurementError: a buffer moved; the training went on." \
        in report
    assert "No step was measured: zerolens stopped measuring (above) before the first sampled step ended." in report
    assert "took no step" not in report


def compiled_loops(rank, world_size, out):
    """torch.compile around DDP and around fully_shard, as users write them: track gets the compiled
    wrapper (its forward hooks stay outside the compiled code) and recognises the backend inside."""
    from torch.distributed.fsdp import fully_shard
    for name in ("ddp", "fsdp2", "fsdp2-around-compiled"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
        if name == "fsdp2-around-compiled":  # fully_shard(torch.compile(model)): FSDP2's own module, compiled inside
            trained = fully_shard(torch.compile(model, backend="eager"))
            model = trained
        else:
            wrapped = nn.parallel.DistributedDataParallel(model) if name == "ddp" else fully_shard(model)
            trained = torch.compile(wrapped, backend="eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with zl.track(trained, optimizer, out=out / name, every=1):
            train_steps(trained, optimizer, 3)


@pytest.mark.slow  # a process of its own, ~7 s: the slow tier
def test_a_compiled_ddp_or_fsdp2_model_is_tracked_as_its_backend(tmp_path):
    spawn(compiled_loops, tmp_path, timeout=240)
    for case in ("ddp", "fsdp2", "fsdp2-around-compiled"):
        summary = json.loads((tmp_path / case / "summary.json").read_text())
        name = case.removesuffix("-around-compiled")
        assert summary["strategy"] == name and not summary["errors"], summary
        assert summary["strategies"][name]["ranks"][0]["sampled_steps"] == [0, 1, 2]
        assert len(summary["checks"]) == 2 and all(c["passed"] for c in summary["checks"]), summary["checks"]


def test_fsdp1_is_refused_in_one_line(tmp_path):
    """FSDP1 wraps the model in a module of its own, which track would otherwise take for a plain module."""
    class FullyShardedDataParallel(nn.Module):  # FSDP1's class name, without a process group to build one
        pass
    model, optimizer = tiny_model_and_optimizer()
    wrapped = FullyShardedDataParallel()
    wrapped.module = model
    with pytest.raises(UserError, match="FSDP1"):
        with zl.track(wrapped, optimizer, out=tmp_path / "run"):
            pass
    assert not (tmp_path / "run").exists()


def test_what_accelerate_prepares_is_tracked(tmp_path):
    """accelerate's users call track on what accelerator.prepare returns: the model, and the torch
    optimizer inside its AcceleratedOptimizer."""
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(*tiny_model_and_optimizer())
    with zl.track(model, optimizer.optimizer, out=tmp_path / "run", every=1):
        for _ in range(2):
            tokens = torch.randint(0, 32, (2, 4))
            accelerator.backward(nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()))
            optimizer.step()
            optimizer.zero_grad()
    rank = json.loads((tmp_path / "run" / "summary.json").read_text())["strategies"]["module"]["ranks"][0]
    assert rank["sampled_steps"] == [0, 1] and rank["grad_bytes_after_backward"] == rank["param_bytes"] > 0
