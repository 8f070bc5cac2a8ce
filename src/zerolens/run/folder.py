"""Run folders: created by zerolens, marked as such, and the only folders zerolens ever deletes.

Every run folder carries a marker file (MARKER) written when zerolens creates it. `--overwrite`
replaces a folder only if it carries the marker: a folder that merely holds a `config.json`
(a Hugging Face model folder, say) is someone else's and is never touched.
"""
from __future__ import annotations

import json
import shutil
import time
from datetime import datetime
from pathlib import Path

from zerolens._version import __version__
from zerolens.errors import UserError

MARKER = ".zerolens-run"


def default_run_folder() -> Path:
    """runs/<timestamp>, with -2, -3 ... when that exists already."""
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def is_run_folder(path: Path) -> bool:
    """A folder zerolens created (it carries the marker)."""
    return (path / MARKER).is_file()


def new_run_folder(out: Path, overwrite: bool = False, names: tuple[str, str] = ("--out", "--overwrite")) -> Path:
    """An empty, marked run folder at `out`. An existing non-empty folder is replaced only with
    `overwrite`, and only if zerolens created it; anything else is a UserError and nothing is
    touched. `names`: what the caller calls `out` and `overwrite` (the flags, or zerolens.track's
    arguments)."""
    out_name, overwrite_name = names
    if out.is_symlink():
        raise UserError(f"{out_name} {out} is a symbolic link; give the folder it points to, or another {out_name}")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out_name} {out} is a file, not a folder; choose another {out_name}")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"run folder {out} already exists and is not empty; choose another {out_name}, "
                            f"or replace it with {overwrite_name}")
        if not is_run_folder(out):
            raise UserError(f"{overwrite_name}: {out} was not created by zerolens (it has no {MARKER} marker; run "
                            "folders from before zerolens marked them have none either); not deleting it")
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(json.dumps({"created_by": f"zerolens {__version__}", "time": time.time()}) + "\n")
    except OSError as e:
        raise UserError(f"cannot create run folder {out}: {e.strerror}") from None
    return out


def results_path(out: Path, strategy: str, round_index: int = 0) -> Path:
    """One strategy's results in a run folder, gathered from every rank (rank r's at index r); a bench's
    later rounds' beside the first's (<strategy>.round2.json, ...)."""
    return out / "results" / (f"{strategy}.json" if round_index == 0 else f"{strategy}.round{round_index + 1}.json")
