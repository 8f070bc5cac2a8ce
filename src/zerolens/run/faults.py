"""Fault injection for testing how a run fails: ZEROLENS_FAULT="rank=R,step=K,phase=P,kind=crash|oom|hang|leak|kill".

At the start of phase P (forward, backward or step) of step K on rank R, of every strategy, or
before the process group exists (phase init, no step), the
rank raises (`crash`: a RuntimeError; `oom`: torch.OutOfMemoryError with the allocator's usual
message, so that the out-of-memory report can be tested on a CPU) or stops answering (`hang`:
sleeps until killed), or keeps 1 MiB allocated for good (`leak`: memory a strategy leaves behind,
which ends its launch; on CPU, where zerolens has no allocator to ask, the only such memory it
can see), or dies without a Python error (`kill`: SIGKILL, as the kernel's out-of-memory killer ends
a process). Unset, nothing happens.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

PHASES = ("init", "forward", "backward", "step")
KINDS = ("crash", "oom", "hang", "leak", "kill")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    kind: str


def parse_fault(text: str) -> Fault:
    try:
        fields = dict(item.split("=", 1) for item in text.split(",") if item.strip())
        step = int(fields["step"]) if fields.get("phase") != "init" else int(fields.get("step", -1))
        fault = Fault(rank=int(fields["rank"]), step=step, phase=fields["phase"], kind=fields["kind"])
    except (KeyError, ValueError):
        raise ValueError(f"ZEROLENS_FAULT must look like rank=1,step=2,phase=backward,kind=crash; got {text!r}") from None
    if fault.phase not in PHASES or fault.kind not in KINDS:
        raise ValueError(f"ZEROLENS_FAULT: phase must be one of {', '.join(PHASES)} and kind one of "
                         f"{', '.join(KINDS)}; got {text!r}")
    return fault


def fault_from_environment() -> Fault | None:
    text = os.environ.get("ZEROLENS_FAULT")
    return parse_fault(text) if text else None


LEAKED: list[torch.Tensor] = []  # what `leak` faults keep allocated


def leaked_bytes(device: torch.device) -> int:
    return sum(t.nbytes for t in LEAKED if t.device.type == device.type)


def inject(fault: Fault | None, rank: int, step: int, phase: str, device: torch.device | None = None) -> None:
    if fault is None or (fault.rank, fault.step, fault.phase) != (rank, step, phase):
        return
    if fault.kind == "leak":
        LEAKED.append(torch.ones(2**20, dtype=torch.uint8, device=device or "cpu"))
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(1)
    if fault.kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. (injected by ZEROLENS_FAULT)")
    raise RuntimeError("injected crash (ZEROLENS_FAULT)")
