"""What the CUDA allocator held at the peak of a phase, byte by byte, by component.

The caching allocator can record every allocation and free with the Python stack that made it
(torch.cuda.memory._record_memory_history). We record one phase at a time on the last step,
replay its events to find the instant of the peak, and name each block alive at that instant:

- by address, from the census: the storages of parameters, gradients, optimizer states and
  communication buffers the strategy holds (taken at the phase's start, during it, and at its end);
- by address, from the saved-tensor hooks: activations saved for backward;
- blocks alive before the phase and in no census: the cuBLAS workspaces and what earlier
  strategies left (both measured elsewhere, so the rest is unattributed);
- blocks allocated during the phase and held by nothing above are temporaries, named by the code
  that allocated them: the strategy's backend (its files are the registry's `transient_code`:
  DeepSpeed's reduce buckets, gathered parameters and fp32 gradient copies; FSDP2's all-gather
  buffers and reduce-scatter inputs and outputs), the optimizer's, autograd's in backward (no
  Python frame: the gradients of activations), the model's in forward.

The replay's peak must equal the allocator's own peak statistic: that checks the replay.
Everything here but `record_phase` is a pure function of the snapshot, so it is tested on CPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

PEAK_COMPONENTS = ("param", "grad", "optimizer_state", "comm_buffer", "activation",
                   "backend_transient", "optimizer_transient", "autograd_transient",
                   "forward_transient", "workspace_and_earlier", "unattributed", "allocator_slack")
# Each Python frame's file decides who allocated a block, innermost frame first; the backend's own
# files come from the strategy's registry entry (`transient_code`).
OPTIMIZER_PATHS = ("/torch/optim/", "/torch/nn/utils/clip_grad")
MAX_ENTRIES = 2_000_000  # alloc/free events kept per phase; a phase of the 1B preset needs tens of thousands


@dataclass
class Block:
    size: int  # bytes requested (the allocator rounds up; the difference shows as allocator slack)
    alloc_index: int  # position of its alloc event in the phase; -1 if allocated before the phase
    frames: list = field(default_factory=list)
    free_index: float = float("inf")  # position of its free event; inf if alive at the phase's end

    @property
    def preexisting(self) -> bool:
        return self.alloc_index < 0


def _live_blocks(segments: list[dict]) -> dict[int, Block]:
    """Blocks allocated now (the snapshot's end), by address. A segment lists its blocks in
    address order, so each block's address is the segment's plus the sizes before it."""
    live = {}
    for seg in segments:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                live[addr] = Block(b.get("requested_size", b["size"]), -1, b.get("frames", []))
            addr += b["size"]
    return live


def replay_to_peak(segments: list[dict], events: list[dict]) -> tuple[int, int, dict[int, Block], list[dict]]:
    """(bytes allocated at the phase's start, peak, blocks alive at the peak, the events) from the
    blocks alive at the end of the phase and its alloc/free events. Sizes are the requested ones,
    which the trace records; free_requested is when the allocator stops counting a block."""
    events = [e for e in events if e["action"] in ("alloc", "free_requested")]
    start = _live_blocks(segments)
    for e in reversed(events):  # walk back from the end: undo each event
        if e["action"] == "alloc":
            start.pop(e["addr"], None)
        else:
            start[e["addr"]] = Block(e["size"], -1)
    at_start = current = peak = sum(b.size for b in start.values())
    peak_index = -1
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        if current > peak:
            peak, peak_index = current, i
    live = dict(start)
    for i, e in enumerate(events[:peak_index + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = Block(e["size"], i, e.get("frames") or [])
        else:
            live.pop(e["addr"], None)
    for i in range(peak_index + 1, len(events)):  # when the blocks alive at the peak are freed
        e = events[i]
        if e["action"] == "free_requested" and e["addr"] in live and live[e["addr"]].free_index == float("inf"):
            live[e["addr"]].free_index = i
    return at_start, peak, live, events


def marker_positions(events: list[dict]) -> list[int]:
    """Positions of the allocations made by `trace_marker`, in order."""
    return [i for i, e in enumerate(events)
            if e["action"] == "alloc" and any(f["name"] == "trace_marker" for f in e.get("frames") or [])]


def allocating_code(frames: list[dict], backend_code: tuple[str, ...] = ()) -> str:
    """file:function of the innermost frame outside torch's own modules (the backend's and the
    optimizer's count as outside), or of the innermost one."""
    for f in frames:
        if "/torch/" not in f["filename"] or any(p in f["filename"] for p in (*OPTIMIZER_PATHS, *backend_code)):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['name']}" if frames else "(no Python frame)"


def transient_kind(block: Block, phase: str, backend_code: tuple[str, ...]) -> str:
    """Who made a temporary: decided by the innermost frame that is the optimizer's, the backend's
    (a file matching `backend_code`) or outside torch (the model's code)."""
    for f in block.frames:
        name = f["filename"]
        if any(p in name for p in OPTIMIZER_PATHS):
            return "optimizer_transient"
        if any(p in name for p in backend_code):
            return "backend_transient"
        if "/torch/" not in name:
            return "forward_transient" if phase == "forward" else "unattributed"
    # Autograd runs backward in C++ with no Python frame; elsewhere such a block (made by a
    # backend's C++ thread) is something we cannot name.
    return "autograd_transient" if phase == "backward" and not block.frames else "unattributed"


def classify(block: Block, addr: int, phase: str, at_start: dict[int, str], during: list[tuple[int, dict[int, str]]],
             at_end: dict[int, str], backend_code: tuple[str, ...]) -> str:
    """A component from an address map taken while this block was alive, else by who allocated it.
    A map taken at another moment could name a different tensor that reused the address."""
    if block.preexisting and addr in at_start:
        return at_start[addr]
    for position, held in during:
        if block.alloc_index < position < block.free_index and addr in held:
            return held[addr]
    if block.free_index == float("inf") and addr in at_end:
        return at_end[addr]
    if block.preexisting:
        return "workspace_and_earlier"
    return transient_kind(block, phase, backend_code)


def peak_anatomy(segments: list[dict], events: list[dict], phase: str, *, at_start: dict[int, str],
                 during: list[dict[int, str]], at_end: dict[int, str], known_preexisting_bytes: int,
                 allocator_peak: int, backend_code: tuple[str, ...]) -> dict:
    """Bytes per component at the phase's peak. `during` holds the maps taken at `trace_marker`
    calls, in order; `backend_code` names the strategy's backend's files (its temporaries). `known_preexisting_bytes` (cuBLAS workspaces and earlier strategies'
    leftovers, measured elsewhere) is how much of `workspace_and_earlier` is explained; the excess
    moves to `unattributed`. What the allocator's own peak exceeds the replay by is its rounding
    of requested sizes (`allocator_slack`)."""
    start_bytes, peak, live, events = replay_to_peak(segments, events)
    positions = marker_positions(events)
    if len(positions) != len(during):
        raise RuntimeError(f"{len(during)} censuses during {phase} but {len(positions)} markers in the trace")
    components = dict.fromkeys(PEAK_COMPONENTS, 0)
    sources: dict[str, int] = {}
    for addr, block in live.items():
        kind = classify(block, addr, phase, at_start, list(zip(positions, during)), at_end, backend_code)
        components[kind] += block.size
        if not block.preexisting and (kind.endswith("_transient") or kind == "unattributed"):
            source = f"{kind}: {allocating_code(block.frames, backend_code)}"
            sources[source] = sources.get(source, 0) + block.size
    excess = components["workspace_and_earlier"] - known_preexisting_bytes
    if excess > 0:
        components["workspace_and_earlier"] -= excess
        components["unattributed"] += excess
    components["allocator_slack"] = allocator_peak - peak
    top = dict(sorted(sources.items(), key=lambda kv: -kv[1])[:6])
    return {"allocated_at_start": start_bytes, "replayed_peak": peak, "allocator_peak": allocator_peak,
            "components": components, "largest_transients": top}


def trace_marker(device) -> None:
    """A tiny allocation whose Python frame marks a moment in the allocator's trace."""
    import torch
    torch.empty(1, device=device)


def address_map(holdings) -> dict[int, str]:
    """Storage start address -> component, for every storage the census counts (first component wins,
    as in census.count)."""
    out: dict[int, str] = {}
    for component in ("param", "grad", "optimizer_state", "comm_buffer"):
        for t in getattr(holdings, component):
            if t is not None and t.device.type == "cuda" and t.untyped_storage().nbytes():
                out.setdefault(t.untyped_storage().data_ptr(), component)
    return out


@contextlib.contextmanager
def record_phase(device_index: int, into: dict):
    """Records the allocator's events during the block; on exit puts the snapshot's segments and
    this device's events into `into` and goes back to recording only live blocks' stacks."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                             max_entries=MAX_ENTRIES, clear_history=True)
    try:
        yield
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        events = snapshot["device_traces"][device_index]
        if len(events) >= MAX_ENTRIES:
            raise RuntimeError(f"the allocator trace filled its {MAX_ENTRIES} entries; the peak cannot be replayed")
        into["segments"] = [s for s in snapshot["segments"] if s["device"] == device_index]
        into["events"] = events
    finally:
        torch.cuda.memory._record_memory_history("state", context="alloc", stacks="python")


def live_block_sizes(segments: list[dict]) -> dict[int, int]:
    """Address -> block size (what the allocator counts) of every block allocated now."""
    sizes = {}
    for seg in segments:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                sizes[addr] = b["size"]
            addr += b["size"]
    return sizes


def live_block_sources(segments: list[dict]) -> dict[str, int]:
    """Bytes of the blocks allocated now, by the code that allocated them (largest first)."""
    sources: dict[str, int] = {}
    for block in _live_blocks(segments).values():
        source = allocating_code(block.frames)
        sources[source] = sources.get(source, 0) + block.size
    return dict(sorted(sources.items(), key=lambda kv: -kv[1]))
