"""--model module:factory with --batch module:function: a user's nn.Module through verify and bench,
measured and predicted like a preset; mistakes end in one line, exit 2, no run folder."""
import json

import pytest

from conftest import REPO, zerolens

USER = ["--model", "zerolens_test_models:tiny_classifier", "--batch", "zerolens_test_models:tiny_batch"]
ENV = {"PYTHONPATH": str(REPO / "tests")}  # the workers import the user's module too


def test_verify_a_user_model(tmp_path):
    out = tmp_path / "run"
    result = zerolens("verify", *USER, "--strategies", "ddp,zero2,fsdp2-grad", "--steps", "30", "--lr", "1e-2",
                      "--out", str(out), timeout=300, env=ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS"
    assert any(c["name"].startswith("retained memory as predicted (fsdp2-grad") for c in summary["checks"])
    assert json.loads((out / "config.json").read_text())["preset"] == "zerolens_test_models:tiny_classifier"


def test_bench_a_user_model(tmp_path):
    out = tmp_path / "bench"
    result = zerolens("bench", *USER, "--warmup", "1", "--steps", "2", "--out", str(out), timeout=300, env=ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    bench = json.loads((out / "bench.json").read_text())
    assert bench["flops_per_token"] is None and bench["tokens_per_step"] == 16 * 6
    assert all(s["mfu"] is None and s["tflops_per_gpu"] is None for s in bench["strategies"].values())


@pytest.mark.parametrize("args, message", [
    (["--model", "zerolens_test_models:tiny_classifier"], "--model needs --batch"),
    (["--model", "no_such_module:build", "--batch", "zerolens_test_models:tiny_batch"], "cannot load no_such_module:build"),
    (["--model", "zerolens_test_models:tiny_batch", "--batch", "zerolens_test_models:tiny_batch"], "--model/--batch:"),
    (["--model", "zerolens_test_models:tiny_classifier", "--batch", "zerolens_test_models:wrong_batch"],
     "returned 3 inputs and 3 targets for batch_size 2"),
    (USER + ["--depth", "3"], "change a preset, not a --model"),
])
def test_user_model_mistakes(tmp_path, args, message):
    result = zerolens("verify", *args, "--out", str(tmp_path / "run"), timeout=60, env=ENV)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
