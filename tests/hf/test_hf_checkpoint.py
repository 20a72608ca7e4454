"""``python -m mcore_ext.hf import / export`` and the launcher in between; bad input refused.

- import at TP 2, export at PP 2: every tensor bit-identical, same keys;
- each bad input is one clear error, and nothing is written;
- import, 20 launcher steps at TP 2 (torchrun), export, and transformers loads the result.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.functional.test_pretrain import LAUNCHER, ROOT, check, losses, torchrun
from mcore_ext.hf import HFConfigError
from tests.hf import models
from tests.hf.test_hf_parity import assert_same_tensors

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return models.save_released(models.build(), str(tmp_path_factory.mktemp("hf") / "tiny"))


def _import(hf, ckpt, tp):
    import mcore_ext
    from mcore_ext.hf import import_checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    return import_checkpoint(hf, ckpt)


def _export(ckpt, out, tp, pp):
    import mcore_ext
    from mcore_ext.hf import export_checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    export_checkpoint(ckpt, out, max_shard_bytes=40_000)


def test_import_at_tp2_export_at_pp2_is_bit_identical(run_distributed, hf_dir, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run_distributed(_import, hf_dir, ckpt, 2, world_size=2)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "0"
    for name in ("config.yaml", "hf_config.json", "metadata.json"):
        assert os.path.exists(os.path.join(ckpt, "iter_0000000", name)), name
    run_distributed(_export, ckpt, out, 1, 2, world_size=2)
    assert_same_tensors(hf_dir, out)
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["vocab_size"] == models.VOCAB and exported["bos_token_id"] == 1


def _refuse(hf, ckpt, tp):
    """The error message of an import that must fail, and whether it wrote anything."""
    import mcore_ext
    from mcore_ext.hf import import_checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    try:
        import_checkpoint(hf, ckpt)
    except Exception as err:  # the test checks type and message
        return type(err).__name__, str(err), os.path.exists(ckpt)
    return None, "no error", os.path.exists(ckpt)


def _bad_copy(hf_dir, root, name, edit_config=None, edit_files=None):
    bad = os.path.join(root, name)
    shutil.copytree(hf_dir, bad)
    if edit_config:
        path = os.path.join(bad, "config.json")
        config = json.load(open(path))
        edit_config(config)
        json.dump(config, open(path, "w"))
    if edit_files:
        edit_files(bad)
    return bad


def _truncate_last_shard(directory):
    last = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))[-1]
    path = os.path.join(directory, last)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-100])


def _remove_first_shard(directory):
    os.remove(os.path.join(directory, sorted(
        f for f in os.listdir(directory) if f.endswith(".safetensors"))[0]))


def _shape_mismatch(config):
    config["intermediate_size"] = 40


BAD_INPUTS = {
    "missing_shard": (dict(edit_files=_remove_first_shard), 2, "SafetensorsError", "missing"),
    "truncated_shard": (dict(edit_files=_truncate_last_shard), 2, "SafetensorsError",
                        "truncated"),
    "missing_config": (dict(edit_files=lambda d: os.remove(os.path.join(d, "config.json"))), 2,
                       "HFConfigError", "config.json: missing"),
    "unknown_model_type": (dict(edit_config=lambda c: c.update(model_type="qwen3")), 2,
                           "HFConfigError", "model_type='qwen3'"),
    # MoE layers the config declares but the (dense) weights lack
    "moe_layers": (dict(edit_config=lambda c: c.update(moe_layers_enum="2,3")), 2,
                   "HFConfigError", "tensor(s) the config needs are missing"),
    "config_weights_mismatch": (dict(edit_config=_shape_mismatch), 2, "HFConfigError",
                                "mlp.gate_proj.weight: shape (48, 32) in the weights, (40, 32)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_and_nothing_is_written(run_distributed, hf_dir, tmp_path, case):
    edits, tp, kind, message = BAD_INPUTS[case]
    bad = _bad_copy(hf_dir, str(tmp_path), case, **edits)
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_refuse, bad, ckpt, tp, world_size=2)
    for error, text, wrote in results:
        assert error == kind, text
        assert message in text
        assert not wrote


def test_head_counts_tp_does_not_divide_are_refused_before_anything_is_built(hf_dir):
    # import_checkpoint / load_pretrained run this check before building or writing anything.
    from mcore_ext.hf.convert import check_parallel, read_hf_config

    _, spec = read_hf_config(hf_dir)
    with pytest.raises(HFConfigError, match="num_attention_heads=4 is not divisible by "
                                            "tensor_model_parallel_size=8"):
        check_parallel(spec, 8)
    with pytest.raises(HFConfigError, match="num_sliding_attention_heads=8 is not divisible by "
                                            "tensor_model_parallel_size=3"):
        check_parallel(spec.replace(num_heads=6), 3)
    check_parallel(spec, 4)


def test_cli_error_is_one_line_exit_2_nothing_written(hf_dir, tmp_path):
    bad = _bad_copy(hf_dir, str(tmp_path), "moe", edit_config=lambda c: c.update(
        moe_layers_enum="1"))
    ckpt = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-m", "mcore_ext.hf", "import", bad, str(ckpt)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "missing" in last and "model.layers.1.moe." in last
    assert not ckpt.exists()


@pytest.mark.slow
def test_import_train_20_steps_at_tp2_export_loads_in_transformers(hf_dir, tmp_path):
    ckpt, run, out = tmp_path / "imported", tmp_path / "run", tmp_path / "exported"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    check(subprocess.run([sys.executable, "-m", "mcore_ext.hf", "import", hf_dir, str(ckpt),
                          "--seq-length", "16"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300), "import")
    metrics = tmp_path / "metrics.jsonl"
    result = check(torchrun(
        "--config", str(ckpt / "iter_0000000" / "config.yaml"),
        "parallelism.tensor_model_parallel_size=2", "data.source=mock",
        "training.micro_batch_size=2", "training.global_batch_size=4",
        "training.train_iters=20", "training.eval_interval=null", "optimizer.lr=1e-3",
        "optimizer.lr_warmup_iters=2", "model.attention_backend=sdpa",
        f"checkpoint.save={run}", f"logging.metrics_file={metrics}", "logging.log_interval=1",
    ), "launcher")
    assert "finetune: loaded the model weights" in result.stdout
    loss = losses(metrics)
    assert sorted(loss) == list(range(1, 21))
    check(subprocess.run([sys.executable, "-m", "mcore_ext.hf", "export", str(run), str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300),
          "export")

    model, info = models.load_released(str(out))
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    original, _ = models.load_released(hf_dir)
    trained = dict(model.named_parameters())
    changed = [n for n, p in original.named_parameters() if not torch.equal(p, trained[n])]
    assert len(changed) == len(trained)  # every tensor was trained (and exported)
    with torch.no_grad():
        assert torch.isfinite(model(models.tokens())).all()
