"""``torch.compile`` deferred to a function's first call while megatron-core is imported.

megatron-core decorates its fused activations with ``jit_fuser``, which is ``torch.compile`` on
torch >= 2.2, at import time. Each such decoration imports TorchDynamo and Inductor (about 3 s of
CPU per process), although most runs never call those functions (no GPU, or a model without
them). ``deferred_torch_compile()`` makes megatron's ``jit_fuser`` a decorator that calls the real
``torch.compile`` on first use, with the same arguments: a run that calls a fused function gets
the same compiled function, one that does not never pays for the compiler. Outside the context
``torch.compile`` is torch's own. Only without CUDA (tests, CPU runs, tools): a GPU run imports
megatron-core as it is.
"""

import contextlib
import functools

import torch


def _compile_on_first_call(compile_fn):
    def deferred(model=None, **kwargs):
        if model is None:  # used as @torch.compile(**kwargs)
            return lambda fn: deferred(fn, **kwargs)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return compile_fn(model, **kwargs)  # modules are compiled as torch does it
        compiled = None

        @functools.wraps(model)
        def call(*args, **call_kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **call_kwargs)

        return call

    return deferred


@contextlib.contextmanager
def deferred_torch_compile():
    """Within, on a machine without CUDA: ``torch.compile(fn)`` returns ``fn`` compiled on its
    first call."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.compile
    torch.compile = _compile_on_first_call(original)
    try:
        yield
    finally:
        torch.compile = original
