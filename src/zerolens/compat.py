"""The releases of torch and DeepSpeed whose internals zerolens knows.

The census reads buffers inside DeepSpeed's ZeRO optimizers and torch's FSDP2, the CPU peaks come
from torch's private MemTracker, and strategies/layout.py restates their layouts. Those move between
releases, so a release outside these ranges is refused before anything trains, in one line that
names the range (pyproject.toml declares the same ranges). Inside them nothing is said.
Tested: DeepSpeed 0.16.9, 0.17.6, 0.18.9, 0.19.8 with torch 2.13 on CPU
(docs/results/deepspeed-compat/), and DeepSpeed 0.19.8 with torch 2.11 on 2xH200.
"""
from __future__ import annotations

import importlib.metadata
import re

from zerolens.errors import UserError

# [lowest, first unsupported) as (major, minor).
SUPPORTED = {"torch": ((2, 11), (2, 14)), "deepspeed": ((0, 16), (0, 20))}
WHY = {"torch": "reads FSDP2's and MemTracker's internals as they are",
       "deepspeed": "reads the ZeRO optimizers' buffers as they are"}


def installed_version(package: str) -> str | None:
    """The installed release, from its metadata (nothing is imported); None when not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as 2.13.0+cpu or 0.19.8."""
    return patch_release(version)[:2]


def patch_release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string (patch 0 where it has none): for behaviour that changed
    within a line, as DeepSpeed's gradient overflow check did at 0.17.1, 0.19.3 and 0.19.6."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not match:
        raise UserError(f"cannot read the version {version!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def supported_range(package: str) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED[package]
    return f"{package}>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_supported(package: str, version: str | None = None) -> None:
    """UserError unless the installed (or given) release of `package` lies in SUPPORTED."""
    version = version or installed_version(package)
    if version is None:
        return  # whoever needs the package says it is missing
    lo, hi = SUPPORTED[package]
    if not lo <= release(version) < hi:
        raise UserError(f"{package} {version} is not supported: zerolens {WHY[package]} in "
                        f"{supported_range(package)} (install a release in that range)")
