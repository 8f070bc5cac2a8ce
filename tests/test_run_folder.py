"""Run folders: zerolens deletes only folders it made, refuses a file as --out, and writes files that
teammates can read (the umask decides, as for any ordinary write). In-process: no worker starts."""
import os
import stat

import pytest

from zerolens.cli import main
from zerolens.errors import UserError
from zerolens.report.files import write_json
from zerolens.run.folder import MARKER, marker_of, new_run_folder, run_ended


def hugging_face_model_folder(path):
    path.mkdir()
    for name, text in (("config.json", '{"model_type": "llama"}'), ("model.safetensors", "weights"),
                       ("tokenizer.json", "{}")):
        (path / name).write_text(text)
    return path


def test_overwrite_never_deletes_a_folder_zerolens_did_not_make(tmp_path, capsys):
    model = hugging_face_model_folder(tmp_path / "llama")
    before = {p.name: p.read_text() for p in model.iterdir()}
    assert main(["verify", "--out", str(model), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "was not created by zerolens" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_text() for p in model.iterdir()} == before  # nothing touched


def test_overwrite_replaces_a_run_folder(tmp_path):
    out = new_run_folder(tmp_path / "run")
    (out / "summary.json").write_text("{}")
    assert (out / MARKER).is_file()
    with pytest.raises(UserError, match="already exists"):
        new_run_folder(out)
    new_run_folder(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER]


def test_overwrite_never_deletes_what_a_user_put_into_a_run_folder(tmp_path, capsys):
    out = new_run_folder(tmp_path / "run")
    (out / "results").mkdir()
    (out / "results" / "ddp.json").write_text("{}")
    (out / "report.md").write_text("# zerolens verify: PASS")
    run_ended(out)  # the run's last file written: the marker lists what zerolens made
    assert marker_of(out)["made"] == ["report.md", "results", "results/ddp.json"]
    (out / "analysis.ipynb").write_text("mine")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("mine")
    (out / "results" / "mine.csv").write_text("mine")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert main(["verify", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "holds what zerolens did not make (analysis.ipynb, notes, results/mine.csv)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before  # nothing touched
    for mine in ("analysis.ipynb", "notes/a.txt", "results/mine.csv"):
        (out / mine).unlink()
    (out / "notes").rmdir()
    new_run_folder(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER]


def test_overwrite_refuses_a_run_folder_with_no_list_of_what_zerolens_made(tmp_path, capsys):
    # A run killed before its process ended, or an older zerolens's folder: what is zerolens's is not known
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text('{"created_by": "zerolens 0.1.0", "time": 0}\n')
    (out / "summary.json").write_text("{}")
    assert main(["verify", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "has no list of what zerolens made in it" in err and len(err.strip().splitlines()) == 1
    assert (out / "summary.json").read_text() == "{}"


def test_the_process_that_made_a_run_folder_lists_what_it_holds_as_it_ends(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from pathlib import Path; from zerolens.run.folder import new_run_folder; "
            "out = new_run_folder(Path(sys.argv[1])); (out / 'logs').mkdir(); (out / 'logs' / 'a.json').write_text('1')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert marker_of(tmp_path / "run")["made"] == ["logs", "logs/a.json"]


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for command in (["verify"], ["bench"], ["sweep"]):
        assert main([*command, "--out", str(a_file)]) == 2
        err = capsys.readouterr().err
        assert "is a file, not a folder" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert a_file.read_text() == "mine"


def test_files_get_the_mode_an_ordinary_write_gives(tmp_path):
    old = os.umask(0o022)
    try:
        import importlib

        import zerolens.report.files
        importlib.reload(zerolens.report.files)  # it reads the umask once, at import
        zerolens.report.files.write_json(tmp_path / "summary.json", {"a": 1})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
        importlib.reload(zerolens.report.files)
    mode = stat.S_IMODE((tmp_path / "summary.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644


def test_write_json_is_whole_or_absent(tmp_path):
    write_json(tmp_path / "x.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left beside it


def test_a_symbolic_link_as_out_is_refused_in_one_line(tmp_path, capsys):
    target = new_run_folder(tmp_path / "real")
    (tmp_path / "link").symlink_to(target)
    assert main(["verify", "--out", str(tmp_path / "link"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and len(err.strip().splitlines()) == 1
    assert target.is_dir() and (tmp_path / "link").is_symlink()


def test_a_heartbeat_is_rewritten_in_place_and_always_reads_whole(tmp_path):
    """train.Heartbeat: one record read back, whatever came before it (a longer one, written another way)."""
    import json

    from zerolens.run.train import Heartbeat
    heartbeat = Heartbeat(tmp_path / "heartbeat_rank0.json")
    for where in ("forward of ddp at step 0", "x" * 600, "step of ddp at step 1", "backward"):
        heartbeat.write(where)
        beat = json.loads((tmp_path / "heartbeat_rank0.json").read_text())
        assert beat["where"] == where and beat["time"] > 0
    heartbeat.close()


def test_the_watchdog_keeps_a_beat_it_read_whole_when_the_next_read_meets_a_write(tmp_path):
    import json
    import time

    from zerolens.run.launch import HangWatchdog
    watchdog = HangWatchdog(tmp_path, nproc=1, timeout=60)
    beat = {"where": "forward of ddp at step 3", "time": time.time(), "pid": 1}
    (tmp_path / "heartbeat_rank0.json").write_text(json.dumps(beat))
    assert watchdog.heartbeats() == {0: beat}
    (tmp_path / "heartbeat_rank0.json").write_text(json.dumps(beat)[:20])  # half a rewrite
    assert watchdog.heartbeats() == {0: beat}
