"""Run folders: created by zerolens, marked as such, and the only folders zerolens ever deletes.

Every run folder carries a marker file (MARKER) written when zerolens creates it. `--overwrite`
replaces a folder only if it carries the marker: a folder that merely holds a `config.json`
(a Hugging Face model folder, say) is someone else's and is never touched. Nor is what a user put
into a run folder afterwards (a notebook beside the report): the process that made the folder lists
in the marker, as it ends, everything the folder holds (`made`), and `--overwrite` refuses a folder
that holds anything that list does not name, or that has no list (its run was killed before its
process ended, or an older zerolens made it).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import time
from datetime import datetime
from pathlib import Path

from zerolens._version import __version__
from zerolens.errors import UserError
from zerolens.report.files import write_atomic

MARKER = ".zerolens-run"
# The run folders this process made (resolved) whose runs have not ended; their markers get the list of
# what zerolens made in them when their runs end (run_ended) or, at the latest, when the process ends.
MADE_HERE: set[Path] = set()


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
        foreign = not_made_by_zerolens(out)
        if foreign is None:
            raise UserError(f"{overwrite_name}: {out} has no list of what zerolens made in it (its run was killed "
                            f"before it ended, or an older zerolens made it); not deleting it: delete it yourself "
                            f"or choose another {out_name}")
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise UserError(f"{overwrite_name}: {out} holds what zerolens did not make ({shown}); not deleting it: "
                            f"move those out, or choose another {out_name}")
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(json.dumps({"created_by": f"zerolens {__version__}", "time": time.time()}) + "\n")
    except OSError as e:
        raise UserError(f"cannot create run folder {out}: {e.strerror}") from None
    MADE_HERE.add(out.resolve())
    return out


def entries(folder: Path) -> set[str]:
    """Every file, folder and link under `folder` (a link not followed), as a path relative to it; the
    marker aside."""
    found = set()
    for root, folders, names in os.walk(folder):  # a link to a folder is listed, not entered
        base = Path(root).relative_to(folder)
        found.update((base / name).as_posix() for name in folders + names)
    found.discard(MARKER)
    return found


def marker_of(folder: Path) -> dict:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def run_ended(folder: Path) -> None:
    """The run in `folder` has ended: where this process made the folder, its marker gets the list of
    what zerolens made in it (all it holds, made empty by this process). Called as soon as a run in a
    process that lives on (zerolens.track in a notebook) writes its last file, so that what the user
    puts there later is not taken for zerolens's; CLI runs end with their process (record_made_at_exit)."""
    folder = folder.resolve()
    if folder in MADE_HERE:
        MADE_HERE.discard(folder)
        marker = marker_of(folder)
        marker["made"] = sorted(entries(folder))
        write_atomic(folder / MARKER, json.dumps(marker) + "\n")


def record_made_at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child ending through the interpreter: not the process that made them
        return
    for folder in list(MADE_HERE):
        try:
            if is_run_folder(folder):
                run_ended(folder)
        except OSError:
            pass  # a folder the user removed or made read-only meanwhile: nothing to list


atexit.register(record_made_at_exit, os.getpid())


def not_made_by_zerolens(folder: Path) -> list[str] | None:
    """What a run folder holds that its marker's list of what zerolens made does not name (a folder's
    contents shown by the folder alone), or None where the marker has no list."""
    run_ended(folder)  # made by this process, its run not ended yet (its list not written): listed now
    made = marker_of(folder).get("made")
    if not isinstance(made, list):
        return None
    foreign = entries(folder) - set(made)
    return sorted(entry for entry in foreign if Path(entry).parent.as_posix() not in foreign)


def results_path(out: Path, strategy: str, round_index: int = 0) -> Path:
    """One strategy's results in a run folder, gathered from every rank (rank r's at index r); a bench's
    later rounds' beside the first's (<strategy>.round2.json, ...)."""
    return out / "results" / (f"{strategy}.json" if round_index == 0 else f"{strategy}.round{round_index + 1}.json")
