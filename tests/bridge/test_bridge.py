"""Megatron-Bridge 0.6.2: ``GatedGPTModelProvider``, ``GatedHybridModelProvider`` and the
registered ``Step3p5ForCausalLM`` bridge (mcore_ext.bridge), on CPU with real gloo ranks.

Needs the test-only environment of ``scripts/setup_bridge.sh`` (.venv-bridge: Bridge installed
without its dependencies next to the project's venv); scripts/test.sh (CI) runs it after the
main suite:

    PYTHONPATH=$PWD .venv-bridge/bin/python -m pytest tests/bridge -m bridge

Without Transformer Engine, ONE Bridge module is stubbed: ``megatron.bridge.peft.lora_layers``
(see tests/bridge/bridge_env.py; Bridge imports TE unconditionally only there). Nothing else of
Bridge or megatron is patched.

- The provider defers every check to ``finalize()``: a bad gate config constructs, Bridge's own
  ``finalize`` accepts it (GatedTransformerConfig.__post_init__ never runs in this MRO), and
  ``GatedGPTModelProvider.finalize`` raises naming the fields.
- ``provide()`` at TP 2 builds mcore_ext's gated attention with ``[QKV_r ; Gate_r]`` rows and
  runs a forward whose logits depend on the gate rows.
- ``GatedHybridModelProvider`` (Bridge's HybridModelProvider building mcore_ext's HybridModel):
  ``from_gpt`` of a configured GPT provider at TP 2 x SP gives the GPT provider's logits for the
  same weights (fp32, 1e-5), its dist checkpoint saves and loads bit for bit, and it refuses
  at ``finalize()`` what build_hybrid_model does not build.
- A tiny HF Step-3.5 checkpoint (tests/hf/models.py: two layer kinds with different head counts,
  a sliding window, per-kind RoPE, a SwiGLU clamp) loads through ``AutoBridge`` into a model
  whose fp32 logits equal ``mcore_ext.hf.load_pretrained``'s within 1e-6 at TP 2 (which
  tests/hf checks against transformers), and Bridge's export gives back every HF tensor bit for
  bit through ``export_hf_weights`` (Bridge's streaming export). Not run: ``save_hf_weights`` /
  ``save_hf_pretrained``, which import NVIDIA ModelOpt (``modelopt.torch.quantization``) at call
  time, not installed here; ``save_hf_pretrained`` also copies the source's tokenizer, which the
  tiny checkpoint does not have.
- docs/bridge.md's snippet, run as written, loads a checkpoint with an MTP layer (mapped through
  mcore_ext.hf.layout's MTP table) and exports it bit for bit; a MoE checkpoint is refused when
  its config is read; ``import mcore_ext.bridge`` without TE is one clear ImportError.
"""

import importlib.util
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bridge.bridge_env import bridge_installed
from tests.hf import models

pytestmark = pytest.mark.bridge
if not bridge_installed():
    pytest.skip("megatron.bridge is not installed (scripts/setup_bridge.sh builds .venv-bridge)",
                allow_module_level=True)
pytest.importorskip("transformers")

TOL = 1e-6
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "bridge.md"
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, vocab_size=64, seq_length=16)


def _provider(**overrides):
    from tests.bridge.bridge_env import import_bridge

    bridge = import_bridge()
    fields = dict(TINY, head_wise_attn_gate=True, add_qkv_bias=True, mcore_ext_backend="sdpa",
                  use_cpu_initialization=True, gradient_accumulation_fusion=False,
                  masked_softmax_fusion=False, bias_activation_fusion=False,
                  bias_dropout_fusion=False, apply_rope_fusion=False,
                  cross_entropy_loss_fusion=False, persist_layer_norm=False)
    fields.update(overrides)
    return bridge.GatedGPTModelProvider(**fields)


def test_finalize_runs_the_gate_checks_that_bridge_defers():
    bad = _provider(attention_output_gate=True)  # constructs: Bridge defers __post_init__
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    GPTModelProvider.finalize(bad)  # Bridge's own finalize does not see the gate
    with pytest.raises(ValueError, match="attention_output_gate=True are mutually exclusive"):
        bad.finalize()
    with pytest.raises(ValueError, match="layer_types entry 'dense' is not one of"):
        _provider(layer_types=["dense", "full_attention"]).finalize()
    with pytest.raises(ValueError, match="transformer_layer_spec=.* would replace"):
        _provider(transformer_layer_spec=lambda config: None).finalize()
    good = _provider(layer_types=["full_attention", "sliding_attention"], sliding_window=4,
                     sliding_num_attention_heads=8)
    good.finalize()
    assert good.heterogeneous_block_specs  # set by mcore_ext's post-init (kinds differ in shape)
    assert good.sliding_config().window_size == (3, 0)


def _provide_and_forward(tp):
    import mcore_ext
    from mcore_ext.attention import HeadWiseGatedSelfAttention

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    provider = _provider(tensor_model_parallel_size=tp)
    provider.finalize()
    model = provider.provide().eval()
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, HeadWiseGatedSelfAttention)
    rows = attention.linear_qkv.weight.shape[0]
    tokens = models.tokens(batch=2, seq=8) % TINY["vocab_size"]
    positions = torch.arange(8).expand_as(tokens)
    with torch.no_grad():
        before = model(tokens, positions, None)
        qkv_rows = provider.qkv_rows // tp
        attention.linear_qkv.weight[qkv_rows:] = 0.0  # this rank's gate rows
        attention.linear_qkv.bias[qkv_rows:] = -30.0  # gates closed: sigmoid(-30) ~ 1e-13
        after = model(tokens, positions, None)
    return rows, provider.linear_qkv_rows, tuple(before.shape), (before - after).abs().max().item()


def test_provider_builds_and_runs_the_gated_model_at_tp2(run_distributed):
    results = run_distributed(_provide_and_forward, 2, world_size=2, timeout=300)
    for rows, linear_qkv_rows, shape, gate_effect in results:
        # (4 + 2 * 2) * 16 QKV rows + 4 gate rows, half per rank
        assert linear_qkv_rows == 132 and rows == 66
        assert shape == (2, 8, TINY["vocab_size"] // 2)
        assert gate_effect > 1e-3  # closing the gates changes the logits


# ------------------------------------------------------------------ HybridModel (issue 36)

KINDS = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4,
             sliding_num_attention_heads=8, swiglu_limits=[0.0, 7.0], gated_linear_unit=True,
             activation_func=torch.nn.functional.silu)


def test_hybrid_provider_refuses_what_it_does_not_build():
    """Bridge's HybridModelProvider fields build_hybrid_model does not implement are named at
    finalize(), as the GPT provider's are; Bridge's own finalize would count every symbol of the
    pattern as a layer (num_layers 4 for '*-*-'): this one keeps the GPT layers' 2."""
    from tests.bridge.bridge_env import import_bridge

    bridge = import_bridge()
    gpt = _provider(**KINDS)
    hybrid = bridge.GatedHybridModelProvider.from_gpt(gpt, hybrid_layer_pattern="*-*-")
    hybrid.finalize()
    assert hybrid.num_layers == 2 and hybrid.hybrid_layer_pattern == "*-*-"
    assert hybrid.heterogeneous_block_specs  # mcore_ext's post-init ran (kinds differ in shape)
    assert hybrid.sliding_config().window_size == (3, 0)
    refused = [
        ("hybrid_layer_pattern='*-*-*-' has 3 attention layers ('*'), num_layers is 2",
         dict(hybrid_layer_pattern="*-*-*-")),
        ("hybrid_layer_pattern='*M*-': symbol 'M' is not one of", dict(hybrid_layer_pattern="*M*-")),
        ("hybrid_override_pattern='*-*-' is deprecated", dict(hybrid_override_pattern="*-*-")),
        ("hybrid_mlp_ratio=0.5 is not supported", dict(hybrid_mlp_ratio=0.5)),
        ("mtp_num_layers=1: MTP is not built on HybridModel", dict(mtp_num_layers=1)),
    ]
    for message, fields in refused:
        with pytest.raises(ValueError, match=re.escape(message)):
            bridge.GatedHybridModelProvider(**{**_fields(gpt), **fields}).finalize()
    with pytest.raises(ValueError, match="hybrid_stack_spec=.* would replace"):
        bridge.GatedHybridModelProvider(**_fields(gpt), hybrid_stack_spec=lambda: None).finalize()
    gpt.register_pre_wrap_hook(lambda model: model)  # what load_weights=True registers
    with pytest.raises(ValueError, match="has pre-wrap hooks .* load GPTModel's parameters"):
        bridge.GatedHybridModelProvider.from_gpt(gpt)


def _fields(provider) -> dict:
    """The constructor fields of ``provider`` the hybrid provider declares."""
    import dataclasses

    from mcore_ext.bridge import GatedHybridModelProvider

    ours = {field.name for field in dataclasses.fields(GatedHybridModelProvider) if field.init}
    return {field.name: getattr(provider, field.name) for field in dataclasses.fields(provider)
            if field.init and field.name in ours and field.name != "transformer_layer_spec"}


def _hybrid_like_gpt_and_checkpointed(directory, tp):
    """The GPT provider's model and the hybrid provider's of the same config at TP ``tp``, the
    GPT weights copied into the hybrid model (megatron's GPT -> hybrid names): this rank's
    logits of both. Then the hybrid model saved with megatron's dist_checkpointing (what
    Bridge's checkpointing calls) and loaded into a hybrid model of another seed: its tensors
    and logits."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import mcore_ext
    from mcore_ext.models.hybrid import copy_weights
    from tests.bridge.bridge_env import import_bridge

    bridge = import_bridge()  # first: it stubs lora_layers before Bridge imports it
    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    try:
        gpt_provider = _provider(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **KINDS)
        gpt_provider.finalize()
        provider = bridge.GatedHybridModelProvider.from_gpt(gpt_provider)
        provider.finalize()
        torch.manual_seed(0)
        (gpt,) = gpt_provider.provide_distributed_model(wrap_with_ddp=False,
                                                        use_cpu_initialization=True)
        (hybrid,) = provider.provide_distributed_model(wrap_with_ddp=False,
                                                       use_cpu_initialization=True)
        copy_weights(gpt, hybrid, to_hybrid=True)
        tokens = models.tokens(batch=2, seq=8) % TINY["vocab_size"]
        positions = torch.arange(8).expand_as(tokens)
        with torch.no_grad():
            gpt_logits = gpt.eval()(tokens, positions, None)
            hybrid_logits = hybrid.eval()(tokens, positions, None)

        if dist.get_rank() == 0:
            os.makedirs(directory)
        dist.barrier()
        dist_checkpointing.save(hybrid.sharded_state_dict(), directory)
        torch.manual_seed(1)
        (loaded,) = provider.provide_distributed_model(wrap_with_ddp=False,
                                                       use_cpu_initialization=True)
        differed = any(not torch.equal(a, b) for a, b in
                       zip(hybrid.state_dict().values(), loaded.state_dict().values())
                       if torch.is_tensor(a))
        loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), directory))
        unequal = [name for name, tensor in hybrid.state_dict().items()
                   if torch.is_tensor(tensor) and not torch.equal(tensor, loaded.state_dict()[name])]
        with torch.no_grad():
            loaded_logits = loaded.eval()(tokens, positions, None)
        # megatron's HybridModel, as mcore_ext builds it (a subclass that adapts MTP's forward)
        return dict(types=[cls.__name__ for cls in type(hybrid).__mro__],
                    shape=tuple(hybrid_logits.shape),
                    diff=(hybrid_logits - gpt_logits).abs().max().item(),
                    differed=differed, unequal=unequal,
                    reloaded=torch.equal(loaded_logits, hybrid_logits),
                    keys=sorted(hybrid.state_dict()))
    finally:
        mcore_ext.destroy_parallel()


def test_hybrid_provider_computes_the_gpt_providers_logits_and_checkpoints_at_tp2(
        run_distributed, tmp_path):
    """``GatedHybridModelProvider.from_gpt`` at TP 2 x SP (fp32, the gate, full and sliding
    kinds, a SwiGLU clamp): megatron's HybridModel with the GPT provider's weights gives its
    logits (1e-5); saved and loaded through dist_checkpointing, every tensor and the logits come
    back bit for bit."""
    results = run_distributed(_hybrid_like_gpt_and_checkpointed, str(tmp_path / "ckpt"), 2,
                              world_size=2, timeout=300)
    for result in results:
        assert "HybridModel" in result["types"] and "GPTModel" not in result["types"], result
        assert result["shape"] == (2, 8, TINY["vocab_size"] // 2)
        assert result["diff"] <= 1e-5, result["diff"]
        assert result["differed"]  # the other seed's model was another model before the load
        assert result["unequal"] == [] and result["reloaded"]
        keys = result["keys"]
        assert "decoder.final_norm.weight" in keys  # HybridModel's names: 2 GPT layers, 4 hybrid
        assert any(key.startswith("decoder.layers.3.mlp.") for key in keys)
        assert "decoder.layers.2.self_attention.linear_qkv.weight" in keys


# ------------------------------------------------------------------------- HF Step-3.5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return models.save_released(models.build(), str(tmp_path_factory.mktemp("hf") / "tiny"))


def _gathered_logits(model, tokens):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    with torch.no_grad():
        out = model(tokens, positions, None).contiguous()
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : models.VOCAB]


def _import_export(hf_dir, tp):
    from tests.bridge.bridge_env import import_bridge

    bridge_module = import_bridge()  # first: it stubs lora_layers before Bridge imports it
    import mcore_ext
    from megatron.bridge import AutoBridge

    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    assert isinstance(bridge._model_bridge, bridge_module.GatedStep35Bridge)
    provider = bridge.to_megatron_provider(load_weights=True)
    assert isinstance(provider, bridge_module.GatedGPTModelProvider)
    provider.tensor_model_parallel_size = tp
    provider.mcore_ext_backend = "sdpa"
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    model[0].eval()
    tokens = models.tokens()
    logits = _gathered_logits(model[0], tokens)
    reference = _gathered_logits(load_pretrained(hf_dir, backend="sdpa").eval(), tokens)

    exported = {name: tensor.clone() for name, tensor in
                bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    return (logits - reference).abs().max().item(), exported


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_hf_step35_loads_like_load_pretrained_and_exports_bit_exact(run_distributed, hf_dir):
    results = run_distributed(_import_export, hf_dir, 2, world_size=2, timeout=300)
    source = _tensors(hf_dir)
    for diff, exported in results:
        assert diff <= TOL, f"max abs logit diff vs load_pretrained {diff:.3g} > {TOL}"
        assert sorted(exported) == sorted(source)
        for name, tensor in source.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


# ------------------------------------------------------- MTP, the documented snippet, MoE, TE


@pytest.fixture(scope="module")
def hf_mtp_dir(tmp_path_factory):
    """The dense tiny checkpoint in the released layout with its MTP layer's tensors (global
    layer num_layers: dense, sliding, its own norm and head), which transformers never saves."""
    model = models.build()
    directory = models.save_released(model, str(tmp_path_factory.mktemp("hf") / "mtp"))
    config = models.add_tensors(directory, models.mtp_tensors(model.config), "mtp.safetensors")
    n = config["num_hidden_layers"]
    config["layer_types"][n] = "sliding_attention"  # Step's MTP layers are sliding
    config["rope_theta"][n] = config["rope_theta"][1]
    config["partial_rotary_factors"][n] = config["partial_rotary_factors"][1]
    models.write_config(directory, config)
    return directory


def documented_snippet() -> str:
    """The python block of docs/bridge.md."""
    return DOCS.read_text().split("```python\n", 1)[1].split("```", 1)[0]


def _gathered(local_logits):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(local_logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local_logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : models.VOCAB]


def _run_documented_snippet(hf_dir):
    """docs/bridge.md's block as written (its path replaced), then its model's logits and MTP
    logits against mcore_ext.hf.load_pretrained's, and what it exported."""
    from tests.bridge.bridge_env import import_bridge

    import_bridge()  # without TE: the test stub of the one module that imports it
    from mcore_ext.hf import load_pretrained
    from mcore_ext.models import mtp_logits

    code = documented_snippet()
    assert '"path/to/step3p5"' in code
    namespace = {}
    exec(compile(code.replace('"path/to/step3p5"', repr(hf_dir)), str(DOCS), "exec"), namespace)
    model = namespace["model"][0].eval()
    reference = load_pretrained(hf_dir, backend="sdpa").eval()
    tokens = models.tokens()
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    diffs = {}
    with torch.no_grad():
        diffs["logits"] = (_gathered(model(tokens, positions, None))
                           - _gathered(reference(tokens, positions, None))).abs().max().item()
        ours, theirs = mtp_logits(model, tokens, positions), mtp_logits(reference, tokens, positions)
    assert len(ours) == len(theirs) == 1
    valid = tokens.size(1) - 1  # depth 0 has a real input token before the last position
    diffs["mtp"] = (_gathered(ours[0])[:, :valid] - _gathered(theirs[0])[:, :valid]).abs().max()
    diffs["mtp"] = diffs["mtp"].item()
    return diffs, {name: t.clone() for name, t in namespace["exported"].items()}


def test_documented_snippet_imports_and_exports_mtp_exactly(run_distributed, hf_mtp_dir):
    """The MTP depth maps through mcore_ext.hf.layout's tables: the snippet of docs/bridge.md
    (init_parallel, use_cpu_initialization on a CPU) loads a checkpoint with an MTP layer at
    TP 2, its main and MTP logits equal load_pretrained's (<= 1e-6), and export gives back every
    tensor, MTP ones included, bit for bit. Before: HFConfigError, 13 unmapped MTP parameters."""
    results = run_distributed(_run_documented_snippet, hf_mtp_dir, world_size=2, timeout=300)
    source = _tensors(hf_mtp_dir)
    assert any(name.startswith("model.layers.4.eh_proj") for name in source)
    for diffs, exported in results:
        assert diffs["logits"] <= TOL and diffs["mtp"] <= TOL, diffs
        assert sorted(exported) == sorted(source)
        for name, tensor in source.items():
            assert exported[name].dtype == tensor.dtype, name
            assert torch.equal(exported[name], tensor), name


def test_moe_checkpoint_is_refused_when_its_config_is_read(tmp_path):
    from tests.bridge.bridge_env import import_bridge

    import_bridge()
    from megatron.bridge import AutoBridge

    from mcore_ext.hf.config import HFConfigError

    directory, _ = models.save_moe(models.build_moe(), str(tmp_path / "moe"))
    bridge = AutoBridge.from_hf_pretrained(directory)
    with pytest.raises(HFConfigError, match=r"config.json makes layers \[1, 2, 3\] MoE "
                                            r"\(mlp_layer_types / moe_layers_enum, "
                                            r"moe_num_experts=8\)"):
        bridge.to_megatron_provider(load_weights=False)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed")
def test_import_without_transformer_engine_is_one_clear_error():
    result = subprocess.run([sys.executable, "-c", "import mcore_ext.bridge"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "ImportError: mcore_ext.bridge imports Megatron-Bridge 0.6, which needs Transformer "
        "Engine (imported unconditionally by megatron.bridge.peft.lora_layers)"), result.stderr


# ------------------------------------------------- checkpoints never run code (issue 37)


def test_importing_mcore_ext_bridge_alone_restricts_checkpoint_pickles():
    """A Bridge user imports ``mcore_ext.bridge`` and nothing else of mcore_ext: that import must
    put the restricted reads and the manifest check in front of every load in place (a fresh
    interpreter, so no other test's import counts)."""
    code = ("from tests.bridge.bridge_env import import_bridge; import_bridge(); "
            "from torch.distributed.checkpoint import filesystem, default_planner; "
            "from megatron.core.dist_checkpointing import serialization; "
            "print(getattr(filesystem.FileSystemReader.read_metadata, '_mcore_ext_safe', False), "
            "getattr(default_planner.DefaultLoadPlanner.load_bytes, '_mcore_ext_safe', False), "
            "getattr(serialization.verify_checkpoint, '_mcore_ext', False))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].split() == ["True"] * 3, done.stdout[-3000:]


def _save_provider_model(directory):
    """The provider's gated model at TP 2 (parallel state initialised by the caller), saved to
    ``directory`` with megatron's dist_checkpointing, what Bridge's checkpointing calls."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    provider = _provider(tensor_model_parallel_size=2)
    provider.finalize()
    (model,) = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    dist.barrier()
    return model


def _save_craft_and_load(directory, marker):
    """The provider's gated model at TP 2, saved with megatron's dist_checkpointing (what Bridge's
    checkpointing calls), its ``.metadata`` replaced by an attacker's pickle (the manifest-free
    Bridge layout: nothing else to forge), then loaded back as Bridge's load does."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import mcore_ext
    from mcore_ext.checkpoint import safe_pickle
    from mcore_ext.checkpoint.errors import CheckpointUnsafeError
    from tests.functional.test_checkpoint_safe_load import Payload

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    try:
        model = _save_provider_model(directory)
        if dist.get_rank() == 0:
            path = os.path.join(directory, ".metadata")
            with open(path, "rb") as f:
                real = pickle.load(f)  # our own file: plain pickle is fine here
            with open(path, "wb") as f:
                pickle.dump(Payload(marker, real), f)
        dist.barrier()
        try:
            with safe_pickle.refusals():
                dist_checkpointing.load(model.sharded_state_dict(), directory)
        except CheckpointUnsafeError as err:
            return str(err)
        return None
    finally:
        mcore_ext.destroy_parallel()


def test_a_crafted_checkpoint_of_the_provider_model_is_refused_and_runs_nothing(
        run_distributed, tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "PWNED"
    results = run_distributed(_save_craft_and_load, str(directory), str(marker), world_size=2,
                              timeout=300)
    for message in results:
        assert message is not None, "the crafted checkpoint loaded"
        assert f"checkpoint file {directory}" in message and "builtins.eval" in message, message
    assert not marker.exists()


def _sign_add_common_and_load(directory):
    """The provider's gated model at TP 2 saved with megatron's dist_checkpointing (what Bridge's
    checkpointing calls) and signed by rank 0 with the key set (a manifest listing
    every file, as the launcher's save writes it); loaded back as Bridge's load does, then again
    with a ``common.pt`` added (megatron would take the iteration from it). Returns (the first
    load's error or None, the second's)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import mcore_ext
    from mcore_ext.checkpoint import manifest
    from mcore_ext.checkpoint.errors import CheckpointCorruptError

    mcore_ext.init_parallel(tensor_model_parallel_size=2)
    try:
        model = _save_provider_model(directory)
        if dist.get_rank() == 0:
            manifest.write(directory, manifest.describe(directory, sorted(os.listdir(directory))))
        errors = []
        for added in (False, True):
            if added and dist.get_rank() == 0:
                torch.save({"iteration": 1}, os.path.join(directory, "common.pt"))
            dist.barrier()
            try:
                dist_checkpointing.load(model.sharded_state_dict(), directory)
                errors.append(None)
            except CheckpointCorruptError as err:
                errors.append(str(err))
        return errors
    finally:
        mcore_ext.destroy_parallel()


def test_a_signed_checkpoint_with_an_added_file_is_refused_on_bridges_load(run_distributed,
                                                                          tmp_path):
    """Issue 44.1 on the Bridge path: with the key, the signed checkpoint loads; with a
    ``common.pt`` added that the manifest does not list, every rank refuses it, naming the file,
    before megatron reads it."""
    from tests.functional.test_checkpoint_safe_load import _with_key  # set, then unset

    directory = tmp_path / "ckpt"
    results = run_distributed(_with_key, "k3y", _sign_add_common_and_load, str(directory),
                              world_size=2, timeout=300)
    for intact, added in results:
        assert intact is None, intact
        assert added is not None and added.startswith(
            f"checkpoint {directory} is corrupt: common.pt not in the manifest"), added
