"""Checkpoint interchange with upstream's key layout, gate mismatches, corruption, inspect CLI."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests import builders




def _config(tp, gate=True, **overrides):
    fields = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=8,
                  add_qkv_bias=True, tensor_model_parallel_size=tp, head_wise_attn_gate=gate)
    fields.update(overrides)
    return builders.gated_config(**fields)


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in _params(model).items())


# --------------------------------------------------------------------------------- interchange


def _save_hand_built(root):
    """At TP=1, write <key>._qkv / <key>._gate from known global blocks, not via the factory."""
    import mcore_ext
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from mcore_ext import checkpoint
    from mcore_ext.checkpoint.sharding import QkvGateFactory

    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    model = builders.build_gpt(_config(1))
    sharded = model.sharded_state_dict()
    layers = 2
    qkv_w = torch.arange(layers * 96 * 64, dtype=torch.float32).view(layers, 96, 64)
    gate_w = -1 - torch.arange(layers * 8 * 64, dtype=torch.float32).view(layers, 8, 64)
    qkv_b = torch.arange(layers * 96, dtype=torch.float32).view(layers, 96) / 7
    gate_b = -torch.arange(layers * 8, dtype=torch.float32).view(layers, 8) / 7
    blocks = {"weight": (qkv_w, gate_w), "bias": (qkv_b, gate_b)}
    for key, factory in list(sharded.items()):
        if not isinstance(factory, QkvGateFactory):
            continue
        qkv, gate = blocks[key.rsplit(".", 1)[-1]]
        offsets = factory.layout.sharded_offsets  # ((layer axis, layer index, layers),)
        layer = offsets[0][1]
        sharded[key] = {
            suffix: ShardedTensor.from_rank_offsets(
                factory.key + suffix, block[layer].clone(), *offsets,
                replica_id=factory.replica_id, prepend_axis_num=len(offsets))
            for suffix, block in ((checkpoint.QKV_SUFFIX, qkv), (checkpoint.GATE_SUFFIX, gate))
        }
    checkpoint.save(sharded, builders.shared_dir(root))
    return blocks


def _load_hand_built(tp, root, blocks):
    import mcore_ext

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    rank, _ = builders.tp_rank_and_size()
    model = builders.build_gpt(_config(tp))
    model.load_state_dict(checkpoint.load(model.sharded_state_dict(), root))
    ok = []
    for layer_index, layer in enumerate(model.decoder.layers):
        linear = layer.self_attention.linear_qkv
        for name in ("weight", "bias"):
            qkv, gate = blocks[name]
            expected = torch.cat([builders.rank_rows(qkv[layer_index], rank, tp),
                                  builders.rank_rows(gate[layer_index], rank, tp)])
            ok.append(torch.equal(getattr(linear, name).detach(), expected))
    return ok


def test_hand_built_upstream_layout_loads_into_the_right_rows(run_distributed, tmp_path):
    root = str(tmp_path / "hand_built")
    blocks = run_distributed(_save_hand_built, root, world_size=2)[0]
    for tp, world_size in ((2, 2), (4, 4)):
        for ok in run_distributed(_load_hand_built, tp, root, blocks, world_size=world_size):
            assert ok == [True] * 4, (tp, ok)


# ---------------------------------------------------------------------------- gate mismatches


def _mismatches(root):
    import mcore_ext

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    plain = builders.build_gpt(_config(2, gate=False), parallel_output=False)
    gated = builders.build_gpt(_config(2, gate=True), parallel_output=False)
    checkpoint.save(plain.sharded_state_dict(), builders.shared_dir(f"{root}/plain"))
    checkpoint.save(gated.sharded_state_dict(), builders.shared_dir(f"{root}/gated"))
    errors = {}

    fresh_gated = builders.build_gpt(_config(2, gate=True), parallel_output=False)
    before = _params(fresh_gated)
    try:
        checkpoint.load(fresh_gated.sharded_state_dict(), f"{root}/plain")
    except checkpoint.GateLayoutMismatch as error:
        errors["plain_into_gated"] = str(error)
    errors["plain_into_gated_untouched"] = _unchanged(fresh_gated, before)

    fresh_plain = builders.build_gpt(_config(2, gate=False), parallel_output=False)
    try:
        checkpoint.load(fresh_plain.sharded_state_dict(), f"{root}/gated")
    except checkpoint.GateLayoutMismatch as error:
        errors["gated_into_plain"] = str(error)

    # The explicit conversion: QKV rows from the ungated checkpoint, gates from init. Opening
    # every gate (weight 0, bias +1e4) must then reproduce the ungated model exactly.
    gate_init = [l.self_attention.linear_qkv.weight[l.self_attention.qkv_rows_per_partition:].clone()
                 for l in fresh_gated.decoder.layers]
    fresh_gated.load_state_dict(checkpoint.load(fresh_gated.sharded_state_dict(), f"{root}/plain",
                                                init_missing_gates=True))
    kept_gate_init = all(
        torch.equal(l.self_attention.linear_qkv.weight[l.self_attention.qkv_rows_per_partition:], g)
        for l, g in zip(fresh_gated.decoder.layers, gate_init))
    with torch.no_grad():
        for layer in fresh_gated.decoder.layers:
            rows = layer.self_attention.qkv_rows_per_partition
            layer.self_attention.linear_qkv.weight[rows:] = 0
            layer.self_attention.linear_qkv.bias[rows:] = 1e4
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand_as(tokens)
    with torch.no_grad():
        converted_diff = (fresh_gated(tokens, positions, None) - plain(tokens, positions, None)).abs().max().item()
    return errors, kept_gate_init, converted_diff


def test_gate_mismatch_errors_and_explicit_conversion(run_distributed, tmp_path):
    for errors, kept_gate_init, converted_diff in run_distributed(_mismatches, str(tmp_path), world_size=2):
        assert "has head_wise_attn_gate=True but checkpoint" in errors["plain_into_gated"]
        assert "decoder.layers.self_attention.linear_qkv.weight._gate" in errors["plain_into_gated"]
        assert "init_missing_gates=True" in errors["plain_into_gated"]
        assert errors["plain_into_gated_untouched"]
        assert "head-wise gate tensors" in errors["gated_into_plain"]
        assert "linear_qkv.bias._gate" in errors["gated_into_plain"]
        assert kept_gate_init
        assert converted_diff <= 1e-5


# ------------------------------------------------------------------------------- corruption


def _corrupted_loads(root):
    import glob

    import mcore_ext
    import torch.distributed as dist

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    checkpoint.save(builders.build_gpt(_config(2)).sharded_state_dict(), builders.shared_dir(f"{root}/good"))
    # The same model except for the head count (16, not 8; hidden size, head dim and query groups
    # unchanged): its gate block has 16 rows, its QKV block (16 + 2 * 2) * 8 rows.
    other = builders.build_gpt(_config(2, num_attention_heads=16))
    checkpoint.save(other.sharded_state_dict(), builders.shared_dir(f"{root}/other_heads"))

    outcomes = {}
    model = builders.build_gpt(_config(2))
    before = _params(model)
    try:
        checkpoint.load(model.sharded_state_dict(), f"{root}/other_heads")
        outcomes["wrong_shape"] = "loaded"
    except checkpoint.CheckpointLoadError as error:
        outcomes["wrong_shape"] = f"CheckpointLoadError: {error}"
    except Exception as error:  # noqa: BLE001  (reported: the test expects CheckpointLoadError)
        outcomes["wrong_shape"] = f"{type(error).__name__}: {error}"

    if dist.get_rank() == 0:  # truncate every data file of the good checkpoint
        for path in glob.glob(f"{root}/good/*.distcp"):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    try:
        checkpoint.load(model.sharded_state_dict(), f"{root}/good")
        outcomes["truncated"] = "loaded"
    except Exception as error:  # noqa: BLE001
        outcomes["truncated"] = f"{type(error).__name__}: {error}"
    outcomes["untouched"] = _unchanged(model, before)
    return outcomes


def test_corrupted_or_mismatched_gate_block_fails_loudly(run_distributed, tmp_path):
    for outcome in run_distributed(_corrupted_loads, str(tmp_path), world_size=2):
        assert outcome["wrong_shape"].startswith("CheckpointLoadError: cannot load checkpoint "), outcome
        assert ("it was saved with num_attention_heads=16 (decoder.layers.self_attention.linear_qkv."
                "weight._gate has 16 gate rows, one per head) but the model has "
                "num_attention_heads=8") in outcome["wrong_shape"], outcome
        assert outcome["truncated"].startswith("CheckpointLoadError: cannot load checkpoint "), outcome
        assert "num_attention_heads" not in outcome["truncated"]  # same heads: no head-count hint
        assert outcome["untouched"], outcome  # nothing was loaded partially


# ---------------------------------------------------------------------------------- inspect


def _save_for_inspect(root, tp):
    import mcore_ext

    from mcore_ext import checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    checkpoint.save(builders.build_gpt(_config(tp)).sharded_state_dict(), builders.shared_dir(root))


def test_inspect_reports_layout_without_the_saving_layout(run_distributed, tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_save_for_inspect, root, 2, world_size=2)
    result = subprocess.run([sys.executable, "-m", "mcore_ext.checkpoint", "inspect", root],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Global shapes, whatever the saving TP: [layers, rows, hidden].
    assert re.search(r"linear_qkv\.weight\._gate\s+\[2, 8, 64\]", result.stdout), result.stdout
    assert re.search(r"linear_qkv\.weight\._qkv\s+\[2, 96, 64\]", result.stdout), result.stdout
    assert ("2 layers, hidden 64, 8 heads, 2 query groups, head dim 8, head-wise gate: yes"
            in result.stdout)

    missing = subprocess.run([sys.executable, "-m", "mcore_ext.checkpoint", "inspect",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "cannot read checkpoint" in missing.stderr


# ---------------------------------------------------------------------------------- vocabulary


def _vocabulary_checks(root):
    """Save a TP 2 model whose untied embedding and output layer have 128 rows; check models of
    other paddings and tokenizers against it. Returns {case: message or None}."""
    import contextlib
    import io

    from megatron.core import dist_checkpointing

    import mcore_ext
    from mcore_ext.training import checkpointing

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    config = _config(2, gate=True)
    saved = builders.build_gpt(config, vocab_size=128, share_embeddings_and_output_weights=False)
    directory = builders.shared_dir(os.path.join(root, "ckpt"))
    dist_checkpointing.save(saved.sharded_state_dict(), directory)
    out = {}
    for case, rows, tokens in (("same padding", 128, 100), ("less padding", 112, 100),
                               ("more padding", 256, 128), ("more tokens", 256, 200)):
        model = builders.build_gpt(config, vocab_size=rows,
                                   share_embeddings_and_output_weights=False)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                checkpointing._check_vocabulary(directory, model.sharded_state_dict(), tokens)
            out[case] = printed.getvalue().strip() or None
        except RuntimeError as err:
            out[case] = f"error: {err}"
    return out


def test_checkpoint_without_a_row_per_token_is_refused(run_distributed, tmp_path):
    """megatron loads vocabulary tensors with allow_shape_mismatch (rows the checkpoint lacks
    start at zero): a changed padding is reported, a checkpoint with fewer rows than the
    tokenizer has tokens is refused (its missing token rows would silently be zero)."""
    results = run_distributed(_vocabulary_checks, str(tmp_path), world_size=2)
    out = results[0]
    assert out["same padding"] is None, out
    for case, change in (("less padding", "128 -> 112"), ("more padding", "128 -> 256")):
        assert out[case].startswith("[checkpoint] vocabulary padding differs"), out
        assert f"embedding.word_embeddings.weight {change}" in out[case], out
        assert f"output_layer.weight {change}" in out[case], out
    assert out["more tokens"].startswith("error: "), out
    assert "has 128 rows, fewer than the 200 tokens" in out["more tokens"], out
    assert "data.tokenizer" in out["more tokens"], out
    assert results[1]["more tokens"] == out["more tokens"]  # every rank refuses


def test_a_verified_checkpoint_changed_afterwards_is_verified_again_on_the_next_load(
        tmp_path, monkeypatch):
    """A process verifies a checkpoint once (an entry point's verification counts for megatron's
    reads after it); a file added or rewritten after that, in a long-lived process (Bridge, a
    notebook), must not load on the old verdict. Old code: the verdict keyed on the manifest's
    own inode and mtime only, so both changes below loaded."""
    from mcore_ext.checkpoint import manifest
    from mcore_ext.checkpoint.errors import CheckpointCorruptError

    monkeypatch.setenv("MCORE_EXT_CHECKPOINT_KEY", "k3y")
    directory = tmp_path / "iter_0000001"
    directory.mkdir()
    for name in ("__0_0.distcp", "metadata.json"):
        (directory / name).write_bytes(name.encode() * 64)
    manifest.write(str(directory), manifest.describe(str(directory), sorted(os.listdir(directory))))
    manifest.check_before_read(str(directory))  # verifies, remembered

    (directory / "common.pt").write_bytes(b"added")
    with pytest.raises(CheckpointCorruptError, match="common.pt not in the manifest"):
        manifest.check_before_read(str(directory))
    (directory / "common.pt").unlink()
    manifest.check_before_read(str(directory))

    shard = directory / "__0_0.distcp"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x10  # same size, its times put back
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp checksum mismatch"):
        manifest.check_before_read(str(directory))


def test_with_the_key_bytes_changed_between_verification_and_the_read_are_refused(
        tmp_path, monkeypatch):
    """Issue 54 (the shape): a load verifies a folder, then torch reads it; a file rewritten in
    between (the same size, its times put back) was read as it then was. Now every DCP read and
    whole-file read checks, after reading, that its folder is still the one verified
    (``manifest.check_unchanged``): refused. The same read of the untouched folder loads."""
    from torch.distributed.checkpoint import load, save

    from mcore_ext.checkpoint import manifest, safe_pickle
    from mcore_ext.checkpoint.errors import CheckpointCorruptError

    monkeypatch.setenv("MCORE_EXT_CHECKPOINT_KEY", "k3y")
    directory = tmp_path / "iter_0000001"
    save({"w": torch.arange(64.0)}, checkpoint_id=str(directory), no_dist=True)
    torch.save({"iteration": 1}, directory / "common.pt")
    manifest.write(str(directory), manifest.describe(str(directory), sorted(os.listdir(directory))))

    def read():
        state = {"w": torch.zeros(64)}
        load(state, checkpoint_id=str(directory), no_dist=True)
        return state["w"], safe_pickle.load_file(directory / "common.pt")

    assert manifest.verify_checkpoint(str(directory), collective=False) == []
    weights, common = read()
    assert torch.equal(weights, torch.arange(64.0)) and common == {"iteration": 1}

    (shard,) = directory.glob("*.distcp")
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(BaseException, match=f"checkpoint {directory} is not the one verified"):
        read()  # torch's DCP raises it as a CheckpointException holding the error
    with pytest.raises(CheckpointCorruptError, match=f"checkpoint {directory} is not the one"):
        safe_pickle.load_file(directory / "common.pt")
    monkeypatch.delenv("MCORE_EXT_CHECKPOINT_KEY")
    read()  # without a key: damage only, which verification (not this read) finds
