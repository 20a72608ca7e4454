"""Step-3.5 MoE + MTP checkpoints (tests/hf/models.py: tiny_moe_config) against transformers 5.23
and the plain-PyTorch MTP reference, on real gloo ranks.

The tiny model: 4 layers (dense full, MoE sliding, MoE sliding, MoE full), 8 experts, top-3, a
random router bias that changes the chosen experts, routed scaling 2.5, the routed clamp hit on
layers 1 and 3, the shared expert's on layer 2 and the dense MLP's on layer 0 (each checked to
change transformers' logits), one MTP layer (dense, sliding, its own clamp, head and norm).

- Main logits equal transformers' ``Step3p7TextModel`` + lm_head within 1e-5 (fp32, max abs) at
  TP 1 / 2, EP 2 / 4, TP 2 x EP 2 and PP 2. transformers scales the routed sum by 2.5 after
  adding the experts up and renormalises without megatron's + 1e-20: both are fp32 rounding
  differences (1e-20 vanishes next to a sum of sigmoids >= top-k * sigmoid(min logit)).
- MTP logits (``mcore_ext.models.mtp_logits``) equal ``tests.reference.step35_mtp_logits`` on the
  checkpoint's tensors within 1e-5 at TP 1 and 2 (transformers has no MTP forward); in bf16 at
  TP 2 within the bf16 bounds below.
- HF -> megatron -> HF gives back every tensor bit for bit with its dtype (fp32 router bias in a
  bf16 checkpoint included), from TP 2 x EP 2 and PP 2.
- A bf16 checkpoint loads as a bf16 model (router in fp32) at EP 2 and TP 2 x EP 2. Reference:
  transformers in fp32 on the same bf16 weights. Bounds from bf16 rounding as for the dense model
  (test_hf_parity: u = 2^-8, about 40 rounded stages adding like a random walk): RMS difference
  <= 8 u x RMS, max <= 16 u x max|logits|, and no more than 1.5 x the RMS difference of
  transformers' own bf16 run, over the tokens whose routing bf16 rounding cannot change: routing
  is discontinuous, and a token whose k-th and (k+1)-th expert scores are nearly tied in fp32 may
  pick another expert in any bf16 run (transformers' own bf16 run does, on one token of this
  batch: logits off by 2.5). Such a token is one whose gap in (sigmoid + bias) is below
  u x max|router logit| / 4 at some MoE layer (the sigmoid's slope is at most 1/4, and a logit
  computed from bf16-rounded activations moves by about u x its size); at most 2 of the 24
  tokens may be set aside, and the others must meet the bounds.
"""

import json
import os

import pytest
import torch

from mcore_ext import _mcore_compat
from tests import reference
from tests.hf import models
from tests.hf.test_hf_parity import _full_logits, _tensors

pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """(directory, tensors, tokens, transformers' logits) of the fp32 tiny MoE + MTP model."""
    model = models.build_moe()
    directory, tensors = models.save_moe(model, str(tmp_path_factory.mktemp("hf") / "moe"))
    tokens = models.tokens()
    with torch.no_grad():
        logits = model(tokens)
    return directory, tensors, tokens, logits


def test_the_tiny_model_exercises_bias_and_every_clamp(moe_checkpoint):
    """Each feature the parity tests rely on changes transformers' logits."""
    _, _, tokens, expected = moe_checkpoint
    model = models.build_moe()
    changed = {}
    with torch.no_grad():
        for what, module, attr in (
                ("router bias", model.model.layers[1].mlp.gate, "e_score_correction_bias"),
                ("routed clamp 1", model.model.layers[1].mlp.experts, "limit"),
                ("routed clamp 3", model.model.layers[3].mlp.experts, "limit"),
                ("shared clamp 2", model.model.layers[2].mlp.shared_experts, "limit"),
                ("dense clamp 0", model.model.layers[0].mlp, "limit")):
            saved = getattr(module, attr)
            if attr == "limit":
                setattr(module, attr, float("inf"))
            else:
                saved = saved.clone()
                module.e_score_correction_bias.zero_()
            changed[what] = (model(tokens) - expected).abs().max().item()
            if attr == "limit":
                setattr(module, attr, saved)
            else:
                module.e_score_correction_bias.copy_(saved)
    assert all(diff > 1e-3 for diff in changed.values()), changed


def _moe_parity(hf_dir, tokens, tp, pp, ep, etp=None):
    import mcore_ext
    from mcore_ext.hf import load_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    logits = _full_logits(model, tokens)
    return None if logits is None else logits[..., : models.VOCAB]


def _check(results, expected, tol=TOL):
    got = [r for r in results if r is not None]
    assert got, "no rank returned logits"
    for logits in got:
        assert logits.shape == expected.shape
        diff = (logits.float() - expected).abs().max().item()
        assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


@pytest.mark.parametrize("tp, pp, ep, world", [
    (1, 1, 1, 1), (2, 1, 1, 2), (1, 1, 2, 2), (1, 2, 1, 2), (2, 1, 2, 4), (1, 1, 4, 4)])
def test_moe_logits_match_transformers(run_distributed, moe_checkpoint, tp, pp, ep, world):
    directory, _, tokens, expected = moe_checkpoint
    _check(run_distributed(_moe_parity, directory, tokens, tp, pp, ep, world_size=world),
           expected)


@pytest.fixture(scope="module")
def moe_checkpoint_bf16(tmp_path_factory):
    """(directory of the bf16 tiny MoE + MTP checkpoint, tokens, transformers' logits on its
    weights in fp32 and in bf16)."""
    model = models.build_moe(dtype=torch.bfloat16)
    directory, tensors = models.save_moe(model, str(tmp_path_factory.mktemp("hf") / "moe_bf16"))
    tokens = models.tokens()
    with torch.no_grad():
        in_bf16 = model(tokens).float()
        model.float()
        gaps, logit_sizes = [], []

        def record_gap(router, args, _):
            logits = torch.nn.functional.linear(args[0].reshape(-1, router.hidden_dim),
                                                router.weight)
            scores = logits.sigmoid() + router.e_score_correction_bias
            top = scores.topk(router.top_k + 1, dim=-1).values
            gaps.append(top[:, -2] - top[:, -1])
            logit_sizes.append(logits.abs().max())

        hooks = [layer.mlp.gate.register_forward_hook(record_gap)
                 for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        in_fp32 = model(tokens)
        for hook in hooks:
            hook.remove()
    threshold = reference.BF16_UNIT_ROUNDOFF * max(logit_sizes) / 4
    near_tie = (torch.stack(gaps).amin(0) < threshold).view(tokens.shape)
    return directory, tokens, in_fp32, in_bf16, near_tie, tensors


@pytest.mark.parametrize("tp, ep, world", [(1, 2, 2), (2, 2, 4)])
def test_bf16_moe_checkpoint_loads_in_bf16_within_rounding(run_distributed, moe_checkpoint_bf16,
                                                           tp, ep, world):
    directory, tokens, expected, transformers_bf16, near_tie, _ = moe_checkpoint_bf16
    assert int(near_tie.sum()) <= 2, near_tie
    u = reference.BF16_UNIT_ROUNDOFF
    rms = lambda t: t.square().mean().sqrt().item()
    results = [r for r in run_distributed(_moe_parity, directory, tokens, tp, 1, ep,
                                          world_size=world) if r is not None]
    assert len(results) == world
    kept = ~near_tie
    expected, transformers_bf16 = expected[kept], transformers_bf16[kept]
    for logits in results:
        assert logits.dtype == torch.bfloat16
        diff = logits.float()[kept] - expected
        assert diff.abs().max() <= 16 * u * expected.abs().max(), diff.abs().max()
        assert rms(diff) <= 8 * u * rms(expected), rms(diff)
        assert 0 < rms(diff) <= 1.5 * rms(transformers_bf16 - expected), (
            rms(diff), rms(transformers_bf16 - expected))


def test_bf16_moe_round_trip_keeps_dtypes_bit_for_bit(run_distributed, moe_checkpoint_bf16,
                                                      tmp_path):
    directory = moe_checkpoint_bf16[0]
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, 1, 1, 2, world_size=2)
    a, b = _tensors(directory), _tensors(out)
    assert a.keys() == b.keys()
    assert a["model.layers.1.moe.router_bias"].dtype == torch.float32
    assert a["model.layers.1.moe.gate_proj.weight"].dtype == torch.bfloat16
    different = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not different, different[:5]


def _mtp_parity(hf_dir, tokens, tp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mcore_ext
    from mcore_ext.hf import load_pretrained
    from mcore_ext.models import mtp_logits

    mcore_ext.init_parallel(tensor_model_parallel_size=tp)
    model = load_pretrained(hf_dir, backend="sdpa").eval()
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    out = []
    with torch.no_grad():
        for local in mtp_logits(model, tokens, positions):
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            out.append(torch.cat(parts, dim=-1)[..., : models.VOCAB])
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_mtp_logits_match_the_reference(run_distributed, moe_checkpoint, tp):
    directory, tensors, tokens, expected = moe_checkpoint
    config = models.tiny_moe_config()
    main_kinds, mtp_kinds = models.reference_kinds(config)
    weights = models.reference_weights(tensors, config.num_hidden_layers)
    with torch.no_grad():
        main = reference.step35_logits(tokens, weights, main_kinds, config.rms_norm_eps)
        want = reference.step35_mtp_logits(tokens, weights, main_kinds, mtp_kinds,
                                           config.rms_norm_eps)
    assert (main - expected).abs().max() <= TOL  # the reference is transformers' model
    results = run_distributed(_mtp_parity, directory, tokens, tp, world_size=max(tp, 1))
    s = tokens.size(1)
    for per_rank in results:
        assert len(per_rank) == 1
        valid = s - 1  # depth 0 has real input tokens at t < s - 1
        diff = (per_rank[0][:, :valid] - want[0][:, :valid]).abs().max().item()
        assert diff <= TOL, diff


def test_bf16_mtp_logits_within_rounding_of_the_reference(run_distributed, moe_checkpoint_bf16):
    """The bf16 model's MTP logits at TP 2 against the plain-PyTorch reference in fp32 on the
    same bf16 weights, with the main logits' bf16 bounds on the tokens whose routing bf16 cannot
    flip (the MTP input at t is the main model's hidden state at t)."""
    directory, tokens, _, _, near_tie, tensors = moe_checkpoint_bf16
    config = models.tiny_moe_config()
    main_kinds, mtp_kinds = models.reference_kinds(config)
    weights = models.reference_weights(tensors, config.num_hidden_layers)  # fp32 copies
    with torch.no_grad():
        (want,) = reference.step35_mtp_logits(tokens, weights, main_kinds, mtp_kinds,
                                              config.rms_norm_eps)
    u = reference.BF16_UNIT_ROUNDOFF
    rms = lambda t: t.square().mean().sqrt().item()
    kept = ~near_tie
    kept[:, -1] = False  # depth 0 has a real input token at t < s - 1 only
    want = want[kept]
    for (logits,) in run_distributed(_mtp_parity, directory, tokens, 2, world_size=2):
        assert logits.dtype == torch.bfloat16
        diff = logits.float()[kept] - want
        assert diff.abs().max() <= 16 * u * want.abs().max(), diff.abs().max()
        assert 0 < rms(diff) <= 8 * u * rms(want), rms(diff)


def _round_trip(hf_dir, out_dir, tp, pp, ep):
    import mcore_ext
    from mcore_ext.hf import load_pretrained, save_pretrained

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep)
    model = load_pretrained(hf_dir, backend="sdpa")
    save_pretrained(model, out_dir, max_shard_bytes=40_000)


@pytest.mark.parametrize("tp, pp, ep, world", [(1, 1, 1, 1), (2, 1, 2, 4), (1, 2, 1, 2)])
def test_round_trip_is_bit_identical(run_distributed, moe_checkpoint, tmp_path, tp, pp, ep,
                                     world):
    directory, _, _, _ = moe_checkpoint
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, tp, pp, ep, world_size=world)
    a, b = _tensors(directory), _tensors(out)
    assert a.keys() == b.keys()
    different = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not different, different[:5]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["moe_layers_enum"] == "1,2,3" and config["num_nextn_predict_layers"] == 1
    assert config["swiglu_limits"] == models.ROUTED_LIMITS + [0.0]
    assert config["swiglu_limits_shared"] == models.SHARED_LIMITS + [models.MTP_LIMIT]


def test_transformers_names_import_and_export_in_the_released_layout(run_distributed, tmp_path):
    """A checkpoint under transformers' names (mlp.experts.gate_up_proj, mlp.gate.*,
    mlp.shared_experts.*) loads to the same logits and exports the released layout."""
    model = models.build_moe()
    directory, _ = models.save_moe(model, str(tmp_path / "hf"), released=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in _tensors(directory)
    tokens = models.tokens()
    with torch.no_grad():
        expected = model(tokens)
    _check(run_distributed(_moe_parity, directory, tokens, 2, 1, 1, world_size=2), expected)
    out = str(tmp_path / "out")
    run_distributed(_round_trip, directory, out, 1, 1, 2, world_size=2)
    released = models.released_tensors(model)
    released.update(models.mtp_tensors(model.config))
    exported = _tensors(out)
    assert exported.keys() == released.keys()
    assert all(torch.equal(exported[n], released[n]) and exported[n].dtype == released[n].dtype
               for n in released)


@pytest.mark.parametrize("architecture", ["gpt", "hybrid"])
def test_cli_imports_and_exports_moe_and_mtp_bit_exact(moe_checkpoint, tmp_path, architecture):
    """``python -m mcore_ext.hf import`` writes a launcher checkpoint of the MoE + MTP model (the
    launcher's MoE / MTP keys in its config.yaml) and ``export`` gives back every tensor bit for
    bit, fp32 router bias included; with ``--architecture hybrid`` the checkpoint is
    HybridModel's, its MTP layer the pattern's '/*-' depth (mtp_model_layer.layers.0 / .1)."""
    import subprocess
    import sys

    import yaml

    from tests.functional.test_pretrain import ROOT

    directory = moe_checkpoint[0]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    for argv in (["import", directory, str(ckpt), "--architecture", architecture],
                 ["export", str(ckpt), str(out)]):
        result = subprocess.run([sys.executable, "-m", "mcore_ext.hf", *argv], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        # Each command prints its result line alone: no third-party notice on stderr (torch's
        # ShardedTensor deprecation was one, from the experts' sharded state), and on stdout
        # only GPTModel's deprecation said once (megatron-core 0.19+) for --architecture gpt.
        assert result.stderr.strip() == "", result.stderr[-2000:]
        printed = [line for line in result.stdout.splitlines() if line.strip()]
        assert printed[0].startswith(f"[hf] {argv[0]}: wrote"), printed
        notices = printed[1:]
        assert notices == ([f"[hf] import --architecture gpt: GPTModel is deprecated"
                            f" in megatron-core {_mcore_compat.megatron_core_version()}"
                            " (critical fixes only); --architecture hybrid writes a HybridModel"
                            " checkpoint (model.architecture: hybrid)"]
                           if argv[0] == "import" and architecture == "gpt"
                           and _mcore_compat.has_hybrid_model() else []), printed
    model = yaml.safe_load(open(ckpt / "iter_0000000" / "config.yaml"))["model"]
    assert model["num_moe_experts"] == models.EXPERTS and model["mtp_num_layers"] == 1
    assert model["architecture"] == architecture
    if architecture == "hybrid":
        from megatron.core import dist_checkpointing

        keys = dist_checkpointing.load_tensors_metadata(str(ckpt / "iter_0000000"))
        assert "mtp.layers.0.mtp_model_layer.layers.1.mlp.linear_fc2.weight" in keys
    models.assert_same_tensors(directory, str(out))


@pytest.mark.slow
def test_imported_moe_fine_tunes_at_ep2_with_mtp_and_exports(moe_checkpoint, tmp_path):
    """The user path: ``hf import`` of the MoE + MTP checkpoint, the launcher fine-tunes it at
    EP 2 on 2 ranks (main and MTP losses logged), ``hf export`` writes the released layout that
    transformers reads; the trained tensors changed, the fp32 router bias stayed fp32 (and, with
    the imported config's bias update rate 0, unchanged: routing as converted)."""
    from tests.hf.test_hf_checkpoint import import_train_export

    directory = moe_checkpoint[0]
    result, metrics, out = import_train_export(directory, tmp_path, 6,
                                               "optimizer.lr_warmup_iters=1",
                                               "parallelism.expert_model_parallel_size=2")
    assert "(experts: EP 2)" in result.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == list(range(1, 7))
    assert all(len(r["mtp_losses"]) == 1 and torch.isfinite(torch.tensor(r["loss"]))
               for r in train), train

    before, after = _tensors(directory), _tensors(out)
    assert before.keys() == after.keys()
    assert all(before[n].dtype == after[n].dtype for n in before)
    bias = [n for n in before if n.endswith("moe.router_bias")]
    assert bias and all(torch.equal(before[n], after[n]) for n in bias)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    mtp_prefix = f"model.layers.{len(models.MOE_TYPES)}."
    assert any(n.startswith(mtp_prefix) for n in changed)  # the MTP layer was trained too
    assert all(n in changed for n in before if n.endswith(("q_proj.weight", "g_proj.weight",
                                                           "moe.gate.weight")))
    # transformers reads the released MoE names only through the Step-3.7 VL wrapper's
    # conversion mapping, so the main layers are renamed by released_tensors' inverse here.
    model = models.build_moe()
    model.load_state_dict(models.transformers_tensors(after, len(models.MOE_TYPES)), strict=True)
    with torch.no_grad():
        assert torch.isfinite(model(models.tokens())).all()


@pytest.mark.slow
def test_readme_fine_tune_command_trains_the_moe_import_at_tp2(moe_checkpoint, tmp_path):
    """README's "Convert Step-3.5-Flash" fine-tuning command on the released MoE + MTP layout
    after ``hf import``: the launcher at TP 2 with the README's overrides
    (parallelism.sequence_parallel=true, which megatron's MoE layer needs at TP > 1 and the
    launcher asks for in one line before any rank starts; mock data for data.prefix). Before,
    that command was megatron's ValueError from the MoE layer's first forward on every rank.
    (``hf export`` of the MoE import: test_cli_imports_and_exports_moe_and_mtp_bit_exact.)"""
    from tests.functional.test_pretrain import check, torchrun
    from tests.hf.test_hf_checkpoint import _cli

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    check(_cli("import", moe_checkpoint[0], str(ckpt), "--seq-length", "16", timeout=600),
          "import")
    result = check(torchrun(
        "--config", str(ckpt / "iter_0000000" / "config.yaml"),
        "parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
        "data.source=mock", f"checkpoint.save={tmp_path / 'ft'}",
        "training.micro_batch_size=2", "training.global_batch_size=2", "training.train_iters=2",
        "training.eval_interval=null", "optimizer.lr_warmup_iters=1",
        f"logging.metrics_file={metrics}", "logging.log_interval=1"), "launcher")
    assert "TP 2 x PP 1 x DP 1" in result.stdout, result.stdout[-2000:]
    assert "finetune: loaded the model weights" in result.stdout
    train = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), train
