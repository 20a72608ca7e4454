"""mcore_ext.hf without megatron models: config forms and refusals, the fused row layouts against
megatron's layout written independently (tests/builders.py), and the streaming safetensors files.
"""

import json
import os

import pytest
import torch

from mcore_ext.hf import layout
from mcore_ext.hf.config import HFConfigError, Step35Config
from mcore_ext.hf.safetensors_io import (
    INDEX_NAME,
    SafetensorsError,
    SafetensorsReader,
    ShardedSafetensorsWriter,
)
from tests import builders
from tests.hf import models


def _modern():
    pytest.importorskip("transformers")
    return models.tiny_config().to_dict()


def test_released_legacy_and_transformers_configs_read_the_same():
    modern = _modern()
    legacy = models.legacy_config_dict(modern)
    nested = {"model_type": "step3p7", "text_config": dict(modern)}
    a, b, c = (Step35Config.from_hf_dict(x) for x in (modern, legacy, nested))
    for other in (b, c):
        assert dataclass_fields(a) == dataclass_fields(other)
    assert a.layer_types == ["full_attention", "sliding_attention", "sliding_attention",
                             "full_attention"]  # the legacy MTP entry was trimmed
    assert (a.num_heads, a.num_sliding_heads, a.num_kv_heads) == (4, 8, 4)
    assert a.rope_theta == {"full_attention": 10000.0, "sliding_attention": 500.0}
    assert a.partial_rotary_factor == {"full_attention": 0.5, "sliding_attention": 1.0}
    assert a.swiglu_limits == [None, 1.0, 1.0, None]
    assert (b.num_mtp_layers, b.mtp_layer_types, b.mtp_swiglu_limits) == (
        1, ["full_attention"], [None])


def test_sliding_kv_heads_read_from_every_form_and_written_for_transformers():
    pytest.importorskip("transformers")
    from transformers import Step3p7TextConfig

    modern = models.tiny_config(num_key_value_heads=2, sliding_kv_heads=1).to_dict()
    for raw in (modern, models.legacy_config_dict(modern)):
        spec = Step35Config.from_hf_dict(raw)
        assert (spec.kv_heads(0), spec.kv_heads(1), spec.heads(1)) == (2, 1, 8)
    out = spec.to_hf_dict()
    hf = Step3p7TextConfig(**{k: v for k, v in out.items() if k != "model_type"})
    assert [hf.per_layer_config[i].num_key_value_heads for i in range(4)] == [2, 1, 1, 2]
    assert out["attention_other_setting"]["num_attention_groups"] == 1  # what vLLM reads
    bad = dict(modern, per_layer_config={"1": {"num_key_value_heads": 1},
                                         "2": {"num_key_value_heads": 2}})
    with pytest.raises(HFConfigError, match=r"per_layer_config\[2\].num_key_value_heads=2 "
                                            "differs"):
        Step35Config.from_hf_dict(bad)


def dataclass_fields(spec):
    """The fields both forms hold: the legacy form pads one MTP layer onto its lists, which
    transformers' saved config (no num_nextn_predict_layers) does not have."""
    fields = dict(vars(spec))
    for key in ("extra", "num_mtp_layers", "mtp_layer_types", "mtp_swiglu_limits"):
        fields.pop(key)
    return fields


def test_exported_config_reads_back_in_transformers_and_here():
    modern = _modern()
    from transformers import Step3p7TextConfig

    spec = Step35Config.from_hf_dict(modern)
    out = spec.to_hf_dict()
    assert out["architectures"] == ["Step3p5ForCausalLM"] and out["model_type"] == "step3p5"
    hf = Step3p7TextConfig(**{k: v for k, v in out.items() if k != "model_type"})
    assert [hf.per_layer_config[i].num_attention_heads for i in range(4)] == [4, 8, 8, 4]
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 500.0
    assert hf.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.5
    assert hf.swiglu_limits_shared == [0.0, 1.0, 1.0, 0.0]
    assert hf.mlp_layer_types == ["dense"] * 4
    assert dataclass_fields(Step35Config.from_hf_dict(out)) == dataclass_fields(spec)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"mlp_layer_types": None, "moe_router_activation": "softmax"},  # MoE from 3 on
     "moe_router_activation='softmax'"),
    ({"mlp_layer_types": None, "norm_expert_weight": False}, "norm_expert_weight=False"),
    ({"mlp_layer_types": None, "use_moe_router_bias": False}, "use_moe_router_bias=False"),
    ({"mlp_layer_types": None, "num_experts_per_tok": 1}, "moe_top_k=1"),
    ({"mlp_layer_types": None, "num_nextn_predict_layers": 1, "moe_layers_enum": "4"},
     r"MTP layers \[4\] are MoE"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"gating": "full"}, "gating='full'"),
    ({"layer_types": ["full_attention"] * 3 + ["chunked"]}, r"layer_types\[3\]='chunked'"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    raw = dict(models.TINY_RELEASED)
    raw.update(change)
    if change.get("mlp_layer_types", 0) is None:  # MoE layers from moe_layers_enum, else 3 on
        raw.pop("mlp_layer_types")
        if "moe_layers_enum" not in change:
            raw.pop("moe_layers_enum")
    with pytest.raises(HFConfigError, match=message):
        Step35Config.from_hf_dict(raw)


@pytest.mark.parametrize("heads, groups, tp", [(8, 2, 1), (8, 2, 2), (8, 4, 4), (8, 2, 4),
                                               (8, 1, 8)])
def test_qkv_gate_rows_per_rank_follow_megatrons_layout(heads, groups, tp):
    hn, h = 4, 6
    q, k, v = (torch.randn(n * hn, h) for n in (heads, groups, groups))
    g = torch.randn(heads, h)
    mapping = layout.QkvGate(heads, groups, hn)
    qkv = builders.interleave_qkv(q, k, v, heads, groups)  # the independent reference
    locals_ = [mapping.to_local([q, k, v, g], r, tp) for r in range(tp)]
    for r, local in enumerate(locals_):
        expected = torch.cat([builders.rank_rows(qkv, r, tp), builders.rank_rows(g, r, tp)])
        assert torch.equal(local, expected)
    for got, want in zip(mapping.from_locals(locals_), (q, k, v, g)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glu_rows_per_rank_are_gate_then_up(tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    locals_ = [layout.Glu().to_local([gate, up], r, tp) for r in range(tp)]
    for r, local in enumerate(locals_):
        assert torch.equal(local, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
    back = layout.Glu().from_locals(locals_)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_vocab_rows_are_padded_with_zeros_and_stripped():
    emb = torch.randn(10, 3)
    mapping = layout.Split(dim=0, rows=10, padded_rows=16)
    locals_ = [mapping.to_local([emb], r, 4) for r in range(4)]
    assert all(t.shape == (4, 3) for t in locals_) and not locals_[3][2:].any()
    assert torch.equal(mapping.from_locals(locals_)[0], emb)


def _plan(tensors):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_writer_shards_by_size_with_an_index_that_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    tensors = {f"t{i}": torch.randn(64, 16, dtype=dt) for i, dt in
               enumerate([torch.float32, torch.bfloat16, torch.float32, torch.float16])}
    out = tmp_path / "hf"
    with ShardedSafetensorsWriter(str(out), _plan(tensors), max_shard_bytes=6144,
                                  extra_files={"config.json": "{}"}) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
    index = json.loads((out / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2  # 4096 + 2048 | 4096 + 2048 bytes, at most 6144 each
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    reader = SafetensorsReader(str(out))
    assert torch.equal(reader.get("t1"), tensors["t1"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".hf-export")]


def test_failed_write_leaves_nothing(tmp_path):
    tensors = {"a": torch.randn(4), "b": torch.randn(4)}
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedSafetensorsWriter(str(out), _plan(tensors)) as writer:
            writer.write("a", tensors["a"])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_truncated_and_missing_files_are_reported(tmp_path):
    directory = models.write_released(str(tmp_path / "hf"))
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    path = tmp_path / "hf" / last
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(SafetensorsError, match=f"{last}: truncated"):
        SafetensorsReader(directory)
    path.unlink()
    with pytest.raises(SafetensorsError, match=f"{last}: missing"):
        SafetensorsReader(directory)


def test_export_refuses_a_model_the_layout_cannot_hold_naming_each_field():
    from mcore_ext.config import GatedTransformerConfig

    # configs/tiny_cpu.yaml's model: QKV bias, plain RMSNorm, no q/k norms.
    config = GatedTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    head_wise_attn_gate=True, add_qkv_bias=True,
                                    add_bias_linear=False, gated_linear_unit=True,
                                    normalization="RMSNorm",
                                    activation_func=torch.nn.functional.silu)
    with pytest.raises(HFConfigError) as err:
        Step35Config.from_transformer_config(config, vocab_size=257, max_position_embeddings=64,
                                             position_embedding_type="learned_absolute")
    for field in ("add_qkv_bias=True", "layernorm_zero_centered_gamma=False",
                  "qk_layernorm=False", "position_embedding_type='learned_absolute'"):
        assert field in str(err.value)


def test_partial_mtp_layers_and_extra_tensors_are_refused(tmp_path):
    from safetensors.torch import save_file

    from mcore_ext.hf.convert import check_weights, read_hf_config, resolve_mtp

    directory = models.write_released(str(tmp_path / "hf"))
    _, spec = read_hf_config(directory)
    assert spec.num_mtp_layers == 1  # the legacy config declares one MTP layer ...
    spec = resolve_mtp(SafetensorsReader(directory), spec)
    assert spec.num_mtp_layers == 0  # ... the weights hold none: the decoder alone
    assert check_weights(SafetensorsReader(directory), spec) == torch.float32

    index_path = os.path.join(directory, INDEX_NAME)
    index = json.load(open(index_path))
    # The released checkpoint appends its MTP layers after the decoder's (here layer 4).
    save_file({"model.layers.4.eh_proj.weight": torch.zeros(2, 2)},
              os.path.join(directory, "mtp.safetensors"))
    index["weight_map"]["model.layers.4.eh_proj.weight"] = "mtp.safetensors"
    json.dump(index, open(index_path, "w"))
    _, declared = read_hf_config(directory)
    reader = SafetensorsReader(directory)
    with pytest.raises(HFConfigError, match="missing.*model.layers.4"):
        check_weights(reader, resolve_mtp(reader, declared))
    with pytest.raises(HFConfigError, match="not part of the Step-3.5 model.*eh_proj"):
        check_weights(reader, spec)  # MTP tensors the config does not declare are not dropped

    save_file({"model.extra.weight": torch.zeros(2)}, os.path.join(directory, "x.safetensors"))
    index["weight_map"]["model.extra.weight"] = "x.safetensors"
    del index["weight_map"]["model.layers.4.eh_proj.weight"]
    os.remove(os.path.join(directory, "mtp.safetensors"))
    json.dump(index, open(index_path, "w"))
    with pytest.raises(HFConfigError, match="not part of the Step-3.5 model.*model.extra"):
        check_weights(SafetensorsReader(directory), spec)


def _full_layer_fields():
    """GatedTransformerConfig fields of the tiny model with full layers only (a global
    window_size excludes layer kinds)."""
    spec = Step35Config.from_hf_dict(models.TINY_RELEASED)
    spec = spec.replace(layer_types=["full_attention"] * spec.num_layers, num_sliding_heads=None,
                        sliding_window=None)
    return spec.transformer_config_fields()


# What megatron can compute and the Step-3.5 layout cannot hold: each is refused by name.
UNHOLDABLE = [
    ("rotary_interleaved", True, "rotary_interleaved=True"),
    ("window_size", (3, 0), r"window_size=\(3, 0\)"),
    ("qk_l2_norm", True, "qk_l2_norm=True"),
    ("no_rope_freq", 2, r"no_rope_freq=\[0, 1, 0, 1\]"),
    ("softmax_type", "off-by-one", "softmax_type='off-by-one'"),
    ("softmax_type", "learnable", "softmax_type='learnable'"),
    ("use_mup", True, "use_mup=True"),
]


@pytest.mark.parametrize("field, value, message", UNHOLDABLE)
def test_export_refuses_what_the_layout_cannot_hold(field, value, message):
    from mcore_ext.config import GatedTransformerConfig

    fields = _full_layer_fields()
    Step35Config.from_transformer_config(GatedTransformerConfig(**fields), vocab_size=257,
                                         max_position_embeddings=64)  # the base model fits
    config = GatedTransformerConfig(**fields, **{field: value})
    with pytest.raises(HFConfigError, match=message):
        Step35Config.from_transformer_config(config, vocab_size=257, max_position_embeddings=64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rope_scaling=True), "rope_scaling=True"),
    (dict(seq_len_interpolation_factor=2.0), "seq_len_interpolation_factor=2.0"),
])
def test_export_refuses_rope_scaling_by_name(kwargs, message):
    from mcore_ext.config import GatedTransformerConfig

    config = GatedTransformerConfig(**_full_layer_fields())
    with pytest.raises(HFConfigError, match=message):
        Step35Config.from_transformer_config(config, vocab_size=257, max_position_embeddings=64,
                                             **kwargs)


def _write_export(directory, tensors, config, max_shard_bytes=2 * 1024**3):
    with ShardedSafetensorsWriter(str(directory), _plan(tensors), max_shard_bytes=max_shard_bytes,
                                  extra_files={"config.json": json.dumps(config)}) as writer:
        for name, t in tensors.items():
            writer.write(name, t)


def _kill_inside(fn, at: int) -> bool:
    """Run ``fn`` in a forked child that SIGKILLs itself before its ``at``-th file-system change
    (remove, unlink, rmdir, rename, replace, link): True if ``fn`` finished first."""
    import signal

    pid = os.fork()
    if pid == 0:
        changes = [0]

        def dying(op):
            def call(*args, **kwargs):
                if changes[0] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
                changes[0] += 1
                return op(*args, **kwargs)
            return call

        for name in ("remove", "unlink", "rmdir", "rename", "replace", "link"):
            setattr(os, name, dying(getattr(os, name)))
        try:
            fn()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status)


def test_writer_killed_anywhere_in_close_never_leaves_config_without_its_weights(tmp_path):
    """Replacing an earlier export (3 shards, index, a tokenizer file beside them) with a new one
    (one file), killed before each file-system change of ``close()`` in turn: the folder holds
    the old export or the new one, complete, each time (or, between two renames, the old one
    moved aside, which the next writer puts back); the tokenizer file is never lost."""
    old = {f"t{i}": torch.full((256,), float(i)) for i in range(3)}
    new = {f"t{i}": torch.full((256,), 10.0 + i) for i in range(2)}
    for at in range(20):
        target = tmp_path / f"kill_{at}" / "hf"
        _write_export(target, old, {"version": "old"}, max_shard_bytes=1024)
        assert len(os.listdir(target)) == 5  # 3 shards, index, config
        (target / "tokenizer.json").write_text("{}")
        writer = ShardedSafetensorsWriter(str(target), _plan(new), extra_files={
            "config.json": json.dumps({"version": "new"})})
        for name, t in new.items():
            writer.write(name, t)
        finished = _kill_inside(writer.close, at)
        aside = target.parent / f".replaced.{target.name}"
        if not target.exists():  # killed between the two renames
            assert (aside / "config.json").exists(), (at, os.listdir(target.parent))
            from mcore_ext.checkpoint.directory import recover_dir

            recover_dir(str(target))
        assert (target / "tokenizer.json").exists(), at
        version = json.loads((target / "config.json").read_text())["version"]
        reader = SafetensorsReader(str(target))  # every weight file of the config's export is there
        expected = old if version == "old" else new
        assert sorted(reader.names) == sorted(expected), (at, version, os.listdir(target))
        assert all(torch.equal(reader.get(n), t) for n, t in expected.items()), (at, version)
        if finished:
            assert version == "new" and at > 0
            assert sorted(os.listdir(target)) == ["config.json", "model.safetensors",
                                                  "tokenizer.json"], os.listdir(target)
            break
    else:
        raise AssertionError("close() did not finish within 20 file-system changes")
