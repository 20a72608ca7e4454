"""mcore_ext._mcore_compat: refusing a megatron-core with a native gate, and the distributed-optimizer
workarounds applying to torch's Adam only.

Both are part of the per-release smoke run (``-m smoke``): they depend on the installed release's
TransformerConfig and DistributedOptimizer.
"""

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import builders

ROOT = Path(__file__).resolve().parents[2]

# Imports mcore_ext, optionally after giving megatron's TransformerConfig a native
# head_wise_attn_gate field the way upstream Megatron-LM's dev branch has it: a dataclass field.
_IMPORT = """
import dataclasses, sys
from megatron.core.transformer import transformer_config

@dataclasses.dataclass
class TransformerConfig(transformer_config.TransformerConfig):
    head_wise_attn_gate: bool = False

if sys.argv[1] == "native":
    transformer_config.TransformerConfig = TransformerConfig
import mcore_ext
print("imported mcore_ext")
"""


@pytest.mark.smoke
def test_import_refuses_megatron_core_with_a_native_gate():
    import importlib.metadata

    version = importlib.metadata.version("megatron-core")
    procs = {
        kind: subprocess.Popen([sys.executable, "-c", _IMPORT, kind], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for kind in ("native", "release")
    }
    results = {kind: (p.wait(timeout=300), *p.communicate()) for kind, p in procs.items()}

    code, stdout, stderr = results["release"]  # the installed release has no native gate
    assert code == 0 and "imported mcore_ext" in stdout, stderr[-3000:]

    code, stdout, stderr = results["native"]
    assert code != 0 and "imported mcore_ext" not in stdout
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: mcore_ext cannot run on megatron-core"), stderr[-3000:]
    # Names the installed version and the native flag, and says what to do instead.
    for expected in (f"megatron-core {version}:", "native head_wise_attn_gate field",
                     "add them twice", "Use the native gate", f"'megatron-core{_supported_range()}'"):
        assert expected in last_line, (expected, last_line)


def _supported_range() -> str:
    """The megatron-core requirement of pyproject.toml, e.g. '>=0.16.1,<0.20'."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [d for d in dependencies if d.startswith("megatron-core")]
    return requirement.removeprefix("megatron-core")


class FusedAdamStandIn(torch.optim.Optimizer):
    """Stands in for Apex's / Transformer Engine's FusedAdam (neither is installed here): a torch
    Optimizer that is not a torch.optim.Adam, built with the arguments megatron gives it."""

    def __init__(self, params, lr, weight_decay, betas, eps, adam_w_mode, **_):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))


@contextlib.contextmanager
def _megatron_with_fused_adam(fused_adam_class):
    """megatron as if imported with Transformer Engine: it builds and expects ``fused_adam_class``.

    megatron.core.optimizer and its distrib_optimizer choose TE's / Apex's FusedAdam or torch's
    Adam at import and record the choice in these module globals.
    """
    from megatron.core import optimizer
    from megatron.core.optimizer import distrib_optimizer

    fused = {
        optimizer: dict(Adam=fused_adam_class, USING_PYTORCH_OPTIMIZER=False),
        distrib_optimizer: dict(Adam=fused_adam_class, HAVE_APEX_OR_TE=True,
                                USING_TE_OPTIMIZER=True, USING_APEX_OPTIMIZER=False),
    }
    saved = {module: {name: getattr(module, name) for name in names}
             for module, names in fused.items()}
    try:
        for module, values in fused.items():
            for name, value in values.items():
                setattr(module, name, value)
        yield
    finally:
        for module, values in saved.items():
            for name, value in values.items():
                setattr(module, name, value)


def _workaround_decisions():
    from mcore_ext._cpu_compat import cuda_to_cpu

    with cuda_to_cpu():  # megatron's optimizer allocates on 'cuda' literally
        return _workaround_decisions_on_this_rank()


def _workaround_decisions_on_this_rank():
    import mcore_ext
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mcore_ext import _mcore_compat, checkpoint

    mcore_ext.init_parallel(tensor_model_parallel_size=1)  # 2 ranks: DP 2 shards the optimizer
    config = builders.gated_config(num_query_groups=2, add_qkv_bias=True)

    def megatron_optimizer(distributed):
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
            builders.build_gpt(config))
        return get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed),
            [model])

    def single(optimizer):
        (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
        return inner

    out = {}
    # megatron's DistributedOptimizer over torch's Adam: the workarounds apply.
    torch_adam = megatron_optimizer(distributed=True)
    inner = single(torch_adam)
    out["torch_adam_type"] = type(inner.optimizer).__name__
    out["torch_adam_selected"] = _mcore_compat.torch_adam_distributed_optimizers(torch_adam) == [inner]
    _mcore_compat.prepare_optimizer_for_loading(torch_adam)
    out["torch_adam_prefilled"] = [sorted(state) for state in inner.optimizer.state.values()]

    # megatron's DistributedOptimizer over a fused Adam: left to megatron.
    with _megatron_with_fused_adam(FusedAdamStandIn):
        fused = megatron_optimizer(distributed=True)
        inner = single(fused)
        out["fused_types"] = type(inner).__name__, type(inner.optimizer).__name__
        out["fused_is_distributed"] = isinstance(inner, DistributedOptimizer)
        out["fused_selected"] = _mcore_compat.torch_adam_distributed_optimizers(fused)
        _mcore_compat.prepare_optimizer_for_loading(fused)
        out["fused_state_after_prepare"] = len(inner.optimizer.state)
        loaded = []
        fused.load_state_dict = loaded.append  # record what megatron's own load receives
        state_dict = {"optimizer": {"param_groups": []}, "param_state": {0: {}},
                      "param_state_sharding_type": "fully_reshardable"}
        checkpoint.load_optimizer_state_dict(fused, state_dict)
        out["fused_load_passed_through"] = len(loaded) == 1 and loaded[0] is state_dict
        out["fused_state_dict_untouched"] = sorted(state_dict) == [
            "optimizer", "param_state", "param_state_sharding_type"]

    # A non-distributed megatron optimizer over torch's Adam: not the distributed optimizer's bugs.
    out["plain_selected"] = _mcore_compat.torch_adam_distributed_optimizers(
        megatron_optimizer(distributed=False))
    return out


@pytest.mark.smoke
def test_optimizer_workarounds_apply_to_torch_adam_only(run_distributed):
    for out in run_distributed(_workaround_decisions, world_size=2):
        assert out["torch_adam_type"] in ("Adam", "AdamW") and out["torch_adam_selected"], out
        # Never-stepped torch Adam gets zero state before a load (bug a).
        assert out["torch_adam_prefilled"] and all(
            keys == ["exp_avg", "exp_avg_sq", "step"] for keys in out["torch_adam_prefilled"]), out
        assert out["fused_types"] == ("DistributedOptimizer", "FusedAdamStandIn"), out
        assert out["fused_is_distributed"] and out["fused_selected"] == [], out
        assert out["fused_state_after_prepare"] == 0, out
        assert out["fused_load_passed_through"] and out["fused_state_dict_untouched"], out
        assert out["plain_selected"] == [], out


@pytest.mark.smoke
def test_megatron_lm_entry_refuses_releases_before_0_19():
    """mcore_ext.megatron_lm's entry (its config, flags, pretrain_gpt) imports on 0.19; on 0.16 to
    0.18 it refuses, naming the release (mcore_ext.checkpoint.content, which the launcher uses,
    imports)."""
    from mcore_ext import _mcore_compat

    version = _mcore_compat.megatron_core_version()
    result = subprocess.run(
        [sys.executable, "-c", "import mcore_ext.checkpoint.content\n"
         "from mcore_ext.megatron_lm import GatedGPTModelConfig"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    if version.startswith("0.19."):
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        assert result.returncode != 0
        assert f"does not support megatron-core {version}" in result.stderr, result.stderr[-3000:]
