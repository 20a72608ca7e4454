"""``torch.compile`` deferred while megatron-core is imported (mcore_ext._lazy_compile)."""

import subprocess
import sys

import torch

from mcore_ext._lazy_compile import _compile_on_first_call, deferred_torch_compile


def test_compiles_once_on_the_first_call_with_the_decoration_arguments():
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((getattr(fn, "__name__", type(fn).__name__), kwargs))
        return lambda *args, **call_kwargs: ("compiled", fn(*args, **call_kwargs))

    compile_ = _compile_on_first_call(fake_compile)

    @compile_
    def double(x):
        return 2 * x

    @compile_(dynamic=True)
    def square(x, power=2):
        return x ** power

    assert calls == [] and double.__name__ == "double"  # decorating compiles nothing
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert square(3, power=3) == ("compiled", 27)
    assert calls == [("double", {}), ("square", {"dynamic": True})]  # once each, same arguments
    compile_(torch.nn.Linear(2, 2))  # a module is compiled as torch does it, at once
    assert calls[2:] == [("Linear", {})]


def test_torch_compile_is_torchs_own_outside_the_context():
    original = torch.compile
    with deferred_torch_compile():
        assert torch.compile is not original
    assert torch.compile is original


def test_importing_the_package_imports_no_compiler():
    """megatron-core decorates its fused functions with torch.compile at import; Inductor (and,
    with it, TorchDynamo) costs about 3 s of CPU per process. None of it is loaded by importing
    mcore_ext: megatron's decorated functions wait for their first call to compile."""
    code = (
        "import sys, torch, mcore_ext\n"
        "from megatron.core.fusions import fused_bias_swiglu\n"
        "assert torch.compile.__module__ == 'torch', torch.compile\n"
        "loaded = [m for m in ('torch._dynamo', 'torch._inductor.compile_fx') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print(fused_bias_swiglu.swiglu.__wrapped__.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "swiglu", result.stderr[-3000:]
