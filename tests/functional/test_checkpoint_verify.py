"""Checkpoint verification, with real damage: truncated files and flipped bits in model and
optimizer tensors, on 2 ranks (TP 2) and 4 ranks (TP 2 x DP 2, distributed optimizer).

Each test trains one tiny run in-process (3 steps, a checkpoint at every step), then damages
copies of it. A bit flip inside a tensor loads without any error from megatron (the launcher
would silently train on the damaged values); a truncated file fails deep inside torch's reader.
Both must be one error line naming the file and the newest checkpoint that verifies, and with
``checkpoint.on_corrupt=previous`` the run resumes from that one, exactly.
"""

import contextlib
import io
import os
import re
import shutil

import pytest

from tests.functional.inprocess import MARK, TINY_MOCK, launch, losses, start_lines
from tests.functional.test_pretrain import GATED_QKV

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_KEY = GATED_QKV + r"\.weight\._qkv"  # GPTModel's stacked weight or any HybridModel layer's
OPTIMIZER_KEY = r"optimizer\.state\.exp_avg\." + MODEL_KEY
LAYOUTS = {
    2: ["parallelism.tensor_model_parallel_size=2"],
    4: ["parallelism.tensor_model_parallel_size=2", "optimizer.use_distributed_optimizer=true"],
}


def damage(directory, how: str) -> str:
    """Damage the highest rank's file holding the model (or optimizer) tensor ``MODEL_KEY``:
    ``truncate_model`` cuts that file in half, ``flip_model`` / ``flip_optimizer`` flip one bit in
    the middle of the tensor's bytes; ``truncate_last`` cuts the highest rank's file, whatever it
    holds. Returns the file's name."""
    from torch.distributed.checkpoint import FileSystemReader

    key = OPTIMIZER_KEY if how.endswith("optimizer") else MODEL_KEY
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    places = [info for index, info in storage.items()
              if re.fullmatch(key, index.fqn) or how == "truncate_last"]
    assert places, sorted({index.fqn for index in storage})
    info = max(places, key=lambda info: int(info.relative_path.split("_")[2]))  # __<rank>_<n>
    path = os.path.join(directory, info.relative_path)
    data = bytearray(open(path, "rb").read())
    if how.startswith("truncate"):
        data = data[: len(data) // 2]
    else:
        data[info.offset + info.length // 2] ^= 0x10
    open(path, "wb").write(data)
    return info.relative_path


def _inspect_verify(directory) -> tuple[int, str]:
    from mcore_ext.checkpoint.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(["inspect", str(directory), "--verify"])
        except SystemExit as exit_:  # argparse: an unknown option
            code = exit_.code
    return code, out.getvalue()


def _damaged_runs(tmp, world, cases):
    """Train ``base``, then per case {name: (damage, also damage iteration 2, on_corrupt)} a copy
    of it, damaged, resumed to step 4. Returns {case: launch result + what was found}."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    common = [*TINY_MOCK, *LAYOUTS[world], "checkpoint.save_interval=1"]
    base = tmp / "base"
    out = {"base": launch(*common, "training.train_iters=3", f"checkpoint.save={base}",
                          f"checkpoint.load={base}", f"logging.metrics_file={tmp / 'base.jsonl'}")}
    for name, (how, older_too, policy) in cases.items():
        ckpt = tmp / name
        files = [None]
        if rank0:
            shutil.copytree(base, ckpt)
            files = [damage(ckpt / "iter_0000003", how)]
            if older_too:
                files.append(damage(ckpt / "iter_0000002", "truncate_model"))
        inspected = _inspect_verify(ckpt / "iter_0000003") if rank0 else None
        dist.barrier()
        policy_override = [] if policy == "error" else [f"checkpoint.on_corrupt={policy}"]
        result = launch(*common, "training.train_iters=4", f"checkpoint.save={ckpt}",
                        f"checkpoint.load={ckpt}", f"logging.metrics_file={tmp / name}.jsonl",
                        *policy_override)
        dist.barrier()
        result["files"] = files
        if rank0:
            result["tracker"] = (ckpt / TRACKER).read_text()
            result["inspect"] = inspected
        out[name] = result
    if rank0:
        out["base"]["inspect"] = _inspect_verify(base / "iter_0000003")
    return out


def _check(results, tmp, cases):
    out = results[0]
    assert out["base"]["code"] == 0, out["base"]
    code, text = out["base"]["inspect"]
    assert code == 0 and "verified: all" in text, text
    base_losses = losses(tmp / "base.jsonl")
    for name, (how, older_too, policy) in cases.items():
        result, file = out[name], out[name]["files"][0]
        others = [r[name] for r in results[1:]]
        damaged = tmp / name / "iter_0000003"
        problem = "truncated" if how.startswith("truncate") else "checksum mismatch"
        verified = 1 if older_too else 2
        code, text = result["inspect"]
        assert code == 2 and f"{damaged / file}: {problem}" in text, (name, text)
        if policy == "error":
            assert [r["code"] for r in (result, *others)] == [2] * len(results), (name, result)
            (line,) = result["stderr"].splitlines()
            assert line.startswith(f"error: checkpoint {damaged} is corrupt: {file} {problem}"), (
                name, line)
            assert (f"the newest checkpoint that verifies is iteration {verified} "
                    f"({tmp / name / f'iter_{verified:07d}'}): set checkpoint.on_corrupt=previous "
                    "to resume from it") in line, (name, line)
            assert all(r["stderr"] == "" for r in others), name  # said once, by rank 0
            assert result["tracker"] == "3" and not (tmp / name / "iter_0000004").exists(), name
        else:
            assert [r["code"] for r in (result, *others)] == [0] * len(results), (name, result)
            resumed = tmp / name / f"iter_{verified:07d}"
            (line,) = start_lines(result["stdout"])
            assert line.startswith(f"{MARK} resumed from {resumed} (iteration {verified}) INSTEAD "
                                   f"OF the latest, iteration 3: {file} {problem}"), (name, line)
            assert "warning: " in result["stderr"] and str(damaged) in result["stderr"], name
            # Resumed exactly from the checkpoint that verifies: the uninterrupted run's losses.
            resumed_losses = losses(tmp / f"{name}.jsonl")
            assert sorted(resumed_losses) == list(range(verified + 1, 5)), resumed_losses
            for step in range(verified + 1, 4):
                assert resumed_losses[step] == base_losses[step], (name, step)
            assert result["tracker"] == "4", name


CASES = {  # world size: {name: (damage to iteration 3, iteration 2 truncated too, on_corrupt)}
    2: {  # TP 2
        "truncated_model_file": ("truncate_model", False, "error"),
        "flipped_model_bit": ("flip_model", False, "previous"),
        "flipped_optimizer_bit": ("flip_optimizer", False, "error"),
    },
    4: {  # TP 2 x DP 2, distributed optimizer
        "truncated_model_file": ("truncate_model", False, "error"),
        "truncated_last_rank_file": ("truncate_last", False, "error"),
        "flipped_optimizer_bits": ("flip_optimizer", True, "previous"),
    },
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)],
                         ids=["2_ranks_tp2", "4_ranks_tp2_dp2_distributed_optimizer"])
def test_damaged_checkpoint_is_named_and_previous_resumes_exactly(run_distributed, tmp_path,
                                                                  world):
    results = run_distributed(_damaged_runs, tmp_path, world, CASES[world], world_size=world)
    _check(results, tmp_path, CASES[world])


def _verify_where_one_rank_cannot_read_the_manifest(directory):
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext.checkpoint import manifest

    mcore_ext.init_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "a.bin"), "wb") as f:
            f.write(b"x" * 64)
        manifest.write(directory, manifest.describe(directory, ["a.bin"]))
    dist.barrier()
    read = manifest._read_document

    def unreadable(_):
        raise OSError("stale file handle")

    if dist.get_rank() == 1:  # this rank's view of the manifest fails (a flaky mount, say)
        manifest._read_document = unreadable
    try:
        return manifest.verify_checkpoint(directory)
    finally:
        manifest._read_document = read  # the worker process runs later tests


def test_a_manifest_one_rank_cannot_read_is_every_ranks_finding(run_distributed, tmp_path):
    # Rank 0 read the manifest and went on to gather the files' checks while rank 1 returned
    # at once: a hang on the old code (the worker pool's timeout); now both report rank 1's
    # finding.
    found = run_distributed(_verify_where_one_rank_cannot_read_the_manifest, str(tmp_path),
                            world_size=2, timeout=60)
    assert found[0] == found[1] and "stale file handle" in found[0][0][1], found
