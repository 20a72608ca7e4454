"""The Megatron-LM entry verifies whatever megatron.training chooses to load (issue 54.3).

megatron.training's ``_load_base_checkpoint`` chooses the checkpoint directory: the tracker of
``--load``, ``--ckpt-step`` with or without a tracker (the issue: with the key, ``--load DIR`` was
refused, and after ``rm DIR/latest_checkpointed_iteration.txt`` ``--load DIR --ckpt-step 2``
loaded the unsigned checkpoint: the entry verified only where a tracker was), and reads it in the
format it finds there (``--ckpt-format torch`` was never verified with the key missing, nor
``torch_dcp`` at all). Here megatron's own ``_load_base_checkpoint`` runs inside the entry's
``verified_loads`` (one gloo rank, no torchrun: the entry's wiring under torchrun is
test_checkpoint_safe_load's test_megatron_lm_entry_verifies_a_launcher_checkpoint_before_loading)
on tiny checkpoints of each format, tracked and untracked: with the key an unsigned one is refused
before it is read, one signed for that folder loads; without the key both load.
"""

import argparse
import os
import shutil
import types

import pytest
import torch

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")

KEY = "MCORE_EXT_CHECKPOINT_KEY"
TRACKER = "latest_checkpointed_iteration.txt"


def _write(root, fmt):
    """A tiny Megatron-LM checkpoint of iteration 2 in ``fmt`` under ``root``, tracked."""
    from megatron.core import dist_checkpointing

    directory = os.path.join(root, "iter_0000002")
    common = {"args": argparse.Namespace(tensor_model_parallel_size=1), "iteration": 2,
              "checkpoint_version": 3.0}
    if fmt == "torch":
        os.makedirs(os.path.join(directory, "mp_rank_00"))
        torch.save(common, os.path.join(directory, "mp_rank_00", "model_optim_rng.pt"))
    elif fmt == "torch_dcp":
        torch.distributed.checkpoint.save(common, checkpoint_id=directory)
    else:
        os.makedirs(directory)
        dist_checkpointing.save(common, directory)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("2")


def _sign(root):
    """``root``'s checkpoint signed with the key, as the launcher signs its own."""
    from mcore_ext.checkpoint import directory as layout
    from mcore_ext.checkpoint import manifest

    directory = os.path.join(root, "iter_0000002")
    manifest.write(directory, manifest.describe(directory, manifest.files_of_rank(directory, None)),
                   iteration=2, run=layout.ensure_run(root))


def _args(**overrides):
    fields = dict(non_persistent_global_ckpt_dir=None, non_persistent_ckpt_type=None,
                  ckpt_step=None, exit_on_missing_checkpoint=False, auto_detect_ckpt_format=True,
                  use_dist_ckpt=True, use_megatron_fsdp=False)
    return types.SimpleNamespace(**{**fields, **overrides})


def _load(root, **overrides):
    """What megatron.training reads of ``root`` (its args-reading load, which every rank makes
    first), inside the entry's ``verified_loads``: "loaded: <iteration>" or the refusal."""
    from megatron.training import checkpointing

    from mcore_ext import _cpu_compat
    from mcore_ext.checkpoint.errors import CheckpointCorruptError
    from mcore_ext.megatron_lm.pretrain_gpt import verified_loads

    try:
        with _cpu_compat.megatron_training_on_cpu(), verified_loads():
            state, name, _, _ = checkpointing._load_base_checkpoint(
                str(root), _args(**overrides), rank0=True)
    except CheckpointCorruptError as err:
        return f"refused: {err}"
    return f"loaded: {state['iteration']}"


def _every_way(tmp, key):
    """{(format, how): outcome} with the key ``key`` (None: unset) in the environment."""
    os.environ.pop(KEY, None)
    out = {}
    for fmt in ("torch", "torch_dist", "torch_dcp"):
        for signed in (False, True):
            root = os.path.join(tmp, f"{fmt}_{'signed' if signed else 'unsigned'}")
            if not os.path.isdir(root):
                os.makedirs(root)
                _write(root, fmt)
                if signed:
                    os.environ[KEY] = "k3y"
                    _sign(root)
                    os.environ.pop(KEY)
            untracked = root + "_untracked"
            if not os.path.isdir(untracked):
                shutil.copytree(root, untracked)
                os.remove(os.path.join(untracked, TRACKER))
            if key is not None:
                os.environ[KEY] = key
            try:
                kind = "signed" if signed else "unsigned"
                out[fmt, kind, "tracker"] = _load(root)
                out[fmt, kind, "--ckpt-step 2"] = _load(root, ckpt_step=2)
                out[fmt, kind, "no tracker, --ckpt-step 2"] = _load(untracked, ckpt_step=2)
            finally:
                os.environ.pop(KEY, None)
    return out


def test_every_way_megatron_chooses_a_checkpoint_is_verified_with_the_key(run_distributed,
                                                                          tmp_path):
    """Old code: with the key, every unsigned case loaded here (the old check sat above this
    read, and there only where a tracker was; torch_dcp never)."""
    keyed, plain = (run_distributed(_every_way, str(tmp_path), key, world_size=1)[0]
                    for key in ("k3y", None))
    for (fmt, kind, how), outcome in keyed.items():
        if kind == "signed":
            assert outcome == "loaded: 2", (fmt, how, outcome)
            continue
        root = tmp_path / (f"{fmt}_unsigned" + ("_untracked" if how.startswith("no") else ""))
        assert outcome == (f"refused: checkpoint {root / 'iter_0000002'} is corrupt: "
                           "mcore_ext_manifest.json missing: MCORE_EXT_CHECKPOINT_KEY is set and "
                           "only a signed checkpoint loads"), (fmt, how, outcome)
    assert set(plain.values()) == {"loaded: 2"}, plain  # without the key: as before


def test_node_local_checkpoints_are_refused_with_the_key(monkeypatch):
    """megatron reads --non-persistent-ckpt-type local checkpoints through nvidia-resiliency-ext's
    manager, which nothing verifies: refused with the key, in one line."""
    from mcore_ext.megatron_lm.pretrain_gpt import FlagError, check_checkpoint_flags

    local = types.SimpleNamespace(non_persistent_ckpt_type="local")
    monkeypatch.delenv(KEY, raising=False)
    check_checkpoint_flags(local)
    check_checkpoint_flags(types.SimpleNamespace(non_persistent_ckpt_type="global"))
    monkeypatch.setenv(KEY, "k3y")
    with pytest.raises(FlagError, match=r"^--non-persistent-ckpt-type local with "
                                        "MCORE_EXT_CHECKPOINT_KEY: "):
        check_checkpoint_flags(local)
    check_checkpoint_flags(types.SimpleNamespace(non_persistent_ckpt_type="global"))
