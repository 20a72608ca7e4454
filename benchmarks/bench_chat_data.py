"""Chat fine-tuning data at scale: the store's build time, size, a rank's data memory and its warm
start-up, against the .npz cache it replaced (issue 56).

    python benchmarks/bench_chat_data.py [--conversations 1000000] [--sizes 10000,100000,1000000]
        [--workers 1,2] [--npz-from e048646] [--no-launcher] [--out runs/bench_chat_data]

The script writes its own conversations (no download): ``--conversations`` JSONL lines of one
or two turns, about 100 tokens each with the tiny byte-level ChatML tokenizer of
configs/sft_tiny/tokenizer (the recipe's; seq_length 128 as the recipe), and the first
10,000 / 100,000 of them as files of their own. Each measurement runs in a fresh process:

- build: ``load_chat_file(write_cache=True)`` of the largest file with 1 and 2 workers (wall
  seconds, without the process's imports), the store's size on disk;
- memory and warm start-up, per size: a process that has imported the launcher's data modules
  opens the built store as the launcher does (``load_chat_file`` while validating, megatron's
  ``BlendedMegatronDatasetBuilder`` with ``ChatDataset`` for a 2-step run of 8 rows a step),
  and collates the first micro-batch: its resident memory before and after (VmRSS, and its
  anonymous and file-backed parts), the seconds this took (the second such start: the first
  saves the rows);
- the launcher itself (not with ``--no-launcher``): torchrun, one rank, the recipe at TP 1
  for 2 steps on each file's built store: the rank's peak resident memory;
- the same for the .npz cache of the code at ``--npz-from`` (a git commit before this change,
  extracted with ``git archive``; skipped without git);
- Hugging Face ``datasets.map(num_proc=2)`` over the same file with the same tokenization, if
  ``datasets`` is installed (else said).

Results: a table, and ``<out>/bench_chat_data.json``.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "configs", "sft_tiny", "tokenizer")
RECIPE = os.path.join(ROOT, "configs", "step35_sft_tiny_cpu.yaml")
SEQ = 128
WORDS = ("the", "sum", "of", "two", "numbers", "is", "found", "by", "adding", "them", "one",
         "digit", "at", "a", "time", "carry", "over", "when", "needed", "so")


# --------------------------------------------------------------------------------- the data

def write_conversations(path: str, count: int, seed: int = 0) -> None:
    """``count`` conversations: two turns (or a prompt and completion, one in five), an
    arithmetic question and an answer padded with words, about 100 tokens rendered."""
    import numpy

    rng = numpy.random.default_rng(seed)
    a, b = rng.integers(1, 1000, count), rng.integers(1, 1000, count)
    extra = rng.integers(7, 13, count)
    words = rng.integers(0, len(WORDS), (count, 12))
    kind = rng.integers(0, 5, count)
    with open(path, "w") as f:
        for i in range(count):
            question = f"Add {a[i]} and {b[i]}."
            answer = f"{a[i]} + {b[i]} = {a[i] + b[i]}: " + " ".join(
                WORDS[w] for w in words[i, :extra[i]]) + "."
            if kind[i] == 0:
                record = {"prompt": question, "completion": answer}
            else:
                record = {"messages": [{"role": "user", "content": question},
                                       {"role": "assistant", "content": answer}]}
            f.write(json.dumps(record) + "\n")


def prefix_file(source: str, path: str, count: int) -> None:
    with open(source, "rb") as f, open(path, "wb") as out:
        for _, line in zip(range(count), f):
            out.write(line)


# ------------------------------------------------------------------- phases (fresh processes)

def _status() -> dict:
    """This process's memory (MiB) from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _forkserver_cpu() -> float:
    """CPU seconds of this process's fork server and the workers it forked (they are not this
    process's children, so its rusage does not count them); 0 without one."""
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (ImportError, AttributeError, TypeError, OSError):
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def phase_build(args) -> dict:
    from mcore_ext.data import chat
    from mcore_ext.data.tokenizers import load_tokenizer

    hf = load_tokenizer(TOKENIZER).hf
    start, cpu = time.monotonic(), time.process_time()
    kwargs = {"workers": int(args.build_workers)} if args.build_workers else {}
    source = chat.load_chat_file(args.path, hf, SEQ, "assistant", "truncate",
                                 cache_dir=args.cache, write_cache=True, **kwargs)
    seconds, cpu = time.monotonic() - start, time.process_time() - cpu + _forkserver_cpu()
    store = getattr(source, "store", None)
    if store is not None:
        where, size = store.directory, store.size_bytes()
    else:  # the .npz cache
        (where,) = [os.path.join(args.cache, n) for n in os.listdir(args.cache)
                    if n.endswith(".npz")]
        size = os.path.getsize(where)
    return {"seconds": seconds, "cpu_seconds": cpu, "conversations": len(source),
            "bytes": size, "cache": where,
            "summary": source.summary(SEQ), "peak_rss_mib": _status()["VmHWM"]}


def phase_memory(args) -> dict:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)

    from mcore_ext.data import chat
    from mcore_ext.data.tokenizers import load_tokenizer
    from mcore_ext.training.data import collate_packed

    tokenizer = load_tokenizer(TOKENIZER)
    before = _status()
    start = time.monotonic()
    source = chat.load_chat_file(args.path, tokenizer.hf, SEQ, "assistant", "truncate",
                                 cache_dir=args.cache, write_cache=False, tokenize=False)
    if source is None:
        raise SystemExit(f"no cache of {args.path} in {args.cache}")
    config = chat.ChatDatasetConfig(random_seed=1234, sequence_length=SEQ,
                                    blend=([args.path], None), split="98,2,0",
                                    tokenizer=tokenizer, hf_tokenizer=tokenizer.hf,
                                    path_to_cache=args.cache)
    train, _, _ = BlendedMegatronDatasetBuilder(chat.ChatDataset, [16, 0, 0], lambda: True,
                                                config).build()
    batch = collate_packed([train[0], train[1]])
    seconds = time.monotonic() - start
    after = _status()
    assert batch["tokens"].shape == (1, 2 * SEQ)
    return {"seconds": seconds, "conversations": len(source), "before": before, "after": after,
            "data_rss_mib": after["VmRSS"] - before["VmRSS"],
            "data_anon_mib": after["RssAnon"] - before["RssAnon"],
            "data_file_mib": after["RssFile"] - before["RssFile"]}


def phase_launcher(args) -> dict:
    """torchrun, 1 rank, the recipe at TP 1 for 2 steps on the built store; the peak RSS of the
    processes it started (the rank: the largest)."""
    import resource

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={args.port}", "launch/pretrain.py",
               "--config", RECIPE, "parallelism.tensor_model_parallel_size=1",
               "parallelism.sequence_parallel=false", "training.train_iters=2",
               "training.eval_interval=null", "checkpoint.save=null", "checkpoint.load=null",
               "optimizer.lr_warmup_iters=1", "data.split=98,2,0", f"data.path={args.path}",
               f"data.cache_dir={args.cache}", "logging.log_interval=1",
               f"logging.metrics_file={args.cache}/launcher-metrics.jsonl"]
    start = time.monotonic()
    result = subprocess.run(command, cwd=args.code, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode:
        raise SystemExit(f"launcher failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "peak_rss_mib": peak,
            "tokenized": "tokenized conversations cached in" in result.stdout}


def phase_datasets(args) -> dict:
    """datasets.map(num_proc=2) with the same tokenization (the ids and loss flags)."""
    import datasets

    from mcore_ext.data import chat
    from mcore_ext.data.tokenizers import load_tokenizer

    hf = load_tokenizer(TOKENIZER).hf

    def tokenize(record):
        record = {k: v for k, v in record.items() if v is not None}
        conversation = chat.conversation_of(record, hf, "assistant", "x")
        return {"ids": conversation.ids, "loss": conversation.loss}

    datasets.disable_caching()
    start = time.monotonic()
    table = datasets.load_dataset("json", data_files=args.path, split="train",
                                  cache_dir=args.cache)
    table = table.map(tokenize, num_proc=2, remove_columns=table.column_names)
    return {"seconds": time.monotonic() - start, "conversations": len(table)}


PHASES = {"build": phase_build, "memory": phase_memory, "launcher": phase_launcher,
          "datasets": phase_datasets}


def run_phase(phase: str, code: str, **kwargs) -> dict:
    """``phase`` in a fresh process with the code at ``code`` first on the path."""
    command = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--code", code]
    for key, value in kwargs.items():
        command += [f"--{key}", str(value)]
    path = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=code)
    if result.returncode:
        print(result.stdout[-3000:], result.stderr[-5000:], sep="\n")
        raise SystemExit(f"phase {phase} {kwargs} failed")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out["process_seconds"] = time.monotonic() - start
    return out


# ------------------------------------------------------------------------------------ driver

def baseline_tree(rev: str, out: str):
    """The repository at ``rev`` extracted into ``out``/npz-<rev> (None without git)."""
    folder = os.path.join(out, f"npz-{rev}")
    if os.path.isdir(os.path.join(folder, "mcore_ext")):
        return folder
    os.makedirs(folder, exist_ok=True)
    try:
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"[bench_chat_data] the .npz code at {rev} cannot be extracted ({err}): skipped")
        return None
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=1_000_000)
    parser.add_argument("--sizes", default="10000,100000,1000000",
                        help="the files whose memory and start-up are measured (first N lines)")
    parser.add_argument("--workers", default="1,2", help="the largest file's builds")
    parser.add_argument("--npz-from", default="e048646",
                        help="a commit with the .npz cache (default: the one issue 56 replaced)")
    parser.add_argument("--no-npz", action="store_true", help="skip the .npz cache")
    parser.add_argument("--no-launcher", action="store_true", help="skip the launcher runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_chat_data"))
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    for name in ("path", "cache", "code", "port", "build_workers"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    largest = max(args.conversations, *sizes)
    files = {}
    start = time.monotonic()
    files[largest] = os.path.join(out, f"chat-{largest}.jsonl")
    if not os.path.isfile(files[largest]):
        write_conversations(files[largest], largest)
    for size in sizes:
        files[size] = os.path.join(out, f"chat-{size}.jsonl")
        if not os.path.isfile(files[size]):
            prefix_file(files[largest], files[size], size)
    print(f"[bench_chat_data] {largest} conversations written in "
          f"{time.monotonic() - start:.0f} s ({os.path.getsize(files[largest]) / 2**20:.0f} MiB)",
          flush=True)
    results = {"conversations": largest, "seq_length": SEQ, "file_bytes": {
        str(n): os.path.getsize(p) for n, p in files.items()}, "store": {}, "npz": {}}
    import shutil

    def fresh(name):
        folder = os.path.join(out, name)
        shutil.rmtree(folder, ignore_errors=True)
        return folder

    port = 29600
    codes = [("store", ROOT)]
    if not args.no_npz:
        tree = baseline_tree(args.npz_from, out)
        if tree:
            codes.append(("npz", tree))
    for name, code in codes:
        r = results[name]
        r["code"] = code if name == "store" else args.npz_from
        workers = [int(w) for w in args.workers.split(",")] if name == "store" else [None]
        r["build"] = {}
        for w in workers:
            cache = fresh(f"{name}-build-{w or 1}")
            build = run_phase("build", code, path=files[largest], cache=cache,
                              **({"build_workers": w} if w else {}))
            r["build"][str(w or 1)] = build
            print(f"[bench_chat_data] {name} build of {largest} with {w or 1} worker(s): "
                  f"{build['seconds']:.1f} s ({build['cpu_seconds']:.1f} s of CPU), "
                  f"{build['bytes'] / 2**20:.1f} MiB", flush=True)
        r["memory"], r["launcher"] = {}, {}
        for size in sizes:
            cache = os.path.join(out, f"{name}-{size}")
            if size == largest:
                cache = os.path.join(out, f"{name}-build-{workers[-1] or 1}")
            elif not os.path.isdir(cache):
                run_phase("build", code, path=files[size], cache=cache,
                          **({"build_workers": workers[-1]} if workers[-1] else {}))
            first = run_phase("memory", code, path=files[size], cache=cache)
            warm = run_phase("memory", code, path=files[size], cache=cache) if (
                name == "store") else first
            warm["first_seconds"] = first["seconds"]
            r["memory"][str(size)] = warm
            print(f"[bench_chat_data] {name} {size}: data memory {warm['data_rss_mib']:.1f} MiB "
                  f"(anonymous {warm['data_anon_mib']:.1f}, file {warm['data_file_mib']:.1f}), "
                  f"start-up {warm['seconds']:.2f} s (first {first['seconds']:.2f} s)",
                  flush=True)
            if not args.no_launcher:
                port += 1
                launcher = run_phase("launcher", code, path=files[size], cache=cache, port=port)
                r["launcher"][str(size)] = launcher
                print(f"[bench_chat_data] {name} {size}: launcher peak RSS "
                      f"{launcher['peak_rss_mib']:.0f} MiB ({launcher['seconds']:.0f} s)",
                      flush=True)
    try:
        import datasets  # noqa: F401
        cache = fresh("datasets")
        results["datasets"] = run_phase("datasets", ROOT, path=files[largest], cache=cache)
    except ImportError:
        results["datasets"] = "not installed in this venv: not measured"
    print(f"[bench_chat_data] datasets.map(num_proc=2): {results['datasets']}")
    with open(os.path.join(out, "bench_chat_data.json"), "w") as f:
        json.dump(results, f, indent=1)
    report(results)


def report(results: dict) -> None:
    print(f"\n{results['conversations']} conversations, seq_length {results['seq_length']}")
    for name in ("store", "npz"):
        r = results.get(name)
        if not r:
            continue
        for w, build in r["build"].items():
            print(f"  {name:5s} build, {w} worker(s): {build['seconds']:8.1f} s "
                  f"({build['cpu_seconds']:8.1f} s of CPU)  {build['bytes'] / 2**20:8.1f} MiB on "
                  "disk")
        for size, m in r["memory"].items():
            launcher = r["launcher"].get(size, {}).get("peak_rss_mib")
            print(f"  {name:5s} {int(size):>9,d}: data memory {m['data_rss_mib']:8.1f} MiB "
                  f"(anonymous {m['data_anon_mib']:7.1f})  warm start-up {m['seconds']:7.2f} s"
                  + (f"  launcher peak RSS {launcher:6.0f} MiB" if launcher else ""))


if __name__ == "__main__":
    main()
