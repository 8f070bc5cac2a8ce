"""Files zerolens writes whole or not at all: a temporary file in the same folder, then a rename."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask: from /proc on Linux (reading it leaves it alone), else by setting it
    and back, which is done once, at import, before any thread of ours runs."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _umask()


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file. The
    file gets the mode an ordinary write would give it (mkstemp's is 0600, which would hide run
    folders from teammates on a shared file system)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")
