"""What the plots show: curves that coincide stay visible and say so; the memory plot puts what is
held and what is alive at the peak on scales of their own, with the reduce bucket drawn on the CPU."""
import json
from pathlib import Path

import pytest

from zerolens.report import plots

SUMMARY = Path(__file__).parent / "fixtures" / "summary_cpu.json"


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots make, kept instead of closed (each still written to its file)."""
    made = []
    save = plots._save

    def keep(fig, path):
        made.append(fig)
        return save(fig, path)
    monkeypatch.setattr(plots, "_save", keep)
    return made


def test_identical_curves_stay_visible_and_say_so(tmp_path, figures):
    losses = {"zero2": [3.0, 2.5, 2.0], "zero0": [3.0, 2.5, 2.0], "ddp": [3.0, 2.4, 2.1]}
    plots.loss_plot(losses, tmp_path / "loss.png", "loss")
    ax = figures[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["zero2", "zero0 (identical to zero2)", "ddp"]
    lines = ax.get_lines()
    assert len({line.get_linestyle() for line in lines}) == 3 and len({line.get_marker() for line in lines}) == 3
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_memory_plot_gives_the_peak_its_own_scale_and_draws_the_cpu_bucket(tmp_path, figures):
    summary = json.loads(SUMMARY.read_text())
    bucket = 2 * 50_000_000
    plots.memory_plot(summary, tmp_path / "memory.png", {"ddp": 0, "zero2": bucket})
    held, peak, share = figures[0].axes
    assert held.get_ylim()[1] < peak.get_ylim()[1] / 5  # the held bytes are not slivers beside the peak
    labels = [t.get_text() for t in peak.get_legend().get_texts()]
    assert labels == ["everything else (tensor tracker's total)", "of which the reduce bucket (every backward)"]
    zero2 = summary["strategies"]["zero2"]["ranks"][0]
    tops = sorted(p.get_y() + p.get_height() for p in peak.patches)
    assert tops[-1] == pytest.approx(zero2["peak_bytes"] / 2**20)  # the bucket stacked within the peak
    buckets = [p for p in peak.patches if p.get_hatch()]
    assert [round(p.get_height() * 2**20) for p in buckets] == [0, 0, bucket, bucket]
