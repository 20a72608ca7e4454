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


def text_config(raw: dict) -> dict:
    """The text decoder's config: a ``Step3p7Config``'s ``text_config``, else ``raw`` itself."""
    if raw.get("model_type") == WRAPPER_MODEL_TYPE and isinstance(raw.get("text_config"), dict):
        return dict(raw["text_config"], model_type=MODEL_TYPE)
    return dict(raw)


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
