"""benchmarks/gpu_check.py on CPU with its tiny model: the one JSON line, the phases it runs and the ones it skips."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gpu_check  # noqa: E402

TINY = [
    "--model",
    "tiny",
    "--boards",
    "1",
    "--group-size",
    "2",
    "--max-new-tokens",
    "4",
    "--microbatches",
    "1",
    "--steps",
    "0",
]


def last_json_line(captured):
    return json.loads(captured.out.strip().splitlines()[-1])


def test_runs_the_rollout_and_prints_one_json_line(capsys):
    rc = gpu_check.main(TINY + ["--phases", "rollout"])
    res = last_json_line(capsys.readouterr())
    assert rc == 0
    assert res["check"] == "gpu_check" and res["model"] == "tiny" and res["backend"] == "cpu"
    roll = res["phases"]["rollout"]
    assert set(res["phases"]) == {"rollout"} and roll["status"] == "ran", res
    assert 0 < roll["generated_tokens"] <= 1 * 2 * 4 and roll["tokens_per_s"] > 0
    assert roll["plan_bytes"] > 0 and roll["compile_s"] > 0


def test_runs_every_phase_on_the_tiny_model(capsys):
    # slow tier (tests/conftest.py): three XLA compilations of the tiny model, ~50 CPU-s
    rc = gpu_check.main(TINY + ["--peak-tflops", "1"])
    res = last_json_line(capsys.readouterr())
    assert rc == 0
    assert [p["status"] for p in res["phases"].values()] == ["ran"] * 3, res
    full, lora = res["phases"]["train_full"], res["phases"]["train_lora"]
    fwd = gpu_check.forward_flops(gpu_check.model_config("tiny"), 2, 63 + 4)
    assert full["model_flops"] == 3 * fwd and lora["model_flops"] == 2 * fwd  # LoRA: no weight gradients
    for phase in (full, lora):
        assert phase["step_s"] > 0 and phase["plan_bytes"] > 0 and 0 < phase["mfu"] < 1
        assert phase["loss"] == phase["loss"] and phase["grad_norm"] > 0  # finite, and a gradient
    assert lora["base_bytes"] < res["param_bytes"]  # the int8 base
    assert lora["optimizer_state_bytes"] < full["optimizer_state_bytes"]  # the adapters' moments only


def test_skips_every_phase_that_cannot_fit_without_compiling_it(capsys):
    rc = gpu_check.main(TINY + ["--memory-limit-bytes", "1000"])
    captured = capsys.readouterr()
    res = last_json_line(captured)
    assert rc == 0
    assert [p["status"] for p in res["phases"].values()] == ["skipped"] * 3
    assert "compile_s" not in json.dumps(res)
    assert "the device has 1,000 bytes" in res["phases"]["train_full"]["reason"]
    assert "gpu_check: train_lora skipped: its weights and optimizer state alone are" in captured.err


def test_peak_table_and_published_plan_precheck():
    assert gpu_check.default_peak_flops("NVIDIA H200") == 989e12
    assert gpu_check.default_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_check.default_peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert gpu_check.default_peak_flops("cpu") is None
    # The known plans were made without a chunked head: the default (--logits-chunk 128) leaves it to the compile.
    assert not gpu_check.Check(gpu_check.parse_args(["--memory-limit-bytes", str(24 * 2**30)])).published_shape
    check = gpu_check.Check(gpu_check.parse_args(["--memory-limit-bytes", str(24 * 2**30), "--logits-chunk", "0"]))
    assert check.published_shape
    try:
        check.precheck("train_full", 0)
    except gpu_check.Skip as e:
        assert "92.4 GB" in str(e)
    else:
        raise AssertionError("the full fine-tune's plan exceeds 24 GB")
    check.precheck("rollout", 0)  # 16.9 GB fits
    ignoring = gpu_check.Check(
        gpu_check.parse_args(["--memory-limit-bytes", str(24 * 2**30), "--logits-chunk", "0", "--ignore-known-plans"])
    )
    ignoring.precheck("train_full", 0)  # left to the compiled plan
