"""What the gate changes in a run: attention sinks and massive activations, gated against ungated.

    python benchmarks/bench_sinks.py --preset cpu --seeds 2 --json out.json --png out.png
    python benchmarks/bench_sinks.py --cost --json cost.json     # the probe's cost, tiny config

The head-wise gate is adopted for what the gated-attention paper (Qiu et al., 2025) reports beyond
loss: with it, the first token's share of attention falls from about half to a few percent (no
*attention sink*), the largest hidden activations fall by an order of magnitude, and longer
contexts extrapolate better. Each seed trains the ungated model (``off``) and the gated one with
the launcher's default init (``on_default``) from identical shared weights on the same data (the
machinery of ``bench_convergence.py``: every shared weight compared at step 0, the JSON's
``identical_at_step0``), through the launcher itself with ``logging.attention_probe``. Read from
the probe records over training, per variant and seed: the first token's mean attention share,
the sink rate (heads above 0.3, Gu et al., ICLR 2025), the residual stream's largest |activation|
and the attention output's; the final loss (the last window's mean); and, after training, the
validation loss at 1x, 2x and 4x the training length (RoPE unchanged), per segment of the training
length, on the validation split's first rows (``--long-rows``).

``--cost``: the probe's cost on configs/tiny_cpu.yaml as written (TP 2 on 2 ranks, torchrun),
side by side in one run: each probe's time against the mean step time of the same run, at an
interval of 100 steps (a probe costs its time / (100 x step time) of training).

Output: a table, the JSON (``--json``) and a plot (``--png``, matplotlib).
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_convergence as convergence  # noqa: E402  (its runs, fingerprints, environment)

ROOT = convergence.ROOT
VARIANTS = ["off", "on_default"]

# A byte-level GPT on the stdlib text, on one core a run: SwiGLU, RMSNorm, QKV bias (the gate's
# bias rows, the ungated run's too), seq 128, 8 x 128 tokens a step, lr 3e-3 cosine to 3e-4 with
# a 100-step warmup, wd 0.1, clip 1.
def _model(layers, hidden, heads, seq=128, micro=8):
    return [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.num_attention_heads={heads}", f"model.ffn_hidden_size={4 * hidden}",
            f"model.seq_length={seq}", "model.swiglu=true", "model.normalization=RMSNorm",
            "model.add_qkv_bias=true", "model.attention_backend=sdpa", "model.architecture=gpt",
            f"training.micro_batch_size={micro}", f"training.global_batch_size={micro}",
            "training.precision=fp32"]


RECIPE = ["optimizer.lr=3.0e-3", "optimizer.min_lr=3.0e-4", "optimizer.lr_decay_style=cosine",
          "optimizer.weight_decay=0.1", "optimizer.adam_beta2=0.95", "optimizer.clip_grad=1.0",
          "optimizer.lr_warmup_iters=100"]

PRESETS = {
    "cpu": {
        "what": "4 x 128 GPT (8 heads of 16), seq 128, 8 x 128 tokens a step, lr 3e-3, 3000 "
                "steps, fp32; probe every 100 steps",
        "iters": 3000, "probe": 100, "window": 100, "long": (2, 4), "long_rows": 16,
        "extra": _model(4, 128, 8) + RECIPE,
    },
    # A few steps, for the benchmark's own test.
    "smoke": {
        "what": "2 x 32 GPT, seq 32, 4 steps (the benchmark's test)",
        "iters": 4, "probe": 2, "window": 2, "long": (2,), "long_rows": 2,
        "extra": _model(2, 32, 4, seq=32, micro=2) + RECIPE[:-1] + ["optimizer.lr_warmup_iters=1"],
    },
}
PROBE_FIGURES = ("first_token_share", "sink_rate", "max_activation", "max_attn_output")


def run_argv(preset: dict, variant: str, seed: int, workdir: str) -> list[str]:
    """bench_convergence's run of one variant, with this preset's model and the probe."""
    # bench_convergence's recipe (lr 3e-4, warmup 2) comes first, this preset's after it: later
    # overrides win.
    condition = dict(iters=preset["iters"], extra=preset["extra"])
    return convergence.run_argv(condition, variant, seed, workdir) + [
        f"logging.attention_probe={preset['probe']}"]


# ------------------------------------------------------------------------------------ worker

_LONG = {}  # metrics file -> validation losses at longer contexts (filled after training)


def _long_context_losses(trainer, factors, rows) -> dict:
    """The trained model's validation loss at 1x and each factor x the training length (RoPE
    unchanged), on the validation split's first ``rows`` samples of that length: the mean over
    every position, and per segment of the training length ([0, L), [L, 2L), ...)."""
    import torch

    from mcore_ext.data.tokenizers import load_tokenizer
    from mcore_ext.runtime import device
    from mcore_ext.training.data import build_datasets, first_micro_batch

    cfg, out = trainer.cfg, {}
    length = cfg.model.seq_length
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    trainer.model.eval()
    for factor in (1, *factors):
        c = copy.deepcopy(cfg)
        c.model.seq_length = factor * length
        c.training.train_iters, c.training.eval_interval, c.training.eval_iters = 1, 1, 1
        c.training.micro_batch_size = c.training.global_batch_size = rows
        _, valid = build_datasets(c, tokenizer)
        batch = first_micro_batch(valid, c)
        with torch.no_grad():
            losses = trainer.model(batch["tokens"].to(device()), batch["position_ids"].to(device()),
                                   None, labels=batch["labels"].to(device()))  # [b, s]
        mask = batch["loss_mask"].to(losses.device).float()
        per_position = (losses.float() * mask).sum(0) / mask.sum(0).clamp(min=1)
        out[str(factor)] = dict(
            loss=float((losses.float() * mask).sum() / mask.sum()),
            segments=[float(per_position[i * length:(i + 1) * length].mean())
                      for i in range(factor)])
    trainer.model.train()
    return out


def worker(job: dict) -> dict:
    """bench_convergence's worker (every variant of one seed in this process, off first, the
    step-0 fingerprints), each run followed by the long-context evaluation; then each run's probe
    records."""
    from mcore_ext.training import loop

    run = loop._Trainer.run

    def run_then_long_context(self):
        finished = run(self)
        if job["long"]:
            _LONG[self.cfg.logging.metrics_file] = _long_context_losses(
                self, job["long"], job["long_rows"])
        return finished

    loop._Trainer.run = run_then_long_context
    try:
        results = convergence.worker(job)
    finally:
        loop._Trainer.run = run
    for variant, result in results.items():
        argv = job["argv"][variant]
        path = next(a for a in argv if a.startswith("logging.metrics_file=")).split("=", 1)[1]
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        probes = [r for r in records if r["kind"] == "probe"]
        result["probe_iterations"] = [r["iteration"] for r in probes]
        for figure in PROBE_FIGURES:
            result[figure] = [r[figure] for r in probes]
        result["probe_time_s"] = [r["time_s"] for r in probes]
        result["step_time_s"] = statistics.median(
            r["step_time_s"] for r in records if r["kind"] == "train")
        last = probes[-1]
        result["last_probe_layers"] = {
            key: {name: figures[name] for name in (
                "first_token_share", "sink_rate", "residual_max", "attn_output_max",
                "first_token_share_per_head", "gate_mean_per_head") if name in figures}
            for key, figures in last["layers"].items()}
        result["long_context"] = _LONG.get(path)
    return results


# -------------------------------------------------------------------------------------- main


def summarise(per_seed: dict, window: int) -> dict:
    """per_seed: {seed: {variant: worker result}} -> per variant: means over seeds."""
    seeds = sorted(per_seed)
    out = {}
    for variant in VARIANTS:
        runs = [per_seed[s][variant] for s in seeds]
        data = {"probe_iterations": runs[0]["probe_iterations"]}
        for figure in PROBE_FIGURES:
            curves = [r[figure] for r in runs]
            data[figure] = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
            data[f"{figure}_per_seed"] = curves
        losses = [convergence.windows(r["losses"], window) for r in runs]
        data["windows"] = [statistics.fmean(c[w] for c in losses) for w in range(len(losses[0]))]
        data["windows_per_seed"] = losses
        data["final_loss"] = statistics.fmean(c[-1] for c in losses)
        data["final_loss_per_seed"] = [c[-1] for c in losses]
        if all(r["long_context"] for r in runs):
            data["long_context"] = {
                factor: dict(
                    loss=statistics.fmean(r["long_context"][factor]["loss"] for r in runs),
                    loss_per_seed=[r["long_context"][factor]["loss"] for r in runs],
                    segments=[statistics.fmean(r["long_context"][factor]["segments"][i]
                                               for r in runs)
                              for i in range(len(runs[0]["long_context"][factor]["segments"]))])
                for factor in runs[0]["long_context"]}
        data["last_probe_layers_per_seed"] = [r["last_probe_layers"] for r in runs]
        data["seconds_per_run"] = statistics.fmean(r["seconds"] for r in runs)
        data["step_time_s"] = statistics.fmean(r["step_time_s"] for r in runs)
        data["probe_time_s"] = statistics.fmean(t for r in runs for t in r["probe_time_s"])
        out[variant] = data
    return out


def table(summary: dict) -> str:
    lines = ["== probe figures, mean over seeds (off = ungated, on_default = gated)",
             f"{'step':>6} " + " ".join(f"{v + ' ' + f:>22}" for f in ("share", "sinks", "max act")
                                        for v in VARIANTS)]
    off = summary["off"]
    for i, step in enumerate(off["probe_iterations"]):
        row = f"{step:>6} "
        for figure in ("first_token_share", "sink_rate", "max_activation"):
            row += " ".join(f"{summary[v][figure][i]:>22.4f}" for v in VARIANTS)
        lines.append(row)
    lines.append("final loss (last window): " + ", ".join(
        f"{v} {summary[v]['final_loss']:.4f} ({', '.join(f'{x:.4f}' for x in summary[v]['final_loss_per_seed'])})"
        for v in VARIANTS))
    if "long_context" in off:
        lines.append("validation loss at 1x / 2x / 4x the training length: " + "; ".join(
            f"{v} " + " / ".join(f"{d['loss']:.4f}" for d in summary[v]["long_context"].values())
            for v in VARIANTS))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, window = result["variants"], result["window"]
    panels = [("first_token_share", "first token's attention share"),
              ("sink_rate", "sink rate (heads above 0.3)"),
              ("max_activation", "largest |activation|, residual stream"),
              ("max_attn_output", "largest |activation|, attention output")]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    colors = {"off": "C0", "on_default": "C1"}
    labels = {"off": "ungated", "on_default": "gated (default init)"}
    for ax, (figure, title) in zip(axes.flat, panels):
        for variant, data in summary.items():
            xs = data["probe_iterations"]
            for curve in data[f"{figure}_per_seed"]:
                ax.plot(xs, curve, color=colors[variant], alpha=0.25, linewidth=0.8)
            ax.plot(xs, data[figure], color=colors[variant], label=labels[variant])
        if figure == "first_token_share" and "uniform_share" in result:
            ax.axhline(result["uniform_share"], color="gray", linestyle="--", linewidth=0.8,
                       label="uniform attention")
        ax.set_title(title)
        ax.set_xlabel("step")
        if figure.startswith("max"):
            ax.set_yscale("log")
        if figure == "sink_rate":
            ax.set_ylim(-0.02, 1.02)
        ax.legend()
    ax = axes.flat[4]
    for variant, data in summary.items():
        xs = [(w + 0.5) * window for w in range(len(data["windows"]))]
        ax.plot(xs, data["windows"], color=colors[variant], label=labels[variant])
    ax.set_title(f"training loss (mean per {window} steps)")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes.flat[5]
    if "long_context" in summary["off"]:
        longest = list(summary["off"]["long_context"])[-1]
        for variant, data in summary.items():
            means = " / ".join(f"{d['loss']:.3f}" for d in data["long_context"].values())
            segments = data["long_context"][longest]["segments"]
            ax.plot(range(1, len(segments) + 1), segments, marker="o", color=colors[variant],
                    label=f"{labels[variant]}: {' / '.join(data['long_context'])}x {means}")
        ax.set_xticks(range(1, len(segments) + 1),
                      [f"{i - 1}-{i} L" for i in range(1, len(segments) + 1)])
        ax.set_title(f"validation loss at {longest}x the training length L (RoPE unchanged),\n"
                     "per position segment; legend: mean loss at each length")
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
    fig.suptitle(f"bench_sinks --preset {result['preset']}: {result['what']}\n"
                 f"{result['seeds']} seeds (thin: each seed); identical at step 0: "
                 f"{result['identical_at_step0']}; {result['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _uniform_share(overrides) -> float:
    """The first token's mean share under uniform causal attention over a sequence of the
    preset's length L: the mean of 1 / (i + 1), H_L / L."""
    length = int(next(o for o in reversed(overrides) if o.startswith("model.seq_length=")
                      ).split("=")[1])
    return sum(1 / (i + 1) for i in range(length)) / length


def cost(args) -> int:
    """The probe on configs/tiny_cpu.yaml as written (TP 2, 2 ranks, torchrun) at an interval of
    100: each probe's time against the same run's mean step time."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_sinks-cost-"))
    prefix = workdir / "data" / "stdlib_byte"
    convergence._prepare_data(str(prefix))
    metrics = workdir / "tiny.jsonl"
    metrics.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={29400 + os.getpid() % 500}",
               str(ROOT / "launch" / "pretrain.py"), "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
               f"training.train_iters={args.cost_iters}", "logging.attention_probe=100",
               f"data.prefix={prefix}", f"data.cache_dir={workdir / 'cache'}",
               "checkpoint.save=null", "checkpoint.load=null", "training.eval_interval=null",
               f"logging.metrics_file={metrics}"]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        return 1
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    probes = [r for r in records if r["kind"] == "probe"]
    # Each log record's step time is its window's mean (log_interval steps); weigh by steps.
    steps = [r["iteration"] - p["iteration"] for p, r in zip([{"iteration": 0}] + train, train)]
    step_time = sum(s * r["step_time_s"] for s, r in zip(steps, train)) / sum(steps)
    later = [p["time_s"] for p in probes if p["iteration"] > 0]  # the first one also warms up
    probe_time = statistics.fmean(later) if later else probes[0]["time_s"]
    result = dict(config="configs/tiny_cpu.yaml (TP 2, 2 ranks)", iters=args.cost_iters,
                  interval=100, step_time_s=step_time, probe_time_s=probe_time,
                  probe_times_s=[p["time_s"] for p in probes],
                  fraction_at_interval_100=probe_time / (100 * step_time),
                  wall_seconds=round(time.perf_counter() - started, 1),
                  environment=convergence._environment("cpu"))
    print(f"probe {probe_time * 1e3:.1f} ms, step {step_time * 1e3:.1f} ms: "
          f"{result['fraction_at_interval_100']:.2%} of training time at an interval of 100 steps")
    convergence.write_outputs(result, args.json, None, None)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--seed-base", type=int, default=1234)
    parser.add_argument("--iters", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--workers", type=int, default=2, help="seeds side by side")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--workdir", default=None, help="metrics and data (default: a temp dir)")
    parser.add_argument("--plot-from", default=None, metavar="JSON",
                        help="only draw --png from a JSON this benchmark wrote")
    parser.add_argument("--cost", action="store_true",
                        help="measure the probe's cost on configs/tiny_cpu.yaml instead")
    parser.add_argument("--cost-iters", type=int, default=300)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        Path(job["out"]).write_text(json.dumps(worker(job)))
        return 0
    if args.plot_from:
        if not args.png:
            parser.error("--plot-from needs --png")
        plot(json.loads(Path(args.plot_from).read_text()), args.png)
        print(f"wrote {args.png}")
        return 0
    if args.cost:
        return cost(args)

    preset = copy.deepcopy(PRESETS[args.preset])
    if args.iters:
        preset["iters"] = args.iters
    seeds = [args.seed_base + i for i in range(args.seeds)]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_sinks-"))
    convergence._prepare_data(str(workdir / "data" / "stdlib_byte"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    started = time.perf_counter()
    pending, running, jobs = [], [], []
    for seed in seeds:
        run_dir = workdir / f"seed{seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        job = dict(condition="sinks", seed=seed, variants=VARIANTS, long=list(preset["long"]),
                   long_rows=preset["long_rows"], out=str(run_dir / "result.json"),
                   argv={v: run_argv(preset, v, seed, str(run_dir)) for v in VARIANTS})
        job_file = run_dir / "job.json"
        job_file.write_text(json.dumps(job))
        Path(job["out"]).unlink(missing_ok=True)
        pending.append((job, job_file, run_dir))
        jobs.append(job)
    failed = []
    while pending or running:
        while pending and len(running) < args.workers:
            job, job_file, run_dir = pending.pop(0)
            log = open(run_dir / "log.txt", "w")
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(job_file)],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, job, run_dir, log))
            print(f"[bench] seed {job['seed']}: {len(VARIANTS)} runs (log {run_dir / 'log.txt'})",
                  flush=True)
        for entry in list(running):
            proc, job, run_dir, log = entry
            if proc.poll() is None:
                continue
            log.close()
            running.remove(entry)
            if proc.returncode != 0:
                failed.append(f"seed {job['seed']}: exit {proc.returncode}, see "
                              f"{run_dir / 'log.txt'}")
        time.sleep(0.5)
    if failed:
        print("error: " + "; ".join(failed), file=sys.stderr)
        return 1

    per_seed = {job["seed"]: json.loads(Path(job["out"]).read_text()) for job in jobs}
    differences = [f"seed {seed}: {d}" for seed, runs in per_seed.items()
                   for d in convergence.identical_at_step0(runs)[1]]
    result = {"preset": args.preset, "what": preset["what"], "seeds": len(seeds),
              "seed_base": args.seed_base, "iters": preset["iters"],
              "probe_interval": preset["probe"], "window": preset["window"],
              "uniform_share": _uniform_share(preset["extra"]),
              "launcher_overrides": run_argv(preset, "on_default", seeds[0], "WORKDIR")[2:],
              "environment": convergence._environment("cpu"),
              "identical_at_step0": not differences, "step0_differences": differences[:5],
              "variants": summarise(per_seed, preset["window"]),
              "wall_seconds": round(time.perf_counter() - started, 1)}
    print(table(result["variants"]))
    print(f"identical at step 0 (every shared weight, every seed): {result['identical_at_step0']}")
    print(f"wall {result['wall_seconds']} s")
    convergence.write_outputs(result, args.json, args.png, plot)
    return 0 if result["identical_at_step0"] else 1


if __name__ == "__main__":
    sys.exit(main())
