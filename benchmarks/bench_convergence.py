"""Does the head-wise gate train as well as no gate? A controlled convergence benchmark.

    python benchmarks/bench_convergence.py --preset cpu --seeds 3 --json out.json [--png out.png]

Each *condition* of a preset (a model shape, precision and schedule) is trained once per *variant*
of the gate and per seed, through the YAML launcher itself (``mcore_ext.training.main``):

- ``off``: no gate (the control);
- ``on_default``: the gate with the launcher's default init (today the reference init: run once
  and reported under both names, ``same_as`` saying so);
- ``on_reference``: the gate as every released implementation starts it (weight rows drawn like
  any QKV row, bias 0: sigmoid ~ 0.5);
- ``on_surgery``: the original head-wise gate's start (weight rows x 0.1, bias 2: sigmoid ~
  0.88), the default until this benchmark measured it;
- ``open``: the gate held open (bias 30, weight rows 0: sigmoid(30) = 1 in fp32 and bf16, and its
  gradient ~ 1e-13): the ungated function, so it must track ``off``;
- ``on_scale_only`` / ``on_bias_only`` (``--variants``): each half of the surgery (weight rows
  x 0.1 with bias 0; weight rows x 1 with bias 2).

What is controlled: for one seed every variant starts from the same weights (every weight the
variants share is compared at step 0, after the launcher builds the model, and the JSON says
``identical_at_step0``) and sees the same batches in the same order (the launcher's data order
depends on the seed alone). Seeds vary both. The losses are averaged per window of steps, over
seeds; the gap of each gated variant to ``off`` is taken per seed (a paired difference), then
its mean and spread (standard deviation and min / max over seeds) per window.

Output: a table per condition, the JSON (``--json``; its top-level ``variants`` is the preset's
first condition, every condition under ``conditions``) and a plot (``--png``, matplotlib).
Runs go two at a time on a CPU (``--workers``), one at a time on a GPU, a seed at a time: every
condition's first seed, then every condition's second. ``--budget S`` (a lent GPU's lease) keeps
to S seconds: a (condition, seed) whose earlier seeds took longer than the time left is not
started, one still running at S is stopped, and the figures are over the seeds that finished
(the JSON's ``complete`` and ``left_out`` say what is missing).
"""

import argparse
import copy
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"

# Gate fields of each variant (launcher overrides). add_qkv_bias is on in every condition, the
# ungated control too, so the bias rows exist for the init to use.
VARIANTS = {
    "off": ["model.head_wise_attn_gate=false"],
    "on_default": ["model.head_wise_attn_gate=true"],
    "on_reference": ["model.head_wise_attn_gate=true",
                     "model.head_wise_attn_gate_init_weight_scale=1.0",
                     "model.head_wise_attn_gate_init_bias=0.0"],
    "on_surgery": ["model.head_wise_attn_gate=true",
                   "model.head_wise_attn_gate_init_weight_scale=0.1",
                   "model.head_wise_attn_gate_init_bias=2.0"],
    "open": ["model.head_wise_attn_gate=true",
             "model.head_wise_attn_gate_init_weight_scale=0.0",
             "model.head_wise_attn_gate_init_bias=30.0"],
    "on_scale_only": ["model.head_wise_attn_gate=true",
                      "model.head_wise_attn_gate_init_weight_scale=0.1",
                      "model.head_wise_attn_gate_init_bias=0.0"],
    "on_bias_only": ["model.head_wise_attn_gate=true",
                     "model.head_wise_attn_gate_init_weight_scale=1.0",
                     "model.head_wise_attn_gate_init_bias=2.0"],
}
DEFAULT_VARIANTS = ["off", "on_default", "on_reference", "on_surgery", "open"]

# The 1B recipe's optimizer (configs/gpt_1b.yaml): lr 3e-4 to 3e-5 cosine, wd 0.1, beta2 0.95,
# clip 1; the short warmup of the H200 runs that showed the gap (2 steps) unless a condition
# says otherwise.
RECIPE = ["optimizer.lr=3.0e-4", "optimizer.min_lr=3.0e-5", "optimizer.lr_decay_style=cosine",
          "optimizer.weight_decay=0.1", "optimizer.adam_beta2=0.95", "optimizer.clip_grad=1.0",
          "optimizer.lr_warmup_iters=2"]

# A narrow but deep GPT on CPU: 16 layers x 64, 4 heads, SwiGLU, RMSNorm, seq 128, 8 x 128
# tokens a step: about 0.1 s a step on one core.
CPU_MODEL = ["model.num_layers=16", "model.hidden_size=64", "model.num_attention_heads=4",
             "model.ffn_hidden_size=256", "model.seq_length=128", "model.swiglu=true",
             "model.normalization=RMSNorm", "model.add_qkv_bias=true",
             "model.attention_backend=sdpa", "model.architecture=gpt",
             "training.micro_batch_size=8", "training.global_batch_size=8"]

PRESETS = {
    "cpu": {
        "what": "16 x 64 GPT, seq 128, 1B recipe (lr 3e-4, warmup 2), 100 steps, fp32 and bf16 "
                "(distributed optimizer)",
        "device": "cpu",
        "window": 10,
        "conditions": {
            "fp32": dict(iters=100, extra=CPU_MODEL + ["training.precision=fp32"]),
            "bf16": dict(iters=100, extra=CPU_MODEL + ["training.precision=bf16",
                                                        "optimizer.use_distributed_optimizer=true"]),
        },
    },
    # The 1B recipe's step size as the narrow model feels it: Adam moves every weight by about
    # lr a step, so a unit's output moves by about lr x its fan-in; the 1B's lr 3e-4 at width
    # 2048 is lr 1e-2 at width 64 (muP's 1 / width scaling of Adam's lr for hidden weights).
    # With the 1B's warmup of 2 steps and a longer one (20).
    "cpu-width-scaled": {
        "what": "the cpu preset's model in fp32 at lr 1e-2 (the 1B's 3e-4 x 2048 / 64), warmup 2, "
                "100 steps; and each with one change: warmup 20, bf16, 4 layers, micro-batch 4 x 2",
        "device": "cpu",
        "window": 10,
        # One factor changed at a time from lr1e-2-warmup2 (--conditions picks some).
        "conditions": {
            f"lr1e-2-{name}": dict(iters=100, extra=CPU_MODEL + [
                "training.precision=fp32", "optimizer.lr=1.0e-2", "optimizer.min_lr=1.0e-3",
                "optimizer.lr_warmup_iters=2", *change])
            for name, change in (
                ("warmup2", []),
                ("warmup20", ["optimizer.lr_warmup_iters=20"]),
                ("bf16", ["training.precision=bf16", "optimizer.use_distributed_optimizer=true"]),
                ("depth4", ["model.num_layers=4"]),
                ("micro4x2", ["training.micro_batch_size=4"]),
            )
        },
    },
    # configs/gpt_1b.yaml's model itself (16 x 2048, 16 heads, SwiGLU 8192: every weight shape
    # and so every Adam step size as on the H200) at the H200 runs' recipe (lr 3e-4, warmup 2, 15
    # steps), in fp32 on a CPU: 2 x 256 tokens a step, not 16 x 4096 (a step of the 1B takes
    # ~30 s at this size on 2 cores). One run at a time on every core: fp32 weights, gradients and
    # Adam's two moments of 1.07B parameters are 17 GB (20 GB peak measured).
    "cpu-1b-shape": {
        "what": "configs/gpt_1b.yaml's 16 x 2048 model in fp32, seq 256, 2 sequences a step, "
                "lr 3e-4, 15 steps; warmup 2 (the H200 runs') and 10",
        "device": "cpu",
        "workers": 1,
        "threads": os.cpu_count() or 1,
        "window": 3,
        "conditions": {
            f"warmup{warmup}": dict(iters=15, config="gpt_1b.yaml", extra=[
                "model.seq_length=256", "model.attention_backend=sdpa",
                "training.precision=fp32", "optimizer.use_distributed_optimizer=false",
                "training.micro_batch_size=2", "training.global_batch_size=2",
                f"optimizer.lr_warmup_iters={warmup}"],
                variants=["off", "on_default", "on_surgery"])
            for warmup in (2, 10)
        },
    },
    # A few steps, for the benchmark's own test.
    "smoke": {
        "what": "4 x 32 GPT, 6 steps (the benchmark's test)",
        "device": "cpu",
        "window": 3,
        "conditions": {
            "fp32": dict(iters=6, extra=CPU_MODEL + ["model.num_layers=4", "model.hidden_size=32",
                                                     "model.ffn_hidden_size=64",
                                                     "model.seq_length=32",
                                                     "training.precision=fp32"]),
        },
    },
    # GPU (one device, bf16, distributed optimizer, warmup 2 as the H200 runs that showed the
    # gap): configs/gpt_1b.yaml for 15 steps (every variant) and 100 (gate off and on), and
    # configs/gpt_125m.yaml for 300. Each condition is also a --conditions choice on its own;
    # scripts/gpu_check.sh runs them as two steps of stage 4.
    "gpu": {
        "what": "1B x 15 steps (every variant), 1B x 100 (off, on_default), 125M x 300 (bf16, "
                "distributed optimizer, warmup 2)",
        # scripts/gpu_check.sh stage 4 runs 1b-15 and 1b-100 under one --budget, a seed at a
        # time (about 80 s a 1b-15 seed and 250 s a 1b-100 seed on an H200: 1.13 s a step).
        "device": "cuda",
        "window": 5,
        "conditions": {
            "1b-15": dict(iters=15, config="gpt_1b.yaml", extra=[]),
            "1b-100": dict(iters=100, config="gpt_1b.yaml", extra=[],
                           variants=["off", "on_default"]),
            "125m-300": dict(iters=300, config="gpt_125m.yaml", extra=[
                "training.global_batch_size=16", "training.micro_batch_size=8"]),
        },
    },
}


def run_argv(condition: dict, variant: str, seed: int, workdir: str) -> list[str]:
    """The launcher's argv for one run (no checkpoints, no evaluation, every step logged)."""
    config = ROOT / "configs" / condition.get("config", "tiny_cpu.yaml")
    return [
        "--config", str(config),
        "parallelism.tensor_model_parallel_size=1", "parallelism.pipeline_model_parallel_size=1",
        f"training.train_iters={condition['iters']}", f"training.seed={seed}",
        "training.eval_interval=null", "checkpoint.save=null", "checkpoint.load=null",
        "logging.log_interval=1", f"logging.metrics_file={workdir}/{variant}-{seed}.jsonl",
        "data.source=stdlib", f"data.prefix={workdir}/../data/stdlib_byte",
        f"data.cache_dir={workdir}/cache", "data.tokenizer=byte", "data.num_workers=0",
        *RECIPE, *condition["extra"], *VARIANTS[variant],
        *(["logging.gate_statistics=true"] if variant != "off" else []),
    ]


# ------------------------------------------------------------------------------------ worker


def _shared_fingerprint(model, reference_shapes: dict | None) -> dict:
    """sha256 of each parameter as the launcher built it; a gated linear_qkv's leading rows only
    (those the ungated model has: ``reference_shapes``), so the gate rows are left out."""
    from megatron.core.utils import unwrap_model

    out = {}
    for name, param in unwrap_model(model).named_parameters():
        tensor = param.detach().cpu()
        if reference_shapes is not None and name in reference_shapes:
            rows = reference_shapes[name][0]
            tensor = tensor[:rows]
        out[name] = (list(tensor.shape),
                     hashlib.sha256(tensor.contiguous().view(-1).view(dtype=_u8()).numpy())
                     .hexdigest())
    return out


def _u8():
    import torch

    return torch.uint8


def worker(job: dict) -> dict:
    """Every variant of one (condition, seed), in this process, ``off`` first: losses per step
    and the step-0 fingerprint of the weights each run starts from."""
    from mcore_ext.training import loop, main

    build = loop.build_model
    results, reference = {}, {}

    for variant in job["variants"]:
        seen = {}

        def capturing(cfg, vocab_size, _seen=seen):
            model = build(cfg, vocab_size)
            shapes = reference.get("shapes")
            _seen["fingerprint"] = _shared_fingerprint(model, shapes)
            if shapes is None:
                reference["shapes"] = {n: s for n, (s, _) in _seen["fingerprint"].items()}
            return model

        loop.build_model = capturing
        argv = job["argv"][variant]
        start = time.perf_counter()
        try:
            code = main(argv)
        finally:
            loop.build_model = build
        if code != 0:
            raise SystemExit(f"{variant} seed {job['seed']}: the launcher exited {code}")
        metrics = argv[argv.index(next(a for a in argv if a.startswith("logging.metrics_file=")))]
        path = metrics.split("=", 1)[1]
        losses, gates = {}, {}
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "train":
                losses[record["iteration"]] = record["loss"]
                if "gate_mean" in record:
                    gates[record["iteration"]] = (record["gate_mean"], record["gate_closed"])
        results[variant] = dict(losses=[losses[i] for i in sorted(losses)],
                                gate_mean=[gates[i][0] for i in sorted(gates)],
                                gate_closed=[gates[i][1] for i in sorted(gates)],
                                fingerprint=seen["fingerprint"],
                                seconds=time.perf_counter() - start)
        gc.collect()  # the last run's model and optimizer, before the next one is built
    return results


# -------------------------------------------------------------------------------------- main


def identical_at_step0(per_variant: dict) -> tuple[bool, list[str]]:
    """Whether every variant's shared weights equal the control's (``off``, else the first)."""
    names = list(per_variant)
    control = per_variant["off" if "off" in per_variant else names[0]]["fingerprint"]
    differences = []
    for variant in names:
        print_ = per_variant[variant]["fingerprint"]
        for name, value in control.items():
            if print_.get(name) != value:
                differences.append(f"{variant}: {name}")
    return not differences, differences


def windows(losses: list[float], size: int) -> list[float]:
    return [statistics.fmean(losses[i:i + size]) for i in range(0, len(losses), size)]


def summarise(per_seed: dict, variants: list[str], window: int) -> dict:
    """per_seed: {seed: {variant: {"losses": [...]}}} -> windowed means, paired gaps to off."""
    out = {"variants": {}, "gaps": {}}
    seeds = sorted(per_seed)
    for variant in variants:
        curves = [windows(per_seed[s][variant]["losses"], window) for s in seeds]
        out["variants"][variant] = {
            "windows": [statistics.fmean(c[w] for c in curves) for w in range(len(curves[0]))],
            "per_seed": curves,
            "final_loss": statistics.fmean(per_seed[s][variant]["losses"][-1] for s in seeds),
        }
        for key in ("gate_mean", "gate_closed"):  # the launcher's logging.gate_statistics
            gates = [windows(per_seed[s][variant].get(key, []), window) for s in seeds]
            if all(gates):
                out["variants"][variant][key] = [statistics.fmean(g[w] for g in gates)
                                                 for w in range(len(gates[0]))]
    if "off" in variants:
        base = out["variants"]["off"]["per_seed"]
        for variant in variants:
            if variant == "off":
                continue
            diffs = [[a - b for a, b in zip(curve, control)]
                     for curve, control in zip(out["variants"][variant]["per_seed"], base)]
            columns = list(zip(*diffs))
            out["gaps"][variant] = {
                "mean": [statistics.fmean(c) for c in columns],
                "std": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns],
                "min": [min(c) for c in columns],
                "max": [max(c) for c in columns],
            }
    return out


def table(name: str, summary: dict, window: int) -> str:
    variants = [v for v in summary["variants"] if "same_as" not in summary["variants"][v]]
    n = len(summary["variants"][variants[0]]["windows"])
    seeds = summary.get("seeds")
    over = f"seeds {', '.join(str(s) for s in seeds)}" if seeds else "seeds"
    lines = [f"== {name}: mean loss per {window}-step window over {over}; gap = variant - off "
             "(mean +- std over seeds)" + "".join(
                 f"; {v} is {d['same_as']}" for v, d in summary["variants"].items()
                 if "same_as" in d)]
    head = f"{'steps':>9} " + " ".join(f"{v:>13}" for v in variants)
    gaps = {v: g for v, g in summary["gaps"].items() if "same_as" not in g}
    head += "".join(f" {'gap ' + v:>22}" for v in gaps)
    lines.append(head)
    for w in range(n):
        row = f"{w * window + 1:>4}-{(w + 1) * window:<4} "
        row += " ".join(f"{summary['variants'][v]['windows'][w]:>13.4f}" for v in variants)
        for v, gap in gaps.items():
            row += f" {gap['mean'][w]:>+11.4f} +- {gap['std'][w]:<7.4f}"
        lines.append(row)
    gated = [v for v in variants if "gate_mean" in summary["variants"][v]]
    if gated:
        lines.append("gate mean / closed fraction (< 0.1) per window: " + "; ".join(
            f"{v} " + " ".join(f"{m:.2f}/{c:.2f}" for m, c in zip(
                summary["variants"][v]["gate_mean"], summary["variants"][v]["gate_closed"]))
            for v in gated))
    return "\n".join(lines)


def plot_titles(name: str, summary: dict, asked: int) -> tuple[str, str]:
    """A condition's two plot titles, naming the seeds that finished (a --budget run may finish
    fewer than the ``asked`` ones). A JSON written before the summary kept its seeds: the
    number of per-seed curves."""
    seeds = summary.get("seeds")
    count = len(seeds) if seeds is not None else len(
        next(iter(summary["variants"].values()))["per_seed"])
    over = f"{count} of {asked} seeds" if count < asked else f"{count} seed{'s' * (count != 1)}"
    named = f" ({', '.join(str(s) for s in seeds)})" if seeds else ""
    return (f"{name}: loss (mean over {over}{named}, band min-max)",
            f"{name}: variant - off per window (+- std over {over})")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conditions = result["conditions"]
    window = result["window"]
    fig, axes = plt.subplots(2, len(conditions), figsize=(6 * len(conditions), 8), squeeze=False)
    for col, (name, summary) in enumerate(conditions.items()):
        top, bottom = axes[0][col], axes[1][col]
        for variant, data in summary["variants"].items():
            if "same_as" in data:
                continue
            xs = [(w + 0.5) * window for w in range(len(data["windows"]))]
            lows = [min(c[w] for c in data["per_seed"]) for w in range(len(xs))]
            highs = [max(c[w] for c in data["per_seed"]) for w in range(len(xs))]
            color = _color(variant)
            top.plot(xs, data["windows"], label=variant, color=color)
            top.fill_between(xs, lows, highs, color=color, alpha=0.15)
        top_title, bottom_title = plot_titles(name, summary, result["seeds"])
        top.set_title(top_title)
        top.set_xlabel("step")
        top.set_ylabel("training loss")
        top.legend(title=" ".join(f"{v} = {d['same_as']}" for v, d in summary["variants"].items()
                                  if "same_as" in d) or None)
        for variant, gap in summary["gaps"].items():
            if "same_as" in gap:
                continue
            xs = [(w + 0.5) * window for w in range(len(gap["mean"]))]
            bottom.errorbar(xs, gap["mean"], yerr=gap["std"], label=variant, capsize=2,
                            color=_color(variant))
        bottom.axhline(0.0, color="black", linewidth=0.8)
        bottom.set_title(bottom_title)
        bottom.set_xlabel("step")
        bottom.set_ylabel("loss gap to the ungated run")
        bottom.legend()
    fig.suptitle(f"bench_convergence --preset {result['preset']}\n(identical at step 0: "
                 f"{result['identical_at_step0']}; {result['environment']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _default_alias() -> str | None:
    """The variant whose init fields are the launcher's defaults (its runs are on_default's)."""
    from mcore_ext.run_config.schema import ModelConfig

    defaults = ModelConfig()
    for name in ("on_reference", "on_surgery"):
        fields = dict(o.split("=", 1) for o in VARIANTS[name][1:])
        if all(float(getattr(defaults, k.split(".", 1)[1])) == float(v) for k, v in fields.items()):
            return name
    return None


def _color(variant: str) -> str:
    """One colour per variant in every panel (matplotlib's tab10, in VARIANTS' order)."""
    return f"C{list(VARIANTS).index(variant) % 10}"


def _environment(device: str) -> dict:
    import platform

    import torch

    env = {"device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)" if device == "cpu"
           else device,
           "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return env


def _prepare_data(prefix: str) -> None:
    """The stdlib byte dataset, once, before runs start side by side (each would build it)."""
    if os.path.isfile(prefix + ".idx"):
        return
    from mcore_ext.data.preprocess import preprocess, stdlib_sources

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    preprocess(stdlib_sources(), prefix, "byte")


def _tail(path: Path, lines: int = 30) -> str:
    """The end of a run's log, for an error whose work folder is removed at exit."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def write_outputs(result: dict, json_path, png_path, plot) -> None:
    """``result`` as JSON to ``json_path`` and drawn by ``plot`` to ``png_path`` (each if given;
    without matplotlib the plot is skipped with a note): bench_convergence's and bench_sinks'."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {json_path}")
    if png_path:
        try:
            plot(result, png_path)
            print(f"wrote {png_path}")
        except ImportError:
            print("note: no plot: matplotlib is not installed (pip install matplotlib)",
                  file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-base", type=int, default=1234)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (off is always run)")
    parser.add_argument("--conditions", default=None,
                        help="comma-separated subset of the preset's conditions")
    parser.add_argument("--iters", type=int, default=None, help="override every condition's steps")
    parser.add_argument("--workers", type=int, default=None,
                        help="runs side by side (default: 2 on a CPU, 1 on a GPU)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--workdir", default=None,
                        help="metrics and data, kept (default: a temporary folder, removed at "
                             "exit)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the results of runs in --workdir whose job (condition, seed, "
                             "variants, launcher arguments) is this one's, from an earlier or "
                             "interrupted invocation of the same code; run only the others")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="stop within SECONDS: a seed whose earlier seeds of its condition "
                             "took longer than the time left is not started, a run still going "
                             "at SECONDS is stopped; the figures are over the seeds that finished")
    parser.add_argument("--plot-from", default=None, metavar="JSON",
                        help="only draw --png from a JSON this benchmark wrote (e.g. on a GPU "
                             "machine without matplotlib)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.plot_from:
        if not args.png:
            parser.error("--plot-from needs --png")
        plot(json.loads(Path(args.plot_from).read_text()), args.png)
        print(f"wrote {args.png}")
        return 0

    if args.worker:  # one (condition, seed): every variant, in this process
        job = json.loads(Path(args.worker).read_text())
        Path(job["out"]).write_text(json.dumps(worker(job)))
        return 0

    preset = copy.deepcopy(PRESETS[args.preset])
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    variants = ["off"] + [v for v in variants if v != "off"]
    alias = _default_alias()
    if alias in variants and "on_default" in variants:
        variants.remove("on_default")  # the same runs: reported under both names below
    else:
        alias = None
    conditions = preset["conditions"]
    if args.conditions:
        chosen = [c.strip() for c in args.conditions.split(",")]
        missing = [c for c in chosen if c not in conditions]
        if missing:
            parser.error(f"--conditions: {missing} not in preset {args.preset}: {list(conditions)}")
        conditions = {c: conditions[c] for c in chosen}
    if args.iters:
        for condition in conditions.values():
            condition["iters"] = args.iters
    if preset["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --preset gpu needs CUDA", file=sys.stderr)
            return 2
    workers = args.workers or preset.get("workers", 2 if preset["device"] == "cpu" else 1)
    seeds = [args.seed_base + i for i in range(args.seeds)]

    # A folder of our own (no --workdir) goes at exit, whatever ends the run: the prepared data,
    # metrics and logs are this invocation's alone (12 MB for the cpu preset at 2 seeds).
    owned = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convergence-"))
    running = []  # (process, job, run_dir, log, started) of the runs going
    try:
        return _run(args, preset, variants, alias, conditions, workers, seeds, workdir, owned,
                    running)
    finally:
        for proc, _job, _run_dir, log, _started in running:  # an error or Ctrl-C: end them first
            proc.kill()
            proc.wait()
            log.close()
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args, preset, variants, alias, conditions, workers, seeds, workdir, owned,
         running) -> int:
    """Every (condition, seed) job in ``workdir``; ``running`` holds the runs going."""
    _prepare_data(str(workdir / "data" / "stdlib_byte"))
    jobs, pending, reused = [], [], []
    took = {}  # condition -> seconds each of its seeds took (run here, or reused: its runs' sum)
    for condition in conditions.values():
        wanted = [alias if alias and v == "on_default" else v
                  for v in condition.get("variants", variants)]
        condition["variants"] = [v for v in variants if v in wanted]
    # A seed at a time: a budget that runs out leaves every condition with its first seeds.
    for seed in seeds:
        for name, condition in conditions.items():
            run_dir = workdir / f"{name}-seed{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            job = dict(condition=name, seed=seed, variants=condition["variants"],
                       out=str(run_dir / "result.json"),
                       argv={v: run_argv(condition, v, seed, str(run_dir))
                             for v in condition["variants"]})
            job_file = run_dir / "job.json"
            if (args.reuse and Path(job["out"]).is_file() and job_file.is_file()
                    and json.loads(job_file.read_text()) == job):
                reused.append(f"{name} seed {seed}")
                took.setdefault(name, []).append(sum(
                    run["seconds"] for run in json.loads(Path(job["out"]).read_text()).values()))
            else:
                Path(job["out"]).unlink(missing_ok=True)  # an earlier invocation's, not this job's
                job_file.write_text(json.dumps(job))
                pending.append((job, job_file, run_dir))
            jobs.append((job, job_file, run_dir))
    if reused:
        print(f"[bench] reused from {workdir}: {', '.join(reused)}", flush=True)

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if preset["device"] == "cpu":
        # Runs side by side, one core each (a preset whose runs need the machine says so).
        env["OMP_NUM_THREADS"] = str(preset.get("threads", 1))
    started = time.perf_counter()
    deadline = started + args.budget if args.budget is not None else None
    failed, left_out = [], []
    while pending or running:
        now = time.perf_counter()
        if deadline is not None and now >= deadline:
            for proc, job, _, log, _ in running:
                proc.kill()
                proc.wait()
                log.close()
                left_out.append(f"{job['condition']} seed {job['seed']}: stopped at the budget "
                                f"({args.budget:.0f} s)")
            left_out += [f"{job['condition']} seed {job['seed']}: not started (budget spent)"
                         for job, _, _ in pending]
            running.clear()
            pending.clear()
            break
        while pending and len(running) < workers:
            job, job_file, run_dir = pending.pop(0)
            expected = statistics.fmean(took[job["condition"]]) if job["condition"] in took \
                else None
            if deadline is not None and expected is not None and now + expected > deadline:
                left_out.append(f"{job['condition']} seed {job['seed']}: not started (its "
                                f"condition's seeds took {expected:.0f} s, {deadline - now:.0f} s "
                                "of the budget left)")
                continue
            log = open(run_dir / "log.txt", "w")
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(job_file)],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, job, run_dir, log, now))
            print(f"[bench] {job['condition']} seed {job['seed']}: {len(job['variants'])} runs "
                  f"(log {run_dir / 'log.txt'})", flush=True)
        for entry in list(running):
            proc, job, run_dir, log, launched = entry
            if proc.poll() is None:
                continue
            log.close()
            running.remove(entry)
            if proc.returncode != 0:
                failed.append(f"{job['condition']} seed {job['seed']}: exit {proc.returncode}, "
                              + (f"its log's end:\n{_tail(run_dir / 'log.txt')}" if owned
                                 else f"see {run_dir / 'log.txt'}"))
            else:
                took.setdefault(job["condition"], []).append(time.perf_counter() - launched)
        time.sleep(0.5)
    if failed:
        print("error: " + "; ".join(failed), file=sys.stderr)
        return 1

    if left_out:
        print("[bench] left out: " + "; ".join(left_out), flush=True)
    result = {"preset": args.preset, "what": preset["what"], "seeds": len(seeds),
              "seed_base": args.seed_base, "window": preset["window"],
              "environment": _environment(preset["device"]), "conditions": {},
              "identical_at_step0": True, "step0_differences": [], "reused": reused,
              "budget_s": args.budget, "complete": not left_out, "left_out": left_out,
              "wall_seconds": round(time.perf_counter() - started, 1)}
    for name in conditions:
        per_seed = {}
        for job, _, _ in jobs:
            if job["condition"] == name and Path(job["out"]).is_file():
                per_seed[job["seed"]] = json.loads(Path(job["out"]).read_text())
                same, differences = identical_at_step0(per_seed[job["seed"]])
                if not same:
                    result["identical_at_step0"] = False
                    result["step0_differences"] += [f"{name} seed {job['seed']}: {d}"
                                                    for d in differences[:5]]
        if not per_seed:  # every seed of it left out (--budget)
            continue
        summary = summarise(per_seed, conditions[name]["variants"], preset["window"])
        summary["seeds"] = sorted(per_seed)
        if alias:
            summary["variants"]["on_default"] = dict(summary["variants"][alias], same_as=alias)
            if alias in summary["gaps"]:
                summary["gaps"]["on_default"] = dict(summary["gaps"][alias], same_as=alias)
        summary["iters"] = conditions[name]["iters"]
        summary["seconds_per_run"] = statistics.fmean(
            r[v]["seconds"] for r in per_seed.values() for v in conditions[name]["variants"])
        result["conditions"][name] = summary
        print(table(name, summary, preset["window"]))
    if not result["conditions"]:
        result["variants"] = {}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"error: no run finished within --budget {args.budget:.0f} s", file=sys.stderr)
        return 1
    first = next(iter(result["conditions"]))
    result["variants"] = result["conditions"][first]["variants"]
    print(f"identical at step 0 (every shared weight, every seed): {result['identical_at_step0']}"
          + (f" ({'; '.join(result['step0_differences'])})" if result["step0_differences"] else ""))
    print(f"wall {result['wall_seconds']} s")
    write_outputs(result, args.json, args.png, plot)
    return 0 if result["identical_at_step0"] else 1


if __name__ == "__main__":
    sys.exit(main())
