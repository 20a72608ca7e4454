"""The ready commands of docs/megatron-lm.md: ``scripts/pretrain_megatron_lm.sh`` trains (a few
iterations here), saves, and a mistake in its flags is one line with exit code 2."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "pretrain_megatron_lm.sh")

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")


def _script(run_dir, *flags):
    return subprocess.run(["bash", SCRIPT, *flags], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env={**os.environ, "RUN_DIR": str(run_dir)})


def test_pretrain_megatron_lm_script_trains_and_saves(tmp_path):
    result = _script(tmp_path, "--train-iters", "4", "--lr-warmup-iters", "1",
                     "--eval-interval", "4", "--eval-iters", "1",
                     "--log-interval", "1", "--save-interval", "4")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "iteration        4/       4" in result.stdout, result.stdout[-3000:]
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert (tmp_path / "train.log").read_text() == result.stdout


@pytest.mark.slow  # the entry's one-line error under torchrun: tests/functional/test_entry_errors.py
def test_pretrain_megatron_lm_script_reports_a_bad_flag_once(tmp_path):
    result = _script(tmp_path, "--no-such-flag")
    assert result.returncode == 2
    assert result.stdout.strip() == \
        "error: unrecognized arguments: --no-such-flag (--help lists the flags)"
