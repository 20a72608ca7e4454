"""A Transformer Engine module's extra state is a pickle inside the checkpoint (issue 54.1).

TE's ``TransformerEngineBaseModule.get_extra_state`` stores its FP8 scaling state as a ``uint8``
tensor of ``pickle.dumps(state)`` (an ``io.BytesIO`` of ``torch.save`` in releases before 1.6), and
its ``set_extra_state`` decodes it with plain ``pickle.loads`` (``torch.load``), unrestricted: the
restricted reads of the checkpoint (safe_pickle) hand it back as a tensor, and the module would run
whatever it holds. ``TEStandIn`` decodes as TE does (2.x up to 2.17; 2.18+ with its opt-in
``NVTE_UNSAFE_PICKLE_EXTRA_STATE=1``), so these tests run without TE; the last one runs TE's own
module where a GPU has it.

- every model mcore_ext builds (GPTModel, HybridModel) decodes each extra state of a state dict
  restricted before any module sees it: a TE-shaped state loads into the stand-in unchanged, a
  payload is refused naming the key and the type and never runs (old code: the stand-in ran it);
- the decoder: a tensor's bytes, a BytesIO, a tensor's storage (a nested ``torch.save``) and bytes
  that are no pickle, each refused in one message naming the key.
The checkpoint paths (``inspect --verify``, the DCP read the launcher and megatron use) are in
tests/functional/test_checkpoint_safe_load.py.
"""

import io
import os
import pickle

import pytest
import torch

from tests import builders

LINEAR_PROJ = "decoder.layers.0.self_attention.linear_proj"


class TEStandIn(torch.nn.Module):
    """A module whose ``set_extra_state`` decodes as Transformer Engine's base module does: a
    tensor's bytes with ``pickle.loads`` (an empty tensor: no FP8 state), an ``io.BytesIO`` with
    ``torch.load`` (as TE does under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``). ``decoded``: what it
    decoded last."""

    def __init__(self):
        super().__init__()
        self.decoded = None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is None:
            return
        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            self.decoded = pickle.loads(state.detach().cpu().numpy().tobytes())
        elif isinstance(state, io.BytesIO):
            state.seek(0)
            self.decoded = torch.load(state, weights_only=False)
        else:
            raise RuntimeError("Unsupported checkpoint format.")


class Payload:
    """Unpickled, runs ``touch marker`` and returns None (what an attacker writes)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return eval, (f"__import__('os').system('touch {self.marker}') and None",)


def te_state() -> dict:
    """An FP8 extra state as TE's get_extra_state builds it (without a recipe: TE 1.x's)."""
    return {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.arange(12.0).view(4, 3),
            "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(4, 2),
            "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True,
                                    "dtype": torch.bfloat16}}


def as_extra_state(obj) -> torch.Tensor:
    """``obj`` stored as TE stores its extra state: a uint8 tensor of ``pickle.dumps``."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _load_into_models(marker):
    """Per model class: (what the stand-in decoded from a TE-shaped state, whether a payload
    was refused and how)."""
    import mcore_ext
    from mcore_ext.checkpoint.errors import PickleRefused

    mcore_ext.init_parallel()
    config = builders.gated_config()
    out = {}
    for name, build in (("gpt", mcore_ext.build_gpt_model),
                        ("hybrid", mcore_ext.build_hybrid_model)):
        model = build(config, vocab_size=64, max_sequence_length=16, backend="sdpa")
        proj = model.get_submodule(LINEAR_PROJ)
        stand_in = TEStandIn()
        proj.set_extra_state = stand_in.set_extra_state  # the module decodes as TE does
        state = model.state_dict()
        assert LINEAR_PROJ + "._extra_state" in state
        model.load_state_dict({**state, LINEAR_PROJ + "._extra_state": as_extra_state(te_state())})
        decoded = stand_in.decoded
        try:
            model.load_state_dict({**state, LINEAR_PROJ + "._extra_state":
                                   as_extra_state({"recipe": Payload(marker)})})
            refused = None
        except PickleRefused as err:
            refused = str(err)
        out[name] = (decoded, refused, os.path.exists(marker))
    return out


def test_every_model_decodes_a_te_extra_state_restricted_before_its_modules_see_it(
        run_distributed, tmp_path):
    """Old code: the stand-in ran the payload (the marker made), nothing refused."""
    (result,) = run_distributed(_load_into_models, str(tmp_path / "PWNED"), world_size=1)
    expected = te_state()
    for name, (decoded, refused, ran) in result.items():
        assert not ran, f"{name}: the payload ran"
        assert refused is not None and refused.startswith(
            "the state dict loaded into the model holds a pickled builtins.eval in "
            f"{LINEAR_PROJ}._extra_state (a Transformer Engine extra state"), (name, refused)
        assert decoded.keys() == expected.keys(), name  # a real state still loads
        assert torch.equal(decoded["amax_history_fwd"], expected["amax_history_fwd"])
        assert decoded["extra_fp8_variables"] == expected["extra_fp8_variables"]


def _refusal(value, key=LINEAR_PROJ + "._extra_state"):
    from mcore_ext.checkpoint import safe_pickle
    from mcore_ext.checkpoint.errors import PickleRefused

    with pytest.raises(PickleRefused) as raised:
        safe_pickle.decode_extra_state(value, "ckpt/iter_0000002/__0_0.distcp", key)
    return str(raised.value)


def test_decoder_refuses_each_form_of_payload_naming_the_key(tmp_path):
    from mcore_ext.checkpoint import safe_pickle

    marker = tmp_path / "PWNED"
    where = ("checkpoint file ckpt/iter_0000002/__0_0.distcp holds a pickled builtins.eval in "
             f"{LINEAR_PROJ}._extra_state")
    assert _refusal(as_extra_state([Payload(marker)])).startswith(where)
    buffer = io.BytesIO()  # older TE: a BytesIO of torch.save
    torch.save({"scale_fwd": Payload(marker)}, buffer)
    assert _refusal(buffer).startswith(where)

    class NestedStorage:  # a "tensor storage" whose torch.save holds the payload
        def __reduce__(self):
            return torch.storage._load_from_bytes, (buffer.getvalue(),)

    assert _refusal(as_extra_state({"scale_fwd": NestedStorage()})).startswith(where)
    # a float tensor: TE decodes any tensor's bytes
    data = bytearray(pickle.dumps(Payload(marker)))
    data += bytes(-len(data) % 4)
    assert _refusal(torch.frombuffer(data, dtype=torch.float32)).startswith(where)
    assert "is not one (UnpicklingError" in _refusal(torch.arange(5, dtype=torch.uint8))
    assert not marker.exists()
    # What a real state holds decodes; an empty tensor (no FP8) and None decode to nothing.
    decoded = safe_pickle.decode_extra_state(as_extra_state(te_state()), "f", "x._extra_state")
    assert torch.equal(decoded["scale_fwd"], torch.ones(3))
    assert safe_pickle.decode_extra_state(torch.empty(0, dtype=torch.uint8), "f", "k") is None
    assert safe_pickle.decode_extra_state(None, "f", "k") is None


def _te_skip_reason():
    import importlib.util

    if not torch.cuda.is_available():
        return "Transformer Engine's modules need a GPU (CUDA)"
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_te_skip_reason() is not None, reason=str(_te_skip_reason()))
def test_transformer_engine_module_loads_its_fp8_state_and_never_a_payload(tmp_path, monkeypatch):
    """TE's own Linear: the FP8 state it saves (recipe, scales, amax history) decodes through the
    restricted reader and loads back; a payload in its place is refused before TE's
    ``set_extra_state`` sees it, even with TE's own opt-in to unsafe loading set."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    from mcore_ext.checkpoint import safe_pickle
    from mcore_ext.checkpoint.errors import PickleRefused

    try:  # TE 2.8+ (quantization), earlier releases (fp8)
        from transformer_engine.pytorch.quantization import check_fp8_support
    except ImportError:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    supported, why = check_fp8_support()
    if not supported:
        pytest.skip(f"this GPU has no FP8: {why}")
    monkeypatch.setenv("NVTE_UNSAFE_PICKLE_EXTRA_STATE", "1")  # TE >= 2.18 refuses by itself
    model = torch.nn.Sequential(te.Linear(32, 32)).cuda()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        model(torch.randn(16, 32, device="cuda")).sum().backward()
    safe_pickle.guard_extra_states(model)
    state = model.state_dict()
    saved = state["0._extra_state"]
    assert saved.numel() > 0
    decoded = safe_pickle.decode_extra_state(saved, "f", "0._extra_state")
    assert isinstance(decoded["recipe"], recipe.DelayedScaling)
    model.load_state_dict(state)  # TE's own state: loads
    marker = tmp_path / "PWNED"
    with pytest.raises(PickleRefused, match=r"pickled builtins\.eval in 0\._extra_state"):
        model.load_state_dict({**state,
                               "0._extra_state": as_extra_state({"recipe": Payload(marker)})})
    assert not marker.exists()
