"""A Step-3.5 config.json, in any of its dialects -> the fields of one ``Step35Config``.

Three dialects reach us:

- the released ``Step3p5ForCausalLM`` config (``released``: legacy keys, per-layer lists padded
  with ``num_nextn_predict_layers`` MTP entries, ``moe_layers_enum``);
- transformers' own saved ``Step3p7TextConfig`` (``step3p7``: ``num_key_value_heads``,
  ``num_sliding_attention_heads``, ``per_layer_config``, ``rope_parameters`` per layer type,
  ``mlp_layer_types``), which keeps the released keys it did not rename;
- the ``text_config`` of a ``Step3p7Config`` (model_type ``step3p7``).

They share most keys and an export writes both spellings, so one pass reads them all: for a
field spelled two ways, the line that reads it says which spelling wins. What only one dialect
has is read by its module. MoE layers (``moe_layers_enum`` / ``mlp_layer_types``, the ``moe_*``
keys or transformers' ``n_routed_experts`` / ``num_experts_per_tok``, routed ``swiglu_limits`` vs
``swiglu_limits_shared``) and the MTP layers (``num_nextn_predict_layers``, whose entries pad the
per-layer lists) become megatron-core's MoE fields and ``mtp_num_layers`` in ``megatron_config``.

Anything megatron cannot compute exactly is refused with ``HFConfigError`` naming the key and value
(a softmax router, no router bias, unnormalised top-k weights, RoPE scaling, biases, a full-width
gate, ...).
"""

from mcore_ext.hf.config import released, step3p7
from mcore_ext.hf.config.base import DENSE, FULL, MODEL_TYPE, SLIDING, SPARSE, HFConfigError

# Carried from an imported config.json to the exported one unchanged (they do not affect weights).
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
               "max_seq_len", "initializer_range", "use_cache")


def fields_from_hf_dict(raw: dict) -> dict:
    """``Step35Config`` fields of a config.json dict (any of the dialects above)."""
    c = step3p7.text_config(raw)
    if c.get("model_type") != MODEL_TYPE:
        raise HFConfigError(
            f"model_type={c.get('model_type')!r}: mcore_ext.hf converts Step-3.5 models "
            f"(model_type {MODEL_TYPE!r}, or {step3p7.WRAPPER_MODEL_TYPE!r} with a text_config)"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in c:
            raise HFConfigError(f"config.json has no {key!r}")

    n = int(c["num_hidden_layers"])
    m = int(c.get("num_nextn_predict_layers") or c.get("num_mtp_layers") or 0)
    lists = released.PaddedLists(c, n, m)

    def mtp_entries(key, transformers_key=None):
        """The MTP layers' entries: a padded list's tail, else transformers' mtp_* key."""
        tail = lists.mtp(key)
        if tail is None and transformers_key:
            tail = c.get(transformers_key)
        return tail

    layer_types = lists.main("layer_types") or [FULL] * n
    for i, kind in enumerate(layer_types):  # before anything reads per-kind values
        if kind not in (FULL, SLIDING):
            raise HFConfigError(
                f"layer_types[{i}]={kind!r}: only {FULL!r} and {SLIDING!r} are supported"
            )
    mtp_types = mtp_entries("layer_types", "mtp_layer_types")
    if mtp_types is None and m:  # Step's MTP layers are sliding (transformers: as listed)
        mtp_types = [SLIDING if c.get("layer_types") else FULL] * m
    mlp_types = lists.main("mlp_layer_types")
    mtp_mlp_types = mtp_entries("mlp_layer_types", "mtp_mlp_layer_types")
    if mlp_types is None:  # the released moe_layers_enum, else transformers' default
        moe = released.moe_layers_from_enum(c)
        if moe is None:
            moe = step3p7.default_moe_layers(n)
        mlp_types = [SPARSE if i in moe else DENSE for i in range(n)]
        mtp_mlp_types = [SPARSE if i in moe else DENSE for i in range(n, n + m)]
    sparse_mtp = [n + k for k, t in enumerate(mtp_mlp_types or ()) if t != DENSE]
    if sparse_mtp:
        raise HFConfigError(
            f"mlp_layer_types: MTP layers {sparse_mtp} are MoE; Step-3.5's MTP layers are "
            "dense (only those are converted)"
        )
    moe = _moe_fields(c, mlp_types, lists) if SPARSE in mlp_types else {}

    heads = int(c["num_attention_heads"])
    kv = c.get("num_key_value_heads", c.get("num_attention_groups"))  # transformers' first
    kv = heads if kv is None else int(kv)
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    other = released.other_setting(c, head_dim)
    sliding_heads = c.get("num_sliding_attention_heads") or other["num_attention_heads"]
    sliding_kv = other["num_key_value_heads"]
    if c.get("per_layer_config"):  # transformers' per-layer counts, where given, win
        per_kind = step3p7.sliding_counts_from_per_layer(c["per_layer_config"], layer_types,
                                                         heads, kv)
        sliding_heads = per_kind.get("num_attention_heads", sliding_heads)
        sliding_kv = per_kind.get("num_key_value_heads", sliding_kv)

    if c.get("rope_scaling"):
        raise HFConfigError(f"rope_scaling={c['rope_scaling']!r}: only default RoPE is supported")
    rope = step3p7.rope_from_parameters(c, sorted(set(layer_types)))
    rope_theta, partial = rope or released.rope_from_lists(c, layer_types, lists)
    limits = lists.main("swiglu_limits_shared")
    limits = [(float(x) if x else None) for x in limits] if limits else [None] * n
    mtp_limits = mtp_entries("swiglu_limits_shared")
    mtp_limits = [(float(x) if x else None) for x in mtp_limits] if mtp_limits else None
    if m:
        released.check_mtp_rope(c, n, m, mtp_types, rope_theta, partial)
    _refuse_what_megatron_cannot_compute(c)

    return dict(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        layer_types=list(layer_types),
        num_sliding_heads=int(sliding_heads) if sliding_heads else None,
        num_sliding_kv_heads=int(sliding_kv) if sliding_kv else None,
        sliding_window=c.get("sliding_window"),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        swiglu_limits=limits,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        query_pre_attn_scalar=c.get("query_pre_attn_scalar"),
        max_position_embeddings=int(c.get("max_position_embeddings")
                                    or c.get("max_seq_len") or 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        extra={k: c[k] for k in PASSTHROUGH if k in c},
        mlp_layer_types=list(mlp_types),
        num_mtp_layers=m,
        mtp_layer_types=list(mtp_types) if m else None,
        mtp_swiglu_limits=mtp_limits,
        **moe,
    )


def _refuse_what_megatron_cannot_compute(c: dict) -> None:
    for key, bad in (("attention_bias", True), ("mlp_bias", True),
                     ("use_bidirectional_attention", True), ("zero_centered", False),
                     ("use_qk_norm", False), ("use_head_wise_attn_gate", False)):
        if key in c and bool(c[key]) == bad:
            raise HFConfigError(f"{key}={c[key]!r} is not supported by the Step-3.5 conversion")
    if c.get("gating", True) not in (True, "per-head"):
        raise HFConfigError(
            f"gating={c['gating']!r} (a head_dim-wide g_proj) is not supported: mcore_ext's "
            "gate is one scalar per head"
        )
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swiglu", "swigluoai"):
        raise HFConfigError(f"hidden_act={act!r}: Step-3.5's dense MLP is SwiGLU (silu)")


def _first(c: dict, *keys, default=None):
    for key in keys:
        if c.get(key) is not None:
            return c[key]
    return default


def _moe_fields(c: dict, mlp_types: list, lists: released.PaddedLists) -> dict:
    """``Step35Config``'s MoE fields: the released spelling first, then transformers'."""
    released.check_router(c)
    defaults = step3p7.MOE_DEFAULTS
    shared = _first(c, "share_expert_dim", "share_expert_dims",
                    default=defaults["share_expert_dim"])
    if isinstance(shared, (list, tuple)):
        if len(shared) != 1:
            raise HFConfigError(f"share_expert_dims={shared!r}: one shared expert is supported")
        shared = shared[0]
    routed = lists.main("swiglu_limits")
    routed = [(float(x) if x else None) for x in routed] if routed else [None] * len(mlp_types)
    if len(routed) != len(mlp_types):
        raise HFConfigError(f"swiglu_limits has {len(routed)} entries, num_hidden_layers is "
                            f"{len(mlp_types)}")
    return dict(
        num_experts=int(_first(c, "moe_num_experts", "n_routed_experts",
                               default=defaults["num_experts"])),
        moe_top_k=int(_first(c, "moe_top_k", "num_experts_per_tok",
                             default=defaults["moe_top_k"])),
        moe_intermediate_size=int(_first(c, "moe_intermediate_size",
                                         default=defaults["moe_intermediate_size"])),
        share_expert_dim=int(shared),
        moe_router_scaling_factor=float(_first(c, "moe_router_scaling_factor", default=1.0)),
        router_fp32=bool(c.get("need_fp32_gate", True)),
        expert_swiglu_limits=routed,
    )
