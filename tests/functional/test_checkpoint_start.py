"""Where a launcher run starts, and the one line that says so (2 gloo ranks, in-process launcher).

One tiny run (``base``: 2 steps, checkpoints at 1 and 2) is shared; the other runs load its
checkpoints: by iteration directory (what ``hf import`` prints), through Megatron-LM's ``release``
tracker, as weights only, and again once it is complete. Paths that hold no checkpoint are
refused before anything is written.
"""

import os
import shutil
import subprocess

import pytest

from tests.functional.inprocess import MARK, ROOT, TINY, TINY_MOCK, launch, losses, start_lines

TRACKER = "latest_checkpointed_iteration.txt"


def _rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _base(tmp):
    base = tmp / "base"
    return launch(*TINY_MOCK, "training.train_iters=2", "checkpoint.save_interval=1",
                  f"checkpoint.save={base}", f"checkpoint.load={base}",
                  f"logging.metrics_file={tmp / 'base.jsonl'}")


@pytest.fixture(scope="module")
def base(run_distributed_shared, tmp_path_factory):
    """The shared run: {"dir": its save directory, "tmp": the folder, "result": rank 0's output}."""
    tmp = tmp_path_factory.mktemp("start")
    result = run_distributed_shared(_base, tmp, world_size=2)
    assert result[0]["code"] == 0, result[0]
    return {"dir": tmp / "base", "tmp": tmp, "result": result[0]}


def _loads(tmp, base):
    """Each way of pointing checkpoint.load at ``base``'s checkpoints: {case: launch result}."""
    out = {}
    out["iteration_dir"] = launch(
        *TINY_MOCK, "training.train_iters=2", f"checkpoint.load={base / 'iter_0000001'}",
        f"checkpoint.save={tmp / 'from_iter'}", f"logging.metrics_file={tmp / 'from_iter.jsonl'}")
    out["iteration_dir_finetune"] = launch(
        *TINY_MOCK, "training.train_iters=1", f"checkpoint.load={base / 'iter_0000002'}",
        "checkpoint.finetune=true", f"checkpoint.save={tmp / 'finetuned'}")
    release = tmp / "released"  # Megatron-LM's --save of a released model: tracker "release"
    if _rank0():
        shutil.copytree(base / "iter_0000002", release / "release")
        (release / TRACKER).write_text("release\n")
    _barrier()
    out["release"] = launch(
        *TINY_MOCK, "training.train_iters=1", f"checkpoint.load={release}",
        "checkpoint.finetune=true", "checkpoint.save=null")
    out["complete"] = launch(
        *TINY_MOCK, "training.train_iters=2", f"checkpoint.save={base}", f"checkpoint.load={base}",
        f"logging.metrics_file={tmp / 'complete.jsonl'}")
    return out


def test_iteration_directory_and_release_tracker_load_and_one_line_says_so(run_distributed, base):
    tmp, saved = base["tmp"], base["dir"]
    first = start_lines(base["result"]["stdout"])
    assert first == [f"{MARK} starting from scratch: checkpoint.save={saved} holds no checkpoint "
                     "yet (the run's first start)"], base["result"]["stdout"][-2000:]

    results = run_distributed(_loads, tmp, saved, world_size=2)
    out = results[0]
    for case, result in out.items():
        assert result["code"] == 0, (case, result)
        assert start_lines(results[1][case]["stdout"]) == []  # rank 0 says it, once
        lines = result["stdout"].splitlines()
        (line,) = start_lines(result["stdout"])
        if case != "complete":  # the last word before training starts
            assert lines[lines.index(line) + 1].startswith("[train] iterations"), (case, lines)

    (line,) = start_lines(out["iteration_dir"]["stdout"])
    assert line == f"{MARK} resumed from {saved / 'iter_0000001'} (iteration 1)"
    # The untracked iteration 1, resumed exactly: step 2 as in the uninterrupted run.
    assert losses(tmp / "from_iter.jsonl") == {2: losses(tmp / "base.jsonl")[2]}

    (line,) = start_lines(out["iteration_dir_finetune"]["stdout"])
    assert line.startswith(f"{MARK} finetune: loaded the model weights of "
                           f"{saved / 'iter_0000002'}; iteration 0"), line
    (line,) = start_lines(out["release"]["stdout"])
    assert line.startswith(f"{MARK} finetune: loaded the model weights of "
                           f"{tmp / 'released' / 'release'}; iteration 0"), line

    complete = out["complete"]["stdout"]
    assert start_lines(complete) == [
        f"{MARK} run complete at 2; raise training.train_iters (2) to extend it "
        f"(checkpoint {saved / 'iter_0000002'})"], complete[-2000:]
    assert "[train]" not in complete and not (tmp / "complete.jsonl").exists()
    assert (saved / TRACKER).read_text() == "2"


def _refusals(tmp):
    """checkpoint.load paths that hold no checkpoint: {case: (launch result, save existed)}."""
    cases = {"typo": tmp / "no_such_dir", "empty": tmp / "empty", "tracker": tmp / "garbage",
             "lost": tmp / "lost", "untracked": tmp / "untracked"}
    if _rank0():
        (cases["untracked"] / "iter_0000005").mkdir(parents=True)  # its tracker lost
        cases["empty"].mkdir()
        cases["tracker"].mkdir()
        (cases["tracker"] / TRACKER).write_text("iter5\n")
        cases["lost"].mkdir()
        (cases["lost"] / TRACKER).write_text("3")
    _barrier()
    out = {}
    for case, load in cases.items():
        # "untracked": the run's own checkpoint.save, whose checkpoints a fresh start would replace
        save = load if case == "untracked" else tmp / f"save_{case}"
        finetune = [] if case == "untracked" else ["checkpoint.finetune=true"]
        out[case] = launch(*TINY_MOCK, "training.train_iters=1", f"checkpoint.load={load}",
                           *finetune, f"checkpoint.save={save}")
        _barrier()
        out[case]["wrote"] = sorted(os.listdir(save)) if save.exists() else None
    return out


def test_a_load_path_without_a_checkpoint_is_an_error_naming_it(run_distributed, tmp_path):
    results = run_distributed(_refusals, tmp_path, world_size=2)
    expected = {
        "typo": f"checkpoint.load={tmp_path / 'no_such_dir'} holds no checkpoint: it does not "
                "exist",
        "empty": f"checkpoint.load={tmp_path / 'empty'} holds no checkpoint: it has no {TRACKER} "
                 "and is not a checkpoint directory",
        "tracker": f"checkpoint.load={tmp_path / 'garbage'} holds no checkpoint: "
                   f"{tmp_path / 'garbage' / TRACKER} holds 'iter5', not an iteration number "
                   "or 'release'",
        "lost": f"checkpoint.load={tmp_path / 'lost'} holds no checkpoint: {TRACKER} names "
                f"iteration 3 but {tmp_path / 'lost' / 'iter_0000003'} does not exist",
        "untracked": f"checkpoint.save={tmp_path / 'untracked'} holds iter_0000005 but no "
                     f"{TRACKER}: a run started there would replace them",
    }
    for case, message in expected.items():
        zero, one = results[0][case], results[1][case]
        assert zero["code"] == 2 and one["code"] == 2, (case, zero)
        assert zero["stderr"].startswith(f"error: {message}"), (case, zero["stderr"])
        assert zero["stderr"].count("\n") == 1 and one["stderr"] == "", (case, one["stderr"])
        # nothing written: not even checkpoint.save's directory
        assert zero["wrote"] == (["iter_0000005"] if case == "untracked" else None), case


# ------------------------------------------------------------- Megatron-LM checkpoints, finetune


def _megatron_lm_copies(base, tmp):
    """``base``'s iteration 2 as megatron.training leaves it (no launcher content), three ways
    the launcher cannot continue it: another global batch size, no ``args``, a schedule in
    samples that is not whole iterations. Then the runs: {case: launch result}."""
    import torch
    from megatron.core import dist_checkpointing

    from mcore_ext.checkpoint import content as checkpoint_content

    variants = {}
    common = dist_checkpointing.load_common_state_dict(str(base / "iter_0000002"))
    megatron_lm = {k: v for k, v in common.items()
                   if k not in ("scheduler", "consumed_samples", "layout", "distributed_optimizer")}
    assert checkpoint_content.written_by_megatron_lm(megatron_lm)
    variants["other_batch"] = megatron_lm
    variants["no_args"] = {k: v for k, v in megatron_lm.items() if k != "args"}
    partial = dict(megatron_lm, opt_param_scheduler=dict(megatron_lm["opt_param_scheduler"]))
    partial["opt_param_scheduler"]["num_steps"] += 1  # 9 samples: 2.25 iterations of 4
    variants["partial_samples"] = partial
    if _rank0():
        for name, content in variants.items():
            shutil.copytree(base / "iter_0000002", tmp / name / "iter_0000002")
            # megatron reads a legacy common.pt in preference to the common state in the shards
            torch.save(content, tmp / name / "iter_0000002" / "common.pt")
            (tmp / name / TRACKER).write_text("2")
    _barrier()
    out = {}
    for name in variants:
        batch = "8" if name == "other_batch" else "4"
        out[name] = launch(*TINY_MOCK, "training.train_iters=1", f"checkpoint.load={tmp / name}",
                           f"training.global_batch_size={batch}", "checkpoint.finetune=true",
                           "checkpoint.save=null")
    out["other_batch_resume"] = launch(
        *TINY_MOCK, "training.train_iters=3", f"checkpoint.load={tmp / 'other_batch'}",
        "training.global_batch_size=8", f"checkpoint.save={tmp / 'resume'}")
    out["other_batch_resume"]["wrote"] = (tmp / "resume").exists()
    return out


def test_finetune_of_a_megatron_lm_checkpoint_loads_weights_whatever_its_schedule(
        run_distributed, base, tmp_path):
    """checkpoint.finetune takes the weights only: another global batch size, a checkpoint
    without args, sample counts that are not whole iterations do not matter. Without finetune
    the batch-size mismatch is one error line on rank 0, exit 2, no traceback."""
    results = run_distributed(_megatron_lm_copies, base["dir"], tmp_path, world_size=2)
    out = results[0]
    for case in ("other_batch", "no_args", "partial_samples"):
        assert out[case]["code"] == 0, (case, out[case])
        (line,) = start_lines(out[case]["stdout"])
        assert line.startswith(f"{MARK} finetune: loaded the model weights of "
                               f"{tmp_path / case / 'iter_0000002'}; iteration 0"), line
    resume, other = out["other_batch_resume"], results[1]["other_batch_resume"]
    assert resume["code"] == 2 and other["code"] == 2, resume
    assert resume["stderr"] == (
        "error: training.global_batch_size=8 but the Megatron-LM checkpoint was trained with "
        "--global-batch-size 4: resume with the same global batch size (or set "
        "checkpoint.finetune=true for weights only)\n"), resume["stderr"]
    assert other["stderr"] == "" and "Traceback" not in resume["stdout"] + resume["stderr"]
    assert not resume["wrote"]  # not even checkpoint.save's directory


# --------------------------------------------------------------------------- scripts/pretrain.sh


def test_pretrain_sh_help_and_a_refused_run_leave_no_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RUN_DIR": str(run_dir)}
    script = str(ROOT / "scripts" / "pretrain.sh")
    helped = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "usage:" in helped.stdout and "section.key=value" in helped.stdout
    assert not run_dir.exists()
    refused = subprocess.run(["bash", script, "training.train_iters=lots"], capture_output=True,
                             text=True, env=env, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("error: ") == 1 and "training.train_iters='lots'" in refused.stderr
    assert not run_dir.exists()


# ------------------------------------------------------------------ another tokenizer, resumed


def _word_tokenizer(directory, size):
    """A local Hugging Face tokenizer of ``size`` tokens (the last one its eos)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 1)} | {"</s>": size - 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")), eos_token="</s>")
    tokenizer.save_pretrained(directory)


def _other_tokenizer(base, tmp):
    """``base`` (byte tokenizer: 257 tokens, 384 rows) resumed with a 600-token tokenizer
    into a new checkpoint.save, which keeps the resolved config (no metrics file)."""
    tokenizer = tmp / "tokenizer"
    if _rank0():
        _word_tokenizer(str(tokenizer), 600)
    _barrier()
    save = tmp / "other_tokenizer"
    out = launch(*TINY_MOCK, "training.train_iters=3", f"checkpoint.load={base}",
                 f"checkpoint.save={save}", f"data.tokenizer={tokenizer}")
    _barrier()
    out["wrote"] = sorted(os.listdir(save)) if save.exists() else None
    return out


def test_a_checkpoint_of_another_tokenizer_is_one_line_and_leaves_no_save_directory(
        run_distributed, base, tmp_path):
    """Resuming with a tokenizer that has more tokens than the checkpoint has vocabulary rows:
    one error line by rank 0, exit 2 on every rank; checkpoint.save, made for the run, is removed
    again with the resolved config.yaml the run had written there."""
    pytest.importorskip("tokenizers")
    zero, one = run_distributed(_other_tokenizer, base["dir"], tmp_path, world_size=2)
    directory = base["dir"] / "iter_0000002"
    assert zero["code"] == 2 and one["code"] == 2, (zero["code"], one["code"])
    assert zero["stderr"] == (
        f"error: {directory}: embedding.word_embeddings.weight has 384 rows, fewer than the 600 "
        "tokens of this run's tokenizer (data.tokenizer): it was trained with another "
        "vocabulary\n"), zero["stderr"]
    assert one["stderr"] == "" and "Traceback" not in zero["stdout"] + one["stdout"]
    assert zero["wrote"] is None  # not even checkpoint.save's directory


def _users_config(tmp) -> str:
    """A commented config.yaml whose metrics file lies beside it."""
    text = open(TINY).read().replace("metrics_file: runs/tiny_cpu/metrics.jsonl",
                                     f"metrics_file: {tmp / 'metrics.jsonl'}  # beside this file")
    return "# my run, my comments\n" + text


def _run_the_users_config(tmp):
    """The review's case: ``--config config.yaml training.train_iters=2 optimizer.lr=1.0``."""
    users = tmp / "config.yaml"
    if _rank0():
        users.write_text(_users_config(tmp))
    _barrier()
    mock = [a for a in TINY_MOCK[2:] if a != "logging.metrics_file=null"]  # the file's own
    return launch("--config", users, *mock, "training.train_iters=2", "optimizer.lr=1.0",
                  "checkpoint.save=null", "checkpoint.load=null")


def test_the_resolved_config_does_not_write_over_the_runs_own_config_file(run_distributed,
                                                                          tmp_path):
    zero, _ = run_distributed(_run_the_users_config, tmp_path, world_size=2)
    assert zero["code"] == 0, zero
    # comments kept, neither the overrides nor the expanded keys baked in
    assert (tmp_path / "config.yaml").read_text() == _users_config(tmp_path)
    resolved = tmp_path / "config.resolved.yaml"
    assert f"resolved configuration in {resolved}\n" in zero["stdout"], zero["stdout"][-2000:]
    assert "train_iters: 2\n" in resolved.read_text() and "lr: 1.0\n" in resolved.read_text()
