"""Megatron-LM command-line flags for every field ``GatedTransformerConfig`` adds.

The flags are generated the way megatron.training generates its own from dataclass fields
(``ArgumentGroupFactory``: type, default, choices and help from the field and its docstring),
with ``dest`` = the field name, so ``core_transformer_config_from_args(args,
config_class=GatedTransformerConfig)`` copies them into the config like any native field. A field
added to ``GatedTransformerConfig`` later gets its flag without a change here.

A field whose name megatron already has a flag for (``rotary_base``, ``rotary_percent``, or one a
later Megatron-LM adds natively, such as ``head_wise_attn_gate``) keeps megatron's flag: that one
already fills the field, and two flags for one destination would fight.
"""

import argparse
import dataclasses
import sys

from mcore_ext import _mcore_compat
from mcore_ext.cli import report_error

_mcore_compat.check_megatron_training()

from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mcore_ext.config import GatedTransformerConfig  # noqa: E402

BACKEND_FLAG = "--mcore-ext-backend"
GROUP_TITLE = "mcore_ext: head-wise attention gate, Step-3.5 layer kinds"
BACKENDS = ("auto", "sdpa", "local", "te")


def mcore_ext_fields() -> list[dataclasses.Field]:
    """The fields ``GatedTransformerConfig`` adds to megatron's ``TransformerConfig``."""
    native = {field.name for field in dataclasses.fields(TransformerConfig)}
    return [
        field for field in dataclasses.fields(GatedTransformerConfig)
        if field.name not in native and field.init
    ]


def _taken(parser: argparse.ArgumentParser, field_name: str, option: str) -> bool:
    """Whether the parser already has a flag for this destination or option string."""
    return option in parser._option_string_actions or any(
        action.dest == field_name for action in parser._actions
    )


def add_mcore_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron's ``extra_args_provider``: the gate's and layer kinds' flags, plus the backend.

    Returns the parser (megatron's convention). Raises ``TypeError`` naming a field whose type
    argparse cannot express (give it ``metadata={"argparse_meta": {...}}``, megatron's override).
    """
    from megatron.training.argument_utils import ArgumentGroupFactory, TypeInferenceError

    factory = ArgumentGroupFactory(GatedTransformerConfig)
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="GatedTransformerConfig's fields (mcore_ext): the head-wise attention gate "
                    "(--head-wise-attn-gate), Step-3.5's layer kinds and clamps; and the "
                    "attention backend",
    )
    # First in --help, before megatron's ~900 flags (argparse lists groups in creation order).
    parser._action_groups.remove(group)
    parser._action_groups.insert(2, group)
    parser.usage = ("torchrun --nproc_per_node=N -m mcore_ext.megatron_lm.pretrain_gpt "
                    "[Megatron-LM's flags] [mcore_ext's flags]")
    parser.description = (f"Megatron-LM's GPT pretraining with mcore_ext's model. mcore_ext's "
                          f"flags: the group '{GROUP_TITLE}' below; then Megatron-LM's.")
    for field in mcore_ext_fields():
        try:
            kwargs = factory._build_argparse_kwargs_from_field(field)
        except TypeInferenceError as err:
            raise TypeError(
                f"GatedTransformerConfig.{field.name} ({field.type}) has no command-line form: "
                f"{err}; add metadata={{'argparse_meta': {{...}}}} to the field"
            ) from None
        names = kwargs.pop("arg_names")
        if any(_taken(parser, field.name, name) for name in names):
            continue  # megatron has this flag natively: it fills the field already
        group.add_argument(*names, **kwargs)
    if not _taken(parser, "mcore_ext_backend", BACKEND_FLAG):
        group.add_argument(
            BACKEND_FLAG, dest="mcore_ext_backend", choices=BACKENDS, default="auto",
            help="mcore_ext attention backend: te (Transformer Engine), local (megatron's "
                 "DotProductAttention), sdpa (torch SDPA, also CPU), auto (te on a GPU with "
                 "Transformer Engine, else sdpa)",
        )
    _mcore_compat.escape_help_percent_signs(parser)
    parser.error = _one_line_error
    return parser


def _one_line_error(message: str):
    """argparse's error for megatron's parser: the mistake on one line from the first rank
    (argparse would print the usage of every flag first, on every rank), exit 2 on all."""
    sys.exit(report_error(f"{message} (--help lists the flags)"))


def transformer_config_from_args(args: argparse.Namespace) -> GatedTransformerConfig:
    """megatron's ``core_transformer_config_from_args`` building a ``GatedTransformerConfig``.

    Refuses the megatron flags that pick another config class (MLA, heterogeneous layers), which
    would silently drop the gate.
    """
    from megatron.training.arguments import core_transformer_config_from_args

    for flag, dest in (("--multi-latent-attention", "multi_latent_attention"),
                       ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path")):
        if getattr(args, dest, None):
            raise ValueError(
                f"{flag} makes megatron build its own config class, without mcore_ext's fields: "
                "it cannot be combined with mcore_ext.megatron_lm"
            )
    config = core_transformer_config_from_args(args, config_class=GatedTransformerConfig)
    if not isinstance(config, GatedTransformerConfig):  # a later megatron ignoring config_class
        raise TypeError(
            f"core_transformer_config_from_args built a {type(config).__name__}, not a "
            "GatedTransformerConfig"
        )
    return config
