"""What zerolens prints reaches the terminal as it is: brackets in check details, paths or a user's
names are text, not rich markup, and nothing is wider than 100 columns."""
from zerolens.report.tables import WIDTH, failed_line, say, terminal_table, verdict_line


def test_brackets_are_printed_as_they_are(capsys):
    say("loss [bold]differs[/] at [rank 1]", failed_line("grads [0.5, 0.5] vs [1.0] (tolerance: [red])"),
        terminal_table(["model [x]", "N"], [["[my]model", 2]]), verdict_line("FAIL"))
    out = capsys.readouterr().out
    assert "loss [bold]differs[/] at [rank 1]" in out
    assert "FAIL grads [0.5, 0.5] vs [1.0] (tolerance: [red])" in out
    assert "model [x]" in out and "[my]model" in out and "Verdict: FAIL" in out


def test_a_long_line_is_wrapped_at_the_width(capsys):
    say("word " * 60)
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= WIDTH


def test_sizes_and_counts_choose_their_unit_and_keep_three_digits():
    from zerolens.units import count, size
    assert [size(n) for n in (0, 512, 1536, 123_456_789, 1.5 * 2**30, 3 * 2**40, 2**50)] == [
        "0 B", "512 B", "1.50 KiB", "118 MiB", "1.50 GiB", "3.00 TiB", "1.00 PiB"]
    assert [count(n) for n in (12, 525_834, 999_960_000, 1.31e9, 7e12)] == ["12", "526K", "1.00B", "1.31B", "7.00T"]


def test_a_tables_unit_keeps_its_figures_short():
    from zerolens.report.tables import in_unit, unit_for
    from zerolens.units import DECIMAL_UNITS
    assert unit_for([3.7e18, 1e9])[1] == "PiB" and unit_for([5e12])[1] == "TiB"
    assert unit_for([300 * 2**20, None])[1] == "MiB" and unit_for([1000])[1] == "B" and unit_for([])[1] == "B"
    assert unit_for([1.6e16], DECIMAL_UNITS)[1] == "PB" and unit_for([4.2e6], DECIMAL_UNITS)[1] == "MB"
    assert in_unit(1422.81 * 2**20, 2**20, 2) == "1422.81" and in_unit(12345 * 2**20, 2**20, 1) == "12,345.0"


def test_a_wide_table_keeps_every_cell_on_one_line(capsys):
    header = ["strategy", "rank", "params", "grads", "optim", "buffers", "bucket", "kept", "peak", "needs", "paper",
              "paper MB", "DS est."]
    row = ["fsdp2-grad", 0, "1.00", "1.00", "2.01", "0.00", "0.00", "3.01", "72.00", "1398.81", "4.01", "4.21", "-"]
    say(terminal_table(header, [row, ["zero1", *row[1:]]], right=set(range(1, 13))))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and max(len(line) for line in lines) <= WIDTH, lines  # header, rule, two rows
    assert lines[2].split() == [str(c) for c in row]


def test_estimate_of_a_quadrillion_parameters_on_1024_ranks_fits_the_terminal(cli):
    result = cli("estimate", "--params", "1e15", "--nproc", "1024")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= WIDTH, lines
    assert "Per rank, PiB (1024-based)" in result.stdout and "paper PB" in result.stdout
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("ddp", "fsdp2-grad", "zero3")]
    assert [len(r) for r in rows] == [9, 9, 9], rows  # each strategy on one line, no figure split


def test_progress_off_a_terminal_says_the_step_now_and_then(capsys, monkeypatch):
    from zerolens.report import tables
    monkeypatch.setattr(tables, "PROGRESS_LINE_EVERY_S", 0.0)
    with tables.progress(3, "ddp") as bar:
        for step in range(3):
            bar.advance("ddp (timed)" if step else None)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["zerolens: ddp 1/3", "zerolens: ddp (timed) 2/3"]  # the last step is the strategy's done line


def test_every_commands_help_fits_the_terminal(cli):
    from zerolens.cli import VERBS
    for verb in ["", *(v.__name__.rsplit(".", 1)[1] for v in VERBS)]:
        result = cli(*([verb] if verb else []), "--help")
        assert result.returncode == 0 and max(len(line) for line in result.stdout.splitlines()) <= WIDTH, verb


def test_a_figure_too_small_for_its_tables_unit_is_not_shown_as_zero():
    """A small model's parameters beside a peak of GiB: "<0.01", where zero bytes stay "0.00"."""
    from zerolens.report.tables import in_unit
    assert in_unit(100, 2**20, 2) == "<0.01" and in_unit(0, 2**20, 2) == "0.00" and in_unit(6000, 2**20, 2) == "0.01"
