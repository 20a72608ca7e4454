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

    # --budget (a lent GPU's lease): a seed whose condition's earlier seeds took longer than the
    # time left is not started; the figures are over the seeds that finished, and say so.
    budget = list(argv)
    budget[budget.index("--seeds") + 1] = "2"
    budget += ["--reuse", "--budget", "0.5"]
    cut = tmp_path / "cut.json"
    proc = subprocess.run(budget + ["--json", str(cut)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    third = json.loads(cut.read_text())
    assert third["complete"] is False and len(third["left_out"]) == 1
    assert third["left_out"][0].startswith("fp32 seed 1235: not started")
    assert third["conditions"]["fp32"]["seeds"] == [1234]
    assert third["conditions"]["fp32"]["gaps"] == result["conditions"]["fp32"]["gaps"]
    assert result["complete"] is True and result["left_out"] == []

    # A run still going when the budget ends is stopped: nothing finished is an error, and the
    # JSON says what was left out rather than showing figures of a run cut short.
    # (Another seed in the same workdir: its data is prepared already.)
    proc = subprocess.run(argv + ["--seed-base", "99", "--budget", "2", "--json", str(cut)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "no run finished within --budget 2 s" in proc.stderr
    stopped = json.loads(cut.read_text())
    assert stopped["conditions"] == {} and stopped["complete"] is False
    assert stopped["left_out"] == ["fp32 seed 99: stopped at the budget (2 s)"]
