"""Megatron-LM's own training loop (megatron.training.pretrain) with mcore_ext's gated model:
``torchrun -m mcore_ext.megatron_lm.pretrain_gpt`` on 2 CPU ranks at TP 2, mock data.

    full     5 iterations, checkpoints at 2 and 4 (and the final one at 5)
    resumed  loads full's iteration-2 checkpoint (--ckpt-step 2) and trains 3..5

The resumed run must reproduce the uninterrupted one: the same losses and, at iteration 5, the
same weights and Adam moments bit for bit (read back from both torch_dist checkpoints with torch's
own DCP reader). Each run says once (rank 0's line of the two ranks' output) that GPTModel is
deprecated and how to build HybridModel; megatron's own per-model notice stays filtered.
Megatron prints the first iteration of every run without resetting its loss average, so its
second printed loss is the mean of two iterations: the test compares the iterations printed
alone (3 and 5 in both runs).

Dropout is 0: on a CPU the "CUDA" RNG of dropout is the CPU generator, which torch's DataLoader
also draws its worker seed from when megatron builds the loaders, after a resume but before the
first step of an uninterrupted run; with dropout the streams then differ (on a GPU they do not).
"""

import contextlib
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.functional.test_pretrain import check, torchrun

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")

TIMEOUT_S = 600
MEGATRON_LM = ("-m", "mcore_ext.megatron_lm.pretrain_gpt")
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--position-embedding-type", "rope", "--no-rope-fusion", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--head-wise-attn-gate", "--mcore-ext-backend", "sdpa",
]
TRAINING = [
    "--tensor-model-parallel-size", "2", "--train-iters", "5", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "256", "--log-interval", "1", "--eval-iters", "0",
    "--eval-interval", "1000", "--ckpt-format", "torch_dist", "--save-interval", "2",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def pretrain_gpt(*flags) -> subprocess.CompletedProcess:
    return check(torchrun(*MODEL, *TRAINING, *flags, program=MEGATRON_LM, timeout=TIMEOUT_S),
                 "pretrain_gpt")


def losses(result) -> dict[int, str]:
    return {int(step): loss for step, loss in LOSS.findall(result.stdout)}


def checkpoint_tensors(directory) -> dict:
    """Every tensor of a torch_dist checkpoint, through torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = Path(directory).with_suffix(".pt")
    dcp_to_torch_save(directory, target)
    state = torch.load(target, weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_lm")
    full = pretrain_gpt("--save", str(tmp / "full"))
    resumed = pretrain_gpt(
        "--load", str(tmp / "full"), "--ckpt-step", "2", "--save", str(tmp / "resumed")
    )
    return tmp, full, resumed


def check_resumed_from_iteration_2(tmp, full, resumed):
    """5 iterations saved at 2 and resumed there: the loss falls, the resume loads iteration 2
    of ``tmp / 'full'`` and logs the uninterrupted run's losses at 3 and 5 (the iterations printed
    alone: see this module's docstring)."""
    full_losses, resumed_losses = losses(full), losses(resumed)
    assert sorted(full_losses) == [1, 2, 3, 4, 5] and sorted(resumed_losses) == [3, 4, 5]
    assert float(full_losses[5]) < float(full_losses[1])
    assert f"loading distributed checkpoint from {tmp / 'full'} at iteration 2" in resumed.stdout
    assert resumed_losses[3] == full_losses[3] and resumed_losses[5] == full_losses[5]


def test_trains_saves_and_resumes_exactly(runs):
    tmp, full, resumed = runs
    check_resumed_from_iteration_2(tmp, full, resumed)
    notice = re.compile(r"^mcore_ext: GPTModel is deprecated in megatron-core \S+ \(critical "
                        r"fixes only\); --hybrid-layer-pattern .* builds its successor, "
                        r"HybridModel$", re.MULTILINE)
    for run in (full, resumed):
        output = run.stdout + run.stderr
        assert len(notice.findall(output)) == 1 and output.count("GPTModel is deprecated") == 1
        assert "GPTModel IS DEPRECATED" not in output  # megatron's, per model built

    saved = sorted(p.name for p in (tmp / "full").iterdir())
    assert saved == ["iter_0000002", "iter_0000004", "iter_0000005",
                     "latest_checkpointed_iteration.txt"]
    a = checkpoint_tensors(tmp / "full" / "iter_0000005")
    b = checkpoint_tensors(tmp / "resumed" / "iter_0000005")
    assert a.keys() == b.keys()
    assert any("linear_qkv.weight._gate" in key for key in a)  # the gate, upstream's keys
    assert any("exp_avg_sq" in key for key in a)  # Adam's moments
    assert [key for key in a if not torch.equal(a[key], b[key])] == []


# A Megatron-LM start signalled while its workers import: -m slow (one torchrun, 1 iteration;
# the launcher's start-up points run by default in test_faults.py, the same agent and handler).
@pytest.mark.slow
def test_a_stop_signal_while_the_workers_import_saves_after_the_first_iteration(tmp_path):
    """SIGUSR1 to python -m mcore_ext.torchrun 1 s after its Megatron-LM workers started: they
    held it while importing, recorded it in main, handed it to megatron's --exit-signal-handler as
    SIGTERM once megatron installed it; megatron trains iteration 1, saves it and exits 0 with its
    line (before: the agent died of SIGUSR1, exit -10, its workers left running unsaved)."""
    import os
    import signal
    import sys
    import time
    import uuid

    from tests.functional.test_pretrain import ROOT, _free_port

    marker = f"MCORE_EXT_TEST_RUN=megatron-lm-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "mcore_ext.torchrun", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", *MEGATRON_LM, *MODEL,
               *TRAINING, "--save", str(tmp_path / "ckpt"), "--exit-signal-handler"]
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        agent = subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr,
                                 env={**os.environ, "OMP_NUM_THREADS": "1",
                                      marker.split("=")[0]: marker.split("=")[1]})

    def ours():  # every process of this run (torchrun passes the marker on to its workers)
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append((int(pid), Path(f"/proc/{pid}/cmdline").read_bytes()))
            except OSError:
                continue
        return found

    try:
        deadline = time.monotonic() + TIMEOUT_S
        while sum(b"megatron_lm.pretrain_gpt" in cmd and pid != agent.pid
                  for pid, cmd in ours()) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1)
        agent.send_signal(signal.SIGUSR1)
        agent.wait(TIMEOUT_S)
    finally:
        for pid, _ in ours():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    result = out.read_text()
    assert agent.returncode == 0, (result[-3000:], err.read_text()[-3000:])
    assert "exiting program after receiving SIGTERM." in result
    assert sorted(int(step) for step, _ in LOSS.findall(result)) == [1]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
