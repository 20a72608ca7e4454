"""Checkpoints interchange exactly with upstream Megatron-LM dev's native head_wise_attn_gate.

Upstream dev's megatron-core and the 0.19.2 that mcore_ext requires cannot share a process, so
the two sides run in their own environments on 4 gloo ranks each and meet through checkpoints:

1. mcore_ext (this environment's worker pool) saves a 2-layer gated GPTModel of every variant
   (GQA with 4 groups / MHA, QKV bias on / off) at TP 1, 2 and 4, with its logits; every head
   gets its own gate first, so that gate rows on the wrong heads would change the logits;
2. upstream dev (``dev_driver.py`` under torchrun in ``.upstream-dev/venv``) loads each at TP 1, 2
   and 4 into its own model, and saves its own models at TP 1, 2 and 4;
3. mcore_ext loads each of upstream's checkpoints at TP 1, 2 and 4.

Every one of the 2 x 9 x 4 loads must reproduce the checkpoint's global ``[QKV ; Gate]`` blocks
(``linear_qkv.{weight,bias}._qkv`` / ``._gate``) exactly in the loaded model, give the source
model's logits (fp32, max abs diff <= 1e-5: the same math, upstream's DotProductAttention against
mcore_ext's SDPA) and, saved again, reproduce every tensor of the checkpoint bit for bit. As a
control, the loaded model with each rank's gate rows rolled by one head must miss the logits.

Not part of the default run (``-m upstream_dev``); needs ``scripts/setup_upstream_dev.sh``.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.upstream import interchange_case as case

pytestmark = pytest.mark.upstream_dev

ROOT = Path(__file__).resolve().parents[2]
DEV_DIR = Path(os.environ.get("UPSTREAM_DEV_DIR", ROOT / ".upstream-dev"))
DRIVER = Path(__file__).with_name("dev_driver.py")
TOL = 1e-5
DEV_TIMEOUT_S = 600


# --- mcore_ext's side (runs on the worker pool's ranks) ---------------------------------------

def _build_ours(tp, variant):
    from tests import builders

    config = builders.gated_config(**case.MODEL, **case.VARIANTS[variant],
                                   tensor_model_parallel_size=tp)
    model = builders.build_gpt(config, vocab_size=case.VOCAB_SIZE, seq_length=case.SEQ_LENGTH,
                               parallel_output=False)
    return model.eval()


def _logits(model):
    tokens, positions = case.tokens_and_positions()
    with torch.no_grad():
        return model(tokens, positions, case.causal_mask())


def _save_ours(tp, root):
    import mcore_ext
    from mcore_ext import checkpoint
    from tests import builders

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=tp)
    logits = {}
    for variant in case.VARIANTS:
        model = _build_ours(tp, variant)
        case.set_distinct_gates_(model, case.MODEL["num_attention_heads"], seed=100)
        logits[(variant, tp)] = _logits(model)
        checkpoint.save(model.sharded_state_dict(),
                        builders.shared_dir(case.checkpoint_dir(root, "ours", variant, tp)))
    return logits


def _load_dev(tp, root, dev_logits):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.validation import StrictHandling

    import mcore_ext
    from mcore_ext import checkpoint
    from tests import builders

    mcore_ext.init_parallel(tensor_model_parallel_size=tp, seed=300 + tp)
    heads = case.MODEL["num_attention_heads"]
    results = {}
    for variant in case.VARIANTS:
        fresh = _logits(_build_ours(tp, variant))
        for src_tp in case.TP_SIZES:
            source = case.checkpoint_dir(root, "dev", variant, src_tp)
            model = _build_ours(tp, variant)
            state = checkpoint.load(model.sharded_state_dict(), source,
                                    strict=StrictHandling.RAISE_ALL)
            model.load_state_dict(state)
            figures = case.check_load(model, source, heads, _logits,
                                      dev_logits[(variant, src_tp)], fresh)
            resaved = builders.shared_dir(case.resave_dir(root, "dev_to_ours", variant, src_tp, tp))
            checkpoint.save(model.sharded_state_dict(), resaved)
            dist.barrier()
            figures["resave"] = case.compare_checkpoints(source, resaved)
            results[(variant, src_tp, tp)] = figures
    return results


# --- the test -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dev_python():
    python = DEV_DIR / "venv" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no upstream-dev environment at {DEV_DIR}: build it with "
                    "MEGATRON_LM_GIT=/path/to/Megatron-LM.git bash scripts/setup_upstream_dev.sh")
    return python


@pytest.fixture(scope="module")
def interchange(dev_python, tmp_path_factory, _worker_pools):
    """Phases 1 and 2: mcore_ext saves, then upstream dev loads those and saves its own."""
    from tests.distributed import WorkerPool

    root = str(tmp_path_factory.mktemp("upstream_dev"))
    pool = _worker_pools.get(case.WORLD_SIZE)
    if pool is None or not pool.alive:
        pool = _worker_pools[case.WORLD_SIZE] = WorkerPool(case.WORLD_SIZE)
    start = time.perf_counter()
    ours_logits = {}
    for tp in case.TP_SIZES:
        ours_logits.update(pool.run(_save_ours, tp, root, timeout=600)[0])
    torch.save(ours_logits, f"{root}/ours_logits.pt")
    seconds = {"mcore_ext save": time.perf_counter() - start}

    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", NO_VCS_VERSION="1", PYTHONWARNINGS="ignore")
    command = [str(dev_python), "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={case.WORLD_SIZE}", str(DRIVER), "--root", root]
    log = Path(root) / "dev_driver.log"
    with open(log, "w") as out:
        # Its own session, so that a timeout stops torchrun's workers too.
        driver = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            returncode = driver.wait(timeout=DEV_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
            returncode = f"timeout after {DEV_TIMEOUT_S} s"
    assert returncode == 0, f"upstream dev driver: {returncode}; {log}:\n{log.read_text()[-20000:]}"
    dev = torch.load(f"{root}/dev_results.pt")
    seconds["upstream dev (torchrun, incl. start)"] = time.perf_counter() - start
    commit = (DEV_DIR / "COMMIT").read_text().strip() if (DEV_DIR / "COMMIT").exists() else "?"
    print(f"\nupstream Megatron-LM {commit}: megatron.core {dev['megatron_core']['version']} "
          f"from {dev['megatron_core']['file']}")
    return dict(root=root, dev=dev, seconds=seconds)


def test_upstream_dev_loads_mcore_ext_checkpoints_exactly(interchange):
    loads = interchange["dev"]["loads"]
    _report("mcore_ext -> upstream dev", loads)
    _print_seconds(interchange["seconds"])
    _check(loads)


def test_mcore_ext_loads_upstream_dev_checkpoints_exactly(interchange, run_distributed):
    root, dev = interchange["root"], interchange["dev"]
    start = time.perf_counter()
    loads = {}
    for tp in case.TP_SIZES:
        loads.update(run_distributed(_load_dev, tp, root, dev["logits"],
                                     world_size=case.WORLD_SIZE, timeout=600)[0])
    _report("upstream dev -> mcore_ext", loads)
    _print_seconds({"mcore_ext load": time.perf_counter() - start})
    _check(loads)


def _check(loads):
    assert len(loads) == len(case.VARIANTS) * len(case.TP_SIZES) ** 2
    for (variant, src_tp, dst_tp), r in loads.items():
        where = f"{variant} TP {src_tp} -> {dst_tp}"
        bias = case.VARIANTS[variant]["add_qkv_bias"]
        expected_keys = sorted(key.format(name) for key in (case.QKV_KEY, case.GATE_KEY)
                               for name in (("weight", "bias") if bias else ("weight",)))
        assert r["qkv_gate_keys"] == expected_keys, where
        assert all(d == 0.0 for d in r["qkv_gate_diffs"].values()), (where, r["qkv_gate_diffs"])
        assert r["resave"]["identical"], (where, r["resave"])
        assert r["logits_before"] > 1e-3, where  # a fresh model really differs
        assert r["logits_after"] <= TOL, (where, r["logits_after"])
        assert r["logits_gates_rolled"] > 1e-2, where  # misplaced gates would show


def _report(direction, loads):
    print(f"\n{direction}: max |loaded - checkpoint| of the global blocks; the re-saved "
          "checkpoint; max |logits - source logits| of the loaded model, of a fresh one, and of "
          "the loaded one with each rank's gate rows rolled by one head")
    print(f"{'variant':13} {'TP':>6} {'qkv.w':>6} {'gate.w':>6} {'qkv.b':>6} {'gate.b':>6}  "
          f"{'re-save':>16}  {'logits':>8}  {'fresh':>8}  {'rolled':>8}")
    for (variant, src_tp, dst_tp), r in sorted(loads.items()):
        d = r["qkv_gate_diffs"]
        cells = [d.get(key.format(name)) for name in ("weight", "bias")
                 for key in (case.QKV_KEY, case.GATE_KEY)]
        cells = ["-" if c is None else f"{c:g}" for c in cells]
        resave = r["resave"]
        resave = (f"{resave['num_tensors']} exact" if resave["identical"]
                  else f"DIFF {resave['max_abs_diff']:.2g}")
        print(f"{variant:13} {src_tp:>2}->{dst_tp:<2} {cells[0]:>6} {cells[1]:>6} {cells[2]:>6} "
              f"{cells[3]:>6}  {resave:>16}  {r['logits_after']:8.1e}  {r['logits_before']:8.1e}  "
              f"{r['logits_gates_rolled']:8.1e}")


def _print_seconds(seconds):
    print("wall time: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
