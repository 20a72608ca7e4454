"""benchmarks/bench_convergence.py end to end (its smoke preset): the launcher's runs start from
the same weights with and without the gate, and the gate held open is the ungated run."""

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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


def _bench():
    spec = importlib.util.spec_from_file_location("bench_convergence",
                                                  ROOT / "benchmarks" / "bench_convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leftovers(tmp):
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("bench_convergence-"))


def test_temporary_workdir_is_removed_at_exit_error_and_interrupt(tmp_path, monkeypatch):
    """Without --workdir the benchmark's work folder (prepared data, metrics, logs) goes at exit:
    a normal return, an error, and a KeyboardInterrupt while a run is going (killed first)."""
    bench = _bench()
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def prepared(prefix):  # the stdlib dataset, stood in for: no run reads it here
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        Path(prefix + ".idx").touch()

    monkeypatch.setattr(bench, "_prepare_data", prepared)
    argv = ["--preset", "smoke", "--seeds", "1", "--variants", "off", "--workers", "1"]

    # A normal return (the budget spent before any run: exit 1, nothing started).
    assert bench.main(argv + ["--budget", "0"]) == 1
    assert _leftovers(temp) == []

    # An error before any run.
    def broken(prefix):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(bench, "_prepare_data", broken)
        with pytest.raises(OSError, match="disk full"):
            bench.main(argv)
    assert _leftovers(temp) == []

    # Ctrl-C while a run is going: the run is ended before its folder is removed.
    started, real_popen = [], subprocess.Popen

    def popen(args, **kwargs):
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                stdout=kwargs.get("stdout"), stderr=kwargs.get("stderr"))
        started.append(proc)
        return proc

    def interrupt(_seconds):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(bench.subprocess, "Popen", popen)
        m.setattr(bench.time, "sleep", interrupt)
        with pytest.raises(KeyboardInterrupt):
            bench.main(argv)
    assert len(started) == 1 and started[0].poll() is not None  # ended, not left running
    assert _leftovers(temp) == []

    # A folder the user names is theirs: kept.
    mine = tmp_path / "mine"
    assert bench.main(argv + ["--budget", "0", "--workdir", str(mine)]) == 1
    assert (mine / "data" / "stdlib_byte.idx").is_file()


class _Axes:
    """Records what plot() writes on a matplotlib Axes (matplotlib is no test dependency)."""

    def __init__(self, titles):
        self.titles = titles

    def set_title(self, text):
        self.titles.append(text)

    def __getattr__(self, name):  # plot, fill_between, legend, ...: drawn, not read
        return lambda *args, **kwargs: None


def _stub_matplotlib(monkeypatch, titles):
    import types

    pyplot = types.ModuleType("matplotlib.pyplot")
    figure = types.SimpleNamespace(suptitle=titles.append, tight_layout=lambda: None,
                                   savefig=lambda *a, **k: None)

    def subplots(rows, cols, **kwargs):
        return figure, [[_Axes(titles) for _ in range(cols)] for _ in range(rows)]

    pyplot.subplots = subplots
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda *a, **k: None
    matplotlib.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)


def test_plot_titles_state_the_seeds_that_finished(monkeypatch, tmp_path):
    """A --budget run that finished 1 seed of 3 (the H200's stage 4): the PNG's titles say 1 of
    3 (seed 1234), not 3; with every seed finished they name them all."""
    bench = _bench()
    titles = []
    _stub_matplotlib(monkeypatch, titles)
    curve = {"windows": [5.0, 4.0], "per_seed": [[5.0, 4.0]], "final_loss": 4.0}
    gap = {"mean": [0.1, 0.0], "std": [0.0, 0.0], "min": [0.1, 0.0], "max": [0.1, 0.0]}
    summary = {"variants": {"off": curve, "on_default": dict(curve)},
               "gaps": {"on_default": gap}, "seeds": [1234]}
    result = {"preset": "gpu", "seeds": 3, "window": 5, "identical_at_step0": True,
              "environment": {"device": "NVIDIA H200"}, "conditions": {"1b-15": summary}}
    bench.plot(result, str(tmp_path / "out.png"))
    top, bottom = titles[:2]
    assert "3 seeds" not in top.replace("1 of 3 seeds", "") and "1 of 3 seeds (1234)" in top
    assert "1 of 3 seeds" in bottom

    titles.clear()
    summary["seeds"] = [1234, 1235, 1236]
    for data in summary["variants"].values():
        data["per_seed"] = [[5.0, 4.0]] * 3
    bench.plot(result, str(tmp_path / "out.png"))
    assert "over 3 seeds (1234, 1235, 1236)" in titles[0] and " of 3" not in titles[0]
    # A JSON from before the summary kept its seeds (--plot-from): the curves are counted.
    titles.clear()
    del summary["seeds"]
    bench.plot(result, str(tmp_path / "out.png"))
    assert "over 3 seeds" in titles[0]
