"""Tiny random Hugging Face Step-3.5 models, built offline from a config.

``tiny_config`` / ``build`` / ``load_released`` need transformers (they import it when called).
``write_released`` writes a released-layout directory (the same tiny model's config, random
tensors) with safetensors alone, for the tests that need HF files but not transformers.

The released checkpoint layout is ``model.*`` + ``lm_head``; transformers has no text-only causal-LM
class for it, so ``CausalLM`` below is the text model plus an untied lm_head: with
``base_model_prefix = "model"`` it loads a released-layout directory with no missing or
unexpected keys, and its logits are ``lm_head(model(...).last_hidden_state)``.
"""

import json
import os

import torch

VOCAB = 257  # the launcher's byte tokenizer
SEQ = 12


def tiny_config(sliding_kv_heads=None, **overrides):
    """Both layer kinds with different head counts, window 4 < SEQ, per-kind RoPE base and
    rotary fraction, a SwiGLU clamp that the random weights hit (on the sliding layers).
    ``sliding_kv_heads``: the sliding layers' own KV-head count (transformers reads it from
    ``per_layer_config``)."""
    from transformers import Step3p7TextConfig

    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        num_sliding_attention_heads=8, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense"] * 4,
        rope_theta=[10000.0, 500.0, 500.0, 10000.0], partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
        swiglu_limits_shared=[0.0, 1.0, 1.0, 0.0], max_position_embeddings=64,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=256,
    )
    fields.update(overrides)
    if sliding_kv_heads is not None:
        heads = fields["num_sliding_attention_heads"]
        fields["per_layer_config"] = {
            i: {"num_attention_heads": heads, "num_key_value_heads": sliding_kv_heads}
            for i, kind in enumerate(fields["layer_types"]) if kind == "sliding_attention"}
    return Step3p7TextConfig(**fields)


def causal_lm_class():
    from torch import nn
    from transformers import Step3p7TextConfig, Step3p7TextModel
    from transformers.models.step3p7.modeling_step3p7 import Step3p7PreTrainedModel

    class CausalLM(Step3p7PreTrainedModel):
        config_class = Step3p7TextConfig
        config: Step3p7TextConfig

        def __init__(self, config):
            super().__init__(config)
            self.model = Step3p7TextModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids, **kwargs):
            return self.lm_head(self.model(input_ids, **kwargs).last_hidden_state)

    return CausalLM


def build(config=None, seed=0, dtype=torch.float32):
    """A CausalLM with random weights everywhere, norm weights included (HF starts them at 0,
    which would hide the (1 + w) convention)."""
    torch.manual_seed(seed)
    model = causal_lm_class()(config or tiny_config()).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(torch.randn_like(param) * 0.5)
            else:
                param.copy_(torch.randn_like(param) * 0.2)
    return model.eval()


def save_released(model, directory, *, max_shard_size="50KB", legacy_config=True):
    """Write ``model`` in the released layout: safetensors (sharded) + a config.json with the
    released checkpoint's legacy keys (or transformers' own saved config)."""
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    if legacy_config:
        with open(os.path.join(directory, "config.json")) as f:
            modern = json.load(f)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(legacy_config_dict(modern), f, indent=2)
    return directory


def legacy_config_dict(modern: dict) -> dict:
    """transformers' saved config -> the released Step3p5ForCausalLM form (legacy keys, one MTP
    layer's entries padded onto the per-layer lists)."""
    n = modern["num_hidden_layers"]
    types = modern["layer_types"]
    rope = modern["rope_parameters"]
    theta = [rope[t]["rope_theta"] for t in types]
    partial = [rope[t].get("partial_rotary_factor", 1.0) for t in types]
    limits = modern["swiglu_limits_shared"] or [0.0] * n
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    per_layer = modern.get("per_layer_config") or {}
    sliding_kv = (per_layer.get(str(sliding[0]), {}).get("num_key_value_heads")
                  if sliding else None) or modern["num_key_value_heads"]
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": modern["vocab_size"],
        "hidden_size": modern["hidden_size"],
        "intermediate_size": modern["intermediate_size"],
        "num_hidden_layers": n,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": modern["num_attention_heads"],
        "num_attention_groups": modern["num_key_value_heads"],
        "head_dim": modern["head_dim"],
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": modern["num_sliding_attention_heads"],
            "num_attention_groups": sliding_kv,
            "head_dim": modern["head_dim"],
        },
        "layer_types": types + ["full_attention"],
        "sliding_window": modern["sliding_window"],
        "rope_theta": theta + [theta[0]],
        "partial_rotary_factors": partial + [partial[0]],
        "swiglu_limits": [0.0] * (n + 1),
        "swiglu_limits_shared": limits + [0.0],
        "moe_layers_enum": "",
        "use_head_wise_attn_gate": True,
        "rms_norm_eps": modern["rms_norm_eps"],
        "max_position_embeddings": modern["max_position_embeddings"],
        "bos_token_id": modern.get("bos_token_id"),
        "eos_token_id": modern.get("eos_token_id"),
        "pad_token_id": modern.get("pad_token_id"),
        "torch_dtype": modern.get("dtype", modern.get("torch_dtype", "float32")),
    }


def load_released(directory):
    """(model, loading info) of a released-layout directory, in fp32."""
    return causal_lm_class().from_pretrained(directory, output_loading_info=True,
                                             dtype=torch.float32)


def tokens(batch=2, seq=SEQ, seed=7):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# tiny_config() in the released config form, written out so that no transformers is needed.
TINY_RELEASED = {
    "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5", "vocab_size": VOCAB,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_attention_groups": 4,
    "head_dim": 8,
    "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                "num_attention_groups": 4, "head_dim": 8},
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                    "full_attention", "full_attention"],
    "sliding_window": 4, "rope_theta": [10000.0, 500.0, 500.0, 10000.0, 10000.0],
    "partial_rotary_factors": [0.5, 1.0, 1.0, 0.5, 0.5],
    "swiglu_limits_shared": [0.0, 1.0, 1.0, 0.0, 0.0], "moe_layers_enum": "",
    "use_head_wise_attn_gate": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
    "bos_token_id": 1, "eos_token_id": 256, "pad_token_id": 0, "torch_dtype": "float32",
}


def released_shapes(raw: dict) -> dict:
    """{tensor name: shape} of a dense released-layout config (written from the format, not from
    mcore_ext.hf.layout)."""
    h, f, hn = raw["hidden_size"], raw["intermediate_size"], raw["head_dim"]
    other = raw["attention_other_setting"]
    shapes = {"model.embed_tokens.weight": (raw["vocab_size"], h)}
    for i in range(raw["num_hidden_layers"]):
        sliding = raw["layer_types"][i] == "sliding_attention"
        heads = other["num_attention_heads"] if sliding else raw["num_attention_heads"]
        kv = other["num_attention_groups"] if sliding else raw["num_attention_groups"]
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * hn, h),
            p + "self_attn.k_proj.weight": (kv * hn, h),
            p + "self_attn.v_proj.weight": (kv * hn, h),
            p + "self_attn.g_proj.weight": (heads, h), p + "self_attn.o_proj.weight": (h, heads * hn),
            p + "self_attn.q_norm.weight": (hn,), p + "self_attn.k_norm.weight": (hn,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (raw["vocab_size"], h)
    return shapes


def write_released(directory, raw=None, seed=0, tensors_per_file=20):
    """A released-layout directory with random tensors: config.json, safetensors files of
    ``tensors_per_file`` tensors each and their index. Returns the directory."""
    from safetensors.torch import save_file

    raw = dict(raw or TINY_RELEASED)
    os.makedirs(directory, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    names = list(released_shapes(raw).items())
    chunks = [names[i:i + tensors_per_file] for i in range(0, len(names), tensors_per_file)]
    weight_map = {}
    for n, chunk in enumerate(chunks):
        file = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({name: torch.randn(shape, generator=generator) * 0.2 for name, shape in chunk},
                  os.path.join(directory, file))
        weight_map.update({name: file for name, _ in chunk})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return directory


def read_tensors(directory) -> dict:
    """Every tensor of the safetensors files in ``directory``."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def assert_same_tensors(a_dir, b_dir):
    """Same names, dtypes and values, bit for bit."""
    a, b = read_tensors(a_dir), read_tensors(b_dir)
    assert a.keys() == b.keys()
    different = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not different, f"tensors differ: {different[:5]}"


# ------------------------------------------------------------------------------ MoE + MTP

MOE_TYPES = ["dense", "sparse", "sparse", "sparse"]
EXPERTS, TOPK, SCALING = 8, 3, 2.5
ROUTED_LIMITS = [0.0, 0.3, 0.0, 0.5]  # routed experts' clamp: layers 1 and 3
SHARED_LIMITS = [1.0, 0.0, 0.4, 0.0]  # dense MLP (layer 0) and shared expert (layer 2)
MTP_LIMIT = 0.5  # the MTP layer's dense MLP


def tiny_moe_config(**overrides):
    """tiny_config with MoE layers 1-3 (both attention kinds; 8 experts, top-3, scaling 2.5) and
    clamps of each kind on different layers."""
    fields = dict(mlp_layer_types=MOE_TYPES, n_routed_experts=EXPERTS, num_experts_per_tok=TOPK,
                  moe_intermediate_size=16, share_expert_dim=24,
                  moe_router_scaling_factor=SCALING, swiglu_limits=ROUTED_LIMITS,
                  swiglu_limits_shared=SHARED_LIMITS)
    fields.update(overrides)
    return tiny_config(**fields)


def build_moe(config=None, seed=0, dtype=torch.float32):
    """build() of the MoE config, with a random router bias (HF starts it at 0) large enough
    to change which experts are chosen."""
    model = build(config or tiny_moe_config(), seed=seed).to(dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.3)
    return model


# transformers' names -> the released checkpoint's (besides the stacked gate_up_proj split)
RELEASED_RENAMES = (("mlp.experts.down_proj", "moe.down_proj.weight"),
                    ("mlp.gate.e_score_correction_bias", "moe.router_bias"),
                    ("mlp.gate.weight", "moe.gate.weight"),
                    ("mlp.shared_experts.", "share_expert."))


def released_tensors(model) -> dict:
    """The model's tensors under the released checkpoint's names (the inverse of transformers'
    step3p7 conversion mapping): stacked moe.{gate,up}_proj, fp32 router_bias."""
    out = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("mlp.experts.gate_up_proj")]
            out[p + "moe.gate_proj.weight"], out[p + "moe.up_proj.weight"] = (
                x.contiguous() for x in t.chunk(2, dim=1))
            continue
        for theirs, released in RELEASED_RENAMES:
            name = name.replace(theirs, released)
        out[name] = t.float() if name.endswith("router_bias") else t
    return out


def transformers_tensors(released: dict, num_layers: int) -> dict:
    """released_tensors' inverse: transformers' names for the main layers (MTP layers, which
    transformers does not build, left out)."""
    out = {}
    for name, tensor in released.items():
        parts = name.split(".")
        is_mtp = parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers
        if is_mtp or name.endswith("moe.up_proj.weight"):
            continue
        if name.endswith("moe.gate_proj.weight"):
            up = released[name.replace("gate_proj", "up_proj")]
            out[name.replace("moe.gate_proj.weight", "mlp.experts.gate_up_proj")] = torch.cat(
                [tensor, up], dim=1)
            continue
        for theirs, ours in RELEASED_RENAMES:
            name = name.replace(ours, theirs)
        out[name] = tensor
    return out


def mtp_tensors(config, seed=1, dtype=torch.float32, std=None) -> dict:
    """Random released-layout tensors of one MTP layer (global index num_hidden_layers):
    dense, sliding, with its own head and norm. ``std``: matrices of that std and norms at 0
    (transformers' initialisation: its RMSNorms scale by 1 + weight), not the parity tests'
    larger random values."""
    gen = torch.Generator().manual_seed(seed)
    h, hn, f, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    heads, groups = config.num_sliding_attention_heads, config.num_key_value_heads
    shapes = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hn, h), "self_attn.k_proj.weight": (groups * hn, h),
        "self_attn.v_proj.weight": (groups * hn, h), "self_attn.g_proj.weight": (heads, h),
        "self_attn.o_proj.weight": (h, heads * hn), "self_attn.q_norm.weight": (hn,),
        "self_attn.k_norm.weight": (hn,), "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
        "transformer.shared_head.norm.weight": (h,),
        "transformer.shared_head.output.weight": (v, h),
    }
    prefix = f"model.layers.{config.num_hidden_layers}."
    scale = {1: 0.5, 2: 0.2} if std is None else {1: 0.0, 2: std}
    return {prefix + k: (torch.randn(*s, generator=gen) * scale[len(s)]).to(dtype)
            for k, s in shapes.items()}


def save_moe(model, directory, *, mtp=True, released=True, shard_tensors=7):
    """A MoE checkpoint: released names (or transformers' own), plus one MTP layer, several
    shards with an index, and the released config.json (MoE keys, lists padded for MTP)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = released_tensors(model) if released else {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    dtype = model.model.embed_tokens.weight.dtype
    if mtp:
        tensors.update(mtp_tensors(model.config, dtype=dtype))
    names = list(tensors)
    weight_map = {}
    for i in range(0, len(names), shard_tensors):
        file = f"model-{i // shard_tensors:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[i:i + shard_tensors]},
                  os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names[i:i + shard_tensors]})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = legacy_config_dict(model.config.to_dict())
    n = model.config.num_hidden_layers
    config.update(
        moe_layers_enum=",".join(str(i) for i, t in enumerate(MOE_TYPES) if t == "sparse"),
        moe_num_experts=EXPERTS, moe_top_k=TOPK, moe_intermediate_size=16, share_expert_dim=24,
        moe_router_activation="sigmoid", moe_router_scaling_factor=SCALING,
        use_moe_router_bias=True, need_fp32_gate=True, norm_expert_weight=True,
        swiglu_limits=ROUTED_LIMITS + [0.0], swiglu_limits_shared=SHARED_LIMITS + [MTP_LIMIT],
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    config["layer_types"][n] = "sliding_attention"  # Step's MTP layers are sliding
    config["rope_theta"][n] = config["rope_theta"][1]
    config["partial_rotary_factors"][n] = config["partial_rotary_factors"][1]
    if not mtp:
        config["num_nextn_predict_layers"] = 1  # declared, absent: the decoder alone
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory, tensors


def reference_weights(tensors: dict, num_layers: int, mtp_layers: int = 1) -> dict:
    """tests.reference's weights dict (step35_logits / step35_mtp_logits) from released-layout
    tensors, in fp32."""
    t = {k: v.float() for k, v in tensors.items()}

    def layer(i):
        p = f"model.layers.{i}."
        w = {k[len(p):].removeprefix("self_attn.").removeprefix("mlp.").removesuffix(".weight"): v
             for k, v in t.items() if k.startswith(p)}
        if p + "moe.gate.weight" in t:
            w.update(router=t[p + "moe.gate.weight"], router_bias=t[p + "moe.router_bias"],
                     experts_gate_proj=t[p + "moe.gate_proj.weight"],
                     experts_up_proj=t[p + "moe.up_proj.weight"],
                     experts_down_proj=t[p + "moe.down_proj.weight"],
                     shared_gate_proj=t[p + "share_expert.gate_proj.weight"],
                     shared_up_proj=t[p + "share_expert.up_proj.weight"],
                     shared_down_proj=t[p + "share_expert.down_proj.weight"])
        if p + "enorm.weight" in t:
            w.update(shared_head_norm=t[p + "transformer.shared_head.norm.weight"],
                     shared_head_output=t[p + "transformer.shared_head.output.weight"])
        return w

    return {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"],
            "lm_head": t["lm_head.weight"], "layers": [layer(i) for i in range(num_layers)],
            "mtp": [layer(num_layers + k) for k in range(mtp_layers)]}


def reference_kinds(config):
    """(main, MTP) layer dicts for tests.reference from a transformers config (tiny_moe_config)."""
    def kind(i, mtp=False):
        sliding = mtp or config.layer_types[i] == "sliding_attention"
        rope = config.rope_parameters["sliding_attention" if sliding else "full_attention"]
        out = dict(heads=config.num_sliding_attention_heads if sliding
                   else config.per_layer_config[0].num_attention_heads,  # layer 0 is full
                   groups=config.num_key_value_heads, window=config.sliding_window if sliding
                   else None, rope_base=rope["rope_theta"],
                   rope_fraction=rope.get("partial_rotary_factor", 1.0),
                   swiglu_limit=MTP_LIMIT if mtp else (SHARED_LIMITS[i] or None))
        if not mtp and MOE_TYPES[i] == "sparse":
            out["moe"] = dict(topk=TOPK, scaling=SCALING, routed_limit=ROUTED_LIMITS[i] or None)
        return out

    return [kind(i) for i in range(config.num_hidden_layers)], [kind(0, mtp=True)]


# ------------------------------------------------------------------- Step-3.7 (text + vision)

def tiny_vl_config(text_config=None):
    """transformers' Step3p7Config around ``text_config`` (default tiny_moe_config) with a tiny
    vision tower (1 layer, width 16, 28 x 28 images of 14-pixel patches)."""
    from transformers import Step3p7Config, Step3p7VisionConfig

    text = text_config or tiny_moe_config()
    vision = Step3p7VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14, mlp_ratio=2.0)
    return Step3p7Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         tie_word_embeddings=False)


def build_vl(config=None, seed=0):
    """Step3p7ForConditionalGeneration with random weights everywhere (norms and the router
    bias included, as build / build_moe), fp32."""
    from transformers import Step3p7ForConditionalGeneration

    torch.manual_seed(seed)
    model = Step3p7ForConditionalGeneration(config or tiny_vl_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") or "layernorm" in name else 0.2
            param.copy_(torch.randn_like(param) * scale)
        gen = torch.Generator().manual_seed(seed + 100)
        for layer in model.model.language_model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                bias = gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    return model.eval()


def save_vl(model, directory, *, mtp=True):
    """``model.save_pretrained`` (the hub's layout: model.layers.*, vision_model.*,
    vit_large_projector.*, lm_head), plus, with ``mtp``, one MTP layer's tensors in a shard of
    its own and num_nextn_predict_layers 1 in the text_config (the stock class skips them), and
    a processor-like file to carry. Returns the directory."""
    model.save_pretrained(directory, max_shard_size="60KB")
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Step3p7ImageProcessor", "patch_size": 14}, f)
    if not mtp:
        return directory
    text = model.config.text_config
    config = add_tensors(directory, mtp_tensors(text), "model-mtp.safetensors")
    config["text_config"].update(num_nextn_predict_layers=1,
                                 mtp_layer_types=["sliding_attention"],
                                 mtp_mlp_layer_types=["dense"])
    write_config(directory, config)
    return directory


def add_tensors(directory, tensors, filename) -> dict:
    """Write ``tensors`` to ``filename`` in the saved folder ``directory``, listed in its
    safetensors index; returns the folder's config.json for the caller to change
    (``write_config``)."""
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update({name: filename for name in tensors})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def write_config(directory, config) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# ----------------------------------------------------------- Step-3.7 with images (parity)

IMAGE_TOKEN = 250  # <im_patch>; 251-254 stand for <patch_start>, <patch_end>, <im_start>, <im_end>
PATCH_START, PATCH_END, IM_START, IM_END = 251, 252, 253, 254
GLOBAL_SIDE, CROP_SIDE = 112, 56  # pixels of the global view and of a local crop
VL_SEQ = 24
LOCAL_PATCHES = [2, 0, 1]  # crops of the 3 images: row 0 holds images 0 and 1, row 2 image 2


def tiny_vl_images_config(text_config=None, vision_layers=2, image_token_id=IMAGE_TOKEN):
    """tiny_vl_config for runs with images: a 2-layer vision tower of width 16 (2 heads of 8)
    whose position table is laid out for GLOBAL_SIDE (8 x 8 patches: the global view uses it as
    is, a CROP_SIDE crop interpolates it), and the placeholder IMAGE_TOKEN inside the vocabulary."""
    from transformers import Step3p7Config, Step3p7VisionConfig

    text = text_config or tiny_moe_config()
    vision = Step3p7VisionConfig(hidden_size=16, num_hidden_layers=vision_layers,
                                 num_attention_heads=2, image_size=GLOBAL_SIDE, patch_size=14,
                                 mlp_ratio=2.0)
    return Step3p7Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         tie_word_embeddings=False, image_token_id=image_token_id)


VISION_SCALE = 0.25  # the vision weights' build() scale x this: features of the text's size
LM_HEAD_SCALE = 0.5  # logits within about +-3


def build_vl_images(config=None, seed=0):
    """build_vl of tiny_vl_images_config, its vision weights (norms aside) scaled by
    VISION_SCALE so that image features (about 0.5) are the size of the token embeddings, and
    lm_head by LM_HEAD_SCALE: fp32 rounding differences (of CP's attention above all, which sums
    in its own order) stay well inside the absolute 1e-5 the parity tests allow."""
    model = build_vl(config or tiny_vl_images_config(), seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("model.vision_model.", "model.multi_modal_projector.")) \
                    and "norm" not in name:
                param.mul_(VISION_SCALE)
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return model


def tokens_per_view(side, patch=14):
    """Features of a side x side view: its patch grid halved twice (two stride-2 convolutions)."""
    grid = side // patch
    for _ in range(2):
        grid = (grid + 1) // 2
    return grid * grid


def image_placeholders(crops):
    """The tokens Step3p7Processor.replace_image_token writes for an image with ``crops`` local
    crops: per crop <patch_start> <im_patch> x t_local <patch_end>, then <im_start> <im_patch> x
    t_global <im_end> (no crop grid of several rows here, so no <patch_newline>)."""
    out = []
    for _ in range(crops):
        out += [PATCH_START] + [IMAGE_TOKEN] * tokens_per_view(CROP_SIDE) + [PATCH_END]
    return out + [IM_START] + [IMAGE_TOKEN] * tokens_per_view(GLOBAL_SIDE) + [IM_END]


def vl_inputs(seed=3):
    """A batch of 3 rows of VL_SEQ tokens: row 0 holds image 0 (2 crops + global view) and image 1
    (global view only), row 1 no image, row 2 image 2 (1 crop + global view); text tokens drawn
    below the special ones. {"input_ids" [3, s], "pixel_values" [3, 3, 112, 112],
    "pixel_values_local" [3, 3, 56, 56], "num_local_patches" [3]}: transformers' names."""
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, IMAGE_TOKEN, (n,), generator=gen).tolist()
    rows = [text(2) + image_placeholders(2) + text(1) + image_placeholders(0),
            text(VL_SEQ),
            text(5) + image_placeholders(1)]
    rows = [r + text(VL_SEQ - len(r)) for r in rows]
    assert all(len(r) == VL_SEQ for r in rows), [len(r) for r in rows]
    return {"input_ids": torch.tensor(rows),
            "pixel_values": torch.randn(3, 3, GLOBAL_SIDE, GLOBAL_SIDE, generator=gen),
            "pixel_values_local": torch.randn(sum(LOCAL_PATCHES), 3, CROP_SIDE, CROP_SIDE,
                                              generator=gen),
            "num_local_patches": torch.tensor(LOCAL_PATCHES)}


# ---------------------------------- Step-3.7 of the VL recipe (configs/step37_vl_sft_tiny_cpu.yaml)

VL_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "vl_tiny")
VL_TINY_PROCESSOR = os.path.join(VL_TINY, "processor")
VL_TINY_VOCAB, VL_TINY_IMAGE_TOKEN = 265, 259  # the processor's tokenizer; <im_patch>


def step37_recipe_config():
    """transformers' Step3p7Config of the model configs/step37_vl_sft_tiny_cpu.yaml trains: the
    text model of configs/step35_sft_tiny_cpu.yaml (64 wide, 4 layers full + sliding, MoE on
    layers 1-3, 4 experts top-2, clamps) over the vl_tiny processor's 265 ids, and a 2-layer
    vision tower of width 32 (2 heads, MLP 64) laid out for its 112-pixel global view."""
    from transformers import Step3p7Config, Step3p7TextConfig, Step3p7VisionConfig

    text = Step3p7TextConfig(
        vocab_size=VL_TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_sliding_attention_heads=6, sliding_window=16,
        layer_types=["full_attention"] + ["sliding_attention"] * 3,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, share_expert_dim=32,
        moe_router_scaling_factor=3.0, rope_theta=[5000000.0, 10000.0, 10000.0, 10000.0],
        partial_rotary_factors=[0.5, 1.0, 1.0, 1.0], swiglu_limits=[0.0, 0.0, 0.0, 7.0],
        swiglu_limits_shared=[0.0, 0.0, 0.0, 16.0], max_position_embeddings=128,
        rms_norm_eps=1e-5, pad_token_id=0)
    vision = Step3p7VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=112, patch_size=14, mlp_ratio=2.0)
    return Step3p7Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         tie_word_embeddings=False, image_token_id=VL_TINY_IMAGE_TOKEN)


def save_step37_recipe(directory, seed=0):
    """A random Step-3.7 release of the recipe's shapes in ``directory``: transformers'
    ``Step3p7ForConditionalGeneration`` with its own initialisation, saved in the hub's layout,
    one MTP layer at the same scale (mtp_tensors) and the vl_tiny processor's files (tokenizer,
    chat template, processor_config.json). Returns the directory."""
    import shutil

    from transformers import Step3p7ForConditionalGeneration

    torch.manual_seed(seed)
    model = Step3p7ForConditionalGeneration(step37_recipe_config()).eval()
    model.save_pretrained(directory, max_shard_size="400KB")  # an index, for add_tensors
    text = model.config.text_config
    config = add_tensors(directory, mtp_tensors(text, seed=seed + 1,
                                                std=text.initializer_range),
                         "model-mtp.safetensors")
    config["text_config"].update(num_nextn_predict_layers=1,
                                 mtp_layer_types=["sliding_attention"],
                                 mtp_mlp_layer_types=["dense"])
    write_config(directory, config)
    for name in os.listdir(VL_TINY_PROCESSOR):
        shutil.copyfile(os.path.join(VL_TINY_PROCESSOR, name), os.path.join(directory, name))
    return directory


# ------------------------------------------- Step-3.7 with the repository's tiny processor

PROCESSOR = VL_TINY_PROCESSOR  # Step3p7Processor: 112 px views, 56 px crops


def tiny_vl_processor_config():
    """tiny_vl_images_config for the tiny processor's tokens: vocabulary 265, <im_patch> 259,
    128 positions (a rendered caption is about 60 tokens)."""
    text = tiny_moe_config(vocab_size=VL_TINY_VOCAB, max_position_embeddings=128)
    return tiny_vl_images_config(text_config=text, image_token_id=VL_TINY_IMAGE_TOKEN)


def save_vl_with_processor(model, directory, *, mtp=True):
    """save_vl with the tiny processor's files (processor_config.json, tokenizer, chat template)
    in place of save_vl's stand-in preprocessor_config.json."""
    import shutil

    save_vl(model, directory, mtp=mtp)
    os.remove(os.path.join(directory, "preprocessor_config.json"))
    for name in sorted(os.listdir(PROCESSOR)):
        shutil.copyfile(os.path.join(PROCESSOR, name), os.path.join(directory, name))
    return directory


CAPTIONS = (0, 2)  # configs/vl_tiny/captions.jsonl lines: 2 local crops + global view; global only


def caption_conversations(lines=CAPTIONS):
    """(conversations, their images as PIL images) of ``lines`` of configs/vl_tiny/captions.jsonl,
    plus a conversation without an image."""
    from PIL import Image

    with open(os.path.join(VL_TINY, "captions.jsonl")) as f:
        every = [json.loads(line)["messages"] for line in f]
    conversations = [every[i] for i in lines]
    images = []
    for messages in conversations:
        for part in messages[0]["content"]:
            if part["type"] == "image":
                with Image.open(os.path.join(VL_TINY, part["path"])) as image:
                    images.append(image.convert("RGB"))
    conversations.append([{"role": "user", "content": "Hi there."},
                          {"role": "assistant", "content": "Hello."}])
    return conversations, images


def render(processor, conversations, images) -> dict:
    """``processor``'s batch of the conversations (chat template, then the processor; right
    padded): input_ids, attention_mask, pixel_values, pixel_values_local, num_local_patches."""
    texts = [processor.apply_chat_template(c, tokenize=False) for c in conversations]
    return dict(processor(text=texts, images=images, padding=True, return_tensors="pt"))


def processor_batch(processor_dir=PROCESSOR) -> dict:
    """The tiny processor's batch of caption_conversations (3 rows: an image with 2 crops, an
    image without crops, no image), without the attention mask (right padding: the rows' real
    tokens come first)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True)
    batch = render(processor, *caption_conversations())
    del batch["attention_mask"]
    return batch
