"""load_pretrained / save_pretrained against the Hugging Face model itself, on real gloo ranks.

The tiny random model (tests/hf/models.py) has both layer kinds with 4 and 8 query heads, a
window of 4 < 12 tokens, RoPE base 10000 / 500 and rotary fraction 0.5 / 1.0 per kind, a SwiGLU
clamp of 1.0 that its activations exceed, and random (non-zero) norm weights. Logits must match
transformers' in fp32 within 1e-5 (max abs) at every parallel layout, and a load / save round
trip must give back every tensor bit for bit.

A bf16 checkpoint loads as a bf16 model: its logits are compared with transformers' in fp32 on the
same bf16 weights, within bf16 rounding (u = 2^-8 per rounding, about 40 rounded stages adding
like a random walk: RMS difference <= 8 u x RMS, max <= 16 u x max|logits|), and against
transformers' own bf16 run of the same checkpoint: no more than 1.5 x its RMS difference. It
round-trips bit for bit in bf16.
"""

import json
import os
import shutil

import pytest
import torch

from tests import reference
from tests.hf import models

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(directory in the released layout, tokens, transformers' fp32 logits)."""
    pytest.importorskip("transformers")
    model = models.build()
    directory = models.save_released(model, str(tmp_path_factory.mktemp("hf") / "tiny"))
    tokens = models.tokens()
    with torch.no_grad():
        logits = model(tokens)
    return directory, tokens, logits


def _full_logits(model, tokens):
    """Logits [b, s, v] of the whole model on every rank of the last stage (None elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            s, b, h = tokens.size(1), tokens.size(0), model.config.hidden_size
            hidden = torch.empty(s, b, h)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _parity(hf_dir, tokens, tp, pp, kernel="sdpa", architecture="gpt"):
    import mcore_ext
    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    # hybrid: what `hf import` writes by default from megatron-core 0.19, built and filled alone
    model = load_pretrained(hf_dir, architecture=architecture, backend="sdpa",
                            attention_kernel=kernel).eval()
    logits = _full_logits(model, tokens)
    return None if logits is None else logits[..., : models.VOCAB]


def _check_parity(results, expected):
    got = [r for r in results if r is not None]
    assert got, "no rank returned logits"
    for logits in got:
        assert logits.shape == expected.shape
        diff = (logits - expected).abs().max().item()
        assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_logits_match_transformers_on_2_ranks(run_distributed, hf_model, tp, pp):
    directory, tokens, expected = hf_model
    _check_parity(run_distributed(_parity, directory, tokens, tp, pp, world_size=2), expected)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_hybrid_model_logits_match_transformers(run_distributed, hf_model, tp, pp):
    """The HybridModel ``hf import`` writes (``--architecture hybrid``, the default on
    megatron-core 0.19): the same bound against transformers as GPTModel's."""
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_hybrid_model():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no HybridModel")
    directory, tokens, expected = hf_model
    _check_parity(run_distributed(_parity, directory, tokens, tp, pp, "sdpa", "hybrid",
                                  world_size=2), expected)


def test_logits_match_transformers_with_the_flex_kernel(run_distributed, hf_model):
    directory, tokens, expected = hf_model
    _check_parity(run_distributed(_parity, directory, tokens, 2, 1, "flex", world_size=2),
                  expected)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(4, 1), (2, 2)])
def test_logits_match_transformers_on_4_ranks(run_distributed, hf_model, tp, pp):
    directory, tokens, expected = hf_model
    _check_parity(run_distributed(_parity, directory, tokens, tp, pp, world_size=4), expected)


# Fewer KV groups than TP ranks on both layer kinds (full: 4 query heads, sliding: 8, each kind
# with its own KV-head count): a rank's QKV rows cut through a query group.
FEW_GROUPS = [pytest.param(2, 1, 4, marks=pytest.mark.slow), (1, 1, 2)]  # full, sliding KV; TP


@pytest.mark.parametrize("kv, sliding_kv, tp", FEW_GROUPS)
def test_logits_match_transformers_with_fewer_kv_groups_than_tp(run_distributed, tmp_path,
                                                                 kv, sliding_kv, tp):
    pytest.importorskip("transformers")
    config = models.tiny_config(num_key_value_heads=kv, sliding_kv_heads=sliding_kv)
    model = models.build(config)
    directory = models.save_released(model, str(tmp_path / "hf"))
    tokens = models.tokens()
    with torch.no_grad():
        expected = model(tokens)
    _check_parity(run_distributed(_parity, directory, tokens, tp, 1, world_size=tp), expected)
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, tp, 1, world_size=tp)
    assert_same_tensors(directory, out)
    exported, info = models.load_released(out)  # transformers reads each kind's KV heads
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        assert torch.equal(exported(tokens), expected)


@pytest.fixture(scope="module")
def hf_model_bf16(tmp_path_factory):
    """(directory of a bf16 checkpoint, tokens, transformers' logits on its weights in fp32 and
    in bf16)."""
    pytest.importorskip("transformers")
    model = models.build().to(torch.bfloat16)
    directory = models.save_released(model, str(tmp_path_factory.mktemp("hf") / "tiny_bf16"))
    tokens = models.tokens()
    with torch.no_grad():
        in_bf16 = model(tokens).float()
        in_fp32 = model.float()(tokens)
    return directory, tokens, in_fp32, in_bf16


def test_bf16_checkpoint_loads_in_bf16_within_rounding_and_round_trips(run_distributed,
                                                                        hf_model_bf16, tmp_path):
    directory, tokens, expected, transformers_bf16 = hf_model_bf16
    u = reference.BF16_UNIT_ROUNDOFF
    rms = lambda t: t.square().mean().sqrt().item()
    results = run_distributed(_parity, directory, tokens, 2, 1, world_size=2)
    assert len(results) == 2
    for logits in results:
        assert logits.dtype == torch.bfloat16
        diff = logits.float() - expected
        assert diff.abs().max() <= 16 * u * expected.abs().max(), diff.abs().max()
        assert rms(diff) <= 8 * u * rms(expected), rms(diff)
        assert 0 < rms(diff) <= 1.5 * rms(transformers_bf16 - expected), rms(diff)
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, 2, 1, world_size=2)
    assert_same_tensors(directory, out)  # dtypes included
    assert json.loads(open(os.path.join(out, "config.json")).read())["torch_dtype"] == "bfloat16"


def _round_trip(hf_dir, out_dir, tp, pp):
    import mcore_ext
    from mcore_ext.hf import load_pretrained, save_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = load_pretrained(hf_dir, backend="sdpa")
    save_pretrained(model, out_dir, max_shard_bytes=30_000)


_tensors = models.read_tensors
assert_same_tensors = models.assert_same_tensors


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_load_save_round_trip_is_bit_identical(run_distributed, hf_model, tmp_path, tp, pp):
    directory, tokens, expected = hf_model
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, tp, pp, world_size=2)
    assert_same_tensors(directory, out)
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1  # sharded by size
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["architectures"] == ["Step3p5ForCausalLM"] and config["eos_token_id"] == 256

    model, info = models.load_released(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.equal(model(tokens), expected)


DOCS = (7, 5)  # two documents packed into one row of 12 tokens (both longer than the window)


def _packed_parity(hf_dir, tokens, tp):
    import mcore_ext
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    cu = torch.tensor([0, DOCS[0], sum(DOCS)], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(DOCS), max_seqlen_kv=max(DOCS))
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        out = model(tokens, positions, None, packed_seq_params=params)
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : models.VOCAB]


def test_packed_thd_batch_matches_transformers_per_document(run_distributed, hf_model):
    directory, _, _ = hf_model
    model, _ = models.load_released(directory)
    packed = models.tokens(batch=1, seq=sum(DOCS), seed=11)
    with torch.no_grad():  # the reference: each document on its own
        expected = torch.cat([model(doc) for doc in packed.split(DOCS, dim=1)], dim=1)
    _check_parity(run_distributed(_packed_parity, directory, packed, 2, world_size=2), expected)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tied_embeddings_export_as_an_lm_head_copy(run_distributed, hf_model, tmp_path, tp, pp):
    from safetensors.torch import load_file, save_file

    directory, _, _ = hf_model
    tied = str(tmp_path / "tied")
    shutil.copytree(directory, tied)
    config = json.load(open(os.path.join(tied, "config.json")))
    config["tie_word_embeddings"] = True
    json.dump(config, open(os.path.join(tied, "config.json"), "w"))
    index_path = os.path.join(tied, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(tied, index["weight_map"].pop("lm_head.weight"))
    save_file({k: v for k, v in load_file(shard).items() if k != "lm_head.weight"}, shard)
    json.dump(index, open(index_path, "w"))

    out = str(tmp_path / "out")
    run_distributed(_round_trip, tied, out, tp, pp, world_size=2)
    source, exported = _tensors(tied), _tensors(out)
    assert torch.equal(exported.pop("lm_head.weight"), source["model.embed_tokens.weight"])
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[k], source[k]) for k in source)
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is False
