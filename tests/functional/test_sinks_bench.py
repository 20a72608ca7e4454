"""benchmarks/bench_sinks.py end to end (its smoke preset): the gated and the ungated run start from
the same weights, each run's probe records become the figures over training, and the trained models
are evaluated at longer contexts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sinks_benchmark_measures_both_variants_from_identical_weights(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_sinks.py", "--preset", "smoke", "--seeds", "1",
         "--workers", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["identical_at_step0"] is True and result["step0_differences"] == []
    assert "logging.attention_probe=2" in result["launcher_overrides"]
    uniform = sum(1 / (i + 1) for i in range(32)) / 32  # H_32 / 32: seq 32
    assert result["uniform_share"] == pytest.approx(uniform)
    for variant in ("off", "on_default"):
        data = result["variants"][variant]
        assert data["probe_iterations"] == [0, 2, 4], data["probe_iterations"]
        # At the init (std 0.02) every score is near 0: attention is near uniform.
        assert data["first_token_share"][0] == pytest.approx(uniform, abs=1e-3)
        assert all(0 < x for x in data["max_activation"] + data["max_attn_output"])
        assert 4.0 < data["final_loss"] < 6.5  # byte-level text from ~ln 256
        lengths = data["long_context"]
        assert list(lengths) == ["1", "2"] and len(lengths["2"]["segments"]) == 2, lengths
        assert all(4.0 < d["loss"] < 6.5 for d in lengths.values()), lengths
    assert "final loss (last window)" in proc.stdout
