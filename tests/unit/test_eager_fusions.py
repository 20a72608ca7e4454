"""megatron-core's ``torch.compile`` decorations are eager without CUDA (mcore_ext._eager_fusions)."""

import subprocess
import sys

import pytest
import torch

from mcore_ext._eager_fusions import eager_fusions


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU imports megatron-core as it is")
def test_torch_compile_is_the_identity_inside_only():
    def double(x):
        return 2 * x

    original = torch.compile
    with eager_fusions():
        assert torch.compile(double) is double
        assert torch.compile(dynamic=True, fullgraph=True)(double) is double
    assert torch.compile is original


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU imports megatron-core as it is")
def test_importing_the_package_loads_no_compiler_and_megatron_fusions_are_eager():
    """Before: ``import mcore_ext`` loaded TorchDynamo and Inductor (megatron's ``jit_fuser``
    decorations), and the MoE router's expert-bias step was an Inductor build in each process."""
    code = (
        "import sys, torch, mcore_ext\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "from megatron.core.transformer.moe.router import TopKRouter\n"
        "assert torch.compile.__module__ == 'torch', torch.compile\n"
        "loaded = [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "y = torch.randn(3, 8)\n"
        "a, b = y.chunk(2, -1)\n"
        "assert torch.equal(fused_bias_swiglu.swiglu(y), torch.nn.functional.silu(a) * b)\n"
        "assert not hasattr(TopKRouter._apply_expert_bias, '_torchdynamo_orig_callable')\n"
        "assert not hasattr(jit.jit_fuser(lambda: 0), '_torchdynamo_orig_callable')\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"  # calling a fused function compiles nothing either
