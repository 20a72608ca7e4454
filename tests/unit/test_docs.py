"""The commands and links of README.md and docs/*.md.

Every fenced code block declares its language. Every command of a shell block (one logical line:
``\\`` continuations joined, comments dropped) has a decision in ``DECISIONS``, keyed by its words:

- ``Run``: run here through bash from the repository root with the venv first on PATH (as after
  ``source .venv/bin/activate``), as written or at tiny size (``tiny``);
- ``Check``: a launcher command, validated with ``--check`` at its torchrun world size (one
  process for all of them: importing megatron once);
- ``Covered``: the named test of the suite runs this command (or the same entry with the same
  arguments at tiny size);
- ``Skip``: not run, for the stated reason (a GPU, a downloaded checkpoint, the network, an opt-in
  environment).

A command without a decision fails, naming its page and line; so does a decision that no page
uses any more, a ``Covered`` test that does not exist, and a link to a missing file or heading.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
NOT_COMMANDS = {"python", "yaml", "text", "json", "toml"}


@dataclass(frozen=True)
class Run:
    tiny: Optional[str] = None  # the command at tiny size ({tmp}: a fresh directory); None: as written
    expect: Optional[str] = None  # text its output must contain


@dataclass(frozen=True)
class Check:
    on_cpu: tuple = ()  # overrides for what only a GPU runs (the rest of the config is checked)


@dataclass(frozen=True)
class Covered:
    test: str  # tests/path.py::test_name


@dataclass(frozen=True)
class Skip:
    reason: str


FINE_TUNE = "tests/functional/test_faults.py::test_finetune_relaunch_resumes_the_runs_own_checkpoint"
HF_ROUND_TRIP = ("tests/hf/test_hf_sft.py::"
                 "test_imported_step35_fine_tunes_on_chat_data_and_exports_what_transformers_decodes")
VL_README = ("tests/hf/test_hf_step37_sft.py::"
             "test_imported_release_fine_tunes_on_images_at_tp2_sp_with_the_tower_frozen")
READY_MEGATRON_LM = ("tests/functional/test_ready_commands.py::"
                     "test_pretrain_megatron_lm_script_trains_and_saves")
SUITE = "the test suite itself: CI's .ci/run runs `bash scripts/test.sh`, this test included"
UPSTREAM = ("opt-in suite: clones Megatron-LM (network) and builds a second environment "
            "(docs/testing.md); not in CI")
BRIDGE = ("installs Megatron-Bridge into its own .venv-bridge (network) and runs its suite, "
          "tests/bridge (docs/testing.md)")

BENCHMARK = ("a benchmark (minutes of CPU, or a GPU's shapes): its method and measured figures are "
             "in benchmarks/README.md")

DECISIONS = {
    "python benchmarks/bench_convergence.py --preset cpu --seeds 3 --json out.json --png out.png":
        Covered("tests/functional/test_convergence_bench.py::"
                "test_convergence_benchmark_runs_variants_from_identical_weights"),
    "python benchmarks/bench_sinks.py --preset cpu --seeds 2 --json out.json --png out.png":
        Covered("tests/functional/test_sinks_bench.py::"
                "test_sinks_benchmark_measures_both_variants_from_identical_weights"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "logging.attention_probe=100": Check(),
    # README: the two commands and the venv
    "bash scripts/pretrain.sh": Run(
        tiny="RUN_DIR={tmp}/run bash scripts/pretrain.sh training.train_iters=2 "
             "optimizer.lr_warmup_iters=1 training.eval_interval=null logging.log_interval=1",
        expect="[pretrain.sh] run dir:"),
    "bash scripts/test.sh": Skip(SUITE),
    "source .venv/bin/activate": Run(
        tiny="source .venv/bin/activate && python -c 'import sys; assert sys.version_info >= (3, 12)'"),
    # the launcher
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "training.train_iters=200": Check(),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml": Check(),
    "python launch/pretrain.py --config configs/gpt_125m.yaml --check --world-size 8": Check(),
    "python launch/pretrain.py --config configs/tiny_cpu.yaml training.train_iters=20 --check "
    "--world-size 2": Check(),
    "bash scripts/pretrain.sh training.train_iters=200 optimizer.lr=1e-3": Check(),
    "sbatch --nodes=2 --gpus-per-node=8 --time=24:00:00 launch/slurm/pretrain.sbatch --config "
    "configs/gpt_125m.yaml": Covered(
        "tests/functional/test_slurm.py::"
        "test_a_job_preempted_as_it_starts_and_mid_run_resumes_and_completes"),
    "RUN_DIR=runs/my_run bash scripts/pretrain.sh": Covered(
        "tests/functional/test_pretrain.py::test_resume_reaches_the_same_losses"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "checkpoint.load=runs/pretrained/checkpoints checkpoint.finetune=true "
    "checkpoint.save=runs/ft": Covered(FINE_TUNE),
    "python -m mcore_ext.data.preprocess --chat data/sft.jsonl --tokenizer "
    "configs/sft_tiny/tokenizer --seq-length 128 --cache-dir runs/data/cache --workers 8": Covered(
        "tests/unit/test_chat_cache.py::"
        "test_the_preprocess_command_builds_the_store_a_run_then_reads"),
    "python -m mcore_ext.data.preprocess --input a.jsonl b.txt --output-prefix data/mytext": Covered(
        "tests/functional/test_pretrain.py::test_preprocess_jsonl_and_text"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "optimizer.type=muon": Covered(
        "tests/functional/test_muon_pretrain.py::test_muon_run_trains_and_resumes_exactly"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "model.architecture=hybrid": Covered(
        "tests/functional/test_hybrid_pretrain.py::test_hybrid_run_trains_and_resumes_exactly"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "model.architecture=hybrid checkpoint.load=runs/tiny_cpu/checkpoints "
    "checkpoint.save=runs/tiny_hybrid/checkpoints": Covered(
        "tests/functional/test_hybrid_pretrain.py::test_gpt_checkpoint_continues_as_a_hybrid_run"),
    # Step-3.5, CP, MoE, GPU configs
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/step35_tiny_cpu.yaml": Check(),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/step35_mtp_tiny_cpu.yaml":
        Check(),
    "torchrun --nproc_per_node=4 launch/pretrain.py --config configs/step35_moe_tiny_cpu.yaml":
        Check(),
    "torchrun --nproc_per_node=8 launch/pretrain.py --config configs/step35_flash_dense.yaml "
    "parallelism.tensor_model_parallel_size=8": Check(on_cpu=("model.attention_kernel=sdpa",)),
    "torchrun --nproc_per_node=4 launch/pretrain.py --config configs/step35_tiny_cpu.yaml "
    "parallelism.context_parallel_size=2": Check(),
    "torchrun --nproc_per_node=4 launch/pretrain.py --config configs/tiny_cpu.yaml "
    "parallelism.context_parallel_size=2": Check(),
    "torchrun --nproc_per_node=8 launch/pretrain.py --config configs/gpt_125m.yaml "
    "parallelism.tensor_model_parallel_size=4": Check(),
    # Hugging Face
    "python -m mcore_ext.hf import HF_DIR CKPT_DIR": Covered(HF_ROUND_TRIP),
    "python -m mcore_ext.hf import HF_DIR CKPT_DIR --architecture hybrid": Covered(
        "tests/hf/test_hf_checkpoint.py::"
        "test_hybrid_import_and_its_export_write_what_the_gpt_path_writes"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config CKPT_DIR/iter_0000000/config.yaml "
    "parallelism.tensor_model_parallel_size=2 parallelism.sequence_parallel=true "
    "data.prefix=data/mytext checkpoint.save=runs/ft": Covered(
        "tests/hf/test_hf_moe.py::test_readme_fine_tune_command_trains_the_moe_import_at_tp2"),
    "python -m mcore_ext.hf export runs/ft HF_OUT": Covered(HF_ROUND_TRIP),
    # the CLI's import_checkpoint at TP 2 on 2 gloo ranks
    "torchrun --nproc_per_node=2 -m mcore_ext.hf import HF_DIR CKPT_DIR --tp 2": Covered(
        "tests/hf/test_hf_checkpoint.py::test_import_at_tp2_export_at_pp2_is_bit_identical"),
    "python -m mcore_ext.hf plan tests/hf/fixtures/step35_flash_config.json --tp 2 --pp 9 --ep 16 "
    "--etp 1 --dp 8": Run(expect="GiB"),
    "python -m mcore_ext.data.preprocess --input a.jsonl --output-prefix data/mytext --tokenizer "
    "HF_DIR": Skip("needs a downloaded Hugging Face checkpoint with its tokenizer; the same entry "
                   "with the byte tokenizer: tests/functional/test_pretrain.py::"
                   "test_preprocess_jsonl_and_text"),
    "python -m mcore_ext.checkpoint inspect ckpt/iter_100": Covered(
        "tests/unit/test_checkpoint_errors.py::test_inspect_reports_layout_without_the_saving_layout"),
    # Megatron-LM
    "bash scripts/pretrain_megatron_lm.sh": Covered(READY_MEGATRON_LM),
    "bash scripts/pretrain_megatron_lm.sh --train-iters 200": Covered(READY_MEGATRON_LM),
    "RUN_DIR=runs/my_run bash scripts/pretrain_megatron_lm.sh": Covered(READY_MEGATRON_LM),
    "python -m mcore_ext.megatron_lm.pretrain_gpt --help": Covered(
        "tests/functional/test_entry_errors.py::test_megatron_lm_help_lists_the_gate_flags_first"),
    "torchrun --nproc_per_node=8 -m mcore_ext.megatron_lm.pretrain_gpt <your Megatron-LM "
    "pretrain_gpt.py flags: model, --data-path / --mock-data, tokenizer, ...> "
    "--head-wise-attn-gate --mcore-ext-backend auto": Skip(
        "a synopsis: <...> stands for the user's Megatron-LM flags; its runnable form is "
        "scripts/pretrain_megatron_lm.sh"),
    "torchrun --nproc_per_node=2 -m mcore_ext.megatron_lm.pretrain_gpt <same model flags> "
    "--head-wise-attn-gate --ckpt-format torch_dist --load <launcher checkpoint.save> "
    "--save <dir>": Covered(
        "tests/functional/test_megatron_lm_checkpoints.py::"
        "test_launcher_checkpoint_resumes_through_megatron_lm"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config run.yaml checkpoint.load=<Megatron-LM "
    "--save dir>": Covered(
        "tests/functional/test_megatron_lm_checkpoints.py::"
        "test_megatron_lm_checkpoint_resumes_through_the_launcher"),
    # Bridge, upstream, releases: opt-in environments
    "bash scripts/setup_bridge.sh": Skip(BRIDGE),
    "PYTHONPATH=$PWD .venv-bridge/bin/python -m pytest tests/bridge -m bridge": Skip(BRIDGE),
    "git clone --bare https://github.com/NVIDIA/Megatron-LM.git /path/to/Megatron-LM.git":
        Skip(UPSTREAM),
    "MEGATRON_LM_GIT=/path/to/Megatron-LM.git bash scripts/setup_upstream_dev.sh": Skip(UPSTREAM),
    ".venv/bin/python -m pytest tests/upstream -m upstream_dev -s": Skip(UPSTREAM),
    "bash scripts/test_versions.sh 0.18.0 0.19.0": Skip(
        "downloads other megatron-core releases and smoke-tests each (minutes); scripts/test.sh "
        "runs the same script on 0.16.1 and 0.18.2 in CI"),
    "bash scripts/test.sh tests/unit/test_docs.py -x": Skip(SUITE),
    "bash scripts/test.sh -k reshard -x": Skip(SUITE),
    # GPUs
    "bash scripts/gpu_check.sh dry-run": Covered(
        "tests/unit/test_gpu_check.py::test_dry_run_writes_every_step_skipped_with_its_reason"),
    "bash scripts/gpu_check.sh plan": Run(expect="stage"),
    "bash scripts/gpu_check.sh prepare": Skip(
        "downloads wheels for the GPU machine (network); its fit under the carry limit: "
        "tests/unit/test_gpu_check.py::test_stages_fit_the_device_calls"),
    # Megatron-LM's HybridModel (docs/megatron-lm.md): a template of the user's own flags
    "torchrun --nproc_per_node=8 -m mcore_ext.megatron_lm.pretrain_gpt <your Megatron-LM "
    "pretrain_gpt.py flags> --head-wise-attn-gate --hybrid-layer-pattern *-*-*-*-": Covered(
        "tests/functional/test_megatron_lm_hybrid.py::"
        "test_hybrid_model_trains_saves_and_resumes_exactly"),
    "torchrun --nproc_per_node=8 -m mcore_ext.megatron_lm.pretrain_gpt <your Megatron-LM "
    "pretrain_gpt.py flags> --head-wise-attn-gate --hybrid-layer-pattern *-*-*-*-/*-": Covered(
        "tests/functional/test_megatron_lm_hybrid.py::"
        "test_mtp_trains_saves_and_resumes_exactly_in_the_other_spelling"),
    # Megatron-LM under CP (docs/megatron-lm.md): a template of the user's own flags
    "torchrun --nproc_per_node=8 -m mcore_ext.megatron_lm.pretrain_gpt <your Megatron-LM "
    "pretrain_gpt.py flags> --head-wise-attn-gate --context-parallel-size 2 "
    "[--tensor-model-parallel-size 2 ...]": Covered(
        "tests/functional/test_megatron_lm_cp.py::test_cp_losses_and_grad_norms_match_cp1"),
    # MoE benchmarks (docs/moe.md)
    "python benchmarks/bench_moe.py --dtype bf16 --rounds 30": Skip(BENCHMARK),
    "python benchmarks/bench_moe.py --dtype bf16 --hidden 4096 --expert-ffn 1280 --tokens 4096":
        Skip(BENCHMARK),
    "bash scripts/gpu_check.sh collect <files_at of the call>": Covered(
        "tests/unit/test_gpu_check.py::test_collect_replaces_the_steps_collected_again_and_keeps_the_others"),
    # Checkpoints (docs/checkpoints.md)
    "RUN_DIR=runs/tiny_cpu-<date> bash scripts/pretrain.sh": Covered(
        "tests/functional/test_pretrain.py::test_resume_reaches_the_same_losses"),
    "RUN_DIR=runs/tiny_cpu-<date> bash scripts/pretrain.sh training.train_iters=200": Check(),
    "python -m mcore_ext.hf import HF_DIR runs/step35_ckpt": Covered(HF_ROUND_TRIP),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config "
    "runs/step35_ckpt/iter_0000000/config.yaml data.prefix=... checkpoint.save=runs/step35_ft":
        Covered(HF_ROUND_TRIP),
    "python -m mcore_ext.checkpoint inspect runs/a/checkpoints/iter_0000020 --verify": Covered(
        "tests/functional/test_checkpoint_verify.py::"
        "test_damaged_checkpoint_is_named_and_previous_resumes_exactly"),
    "MCORE_EXT_TRUST_CHECKPOINT=ckpt/iter_0000100 python -m mcore_ext.checkpoint inspect "
    "ckpt/iter_0000100 --verify": Covered(
        "tests/functional/test_checkpoint_safe_load.py::"
        "test_the_explicit_opt_in_runs_the_payload_of_that_checkpoint_only"),
    "python -m mcore_ext.hf export runs/lora/checkpoints ADAPTER_OUT --adapter": Covered(
        "tests/hf/test_hf_lora_moe.py::"
        "test_released_layout_lora_exports_a_peft_adapter_and_its_mtp_adapters"),
    "python -m mcore_ext.hf export runs/a/checkpoints OUT": Covered(
        "tests/hf/test_hf_checkpoint.py::"
        "test_export_refuses_a_folder_with_files_and_overwrite_keeps_the_others"),
    "python -m mcore_ext.hf export runs/a/checkpoints OUT --overwrite": Covered(
        "tests/hf/test_hf_checkpoint.py::"
        "test_export_refuses_a_folder_with_files_and_overwrite_keeps_the_others"),
    # fine-tuning on chat data (README)
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/step35_sft_tiny_cpu.yaml":
        Covered("tests/functional/test_sft.py::"
                "test_recipe_fine_tunes_packed_conversations_and_loss_falls"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config runs/step35_ckpt/iter_0000000/"
    "config.yaml parallelism.tensor_model_parallel_size=2 parallelism.sequence_parallel=true "
    "data.source=chat data.path=configs/sft_tiny/chat.jsonl checkpoint.load=runs/step35_ckpt "
    "checkpoint.finetune=true checkpoint.save=runs/ft": Covered(
        "tests/hf/test_hf_sft.py::"
        "test_imported_step35_fine_tunes_on_chat_data_and_exports_what_transformers_decodes"),
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --seq "
    "131072 --cp 8 --recompute full --packed": Run(expect="packed documents"),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/step35_sft_tiny_cpu.yaml "
    "parallelism.tensor_model_parallel_size=1 parallelism.sequence_parallel=false "
    "parallelism.context_parallel_size=2": Covered(
        "tests/functional/test_sft.py::"
        "test_recipe_at_context_parallel_2_trains_packed_conversations"),
    # fine-tuning Step-3.7 on images (README)
    "python -m mcore_ext.hf import --vision HF_DIR runs/step37_ckpt": Covered(VL_README),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config runs/step37_ckpt/iter_0000000/"
    "config.yaml parallelism.tensor_model_parallel_size=2 parallelism.sequence_parallel=true "
    "data.source=chat data.path=configs/vl_tiny/captions.jsonl checkpoint.load=runs/step37_ckpt "
    "checkpoint.finetune=true checkpoint.save=runs/ft": Covered(VL_README),
    "torchrun --nproc_per_node=2 launch/pretrain.py --config configs/step37_vl_sft_tiny_cpu.yaml":
        Covered("tests/hf/test_hf_step37_sft.py::test_recipe_learns_to_read_the_pictures"),
    # packed vs one-conversation-per-row SFT (docs/training.md)
    "python benchmarks/bench_sft_packing.py": Skip(BENCHMARK),
    # the drawn image-caption set (docs/training.md, chat data with images)
    "python -m mcore_ext.data.shapes /tmp/shapes --count 48": Covered(
        "tests/unit/test_vl_shapes.py::"
        "test_the_committed_set_is_what_the_script_draws_from_its_seed"),
    # the memory plan (docs/memory-plan.md)
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --seq "
    "32768 --recompute full --packed --without-mtp parallelism.tensor_model_parallel_size=8 "
    "parallelism.pipeline_model_parallel_size=1 parallelism.expert_model_parallel_size=8 "
    "lora.rank=16 lora.targets=[q_proj,k_proj,v_proj,g_proj,o_proj]": Run(expect="50.9 GiB"),
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --seq "
    "32768 --recompute full --packed parallelism.tensor_model_parallel_size=8 "
    "parallelism.pipeline_model_parallel_size=1 parallelism.expert_model_parallel_size=8 "
    "lora.rank=16 lora.targets=[all-linear,experts.gate_up_proj,experts.down_proj]": Covered(
        "tests/unit/test_memory_plan.py::"
        "test_a_lora_plan_counts_mtp_and_expert_adapters_and_refuses_expert_tp"),
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --dp 8":
        Run(expect="GiB"),
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --seq "
    "32768 --cp 8 --dp 1 --recompute full --breakdown": Run(expect="GiB"),
    "python -m mcore_ext.plan --config configs/step35_flash.yaml --vocab-size 128896 --seq "
    "262144 --search": Covered(
        "tests/unit/test_memory_plan.py::test_search_lists_the_fewest_gpus_that_fit_first"),
    # the vision tower in the plan (docs/memory-plan.md): the same entry and arguments, and the
    # figure the page quotes
    "python -m mcore_ext.hf plan tests/hf/fixtures/step37_flash_config.json --tp 8 --pp 9 --ep 16 "
    "--etp 1 --dp 8 --seq 4096 --crops 4 --vision trained --breakdown": Covered(
        "tests/unit/test_memory_plan_vision.py::"
        "test_hf_plan_with_vision_counts_the_tower_frozen_or_trained"),
    "python -m mcore_ext.hf plan HF_DIR --tp 2 --pp 9 --ep 16 --etp 1 --dp 8 --seq 4096 "
    "--recompute selective": Covered(
        "tests/unit/test_memory_plan.py::test_the_launcher_config_and_the_hf_config_plan_alike"),
}


# ----------------------------------------------------------------------------- reading markdown

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def code_blocks(path):
    """[(language, line of the opening fence, [(line number, text)])] of a markdown file."""
    blocks, current = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if current is None:
            if match:
                current = (match.group(3).lower(), number, match.group(2), [])
        elif match and match.group(2).startswith(current[2]) and not match.group(3):
            blocks.append((current[0], current[1], current[3]))
            current = None
        else:
            current[3].append((number, line))
    assert current is None, f"{path.name}:{current[1]}: a code block is never closed"
    return blocks


def _without_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands():
    """[(page, line, key, command)] of every shell block: key = the command's words, one space
    apart; command = the logical line as bash runs it."""
    found = []
    for page in PAGES:
        for language, _, lines in code_blocks(page):
            if language not in SHELL:
                continue
            pending, start = "", None
            for number, text in lines:
                text = _without_comment(text)
                start = start or number
                if text.endswith("\\"):
                    pending += text[:-1].strip() + " "
                    continue
                command = (pending + text.strip()).strip()
                pending, first, start = "", start, None
                if command:
                    key = " ".join(shlex.split(command))
                    found.append((page.relative_to(ROOT).as_posix(), first, key, command))
    return found


def _label(item):
    page, line, key, _ = item
    return f"{page}:{line}: {key}"


# ---------------------------------------------------------------------------------- decisions


def test_every_code_block_declares_its_language():
    bare = [f"{page.relative_to(ROOT)}:{line}" for page in PAGES
            for language, line, _ in code_blocks(page) if language not in SHELL | NOT_COMMANDS]
    assert not bare, ("code blocks without a known language (bash for commands, text / python / "
                      f"yaml otherwise): {bare}")


def test_every_command_has_a_decision():
    missing = [_label(item) for item in commands() if item[2] not in DECISIONS]
    assert not missing, ("commands without a decision in DECISIONS of tests/unit/test_docs.py "
                         "(Run, Check, Covered or Skip):\n" + "\n".join(missing))


def test_no_decision_is_left_without_its_command():
    used = {key for _, _, key, _ in commands()}
    stale = sorted(set(DECISIONS) - used)
    assert not stale, f"decisions for commands no page has any more: {stale}"


def test_covering_tests_exist():
    absent = []
    for decision in {d for d in DECISIONS.values() if isinstance(d, Covered)}:
        path, name = decision.test.split("::")
        source = (ROOT / path).read_text() if (ROOT / path).exists() else ""
        if not re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE):
            absent.append(decision.test)
    assert not absent, f"Covered names tests that do not exist: {absent}"


def _runs():
    """The Run commands, each once (the first page that gives it)."""
    runs = {}
    for item in commands():
        if isinstance(DECISIONS.get(item[2]), Run):
            runs.setdefault(item[2], item)
    return list(runs.values())


def _venv_env():
    """The environment of an activated venv: this interpreter's bin first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "VIRTUAL_ENV": str(Path(sys.executable).parent.parent), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("item", _runs(), ids=lambda item: item[2][:60])
def test_run_commands_run(item, tmp_path):
    page, line, key, command = item
    decision = DECISIONS[key]
    script = decision.tiny.format(tmp=tmp_path) if decision.tiny else command
    if ".venv/bin/activate" in script and not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("this checkout's venv is not .venv (MCORE_EXT_VENV)")
    result = subprocess.run(["bash", "-c", f"set -euo pipefail; {script}"], cwd=ROOT,
                            env=_venv_env(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{page}:{line}: {script}\n{output[-3000:]}"
    if decision.expect:
        assert decision.expect in output, f"{page}:{line}: {script}\n{output[-3000:]}"


def _launcher_arguments(key: str):
    """(launcher arguments, world size) of a launcher command: torchrun launch/pretrain.py,
    python launch/pretrain.py --check, or scripts/pretrain.sh (2 ranks, configs/tiny_cpu.yaml)."""
    words = shlex.split(key)
    while re.match(r"^[A-Z_]+=", words[0]):  # RUN_DIR=... and other variables of the command
        words = words[1:]
    if words[:2] == ["bash", "scripts/pretrain.sh"]:
        return ["--config", "configs/tiny_cpu.yaml", *words[2:]], 2
    if words[0] == "torchrun":
        nproc = next(int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node="))
        return words[words.index("launch/pretrain.py") + 1:], nproc
    assert words[:2] == ["python", "launch/pretrain.py"], key
    args = words[2:]
    at = args.index("--world-size")
    world_size = int(args[at + 1])
    return [w for i, w in enumerate(args) if w != "--check" and i not in (at, at + 1)], world_size


CHECK_DRIVER = """
import contextlib, io, json, sys
from mcore_ext.training import main
results = []
for args, world_size in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([*args, "--check", "--world-size", str(world_size)])
    results.append((code, out.getvalue()[-2000:]))
print(json.dumps(results))
"""


def test_launcher_commands_pass_check():
    """Each launcher command's config, overrides and layout at its world size, as ``--check``
    resolves them (no training)."""
    items = [item for item in commands() if isinstance(DECISIONS.get(item[2]), Check)]
    items = list({item[2]: item for item in items}.values())  # each command once
    calls = []
    for _, _, key, _ in items:
        args, world_size = _launcher_arguments(key)
        calls.append(([*args, *DECISIONS[key].on_cpu], world_size))
    result = subprocess.run([sys.executable, "-c", CHECK_DRIVER, json.dumps(calls)], cwd=ROOT,
                            env=_venv_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    failed = [f"{_label(item)}\n{output}" for item, (code, output) in zip(items, outcomes) if code]
    assert not failed, "\n\n".join(failed)


# ------------------------------------------------------------------------------------- links

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set:
    anchors, seen = set(), {}
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if in_code:
            continue
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            slug = _slug(match.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_links_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", page.read_text())  # not inside code blocks
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network)
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_is_a_short_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    keys = {key for page, _, key, _ in commands() if page == "README.md"}
    # CI (.ci/run) runs scripts/test.sh: the README names it, and the main job, as written.
    assert {"bash scripts/pretrain.sh", "bash scripts/test.sh", "source .venv/bin/activate"} <= keys
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_test_sh_with_a_path_runs_that_path_alone():
    """``bash scripts/test.sh tests/unit/test_docs.py -x`` (docs/testing.md) collects that file
    only, not the whole suite besides it."""
    result = subprocess.run(["bash", "scripts/test.sh", "tests/unit/test_docs.py", "--co", "-q"],
                            cwd=ROOT, env=_venv_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/unit/test_docs.py::") for line in collected), \
        result.stdout[-3000:]


def _run_readme_snippet(code: str):
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (the README's own code)
    model = namespace["model"]
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    return type(model).__mro__[1].__name__, model.hybrid_layer_pattern, tuple(qkv.shape)


def test_readme_python_snippet_builds_the_gated_hybrid_model(run_distributed):
    """The README's Python block, as written, on 2 gloo ranks: a HybridModel (pattern *-*-)
    whose linear_qkv holds each rank's Q, K, V and gate rows: (8 x 16 + 2 x 2 x 16 + 8) / TP 2."""
    from mcore_ext import _mcore_compat

    if not _mcore_compat.has_hybrid_model():
        pytest.skip(f"megatron-core {_mcore_compat.megatron_core_version()} has no HybridModel")
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Using it from Python", 1)[1].split("```python\n", 1)[1]
    code = code.split("```", 1)[0]
    for cls, pattern, shape in run_distributed(_run_readme_snippet, code, world_size=2):
        assert (cls, pattern, shape) == ("HybridModel", "*-*-", (100, 128))
