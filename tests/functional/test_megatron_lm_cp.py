"""The Megatron-LM entry (``-m mcore_ext.megatron_lm.pretrain_gpt``) with context parallelism,
through megatron.training's own ``pretrain()`` on gloo, mock data, fp32, no dropout:

    cp1      1 rank, CP 1
    cp2      2 ranks, --context-parallel-size 2 and otherwise the same flags (so Megatron-LM's
             defaults: --cp-comm-type p2p, an attention mask made by the dataloader)
    tp2      2 ranks, TP 2, CP 1
    tp2_cp2  4 ranks, TP 2 x CP 2 (tp2 and tp2_cp2: opt-in, -m slow)

Every layout reads the same samples (DP 1). Per iteration the loss and the pre-clipping grad norm
of cp2 must equal cp1's and tp2_cp2's tp2's (megatron initialises each TP shard from its own RNG
stream, so TP 2 starts from other weights than TP 1); rel 1e-5: reduction order only. Before the entry split the batch over CP
ranks, every rank fed the whole sequence to a model expecting its two chunks: iteration 1's loss
was 5.559535 at CP 2 vs 5.558819 at CP 1, grad norm 1.348 vs 1.385.
"""

import re

import pytest

from tests.functional.test_megatron_lm_pretrain import MODEL
from tests.functional.test_pretrain import check, torchrun

pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")

TIMEOUT_S = 600
EXACT_LOG = ("-m", "tests.functional.megatron_lm_exact_log")
TRAINING = [
    "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000",
]
EXACT = re.compile(r"exact iteration=(\d+) lm_loss=(\S+) grad_norm=(\S+)")
TOL = 1e-5


def exact(result) -> dict[int, tuple[float, float]]:
    return {int(i): (float(loss), float(norm)) for i, loss, norm in EXACT.findall(result.stdout)}


def run(*flags, nproc):
    return torchrun(*MODEL, *TRAINING, *flags, nproc=nproc, program=EXACT_LOG, timeout=TIMEOUT_S)


RUNS = {
    "cp1": ((), 1),
    "cp2": (("--context-parallel-size", "2"), 2),
    "tp2": (("--tensor-model-parallel-size", "2"), 2),
    "tp2_cp2": (("--context-parallel-size", "2", "--tensor-model-parallel-size", "2"), 4),
}


@pytest.fixture(scope="module")
def cp_runs():
    """``cp_runs(name)``: each layout runs once, when a test first asks for it (the TP 2 pair is
    opt-in, so the default run makes two of the four)."""
    done = {}

    def get(name):
        if name not in done:
            flags, nproc = RUNS[name]
            done[name] = check(run(*flags, nproc=nproc), name)
        return done[name]

    return get


@pytest.mark.parametrize("name, cp1_name", [
    ("cp2", "cp1"), pytest.param("tp2_cp2", "tp2", marks=pytest.mark.slow)])
def test_cp_losses_and_grad_norms_match_cp1(cp_runs, name, cp1_name):
    reference, run_ = exact(cp_runs(cp1_name)), exact(cp_runs(name))
    assert sorted(reference) == sorted(run_) == [1, 2, 3], (reference, run_)
    for iteration in (1, 2, 3):
        (loss1, norm1), (loss, norm) = reference[iteration], run_[iteration]
        assert loss == pytest.approx(loss1, rel=TOL), (iteration, reference, run_)
        assert norm == pytest.approx(norm1, rel=TOL), (iteration, reference, run_)


def test_cp_says_once_what_it_changed(cp_runs):
    """Megatron-LM's default --cp-comm-type p2p runs as the sdpa backend's all-gather, and the
    dataloader's causal-only mask is not made: each said once, by rank 0."""
    out = cp_runs("cp2").stdout + cp_runs("cp2").stderr
    assert out.count("--cp-comm-type p2p") == 1, out[-3000:]
    assert out.count("attention mask") == 1, out[-3000:]


def test_unsupported_cp_comm_type_is_one_line_before_training():
    result = run("--context-parallel-size", "2", "--cp-comm-type", "a2a", nproc=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --cp-comm-type a2a with --context-parallel-size 2: the sdpa backend's context "
        "parallelism all-gathers K/V; use --cp-comm-type all_gather (or p2p, run as all_gather), "
        "or --mcore-ext-backend te"
    ], result.stderr[-3000:]
    # torchrun's own report of a failed child stays; no rank prints a traceback
    assert "[rank" not in result.stderr and "FlagError" not in result.stderr, result.stderr[-3000:]
    assert "lm loss" not in result.stdout


def test_per_document_mask_and_local_backend_under_cp_are_refused_by_name():
    """--reset-attention-mask makes a per-document mask the sdpa CP path cannot take (at CP 1
    SDPA takes it as given); the local backend has no CP."""
    import argparse

    from mcore_ext.megatron_lm.pretrain_gpt import FlagError, attention_flags

    args = argparse.Namespace(
        context_parallel_size=2, mcore_ext_backend="sdpa", cp_comm_type=["p2p"],
        create_attention_mask_in_dataloader=True, reset_attention_mask=True,
    )
    with pytest.raises(FlagError, match="--reset-attention-mask with --context-parallel-size 2"):
        attention_flags(args)
    args.context_parallel_size = 1
    assert attention_flags(args) == [] and args.create_attention_mask_in_dataloader
    args.context_parallel_size, args.reset_attention_mask = 2, False
    assert len(attention_flags(args)) == 2
    assert args.cp_comm_type == ["all_gather"] and not args.create_attention_mask_in_dataloader
    args.mcore_ext_backend = "local"
    with pytest.raises(FlagError, match="local DotProductAttention has no context parallelism"):
        attention_flags(args)
    args.context_parallel_size, args.create_attention_mask_in_dataloader = 1, True
    assert attention_flags(args) == [] and args.create_attention_mask_in_dataloader  # local: as is


# ------------------------------------------------------ CP 1: the dataloader's causal-only mask

SPY = ("-m", "tests.functional.megatron_lm_attention_spy")
KINDS = ["--layer-types", "sliding_attention", "full_attention", "--sliding-window", "16"]


def test_causal_only_mask_keeps_the_banded_and_causal_kernels_at_cp1():
    """Megatron-LM's default --create-attention-mask-in-dataloader at CP 1 through megatron's
    pretrain(), spying on torch's SDPA: the sliding layer (window (15, 0), s = 64) runs banded,
    [16, 16] for block 0 and [16, 32] for the others, the full layer with is_causal and no mask;
    no [s, s] mask is made. Before, the dataloader's causal [1, 1, 64, 64] mask reached core
    attention and both layers ran one SDPA call under a dense 64 x 64 mask."""
    flags = [a if a != "32" else "64" for a in MODEL]  # --seq-length, --max-position-embeddings
    result = check(torchrun(*flags, *TRAINING, *KINDS, "--train-iters", "2", nproc=1,
                            program=SPY, timeout=TIMEOUT_S), "spy")
    calls = sorted(line for line in result.stdout.splitlines() if line.startswith("sdpa "))
    assert calls == [
        "sdpa q=16 k=16 mask=(16, 16) is_causal=False",
        "sdpa q=16 k=32 mask=(16, 32) is_causal=False",
        "sdpa q=64 k=64 mask=None is_causal=True",
    ], result.stdout[-3000:]
    out = result.stdout + result.stderr
    assert out.count("attention mask") == 1, out[-3000:]  # said once
