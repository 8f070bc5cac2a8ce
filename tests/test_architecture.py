"""The house's layout: each subpackage of zerolens imports only from its own layer and the layers below,
so no import runs back up the pipeline. Every import counts, those inside functions too; only those
under `if TYPE_CHECKING:` are left out, as they never run."""
import ast
from pathlib import Path

import pytest

import zerolens

PACKAGE = Path(zerolens.__file__).parent
# Top first: commands -> integrations -> tracking -> run -> report -> predict -> strategies -> measure -> models -> foundation.
LAYERS = [
    ("entry points", {"zerolens", "zerolens.__main__", "zerolens.cli", "zerolens.worker"}),
    ("commands", {"zerolens.commands"}),
    ("integrations", {"zerolens.integrations"}),
    ("tracking", {"zerolens.tracking"}),
    ("run", {"zerolens.run"}),
    ("report", {"zerolens.report"}),
    ("predict", {"zerolens.predict"}),
    ("strategies", {"zerolens.strategies"}),
    ("measure", {"zerolens.measure"}),
    ("models", {"zerolens.models"}),
    ("foundation", {"zerolens.errors", "zerolens.compat", "zerolens.units", "zerolens._version"}),
]


def layer_of(module: str) -> int:
    """The layer of a zerolens module: its own name's, else its nearest package's."""
    name = module
    while True:
        for i, (_, members) in enumerate(LAYERS):
            if name in members:
                return i
        if "." not in name:
            raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: place it")
        name = name.rsplit(".", 1)[0]


def zerolens_imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of each import of zerolens in `source`, the code of `module`; relative imports
    resolved. `from zerolens.x import y` counts as x: y is x's or lies inside it."""
    tree = ast.parse(source)
    type_only = {inner for node in ast.walk(tree)
                 if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
                 for inner in ast.walk(node)}
    package = module if is_package else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if node in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "zerolens"]
        elif isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".")
            found.append((node.lineno, ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]).strip(".")))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zerolens":
            found.append((node.lineno, node.module))
    return found


def imports_up(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = layer_of(module)
    return [f"line {line}: {imported} ({LAYERS[layer_of(imported)][0]}, above {LAYERS[mine][0]})"
            for line, imported in zerolens_imports(source, module, is_package) if layer_of(imported) < mine]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_back_up_the_pipeline(path):
    upward = imports_up(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not upward, f"{module_name(path)} imports upward:\n" + "\n".join(upward)


def test_the_check_finds_an_import_back_up_and_lets_a_type_only_one_be():
    assert imports_up("from zerolens.run.config import RunConfig\n", "zerolens.strategies.base") == [
        "line 1: zerolens.run.config (run, above strategies)"]
    assert imports_up("def f():\n    from ..report import tables\n", "zerolens.measure.probe") == [
        "line 2: zerolens.report (report, above measure)"]
    assert imports_up("import zerolens.cli\n", "zerolens.models.data") == ["line 1: zerolens.cli (entry points, above models)"]
    assert imports_up("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerolens.run.config import RunConfig\n"
                      "from zerolens.measure.census import Holdings\nfrom . import registry\n",
                      "zerolens.strategies.base") == []


def test_each_subpackage_says_what_it_owns_and_what_it_may_import():
    for package in (p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert "import" in doc and len(doc.splitlines()) <= 4, \
            f"{package.name}/__init__.py: say in a few lines what it owns and what it may import"


def test_the_public_functions_are_importable_from_zerolens():
    import subprocess
    import sys

    from zerolens import estimate, predict_peaks, predict_retained, track
    from zerolens.commands.estimate import estimate as estimate_in_its_module
    assert estimate is estimate_in_its_module and callable(predict_peaks) and callable(predict_retained)
    assert callable(track)
    result = estimate(strategies=("zero2",), world_size=4, precision="fp16", reduce_bucket_size=50_000_000,
                      params=1e9)
    assert result["strategies"]["zero2"]["deepspeed_estimator_bytes"] == 2e9 + 18e9 / 4
    # `import zerolens` alone loads none of them, nor torch.
    loaded = subprocess.run([sys.executable, "-c", "import sys, zerolens; print('torch' in sys.modules)"],
                            capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stderr
