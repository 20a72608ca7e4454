"""The released Step-3.5-Flash config.json (``Step3p5ForCausalLM``): its own keys read, and the
config.json every export writes.

The released form spells some fields its own way (``num_attention_groups``,
``attention_other_setting`` for the sliding kind, ``moe_layers_enum``, ``moe_num_experts``,
``num_nextn_predict_layers``) and pads its per-layer lists (``layer_types``, ``rope_theta``,
``partial_rotary_factors``, ``swiglu_limits_shared``, ``swiglu_limits``) with the MTP layers'
entries. Reading it is ``read``'s, with the pieces below; ``to_hf_dict`` writes this form (what
vLLM and the released modeling code read) plus transformers' spellings, so that transformers'
``Step3p7TextConfig`` reads the same model from it.
"""

from typing import Optional

from mcore_ext.hf.config.base import ARCHITECTURE, DENSE, FULL, MODEL_TYPE, SLIDING, HFConfigError


class PaddedLists:
    """The per-layer lists of a config whose ``num_nextn_predict_layers`` MTP layers' entries
    follow the ``n`` main layers' (released hub configs); lists of ``n`` entries pass as they are.
    """

    def __init__(self, c: dict, n: int, m: int):
        self.c, self.n, self.m = c, n, m

    def main(self, key: str, default=None):
        """``key``'s value with the MTP layers' entries dropped."""
        value = self.c.get(key, default)
        if isinstance(value, list) and len(value) == self.n + self.m:
            value = value[:self.n]
        return value

    def mtp(self, key: str) -> Optional[list]:
        """The MTP layers' entries of ``key``: a padded list's tail, else None."""
        value = self.c.get(key)
        if self.m and isinstance(value, list) and len(value) == self.n + self.m:
            return value[self.n:]
        return None


def moe_layers_from_enum(c: dict) -> Optional[set]:
    """The MoE layers ``moe_layers_enum`` names ("3,4,5" or a list), None without it."""
    enum = c.get("moe_layers_enum")
    if enum is None:
        return None
    items = enum.split(",") if isinstance(enum, str) else enum
    return {int(i) for i in items if str(i).strip()}


def other_setting(c: dict, head_dim: int) -> dict:
    """The sliding kind's head counts in ``attention_other_setting`` (``num_attention_heads``,
    ``num_key_value_heads``; None where absent); its head dim must be the model's."""
    other = c.get("attention_other_setting") or {}
    if other.get("head_dim") not in (None, head_dim):
        raise HFConfigError(
            f"attention_other_setting.head_dim={other['head_dim']} differs from head_dim="
            f"{head_dim}: one head dim for both layer kinds is supported"
        )
    return {"num_attention_heads": other.get("num_attention_heads"),
            "num_key_value_heads": other.get("num_attention_groups",
                                             other.get("num_key_value_heads"))}


def check_router(c: dict) -> None:
    """Refuse the released router variants megatron's sigmoid router does not compute exactly."""
    activation = c.get("moe_router_activation", "sigmoid")
    if activation != "sigmoid":
        raise HFConfigError(f"moe_router_activation={activation!r}: only 'sigmoid' is converted "
                            "(megatron's softmax router normalises differently)")
    for key in ("use_moe_router_bias", "norm_expert_weight"):
        if key in c and not c[key]:
            why = ("megatron's sigmoid router always renormalises the top-k weights"
                   if key == "norm_expert_weight" else
                   "the Step-3.5 layout always has an fp32 router_bias")
            raise HFConfigError(f"{key}={c[key]!r} is not supported ({why})")


def rope_from_lists(c: dict, layer_types: list, lists: PaddedLists) -> tuple[dict, dict]:
    """(rope_theta, partial_rotary_factor) per layer type from the per-layer ``rope_theta`` /
    ``partial_rotary_factors`` (or one value for all layers): one value per layer type."""
    raw_theta = lists.main("rope_theta", 10000.0)
    raw_partial = lists.main("partial_rotary_factors")
    n = len(layer_types)
    thetas = raw_theta if isinstance(raw_theta, list) else [raw_theta] * n
    partials = raw_partial if isinstance(raw_partial, list) else [raw_partial or 1.0] * n
    for name, values in (("rope_theta", thetas), ("partial_rotary_factors", partials)):
        if len(values) != n:
            raise HFConfigError(f"{name} has {len(values)} entries, num_hidden_layers is {n}")
    theta, partial = {}, {}
    for i, kind in enumerate(layer_types):
        for table, value, name in ((theta, float(thetas[i]), "rope_theta"),
                                   (partial, float(partials[i]), "partial_rotary_factors")):
            if table.setdefault(kind, value) != value:
                raise HFConfigError(
                    f"{name}[{i}]={value} differs from an earlier {kind} layer's "
                    f"{table[kind]}: one value per layer type is supported (as in transformers)"
                )
    return theta, partial


def check_mtp_rope(c: dict, n: int, m: int, mtp_types: list, theta: dict, partial: dict):
    """The MTP layers' padded rope_theta / partial_rotary_factors entries must be their kind's
    value (one RoPE per layer kind); a kind only MTP layers have takes its value from them."""
    for key, table in (("rope_theta", theta), ("partial_rotary_factors", partial)):
        values = c.get(key)
        if not (isinstance(values, list) and len(values) == n + m):
            continue
        for k, kind in enumerate(mtp_types):
            value = float(values[n + k])
            if table.setdefault(kind, value) != value:
                raise HFConfigError(
                    f"{key}[{n + k}]={value} (MTP layer) differs from the {kind} layers' "
                    f"{table[kind]}: one value per layer type is supported"
                )


# ------------------------------------------------------------------------------ writing


def to_hf_dict(spec) -> dict:
    """``spec`` (a ``Step35Config``) as config.json in the released layout
    (``Step3p5ForCausalLM``), which transformers' ``Step3p7TextConfig`` also reads: the legacy
    per-layer lists, plus the modern keys."""
    n = spec.num_layers
    # The released per-layer lists are padded with the MTP layers' entries.
    types = list(spec.layer_types) + list(spec.mtp_layer_types)
    theta = [float(_kind_value(spec.rope_theta, t)) for t in types]
    partial = [float(_kind_value(spec.partial_rotary_factor, t)) for t in types]
    shared_limits = list(spec.swiglu_limits) + list(spec.mtp_swiglu_limits)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": spec.num_heads,
        "num_attention_groups": spec.num_kv_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "layer_types": types,
        "sliding_window": spec.sliding_window,
        "rope_theta": theta,
        "partial_rotary_factors": partial,
        "swiglu_limits_shared": [x if x else 0.0 for x in shared_limits],
        "mlp_layer_types": list(spec.mlp_layer_types) + [DENSE] * spec.num_mtp_layers,
        "moe_layers_enum": ",".join(str(i) for i in range(n) if spec.is_sparse(i)),
        "num_nextn_predict_layers": spec.num_mtp_layers,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "zero_centered": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    if spec.is_moe:
        out.update(_moe_hf_keys(spec))
    if SLIDING in types:
        out["attention_other_setting"] = {
            "attention_type": SLIDING,
            "num_attention_heads": spec.num_sliding_heads or spec.num_heads,
            "num_attention_groups": spec.num_sliding_kv_heads or spec.num_kv_heads,
            "head_dim": spec.head_dim,
        }
        out["num_sliding_attention_heads"] = spec.num_sliding_heads or spec.num_heads
        # transformers reads each layer's counts here (attention_other_setting: vLLM).
        out["per_layer_config"] = {
            str(i): {"num_attention_heads": spec.heads(i),
                     "num_key_value_heads": spec.kv_heads(i)}
            for i, kind in enumerate(spec.layer_types) if kind == SLIDING}
    if spec.query_pre_attn_scalar not in (None, spec.head_dim):
        out["query_pre_attn_scalar"] = spec.query_pre_attn_scalar
    out.update(spec.extra)
    return out


def _moe_hf_keys(spec) -> dict:
    """The released MoE keys, plus transformers' spellings of the renamed ones."""
    routed = list(spec.expert_swiglu_limits) + [None] * spec.num_mtp_layers
    return {
        "moe_num_experts": spec.num_experts,
        "moe_top_k": spec.moe_top_k,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "share_expert_dim": spec.share_expert_dim,
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": spec.moe_router_scaling_factor,
        "use_moe_router_bias": True,
        "need_fp32_gate": spec.router_fp32,
        "norm_expert_weight": True,
        "swiglu_limits": [x if x else 0.0 for x in routed],
        "n_routed_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_top_k,
    }


def _kind_value(table: dict, kind: str):
    return table.get(kind, table.get(FULL))
