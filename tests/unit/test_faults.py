"""Fault handling without torchrun: the async writer's Manager dies with the process that
started it, duplicate preemption signals, and the clean-up after a save killed half way."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RANK = """
import os, signal
from megatron.core.dist_checkpointing.strategies import filesystem_async
from mcore_ext.training import faults

faults.install_checkpoint_writer_queue(async_save=True)
queue = filesystem_async._results_queue  # what megatron's writer will use
queue.put("written")
assert queue.get() == "written"
print(faults._writer_manager._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as an operator's kill -9 of a rank
"""


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_async_writer_manager_dies_with_its_rank():
    result = subprocess.run(
        [sys.executable, "-c", _RANK], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == -9, result.stderr[-3000:]
    manager = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(manager)
    if alive:  # megatron's own Manager() would stay: clean up, then fail
        os.kill(manager, 9)
    assert not alive, "the writer's Manager outlived its rank"


_SIGNALS = """
import os, signal, time
# Held, as python -m mcore_ext.torchrun starts the launcher's workers: from the first line, so
# that every thread the imports start holds it too (a thread that did not would take it).
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
from mcore_ext.training.faults import ExitSignalHandler

# As an interactive process starts: a shell's background job (a CI script started with &)
# inherits SIGINT ignored, and the handler rightly restores what it found.
signal.signal(signal.SIGINT, signal.default_int_handler)
# A window far wider than the real one: on a loaded machine the two handlers below may run
# seconds apart, and this checks the rule, not the machine's speed.
ExitSignalHandler.REPEAT_WINDOW_S = 600.0
# A SIGUSR1 that comes while the worker imports is pending, and recorded when the handler is
# entered (before: it ended the worker).
os.kill(os.getpid(), signal.SIGUSR1)
with ExitSignalHandler() as held:
    print("held", held.received, flush=True)
# release() (a run without exit_on_signal): a recorded signal goes to the previous handler.
caught = []
signal.signal(signal.SIGUSR2, lambda signum, frame: caught.append(signum))
with ExitSignalHandler() as handler:
    os.kill(os.getpid(), signal.SIGUSR2)
    handler.release()
print("released", caught, flush=True)
# hand_over (the Megatron-LM entry): megatron's handler, installed over this one for its
# --exit-signal (SIGTERM), gets a signal recorded before as SIGTERM, and any later stop signal.
megatron = []
with ExitSignalHandler() as handler:
    os.kill(os.getpid(), signal.SIGUSR2)
    signal.signal(signal.SIGTERM, lambda signum, frame: megatron.append(signum))
    handler.hand_over(signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
print("handed over", megatron, flush=True)
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
with ExitSignalHandler() as handler:
    # SLURM's SIGTERM and torchrun's forwarded copy, milliseconds apart: one request.
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    print("alive", handler.received, flush=True)
    # An operator's second signal after the window ends the process at once.
    handler._received_at -= ExitSignalHandler.REPEAT_WINDOW_S
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still alive", flush=True)
"""


def test_held_signals_are_recorded_and_a_repeated_signal_within_the_window_is_one_request():
    result = subprocess.run(
        [sys.executable, "-c", _SIGNALS], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    lines = result.stdout.split("\n")
    assert lines[:4] == ["held 10", "released [12]", "handed over [15, 15]", "alive 15"], (
        result.stdout, result.stderr[-2000:])
    assert "still alive" not in result.stdout
    assert result.returncode == -2, result.stderr[-2000:]  # SIGINT's default action


def _ready():
    return True


def _prepare_stdlib_data_with_rank_1_late(prefix, late_s):
    """Every rank: ``prepare_tokenizer_and_data`` on a fresh data.prefix while rank 1 starts
    ``late_s`` late (the ``start`` fault point), from three small stdlib files (rank 0's build
    then ends well before rank 1 looks); then the optimizer's first collective
    (``all_gather_object``). Returns what each rank sees on disk after it."""
    import torch.distributed as dist

    from mcore_ext.training import data
    from mcore_ext.training.config import load_config

    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [f"data.prefix={prefix}"],
                      world_size=2)
    sources = data.stdlib_sources
    data.stdlib_sources = lambda: sources()[:3]
    os.environ["MCORE_EXT_DELAY_AT"] = f"start,{late_s},1"
    try:
        tokenizer = data.prepare_tokenizer_and_data(cfg)
    finally:
        del os.environ["MCORE_EXT_DELAY_AT"]
        data.stdlib_sources = sources
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (os.path.isfile(f"{prefix}.idx"), tokenizer.vocab_size))
    return seen


def test_a_rank_that_starts_after_the_stdlib_build_still_enters_its_collective(run_distributed,
                                                                               tmp_path):
    """Rank 0 decides whether the stdlib dataset is built and every rank follows: a rank that
    looked for itself, after rank 0 had written the index, skipped the build's collective and
    waited in the optimizer's while the others waited in the build's (a start-up that never
    ended). The late rank's 5 s is the timeout's margin: the old code hung until it."""
    run_distributed(_ready, world_size=2)  # the workers started (the timeout below is the run's)
    seen = run_distributed(_prepare_stdlib_data_with_rank_1_late, str(tmp_path / "stdlib"), 5,
                           world_size=2, timeout=40)
    assert seen == [[(True, 257), (True, 257)]] * 2


def _tree(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text() if p.is_file() else "/"
        for p in sorted(Path(root).rglob("*"))
    }


def test_recover_restores_a_tracked_checkpoint_moved_aside_and_drops_partial_saves(tmp_path):
    """A save killed between its two renames (iter_4 moved aside, the new one not yet in place):
    the tracked iteration's old directory goes back; unfinished writes are deleted."""
    from mcore_ext.checkpoint.directory import TRACKER
    from mcore_ext.checkpoint.directory import recover_root as _recover

    (tmp_path / TRACKER).write_text("4")
    (tmp_path / ".replaced.iter_0000004").mkdir()
    (tmp_path / ".replaced.iter_0000004" / "common.pt").write_text("old")
    (tmp_path / ".saving.iter_0000004").mkdir()
    (tmp_path / ".saving.iter_0000004" / "common.pt").write_text("new, complete")
    (tmp_path / ".saving.iter_0000008").mkdir()
    (tmp_path / ".saving.iter_0000008" / "__0_0.distcp").write_text("partial")
    _recover(str(tmp_path))
    assert _tree(tmp_path) == {TRACKER: "4", "iter_0000004": "/", "iter_0000004/common.pt": "old"}


def test_recover_drops_a_replaced_directory_once_the_new_one_is_in_place(tmp_path):
    from mcore_ext.checkpoint.directory import TRACKER
    from mcore_ext.checkpoint.directory import recover_root as _recover

    (tmp_path / TRACKER).write_text("4")
    for name, text in [("iter_0000004", "new"), (".replaced.iter_0000004", "old"),
                       ("iter_0000002", "older")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "common.pt").write_text(text)
    _recover(str(tmp_path))
    assert _tree(tmp_path) == {
        TRACKER: "4", "iter_0000002": "/", "iter_0000002/common.pt": "older",
        "iter_0000004": "/", "iter_0000004/common.pt": "new",
    }


def _publish_with_a_failing_read_back(root):
    """Rank r's saves of iterations 4 and 8, each a tensor row of its own; in the save of 8
    rank 1 cannot read its file back to checksum it (EIO). Returns each save's error or None."""
    import errno
    from unittest import mock

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mcore_ext import _cpu_compat
    from mcore_ext.checkpoint import manifest, saving
    from mcore_ext.checkpoint.directory import iteration_dir
    from mcore_ext.checkpoint.errors import CheckpointSaveError

    _cpu_compat.install()  # megatron's writer synchronizes CUDA
    rank, world = dist.get_rank(), dist.get_world_size()
    describe = manifest.describe

    def failing_on_rank_1(directory, names):
        if rank == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(directory, names[0]))
        return describe(directory, names)

    errors = []
    for iteration, read_back in [(4, describe), (8, failing_on_rank_1)]:
        directory = iteration_dir(root, iteration)
        partial = saving.begin(directory)
        row = torch.full((1, 4), float(iteration + rank))
        dist_checkpointing.save(
            {"w": ShardedTensor.from_rank_offsets("w", row, (0, rank, world))}, partial)
        try:
            with mock.patch.object(manifest, "describe", read_back):
                saving.publish(partial, directory, root=root, iteration=iteration)
            errors.append(None)
        except CheckpointSaveError as err:
            errors.append(str(err))
    return errors


def test_a_save_whose_read_back_fails_on_one_rank_never_goes_live(run_distributed, tmp_path):
    """Checksumming its own files fails on rank 1 only: every rank raises, and nothing of the
    failed save is published (before: rank 0 renamed it into place and moved the tracker, with
    a manifest that lacked rank 1's file)."""
    from mcore_ext.checkpoint import manifest
    from mcore_ext.checkpoint.directory import TRACKER

    results = run_distributed(_publish_with_a_failing_read_back, str(tmp_path), world_size=2)
    for errors in results:
        assert errors[0] is None, errors
        assert errors[1].startswith(f"publishing {tmp_path / 'iter_0000008'} failed on rank 1 "
                                    "(OSError: [Errno 5] Input/output error"), errors
        assert "rank 0" not in errors[1], errors
    assert (tmp_path / TRACKER).read_text() == "4"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", TRACKER]
    assert sorted(manifest.read(str(tmp_path / "iter_0000004"))) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
    assert manifest.verify_checkpoint(str(tmp_path / "iter_0000004"), collective=False) == []


def test_a_rank_file_the_manifest_does_not_list_fails_verification(tmp_path):
    """A checkpoint whose manifest misses a rank's data file in its folder (as a save published
    without that rank's entries left it) does not verify (before: it did, unread)."""
    from mcore_ext.checkpoint import manifest

    for name in [".metadata", "__0_0.distcp", "__1_0.distcp", "config.yaml"]:
        (tmp_path / name).write_text(f"bytes of {name}")
    manifest.write(str(tmp_path), manifest.describe(str(tmp_path), [".metadata", "__0_0.distcp"]))
    problems = manifest.verify_checkpoint(str(tmp_path), collective=False)
    assert problems == [("__1_0.distcp", "not in the manifest (the save did not record it)")]
    (tmp_path / "__1_0.distcp").unlink()
    assert manifest.verify_checkpoint(str(tmp_path), collective=False) == []


def test_recover_unlinks_a_symbolic_link_moved_aside_and_keeps_its_target(tmp_path):
    """What an export into a link left before writers resolved links (the link moved aside as
    .replaced.out, a real out in its place): the link goes, its target and out stay (before:
    OSError 'Cannot call rmtree on a symbolic link', at every later export)."""
    from mcore_ext.checkpoint.directory import recover_dir

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("earlier export")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("new export")
    (tmp_path / ".replaced.out").symlink_to(tmp_path / "target", target_is_directory=True)
    recover_dir(str(tmp_path / "out"))
    assert _tree(tmp_path) == {"out": "/", "out/config.json": "new export",
                               "target": "/", "target/config.json": "earlier export"}


def test_the_start_is_the_same_before_and_after_the_repair_of_a_killed_resave(tmp_path):
    """The tracked iteration only as .replaced.iter_0000004 (a re-save killed between its two
    renames): every rank finds iteration 4 whether it looks before or after rank 0 put it back
    (before: CheckpointNotFoundError '... names iteration 4 but .../iter_0000004 does not
    exist', so the run exited before the repair)."""
    from mcore_ext.checkpoint.directory import TRACKER, find_start, recover_root

    (tmp_path / TRACKER).write_text("4")
    (tmp_path / ".replaced.iter_0000004").mkdir()
    (tmp_path / ".saving.iter_0000004").mkdir()
    before = find_start(str(tmp_path), str(tmp_path))
    recover_root(str(tmp_path))
    after = find_start(str(tmp_path), str(tmp_path))
    assert before == after
    assert after.own and after.checkpoint.iteration == 4
    assert after.checkpoint.directory == str(tmp_path / "iter_0000004")
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", TRACKER]


def _stop_requests(late_rank, signalled_rank):
    """Each rank's StopRequest answer when only ``late_rank``'s clock is past the limit and only
    ``signalled_rank`` got SIGTERM (None: no rank)."""
    import signal
    import types

    import torch.distributed as dist

    from mcore_ext.training.faults import StopRequest

    rank = dist.get_rank()
    handler = types.SimpleNamespace(received=signal.SIGTERM if rank == signalled_rank else 0)
    clock = (lambda: 61.0) if rank == late_rank else (lambda: 59.0)  # minutes since 0: 1.02 / 0.98
    return StopRequest(handler, exit_duration_mins=1.0, started=0.0, clock=clock).agreed()


def test_exit_duration_is_rank_0s_decision_and_every_rank_gets_it(run_distributed):
    """training.exit_duration_mins: rank 0's clock past the limit stops every rank; rank 1's
    alone stops none (clocks that differ must not split the ranks); a signal on any rank stops
    all and names the signal."""
    assert run_distributed(_stop_requests, 0, None, world_size=2) == [
        "training.exit_duration_mins=1 reached"] * 2
    assert run_distributed(_stop_requests, 1, None, world_size=2) == [None, None]
    assert run_distributed(_stop_requests, None, 1, world_size=2) == ["SIGTERM received"] * 2


def _run_with_exit_duration(tmp):
    from tests.functional.inprocess import TINY_MOCK, launch

    ckpt = f"{tmp}/ckpt"
    common = (*TINY_MOCK, "training.train_iters=3", f"checkpoint.save={ckpt}",
              "checkpoint.load=null", f"logging.metrics_file={tmp}/metrics.jsonl")
    # A limit any step outlasts: the run saves at its first step boundary.
    stopped = launch(*common, "training.exit_duration_mins=1e-6")
    resumed = launch(*common)
    return stopped, resumed


def test_exit_duration_saves_and_exits_16_then_the_same_command_resumes(run_distributed,
                                                                        tmp_path):
    from mcore_ext.checkpoint.directory import TRACKER
    from mcore_ext.training.faults import SAVED_NOT_FINISHED
    from tests.functional.inprocess import losses, start_lines

    (stopped, resumed), (stopped1, resumed1) = run_distributed(
        _run_with_exit_duration, str(tmp_path), world_size=2)
    assert stopped["code"] == stopped1["code"] == SAVED_NOT_FINISHED == 16, stopped
    assert ("[train] stopping at iteration 1 (training.exit_duration_mins=1e-06 reached)"
            in stopped["stdout"]), stopped["stdout"][-2000:]
    assert resumed["code"] == resumed1["code"] == 0, resumed
    assert start_lines(resumed["stdout"])[0].endswith("(iteration 1)"), resumed["stdout"]
    assert (tmp_path / "ckpt" / TRACKER).read_text().strip() == "3"
    assert sorted(losses(tmp_path / "metrics.jsonl")) == [1, 2, 3]


def test_the_agent_script_holds_the_stop_signals_and_holds_them_for_the_entry_points():
    """launch/torchrun.py blocks, before its imports, the signals mcore_ext.torchrun forwards;
    the agent holds them for the workers of the launcher and the Megatron-LM entry only (another
    program would never see them)."""
    import importlib.util
    import signal

    from torch.distributed.run import parse_args

    from mcore_ext import cli, torchrun

    text = (ROOT / "launch" / "torchrun.py").read_text()
    held = text.split("STOP_SIGNALS = (", 1)[1].split(")", 1)[0]
    assert [name.strip().removeprefix("signal.") for name in held.split(",")] == list(
        cli.STOP_SIGNALS) == list(torchrun._FORWARDED)
    assert text.index("signal.pthread_sigmask(signal.SIG_BLOCK") < text.index("import sys")
    assert importlib.util.find_spec("signal") and signal.SIGUSR1  # (used above by name)
    launcher = ROOT / "launch" / "pretrain.py"
    assert torchrun._holds_signals(parse_args(["--nproc_per_node=2", str(launcher), "--config",
                                               "x.yaml"]))
    assert not torchrun._holds_signals(parse_args(["--nproc_per_node=2", "train.py"]))
    assert not torchrun._holds_signals(parse_args(["-m", "--nproc_per_node=2", "mcore_ext.hf"]))
    assert torchrun._holds_signals(parse_args(["-m", "--nproc_per_node=2",
                                               "mcore_ext.megatron_lm.pretrain_gpt"]))
