"""zerolens.track: what a user's own training holds, per rank and phase, measured as verify measures it.

    with zerolens.track(model, optimizer, out="runs/myjob", every=50):
        ...the user's loop, unchanged...

The strategy comes from the registry (registry.adopt): a DDP model, a DeepSpeed engine (stages 0-3), a
model under FSDP2's fully_shard, or a plain module. The phases are found through hooks, so the loop
calls nothing per step: a forward begins at the model's forward pre-hook (a training forward: grad
enabled, module in training mode) and lasts until backward begins; backward is the call of
torch.autograd.backward (what `loss.backward()` calls; a DeepSpeed engine's `backward`), patched
only during a sampled step; the step is the optimizer's step (its step hooks; a DeepSpeed engine's
`step` at a gradient accumulation boundary). On every `every`-th optimizer step, from the first, it
takes verify's census (measure.probe.MemoryProbe) after the last backward of the step (just before the
optimizer step) and after the step (at the next forward, after the loop's zero_grad, or at exit), and
on CUDA each phase's allocator peak and reserve. Off the sampled steps the hooks count steps, nothing
more.

Each rank appends its sampled steps to metrics_rank<r>.jsonl in the run folder as they end; rank 0
then rewrites summary.json and report.md from every rank's file (unfinished until track exits), so
a crash leaves a readable partial report. At exit the ranks wait for each other and rank 0 writes the
final report and prints one short table.

With `log_to` (a TensorBoard SummaryWriter, a W&B run, a Lightning logger, or a function of
(figures, step)), rank 0 also logs its own figures of each sampled step there, under "zerolens/"
(`logged_figures`); the run folder keeps every rank's.
"""
from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zerolens.errors import UserError, one_line_error
from zerolens.measure.probe import MemoryProbe
from zerolens.report import files
from zerolens.report.checks import prediction_check
from zerolens.report.render import tracked_report, tracked_terminal_lines
from zerolens.report.summary import rank_summary
from zerolens.report.tables import SCHEMA_VERSION, say
from zerolens.run.folder import default_run_folder, new_run_folder, run_ended
from zerolens.run.worker import append_metrics, git_commit, versions
from zerolens.strategies import registry
from zerolens.strategies.layout import RETAINED_KEYS, deepspeed_layout
from zerolens.units import MiB

EVERY = 50  # sampled steps: the first and every 50th after it


@contextlib.contextmanager
def track(trained, optimizer=None, *, out: str | Path | None = None, every: int = EVERY, overwrite: bool = False,
          log_to=None):
    """Measures the user's training loop inside the block on every rank (see the module's docstring).
    `trained`: the model the loop trains (plain, DDP-wrapped or under fully_shard) or a DeepSpeed
    engine; `optimizer`: its optimizer (a DeepSpeed engine has its own); `out`: the run folder
    (runs/<time> by default; an existing one only with `overwrite`, and only if zerolens made it);
    `log_to`: where rank 0 logs its figures of each sampled step too (see `figures_sink`).
    Yields the Tracker. Every rank must enter it."""
    tracker = Tracker(trained, optimizer, out=out, every=every, overwrite=overwrite, log_to=log_to)
    try:
        yield tracker
    except BaseException as error:
        tracker.close(error)
        raise
    tracker.close(None)


def world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_folder_of_rank0(out: Path | None, overwrite: bool) -> Path:
    """The run folder, made by rank 0 and named to every rank; rank 0's UserError raised on every
    rank, which must not go on where rank 0 cannot."""
    made = [None, None]  # the folder, or the error
    if world()[0] == 0:
        try:
            made[0] = str(new_run_folder(out or default_run_folder(), overwrite, names=("out=", "overwrite=True")))
        except UserError as error:
            made[1] = str(error)
    if world()[1] > 1:
        dist.broadcast_object_list(made, src=0)
    if made[1] is not None:
        raise UserError(made[1])
    return Path(made[0])


def parameter_sizes(module: nn.Module) -> tuple[list[int], list[tuple[int, ...]]]:
    """Each parameter's whole size and shape, as the model was built: ZeRO-3 keeps them beside its
    shards (ds_numel, ds_shape); a DTensor's shape is its global one."""
    params = list(module.parameters())
    numels = [int(getattr(p, "ds_numel", p.numel())) for p in params]
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
    return numels, shapes


def figures_sink(log_to):
    """`log_to` as a function of (figures, step), None for None. Told apart by what each offers:
    a TensorBoard SummaryWriter (torch.utils.tensorboard or tensorboardX) its add_scalar, a
    Lightning logger its log_metrics, W&B (the wandb module or a run) its log, with commit=False so
    that the figures join the row of the loop's own next log without moving W&B's step (they carry
    their own, "zerolens/step"); or a function of (figures, step)."""
    if log_to is None:
        return None
    if hasattr(log_to, "add_scalar"):
        def to_tensorboard(figures, step):
            for name, value in figures.items():
                log_to.add_scalar(name, value, global_step=step)
            log_to.flush()  # the figures survive a crash of the loop
        return to_tensorboard
    if hasattr(log_to, "log_metrics"):
        return lambda figures, step: log_to.log_metrics(figures, step=step)
    if "wandb" in (getattr(log_to, "__name__", ""), type(log_to).__module__.split(".")[0]):
        defined = []

        def to_wandb(figures, step):
            if not defined:
                defined.append(log_to.define_metric("zerolens/*", step_metric="zerolens/step"))
            log_to.log({**figures, "zerolens/step": step}, commit=False)
        return to_wandb
    if callable(log_to):
        return log_to
    raise UserError(f"zerolens.track: log_to={type(log_to).__name__}; give a TensorBoard SummaryWriter, a W&B run, "
                    "a Lightning logger or a function of (figures, step)")


def logged_figures(record: dict) -> dict[str, float]:
    """What a sampled step logs: the activations forward saved, each component's holding after
    backward and after the step, each phase's allocator peak and reserve (CUDA) and what the process
    holds outside the allocator (CUDA), all in MiB; and the step's seconds."""
    figures = {}
    for key, value in record.items():
        measured = key.endswith(("_bytes_after_forward", "_bytes_after_backward", "_bytes_after_step")) or \
            key.startswith(("peak_during_", "reserved_peak_during_", "outside_allocator_"))
        if measured and isinstance(value, int):
            figures[f"zerolens/{key.replace('_bytes', '')}_MiB"] = value / MiB
    figures["zerolens/seconds_sampled_step"] = record["seconds_sampled_step"]
    return figures


class Optimizers:
    """The optimizers one loop steps (zerolens.track(model, [adamw, sgd])), seen as one where zerolens
    reads an optimizer: the census its states (census.optimizer_state_tensors: `state`, each
    optimizer's kept apart, so a parameter two of them step counts in both), the prediction its
    parameter groups (`param_groups`, in the optimizers' order)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {(i, p): state for i, o in enumerate(self.optimizers) for p, state in o.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        return [group for o in self.optimizers for group in o.param_groups]

    def __str__(self) -> str:
        return ", ".join(type(o).__name__ for o in self.optimizers)


def compiled_inside(trained):
    """What torch.compile(model) wrapped (OptimizedModule's `_orig_mod`), where `trained` is such a
    wrapper: the backend is recognised in the model inside, and track's hooks go on the wrapper, outside
    the compiled code. Not fully_shard around a compiled model (FSDP2's own module, recognised as it is),
    nor a DeepSpeed engine (which answers `_orig_mod` from its module)."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.fsdp import FSDPModule
    if isinstance(trained, OptimizedModule) and not isinstance(trained, FSDPModule):
        return trained._orig_mod
    return trained


def keeps_adams_states(optimizer) -> bool:
    """Whether the optimizer keeps what the layouts model: two states per parameter and a step count (torch's
    Adam and AdamW without amsgrad, which keeps a third; RAdam and Adamax keep the same; DeepSpeed's and
    apex's FusedAdam, its step a Python number). NAdam keeps a fourth (mu_product); SparseAdam another layout."""
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return not any(group.get("amsgrad") for group in optimizer.param_groups)
    if isinstance(optimizer, torch.optim.RAdam | torch.optim.Adamax):
        return True
    if isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch.optim"):
        return False
    return "Adam" in type(optimizer).__name__ and "NAdam" not in type(optimizer).__name__


def optimizer_name(optimizer) -> str:
    amsgrad = any(group.get("amsgrad") for group in getattr(optimizer, "param_groups", []))
    return type(optimizer).__name__ + (" (amsgrad)" if amsgrad else "")


def offloaded(engine) -> bool:
    """Whether a DeepSpeed engine offloads its optimizer or its parameters (to the CPU or NVMe)."""
    sections = [engine.zero_offload_optimizer(), engine.zero_offload_param()]
    return any(section is not None and getattr(section.device, "value", section.device) != "none"
               for section in sections)


def optimizers_of(optimizer) -> list[torch.optim.Optimizer] | None:
    """The torch optimizers the user gave track (one, or a list or tuple of them), None where that is
    not what they gave."""
    given = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
    if not given or not all(isinstance(o, torch.optim.Optimizer) for o in given):
        return None
    return list({id(o): o for o in given}.values())  # one given twice is one


class Tracker:
    def __init__(self, trained, optimizer, *, out: str | Path | None, every: int, overwrite: bool, log_to=None,
                 forward_hooks: bool = True):
        if not isinstance(every, int) or every < 1:
            raise UserError(f"zerolens.track: every={every!r}; give a whole number of steps, 1 or more")
        log_figures = figures_sink(log_to)  # on every rank: a UserError must end them all
        self.log_figures = log_figures if world()[0] == 0 else None
        inner = compiled_inside(trained)
        if any(c.__name__ == "FullyShardedDataParallel" for c in type(inner).__mro__):
            raise UserError("zerolens.track: FSDP1 (FullyShardedDataParallel) is not measured; FSDP2 (fully_shard) is")
        # Several optimizers (one for the embeddings, another for the rest, say): one step of the loop
        # steps each (_optimizer_step_ends), and the census and the prediction see them as one (Optimizers).
        self.optimizers = optimizers_of(optimizer) or []
        if self.optimizers:
            optimizer = self.optimizers[0] if len(self.optimizers) == 1 else Optimizers(self.optimizers)
        strategy = registry.adopt(inner, optimizer)
        if strategy is None:
            raise UserError(f"zerolens.track: cannot track a {type(trained).__name__}; give it the model the loop "
                            "trains (a module, DDP-wrapped or under fully_shard) or a DeepSpeed engine")
        self.engine = inner if hasattr(strategy, "engine") else None
        if self.engine is None and not self.optimizers:
            raise UserError("zerolens.track needs the optimizer the loop steps: zerolens.track(model, optimizer), "
                            "or a list of them where it steps several")
        self.stepped: set[int] = set()  # the optimizers that have stepped in the step under way (ids)
        # What the forward computes in where no forward hook can see its autocast (Lightning's precision on
        # one device, whose autocast begins after on_train_batch_start): said by the caller
        self.mixed_precision: str | None = None
        self.strategy, self.trained, self.every = strategy, trained, every
        self.rank, self.world_size = world()
        self.device = strategy.device
        self.registered = strategy.name in registry.names()
        self.probe = MemoryProbe(self.device, backend_code=registry.spec(strategy.name).transient_code
                                 if self.registered else ())
        self.steps_done = 0
        self.record: dict | None = None  # the sampled step being measured
        self.after_step_pending = False  # its census after the step waits for the next forward
        self.phases: dict[str, contextlib.ExitStack] = {}
        self.activations: contextlib.ExitStack | None = None
        self.backward_depth = 0
        self.failed: str | None = None  # zerolens's own error in a hook, which ended the measuring
        self.predictions: dict[int, dict] = {}  # each rank's retained bytes predicted (predicted_retained)
        self.started = time.time()
        self.out = run_folder_of_rank0(None if out is None else Path(out), overwrite)
        self._undo: list = []  # what puts the user's objects back as they were, at close
        self.backward_undo = None  # the same for backward's patch, during a sampled step
        # False: the caller says where each training forward begins and ends (forward_begins, forward_ends)
        self.forward_hooks = forward_hooks
        self._install()
        if self.rank == 0:
            self._write_config()

    def _write_config(self) -> None:
        numels, _ = parameter_sizes(self.strategy.module)
        first = next(self.strategy.module.parameters())
        config = {"command": "zerolens.track", "strategy": self.strategy.name, "trained": type(self.trained).__name__,
                  "optimizer": type(self.engine.optimizer).__name__ if self.engine is not None
                  else str(Optimizers(self.optimizers)),
                  "world_size": self.world_size, "device": self.device.type, "every": self.every,
                  "param_count": sum(numels), "weights": str(first.dtype).removeprefix("torch."),
                  "precision": self.strategy.settings.precision, "grad_accum": self.strategy.settings.grad_accum}
        env = {"command": "zerolens.track", "argv": sys.argv, "python": sys.version.split()[0], **versions(),
               "backend": dist.get_backend() if self.world_size > 1 else None, "world_size": self.world_size,
               "device": self.device.type, "hostname": platform.node(), "zerolens_commit": git_commit()}
        files.write_json(self.out / "config.json", config)
        files.write_json(self.out / "env.json", env)

    # --- The hooks -----------------------------------------------------------------------------------
    def _install(self) -> None:
        module = self.trained
        if self.forward_hooks:
            # Before the backend's own pre-hooks (FSDP2 gathers the root's parameters in one): the census
            # after the step is taken there.
            pre = module.register_forward_pre_hook(lambda *a: self._measuring(self._forward_begins, *a), prepend=True)
            post = module.register_forward_hook(lambda *a: self._measuring(self._forward_ends, *a))
            self._undo += [pre.remove, post.remove]
        if self.engine is not None:
            self._undo.append(patched(self.engine, "step", self._engine_step(self.engine.step)))
        else:
            for optimizer in self.optimizers:
                before = optimizer.register_step_pre_hook(lambda *a: self._measuring(self._optimizer_step_begins, *a))
                after = optimizer.register_step_post_hook(lambda o, *_: self._measuring(self._optimizer_step_ends, o))
                self._undo += [before.remove, after.remove]

    def _measuring(self, work, *args):
        """`work(*args)`, zerolens's own part of a hook: an error in it ends the measuring, never the user's
        training. It is said once on this rank and kept in logs/rank<r>.error; the report keeps the
        steps measured before it."""
        if self.failed is not None:
            return None
        try:
            return work(*args)
        except Exception as error:
            self.failed = f"zerolens.track stopped measuring at step {self.steps_done}: {type(error).__name__}: " \
                          f"{one_line_error(error)}"
            self._unhook()
            self._write_error_line(self.failed)
            print(f"zerolens: rank {self.rank}: {self.failed}; the training goes on", file=sys.stderr)
            return None

    def _unhook(self) -> None:
        """Every hook and patch off, every open phase closed: the user's objects as they were."""
        for stack in [*self.phases.values(), self.activations]:
            if stack is not None:
                stack.close()
        self.phases, self.activations = {}, None
        if self.backward_undo is not None:
            self.backward_undo()
            self.backward_undo = None
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    def _engine_step(self, step):
        def tracked_step(*args, **kwargs):
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary:
                self._measuring(self._step_begins)
            result = step(*args, **kwargs)
            if boundary:
                self._measuring(self._step_ends)
            return result
        return tracked_step

    def _tracked_backward(self, backward):
        def tracked_backward(*args, **kwargs):
            if self.backward_depth == 0:
                self._measuring(self._backward_begins)
            self.backward_depth += 1
            try:
                return backward(*args, **kwargs)
            finally:
                self.backward_depth -= 1
                if self.backward_depth == 0:
                    self._measuring(self._close_phase, "backward")
        return tracked_backward

    def _backward_begins(self) -> None:
        self._close_phase("forward")
        self._open_phase("backward")

    def forward_begins(self) -> None:
        """A training forward begins, where no forward hook sees it (forward_hooks=False): a Lightning
        module's training_step, which may call its submodules and never its own forward."""
        self._measuring(self._forward_begins, self.trained, ())

    def forward_ends(self) -> None:
        self._measuring(self._forward_ends, self.trained, (), None)

    def _forward_begins(self, module, args) -> None:
        # The model inside the wrapper says whether this is training: after a validation Lightning puts
        # its LightningModule back in training mode and leaves the DDP wrapper around it in eval mode.
        if not (self.strategy.module.training and torch.is_grad_enabled()):
            return  # an evaluation's forward
        self._step_left_open()
        self.strategy.before_forward()
        if self.after_step_pending:
            self._finish_record()
        if self.steps_done % self.every:
            return
        if self.record is None:
            self._start_record()
        if torch.is_autocast_enabled(self.device.type):  # what the forward computes in, where not the weights' dtype
            self.record["autocast"] = str(torch.get_autocast_dtype(self.device.type)).removeprefix("torch.")
        self._open_phase("forward")
        self.activations = contextlib.ExitStack()
        self.activations.enter_context(self.probe.saved_activations(self.strategy, into=self.record))

    def _forward_ends(self, module, args, output) -> None:
        if self.activations is not None:
            self.activations.close()
            self.activations = None

    def _optimizer_step_begins(self, optimizer, args, kwargs):
        """A torch optimizer's step pre-hook. A step given a closure (Lightning's, LBFGS's) runs the
        closure, forward and backward, inside it: the step begins when the closure has returned."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            self._step_begins_once()
            return None

        def closure_then_step_begins():
            loss = closure()
            self._measuring(self._step_begins_once)
            return loss
        return (args[:1], {**kwargs, "closure": closure_then_step_begins})

    def _step_begins_once(self) -> None:
        """The loop's step begins at its first optimizer's step (of several: the first to step)."""
        if not self.stepped:
            self._step_begins()

    def _optimizer_step_ends(self, optimizer) -> None:
        """A torch optimizer's step post-hook: the loop's step ends when each of its optimizers has stepped."""
        self.stepped.add(id(optimizer))
        if len(self.stepped) == len(self.optimizers):
            self.stepped = set()
            self._step_ends()

    def _step_left_open(self) -> None:
        """A loop that steps some of its optimizers less often than the others (every other step, say):
        its step ended with the last optimizer it stepped, before this training forward (not a backward:
        track sees backward only in a sampled step, and a loop may step one optimizer between two backwards)."""
        if self.stepped:
            self.stepped = set()
            self._step_ends()

    def _step_begins(self) -> None:
        if self.record is None:
            return
        self._close_phase("backward")
        self.record |= self.probe.census(self.strategy, "backward")
        if self.engine is None:  # a parameter the forward did not use (find_unused_parameters) has none
            self.record["trained_without_grad"] = sum(p.requires_grad and p.grad is None
                                                      for p in self.strategy.module.parameters())
        self._open_phase("step")

    def _step_ends(self) -> None:
        self.steps_done += 1
        if self.record is None:
            return
        self._close_phase("step")
        self.record["step_applied"] = True
        self.after_step_pending = True

    # --- A sampled step ------------------------------------------------------------------------------
    def _start_record(self) -> None:
        self.record = {"strategy": self.strategy.name, "rank": self.rank, "step": self.steps_done}
        self.record_started = time.perf_counter()
        owner = self.engine if self.engine is not None else torch.autograd
        self.backward_undo = patched(owner, "backward", self._tracked_backward(owner.backward))

    def _open_phase(self, name: str) -> None:
        if name in self.phases:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.probe.measured_phase(name, self.record))
        self.phases[name] = stack

    def _close_phase(self, name: str) -> None:
        stack = self.phases.pop(name, None)
        if stack is not None:
            stack.close()

    def _finish_record(self, at_exit: bool = False) -> None:
        """The census after the step, and the record into this rank's metrics file. `at_exit`: taken
        when track ends, with no forward after the step, so before any zero_grad the loop would
        have called at the top of its next iteration."""
        self.record |= self.probe.census(self.strategy, "step") | {"census_after_step_at_exit": at_exit}
        # An optimizer stepped less often than the others may have no states yet at this census
        self.record["optimizers_without_state"] = sum(not o.state for o in self.optimizers) if self.engine is None else 0
        self.record["seconds_sampled_step"] = time.perf_counter() - self.record_started
        self.backward_undo()
        self.backward_undo = None
        append_metrics(self.out, self.rank, [self.record])
        record, self.record, self.after_step_pending = self.record, None, False
        if self.rank == 0:
            self._write_report(verdict="UNFINISHED")
            if self.log_figures is not None:
                self.log_figures(logged_figures(record), record["step"])

    # --- The end -------------------------------------------------------------------------------------
    def close(self, error: BaseException | None) -> None:
        """Hooks off; the last sampled step written where it is whole. Without an error the ranks meet
        and rank 0 writes the report and prints its table; with one, this rank says what ended it
        (logs/rank<r>.error), and rank 0 writes the report as it stands."""
        if error is None:  # a step an error broke off between two optimizers is no whole step
            self._measuring(self._step_left_open)
        if self.after_step_pending:  # the step ended whole, the error (if any) came after it
            self._measuring(self._finish_record, True)
        self._unhook()
        if error is not None:
            self._write_error_line(f"{type(error).__name__}: {one_line_error(error)}")
            if self.rank == 0:
                self._write_report(verdict="CRASHED")
            return
        if self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            summary = self._write_report(verdict="FINISHED")
            # Every rank's files are written (the barrier): the marker lists them now, not what the user
            # may put here before this process ends (a notebook's)
            run_ended(self.out)
            say(*tracked_terminal_lines(summary, self.out))

    def _write_error_line(self, line: str) -> None:
        """What ended this rank's measuring or its loop, in logs/rank<r>.error (the summary lists them)."""
        (self.out / "logs").mkdir(exist_ok=True)
        files.write_atomic(self.out / "logs" / f"rank{self.rank}.error", line + "\n")

    def _write_report(self, verdict: str) -> dict:
        summary = self.summary(verdict)
        files.write_json(self.out / "summary.json", summary)
        files.write_atomic(self.out / "report.md", tracked_report(summary))
        return summary

    def summary(self, verdict: str) -> dict:
        """summary.json from every rank's metrics file as it stands: verify's per-rank figures
        (report.summary.rank_summary) over the sampled steps, and where the registry knows the
        strategy, the retained bytes predicted beside them and checked."""
        name = self.strategy.name
        ranks, missing, notes = [], [], [*self.strategy.notes()]
        without_grad = 0  # trained parameters with no gradient at a sampled step's end of backward, at most
        autocast: set[str] = set()  # the dtypes the sampled forwards ran under autocast in
        stateless = 0  # optimizers with no states yet at the census the retained figures are from, at most
        for r in range(self.world_size):
            path = self.out / f"metrics_rank{r}.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            if not records:
                missing.append(r)
                continue
            # The retained figures are the last record's: the latest whose census after the step came at
            # a forward, where there is one (a census at exit sees the gradients a next zero_grad would drop).
            ordered = sorted(records, key=lambda rec: not rec["census_after_step_at_exit"])
            without_grad = max(without_grad, *(rec.get("trained_without_grad", 0) for rec in records))
            stateless = max(stateless, ordered[-1].get("optimizers_without_state", 0))  # the figures' record
            autocast |= {rec["autocast"] for rec in records if rec.get("autocast")}
            if ordered[-1]["census_after_step_at_exit"]:
                notes.append(f"rank {r}: its only sampled step was the last, whose census after the step was "
                             "taken at exit, before the zero_grad of a next step")
            ranks.append(rank_summary(r, ordered) | {
                "sampled_steps": [rec["step"] for rec in records],
                # From a sampled step's first forward to the next forward: what one measured step costs.
                "seconds_of_sampled_steps": [rec["seconds_sampled_step"] for rec in records]})
        errors = {p.stem: p.read_text().strip() for p in sorted((self.out / "logs").glob("rank*.error"))}
        tensors, elements = self.trained_outside_the_optimizers()
        if tensors:
            notes.append(f"{tensors} of the model's trained parameter tensors (requires_grad; {elements:,} elements) "
                         "in none of the optimizers given to track, whose states are counted (and predicted) for their "
                         "own parameters alone: where another optimizer steps them, give track that one too: "
                         "zerolens.track(model, [optimizer, other])")
        why_not = self.not_predicted() or (without_grad and (
            f"{without_grad} of the parameters that train had no gradient after a sampled step's backward (its "
            "forward did not use them, as DDP's find_unused_parameters allows), and the layouts give every one a "
            "gradient and optimizer states")) or (stateless and (
            f"{stateless} of the optimizers given to track had not stepped yet at the sampled step the figures are "
            "from (torch makes an optimizer's states at its first step), and the layouts give each its states"))
        if why_not:
            notes.append(f"Retained memory not predicted: {why_not}.")
        else:
            kept = []
            for rank in ranks:
                predicted = self.predicted_retained(rank["rank"])
                rank["predicted"] = dict(predicted)
                if rank["grad_bytes_after_step"] and not predicted["grad_bytes_after_step"]:
                    # The strategy frees its gradients at the step's zero_grad; this loop zeroes them later
                    # (Lightning's after the next forward) or keeps them (zero_grad(set_to_none=False)).
                    rank["predicted"]["grad_bytes_after_step"] = predicted["grad_bytes_after_backward"]
                    kept.append(rank["rank"])
            if kept:
                notes.append(f"The loop's gradients were still held at the next step's forward (ranks "
                             f"{', '.join(map(str, kept))}): its zero_grad comes after that forward (as Lightning's "
                             "does) or zeroes them in place (set_to_none=False), so they are alive through every "
                             "forward; predicted as kept.")
        if self.device.type == "cpu":
            notes.append("CPU: no allocator, so no peaks per phase; the census counts what each rank holds.")
        return {
            "schema_version": SCHEMA_VERSION, "command": "zerolens.track", "verdict": verdict,
            "errors": errors, "strategy": name, "world_size": self.world_size, "device": self.device.type,
            "precision": self.strategy.settings.precision, "computed_in": self.computed_in(autocast),
            "every": self.every, "steps_seen": self.steps_done,
            "ranks_without_a_sampled_step": missing, "notes": notes,
            "checks": [prediction_check(name, rank) for rank in ranks if "predicted" in rank],
            "strategies": {name: {"ranks": ranks}},
            "seconds": time.time() - self.started,
        }

    def computed_in(self, autocast: set[str]) -> str | None:
        """What the forward computes in where it is not the weights' dtype (`precision`): autocast's dtype
        (a plain loop's, Lightning's bf16-mixed), or the dtype FSDP2's MixedPrecisionPolicy gathers the
        weights in; None where neither (DeepSpeed's precision is the weights')."""
        if autocast:
            return f"autocast {', '.join(sorted(autocast))}"
        if self.mixed_precision:
            return self.mixed_precision
        policy = getattr(getattr(self.strategy, "root_state", None), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
        return None if dtype is None else f"FSDP2's MixedPrecisionPolicy: {str(dtype).removeprefix('torch.')}"

    def predicted_retained(self, rank: int) -> dict:
        """registry.predict_retained for `rank`, made once: rank 0 writes the summary after each of its
        sampled steps, and neither the model nor the settings change in between."""
        if rank not in self.predictions:
            numels, shapes = parameter_sizes(self.strategy.module)
            trainable = [p.requires_grad for p in self.strategy.module.parameters()]
            settings = self.strategy.settings
            predicted = registry.predict_retained(
                self.strategy.name, numels, self.world_size, rank, settings.precision,
                reduce_bucket_size=settings.reduce_bucket_size, param_shapes=shapes,
                deepspeed=deepspeed_layout(versions().get("deepspeed")), weight_bytes=self.weight_bytes(),
                trainable=None if all(trainable) else trainable, param_groups=self.parameter_groups(),
                deepspeed_step_bytes=self.deepspeed_step_bytes(), **self.stage3_threshold())
            if isinstance(getattr(self.strategy, "model", None), nn.parallel.DistributedDataParallel) \
                    and self.strategy.model.gradient_as_bucket_view:
                predicted["comm_buffer_bytes_after_backward"] = 0  # the gradients are the buckets: counted as gradients
            self.predictions[rank] = {k: predicted[k] for k in RETAINED_KEYS}
        return self.predictions[rank]

    def deepspeed_step_bytes(self) -> int | None:
        """layout.Layout.deepspeed_step_bytes of a DeepSpeed engine's optimizer: none for one of DeepSpeed's own
        (FusedAdam: its step counts are Python numbers); None (torch's AdamW's) otherwise."""
        if self.engine is None or isinstance(self.engine.basic_optimizer, torch.optim.Adam | torch.optim.AdamW):
            return None
        return 0

    def not_predicted(self) -> str | None:
        """Why the retained memory cannot be predicted here, or None: the layouts are those of the
        registered strategies with torch's AdamW (or DeepSpeed's Adam, which keeps the same states)."""
        if not self.registered:
            return "a module no data-parallel backend wraps is not a registered strategy"
        optimizers = [self.engine.basic_optimizer] if self.engine is not None else self.optimizers
        others = [optimizer_name(o) for o in optimizers if not keeps_adams_states(o)]
        if others:
            return (f"the layouts are modelled for Adam's two states per parameter, and the loop steps "
                    f"{', '.join(others)}")
        if self.engine is not None and offloaded(self.engine):
            return "DeepSpeed offloads the optimizer or the parameters to the CPU, which the layouts do not model"
        return None

    def trained_outside_the_optimizers(self) -> tuple[int, int]:
        """How many of the module's parameter tensors that train no optimizer given to track holds, and
        their elements (none for a DeepSpeed engine, whose optimizer holds what it trains)."""
        if self.engine is not None:
            return 0, 0
        held = {id(p) for o in self.optimizers for group in o.param_groups for p in group["params"]}
        outside = [p for p in self.strategy.module.parameters() if p.requires_grad and id(p) not in held]
        return len(outside), sum(p.numel() for p in outside)

    def parameter_groups(self) -> list[tuple[int, ...]] | None:
        """The optimizer's parameter groups as layout.Layout.param_groups wants them (indices of the
        module's parameters that train, in each group's order), None where one group steps every
        parameter that trains: a torch optimizer's param_groups (of several optimizers, each one's in
        turn); a DeepSpeed engine's original groups, which ZeRO-1/2 keep as bit16_groups and ZeRO-3
        as fp16_groups (its basic optimizer holds the flat partitions)."""
        index = {id(p): i for i, p in enumerate(self.strategy.module.parameters())}
        if self.engine is None:
            groups = [group["params"] for group in self.strategy.optimizer.param_groups]
        else:
            groups = getattr(self.engine.optimizer, "bit16_groups", None) or getattr(
                self.engine.optimizer, "fp16_groups", None)
            if groups is None:  # without ZeRO, each parameter's own state: groups change nothing
                return None
        indices = [tuple(index[id(p)] for p in group if id(p) in index and p.requires_grad) for group in groups]
        indices = [group for group in indices if group]
        trained = sum(p.requires_grad for p in self.strategy.module.parameters())
        return None if len(indices) == 1 and len(indices[0]) == trained else indices

    def weight_bytes(self) -> int:
        """The element size of the weights as the model was built: DeepSpeed builds its masters in fp32
        from them; the torch-native strategies keep them as they are."""
        if self.engine is not None:
            return 4
        return next(self.strategy.module.parameters()).element_size()

    def stage3_threshold(self) -> dict:
        if self.engine is None or self.engine.zero_optimization_stage() != 3:
            return {}
        return {"param_persistence_threshold": int(self.engine.zero_param_persistence_threshold())}


def patched(owner, name: str, replacement):
    """`owner.name` replaced (an object's own attribute, or a module's function); returns what puts
    the original back."""
    own = vars(owner)
    original = own.get(name, _MISSING)
    setattr(owner, name, replacement)

    def undo():
        if original is _MISSING:
            delattr(owner, name)  # the class's method again
        else:
            setattr(owner, name, original)
    return undo


_MISSING = object()
