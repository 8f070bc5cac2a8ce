"""The documentation site builds without a warning (broken links, missing pages), and the files it
describes stay within bounds."""
import subprocess
import sys

from conftest import REPO


def test_the_docs_build_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_starts_with_the_two_setup_commands_and_stays_short():
    lines = (REPO / "README.md").read_text().splitlines()
    head = "\n".join(lines[:15])
    assert "pip install -e . && zerolens verify" in head and "python3 -m pytest" in head
    assert len(lines) <= 180


def test_results_stay_small():
    size = sum(p.stat().st_size for p in (REPO / "docs" / "results").rglob("*") if p.is_file())
    assert size < 3 * 2**20, f"docs/results holds {size / 2**20:.1f} MiB"
