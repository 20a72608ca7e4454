#!/usr/bin/env python
"""The GPU check: every GPU test and benchmark in three stages of < 10 minutes, one JSON of figures.

    python benchmarks/gpu_check.py prepare          # here: wheels that must travel -> .gpu_wheels/,
                                                    # then print the device `run` calls
    python benchmarks/gpu_check.py stage N --out D  # on the GPU machine: stage N (1, 2, 3) -> D
    python benchmarks/gpu_check.py collect D...     # here: merge the stages' JSON into
                                                    # benchmarks/results/<date>-<device>.json
    python benchmarks/gpu_check.py dry-run          # every stage here; without CUDA each GPU step
                                                    # is skipped with its reason

``scripts/gpu_check.sh`` wraps it (on the GPU machine it first installs the carried wheels into a
venv over the image's torch). Each stage writes ``gpu_check-stageN.json`` after every step, so a
stage cut short still reports what it measured. A step is ``passed``, ``failed`` (its exit code
and the tail of its output) or ``skipped`` with the reason: no CUDA, too few GPUs, a benchmark or
one of its options missing from this tree (other branches add them), or the stage's time budget
spent. docs/gpu.md says what each step measures.
"""

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHEELS = os.path.join(ROOT, ".gpu_wheels")  # ignored (.gitignore); carried to the device
RESULTS = os.path.join(HERE, "results")
CARRY_LIMIT = 64 * 2**20  # the device's limit on the working tree plus carried paths
STAGE_BUDGET_S = 540  # a stage's work inside one 600 s call, with room to write its JSON
MIN_STEP_S = 30  # a step gets at least this much of the stage's budget, or is skipped

# Packages the tests and the launcher import that the device image lacks or has too old
# (transformers 5.17 there; the tests' Step3p7 model needs >= 5.23); regex: what transformers
# needs at least; emerging-optimizers (and its absl-py): megatron-core's Muon. Versions: this
# checkout's .venv (what CI tests).
TRAVELLING = ("megatron-core", "transformers", "regex", "emerging-optimizers", "absl-py")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass
class Step:
    """One command of a stage. ``{py}``, ``{out}``, ``{work}`` in ``command`` are replaced by the
    interpreter, the stage's output folder (comes back from the device) and a scratch folder."""

    name: str
    stage: int
    what: str
    command: list
    timeout_s: int
    needs_cuda: bool = True
    min_gpus: int = 1
    script: str | None = None  # a benchmark whose options are checked against its --help
    figures: str | None = None  # how to read the figures: junit, bench_gate, bench_json, metrics
    json_name: str | None = None  # the file under {out} / {work} the command writes its figures to
    compare_with: str | None = None  # metrics: the gate-off step this gate-on step is compared to


def _launcher(config, gate, iters, name, extra=(), what=None):
    return Step(
        name=name, stage=3, timeout_s=200, figures="metrics", json_name=f"{name}.jsonl",
        what=f"launcher on {config}, head-wise gate {what or ('on' if gate else 'off')}, {iters} "
             "steps, one GPU: tokens/s, TFLOP/s and MFU (steps after the first)",
        command=["{py}", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                 "launch/pretrain.py", "--config", f"configs/{config}",
                 f"model.head_wise_attn_gate={'true' if gate else 'false'}",
                 f"training.train_iters={iters}", "optimizer.lr_warmup_iters=2",
                 "training.eval_interval=null",
                 "checkpoint.save=null", "checkpoint.load=null", "logging.log_interval=1",
                 f"logging.metrics_file={{work}}/{name}.jsonl", *extra],
        compare_with=re.sub(r"gate-\w+$", "gate-off", name) if gate else None,
    )


def _attention(name, kernel, seq, stage, extra=(), timeout_s=150):
    return Step(
        name=name, stage=stage, timeout_s=timeout_s, script="benchmarks/bench_attention.py",
        figures="bench_json", json_name=f"{name}.json",
        what=f"Step-3.5 attention ({kernel} kernel, window 512) at {seq // 1024}K tokens: step time, "
             "peak memory and which attention ops ran (flash / efficient / math / flex / varlen)",
        command=["{py}", "benchmarks/bench_attention.py", "--no-ref", "--kernel", kernel,
                 "--seq", str(seq), "--hidden", "1024", "--head-dim", "128", "--window", "512",
                 "--rounds", "1", "--steps", "3", *extra, "--json", f"{{work}}/{name}.json"],
    )


def _long_context(name, seqs, stage, controls_up_to, timeout_s=150):
    return Step(
        name=name, stage=stage, timeout_s=timeout_s, script="benchmarks/bench_long_context.py",
        figures="bench_json", json_name=f"{name}.json",
        what=f"a sliding layer's core attention at Step-3.5's shapes (96 heads / 8 groups, head "
             f"dim 128, window 512) at {', '.join(f'{s // 1024}K' for s in seqs)} tokens: banded "
             "sdpa vs a full layer and the dense-mask control (time, peak memory)",
        command=["{py}", "benchmarks/bench_long_context.py", "--seqs", *map(str, seqs),
                 "--window", "512", "--heads", "96", "--groups", "8", "--head-dim", "128",
                 "--controls-up-to", str(controls_up_to), "--rounds", "3",
                 "--json", f"{{work}}/{name}.json"],
    )


STEPS = [
    # ------------------------------------------------------------------------ stage 1: tests
    Step("gpu-tests", 1, "the tests marked gpu (pytest -m gpu): gated layer, layer kinds, KV "
         "cache, recompute, offloading, CP on NCCL, HF import / export, launcher bf16 + async "
         "checkpoints, MoE; without CUDA each is skipped by the test suite with its reason",
         ["{py}", "-m", "pytest", "tests", "-m", "gpu", "-v", "-p", "no:cacheprovider",
          "--ignore=tests/bridge", "--ignore=tests/upstream",
          "--timeout", "300", "--junitxml", "{work}/junit.xml"],
         timeout_s=520, needs_cuda=False, figures="junit"),
    # ---------------------------------------- stage 2: the gate's cost, attention kernels, MoE
    Step("gate-cost", 2, "bench_gate.py --preset gpu: head-wise gate vs none vs megatron's "
         "attention_output_gate, one layer and a 4-layer block (bf16, hidden 4096, 32 heads, "
         "seq 4096, forward + backward), and the ops whose device time differs (torch profiler)",
         ["{py}", "benchmarks/bench_gate.py", "--preset", "gpu", "--profile",
          "--json", "{work}/bench_gate.json"],
         timeout_s=200, script="benchmarks/bench_gate.py", figures="bench_gate",
         json_name="bench_gate.json"),
    *[_attention(f"attention-32k-packed-{k}", k, 32768, 2, extra=("--packed", "8"))
      for k in ("sdpa", "flex", "varlen")],
    *[_attention(f"sliding-32k-{k}", k, 32768, 2, extra=("--layers", "4"))
      for k in ("sdpa", "flex")],
    _long_context("long-context-32k-64k", [32768, 65536], 2, controls_up_to=32768),
    Step("moe-grouped-vs-sequential", 2, "MoE grouped experts vs the sequential loop, 64-288 "
         "experts (a benchmark the MoE work adds; it must take --preset gpu --json PATH)",
         ["{py}", "benchmarks/bench_moe.py", "--preset", "gpu", "--json", "{work}/bench_moe.json"],
         timeout_s=150, script="benchmarks/bench_moe.py", figures="bench_json",
         json_name="bench_moe.json"),
    Step("cp-kernels-4gpu", 2, "bench_cp.py at CP 4 over NCCL, GQA, 32K tokens: activation memory "
         "per rank and which SDPA kernel each CP chunk runs",
         ["{py}", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
          "benchmarks/bench_cp.py", "--seq", "32768", "--hidden", "1024", "--heads", "16",
          "--groups", "2", "--json", "{work}/bench_cp.json"],
         timeout_s=150, min_gpus=4, script="benchmarks/bench_cp.py", figures="bench_json",
         json_name="bench_cp.json"),
    # ---------------------------------------------------------------- stage 3: training speed
    _launcher("gpt_1b.yaml", True, 15, "train-1b-gate-on"),
    _launcher("gpt_1b.yaml", False, 15, "train-1b-gate-off"),
    # The gated 1B run's loss fell more slowly (4.23 vs 3.31 at step 15, two H200 leases), not so
    # on CPUs: the gate held open (sigmoid(30) = 1, its weight rows 0) must track the ungated run.
    _launcher("gpt_1b.yaml", True, 15, "train-1b-gate-open",
              extra=("model.head_wise_attn_gate_init_bias=30",
                     "model.head_wise_attn_gate_init_weight_scale=0"),
              what="held open (bias 30, weight rows 0)"),
    _launcher("gpt_125m.yaml", True, 30, "train-125m-gate-on"),
    _launcher("gpt_125m.yaml", False, 30, "train-125m-gate-off"),
    *[_attention(f"sliding-128k-{k}", k, 131072, 3, extra=("--layers", "4"))
      for k in ("sdpa", "flex")],
    _long_context("long-context-128k", [131072], 3, controls_up_to=0),
    # -------------------------------------------- stage 4: does the gate train as well as none?
    # bench_convergence.py's gpu preset (issue 45): gate off / on from the same weights and data,
    # loss per window and the paired gap to the ungated run, a seed at a time within the step's
    # time ({budget}: what is left of it, less 20 s for the JSON), so a short lease still brings
    # back every seed that finished; its PNG comes back beside the JSON.
    *[Step(f"convergence-{name}", stage, f"bench_convergence.py --preset gpu: {what}, from "
           "identical weights, windowed losses and the gap to the ungated run",
           ["{py}", "benchmarks/bench_convergence.py", "--preset", "gpu", "--conditions",
            conditions, "--seeds", str(seeds), "--variants", variants, "--budget", "{budget}",
            "--workdir", f"{{work}}/convergence-{name}",
            "--json", f"{{work}}/convergence-{name}.json",
            "--png", f"{{out}}/convergence-{name}.png"],
           timeout_s=timeout_s, script="benchmarks/bench_convergence.py", figures="bench_json",
           json_name=f"convergence-{name}.json")
      for name, stage, conditions, seeds, variants, timeout_s, what in (
          # The H200's gap was one seed at 15 steps: seeds first (1b-15: gate off / default /
          # the old surgery default), then 100 steps (off / default), as the budget allows.
          ("1b", 4, "1b-15,1b-100", 3, "off,on_default,on_surgery", 540,
           "1B x 15 steps (off / default / surgery) and x 100 (off / default), up to 3 seeds"),
          ("125m", 5, "125m-300", 2, "off,on_default,on_surgery,open", 300,
           "125M x 300 steps (off / default / surgery / held open), 2 seeds"))],
]
STAGES = sorted({s.stage for s in STEPS})


# ------------------------------------------------------------------------------ the machine


def environment() -> dict:
    """Device, versions and where this ran: the header of every stage's JSON."""
    from importlib import metadata

    import torch

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    on_gpu = torch.cuda.is_available()
    env = dict(
        device=torch.cuda.get_device_name(0) if on_gpu else "cpu",
        gpus=torch.cuda.device_count() if on_gpu else 0,
        cuda=torch.version.cuda if on_gpu else None,
        torch=torch.__version__,
        megatron_core=version("megatron-core"),
        transformers=version("transformers"),
        python=sys.version.split()[0],
        commit=_commit(),
    )
    if on_gpu and shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True)
        env["nvidia_smi"] = query.stdout.strip()
    return env


def _commit() -> str | None:
    """This tree's commit (``-dirty`` with uncommitted changes): from git here, from the wheels'
    manifest on the device (no .git; the manifest is written by ``prepare``)."""
    manifest = os.path.join(WHEELS, "manifest.json")
    if os.environ.get("OUT") and os.path.exists(manifest):  # the device: its .git is not ours
        with open(manifest) as f:
            return json.load(f).get("commit")
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty",
                               "--abbrev=7"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        if os.path.exists(manifest):
            with open(manifest) as f:
                return json.load(f).get("commit")
    return None


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the results file's name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ----------------------------------------------------------------------------------- stages


def run_stage(stage: int, out: str, budget_s: float = STAGE_BUDGET_S,
              only: list | None = None) -> dict:
    """Run the stage's steps in order within ``budget_s``; write ``out/gpu_check-stageN.json``
    after each step. Returns that JSON's content. ``only``: run just these steps of the stage
    (a lease shorter than the three stages' 30 minutes picks the steps that matter most)."""
    steps = [s for s in STEPS if s.stage == stage]
    if only:
        unknown = sorted(set(only) - {s.name for s in steps})
        if unknown:
            raise SystemExit(f"error: --steps: stage {stage} has no step {', '.join(unknown)}; "
                             f"its steps: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in only]
    import torch

    os.makedirs(out, exist_ok=True)
    deadline = time.monotonic() + budget_s
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = dict(stage=stage, date=datetime.date.today().isoformat(), **environment(), steps=[])
    path = os.path.join(out, f"gpu_check-stage{stage}.json")
    log_path = os.path.join(out, f"gpu_check-stage{stage}.log")
    help_cache: dict = {}
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_stage{stage}_") as work, \
            open(log_path, "w") as log:
        for step in steps:
            result = dict(name=step.name, stage=stage, what=step.what,
                          command=" ".join(_fill(step.command, work=work)))
            reason = _skip_reason(step, gpus, deadline, help_cache)
            if reason:
                result.update(status="skipped", reason=reason)
            else:
                result.update(_run_step(step, work, deadline, log, out=out))
            print(f"[gpu_check] stage {stage} {step.name}: {result['status']}"
                  + (f" ({result['reason']})" if result.get("reason") else ""), flush=True)
            report["steps"].append(result)
            _compare_gate(report["steps"])
            _write_json(path, report)
    return report


def _fill(command, work, out=None, budget=None) -> list:
    """The command with its placeholders filled (``{budget}``: seconds, when known)."""
    return [c.replace("{py}", sys.executable).replace("{work}", work).replace("{out}", out or work)
            .replace("{budget}", "{budget}" if budget is None else str(int(budget)))
            for c in command]


def _skip_reason(step: Step, gpus: int, deadline: float, help_cache: dict) -> str | None:
    if step.needs_cuda and gpus == 0:
        return "needs CUDA: torch.cuda.is_available() is False on this machine"
    if gpus and gpus < step.min_gpus:
        return (f"needs {step.min_gpus} GPUs (one NCCL rank per GPU; NCCL refuses two ranks on "
                f"one GPU), this machine has {gpus}")
    if time.monotonic() + MIN_STEP_S > deadline:
        return "the stage's time budget (--budget) is spent"
    if step.script:
        if not os.path.exists(os.path.join(ROOT, step.script)):
            return f"{step.script} does not exist in this tree (yet)"
        options = help_cache.get(step.script)
        if options is None:
            shown = subprocess.run([sys.executable, step.script, "--help"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=120)
            options = help_cache[step.script] = set(re.findall(r"--[a-z0-9][a-z0-9-]*",
                                                               shown.stdout))
        missing = [o for o in step.command if o.startswith("--") and o not in options]
        if missing:
            return f"{step.script} has no {', '.join(missing)} option in this tree (yet)"
    return None


def _run_step(step: Step, work: str, deadline: float, log, out: str | None = None) -> dict:
    timeout = max(1.0, min(step.timeout_s, deadline - time.monotonic()))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    command = _fill(step.command, work=work, out=out, budget=max(1.0, timeout - 20))
    log.write(f"\n===== {step.name}: {' '.join(command)}\n")
    log.flush()
    start = time.monotonic()
    try:
        # Its own process group, so a timeout also ends what it started (torchrun's ranks).
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
            output += f"\n[gpu_check] killed after {timeout:.0f} s"
        code = proc.returncode
    except OSError as err:
        output, code = f"[gpu_check] could not start: {err}", 127
    seconds = round(time.monotonic() - start, 1)
    log.write(output)
    log.flush()
    result = dict(seconds=seconds, exit_code=code)
    figures = None
    try:
        figures = _FIGURES[step.figures](os.path.join(work, step.json_name or "junit.xml")) \
            if step.figures else None
    except (OSError, ValueError, KeyError, ET.ParseError) as err:
        result["figures_error"] = f"{type(err).__name__}: {err}"
        if step.figures == "junit":  # cut short before pytest wrote its XML: its -v lines
            figures = _pytest_lines(output)
    if figures is not None:
        result["figures"] = figures
    timed_out = code in (-9, 137) or "[gpu_check] killed after" in output
    counts = (figures or {}).get("counts", {}) if step.figures == "junit" else {}
    if step.figures == "junit" and figures and set(counts) == {"skipped"}:
        reasons = sorted({t["reason"] for t in figures["tests"].values() if t.get("reason")})
        result.update(status="skipped", reason="every test skipped: " + "; ".join(reasons))
    elif code == 0:
        result["status"] = "passed"
    else:
        result["status"] = "failed"
        result["reason"] = (f"timed out after {timeout:.0f} s" if timed_out
                            else f"exit code {code}")
        result["output_tail"] = output.splitlines()[-40:]
    return result


def _write_json(path: str, content: dict) -> None:
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(content, f, indent=1)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------- figures


def _junit(path) -> dict:
    """pytest's JUnit XML -> per test: passed / failed / skipped (with reason), and counts."""
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        status, reason = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or "").strip()[:500]
        tests[name] = dict(status=status, seconds=float(case.get("time") or 0),
                           **({"reason": reason} if reason else {}))
    counts = {}
    for t in tests.values():
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    return dict(counts=counts, tests=tests)


def _pytest_lines(output: str) -> dict:
    """pytest -v's "tests/x.py::test PASSED" lines -> the figures _junit gives (no reasons)."""
    tests = {}
    for name, outcome in re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", output,
                                    re.MULTILINE):
        tests[name] = dict(status={"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped",
                                   "ERROR": "error"}[outcome])
    counts = {}
    for t in tests.values():
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    return dict(counts=counts, tests=tests, cut_short=True)


def _bench_gate(path) -> dict:
    """Per scope: head-wise and full time / memory ratios against no gate, and issue 27's
    targets (time <= 1.005, memory <= 1.01, head-wise overhead <= 1/10 of full's)."""
    with open(path) as f:
        payload = json.load(f)
    scopes = {}
    for key, rows in payload["results"].items():
        hw, full = rows["head-wise"], rows.get("full")
        figures = dict(
            head_wise_time_ratio=hw["time_ratio"],
            head_wise_time_ratio_paired=hw["time_ratio_paired_median"],
            head_wise_memory_ratio=hw["memory_ratio"],
            none_step_ms=1e3 * rows["none"]["time_s_median"],
        )
        targets = dict(time=hw["time_ratio"] <= 1.005, memory=hw["memory_ratio"] <= 1.01)
        if full:
            figures.update(full_time_ratio=full["time_ratio"], full_memory_ratio=full["memory_ratio"])
            overhead = full["time_ratio"] - 1
            figures["head_wise_over_full_overhead"] = (
                (hw["time_ratio"] - 1) / overhead if overhead > 0 else None)
            targets["tenth_of_full"] = overhead > 0 and hw["time_ratio"] - 1 <= overhead / 10
        scopes[key] = dict(figures, targets_met=targets)
    # The ops whose device time differs most between no gate and the head-wise gate (one layer).
    return dict(device=payload.get("device"), options=payload.get("options"), scopes=scopes,
                profile=payload.get("profile"))


def _bench_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _metrics(path) -> dict:
    """The launcher's metrics (JSON lines): medians over the steps after the first (warm-up), and
    every step's loss (the curve, not only its ends: one seed's last loss says little alone)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    steps = [r for r in train if r["iteration"] > 1]
    if not steps:
        raise ValueError(f"no training step after the first in {path}")

    def median(key):
        values = [r[key] for r in steps if r.get(key) is not None]
        return statistics.median(values) if values else None

    return dict(steps=len(steps), step_time_s=median("step_time_s"),
                tokens_per_s=median("tokens_per_s"), tflops_per_device=median("tflops_per_device"),
                mfu=median("mfu"), peak_memory_gb=max(r["peak_memory_gb"] for r in steps),
                first_loss=records[0].get("loss"), last_loss=steps[-1]["loss"],
                losses=[r.get("loss") for r in train])


_FIGURES = {"junit": _junit, "bench_gate": _bench_gate, "bench_json": _bench_json,
            "metrics": _metrics}


def _compare_gate(results) -> None:
    """A gate-on launcher step with its gate-off partner done: the gate's share of step time."""
    by_name = {r["name"]: r for r in results}
    for step in STEPS:
        on, off = by_name.get(step.name), by_name.get(step.compare_with or "")
        if not (on and off and "figures" in on and "figures" in off):
            continue
        t_on, t_off = on["figures"]["step_time_s"], off["figures"]["step_time_s"]
        on["figures"]["gate_step_time_ratio"] = t_on / t_off
        if on["figures"].get("last_loss") is not None and off["figures"].get("last_loss"):
            on["figures"]["last_loss_minus_gate_off"] = (on["figures"]["last_loss"]
                                                        - off["figures"]["last_loss"])


# ---------------------------------------------------------------------------------- collect


def collect(parts: list, results_dir: str = RESULTS, commit: str | None = None) -> str:
    """Merge stage JSONs (files, or folders holding gpu_check-stage*.json) into
    ``results_dir/<date>-<device>.json``; a step collected again replaces its earlier result, the
    stage's other steps stay. Each step keeps the commit it ran at: ``commit`` (what was carried
    to the device) or the stage's own record (the wheels' manifest: the commit ``prepare`` saw)."""
    files = []
    for part in parts:
        files += sorted(glob.glob(os.path.join(part, "gpu_check-stage*.json"))) \
            if os.path.isdir(part) else [part]
    if not files:
        raise FileNotFoundError(f"no gpu_check-stage*.json in {', '.join(parts)}")
    stages = []
    for name in files:
        with open(name) as f:
            stages.append(json.load(f))
    first = stages[0]
    path = os.path.join(results_dir, f"{first['date']}-{device_slug(first['device'])}.json")
    merged = dict(device=first["device"], date=first["date"], environment={}, steps=[])
    if os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
    for stage in stages:
        if commit:
            stage["commit"] = commit
        merged["environment"][str(stage["stage"])] = {
            k: v for k, v in stage.items() if k not in ("steps", "stage")}
        names = {s["name"] for s in stage["steps"]}
        merged["steps"] = [s for s in merged["steps"] if s["name"] not in names]
        merged["steps"] += [dict(s, commit=stage.get("commit")) for s in stage["steps"]]
    merged["steps"].sort(key=lambda s: ([x.name for x in STEPS].index(s["name"])
                                        if s["name"] in {x.name for x in STEPS} else len(STEPS)))
    merged["summary"] = {status: sum(s["status"] == status for s in merged["steps"])
                         for status in ("passed", "failed", "skipped")}
    os.makedirs(results_dir, exist_ok=True)
    _write_json(path, merged)
    return path


# ---------------------------------------------------------------------------------- prepare


def prepare(wheels: str = WHEELS) -> None:
    """Download the travelling wheels (this checkout's versions, for the device's Python 3.12 on
    x86-64), check that the tree plus wheels fit the carry limit, print the device calls."""
    from importlib import metadata

    os.makedirs(wheels, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in TRAVELLING]
    for old in glob.glob(os.path.join(wheels, "*.whl")):
        os.remove(old)  # one version of each: two would stop the install there
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    *platforms, "-d", wheels, *pins], check=True)
    with open(os.path.join(wheels, "manifest.json"), "w") as f:
        json.dump(dict(pins=pins, commit=_commit()), f, indent=1)
    wheel_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(wheels, "*")))
    tree_bytes = tree_size()
    total = wheel_bytes + tree_bytes
    print(f"[gpu_check] wheels {', '.join(pins)}: {wheel_bytes / 2**20:.1f} MiB in "
          f"{os.path.relpath(wheels, ROOT)}/; working tree {tree_bytes / 2**20:.1f} MiB; "
          f"{total / 2**20:.1f} of {CARRY_LIMIT / 2**20:.0f} MiB")
    if total > CARRY_LIMIT:
        raise SystemExit("error: the tree and the wheels exceed the device's 64 MiB carry limit")
    print(device_calls(os.path.relpath(wheels, ROOT)))


def tree_size() -> int:
    """Bytes of what travels besides carried paths: tracked and untracked, not ignored, files."""
    listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], check=True, capture_output=True).stdout
    paths = [p for p in listed.decode().split("\0") if p]
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in paths
               if os.path.isfile(os.path.join(ROOT, p)))


def device_calls(carry: str = ".gpu_wheels") -> str:
    lines = ["", "Device calls, one per stage (each < 10 min; the machine's start is extra):"]
    for stage in STAGES:
        names = ", ".join(s.name for s in STEPS if s.stage == stage)
        lines.append(f'  run(command="bash scripts/gpu_check.sh stage {stage}", carry=["{carry}"], '
                     f"timeout_s=600)   # {names}")
    lines.append("then after each call, here: bash scripts/gpu_check.sh collect <files_at of that "
                 "call>  (-> benchmarks/results/<date>-<device>.json)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="download the travelling wheels, print the device calls")
    prep.add_argument("--wheels", default=WHEELS)
    stage = sub.add_parser("stage", help="run one stage (on the GPU machine)")
    stage.add_argument("stage", type=int, choices=STAGES)
    stage.add_argument("--out", default=os.environ.get("OUT") or os.path.join(RESULTS, "parts"),
                       help="folder for gpu_check-stageN.json and its log (default: $OUT)")
    stage.add_argument("--budget", type=float, default=STAGE_BUDGET_S, help="seconds for the stage")
    stage.add_argument("--steps", type=lambda v: [n for n in v.split(",") if n],
                       help="comma-separated step names: run only these (default: all)")
    col = sub.add_parser("collect", help="merge stage JSONs into benchmarks/results/")
    col.add_argument("parts", nargs="+", help="stage JSON files or folders holding them")
    col.add_argument("--results", default=RESULTS)
    col.add_argument("--commit", help="the commit the device ran (default: the stage's record, "
                                      "the commit of the last prepare)")
    dry = sub.add_parser("dry-run", help="every stage here, then collect (CPU: GPU steps skipped)")
    dry.add_argument("--results", default=RESULTS)
    dry.add_argument("--budget", type=float, default=STAGE_BUDGET_S)
    sub.add_parser("plan", help="print the stages and their steps")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        prepare(args.wheels)
    elif args.command == "stage":
        run_stage(args.stage, args.out, args.budget, args.steps)
        print(f"[gpu_check] wrote {os.path.join(args.out, f'gpu_check-stage{args.stage}.json')}")
    elif args.command == "collect":
        print(f"[gpu_check] wrote {collect(args.parts, args.results, args.commit)}")
    elif args.command == "dry-run":
        with tempfile.TemporaryDirectory(prefix="gpu_check_parts_") as parts:
            for number in STAGES:
                run_stage(number, parts, args.budget)
            print(f"[gpu_check] wrote {collect([parts], args.results)}")
    else:
        for number in STAGES:
            print(f"stage {number}:")
            for s in (s for s in STEPS if s.stage == number):
                print(f"  {s.name:28} <= {s.timeout_s:3d} s  {s.what}")
        print(device_calls())
    return 0


if __name__ == "__main__":
    sys.exit(main())
