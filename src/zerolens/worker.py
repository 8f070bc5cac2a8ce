"""The per-rank entry point: trains every strategy on this rank, measures, gathers to rank 0.

Runs under `zerolens verify` (which starts it through torch's elastic launcher), and unchanged
under `torchrun --nproc-per-node N -m zerolens.worker ...` or
`deepspeed --num_gpus N --module zerolens.worker ...` (ranks come from the environment;
the `--local_rank` that the deepspeed launcher appends is accepted).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import traceback
import warnings
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import report
from .config import UserError, VerifyConfig, add_bench_arguments, add_verify_arguments, config_from_args
from .faults import fault_from_environment
from .model import parameter_shapes
from .strategies import TrainSettings, make_strategy
from .summary import build_summary
from .train import Phase, train_strategy


class RankFailure(RuntimeError):
    """Carries the rank and phase of a failure to the launcher's error report."""


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zerolens.worker", description=__doc__)
    add_verify_arguments(parser)
    add_bench_arguments(parser)
    parser.add_argument("--job", choices=("verify", "bench"), default="verify")
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # files only (maxsize's trials)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    # `zerolens verify` turns the verdict into its own exit code, so it asks for 0 here.
    parser.add_argument("--fail-exit-code", type=int, default=1, help="exit code of rank 0 on FAIL (default 1)")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    return parser


def default_run_folder() -> Path:
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


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


def init_distributed(config: VerifyConfig, local_rank: int) -> torch.device:
    if config.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if config.memory_limit_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, config.memory_limit_gib * 2**30 / total), device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if any(s.startswith("zero") for s in config.strategies):
        import deepspeed
        # DeepSpeed wraps the process group that already exists. On CPU it prints a line per rank
        # about its shared-memory collective op: keep that out of the table unless asked.
        quiet = contextlib.nullcontext() if config.verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            deepspeed.init_distributed(dist_backend=dist.get_backend())
    return device


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
    phase.heartbeat = logs / f"heartbeat_rank{rank}.json"
    return stack_file


def stop_watching(stack_file) -> None:
    """After the last collective: a finished rank has no stack to show, so its empty dump file
    goes. The handler stays registered till the process ends (a late SIGUSR1 from the watchdog
    then writes to the unlinked file instead of killing the rank)."""
    stack_file.flush()
    path = Path(stack_file.name)
    if path.stat().st_size == 0:
        path.unlink()


OUT_OF_MEMORY = "ran out of GPU memory"  # what `zerolens maxsize` looks for in a failed trial


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


def environment(config: VerifyConfig, command: str, device: torch.device) -> dict:
    """env.json: what produced the run, for whoever reads its figures later."""
    return {"command": command, "argv": sys.argv, "python": sys.version.split()[0], **versions(),
            "backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(device.type),
            "devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                        if device.type == "cuda" else [platform.processor() or platform.machine()]),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "hostname": platform.node(),
            "zerolens_commit": git_commit(), "zerolens_fault": os.environ.get("ZEROLENS_FAULT")}


def train_settings(config: VerifyConfig) -> TrainSettings:
    return TrainSettings(precision=config.precision, lr=config.lr, micro_batch=config.micro_batch,
                         world_size=config.nproc, reduce_bucket_size=config.reduce_bucket_size,
                         gradient_clipping=config.gradient_clipping, fused_adam=config.fused_adam,
                         user_ds_config=config.ds_config, ds_override=config.ds_override, verbose=config.verbose)


def write_config(out: Path, command: str, config: VerifyConfig, settings: TrainSettings) -> None:
    """config.json: the command, every setting, and each backend's own settings (DeepSpeed configs)."""
    report.write_json(out / "config.json", {"command": command, **config.to_json(),
                                            "strategy_settings": {n: make_strategy(n, settings).describe()
                                                                  for n in config.strategies}})


def run_bench(config: VerifyConfig, device: torch.device, out: Path, command: str, phase: Phase,
              quiet: bool = False) -> None:
    from .bench import bench_rank, bench_summary, render_bench
    rank = dist.get_rank()
    settings = train_settings(config)
    if rank == 0:
        write_config(out, command, config, settings)
    if rank == 0 and not quiet:
        print(f"zerolens bench: {config.nproc} ranks on {config.device}, {config.preset}, strategies "
              f"{', '.join(config.strategies)}, {config.warmup_steps} warm-up + {config.steps} timed steps; "
              f"run folder {out}", flush=True)
    results = bench_rank(config, settings, device, phase)
    phase.strategy, phase.step, phase.name = "-", -1, "gathering results"
    gathered = [None] * config.nproc
    dist.all_gather_object(gathered, results)
    if rank != 0:
        return
    phase.name = "writing the report"
    params = sum(shape.numel() for shape in parameter_shapes(config.model))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    summary = bench_summary(config, gathered, params, device_name, versions())
    if device.type == "cuda":  # what the allocator may use: the GPU, or the --memory-limit-gib cap
        total = torch.cuda.get_device_properties(device).total_memory
        summary["memory_limit_bytes"] = min(total, int(config.memory_limit_gib * 2**30)) if config.memory_limit_gib \
            else total
    text = render_bench(summary, command)
    report.write_json(out / "bench.json", summary)
    report.write_atomic(out / "bench.md", text)
    if quiet:
        return
    print("\n" + text + f"\nReport: {out / 'bench.md'}", flush=True)
    try:
        from .plots import bench_plot
        print(f"Plot: {bench_plot(summary, out / 'bench.png')}\n", flush=True)
    except ImportError:
        print("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)\n", flush=True)


def run_verify(config: VerifyConfig, device: torch.device, out: Path, command: str, phase: Phase) -> dict | None:
    rank = dist.get_rank()
    settings = train_settings(config)
    if rank == 0:
        write_config(out, command, config, settings)
        if config.precision_note:
            print(f"zerolens: {config.precision_note}", flush=True)
        print(f"zerolens: {config.nproc} ranks on {config.device}, strategies {', '.join(config.strategies)}, "
              f"{config.steps} steps; run folder {out}", flush=True)
    results = []
    for name in config.strategies:
        strategy = make_strategy(name, settings)
        result = train_strategy(strategy, model_config=config.model, steps=config.steps, seed=config.seed,
                                signal=config.signal, micro_batch=config.micro_batch, device=device,
                                phase=phase)
        results.append({"losses": result.losses, "records": result.records, "seconds": result.seconds,
                        "settings": strategy.describe(), "notes": result.notes,
                        "allocated_at_start": result.allocated_at_start,
                        "leftover_sources": result.leftover_sources})
        if rank == 0:
            print(f"zerolens: {name} done in {result.seconds:.1f} s, loss {result.losses[0]:.4f} -> "
                  f"{result.losses[-1]:.4f}", flush=True)
    phase.strategy, phase.step, phase.name = "-", -1, "writing metrics"
    report.write_jsonl(out / f"metrics_rank{rank}.jsonl", [rec for r in results for rec in r["records"]])
    phase.name = "gathering results"
    gathered = [None] * config.nproc
    dist.all_gather_object(gathered, results)
    if rank != 0:
        return None
    phase.name = "writing the report"
    # Shapes from a copy on the meta device: building the model again on the CPU only to read its
    # sizes cost seconds (14 s for gpt-1b on 2 cores).
    shapes = parameter_shapes(config.model)
    summary = build_summary(config, gathered, [s.numel() for s in shapes], versions(),
                            param_shapes=[tuple(s) for s in shapes])
    text = report.render(summary, command)
    report.write_json(out / "summary.json", summary)
    report.write_atomic(out / "report.md", text)
    print("\n" + text + f"\nReport: {out / 'report.md'}", flush=True)
    phase.name = "plotting"
    try:
        from .plots import verify_plots
        paths = verify_plots(summary, out)
        print("Plots: " + ", ".join(str(p) for p in paths) + "\n", flush=True)
    except ImportError:
        print("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)\n", flush=True)
    return summary


@record
def main(argv: list[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("zerolens.worker: no RANK/WORLD_SIZE in the environment; start it with zerolens verify, "
              "torchrun or deepspeed", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    try:
        config = config_from_args(args, world_size=world_size)
    except UserError as e:
        if rank == 0:
            print(f"zerolens: {e}", file=sys.stderr)
        return 2
    quiet_libraries(config.verbose)
    command = args.command or shlex.join([os.path.basename(sys.executable), "-m", "zerolens.worker",
                                          *(argv if argv is not None else sys.argv[1:])])
    phase = Phase(name="init", rank=rank, fault=fault_from_environment())
    out = [None]
    try:
        device = init_distributed(config, local_rank)
        out = [Path(config.out) if config.out else default_run_folder()]
        dist.broadcast_object_list(out)  # rank 0's choice of folder, for every rank
        stack_file = watch_for_hangs(out[0] / "logs", rank, phase)  # open till the rank is done
        if rank == 0:
            report.write_json(out[0] / "env.json", environment(config, command, device))
        if args.job == "bench":
            run_bench(config, device, out[0], command, phase, quiet=args.quiet)
            summary = None
        else:
            summary = run_verify(config, device, out[0], command, phase)
        phase.name = "shutdown"
        dist.barrier()
        dist.destroy_process_group()
        stop_watching(stack_file)
    except Exception as e:
        message = (out_of_memory_message(rank, phase, e) if isinstance(e, torch.OutOfMemoryError)
                   else f"rank {rank} failed during {phase}: {type(e).__name__}: {e}")
        if out[0] is not None:  # the rank's own log in the run folder, traceback included
            (out[0] / "logs").mkdir(parents=True, exist_ok=True)
            (out[0] / "logs" / f"rank{rank}.log").write_text(message + "\n\n" + traceback.format_exc())
        else:  # no run folder yet: the traceback goes to the console
            traceback.print_exc()
        raise RankFailure(message) from e
    if summary is not None and summary["verdict"] == "FAIL":
        return args.fail_exit_code
    return 0


if __name__ == "__main__":
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
