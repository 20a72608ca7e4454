"""The activation memory plan (``mcore_ext.plan.activations``) against measured peaks on a CPU.

Tiny bf16 Step-3.5-style models (head-wise gate, q / k norms, zero-centered RMSNorm, SwiGLU;
full, sliding and MoE layers) run forward + backward with the loss on real gloo ranks. The
measure is torch's own CPU allocations (``mcore_ext.plan.measure.allocation_peak``: the running
sum of the allocator's allocation and free events under the profiler, exact): the peak of one
step after a first one has allocated the weight gradients (later steps accumulate into them, as
megatron does into its gradient buffers), the least of three. The plan must be within 15 % of it.
"""

import pytest
import torch

TOLERANCE = 0.15
SEQ, BATCH, VOCAB, HIDDEN = 512, 2, 1024, 256

KINDS = {
    "dense": {},
    "sliding": dict(layer_types=["sliding_attention"] * 2, sliding_window=64),
    "moe": dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                moe_shared_expert_intermediate_size=128, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=3.0,
                moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall"),
}
# Step-3.5's layout in miniature: a full and a sliding MoE layer, one MTP depth (dense, sliding,
# its own output head).
KINDS["step35"] = dict(KINDS["moe"], layer_types=["full_attention"] + ["sliding_attention"] * 2,
                       sliding_window=64, mtp_num_layers=1, mtp_step35_heads=True)


DOCUMENTS = [200, 150, 100, 62]  # a packed row's documents (SEQ tokens): some under the window


def _measure_and_plan(kind, recompute, cp=1, tp=1, packed=False, lora=None):
    import mcore_ext
    from mcore_ext.attention import context_parallel
    from mcore_ext.plan import activations
    from mcore_ext.plan.measure import allocation_peak
    from mcore_ext.plan.shape import ModelShape

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, seed=7)
    fields = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        kv_channels=64, ffn_hidden_size=512, head_wise_attn_gate=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", qk_layernorm=True,
        layernorm_zero_centered_gamma=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        bf16=True, tensor_model_parallel_size=tp, context_parallel_size=cp,
        sequence_parallel=tp > 1, **KINDS[kind])
    if recompute != "none":
        fields["recompute_granularity"] = recompute
    if recompute == "full":
        fields.update(recompute_method="uniform", recompute_num_layers=1)
    config = mcore_ext.GatedTransformerConfig(**fields)
    model = mcore_ext.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      backend="sdpa")
    if lora is not None:  # as the launcher: adapters before the cast, the base frozen
        from mcore_ext.lora import apply_lora

        apply_lora(model, lora)
    model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    batch = dict(tokens=torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                 labels=torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                 position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    if cp > 1:
        batch = context_parallel.get_batch_on_this_cp_rank(batch)
    params = None
    if packed:  # the BATCH rows as one THD sequence of documents, positions restarting
        from mcore_ext.training.data import packed_seq_params

        lengths = torch.tensor(DOCUMENTS * BATCH)
        batch = {key: value.reshape(1, -1) for key, value in batch.items()}
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
        batch["cu_seqlens"] = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        batch["max_seqlen"] = max(DOCUMENTS)
        params = packed_seq_params(batch, "cpu")

    def step():
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=params)
        losses.float().sum().backward()

    step()  # allocates the weight gradients
    # The least of three steps: gloo's collectives (the MoE dispatcher's at TP 2) allocate on
    # their own timing, which moves a single step's peak by up to ~10 %.
    measured = min(allocation_peak(step, "cpu")["peak"] for _ in range(3))
    shape = ModelShape.from_transformer_config(config, vocab_size=VOCAB)
    if lora is not None:
        from mcore_ext.plan.params import with_lora

        shape = with_lora(shape, lora)
    work = activations.Workload(seq=SEQ, micro_batch=BATCH, recompute=recompute,
                                sliding_kernel=activations.installed_sliding_kernel(),
                                cpu=True, packed=packed,
                                documents=tuple(DOCUMENTS) if packed else None)
    (stage,) = activations.stage_activations(shape, activations.Layout(tp=tp, cp=cp), work)
    mcore_ext.destroy_parallel()
    return measured, stage.peak


def _check(results):
    for rank, (measured, planned) in enumerate(results):
        assert abs(planned / measured - 1) <= TOLERANCE, (
            f"rank {rank}: plan {planned / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB "
            f"(ratio {planned / measured:.3f})")


def _recompute_cases(kinds, recomputes, default):
    """(kind, recompute) cases; those not in ``default`` are the slow suite's (-m slow)."""
    return [pytest.param(kind, recompute, marks=() if (kind, recompute) in default
                         else pytest.mark.slow)
            for kind in kinds for recompute in recomputes]


# The default run: the dense model and Step-3.5's miniature (full and sliding MoE layers, MTP)
# without recompute and with full recompute; the sliding and MoE kinds alone are measured at CP 2
# below. The rest is the slow suite's.
@pytest.mark.parametrize("kind, recompute", _recompute_cases(
    sorted(KINDS), ["none", "selective", "full"],
    default={("dense", "none"), ("step35", "none"), ("step35", "full")}))
def test_plan_matches_the_measured_peak(run_distributed, kind, recompute):
    _check(run_distributed(_measure_and_plan, kind, recompute, world_size=1))


@pytest.mark.parametrize("kind, recompute", _recompute_cases(
    ["dense", "sliding", "moe"], ["none", "full"],
    default={("dense", "none"), ("sliding", "none"), ("moe", "none"), ("sliding", "full")}))
def test_plan_matches_the_measured_peak_at_cp2(run_distributed, kind, recompute):
    _check(run_distributed(_measure_and_plan, kind, recompute, 2, world_size=2))


@pytest.fixture
def fresh_workers(_worker_pools):
    """The 2-rank workers start afresh, as a training process does. In the whole suite (CI-
    equivalent of 2026-11-26) the MoE case measured 27.79 MiB on rank 1 against 23.47 planned
    (0.845, over the 15 % tolerance) in workers earlier tests had used, and passes alone; what
    the earlier tests leave that the step allocates is not found yet (docs/known-gaps.md)."""
    pool = _worker_pools.pop(2, None)
    if pool is not None:
        pool.close()


# dense is slow: the MoE model's attention and dense layers are the dense model's (CI time).
@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.slow), "moe"])
def test_plan_matches_the_measured_peak_at_tp2_with_sequence_parallelism(
        fresh_workers, run_distributed, kind):
    _check(run_distributed(_measure_and_plan, kind, "none", 1, 2, world_size=2))


@pytest.mark.parametrize("kind", ["dense", "step35"])
def test_plan_of_packed_documents_matches_the_measured_peak(run_distributed, kind):
    """A THD micro-batch of packed documents (two rows of 200 + 150 + 100 + 62 tokens, positions
    restarting, per-document attention on the sdpa kernel): within 15 % of the measured peak
    with the CPU kernel's per-document scores counted (without them dense measured 0.83 and
    Step-3.5's miniature 0.866; with them 0.976 and 0.926)."""
    _check(run_distributed(_measure_and_plan, kind, "none", 1, 1, True, world_size=1))


EVERY_TARGET = ("all-linear", "experts.gate_up_proj", "experts.down_proj")


@pytest.mark.parametrize("kind, targets, tp", [
    ("dense", "o_proj", 1), ("moe", "o_proj", 1), ("dense", "all-linear", 2),
    pytest.param("step35", EVERY_TARGET, 1, marks=pytest.mark.slow),
    pytest.param("dense", "all-linear", 1, marks=pytest.mark.slow)])
def test_plan_of_a_lora_run_matches_the_measured_peak(run_distributed, kind, targets, tp):
    """A LoRA run (r 16, the base frozen, bf16): frozen linears save no input, frozen norms no
    normalized value, the embedding's output no gradient (layer 0's input norm saves nothing);
    the adapters save their r-wide ``A x`` and each column-parallel target's update (kept by
    index_add). Measured / planned: dense o_proj 0.987, MoE o_proj 0.942, dense all-linear at
    TP 2 + SP 0.984 / 0.985 (TP 1: 0.986). The plan without the LoRA terms (the full
    fine-tuning one) read 1.219, 1.171, and for all-linear at TP 1 1.052. Step-3.5's miniature
    with every target (shared and routed experts, the MTP layer): 0.962; without the experts'
    and MTP terms (each routed copy's input and fc2 input and A x, the shared expert's input,
    fc2 input and updates, frozen MTP norms and eh_proj) 0.930 (in the slow suite: 27 CPU s,
    and the default run keeps these adapters' exact parameter count in the test below)."""
    from mcore_ext.lora import LoraConfig

    lora = LoraConfig(rank=16, targets=targets)
    _check(run_distributed(_measure_and_plan, kind, "none", 1, tp, False, lora,
                           world_size=tp))


def test_packed_rows_plan_as_one_sequence_where_no_scores_are_stored():
    """Step-3.5-Flash at 32K on a GPU (flash-style kernels): the packed plan's terms are the
    one-sequence plan's, at CP 1 and at CP 8 x PP 9 x VPP 5; on a CPU it adds the documents'
    scores, heads x sum(t^2) x (4 + 2) bytes per full layer, counted here by hand."""
    from mcore_ext.plan import activations as A

    shape, _ = _flash_shape_and_spec()
    for layout in (A.Layout(), A.Layout(cp=8, pp=9, vpp=5, ep=8)):
        one, packed = (A.stage_activations(shape, layout, A.Workload(
            seq=32768, packed=p, documents=(16384, 8192, 8192))) for p in (False, True))
        assert [s.saved.terms for s in packed] == [s.saved.terms for s in one]
        assert [s.peak for s in packed] == [s.peak for s in one]
    documents = (16384, 8192, 4096, 4096)
    work = A.Workload(seq=32768, packed=True, cpu=True, documents=documents)
    full = next(layer for layer in shape.layers if not layer.sliding)
    terms = A.attention_bytes(shape, full, A.Layout(tp=8), work).terms
    assert terms["packed scores (CPU sdpa)"] == full.heads / 8 * sum(
        t * t for t in documents) * (4 + 2)


# ------------------------------------------------------------------ the plan of a launcher config

def _flash_shape_and_spec():
    import json
    import os

    import mcore_ext  # noqa: F401 (megatron's config)
    from mcore_ext.hf import plan as hf_plan
    from mcore_ext.hf.config import Step35Config

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    with open(os.path.join(root, "tests", "hf", "fixtures", "step35_flash_config.json")) as f:
        spec = Step35Config.from_hf_dict(json.load(f))
    return hf_plan.shape_of(spec), root


def test_the_launcher_config_and_the_hf_config_plan_alike(capsys):
    """``python -m mcore_ext.plan`` and ``python -m mcore_ext.hf plan``, their main() in this
    process (a process each would spend its time importing megatron)."""
    import os

    from mcore_ext.hf.__main__ import main as hf_main
    from mcore_ext.plan.__main__ import main as plan_main

    _, root = _flash_shape_and_spec()
    common = ["--seq", "32768", "--cp", "4", "--recompute", "full", "--dp", "2"]
    assert plan_main(["--config", os.path.join(root, "configs", "step35_flash.yaml"),
                      "--vocab-size", "128896", *common]) in (0, None)
    launcher = capsys.readouterr().out
    assert hf_main(["plan", os.path.join(root, "tests", "hf", "fixtures",
                                         "step35_flash_config.json"),
                    "--tp", "2", "--pp", "9", "--ep", "16", "--etp", "1", *common]) in (0, None)
    hf = capsys.readouterr().out
    assert launcher == hf and "TP 2 x PP 9 CP 4, EP 16, ETP 1, DP 2 = 144 ranks" in hf
    code = plan_main(["--config", os.path.join(root, "configs", "step35_flash.yaml"),
                      "parallelism.pipeline_model_parallel_size=4", "--vocab-size", "128896",
                      "--dp", "8"])
    assert code == 2 and "num_layers=45 is not divisible by pipeline size 4" in (
        capsys.readouterr().err)


def test_a_tokenizer_without_transformers_is_one_error_line(capsys, monkeypatch):
    """The vocabulary from a Hugging Face tokenizer where transformers cannot be imported: one
    line naming the package, exit 2 (before: an ImportError traceback)."""
    import os
    import sys

    from mcore_ext.plan.__main__ import main as plan_main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setitem(sys.modules, "transformers", None)
    code = plan_main(["--config", os.path.join(root, "configs", "tiny_cpu.yaml"),
                      f"data.tokenizer={os.path.join(root, 'configs', 'sft_tiny', 'tokenizer')}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: tokenizer "), err
    assert "(pip install transformers)" in err, err


def test_sliding_layers_cost_their_tokens_and_cp_divides_them():
    from mcore_ext.plan import activations as A

    shape, _ = _flash_shape_and_spec()
    sliding, full = shape.layers[1], shape.layers[0]
    assert sliding.sliding and not full.sliding

    def per_token(layer, seq, cp=1):
        work = A.Workload(seq=seq, recompute="selective")
        return A.attention_bytes(shape, layer, A.Layout(tp=2, cp=cp), work).total / seq * cp

    # flash-style kernels keep no [s, s] scores: bytes per token do not grow with the sequence
    assert per_token(sliding, 4096) == per_token(sliding, 262144)
    assert per_token(sliding, 262144, cp=8) == per_token(sliding, 262144)
    # the dense window mask (today's sdpa path) is s^2 per batch
    masked = A.Workload(seq=32768, sliding_kernel="masked")
    assert A.batch_bytes(shape, [1], A.Layout(), masked).total == 32768**2 * 2


def test_pipeline_stages_hold_megatrons_1f1b_micro_batches():
    from mcore_ext.plan import activations as A

    work = A.Workload(seq=4096)
    assert [A.in_flight(A.Layout(pp=4), s, work) for s in range(4)] == [4, 3, 2, 1]
    # interleaved (VPP 3): warmup (pp - s - 1) * 2 + (vpp - 1) * pp chunks, 1 / vpp of a stage
    assert A.in_flight(A.Layout(pp=4, vpp=3), 0, work) == (3 * 2 + 2 * 4 + 1) / 3
    assert A.in_flight(A.Layout(pp=4), 0, A.Workload(seq=4096, num_microbatches=2)) == 2


def test_search_lists_the_fewest_gpus_that_fit_first():
    from mcore_ext.plan import GIB, Workload, plan_memory, search

    shape, _ = _flash_shape_and_spec()
    work = Workload(seq=4096)
    found = search(shape, work, usable_gib=68.0, max_gpus=128, recomputes=("selective",),
                   tps=(2, 8), limit=50)
    assert found and found[0][0] == 72  # weights, grads and Adam state alone need that many
    assert [gpus for gpus, *_ in found] == sorted(gpus for gpus, *_ in found)
    for gpus, layout, recompute, worst in found[:5]:
        rows = plan_memory(shape, layout, Workload(seq=4096, recompute=recompute))
        assert max(r.total for r in rows) / GIB == pytest.approx(worst) and worst <= 68.0
        assert layout.world == gpus


# ------------------------------------------------------------------ LoRA: the frozen base, adapters

LORA_VOCAB = 256
# (config, overrides): a dense Step-3.5 with every target adapted, and the MoE miniature (without
# its MTP depth, as a LoRA run trains it) with the attention targets at EP 2.
LORA_MODELS = {
    "dense": ("step35_tiny_cpu.yaml", ["lora.rank=4", "lora.targets=all-linear"]),
    "moe": ("step35_moe_tiny_cpu.yaml", [
        "lora.rank=4", "lora.targets=[q_proj,k_proj,v_proj,g_proj,o_proj]",
        "model.mtp_num_layers=null", "model.swiglu_limits=[0,0,0,16.0]",
        "model.layer_types=[full_attention,sliding_attention,sliding_attention,sliding_attention]",
        "parallelism.expert_model_parallel_size=2", "parallelism.expert_tensor_parallel_size=1"]),
    # The MoE miniature whole: its MTP depth, every target, the shared and routed experts' too.
    "moe_all": ("step35_moe_tiny_cpu.yaml", [
        "lora.rank=4", "lora.targets=[all-linear,experts.gate_up_proj,experts.down_proj]",
        "model.moe_router_bias_update_rate=0", "parallelism.expert_model_parallel_size=2",
        "parallelism.expert_tensor_parallel_size=1"]),
}


def _lora_state(tp, model, distributed):
    """What the launcher's LoRA model (``build_model``: adapters before megatron's DDP and
    Float16Module) and its optimizer allocate on this rank after one step, beside the plan's
    bytes for the same config and layout."""
    import os

    import mcore_ext
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer

    from mcore_ext._cpu_compat import cuda_to_cpu
    from mcore_ext.lora import LoraConfig
    from mcore_ext.plan.params import stage_counts, state_bytes, with_lora
    from mcore_ext.plan.shape import ModelShape
    from mcore_ext.run_config import PretrainConfig, apply_overrides, build, read_yaml
    from mcore_ext.run_config.megatron_configs import optimizer_config, transformer_config
    from mcore_ext.training.loop import build_model
    from tests import builders

    name, overrides = LORA_MODELS[model]
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    cfg = build(PretrainConfig, apply_overrides(read_yaml(os.path.join(root, "configs", name)), [
        *overrides, f"parallelism.tensor_model_parallel_size={tp}",
        f"parallelism.sequence_parallel={tp > 1}", "training.precision=bf16",
        f"optimizer.use_distributed_optimizer={distributed}"]))
    p = cfg.parallelism
    mcore_ext.init_parallel(tensor_model_parallel_size=tp,
                            expert_model_parallel_size=p.expert_model_parallel_size,
                            expert_tensor_parallel_size=p.expert_tensor_parallel_size, seed=3)
    try:
        with cuda_to_cpu():  # megatron's mixed-precision optimizer allocates on "cuda" literally
            ddp = build_model(cfg, LORA_VOCAB)
            optimizer = get_megatron_optimizer(optimizer_config(cfg), [ddp])
            tokens = torch.randint(0, LORA_VOCAB, (2 * ps.get_data_parallel_world_size(), 17),
                                   generator=torch.Generator().manual_seed(0))
            builders.train_step(ddp, optimizer, tokens)
        params = list(ddp.parameters())
        chained = getattr(optimizer, "chained_optimizers", [optimizer])
        main = [q for o in chained for g in o.optimizer.param_groups for q in g["params"]]
        state = [s for o in chained for s in o.optimizer.state.values()]
        measured = {
            "bf16 weights": sum(q.numel() * q.element_size() for q in params) + sum(
                b.numel() * b.element_size() for n, b in ddp.named_buffers()
                if n.endswith("expert_bias")),
            "fp32 grads": sum(q.main_grad.numel() * q.main_grad.element_size()
                              for q in params if hasattr(q, "main_grad")),
            "fp32 main weights": sum(q.numel() * q.element_size() for q in main),
            "Adam state": sum(s[k].numel() * s[k].element_size() for s in state
                              for k in ("exp_avg", "exp_avg_sq")),
        }
        buffers = sum(b.grad_data.numel() * b.grad_data.element_size()
                      for b in ddp.buffers + ddp.expert_parallel_buffers)
        a = cfg.lora
        shape = with_lora(ModelShape.from_transformer_config(
            transformer_config(cfg), vocab_size=LORA_VOCAB, make_vocab_size_divisible_by=(
                cfg.model.make_vocab_size_divisible_by)),
            LoraConfig(rank=a.rank, alpha=a.alpha, dropout=a.dropout, targets=a.targets))
        (count,) = stage_counts(shape, tp, 1, p.expert_model_parallel_size,
                                p.expert_tensor_parallel_size)
        dp = ps.get_data_parallel_world_size()
        planned = state_bytes(count, dp=dp, edp=dp * tp // p.expert_model_parallel_size,
                              distributed_optimizer=distributed)
        return dict(measured=measured, planned=planned, buffers=buffers, dp=dp,
                    adapters=sum(q.numel() for n, q in ddp.named_parameters() if "_lora." in n),
                    planned_adapters=count.adapter + count.expert_adapter)
    finally:
        mcore_ext.destroy_parallel()


# The default run: the dense model at TP 2 (SP, B sharded) and the whole MoE model at TP 1 x DP 2
# (the distributed optimizer's DP shards of the dense adapters, the routed experts' adapters at
# EP 2 unsharded: expert-DP 1; the MTP layer's); the others are the slow suite's.
@pytest.mark.parametrize("model, tp", [
    ("dense", 2), ("moe_all", 1), pytest.param("dense", 1, marks=pytest.mark.slow),
    pytest.param("moe", 1, marks=pytest.mark.slow), pytest.param("moe", 2, marks=pytest.mark.slow)])
def test_lora_plan_holds_what_the_launchers_model_and_optimizer_allocate(run_distributed,
                                                                         model, tp):
    """A LoRA run of the launcher at TP 1 x DP 2 and TP 2 (SP), with and without the distributed
    optimizer, one Adam step: the plan's bf16 weights (frozen base and adapters), fp32 gradients,
    main copies and Adam state per rank equal what the model and optimizer hold (the gradients:
    the adapters' views of megatron's buffer; with the distributed optimizer each DP rank's shard
    of the main copies and Adam state, summed over the DP ranks, is the plan's share x DP)."""
    for distributed in (False, True):
        got = run_distributed(_lora_state, tp, model, distributed, world_size=2)
        for rank, one in enumerate(got):
            assert one["adapters"] == one["planned_adapters"], one
            for what in ("bf16 weights", "fp32 grads"):
                assert one["measured"][what] == one["planned"][what], (rank, what, one)
            # megatron pads each parameter's start in its buffer (distributed optimizer: to 64
            # elements) and the buffer's end; the plan counts the parameters themselves
            assert one["buffers"] >= one["planned"]["fp32 grads"]
        for what in ("fp32 main weights", "Adam state"):
            dp = got[0]["dp"]
            measured = sum(one["measured"][what] for one in got) / (2 // dp * dp)
            planned = got[0]["planned"][what]
            if not distributed or dp == 1:
                assert all(one["measured"][what] == planned for one in got), (what, got)
            assert measured == pytest.approx(planned), (what, distributed, got)


def test_a_lora_plan_counts_mtp_and_expert_adapters_and_refuses_expert_tp(capsys):
    """Step-3.5-Flash's config with its 3 MTP layers and every target, routed experts included,
    at 32K on one node (docs/memory-plan.md's command) plans: 319.3M adapters on a rank (its
    36 local experts' in 42 MoE layers), 62.8 GiB; routed experts' adapters at expert TP 2 are
    one ``error:`` line, exit 2 (the launcher refuses them)."""
    import os

    from mcore_ext.plan.__main__ import main as plan_main

    _, root = _flash_shape_and_spec()
    config = ["--config", os.path.join(root, "configs", "step35_flash.yaml"), "--vocab-size",
              "128896"]
    lora = ["lora.rank=16", "lora.targets=[all-linear,experts.gate_up_proj,experts.down_proj]"]
    assert plan_main([*config, "--seq", "32768", "--recompute", "full", "--packed",
                      "parallelism.tensor_model_parallel_size=8",
                      "parallelism.pipeline_model_parallel_size=1",
                      "parallelism.expert_model_parallel_size=8", *lora]) in (0, None)
    out = capsys.readouterr().out
    assert ("LoRA: r 16 on q_proj k_proj v_proj g_proj o_proj gate_proj up_proj down_proj "
            "experts.gate_up_proj experts.down_proj;" in out), out
    assert "the adapters trained: 319,339,776 on a rank" in out and "largest rank: 62.8 GiB" in out
    assert plan_main([*config, "--dp", "16", *lora,
                      "parallelism.expert_tensor_parallel_size=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: lora.targets: routed experts' adapters with expert tensor parallelism 2: "), err
