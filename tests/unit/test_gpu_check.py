"""benchmarks/gpu_check.py without a GPU: the dry run writes the results JSON with every GPU step
skipped and its reason; the figures readers and the merge work on their inputs' formats."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_dry_run_writes_every_step_skipped_with_its_reason(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "dry-run",
                             "--results", str(tmp_path)], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("*-cpu.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["environment"]["1"]["megatron_core"]
    assert [s["name"] for s in report["steps"]] == [s.name for s in gpu_check.STEPS]
    for step in report["steps"]:
        assert step["status"] == "skipped" and step["reason"], step
        assert step["command"]
    tests = report["steps"][0]["figures"]["tests"]
    # the suite's GPU tests were collected, each skipped by the suite itself with its reason
    for name in ("tests.unit.test_gated_attention::test_gated_layer_on_cuda_matches_fp32_"
                 "reference[sdpa-bf16]",
                 "tests.functional.test_gpu_launcher::test_async_save_survives_a_kill_and_resumes"):
        assert tests[name]["status"] == "skipped" and "CUDA" in tests[name]["reason"], tests
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": len(gpu_check.STEPS)}


def test_missing_benchmark_or_option_is_a_skip_not_a_crash():
    far = float("inf")
    absent = gpu_check.Step("x", 2, "", ["{py}", "benchmarks/bench_nothing.py"], 10,
                            script="benchmarks/bench_nothing.py")
    assert "does not exist" in gpu_check._skip_reason(absent, 1, far, {})
    option = gpu_check.Step("y", 2, "", ["{py}", "benchmarks/bench_cp.py", "--not-an-option"], 10,
                            script="benchmarks/bench_cp.py")
    cache = {"benchmarks/bench_cp.py": {"--seq", "--json"}}  # what --help listed
    assert gpu_check._skip_reason(option, 1, far, cache) == \
        "benchmarks/bench_cp.py has no --not-an-option option in this tree (yet)"
    four = gpu_check.Step("z", 2, "", ["{py}"], 10, min_gpus=4)
    assert "needs 4 GPUs" in gpu_check._skip_reason(four, 1, far, {})
    assert "time budget" in gpu_check._skip_reason(four, 4, 0.0, {})


def test_a_step_writes_into_out_within_what_is_left_of_its_time(tmp_path):
    # {out} is the folder that comes back from the device (a PNG written to the temporary {work}
    # is lost); {budget} is the step's time left less 20 s for its JSON.
    script = "import json, sys; open(sys.argv[1] + '/seen.json', 'w').write(json.dumps(sys.argv))"
    step = gpu_check.Step("t", 4, "", ["{py}", "-c", script, "{out}", "{budget}"], 100,
                          needs_cuda=False)
    (tmp_path / "work").mkdir()
    (tmp_path / "out").mkdir()
    with open(tmp_path / "log.txt", "w") as log:
        result = gpu_check._run_step(step, str(tmp_path / "work"), time.monotonic() + 50, log,
                                     out=str(tmp_path / "out"))
    assert result["status"] == "passed", result
    seen = json.loads((tmp_path / "out" / "seen.json").read_text())
    assert seen[1] == str(tmp_path / "out") and 25 <= int(seen[2]) <= 30


def test_launcher_metrics_leave_out_the_first_step(tmp_path):
    records = [dict(kind="train", iteration=1, loss=5.0, step_time_s=9.0, tokens_per_s=1.0,
                    tflops_per_device=1.0, mfu=0.01, peak_memory_gb=3.0)]
    records += [dict(kind="train", iteration=i, loss=4.0, step_time_s=t, tokens_per_s=100.0 / t,
                     tflops_per_device=400.0 / t, mfu=0.4 / t, peak_memory_gb=3.5)
                for i, t in ((2, 1.0), (3, 1.2), (4, 1.1))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = gpu_check._metrics(str(path))
    assert figures["steps"] == 3 and figures["step_time_s"] == 1.1
    assert figures["mfu"] == pytest.approx(0.4 / 1.1) and figures["peak_memory_gb"] == 3.5
    assert figures["losses"] == [5.0, 4.0, 4.0, 4.0]  # every step's, the first included


def test_tests_cut_short_are_read_from_pytest_lines():
    output = ("tests/unit/test_a.py::test_one[sdpa-bf16] PASSED     [ 50%]\n"
              "tests/unit/test_a.py::test_two FAILED                [100%]\n")
    figures = gpu_check._pytest_lines(output)
    assert figures["counts"] == {"passed": 1, "failed": 1} and figures["cut_short"]
    assert figures["tests"]["tests/unit/test_a.py::test_one[sdpa-bf16]"]["status"] == "passed"


def test_collect_replaces_the_steps_collected_again_and_keeps_the_others(tmp_path):
    def stage(number, status, names=None, commit="aaaaaaa"):
        return dict(stage=number, date="2026-01-02", device="NVIDIA H100 80GB HBM3", torch="2.11",
                    commit=commit,
                    steps=[dict(name=s.name, stage=number, status=status)
                           for s in gpu_check.STEPS
                           if s.stage == number and (names is None or s.name in names)])

    for number in (1, 2):
        (tmp_path / f"gpu_check-stage{number}.json").write_text(json.dumps(stage(number, "failed")))
    gpu_check.collect([str(tmp_path)], str(tmp_path / "results"))
    again = tmp_path / "again"
    again.mkdir()
    # A later call runs two of stage 2's steps only, at another commit.
    (again / "gpu_check-stage2.json").write_text(
        json.dumps(stage(2, "passed", {"gate-cost", "attention-32k-packed-sdpa"})))
    path = gpu_check.collect([str(again)], str(tmp_path / "results"), commit="bbbbbbb")
    assert path.endswith("2026-01-02-nvidia-h100-80gb-hbm3.json")
    merged = json.loads(Path(path).read_text())
    steps = {s["name"]: s for s in merged["steps"]}
    assert len(steps) == sum(s.stage in (1, 2) for s in gpu_check.STEPS)
    for s in gpu_check.STEPS:
        if s.stage in (1, 2):
            rerun = s.name in ("gate-cost", "attention-32k-packed-sdpa")
            assert steps[s.name]["status"] == ("passed" if rerun else "failed"), s.name
            assert steps[s.name]["commit"] == ("bbbbbbb" if rerun else "aaaaaaa"), s.name


def test_stages_fit_the_device_calls():
    """Each stage's steps fit one 10-minute call; the device calls name the carried wheels."""
    for number in gpu_check.STAGES:
        assert gpu_check.STAGE_BUDGET_S <= 570
        assert any(s.stage == number for s in gpu_check.STEPS)
    calls = gpu_check.device_calls()
    assert calls.count('carry=[".gpu_wheels"]') == len(gpu_check.STAGES)
    assert ".gpu_wheels" in (ROOT / ".gitignore").read_text()  # carried paths must be ignored


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip of a machine without CUDA")
def test_gpu_skip_follows_the_marker_not_a_folder_named_gpu(tmp_path):
    """tests/conftest.py skips tests marked gpu; a checkout in a folder named gpu (pytest's
    keywords hold folder names) once had every test skipped."""
    folder = tmp_path / "gpu"
    folder.mkdir()
    (folder / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems"
                                        "  # noqa: F401\n")
    (folder / "test_x.py").write_text("import pytest\n\ndef test_plain():\n    pass\n\n"
                                      "@pytest.mark.gpu\ndef test_marked():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-o", "markers=gpu", "-rs", str(folder)], capture_output=True,
                            text=True, cwd=folder, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert "1 passed, 1 skipped" in result.stdout, result.stdout[-2000:]


def test_launcher_steps_are_configs_the_launcher_accepts():
    """Each training step's overrides pass the launcher's validation (its 15 / 30 steps once
    stopped at the configs' 100 warm-up iterations, on an H200, before any step ran)."""
    from mcore_ext.training.config import load_config

    steps = [s for s in gpu_check.STEPS if "launch/pretrain.py" in s.command]
    assert steps
    for step in steps:
        args = step.command[step.command.index("launch/pretrain.py") + 1:]
        config = args[args.index("--config") + 1]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        overrides = [a.replace("{work}", "/tmp") for a in overrides]
        cfg = load_config(str(ROOT / config), overrides, world_size=1)
        assert cfg.optimizer.lr_warmup_iters < cfg.training.train_iters, step.name


def test_stage_runs_only_the_steps_asked_for(tmp_path):
    report = gpu_check.run_stage(2, str(tmp_path), budget_s=60, only=["gate-cost"])
    assert [s["name"] for s in report["steps"]] == ["gate-cost"]
    with pytest.raises(SystemExit, match="stage 2 has no step train-1b-gate-on"):
        gpu_check.run_stage(2, str(tmp_path), only=["train-1b-gate-on"])
