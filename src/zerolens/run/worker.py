"""The per-rank entry point: trains every strategy on this rank, measures, gathers to rank 0.

Runs under `zerolens verify` (which starts it through torch's elastic launcher), and unchanged
under `torchrun --nproc-per-node N -m zerolens.run.worker ...` or
`deepspeed --num_gpus N --module zerolens.run.worker ...` (ranks come from the environment;
the `--local_rank` that the deepspeed launcher appends is accepted).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import logging
import os
import platform
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from zerolens.errors import UserError
from zerolens.measure.allocator import clear_cublas_workspaces
from zerolens.measure.matmul import matmul_tflops
from zerolens.measure.probe import MemoryProbe
from zerolens.measure.timer import StepTimer
from zerolens.models.data import rank_batches
from zerolens.models.model import parameter_shapes, trainable_flags, weight_bytes
from zerolens.report import files, render
from zerolens.report.checks import metrics_complete
from zerolens.report.summary import build_summary
from zerolens.report.tables import say
from zerolens.run import wall_time
from zerolens.run.config import RunConfig, load_config, save_config
from zerolens.run.faults import fault_from_environment, leaked_bytes
from zerolens.run.flags import add_bench_arguments, add_verify_arguments, config_from_args
from zerolens.run.folder import default_run_folder, is_run_folder, new_run_folder, results_path
from zerolens.run.launch import LAUNCHER_PID, OUT_OF_MEMORY
from zerolens.run.prediction import (
    PREDICTED_PEAKS,
    gathered,
    on_own_gpu,
    part_name,
    predict_in_fresh_process,
    share_of,
)
from zerolens.run.reference import PREFIX as REFERENCE_PREFIX
from zerolens.run.reference import reference_of, run_reference
from zerolens.run.train import Heartbeat, Phase, train
from zerolens.strategies import DTYPES, make_strategy, registry
from zerolens.strategies.base import PHASES
from zerolens.units import size


class RankFailure(RuntimeError):
    """Carries the rank and phase of a failure to the launcher's error report."""


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zerolens.run.worker", description=__doc__)
    add_verify_arguments(parser)
    add_bench_arguments(parser)
    parser.add_argument("--job", choices=("verify", "bench"), default="verify")
    # Files only, nothing on the terminal: the points of a sweep, the trials of maxsize.
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    # `zerolens verify` turns the verdict into its own exit code, so it asks for 0 here.
    parser.add_argument("--fail-exit-code", type=int, default=1, help="exit code of rank 0 on FAIL (default 1)")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    # Started by `zerolens`: the run folder exists; strategies with results in it are done; the
    # launch ends after a strategy that left memory allocated, and zerolens starts the rest anew.
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    # The run's settings, resolved and checked by `zerolens` (config.json); with it the settings flags
    # (verify's and bench's, --job) are ignored, and only the ones that say how to run count.
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    return parser


def quiet_libraries(verbose: bool) -> None:
    """DeepSpeed logs at INFO on every rank; users want one table. --verbose brings it back."""
    if verbose:
        return
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with contextlib.suppress(ImportError):
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|deepspeed)\..*")


def init_distributed(config: RunConfig, local_rank: int) -> torch.device:
    if config.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if config.memory_limit_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            # Segments are whole 2 MiB: half of that above the limit changes nothing but keeps the fraction's
            # float rounding from taking a limit that is a segment boundary (plan --check's caps) below it.
            limit = config.memory_limit_gib * 2**30 + 2**20
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if registry.needing_deepspeed(config.strategies):
        import deepspeed
        # DeepSpeed wraps the process group that already exists. On CPU it prints a line per rank
        # about its shared-memory collective op: keep that out of the table unless asked.
        quiet = contextlib.nullcontext() if config.verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        if device.type == "cpu":
            unlink_shared_memory_name()
    return device


def deepspeed_shared_memory_name(rank: int) -> Path:
    """Where DeepSpeed's CPU collective op (csrc/cpu/comm/shm.cpp, shm_initialize) puts this run's
    buffer for `rank`: a 66 MiB POSIX shared-memory object named by user, MASTER_ADDR and MASTER_PORT."""
    return Path("/dev/shm") / "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)


def unlink_shared_memory_name() -> None:
    """DeepSpeed never unlinks its CPU ranks' shared-memory buffers (shared_close is never called),
    so each CPU run would leave 66 MiB per rank in /dev/shm, which is RAM, until the machine restarts:
    a test suite or a sweep fills the memory. Every rank has mapped every buffer when its
    init_distributed returns (shm_initialize opens them all), so after a barrier each rank removes the
    name of its own: the mappings live on until the ranks end, and a crash after this leaves nothing."""
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):  # DeepSpeed uses the op only when all ranks are local
        deepspeed_shared_memory_name(dist.get_rank()).unlink()


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    with contextlib.suppress(ImportError):
        import deepspeed
        out["deepspeed"] = deepspeed.__version__
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def watch_for_hangs(logs: Path, rank: int, phase: Phase):
    """What the launcher's hang watchdog (launch.py) reads: this rank's heartbeat, rewritten at
    every change of phase, and its Python stack, dumped on SIGUSR1 (faulthandler works even while
    the rank is blocked in a collective). Returns the open stack file, which must stay open."""
    logs.mkdir(parents=True, exist_ok=True)
    stack_file = open(logs / f"stack_rank{rank}.txt", "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    phase.heartbeat = Heartbeat(logs / f"heartbeat_rank{rank}.json")
    return stack_file


def stop_watching(stack_file) -> None:
    """After the last collective: a finished rank has no stack to show, so its empty dump file
    goes. The handler stays registered till the process ends (a late SIGUSR1 from the watchdog
    then writes to the unlinked file instead of killing the rank)."""
    stack_file.flush()
    path = Path(stack_file.name)
    if path.stat().st_size == 0:
        path.unlink()


def out_of_memory_message(rank: int, phase: Phase, error: Exception) -> str:
    """One line: where, how much was asked for (from the allocator's message), and what to try."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(error))
    return (f"rank {rank} {OUT_OF_MEMORY} during {phase}"
            + (f" (tried to allocate {asked.group(1)})" if asked else "")
            + ": try a smaller --micro-batch, a smaller --reduce-bucket-size, a higher ZeRO stage or FSDP2, "
              "or --activation-checkpointing (GPT presets)")


def git_commit() -> str | None:
    """The commit of the zerolens source, when it runs from a git checkout."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        result = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        if result.returncode == 0:
            return result.stdout.strip()
    return None


def environment(config: RunConfig, command: str, device: torch.device) -> dict:
    """env.json: what produced the run, for whoever reads its figures later."""
    return {"command": command, "argv": sys.argv, "python": sys.version.split()[0], **versions(),
            "backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(device.type),
            "devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                        if device.type == "cuda" else [platform.processor() or platform.machine()]),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "hostname": platform.node(),
            "zerolens_commit": git_commit(), "zerolens_fault": os.environ.get("ZEROLENS_FAULT")}


def allocated_now(device: torch.device) -> int:
    """CUDA: what the caching allocator holds. CPU: no allocator to ask; only what a `leak` fault keeps
    (faults.py) is known, which is how the tests reach the relaunch on CPU."""
    if device.type != "cuda":
        return leaked_bytes(device)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def memory_left_behind(device: torch.device, allocated_before: int) -> int:
    """Bytes a strategy left allocated after its teardown, the most of any rank. cuBLAS workspaces
    are dropped first: every strategy allocates its own on its first matrix product."""
    clear_cublas_workspaces()
    left = torch.tensor([allocated_now(device) - allocated_before], device=device)
    dist.all_reduce(left, op=dist.ReduceOp.MAX)
    return max(0, int(left.item()))


def run_strategy(name: str, config: RunConfig, device: torch.device, phase: Phase, earlier_left: int) -> dict:
    """This rank's results for one strategy, through the one training loop: measured (verify's
    MemoryProbe) or timed (bench's StepTimer, after its warm-up steps)."""
    strategy = make_strategy(name, config.train_settings(name))
    bench = config.job == "bench"
    probe = (StepTimer(device, config.warmup_steps) if bench
             else MemoryProbe(device, backend_code=registry.spec(name).transient_code, earlier_left=earlier_left))
    batches = rank_batches(config.model, seed=config.seed, micro_batch=config.micro_batch, signal=config.signal,
                           rank=dist.get_rank(), world_size=dist.get_world_size())
    run = train(strategy, model_config=config.model_for(name), seed=config.seed, batches=batches, device=device,
                phase=phase, steps=config.warmup_steps + config.steps if bench else config.steps, probe=probe,
                grad_accum=config.grad_accum)
    run.notes += [n for n in [config.compile_note(name)] if n]
    if bench:
        # After the training and its measurements, so that its memory is in none of them
        measured_matmul = matmul_tflops(device, DTYPES[config.precision]) if device.type == "cuda" else None
        return {"name": name, "process_id": os.getpid(), "matmul_tflops": measured_matmul,
                "seconds": [r["seconds"] for r in run.records],
                "phase_seconds": [{p: r.get(f"seconds_{p}") for p in PHASES} for r in run.records],
                "communication": next((r["communication"] for r in run.records if "communication" in r), None),
                "losses": run.losses,
                "settings": strategy.describe(), "notes": run.notes, **run.measured}
    return {"losses": run.losses, "records": run.records, "seconds": run.seconds, "settings": strategy.describe(),
            "notes": run.notes, **run.measured}


def append_metrics(out: Path, rank: int, records: list[dict]) -> None:
    """This rank's per-step records, appended to its own metrics file (written whole each time)."""
    path = out / f"metrics_rank{rank}.jsonl"
    before = path.read_text() if path.exists() else ""
    files.write_atomic(path, before + "".join(json.dumps(r) + "\n" for r in records))


def run_strategies(job: str, config: RunConfig, device: torch.device, out: Path, phase: Phase,
                   stop_on_leftover: bool, quiet: bool = False) -> bool:
    """Runs, one after another, every strategy (of every round: config.run_items) that has no results
    in `out` yet; rank 0 writes each one's results as soon as it is done. A strategy that leaves
    memory allocated after its teardown would put it in the next one's peak (DDP's buckets were still
    allocated right after its teardown on 2xH200; measured after the gather below, they are gone):
    with `stop_on_leftover` (zerolens's own launcher, which relaunches) this launch then ends, and
    `zerolens` starts fresh processes for the rest. So it does after a strategy that left
    torch.nn.functional.linear replaced: DeepSpeed's ZeRO-3 puts its own in, which saves other
    tensors for backward (FSDP2 after it in the same processes peaked 1.5% lower in forward on the
    case study, CPU); zerolens's ZeRO-3 puts torch's back at its teardown, and this guards against
    any other that does not. And so it does after every strategy of a bench: each is timed in
    processes of its own. Returns True when every strategy has results."""
    linear = torch.nn.functional.linear
    rank = dist.get_rank()
    todo = [[(r, n) for r, n in config.run_items() if not results_path(out, n, r).exists()] if rank == 0 else None]
    dist.broadcast_object_list(todo)  # rank 0's view of the run folder, for every rank
    todo = todo[0]
    left_by_earlier = 0
    for i, (round_index, name) in enumerate(todo):
        started = time.time()
        allocated_before = allocated_now(device)
        result = (run_reference(name, config, device) if name.startswith(REFERENCE_PREFIX)
                  else run_strategy(name, config, device, phase, left_by_earlier))
        result["earlier_strategies_left_bytes"] = left_by_earlier
        if job == "verify":
            phase.at(strategy=name, step=-1, name="writing metrics")
            append_metrics(out, rank, result["records"])
        phase.at(strategy=name, step=-1, name="gathering results")
        gathered = [None] * config.nproc
        dist.all_gather_object(gathered, result)
        phase.at(name="measuring what is left")
        left = memory_left_behind(device, allocated_before)
        if rank == 0:
            files.write_json(results_path(out, name, round_index), {
                "strategy": name, "round": round_index + 1, "left_allocated_bytes": left, "ranks": gathered})
            wall_time.note(out, "training", time.time() - started, strategy=name)
            if job == "verify" and not quiet:
                losses = gathered[0]["losses"]
                say(f"zerolens: {name} done in {max(g['seconds'] for g in gathered):.1f} s, loss "
                    f"{losses[0]:.4f} -> {losses[-1]:.4f}")
        left_by_earlier += left
        linear_replaced = torch.nn.functional.linear is not linear
        if (left or linear_replaced or job == "bench") and stop_on_leftover and i + 1 < len(todo):
            if left and rank == 0 and not quiet:
                say(f"zerolens: {name} left {size(left)} allocated: the next strategies start in fresh "
                    "processes")
            return False
    return True


def gathered_results(out: Path, strategies: tuple[str, ...], nproc: int, round_index: int = 0) -> list[list[dict]]:
    """gathered[rank][i]: rank's results for strategies[i] (in a bench's round `round_index`), from the
    results files."""
    results = {name: json.loads(results_path(out, name, round_index).read_text()) for name in strategies}
    for name, f in results.items():
        for rank in f["ranks"]:
            rank["left_allocated_by_this_strategy_bytes"] = f["left_allocated_bytes"]
    return [[results[name]["ranks"][r] for name in strategies] for r in range(nproc)]


def read_predicted_peaks(out: Path) -> dict:
    """The run's predicted_peaks.json; empty where the run made none (maxsize's trials)."""
    path = out / PREDICTED_PEAKS
    return json.loads(path.read_text()) if path.exists() else {}


def finish_bench(config: RunConfig, device: torch.device, out: Path, command: str, quiet: bool) -> None:
    """Rank 0, once every strategy has results: bench.json, bench.md and bench.png."""
    from zerolens.report.bench import bench_summary, bench_terminal_lines, render_bench
    params = sum(shape.numel() for shape in parameter_shapes(config.model))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rounds = [gathered_results(out, config.strategies, config.nproc, r) for r in range(config.rounds)]
    # Each reference loop's results, round by round, by the strategy it is the reference of.
    references = {name: [[rank[0] for rank in gathered_results(out, (reference_of(name),), config.nproc, r)]
                         for r in range(config.rounds)]
                  for name in config.strategies if config.reference_loops and reference_of(name)}
    summary = bench_summary(config, rounds, params, device_name, versions(), predicted=read_predicted_peaks(out),
                            references=references)
    if device.type == "cuda":  # what the allocator may use: the GPU, or the --memory-limit-gib cap
        total = torch.cuda.get_device_properties(device).total_memory
        summary["memory_limit_bytes"] = min(total, int(config.memory_limit_gib * 2**30)) if config.memory_limit_gib \
            else total
    text = render_bench(summary, command)
    files.write_json(out / "bench.json", summary)
    files.write_atomic(out / "bench.md", text)
    if quiet:
        return
    try:
        from zerolens.report.plots import bench_plot
        bench_plot(summary, out / "bench.png")
    except ImportError:
        say("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)")
    say(*(text.splitlines() if config.verbose else bench_terminal_lines(summary, out)))


def finish_verify(config: RunConfig, out: Path, command: str, phase: Phase, quiet: bool = False) -> dict:
    """Rank 0, once every strategy has results: summary.json, report.md and the plots."""
    started = time.time()
    # Shapes from a copy on the meta device: building the model again on the CPU only to read its
    # sizes cost seconds (14 s for gpt-1b on 2 cores).
    shapes = parameter_shapes(config.model)
    summary = build_summary(config, gathered_results(out, config.strategies, config.nproc), [s.numel() for s in shapes],
                            versions(), param_shapes=[tuple(s) for s in shapes],
                            metrics=metrics_complete(out, config.strategies, config.steps, config.nproc),
                            predicted_peaks=read_predicted_peaks(out), weight_bytes=weight_bytes(config.model),
                            trainable=trainable_flags(config.model))
    text = render.render(summary, command)
    wall_time.note(out, "report", time.time() - started)
    phase.at(name="plotting")
    started = time.time()
    try:
        from zerolens.report.plots import verify_plots
        verify_plots(summary, out, {name: registry.spec(name).reduce_bucket_bytes(config.precision,
                                                                                   config.reduce_bucket_size)
                                    for name in config.strategies})
    except ImportError:
        say("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)")
    wall_time.note(out, "plots", time.time() - started)
    # Written last, with where the run's time went up to here: summary.json, then report.md. A Ctrl-C
    # during the plots leaves neither, so summary.json says INTERRUPTED (jobs.record_interruption) and no
    # report says PASS beside it; one between the two leaves summary.json, which a report only renders.
    summary["wall_time"] = wall_time.breakdown(out)
    files.write_json(out / "summary.json", summary)
    files.write_atomic(out / "report.md", text)
    if config.verbose and not quiet:
        say(*text.splitlines(), wall_time.breakdown_line(summary["wall_time"]))
    if not quiet:
        say(*render.terminal_lines(summary, out))
    return summary


def agree_on_run_folder(config: RunConfig, args: argparse.Namespace) -> Path:
    """The run folder, decided by rank 0 and told to every rank. Started by `zerolens`, the folder
    exists (zerolens made it). Under another launcher rank 0 makes it here, with the same rules:
    a new or empty folder, or with --overwrite one zerolens created. A UserError reaches every rank."""
    decision = [None, None]
    if dist.get_rank() == 0:
        try:
            out = Path(config.out) if config.out else default_run_folder()
            if not (args.resume and is_run_folder(out)):
                new_run_folder(out, args.overwrite)
            decision = [str(out), None]
        except UserError as e:
            decision = [None, str(e)]
    dist.broadcast_object_list(decision)
    if decision[1] is not None:
        raise UserError(decision[1])
    return Path(decision[0])


def print_header(config: RunConfig, out: Path) -> None:
    for note in (config.device_note, config.precision_note):
        if note:
            say(f"zerolens: {note}")
    accumulated = f" of {config.grad_accum} micro-batches each" if config.grad_accum > 1 else ""
    if config.job == "bench":
        rounds = f", {config.rounds} rounds" if config.rounds > 1 else ""
        references = ", each strategy beside a loop written without zerolens" if config.reference_loops else ""
        # (DeepSpeed before 0.17.1 never checks bf16 gradients: "off" is true there too)
        unchecked = (config.grad_overflow_check is False
                     and bool(registry.reading_grad_overflow_check(config.strategies)))
        kernels = ", ".join(["fused AdamW" if config.fused_adam else "foreach AdamW"]
                            + ["blocks and loss compiled"] * config.model.compile_blocks
                            + ["ZeRO-1/2's bf16 gradient overflow check off"] * unchecked)
        ranks = f"{config.nproc} rank{'s' * (config.nproc != 1)}"
        say(f"zerolens bench: {ranks} on {config.device}, {config.preset}, strategies "
            f"{', '.join(config.strategies)}, {config.warmup_steps} warm-up + {config.steps} timed steps{accumulated}"
            f"{rounds}{references}; {kernels}", f"run folder: {out}")
    else:
        ranks = f"{config.nproc} rank{'s' * (config.nproc != 1)}"
        say(f"zerolens verify: {ranks} on {config.device}, {config.preset}, strategies "
            f"{', '.join(config.strategies)}, {config.steps} steps{accumulated}", f"run folder: {out}")


@record
def main(argv: list[str] | None = None) -> int:
    """One rank, started by torchrun, deepspeed or another launcher (`python -m zerolens.worker`)."""
    return run_rank(argv)


def launched_rank(argv: list[str]) -> None:
    """One rank started by `zerolens` itself (launch.launch_local), in a process forked or spawned by
    multiprocessing; torch's launcher records its error as @record does, and reads its exit code."""
    with contextlib.suppress(OSError):
        os.setsid()  # a process group of its own, as torch's launcher gives a spawned binary: launch.rank_pids
    if os.environ.get(LAUNCHER_PID, "").isdigit():
        ended_with_launcher(int(os.environ[LAUNCHER_PID]))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # A forked rank's OpenMP read the fork server's setting; the launch sets this run's (jobs.py).
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = run_rank(argv)
    if code:
        sys.exit(code)


def ended_with_launcher(launcher: int) -> None:
    """Kills this rank when the process that launched it ends. A launcher killed outright (SIGKILL, the
    kernel's out-of-memory killer) stops no rank: they wait forever in a collective or on its store,
    and the fork server, which holds a pipe open for them, waits with them."""
    def watch():
        try:
            launcher_fd = os.pidfd_open(launcher)  # readable once the launcher has exited (Linux)
            select.select([launcher_fd], [], [])
        except (AttributeError, OSError):  # no pidfd here, or the launcher is already gone
            while _alive(launcher):
                time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zerolens-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a PermissionError would be a live process of another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run_rank(argv: list[str] | None) -> int:
    args = worker_parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("zerolens.run.worker: no RANK/WORLD_SIZE in the environment; start it with zerolens verify, "
              "torchrun or deepspeed", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    try:
        registry.load_plugins()
        config = load_config(args.config) if args.config else config_from_args(args, world_size=world_size)
        if config.nproc != world_size:
            raise UserError(f"the config is for {config.nproc} ranks, the launcher started {world_size}")
    except UserError as e:
        if rank == 0:
            print(f"zerolens: {e}", file=sys.stderr)
        return 2
    quiet_libraries(config.verbose)
    command = args.command or shlex.join([os.path.basename(sys.executable), "-m", "zerolens.worker",
                                          *(argv if argv is not None else sys.argv[1:])])
    phase = Phase(name="init", rank=rank, fault=fault_from_environment())
    # Started by `zerolens`, the run folder exists before the ranks do: the hang watchdog can hear
    # from them from the start, process-group initialisation included.
    out = Path(config.out) if args.resume else None
    stack_file = watch_for_hangs(out / "logs", rank, phase) if out is not None else None
    try:
        if out is not None and rank == 0:
            wall_time.note_launched(out)
        phase.enter("init")
        started = time.time()
        device = phase.device = init_distributed(config, local_rank)
        try:
            out = agree_on_run_folder(config, args)
        except UserError as e:
            if rank == 0:
                print(f"zerolens: {e}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        if stack_file is None:
            stack_file = watch_for_hangs(out / "logs", rank, phase)
        if rank == 0:
            wall_time.note(out, "process_group", time.time() - started)
        first_launch = not (out / "results").exists()
        if rank == 0:
            if first_launch and not args.quiet:
                print_header(config, out)
            if not (out / "env.json").exists():
                files.write_json(out / "env.json", environment(config, command, device))
            if not args.config:  # zerolens wrote it; under another launcher rank 0 does
                save_config(config, out / "config.json", command)
        dist.barrier()  # config.json is there before any rank's prediction reads it
        # Decided by every rank before any could pass the next barrier, after which rank 0 writes the file
        if config.predict_peaks and not (out / PREDICTED_PEAKS).exists():
            # Before anything trains: a prediction made without the measurement, each rank's share of the
            # strategies in a process of its own, gathered by rank 0 (run/prediction.py).
            phase.at(strategy="-", step=-1, name="predicting the peaks")
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            started = time.time()
            share = share_of(config.strategies, rank, dist.get_world_size())
            if share:
                predict_in_fresh_process(config, out, capability, share, into=part_name(rank),
                                         env=on_own_gpu(device))
            dist.barrier()
            if rank == 0:
                gathered(config, out, dist.get_world_size())
                wall_time.note(out, "prediction", time.time() - started,
                               shares=[share_of(config.strategies, r, dist.get_world_size())
                                       for r in range(dist.get_world_size())])
        dist.barrier()  # the folder is ready before any rank writes into it
        finished = run_strategies(config.job, config, device, out, phase, stop_on_leftover=args.resume,
                                  quiet=args.quiet)
        summary = None
        if finished and rank == 0:
            phase.at(strategy="-", step=-1, name="writing the report")
            if config.job == "bench":
                finish_bench(config, device, out, command, quiet=args.quiet)
            else:
                summary = finish_verify(config, out, command, phase, quiet=args.quiet)
        phase.at(strategy="-", step=-1, name="shutdown")
        dist.barrier()
        dist.destroy_process_group()
        stop_watching(stack_file)
    except Exception as e:
        message = (out_of_memory_message(rank, phase, e) if isinstance(e, torch.OutOfMemoryError)
                   else f"rank {rank} failed during {phase}: {type(e).__name__}: {e}")
        if out is not None:  # the rank's own log in the run folder, traceback included
            (out / "logs").mkdir(parents=True, exist_ok=True)
            (out / "logs" / f"rank{rank}.log").write_text(message + "\n\n" + traceback.format_exc())
        else:  # no run folder yet: the traceback goes to the console
            traceback.print_exc()
        raise RankFailure(message) from e
    if summary is not None and summary["verdict"] == "FAIL":
        return args.fail_exit_code
    return 0


def run_as_script() -> None:
    """`python -m zerolens.worker` (and `-m zerolens.run.worker`): main, then out of the process."""
    try:
        code = main()
    except RankFailure:
        # @record has written the error for the launcher, which reports it in one line; the
        # traceback is in this rank's log in the run folder, not on everyone's console.
        code = 1
    # Everything is written and the process group is gone. Skip the interpreter's teardown: a C++
    # thread left by a backend has aborted it ("terminate called without an active exception",
    # seen in CPU test processes after destroy_process_group), which would turn a finished run
    # into a reported crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_as_script()
