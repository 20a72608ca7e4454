"""Megatron-Bridge 0.6.2: ``GatedGPTModelProvider`` and the registered ``Step3p5ForCausalLM``
bridge (mcore_ext.bridge), on CPU with real gloo ranks.

Needs the test-only environment of ``scripts/setup_bridge.sh`` (.venv-bridge: Bridge installed
without its dependencies next to the project's venv) and is not in the default run:

    PYTHONPATH=$PWD .venv-bridge/bin/python -m pytest tests/bridge -m bridge

Without Transformer Engine, ONE Bridge module is stubbed: ``megatron.bridge.peft.lora_layers``
(see tests/bridge/bridge_env.py; Bridge imports TE unconditionally only there). Nothing else of
Bridge or megatron is patched.

- The provider defers every check to ``finalize()``: a bad gate config constructs, Bridge's own
  ``finalize`` accepts it (GatedTransformerConfig.__post_init__ never runs in this MRO), and
  ``GatedGPTModelProvider.finalize`` raises naming the fields.
- ``provide()`` at TP 2 builds mcore_ext's gated attention with ``[QKV_r ; Gate_r]`` rows and
  runs a forward whose logits depend on the gate rows.
- A tiny HF Step-3.5 checkpoint (tests/hf/models.py: two layer kinds with different head counts,
  a sliding window, per-kind RoPE, a SwiGLU clamp) loads through ``AutoBridge`` into a model
  whose fp32 logits equal ``mcore_ext.hf.load_pretrained``'s within 1e-6 at TP 2 (which
  tests/hf checks against transformers), and Bridge's export gives back every HF tensor bit for
  bit through ``export_hf_weights`` (Bridge's streaming export). Not run: ``save_hf_weights`` /
  ``save_hf_pretrained``, which import NVIDIA ModelOpt (``modelopt.torch.quantization``) at call
  time, not installed here; ``save_hf_pretrained`` also copies the source's tokenizer, which the
  tiny checkpoint does not have.
"""

import os

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
