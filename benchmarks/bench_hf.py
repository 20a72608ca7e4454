"""Time and peak memory of ``python -m mcore_ext.hf import`` / ``export`` on a generated model.

    python benchmarks/bench_hf.py [--layers 8] [--workdir /tmp/bench_hf]

Generates a random dense Step-3.5 model in the released layout (bf16, both layer kinds, about
1 GB with the defaults) with mcore_ext's own streaming writer, then runs import and export each
in a fresh process (TP = PP = 1, one CPU process, as the CLI runs) and reports wall time and peak
RSS over the interpreter's (RSS after importing torch, megatron-core and mcore_ext, before the
work starts). Finally checks that export reproduced every tensor bit for bit.
Targets (issue 10): each under 60 s and under 1.5 GB over the interpreter.

    python benchmarks/bench_hf.py --moe [--layers 4] [--ep 4]

Issue 18: a generated MoE + MTP model (about 2 GB: layer 0 dense, the others MoE with 48 stacked
experts, one MTP layer with its own head, fp32 router bias) goes HF -> megatron (``load_pretrained``)
-> HF (``save_pretrained``) in one fresh process (``--ep 1``) or in ``--ep`` gloo ranks under
torchrun, each reading only its experts' slices (export gathers the experts to rank 0 one at a
time); reports both steps' time and each rank's peak RSS over its interpreter, and checks the
round trip bit for bit.

    python benchmarks/bench_hf.py --import-architectures [--layers 4]

Issue 44 (item 10): the same generated dense model imported as GPTModel and as HybridModel
(``--architecture gpt`` / ``hybrid``), each in a fresh process; reports each import's peak RSS over
the interpreter, the model's bytes, and the hybrid / GPT ratio. Target: the HybridModel import
within 1.1 x the GPT import's peak (one model per rank, not two).
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def generate(directory: str, layers: int, moe: bool = False) -> int:
    """A random model in the released layout; returns its size in bytes. ``moe``: layer 0 dense,
    the others MoE (stacked experts written expert by expert, so the generator never holds one
    whole), plus one MTP layer."""
    import torch

    from mcore_ext.hf import layout
    from mcore_ext.hf.config import Step35Config
    from mcore_ext.hf.safetensors_io import ShardedSafetensorsWriter

    full = 0 if moe else 3  # which layer of every 4 is full attention
    kinds = ["full_attention" if i % 4 == full else "sliding_attention" for i in range(layers)]
    moe_fields = dict(
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_experts=48, moe_top_k=4,
        moe_intermediate_size=768, share_expert_dim=768, moe_router_scaling_factor=3.0,
        expert_swiglu_limits=[None] * (layers - 1) + [7.0], num_mtp_layers=1,
    ) if moe else {}
    spec = Step35Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=layers,
        num_heads=16, num_kv_heads=4, head_dim=128, num_sliding_heads=24, layer_types=kinds,
        sliding_window=512, rope_theta={"full_attention": 5e6, "sliding_attention": 1e4},
        partial_rotary_factor={"full_attention": 0.5, "sliding_attention": 1.0},
        swiglu_limits=[None] * (layers - 1) + [16.0], max_position_embeddings=4096,
        **moe_fields,
    )
    plan = [(n, layout.hf_dtype(n, torch.bfloat16), s) for n, s in layout.hf_shapes(spec).items()]
    generator = torch.Generator().manual_seed(0)
    config = json.dumps(spec.to_hf_dict(), indent=2)
    with ShardedSafetensorsWriter(directory, plan, max_shard_bytes=400 * 2**20,
                                  extra_files={"config.json": config}) as writer:
        for name, dtype, shape in plan:
            if name.endswith(layout.STACKED_EXPERT_NAMES):
                for _ in range(shape[0]):
                    rows = torch.randn((1, *shape[1:]), generator=generator) * 0.02
                    writer.write_rows(name, rows.to(dtype))
            else:
                writer.write(name, (torch.randn(shape, generator=generator) * 0.02).to(dtype))
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def measure_moe(source: str, target: str, ep: int = 1) -> None:
    """Run in this (fresh) process, one rank of ``ep``: load_pretrained, then save_pretrained;
    one JSON line per rank."""
    import torch.distributed as dist

    import mcore_ext
    from mcore_ext.hf import load_pretrained, save_pretrained

    baseline = _rss_mb()
    mcore_ext.init_parallel(expert_model_parallel_size=ep)
    rank = dist.get_rank()
    start = time.perf_counter()
    with mcore_ext.cuda_to_cpu():
        model = load_pretrained(source, backend="sdpa")
        loaded = time.perf_counter()
        after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        save_pretrained(model, target, max_shard_bytes=400 * 2**20)
    saved = time.perf_counter()
    mcore_ext.destroy_parallel()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(json.dumps({"rank": rank, "load_s": round(loaded - start, 1),
                      "save_s": round(saved - loaded, 1),
                      "model_mb": round(model_mb), "baseline_rss_mb": round(baseline),
                      "peak_after_load_over_interpreter_mb": round(after_load - baseline),
                      "peak_over_interpreter_mb": round(peak - baseline)}))


def main_moe(args) -> int:
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    hf, out = str(work / "hf"), str(work / "exported")
    start = time.perf_counter()
    size = generate(hf, args.layers, moe=True)
    print(f"generated {size / 2**30:.2f} GiB (MoE + MTP, {args.layers} layers, bf16) in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ep}",
              "--master_addr=127.0.0.1", "--master_port=29517"] if args.ep > 1 else [sys.executable]
    result = subprocess.run([*launch, __file__, "--measure", "moe", hf, out, "--ep", str(args.ep)],
                            capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode:
        print(result.stdout[-2000:], result.stderr[-4000:])
        return 1
    ranks = sorted((json.loads(line) for line in result.stdout.splitlines()
                    if line.startswith("{")), key=lambda f: f["rank"])
    for figures in ranks:
        print(figures, flush=True)
    peak = max(f["peak_over_interpreter_mb"] for f in ranks)
    print(f"EP {args.ep}: largest rank peak {peak} MB over its interpreter, all ranks together "
          f"{sum(f['peak_over_interpreter_mb'] for f in ranks)} MB")
    bad = compare(hf, out)
    print("round trip: every tensor bit-identical" if not bad else f"round trip differs: {bad[:5]}")
    ok = (not bad and all(f["load_s"] < 60 and f["save_s"] < 60 for f in ranks)
          and peak < 1536)
    print("targets (< 60 s each, < 1.5 GB over the interpreter per process):",
          "met" if ok else "NOT met")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def measure(command: str, source: str, target: str, architecture: str | None = None) -> None:
    """Run in this (fresh) process: import (as ``architecture``, default the recommended one) or
    export, then print one JSON line of figures."""
    import mcore_ext  # noqa: F401  (the interpreter's baseline includes megatron-core)
    import mcore_ext.hf.checkpoint as hf_checkpoint
    import mcore_ext.models  # noqa: F401
    import mcore_ext.training.checkpointing  # noqa: F401

    baseline = _rss_mb()
    start = time.perf_counter()
    mcore_ext.init_parallel(tensor_model_parallel_size=1)
    with mcore_ext.cuda_to_cpu():
        if command == "import":
            hf_checkpoint.import_checkpoint(source, target, architecture=architecture)
        else:
            hf_checkpoint.export_checkpoint(source, target, max_shard_bytes=400 * 2**20)
    seconds = time.perf_counter() - start
    mcore_ext.destroy_parallel()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"command": command, "architecture": architecture,
                      "seconds": round(seconds, 1),
                      "baseline_rss_mb": round(baseline), "peak_rss_mb": round(peak),
                      "peak_over_interpreter_mb": round(peak - baseline)}))


def compare(a: str, b: str) -> list[str]:
    """Names of tensors that differ (or exist on one side only), read one at a time."""
    from mcore_ext.hf.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    bad = sorted(set(ra.names) ^ set(rb.names))
    for name in sorted(set(ra.names) & set(rb.names)):
        x, y = ra.get(name), rb.get(name)
        if x.dtype != y.dtype or not x.equal(y):
            bad.append(name)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", default="/tmp/bench_hf")
    parser.add_argument("--measure", nargs=3, metavar=("COMMAND", "SOURCE", "TARGET"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--moe", action="store_true", help="the MoE + MTP model (issue 18)")
    parser.add_argument("--import-architectures", action="store_true",
                        help="import the same model as GPTModel and as HybridModel (issue 44)")
    parser.add_argument("--architecture", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ep", type=int, default=1,
                        help="--moe: expert-parallel ranks (gloo processes under torchrun)")
    args = parser.parse_args()
    if args.measure:
        if args.measure[0] == "moe":
            measure_moe(*args.measure[1:], ep=args.ep)
        else:
            measure(*args.measure, architecture=args.architecture)
        return 0
    if args.moe:
        return main_moe(args)
    if args.import_architectures:
        return main_architectures(args)

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    hf, ckpt, out = str(work / "hf"), str(work / "ckpt"), str(work / "exported")
    start = time.perf_counter()
    size = generate(hf, args.layers)
    print(f"generated {size / 2**30:.2f} GiB ({args.layers} layers, bf16) in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    figures = []
    for command, source, target in (("import", hf, ckpt), ("export", ckpt, out)):
        result = subprocess.run(
            [sys.executable, __file__, "--measure", command, source, target],
            capture_output=True, text=True, env=env, cwd=ROOT,
        )
        if result.returncode:
            print(result.stdout[-2000:], result.stderr[-4000:])
            return 1
        figures.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(figures[-1], flush=True)
    bad = compare(hf, out)
    print("round trip: every tensor bit-identical" if not bad else f"round trip differs: {bad[:5]}")
    ok = not bad and all(f["seconds"] < 60 and f["peak_over_interpreter_mb"] < 1536 for f in figures)
    print("targets (< 60 s, < 1.5 GB over the interpreter):", "met" if ok else "NOT met")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def main_architectures(args) -> int:
    """Issue 44: the import's peak as GPTModel and as HybridModel, side by side."""
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    hf = str(work / "hf")
    size = generate(hf, args.layers)
    print(f"generated {size / 2**30:.2f} GiB ({args.layers} layers, bf16)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    peaks = {}
    for architecture in ("gpt", "hybrid"):
        result = subprocess.run(
            [sys.executable, __file__, "--measure", "import", hf, str(work / architecture),
             "--architecture", architecture], capture_output=True, text=True, env=env, cwd=ROOT)
        if result.returncode:
            print(result.stdout[-2000:], result.stderr[-4000:])
            return 1
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        peaks[architecture] = figures["peak_over_interpreter_mb"]
        print(figures, flush=True)
    ratio = peaks["hybrid"] / peaks["gpt"]
    print(f"model {size / 2**20:.0f} MB; import peak over the interpreter: GPTModel "
          f"{peaks['gpt']} MB, HybridModel {peaks['hybrid']} MB, ratio {ratio:.3f}")
    ok = ratio <= 1.1
    print("target (HybridModel import within 1.1 x GPTModel's):", "met" if ok else "NOT met")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
