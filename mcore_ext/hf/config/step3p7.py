"""transformers' Step-3.5 config: ``Step3p7TextConfig`` as transformers saves it (model_type
``step3p5``), and a ``Step3p7Config`` (model_type ``step3p7``) around it as ``text_config``.

transformers kept the released keys it did not rename (``layer_types``, ``sliding_window``,
``swiglu_limits_shared``, ``swiglu_limits``, the ``moe_*`` sizes, ...), so a config.json of this
dialect is read by ``read`` together with ``released``; here is what transformers spells its own
way: the wrapper, ``per_layer_config``, ``rope_parameters`` per layer type, the defaults of keys
it may leave out. Its renamed scalar keys (``num_key_value_heads``, ``num_sliding_attention_heads``,
``mlp_layer_types``, ``mtp_layer_types``, ``n_routed_experts``, ``num_experts_per_tok``) are read
in ``read``, next to their released spelling, where one line says which wins.
"""

from typing import Optional

from mcore_ext.hf.config.base import FULL, MODEL_TYPE, SLIDING, HFConfigError

WRAPPER_MODEL_TYPE = "step3p7"

# Step3p7TextConfig's defaults (= Step-3.5-Flash's), for configs that omit a key.
MOE_DEFAULTS = {"num_experts": 288, "moe_top_k": 8, "moe_intermediate_size": 1280,
                "share_expert_dim": 1280}
FIRST_MOE_LAYER = 3  # without mlp_layer_types (or the released moe_layers_enum): MoE from here on

_PER_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads")


# Every key a Step-3.7 text_config may hold: what ``read`` reads (both spellings), and keys that
# do not change the function or the weights (initialisation, caching, outputs, dropout during
# training: the launcher's own settings apply). Any other key is refused by name: a setting of a
# later Step-3.7 that this conversion would otherwise silently drop.
TEXT_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_attention_groups",
    "head_dim", "hidden_act", "max_position_embeddings", "max_seq_len", "rms_norm_eps",
    "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "partial_rotary_factors", "rope_scaling", "layer_types", "mlp_layer_types",
    "moe_layers_enum", "mtp_layer_types", "mtp_mlp_layer_types", "num_nextn_predict_layers",
    "num_mtp_layers", "sliding_window", "num_sliding_attention_heads", "attention_other_setting",
    "per_layer_config", "query_pre_attn_scalar", "swiglu_limits", "swiglu_limits_shared",
    "moe_intermediate_size", "n_routed_experts", "moe_num_experts", "num_local_experts",
    "num_experts_per_tok", "moe_top_k", "share_expert_dim", "share_expert_dims",
    "moe_router_scaling_factor", "moe_router_activation", "use_moe_router_bias",
    "need_fp32_gate", "norm_expert_weight", "attention_bias", "mlp_bias", "gating",
    "use_bidirectional_attention", "use_head_wise_attn_gate", "use_qk_norm", "zero_centered",
    # no effect on the function or the weights
    "initializer_range", "use_cache", "output_router_logits", "attention_dropout", "dtype",
    "torch_dtype", "transformers_version", "_name_or_path", "return_dict",
    "output_hidden_states", "output_attentions",
    # transformers' PretrainedConfig fields every config.to_dict() carries (heads, generation)
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "tie_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "pruned_heads", "torchscript",
})
# One setting, two spellings (transformers' attribute_map): both given must agree.
_ALIASES = (("n_routed_experts", "moe_num_experts", "num_local_experts"),
            ("num_experts_per_tok", "moe_top_k"), ("num_key_value_heads", "num_attention_groups"),
            ("num_nextn_predict_layers", "num_mtp_layers"))


def text_config(raw: dict) -> dict:
    """The text decoder's config: a ``Step3p7Config``'s ``text_config`` (checked: ``check_text``),
    else ``raw`` itself."""
    if raw.get("model_type") == WRAPPER_MODEL_TYPE:
        if not isinstance(raw.get("text_config"), dict):
            raise HFConfigError(f"model_type={WRAPPER_MODEL_TYPE!r} without a text_config dict "
                                f"(text_config={raw.get('text_config')!r})")
        check_text(raw)
        return dict(raw["text_config"], model_type=MODEL_TYPE)
    return dict(raw)


def check_text(raw: dict) -> None:
    """Refuse, by name, what a Step-3.7 text_config holds beyond Step-3.5's model."""
    c = raw["text_config"]
    unknown = sorted(k for k in c if k not in TEXT_KEYS)
    if unknown:
        raise HFConfigError(
            f"text_config.{unknown[0]}={c[unknown[0]]!r}"
            + (f" (and {', '.join(unknown[1:4])})" if len(unknown) > 1 else "")
            + ": not a setting of the Step-3.5 text model this conversion reads; refused "
            "rather than dropped")
    if c.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise HFConfigError(f"text_config.model_type={c['model_type']!r}: the Step-3.7 text "
                            f"model converted is {MODEL_TYPE!r}")
    for names in _ALIASES:
        given = {n: c[n] for n in names if c.get(n) is not None}
        if len(set(map(str, given.values()))) > 1:
            raise HFConfigError("text_config: " + ", ".join(f"{k}={v!r}" for k, v in given.items())
                                + " disagree (one setting, two spellings)")
    dropout = c.get("attention_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise HFConfigError(f"text_config.attention_dropout={dropout!r}: expected a probability")
    tie = raw.get("tie_word_embeddings")
    if tie is not None and bool(tie) != bool(c.get("tie_word_embeddings", False)):
        raise HFConfigError(f"tie_word_embeddings={tie!r} but text_config.tie_word_embeddings="
                            f"{c.get('tie_word_embeddings', False)!r}: which lm_head the model "
                            "has is ambiguous")


def default_moe_layers(num_layers: int) -> set:
    """The MoE layers transformers assumes when a config names none."""
    return set(range(FIRST_MOE_LAYER, num_layers))


def sliding_counts_from_per_layer(per_layer_config: dict, layer_types: list, heads: int,
                                  kv: int) -> dict:
    """The sliding kind's head / KV-head counts from transformers' ``per_layer_config``
    ({layer: {key: value}}): one value per kind, full layers at the global counts."""
    found = {}
    for idx, entry in per_layer_config.items():
        layer = int(idx)
        for key, value in entry.items():
            where = f"per_layer_config[{idx}].{key}={value!r}"
            if key not in _PER_LAYER_KEYS:
                raise HFConfigError(f"{where}: only {_PER_LAYER_KEYS} may differ per layer")
            if layer >= len(layer_types):
                continue  # an MTP layer's entry
            if layer_types[layer] != SLIDING:
                if value != {"num_attention_heads": heads, "num_key_value_heads": kv}[key]:
                    raise HFConfigError(f"{where} on a {FULL} layer: only the sliding kind has "
                                        "its own head counts")
                continue
            if found.setdefault(key, int(value)) != int(value):
                raise HFConfigError(f"{where} differs from an earlier sliding layer's "
                                    f"{found[key]}: one value per layer kind is supported")
    return found


def rope_from_parameters(c: dict, kinds: list) -> Optional[tuple[dict, dict]]:
    """(rope_theta, partial_rotary_factor) per layer type from ``rope_parameters``; None when the
    config has no such entry for every kind (then the released per-layer lists hold them)."""
    params = c.get("rope_parameters")
    if not (isinstance(params, dict) and all(isinstance(params.get(k), dict) for k in kinds)):
        return None
    theta, partial = {}, {}
    for kind in kinds:
        p = params[kind]
        if p.get("rope_type", "default") != "default":
            raise HFConfigError(
                f"rope_parameters[{kind!r}].rope_type={p['rope_type']!r}: only default RoPE "
                "is supported"
            )
        theta[kind] = float(p.get("rope_theta", 10000.0))
        partial[kind] = float(p.get("partial_rotary_factor", 1.0))
    return theta, partial


# ------------------------------------------------------------------------------ vision side

# Every key a Step-3.7 vision_config may hold: what ``vision_config`` reads (the release's and
# transformers' spellings) and keys without effect on the function or the weights. Any other is
# refused by name, as for text_config.
VISION_KEYS = frozenset({
    "model_type", "hidden_size", "width", "num_hidden_layers", "layers", "num_attention_heads",
    "heads", "intermediate_size", "mlp_ratio", "num_channels", "image_size", "patch_size",
    "hidden_act", "layer_norm_eps", "rope_parameters", "rope_theta", "layer_scale_init_value",
    "ls_init_value", "attention_dropout", "max_position_embeddings",
    # no effect on the function or the weights
    "initializer_range", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "architectures", "return_dict", "output_hidden_states", "output_attentions",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "problem_type",
    "tokenizer_class", "prefix", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "task_specific_params", "finetuning_task", "tie_encoder_decoder",
    "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "pruned_heads",
    "torchscript", "tie_word_embeddings",
})
_VISION_ALIASES = (("hidden_size", "width"), ("num_hidden_layers", "layers"),
                   ("num_attention_heads", "heads"), ("layer_scale_init_value", "ls_init_value"))
_VISION_DEFAULTS = {"hidden_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 16,
                    "num_channels": 3, "image_size": 728, "patch_size": 14,
                    "layer_norm_eps": 1e-5, "layer_scale_init_value": 0.1,
                    "mlp_ratio": 8960 / 1536}


def vision_config(raw: dict, freeze: bool = True):
    """The ``mcore_ext.vision.VisionConfig`` of a Step-3.7 config.json (``Step3p7Config``: its
    ``vision_config`` dict and ``projector_bias`` / ``image_token_id``), transformers'
    defaults for keys left out. The MLP width is transformers' ``int(hidden_size x
    mlp_ratio)`` (an ``intermediate_size`` that disagrees is refused). Unknown keys, a hidden
    act other than quick_gelu and a RoPE other than axial are refused by name."""
    from mcore_ext.vision.config import VisionConfig

    if raw.get("model_type") != WRAPPER_MODEL_TYPE:
        raise HFConfigError(f"model_type={raw.get('model_type')!r}: only a {WRAPPER_MODEL_TYPE!r} "
                            "config has a vision tower")
    c = raw.get("vision_config")
    c = {} if c is None else c
    if not isinstance(c, dict):
        raise HFConfigError(f"vision_config={c!r}: expected a dict")
    unknown = sorted(k for k in c if k not in VISION_KEYS)
    if unknown:
        raise HFConfigError(f"vision_config.{unknown[0]}={c[unknown[0]]!r}: not a setting of the "
                            "Step-3.7 vision tower this conversion reads; refused rather than "
                            "dropped")
    for names in _VISION_ALIASES:
        given = {n: c[n] for n in names if c.get(n) is not None}
        if len(set(map(str, given.values()))) > 1:
            raise HFConfigError("vision_config: " + ", ".join(f"{k}={v!r}" for k, v in given.items())
                                + " disagree (one setting, two spellings)")

    def get(name):
        for alias in next((a for a in _VISION_ALIASES if a[0] == name), (name,)):
            if c.get(alias) is not None:
                return c[alias]
        return _VISION_DEFAULTS[name]

    if c.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise HFConfigError(f"vision_config.hidden_act={c['hidden_act']!r}: the Step-3.7 tower "
                            "converted uses quick_gelu")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise HFConfigError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: the "
                            "Step-3.7 tower uses axial 2-D RoPE")
    hidden = int(get("hidden_size"))
    ffn = int(hidden * float(get("mlp_ratio")))
    if c.get("intermediate_size") is not None and int(c["intermediate_size"]) != ffn:
        raise HFConfigError(f"vision_config.intermediate_size={c['intermediate_size']!r} but "
                            f"int(hidden_size x mlp_ratio) = {ffn}: transformers builds the "
                            "latter")
    try:
        return VisionConfig(
            hidden_size=hidden, num_layers=int(get("num_hidden_layers")),
            num_attention_heads=int(get("num_attention_heads")), ffn_hidden_size=ffn,
            num_channels=int(get("num_channels")), image_size=int(get("image_size")),
            patch_size=int(get("patch_size")), layernorm_epsilon=float(get("layer_norm_eps")),
            rotary_base=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            layer_scale_init=float(get("layer_scale_init_value")),
            projector_bias=bool(raw.get("projector_bias", False)),
            image_token_id=int(raw.get("image_token_id", 151679)), freeze=freeze)
    except ValueError as err:
        raise HFConfigError(f"vision_config: {err}") from None
