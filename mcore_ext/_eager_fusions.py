"""megatron-core's fused functions run eagerly on a machine without CUDA.

megatron-core decorates its fused activations, norms and MoE router steps with ``torch.compile``
(``megatron.core.jit.jit_fuser``, and ``@torch.compile`` itself) when it is imported. On a CPU
that costs every process the import of TorchDynamo and Inductor (about 3 s of CPU), and each
decorated function a run calls (the MoE router's expert-bias step, for one) an Inductor C++ build
in that process; the tiny CPU models of tests and tools never win that back. ``eager_fusions()``
makes ``torch.compile`` the identity while megatron-core is imported on a machine without CUDA,
so those functions are megatron's plain PyTorch (the formula the compiled kernel computes, in the
same precision). megatron.training's own ``--disable-jit-fuser`` cannot do this: it runs after the
import has decorated them. A GPU run imports megatron-core as it is, and outside the context
``torch.compile`` is torch's own.
"""

import contextlib

import torch


def _eager(model=None, **kwargs):
    """``torch.compile``'s signature, compiling nothing: ``fn`` and ``@torch.compile(...)`` alike."""
    if model is None:
        return lambda fn: fn
    return model


@contextlib.contextmanager
def eager_fusions():
    """Within, on a machine without CUDA: ``torch.compile(fn)`` is ``fn``."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.compile
    torch.compile = _eager
    try:
        yield
    finally:
        torch.compile = original
