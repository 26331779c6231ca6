"""The Lightning and HF Trainer examples on CUDA with AMP (fp16 autocast and the framework's
GradScaler): the same data-stall finding as on CPU, and the framework's precision and scaler
seen. Run on a GPU machine: `python -m pytest -m gpu tests/test_integrations_gpu.py`."""

from __future__ import annotations

import pytest

from tests.test_integrations import events, report, run_example

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["lightning_job.py", "hf_trainer.py"])
def test_the_framework_examples_with_amp_on_cuda_give_the_same_finding(tmp_path, name):
    run_dir = tmp_path / "run"
    run_example(name, "--steps", "150", "--gpu", "--run-dir", str(run_dir))
    found = report(run_dir)["findings"]
    assert found[0]["rule"] == "data-stall"
    logged = events(run_dir)
    framework = next(e for e in logged if e["event"] == "framework")
    if name == "lightning_job.py":
        assert framework["precision"] == "16-mixed" and framework["grad_scaler"] is True
    else:
        assert framework["fp16"] is True
    config = [e for e in logged if e["event"] == "config"][-1]
    assert "float16" in str(config["autocast"]["cuda"])  # seen inside the model's forward
    end = next(e for e in logged if e["event"] == "end")
    assert end["scaler"]["present"] and end["scaler"]["steps"] > 0
