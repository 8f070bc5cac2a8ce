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
