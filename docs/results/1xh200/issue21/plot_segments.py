"""segments.png: what the caching allocator reserved over three training steps, recorded on an H200 beside
the model's prediction from the same allocations (without their addresses), for each allocator setting.

python3 docs/results/1xh200/issue21/plot_segments.py   (reads tests/fixtures/allocator/, writes segments.png here)
"""
import gzip
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zerolens.predict.allocator import Block, CachingAllocator, alloc_settings, requests_of_recording  # noqa: E402

HERE = Path(__file__).parent
FIXTURES = HERE.parents[2].parent / "tests" / "fixtures" / "allocator"
GiB = 2**30


def recorded(record: dict) -> tuple[list[int], list[int]]:
    """Allocated and reserved bytes after each request of the recording, as the allocator had them."""
    allocated = reserved = 0
    out_allocated, out_reserved = [], []
    for action, _, size, _ in record["events"]:
        if action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        if action in ("alloc", "free_completed"):
            out_allocated.append(allocated)
            out_reserved.append(reserved)
    return out_allocated, out_reserved


def modelled(record: dict) -> list[int]:
    """The model's reserved bytes after each of the same requests."""
    allocator = CachingAllocator(**alloc_settings(record["alloc_conf"])[0])
    blocks: dict[int, Block] = {}
    out = []
    for action, ident, size, stream in requests_of_recording(record):
        if action == "alloc":
            blocks[ident] = allocator.malloc(size, stream)
        else:
            allocator.free(blocks.pop(ident))
        out.append(allocator.reserved)
    return out


fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
for column, model in enumerate(("case-study", "gpt2")):
    for row, setting in enumerate(("default", "expandable")):
        with gzip.open(FIXTURES / f"{model}-{setting}.json.gz", "rt") as f:
            record = json.load(f)
        allocated, reserved = recorded(record)
        ax = axes[row][column]
        ax.plot([a / GiB for a in allocated], color="0.6", lw=0.8, label="allocated")
        ax.plot([r / GiB for r in reserved], color="tab:blue", lw=1.6, label="reserved, recorded")
        ax.plot([r / GiB for r in modelled(record)], color="tab:orange", lw=1.0, ls="--", label="reserved, model")
        ax.set_title(f"{record['model']} ({record['precision']}, micro-batch {record['micro_batch']}), "
                     f"{'expandable segments' if setting == 'expandable' else 'default allocator'}", fontsize=9)
        ax.set_ylabel("GiB")
        if row == 1:
            ax.set_xlabel("allocation or free, in order (3 training steps)")
axes[0][0].legend(fontsize=8, loc="lower right")
fig.suptitle("The caching allocator's reserve on an H200 (torch 2.11), recorded and predicted by zerolens's model",
             fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "segments.png", dpi=80)
