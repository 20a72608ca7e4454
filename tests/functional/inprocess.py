"""The YAML launcher's ``main`` run inside a test's gloo ranks (``run_distributed``): no torchrun
and no imports per run, so a tiny run costs seconds. Its output is captured per rank."""

import contextlib
import io
import json
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
# The tiny config made tinier: 64 hidden, 32 tokens, 4 samples per step, mock data, no evaluation;
# no metrics file unless a test names one (the config's runs/tiny_cpu/ is the README's run folder:
# a test's metrics and resolved config went there, into the checkout).
TINY_MOCK = [
    "--config", TINY, "model.hidden_size=64", "model.seq_length=32",
    "training.micro_batch_size=2", "training.global_batch_size=4",
    "training.eval_interval=null", "data.source=mock", "optimizer.lr_warmup_iters=0",
    "logging.log_interval=1", "logging.metrics_file=null",
]
MARK = "==> [checkpoint]"  # the launcher's line about where the run starts


def launch(*argv) -> dict:
    """``mcore_ext.training.main(argv)`` on this rank: {"code", "stdout", "stderr"}; an exception
    that escapes main (a traceback on every rank) is returned as its text in "code"."""
    from mcore_ext.training import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except BaseException:  # noqa: BLE001  (what the user would see as a traceback)
            code = "raised " + traceback.format_exc()
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def completed(result: dict) -> types.SimpleNamespace:
    """A rank's ``launch`` result as the fields of a finished torchrun (``returncode``,
    ``stdout``, ``stderr``), for tests that read either."""
    return types.SimpleNamespace(returncode=result["code"], stdout=result["stdout"],
                                 stderr=result["stderr"])


def start_lines(stdout: str) -> list[str]:
    """The launcher's lines about where the run starts."""
    return [line for line in stdout.splitlines() if line.startswith(MARK)]


def losses(path) -> dict[int, float]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if r["kind"] == "train"}
