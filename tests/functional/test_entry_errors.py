"""A user's mistake in each entry point, under real torchrun (2 gloo ranks): one ``error:`` line,
first and once; exit code 2 through ``python -m mcore_ext.torchrun``. Plain torchrun turns any
rank's non-zero exit into its own report and exit code 1 (torch's launch_agent raises
ChildFailedError, which its main re-raises): the mistake still comes first and once. Also: the
``hf`` commands print their result line alone, and the Megatron-LM entry's --help works.
"""

import os
import subprocess
import sys

import pytest
import yaml

from mcore_ext import _mcore_compat
from tests.functional.test_pretrain import ROOT, TINY, _free_port
from tests.hf import models

LAUNCHER = ["launch/pretrain.py", "--config", TINY]
HF = ["-m", "mcore_ext.hf"]
MEGATRON_LM = ["-m", "mcore_ext.megatron_lm.pretrain_gpt"]


def _run(*args, timeout=300):
    # OMP_NUM_THREADS set: without it torchrun prints a notice that it sets it (to 1).
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _torchrun(program, *args, wrapper: bool):
    front = ["-m", "mcore_ext.torchrun"] if wrapper else ["-m", "torch.distributed.run"]
    return _run(*front, "--nproc_per_node=2", "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}", *program, *args)


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return models.write_released(str(tmp_path_factory.mktemp("hf") / "tiny"))


CASES = {
    "launcher": (LAUNCHER, ["model.num_layer=3"],
                 "error: unknown config key 'model.num_layer'; did you mean 'model.num_layers'?"),
    "hf": (HF, ["import", "{hf}", "{tmp}/ckpt", "--tp", "3"],
           "error: 2 process(es) are not divisible by --tp 3 x --pp 1 = 3: run under torchrun "
           "--nproc_per_node=N with N a multiple of 3"),
    "megatron_lm": (MEGATRON_LM, ["--no-such-flag"],
                    "error: unrecognized arguments: --no-such-flag (--help lists the flags)"),
    # valid flags but a schedule megatron's scheduler asserts on, after building the model
    "megatron_lm_schedule": (
        MEGATRON_LM,
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--position-embedding-type", "rope", "--no-rope-fusion", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--head-wise-attn-gate", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--lr", "1e-3",
         "--train-iters", "3", "--lr-warmup-iters", "3"],
        "error: --lr-warmup-iters 3 must be below --train-iters 3 (--lr-decay-iters not given): "
        "megatron's learning rate would never decay"),
}


# The hf and schedule cases cost a torchrun start each (the schedule one builds the model too).
@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.slow)
                                   if e in ("hf", "megatron_lm_schedule") else e for e in CASES])
def test_mistake_under_torchrun_is_one_line_first_and_exit_2(entry, hf_dir, tmp_path):
    program, args, message = CASES[entry]
    args = [a.format(hf=hf_dir, tmp=tmp_path) for a in args]

    quiet = _torchrun(program, *args, wrapper=True)
    assert quiet.returncode == 2, quiet.stderr[-3000:]
    assert _lines(quiet.stderr) == [message], quiet.stderr[-3000:]
    if entry == "megatron_lm_schedule":  # found after megatron's parser printed the arguments
        assert "[rank" not in quiet.stdout and "Traceback" not in quiet.stdout, quiet.stdout
    else:
        assert not _lines(quiet.stdout), quiet.stdout

    plain = _torchrun(program, *args, wrapper=False)
    errors = _lines(plain.stderr)
    assert plain.returncode == 1  # torchrun's own code for any failed rank
    assert errors[0] == message and plain.stderr.count(message) == 1, plain.stderr[-3000:]
    assert "usage:" not in plain.stderr and "Traceback" not in errors[1]  # torchrun's report
    assert not (tmp_path / "ckpt").exists()


# hf import (both architectures) and export printing their line alone, GPTModel's notice once:
# tests/hf/test_hf_moe.py::test_cli_imports_and_exports_moe_and_mtp_bit_exact (the MoE model)
@pytest.mark.slow
def test_hf_commands_print_their_result_alone(hf_dir, tmp_path):
    imported = _run(*HF, "import", hf_dir, str(tmp_path / "ckpt"))
    exported = _run(*HF, "export", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    as_gpt = _run(*HF, "import", hf_dir, str(tmp_path / "gpt"), "--architecture", "gpt")
    notices = {}
    for name, result, line in (("import", imported, "[hf] import: wrote"),
                               ("export", exported, "[hf] export: wrote"),
                               ("import gpt", as_gpt, "[hf] import: wrote")):
        assert result.returncode == 0, result.stderr[-3000:]
        assert _lines(result.stderr) == [], result.stderr  # no third-party notices
        out, *notices[name] = _lines(result.stdout)
        assert out.startswith(line), out
    # The default import writes the model megatron-core recommends (HybridModel from 0.19) and
    # the export reads it, both silently; an import to GPTModel (--architecture gpt) says once
    # that it is deprecated (megatron-core 0.19+, which has HybridModel).
    saved = yaml.safe_load((tmp_path / "ckpt" / "iter_0000000" / "config.yaml").read_text())
    assert saved["model"]["architecture"] == (
        "hybrid" if _mcore_compat.has_hybrid_model() else "gpt")
    assert notices["import"] == notices["export"] == []
    assert notices["import gpt"] == [
        "[hf] import --architecture gpt: GPTModel is deprecated in megatron-core "
        f"{_mcore_compat.megatron_core_version()} (critical fixes only); --architecture hybrid "
        "writes a HybridModel checkpoint (model.architecture: hybrid)"
    ][:_mcore_compat.has_hybrid_model()]


def test_megatron_lm_help_lists_the_gate_flags_first():
    result = _run(*MEGATRON_LM, "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    group = text.index("mcore_ext: head-wise attention gate, Step-3.5 layer kinds:")
    assert group < text.index("  --head-wise-attn-gate\n") < text.index("  --tensor-model-parallel-size")
    assert len(text.split("\n\n")[0].splitlines()) == 1  # a one-line usage, not every flag's


def test_hf_plan_help_does_not_mention_torchrun():
    result = _run(*HF, "plan", "--help")
    assert result.returncode == 0 and "--tp TP" in result.stdout
    assert "torchrun" not in result.stdout, result.stdout


_SLOW_FIRST_RANK = """
import os, sys, time
from mcore_ext.cli import report_error
if os.environ["RANK"] == "0":
    time.sleep(3)  # the first rank reaches the mistake last (imports, a loaded machine)
sys.exit(report_error("the same mistake on every rank"))
"""


@pytest.mark.parametrize("wrapper", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["mcore_ext.torchrun", "torchrun"])
def test_the_message_survives_a_first_rank_that_finds_it_last(tmp_path, wrapper):
    """Before, the other ranks exited at once; torchrun's agent then stopped the first rank
    before it printed: exit 2 and no line at all (seen in CI under load)."""
    script = tmp_path / "slow_first_rank.py"
    script.write_text(_SLOW_FIRST_RANK)
    result = _torchrun([str(script)], wrapper=wrapper)
    assert result.returncode == (2 if wrapper else 1), result.stderr[-3000:]
    errors = _lines(result.stderr)
    assert errors and errors[0] == "error: the same mistake on every rank", result.stderr[-3000:]
    assert result.stderr.count("error: the same mistake") == 1, result.stderr[-3000:]
