"""benchmarks/bench_convergence.py end to end (its smoke preset): the launcher's runs start from
the same weights with and without the gate, and the gate held open is the ungated run."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_convergence_benchmark_runs_variants_from_identical_weights(tmp_path):
    out = tmp_path / "result.json"
    argv = [sys.executable, "benchmarks/bench_convergence.py", "--preset", "smoke", "--seeds", "1",
            "--variants", "off,open,on_reference", "--workers", "1", "--workdir",
            str(tmp_path / "w")]
    proc = subprocess.run(argv + ["--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["reused"] == []
    # Checked on the models the launcher built, every weight the variants share.
    assert result["identical_at_step0"] is True and result["step0_differences"] == []
    variants = result["variants"]
    assert set(variants) == {"off", "open", "on_reference"}
    steps = 6
    for data in variants.values():
        assert len(data["windows"]) == steps // result["window"]
        assert all(4.0 < loss < 6.5 for loss in data["windows"])  # byte-level text from ~ln 256
    # Held open (sigmoid(30) = 1 in fp32, gradient 0) it computes the ungated function: the same
    # losses up to the GEMMs' summation order over the extra rows (1e-4 on losses of ~5.8).
    assert max(abs(g) for g in result["conditions"]["fp32"]["gaps"]["open"]["mean"]) < 1e-4
    # The reference init (sigmoid ~ 0.5) is another function: its losses differ from step 1.
    assert abs(result["conditions"]["fp32"]["gaps"]["on_reference"]["mean"][0]) > 1e-4

    # --reuse: the same jobs in the same workdir are read back, not run again (no launcher log),
    # and summarised to the same figures.
    again = tmp_path / "again.json"
    proc = subprocess.run(argv + ["--reuse", "--json", str(again)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[bench] reused from" in proc.stdout and "[bench] fp32 seed" not in proc.stdout
    second = json.loads(again.read_text())
    assert second["reused"] == ["fp32 seed 1234"]
    assert second["conditions"] == result["conditions"]
