"""Step-3.5 config.json <-> ``Step35Config`` <-> ``GatedTransformerConfig`` fields.

``Step35Config`` is the dense Step-3.5 text decoder as both sides need it, with the semantics of
transformers' ``Step3p7TextConfig`` (model_type ``step3p5``). ``Step35Config.from_hf_dict`` reads
the three forms a config.json comes in:

- the released ``Step3p5ForCausalLM`` one (legacy keys: ``num_attention_groups``,
  ``attention_other_setting``, list-valued ``rope_theta`` / ``partial_rotary_factors``,
  ``swiglu_limits_shared``, per-layer lists padded with ``num_nextn_predict_layers`` MTP entries,
  ``moe_layers_enum``);
- transformers' own saved ``Step3p7TextConfig`` (``num_key_value_heads``,
  ``num_sliding_attention_heads``, ``rope_parameters`` per layer type, ``mlp_layer_types``);
- the ``text_config`` of a ``Step3p7Config`` (model_type ``step3p7``).

MoE layers (``moe_layers_enum`` / ``mlp_layer_types``, the ``moe_*`` keys or transformers'
``n_routed_experts`` / ``num_experts_per_tok``, routed ``swiglu_limits`` vs ``swiglu_limits_shared``)
and the MTP layers (``num_nextn_predict_layers``, whose entries pad the per-layer lists) map onto
megatron-core's MoE fields and ``mtp_num_layers`` (see STEP35 in the README).

Anything megatron cannot compute exactly is refused with ``HFConfigError`` naming the key and value
(a softmax router, no router bias, unnormalised top-k weights, RoPE scaling, biases, a full-width
gate, ...).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
DENSE, SPARSE = "dense", "sparse"
MODEL_TYPE = "step3p5"
ARCHITECTURE = "Step3p5ForCausalLM"

# Carried from an imported config.json to the exported one unchanged (they do not affect weights).
_PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
                "max_seq_len", "initializer_range", "use_cache")


class HFConfigError(ValueError):
    """A Hugging Face config (or a megatron model) the Step-3.5 conversion cannot represent."""


@dataclass
class Step35Config:
    """A dense Step-3.5 text decoder: what the weights of both layouts need, nothing more."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # full-attention layers
    num_kv_heads: int
    head_dim: int
    layer_types: list = None  # one of FULL / SLIDING per layer
    num_sliding_heads: Optional[int] = None  # None = num_heads
    num_sliding_kv_heads: Optional[int] = None  # None = num_kv_heads (vLLM reads it; see README)
    sliding_window: Optional[int] = None
    rope_theta: dict = field(default_factory=lambda: {FULL: 10000.0})  # per layer type
    partial_rotary_factor: dict = field(default_factory=lambda: {FULL: 1.0})  # per layer type
    swiglu_limits: list = None  # per layer, None = no clamp
    rms_norm_eps: float = 1e-5
    query_pre_attn_scalar: Optional[float] = None  # None = head_dim
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # _PASSTHROUGH keys of the source config
    # MoE (Step3p7SparseMoeBlock): a sigmoid router whose fp32 bias only selects experts,
    # renormalised top-k weights, the routed output scaled, one always-on shared expert.
    mlp_layer_types: list = None  # DENSE / SPARSE per main layer; None = all dense
    num_experts: Optional[int] = None
    moe_top_k: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    share_expert_dim: Optional[int] = None
    moe_router_scaling_factor: float = 1.0
    router_fp32: bool = True  # need_fp32_gate: router logits in fp32
    expert_swiglu_limits: list = None  # routed experts' clamp per main layer (HF swiglu_limits)
    # MTP layers: dense, global index num_layers + k, their own output head and norm.
    num_mtp_layers: int = 0
    mtp_layer_types: list = None  # attention kind per MTP layer
    mtp_swiglu_limits: list = None  # the MTP layers' MLP clamps (HF swiglu_limits_shared tail)

    def __post_init__(self):
        # One spelling per model: values equal to their defaults are stored as None.
        if self.query_pre_attn_scalar is not None and float(self.query_pre_attn_scalar) == self.head_dim:
            self.query_pre_attn_scalar = None
        if self.num_sliding_kv_heads == self.num_kv_heads:
            self.num_sliding_kv_heads = None
        if self.num_sliding_heads == self.num_heads:
            self.num_sliding_heads = None
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_layers
        if self.swiglu_limits is None:
            self.swiglu_limits = [None] * self.num_layers
        for name in ("layer_types", "swiglu_limits"):
            if len(getattr(self, name)) != self.num_layers:
                raise HFConfigError(
                    f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is "
                    f"{self.num_layers}"
                )
        for i, kind in enumerate(self.layer_types):
            if kind not in (FULL, SLIDING):
                raise HFConfigError(
                    f"layer_types[{i}]={kind!r}: only {FULL!r} and {SLIDING!r} are supported"
                )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise HFConfigError("layer_types has sliding_attention layers but sliding_window is "
                                f"{self.sliding_window!r}")
        self._post_init_moe_mtp()

    def _post_init_moe_mtp(self):
        n, m = self.num_layers, self.num_mtp_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [DENSE] * n
        if self.expert_swiglu_limits is None:
            self.expert_swiglu_limits = [None] * n
        if self.mtp_layer_types is None:
            self.mtp_layer_types = [SLIDING if SLIDING in self.layer_types else FULL] * m
        if self.mtp_swiglu_limits is None:
            self.mtp_swiglu_limits = [None] * m
        for name, length in (("mlp_layer_types", n), ("expert_swiglu_limits", n),
                             ("mtp_layer_types", m), ("mtp_swiglu_limits", m)):
            if len(getattr(self, name)) != length:
                raise HFConfigError(f"{name} has {len(getattr(self, name))} entries, expected "
                                    f"{length}")
        for i, kind in enumerate(self.mlp_layer_types):
            if kind not in (DENSE, SPARSE):
                raise HFConfigError(f"mlp_layer_types[{i}]={kind!r}: only {DENSE!r} and "
                                    f"{SPARSE!r} are supported")
        for i, kind in enumerate(self.mtp_layer_types):
            if kind not in (FULL, SLIDING):
                raise HFConfigError(f"mtp_layer_types[{i}]={kind!r}: only {FULL!r} and "
                                    f"{SLIDING!r} are supported")
        if SLIDING in self.mtp_layer_types and not self.sliding_window:
            raise HFConfigError("the MTP layers are sliding_attention but sliding_window is "
                                f"{self.sliding_window!r}")
        if self.is_moe:
            for name in ("num_experts", "moe_top_k", "moe_intermediate_size", "share_expert_dim"):
                value = getattr(self, name)
                if not value or int(value) < 1:
                    raise HFConfigError(f"{name}={value!r}: MoE layers need a positive value")
            if self.moe_top_k < 2:
                raise HFConfigError(f"moe_top_k={self.moe_top_k}: Step-3.5 renormalises the "
                                    "top-k weights, megatron only when top-k > 1")
            if self.moe_top_k > self.num_experts:
                raise HFConfigError(f"moe_top_k={self.moe_top_k} exceeds moe_num_experts="
                                    f"{self.num_experts}")

    # ------------------------------------------------------------------------ per layer

    @property
    def is_moe(self) -> bool:
        return SPARSE in (self.mlp_layer_types or ())

    def layer_type(self, layer: int) -> str:
        """Attention kind of global layer ``layer`` (0-based; MTP layers follow the main ones)."""
        if layer >= self.num_layers:
            return self.mtp_layer_types[layer - self.num_layers]
        return self.layer_types[layer]

    def is_sparse(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is an MoE layer (MTP layers are dense)."""
        return layer < self.num_layers and self.mlp_layer_types[layer] == SPARSE

    def heads(self, layer: int) -> int:
        if self.layer_type(layer) == SLIDING and self.num_sliding_heads:
            return self.num_sliding_heads
        return self.num_heads

    def kv_heads(self, layer: int) -> int:
        if self.layer_type(layer) == SLIDING and self.num_sliding_kv_heads:
            return self.num_sliding_kv_heads
        return self.num_kv_heads

    def _kind_value(self, table: dict, kind: str):
        return table.get(kind, table.get(FULL))

    # ---------------------------------------------------------------------- HF -> here

    @classmethod
    def from_hf_dict(cls, raw: dict) -> "Step35Config":
        """Normalize a config.json dict (any of the three forms in the module docstring)."""
        c = dict(raw)
        if c.get("model_type") == "step3p7" and isinstance(c.get("text_config"), dict):
            c = dict(c["text_config"], model_type=MODEL_TYPE)
        if c.get("model_type") != MODEL_TYPE:
            raise HFConfigError(
                f"model_type={c.get('model_type')!r}: mcore_ext.hf converts Step-3.5 models "
                f"(model_type {MODEL_TYPE!r}, or 'step3p7' with a text_config)"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in c:
                raise HFConfigError(f"config.json has no {key!r}")

        n = int(c["num_hidden_layers"])
        m = int(c.get("num_nextn_predict_layers") or c.get("num_mtp_layers") or 0)
        padded = n + m

        def per_layer(key, default=None):
            value = c.get(key, default)
            if isinstance(value, list) and len(value) == padded:
                value = value[:n]  # legacy hub configs append the MTP layers' entries
            return value

        def mtp_tail(key, mtp_key=None):
            """The MTP layers' entries: a padded list's tail, else transformers' mtp_* key."""
            value = c.get(key)
            if m and isinstance(value, list) and len(value) == padded:
                return value[n:]
            return c.get(mtp_key) if mtp_key else None

        layer_types = per_layer("layer_types") or [FULL] * n
        for i, kind in enumerate(layer_types):  # before anything reads per-kind values
            if kind not in (FULL, SLIDING):
                raise HFConfigError(
                    f"layer_types[{i}]={kind!r}: only {FULL!r} and {SLIDING!r} are supported"
                )
        mtp_types = mtp_tail("layer_types", "mtp_layer_types")
        if mtp_types is None and m:  # Step's MTP layers are sliding (transformers: as listed)
            mtp_types = [SLIDING if c.get("layer_types") else FULL] * m
        mlp_types = per_layer("mlp_layer_types")
        mtp_mlp_types = mtp_tail("mlp_layer_types", "mtp_mlp_layer_types")
        if mlp_types is None:
            # transformers' default: the legacy moe_layers_enum, else MoE from layer 3 on.
            enum = c.get("moe_layers_enum")
            if enum is not None:
                items = enum.split(",") if isinstance(enum, str) else enum
                moe = {int(i) for i in items if str(i).strip()}
            else:
                moe = set(range(3, n))
            mlp_types = [SPARSE if i in moe else DENSE for i in range(n)]
            mtp_mlp_types = [SPARSE if i in moe else DENSE for i in range(n, padded)]
        sparse_mtp = [n + k for k, t in enumerate(mtp_mlp_types or ()) if t != DENSE]
        if sparse_mtp:
            raise HFConfigError(
                f"mlp_layer_types: MTP layers {sparse_mtp} are MoE; Step-3.5's MTP layers are "
                "dense (only those are converted)"
            )
        moe = _moe_fields(c, mlp_types, per_layer) if SPARSE in mlp_types else {}

        heads = int(c["num_attention_heads"])
        kv = c.get("num_key_value_heads", c.get("num_attention_groups"))
        kv = heads if kv is None else int(kv)
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        other = c.get("attention_other_setting") or {}
        sliding_heads = c.get("num_sliding_attention_heads") or other.get("num_attention_heads")
        sliding_kv = other.get("num_attention_groups", other.get("num_key_value_heads"))
        if other.get("head_dim") not in (None, head_dim):
            raise HFConfigError(
                f"attention_other_setting.head_dim={other['head_dim']} differs from head_dim="
                f"{head_dim}: one head dim for both layer kinds is supported"
            )
        if c.get("per_layer_config"):
            per_kind = _sliding_counts_from_per_layer(c["per_layer_config"], layer_types,
                                                      heads, kv)
            sliding_heads = per_kind.get("num_attention_heads", sliding_heads)
            sliding_kv = per_kind.get("num_key_value_heads", sliding_kv)

        rope_theta, partial = _rope_by_kind(c, layer_types, per_layer)
        limits = per_layer("swiglu_limits_shared")
        limits = [(float(x) if x else None) for x in limits] if limits else [None] * n
        mtp_limits = mtp_tail("swiglu_limits_shared")
        mtp_limits = [(float(x) if x else None) for x in mtp_limits] if mtp_limits else None
        if m:
            _check_mtp_rope(c, n, m, mtp_types, rope_theta, partial)

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

        return cls(
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
            extra={k: c[k] for k in _PASSTHROUGH if k in c},
            mlp_layer_types=list(mlp_types),
            num_mtp_layers=m,
            mtp_layer_types=list(mtp_types) if m else None,
            mtp_swiglu_limits=mtp_limits,
            **moe,
        )

    # ---------------------------------------------------------------------- here -> HF

    def to_hf_dict(self) -> dict:
        """config.json in the released layout (``Step3p5ForCausalLM``), which transformers'
        ``Step3p7TextConfig`` also reads: the legacy per-layer lists, plus the modern keys."""
        n = self.num_layers
        # The released per-layer lists are padded with the MTP layers' entries.
        types = list(self.layer_types) + list(self.mtp_layer_types)
        theta = [float(self._kind_value(self.rope_theta, t)) for t in types]
        partial = [float(self._kind_value(self.partial_rotary_factor, t)) for t in types]
        shared_limits = list(self.swiglu_limits) + list(self.mtp_swiglu_limits)
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": n,
            "num_attention_heads": self.num_heads,
            "num_attention_groups": self.num_kv_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": types,
            "sliding_window": self.sliding_window,
            "rope_theta": theta,
            "partial_rotary_factors": partial,
            "swiglu_limits_shared": [x if x else 0.0 for x in shared_limits],
            "mlp_layer_types": list(self.mlp_layer_types) + [DENSE] * self.num_mtp_layers,
            "moe_layers_enum": ",".join(str(i) for i in range(n) if self.is_sparse(i)),
            "num_nextn_predict_layers": self.num_mtp_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "use_head_wise_attn_gate": True,
            "use_qk_norm": True,
            "zero_centered": True,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        if self.is_moe:
            out.update(self._moe_hf_keys())
        if SLIDING in types:
            out["attention_other_setting"] = {
                "attention_type": SLIDING,
                "num_attention_heads": self.num_sliding_heads or self.num_heads,
                "num_attention_groups": self.num_sliding_kv_heads or self.num_kv_heads,
                "head_dim": self.head_dim,
            }
            out["num_sliding_attention_heads"] = self.num_sliding_heads or self.num_heads
            # transformers reads each layer's counts here (attention_other_setting: vLLM).
            out["per_layer_config"] = {
                str(i): {"num_attention_heads": self.heads(i),
                         "num_key_value_heads": self.kv_heads(i)}
                for i, kind in enumerate(self.layer_types) if kind == SLIDING}
        if self.query_pre_attn_scalar not in (None, self.head_dim):
            out["query_pre_attn_scalar"] = self.query_pre_attn_scalar
        out.update(self.extra)
        return out

    def _moe_hf_keys(self) -> dict:
        """The released MoE keys, plus transformers' spellings of the renamed ones."""
        routed = list(self.expert_swiglu_limits) + [None] * self.num_mtp_layers
        return {
            "moe_num_experts": self.num_experts,
            "moe_top_k": self.moe_top_k,
            "moe_intermediate_size": self.moe_intermediate_size,
            "share_expert_dim": self.share_expert_dim,
            "moe_router_activation": "sigmoid",
            "moe_router_scaling_factor": self.moe_router_scaling_factor,
            "use_moe_router_bias": True,
            "need_fp32_gate": self.router_fp32,
            "norm_expert_weight": True,
            "swiglu_limits": [x if x else 0.0 for x in routed],
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.moe_top_k,
        }

    # ----------------------------------------------------------- here <-> megatron

    def transformer_config_fields(self) -> dict:
        """``GatedTransformerConfig`` fields of this model (parallel sizes and dtypes left out)."""
        # Per-layer lists cover the MTP layers too (their entries last), as in config.json.
        all_types = list(self.layer_types) + list(self.mtp_layer_types)
        kinds = set(all_types)
        sliding = SLIDING in kinds
        fields = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.intermediate_size,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv_heads,
            kv_channels=self.head_dim,
            head_wise_attn_gate=True,
            head_wise_attn_gate_init_bias=0.0,  # no gate bias rows to start (g_proj has no bias)
            add_bias_linear=False,
            add_qkv_bias=False,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            layernorm_zero_centered_gamma=True,
            qk_layernorm=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            rotary_base=float(self.rope_theta[FULL]) if FULL in kinds else 10000.0,
            rotary_percent=float(self.partial_rotary_factor.get(FULL, 1.0)),
        )
        if self.query_pre_attn_scalar not in (None, self.head_dim):
            fields["softmax_scale"] = float(self.query_pre_attn_scalar) ** -0.5
        if sliding:
            fields.update(
                layer_types=all_types,
                sliding_window=int(self.sliding_window),
                sliding_rotary_base=float(self.rope_theta.get(SLIDING, fields["rotary_base"])),
                sliding_rotary_percent=float(self.partial_rotary_factor.get(
                    SLIDING, fields["rotary_percent"])),
            )
            if kinds == {SLIDING}:  # no full layer: the full-layer values are unused
                fields["rotary_base"] = fields["sliding_rotary_base"]
                fields["rotary_percent"] = fields["sliding_rotary_percent"]
            if self.num_sliding_heads not in (None, self.num_heads):
                fields["sliding_num_attention_heads"] = self.num_sliding_heads
            if self.num_sliding_kv_heads not in (None, self.num_kv_heads):
                fields["sliding_num_query_groups"] = self.num_sliding_kv_heads
        limits = list(self.swiglu_limits) + list(self.mtp_swiglu_limits)
        if any(limits):
            fields["swiglu_limits"] = limits
        if self.num_mtp_layers:
            fields["mtp_num_layers"] = self.num_mtp_layers
        if self.is_moe:
            fields.update(
                num_moe_experts=self.num_experts,
                moe_router_topk=self.moe_top_k,
                moe_ffn_hidden_size=self.moe_intermediate_size,
                moe_shared_expert_intermediate_size=self.share_expert_dim,
                moe_layer_freq=[int(self.is_sparse(i)) for i in range(self.num_layers)],
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=(None if self.moe_router_scaling_factor == 1.0
                                                else self.moe_router_scaling_factor),
                moe_router_dtype="fp32" if self.router_fp32 else None,
            )
            if any(self.expert_swiglu_limits):
                fields["moe_expert_swiglu_limits"] = list(self.expert_swiglu_limits)
        return fields

    @classmethod
    def from_transformer_config(
        cls, config, *, vocab_size: int, max_position_embeddings: int,
        share_embeddings: bool = False, position_embedding_type: str = "rope", extra=None,
        rope_scaling: bool = False, seq_len_interpolation_factor: Optional[float] = None,
    ) -> "Step35Config":
        """The Step-3.5 description of a megatron model, or ``HFConfigError`` naming what the
        layout cannot hold. ``rope_scaling`` / ``seq_len_interpolation_factor``: the GPTModel's
        (they are not config fields)."""
        problems = []

        def need(ok, what):
            if not ok:
                problems.append(what)

        need(getattr(config, "head_wise_attn_gate", False),
             "head_wise_attn_gate=False (Step-3.5 has a g_proj gate on every layer)")
        need(config.normalization == "RMSNorm", f"normalization={config.normalization!r} "
             "(Step-3.5 uses RMSNorm)")
        need(config.layernorm_zero_centered_gamma, "layernorm_zero_centered_gamma=False "
             "(Step-3.5's norms compute x * (1 + w))")
        need(config.qk_layernorm, "qk_layernorm=False (Step-3.5 has per-head q/k norms)")
        need(not config.add_bias_linear, "add_bias_linear=True (Step-3.5 has no linear biases)")
        need(not config.add_qkv_bias, "add_qkv_bias=True (Step-3.5 has no QKV or gate bias)")
        need(config.gated_linear_unit, "gated_linear_unit=False (Step-3.5's MLP is SwiGLU)")
        act = getattr(config.activation_func, "__name__", str(config.activation_func))
        need(act == "silu", f"activation_func={act} (Step-3.5's MLP is SwiGLU: silu)")
        if config.num_moe_experts:
            _check_megatron_moe(config, need)
        need(getattr(config, "mtp_step35_heads", True), "mtp_step35_heads=False (Step-3.5's MTP "
             "layers have their own output head and norm)")
        need(position_embedding_type == "rope", f"position_embedding_type="
             f"{position_embedding_type!r} (Step-3.5 uses RoPE)")
        need(not getattr(config, "multi_latent_attention", False), "multi_latent_attention=True")
        need(not config.attention_output_gate, "attention_output_gate=True (a head_dim-wide "
             "gate; Step-3.5's g_proj has one scalar per head)")
        need(getattr(config, "activation_func_clamp_value", None) is None,
             "activation_func_clamp_value (megatron's pre-activation clamp is not Step-3.5's)")
        # Fields that change the function without a weight to show it (getattr: releases before
        # 0.19 lack some of them, and then they are off).
        need(not getattr(config, "rotary_interleaved", False), "rotary_interleaved=True "
             "(Step-3.5 rotates the two halves of each head, not interleaved pairs)")
        need(getattr(config, "window_size", None) is None,
             f"window_size={getattr(config, 'window_size', None)} (one window on every layer; "
             "the layout's windows belong to layer kinds: layer_types + sliding_window)")
        need(not getattr(config, "qk_l2_norm", False), "qk_l2_norm=True (Step-3.5's q/k norms "
             "are RMSNorms with weights)")
        no_rope = getattr(config, "no_rope_freq", None)
        need(not no_rope or not any(no_rope if isinstance(no_rope, list) else [no_rope]),
             f"no_rope_freq={no_rope!r} (layers without RoPE; every Step-3.5 layer has RoPE)")
        softmax_type = getattr(config, "softmax_type", "vanilla")
        need(softmax_type == "vanilla", f"softmax_type={softmax_type!r} (Step-3.5's softmax "
             "is vanilla: no sink term)")
        need(not getattr(config, "use_mup", False), "use_mup=True (muP's embedding / output "
             "multipliers are not part of the layout)")
        need(getattr(config, "experimental_attention_variant", None) is None,
             f"experimental_attention_variant="
             f"{getattr(config, 'experimental_attention_variant', None)!r}")
        need(not rope_scaling, "rope_scaling=True (llama-3 RoPE scaling; the layout's RoPE is "
             "unscaled)")
        need(seq_len_interpolation_factor is None,
             f"seq_len_interpolation_factor={seq_len_interpolation_factor} (the layout's RoPE is "
             "unscaled)")
        if problems:
            raise HFConfigError(
                "this model cannot be written in the Step-3.5 layout: " + "; ".join(problems)
            )
        del share_embeddings  # an untied lm_head holds a tied model exactly (a copy)

        n = config.num_layers
        m = int(getattr(config, "mtp_num_layers", None) or 0)
        all_types = getattr(config, "layer_types", None)
        if all_types is None:
            all_types = [FULL] * (n + m)
        elif len(all_types) == n:  # the MTP layers follow Step's rule: sliding
            all_types = list(all_types) + [SLIDING] * m
        layer_types = list(all_types[:n])
        sliding_base = getattr(config, "sliding_rotary_base", None)
        sliding_pct = getattr(config, "sliding_rotary_percent", None)
        rotary_base = float(getattr(config, "rotary_base", 10000.0))
        rotary_pct = float(getattr(config, "rotary_percent", 1.0))
        default_scale = config.kv_channels ** -0.5
        scale = config.softmax_scale
        scalar = None
        if scale is not None and not math.isclose(scale, default_scale, rel_tol=1e-12):
            scalar = 1.0 / (scale * scale)
        limits = list(getattr(config, "swiglu_limits", None) or [None] * n)
        limits += [None] * (n + m - len(limits))
        moe = _moe_from_megatron(config) if config.num_moe_experts else {}
        return cls(
            vocab_size=vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.ffn_hidden_size,
            num_layers=n,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_query_groups,
            head_dim=config.kv_channels,
            layer_types=layer_types,
            num_sliding_heads=getattr(config, "sliding_num_attention_heads", None),
            num_sliding_kv_heads=getattr(config, "sliding_num_query_groups", None),
            sliding_window=getattr(config, "sliding_window", None),
            rope_theta={FULL: rotary_base,
                        SLIDING: float(sliding_base) if sliding_base else rotary_base},
            partial_rotary_factor={FULL: rotary_pct,
                                   SLIDING: float(sliding_pct) if sliding_pct else rotary_pct},
            swiglu_limits=[(float(x) if x else None) for x in limits[:n]],
            rms_norm_eps=config.layernorm_epsilon,
            query_pre_attn_scalar=scalar,
            max_position_embeddings=max_position_embeddings,
            extra=dict(extra or {}),
            num_mtp_layers=m,
            mtp_layer_types=list(all_types[n:]),
            mtp_swiglu_limits=[(float(x) if x else None) for x in limits[n:]],
            **moe,
        )

    def replace(self, **changes) -> "Step35Config":
        return dataclasses.replace(self, **changes)


_PER_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads")


def _sliding_counts_from_per_layer(per_layer_config: dict, layer_types: list, heads: int,
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


def _rope_by_kind(c: dict, layer_types: list, per_layer) -> tuple[dict, dict]:
    """(rope_theta, partial_rotary_factor) per layer type, from either config form."""
    if c.get("rope_scaling"):
        raise HFConfigError(f"rope_scaling={c['rope_scaling']!r}: only default RoPE is supported")
    kinds = sorted(set(layer_types))
    params = c.get("rope_parameters")
    if isinstance(params, dict) and all(isinstance(params.get(k), dict) for k in kinds):
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
    raw_theta = per_layer("rope_theta", 10000.0)
    raw_partial = per_layer("partial_rotary_factors")
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


# transformers' Step3p7TextConfig defaults (= Step-3.5-Flash's), for configs that omit a key.
_MOE_DEFAULTS = {"num_experts": 288, "moe_top_k": 8, "moe_intermediate_size": 1280,
                 "share_expert_dim": 1280}


def _first(c: dict, *keys, default=None):
    for key in keys:
        if c.get(key) is not None:
            return c[key]
    return default


def _moe_fields(c: dict, mlp_types: list, per_layer) -> dict:
    """Step35Config's MoE fields from the released keys or transformers' spellings, refusing
    router variants megatron's sigmoid router does not compute exactly."""
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
    shared = _first(c, "share_expert_dim", "share_expert_dims",
                    default=_MOE_DEFAULTS["share_expert_dim"])
    if isinstance(shared, (list, tuple)):
        if len(shared) != 1:
            raise HFConfigError(f"share_expert_dims={shared!r}: one shared expert is supported")
        shared = shared[0]
    routed = per_layer("swiglu_limits")
    routed = [(float(x) if x else None) for x in routed] if routed else [None] * len(mlp_types)
    if len(routed) != len(mlp_types):
        raise HFConfigError(f"swiglu_limits has {len(routed)} entries, num_hidden_layers is "
                            f"{len(mlp_types)}")
    return dict(
        num_experts=int(_first(c, "moe_num_experts", "n_routed_experts",
                               default=_MOE_DEFAULTS["num_experts"])),
        moe_top_k=int(_first(c, "moe_top_k", "num_experts_per_tok",
                             default=_MOE_DEFAULTS["moe_top_k"])),
        moe_intermediate_size=int(_first(c, "moe_intermediate_size",
                                         default=_MOE_DEFAULTS["moe_intermediate_size"])),
        share_expert_dim=int(shared),
        moe_router_scaling_factor=float(_first(c, "moe_router_scaling_factor", default=1.0)),
        router_fp32=bool(c.get("need_fp32_gate", True)),
        expert_swiglu_limits=routed,
    )


def _check_mtp_rope(c: dict, n: int, m: int, mtp_types: list, theta: dict, partial: dict):
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


def _check_megatron_moe(config, need) -> None:
    """The megatron MoE settings the Step-3.5 layout cannot hold, appended to ``need``'s list."""
    score = config.moe_router_score_function
    need(score == "sigmoid", f"moe_router_score_function={score!r} (Step-3.5's router is sigmoid)")
    need(config.moe_router_enable_expert_bias, "moe_router_enable_expert_bias=False (Step-3.5's "
         "router has an fp32 expert bias)")
    need(config.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size="
         "None (Step-3.5's MoE layers have a shared expert)")
    need(not getattr(config, "moe_shared_expert_gate", False), "moe_shared_expert_gate=True")
    need(config.moe_router_dtype in (None, "fp32"), f"moe_router_dtype="
         f"{config.moe_router_dtype!r} (need_fp32_gate is fp32 or the weights' dtype)")
    for key in ("moe_router_num_groups", "moe_router_group_topk"):
        need(not getattr(config, key, None), f"{key}={getattr(config, key)} (group-limited "
             "routing)")
    topk = config.moe_router_topk
    need(topk > 1, f"moe_router_topk={topk} (megatron renormalises only when top-k > 1; "
         "Step-3.5 always does)")


def megatron_moe_layers(config) -> list[bool]:
    """Which main layers of a megatron config are MoE (its ``moe_layer_freq``: a list or an
    every-N-layers int)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def _moe_from_megatron(config) -> dict:
    limits = list(getattr(config, "moe_expert_swiglu_limits", None) or [])
    limits = (limits + [None] * config.num_layers)[:config.num_layers]
    scale = config.moe_router_topk_scaling_factor
    return dict(
        mlp_layer_types=[SPARSE if x else DENSE for x in megatron_moe_layers(config)],
        num_experts=config.num_moe_experts,
        moe_top_k=config.moe_router_topk,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        share_expert_dim=config.moe_shared_expert_intermediate_size,
        moe_router_scaling_factor=float(scale) if scale is not None else 1.0,
        router_fp32=config.moe_router_dtype == "fp32",
        expert_swiglu_limits=[(float(x) if x else None) for x in limits],
    )
