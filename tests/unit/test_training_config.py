"""The launcher's config: precedence, validation messages, resolution, shipped configs."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from mcore_ext.training.config import ConfigError, PretrainConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


MOCK = "data:\n  source: mock\n"


def test_precedence_defaults_yaml_overrides(tmp_path):
    path = write(tmp_path, MOCK + "model:\n  num_layers: 4\n  hidden_size: 64\n")
    cfg = load_config(path, ["model.num_layers=6", "training.eval_interval=null"], world_size=1)
    assert cfg.model.num_layers == 6  # override beats YAML
    assert cfg.model.hidden_size == 64  # YAML beats default
    assert cfg.model.num_attention_heads == 4  # default
    assert cfg.training.eval_interval is None  # null parses to None


def test_override_values_are_parsed_as_yaml(tmp_path):
    path = write(tmp_path, MOCK)
    cfg = load_config(
        path,
        ["optimizer.lr=1e-3", "model.head_wise_attn_gate=true", "training.train_iters=20",
         "data.split=90,10,0"],
        world_size=1,
    )
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.head_wise_attn_gate is True
    assert cfg.training.train_iters == 20
    assert cfg.data.split == "90,10,0"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.num_layer=3", "unknown config key 'model.num_layer'; did you mean 'model.num_layers'?"),
        ("training.hidden_size=64", "did you mean 'model.hidden_size'?"),
        ("optimizer.learning_rate=0.1", "unknown config key 'optimizer.learning_rate'"),
        ("modle.num_layers=3", "unknown config section 'modle'; did you mean 'model'?"),
    ],
)
def test_unknown_keys_name_the_key_and_suggest(tmp_path, override, expected):
    with pytest.raises(ConfigError, match="unknown config") as err:
        load_config(write(tmp_path, MOCK), [override], world_size=1)
    assert expected in str(err.value)


def test_unknown_key_in_yaml_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MOCK + "training:\n  global_batch: 8\n"), world_size=1)
    assert "'training.global_batch'" in str(err.value)
    assert "did you mean 'training.global_batch_size'?" in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.num_layers=two", "model.num_layers='two' has type str, expected an integer"),
        ("model.num_layers=2.5", "model.num_layers=2.5 has type float, expected an integer"),
        ("model.head_wise_attn_gate=3", "model.head_wise_attn_gate=3 has type int, expected true or false"),
        ("optimizer.lr=fast", "optimizer.lr='fast' has type str, expected a number"),
        ("training.precision=bf32", "training.precision='bf32' is not one of"),
        ("model.num_layers=[1,2]", "expected an integer"),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(tmp_path, override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MOCK), [override], world_size=1)
    assert expected in str(err.value)


def test_literal_suggests_closest_choice(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        load_config(write(tmp_path, MOCK), ["training.precision=bfloat16"], world_size=1)


def test_bad_yaml_is_a_clear_error(tmp_path):
    path = write(tmp_path, "model:\n  num_layers: 2\n   hidden_size: [64\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML \(line \d+, column \d+\)"):
        load_config(path, world_size=1)


def test_yaml_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- just\n- a list\n"), world_size=1)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/run.yaml", world_size=1)


def test_malformed_override(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(write(tmp_path, MOCK), ["num_layers=3"], world_size=1)


def test_layout_must_divide_world_size(tmp_path):
    path = write(tmp_path, MOCK + "parallelism:\n  tensor_model_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="parallel layout does not divide the world size: 3 ranks"):
        load_config(path, world_size=3)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_with_tensor_parallelism_needs_sequence_parallelism(ep):
    """megatron's MoE layer refuses to train at TP > 1 without sequence parallelism, EP or not
    (a ValueError on every rank from the first forward): decided here, by name."""
    moe = str(CONFIGS / "step35_moe_tiny_cpu.yaml")
    layout = ["parallelism.tensor_model_parallel_size=2",
              f"parallelism.expert_model_parallel_size={ep}"]
    with pytest.raises(ConfigError) as err:
        load_config(moe, layout, world_size=4)
    assert str(err.value) == (
        "model.num_moe_experts=8 with parallelism.tensor_model_parallel_size=2 needs "
        "parallelism.sequence_parallel=true (megatron's MoE layer does not train with TP "
        "without it)")
    cfg = load_config(moe, [*layout, "parallelism.sequence_parallel=true"], world_size=4)
    assert cfg.parallelism.sequence_parallel
    dense = load_config(str(CONFIGS / "step35_tiny_cpu.yaml"),
                        ["parallelism.tensor_model_parallel_size=2"], world_size=2)
    assert not dense.parallelism.sequence_parallel  # no MoE layers: not needed


def test_global_batch_must_split_into_micro_batches(tmp_path):
    with pytest.raises(ConfigError, match=r"global_batch_size \(10\) must be divisible"):
        load_config(
            write(tmp_path, MOCK),
            ["training.global_batch_size=10", "training.micro_batch_size=4"],
            world_size=1,
        )


def test_missing_data_path(tmp_path):
    prefix = tmp_path / "nope" / "text"
    with pytest.raises(ConfigError, match=f"data path '{prefix}' does not exist"):
        load_config(write(tmp_path, f"data:\n  source: files\n  prefix: {prefix}\n"), world_size=1)


def test_megatron_rejections_become_config_errors(tmp_path):
    # 6 heads cannot be split over 4 TP ranks: megatron's TransformerConfig refuses.
    with pytest.raises(ConfigError, match=r"rejected by megatron-core.*num_attention_heads \(6\)"):
        load_config(
            write(tmp_path, MOCK),
            ["model.num_attention_heads=6", "model.hidden_size=96", "model.head_wise_attn_gate=true",
             "parallelism.tensor_model_parallel_size=4"],
            world_size=4,
        )


def test_resolution_fills_derived_values(tmp_path):
    cfg = load_config(
        write(tmp_path, MOCK),
        ["model.hidden_size=96", "model.num_attention_heads=4", "training.global_batch_size=32",
         "training.micro_batch_size=4", "parallelism.tensor_model_parallel_size=2"],
        world_size=4,
    )
    assert cfg.model.kv_channels == 24 and cfg.model.num_query_groups == 4
    assert cfg.model.ffn_hidden_size == 256  # swiglu: 8/3 * 96 rounded up to 64
    assert cfg.optimizer.lr_decay_iters == cfg.training.train_iters
    assert (cfg.data_parallel_size, cfg.num_microbatches) == (2, 4)  # 32 = 4 x DP 2 x 4


def test_saved_yaml_round_trips(tmp_path):
    cfg = load_config(str(CONFIGS / "tiny_cpu.yaml"), ["training.train_iters=30"], world_size=2)
    again = load_config(write(tmp_path, cfg.to_yaml()), world_size=2)
    assert again.to_dict() == cfg.to_dict()
    assert set(yaml.safe_load(cfg.to_yaml())) == {
        "model", "parallelism", "training", "optimizer", "data", "checkpoint", "logging", "lora"
    }


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_explicit_precision_is_kept_on_any_device(tmp_path, precision):
    """bf16 / fp16 run on a CPU too (megatron's Float16Module and mixed-precision optimizer)."""
    from mcore_ext.run_config.megatron_configs import optimizer_config, transformer_config

    cfg = load_config(write(tmp_path, MOCK), [f"training.precision={precision}"], world_size=1)
    assert cfg.training.precision == precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    model, optimizer = transformer_config(cfg), optimizer_config(cfg)
    assert model.params_dtype is dtype and optimizer.params_dtype is dtype
    assert (model.bf16, model.fp16) == (optimizer.bf16, optimizer.fp16) == (
        precision == "bf16", precision == "fp16")


def test_auto_precision_is_bf16_on_gpu_fp32_on_cpu(tmp_path):
    cfg = load_config(write(tmp_path, MOCK), ["training.precision=auto"], world_size=1)
    assert cfg.training.precision == ("bf16" if torch.cuda.is_available() else "fp32")


def test_every_field_has_a_docstring_comment():
    import inspect

    import mcore_ext.training.config as module

    for section in dataclasses.fields(PretrainConfig):
        if section.metadata.get("derived"):
            continue
        source = inspect.getsource(section.default_factory)
        for field in dataclasses.fields(section.default_factory):
            after = source.split(f"    {field.name}:", 1)[1].split("\n", 2)[1]
            assert after.strip().startswith('"""'), f"{section.name}.{field.name} has no docstring"
    assert module.ConfigError.__doc__


@pytest.mark.parametrize("world_size", [1, 8])
@pytest.mark.parametrize("name", ["gpt_125m.yaml", "gpt_1b.yaml", "step35_attention.yaml"])
def test_gpu_configs_validate(name, world_size):
    cfg = load_config(str(CONFIGS / name), world_size=world_size)  # bf16 validates on a CPU too
    assert cfg.model.head_wise_attn_gate and cfg.training.precision == "bf16"
    assert cfg.data_parallel_size * cfg.training.micro_batch_size * cfg.num_microbatches == (
        cfg.training.global_batch_size
    )


def test_step35_attention_shape():
    m = load_config(str(CONFIGS / "step35_attention.yaml"), world_size=8).model
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (64, 8, 128)


def test_tiny_config_is_the_readme_job():
    cfg = load_config(str(CONFIGS / "tiny_cpu.yaml"), world_size=2)
    assert cfg.parallelism.tensor_model_parallel_size == 2
    assert cfg.model.head_wise_attn_gate and cfg.data.source == "stdlib"


def test_flops_count_the_gate_rows():
    from mcore_ext.training.loop import flops_per_iteration
    from mcore_ext.run_config.megatron_configs import transformer_config

    cfg = load_config(str(CONFIGS / "tiny_cpu.yaml"), world_size=2)
    m, t = cfg.model, cfg.training
    gated = flops_per_iteration(transformer_config(cfg), 384, m.seq_length, t.global_batch_size)
    cfg.model.head_wise_attn_gate = False
    plain = flops_per_iteration(transformer_config(cfg), 384, m.seq_length, t.global_batch_size)
    tokens = t.global_batch_size * m.seq_length
    # fwd + bwd = 3 x 2 FLOPs per multiply-add, for num_attention_heads extra rows of h inputs.
    assert gated - plain == 6 * tokens * m.num_layers * m.hidden_size * m.num_attention_heads


def test_gate_init_bias_without_qkv_bias_is_kept_not_rewritten(tmp_path):
    """The launcher leaves the policy to GatedTransformerConfig: the value stays as configured
    (the saved config says what the user asked for) and is effectively 0 without a QKV bias."""
    from mcore_ext.run_config.megatron_configs import transformer_config

    cfg = load_config(write(tmp_path, MOCK),
                      ["model.head_wise_attn_gate=true", "model.add_qkv_bias=false",
                       "model.head_wise_attn_gate_init_bias=2.0"], world_size=1)
    assert cfg.model.head_wise_attn_gate_init_bias == 2.0
    assert "head_wise_attn_gate_init_bias: 2.0" in cfg.to_yaml()
    config = transformer_config(cfg)
    assert config.head_wise_attn_gate_init_bias == 2.0
    assert config.effective_head_wise_attn_gate_init_bias == 0.0
    cfg.model.add_qkv_bias = True
    assert transformer_config(cfg).effective_head_wise_attn_gate_init_bias == 2.0


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_start_their_gates_as_configured(name):
    """No shipped config asks for a gate init bias its model has no bias rows for (which would
    warn on every rank): the configured value is the effective one."""
    from mcore_ext.training.config import PretrainConfig
    from mcore_ext.run_config.overrides import apply_overrides, build, read_yaml
    from mcore_ext.run_config.megatron_configs import transformer_config

    raw = apply_overrides(read_yaml(str(CONFIGS / name)), ["training.precision=fp32"])
    config = transformer_config(build(PretrainConfig, raw))
    if config.head_wise_attn_gate:
        assert config.effective_head_wise_attn_gate_init_bias == \
            config.head_wise_attn_gate_init_bias, (name, config.head_wise_attn_gate_init_bias)


def test_eta_leaves_out_the_first_step():
    """The first step (compilation, allocation) gives no estimate; later ones use the mean of
    the steps after it: 90 steps left x 1 s, not x the first step's 10 s."""
    from mcore_ext.training.loop import _Eta

    eta = _Eta(first_iteration=1)
    assert eta.seconds_left(1, 1, 10.0, 100) is None
    assert eta.seconds_left(10, 9, 9.0, 100) == pytest.approx(90.0)
    assert eta.seconds_left(20, 10, 12.0, 100) == pytest.approx(80 * 21.0 / 19)
    resumed = _Eta(first_iteration=51)  # a resumed run's first step warms up too
    assert resumed.seconds_left(51, 1, 7.0, 100) is None


def test_config_goes_to_the_run_directory_and_a_summary_to_the_console(tmp_path, capsys):
    from mcore_ext.training.loop import _announce_config

    cfg = load_config(str(CONFIGS / "tiny_cpu.yaml"),
                      [f"logging.metrics_file={tmp_path / 'run' / 'metrics.jsonl'}"], world_size=2)
    _announce_config(cfg)
    (line,) = capsys.readouterr().out.splitlines()
    assert line == ("[config] 2 layers x 128 hidden, 4 heads, seq 128, gate on, sdpa; 100 "
                    f"iterations, lr 0.003 (cosine); resolved configuration in "
                    f"{tmp_path / 'run' / 'config.yaml'}")
    assert load_config(str(tmp_path / "run" / "config.yaml"), world_size=2) == cfg
    nowhere = load_config(str(CONFIGS / "tiny_cpu.yaml"),
                          ["logging.metrics_file=null", "checkpoint.save=null"], world_size=2)
    _announce_config(nowhere)  # nothing keeps it: the console gets all of it
    assert "head_wise_attn_gate: true" in capsys.readouterr().out


def test_resolved_config_never_goes_over_an_input(tmp_path, capsys):
    """config.yaml beside the metrics file is the launcher's only when it wrote it (its first
    line) and it is not the run's --config: else config.resolved.yaml; the input stays as it was."""
    from mcore_ext.training.loop import RESOLVED_MARK, _announce_config

    def announce(config_file=None):
        cfg = load_config(str(config_file or CONFIGS / "tiny_cpu.yaml"), [
            f"logging.metrics_file={tmp_path / 'metrics.jsonl'}", "training.train_iters=20"],
            world_size=2)
        written = _announce_config(cfg, str(config_file) if config_file else None)
        assert capsys.readouterr().out.endswith(f"resolved configuration in {written}\n")
        assert load_config(written, world_size=2) == cfg
        return written

    users = tmp_path / "config.yaml"
    text = "# my run: comments stay\n" + (CONFIGS / "tiny_cpu.yaml").read_text()
    users.write_text(text)
    resolved = str(tmp_path / "config.resolved.yaml")
    assert announce(users) == resolved and users.read_text() == text  # the --config
    assert announce() == resolved and users.read_text() == text  # a file the launcher did not write
    assert announce(users) == resolved  # its own resolved config: replaced (a resumed run)
    users.unlink()
    assert announce() == str(users)  # new: config.yaml, with the launcher's first line
    assert users.read_text().startswith(RESOLVED_MARK + "\n")
    before = users.read_text()
    assert announce(users) == resolved and users.read_text() == before  # a resolved --config


# ------------------------------------------------------- model.architecture left out


@pytest.mark.smoke  # 0.16 - 0.18 have no HybridModel: gpt there
def test_architecture_defaults_to_what_the_installed_megatron_core_recommends(tmp_path):
    from importlib.metadata import version

    from packaging.version import Version

    recommended = "hybrid" if Version(version("megatron-core")) >= Version("0.19") else "gpt"
    assert load_config(write(tmp_path, MOCK), world_size=1).model.architecture == recommended
    assert PretrainConfig().model.architecture == recommended


def _save_final_norms(root):
    """Three one-tensor dist checkpoints (2 ranks): a GPTModel's final norm key, a
    HybridModel's, and an adapters-only one (a LoRA key; its config.yaml says what it is)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    import mcore_ext

    mcore_ext.init_parallel()
    for name, key in (("gpt", "decoder.final_layernorm.weight"),
                      ("hybrid", "decoder.final_norm.weight"),
                      ("adapters", "decoder.layers.0.self_attention.linear_qkv.adapter.weight")):
        directory = Path(root) / name / "iter_0000004"
        if dist.get_rank() == 0:
            directory.mkdir(parents=True)
        dist.barrier()
        tensor = ShardedTensor.from_rank_offsets(key, torch.ones(4), replica_id=dist.get_rank())
        dist_checkpointing.save({"w": tensor}, str(directory))
        if dist.get_rank() == 0:
            (directory.parent / "latest_checkpointed_iteration.txt").write_text("4")


def test_architecture_left_out_follows_the_loaded_checkpoint_else_megatron(
        run_distributed, tmp_path):
    """Left out, model.architecture is the loaded checkpoint's (a GPT run resumes or fine-tunes
    as GPT, a hybrid one as hybrid, an adapters-only checkpoint as its config.yaml says, a
    launcher config.yaml from before the key as gpt); from scratch, HybridModel where the installed
    megatron-core has it (0.19+, which deprecates GPTModel), else GPTModel. Named, it wins."""
    from importlib.metadata import version

    from packaging.version import Version

    run_distributed(_save_final_norms, str(tmp_path), world_size=2)
    recommended = "hybrid" if Version(version("megatron-core")) >= Version("0.19") else "gpt"
    path = write(tmp_path, MOCK)
    adapters = tmp_path / "adapters" / "iter_0000004"

    def loaded(name, *overrides):
        return load_config(path, [f"checkpoint.load={tmp_path / name}", *overrides],
                           world_size=1).model.architecture

    assert loaded("adapters") == recommended  # no final norm, no config.yaml: not known
    (adapters / "config.yaml").write_text("model:\n  num_layers: 2\n")
    assert loaded("adapters") == "gpt"  # saved before model.architecture existed
    (adapters / "config.yaml").write_text("model:\n  architecture: hybrid\n")
    cases = {"gpt": "gpt", "hybrid": "hybrid", "adapters": "hybrid"}
    for name, expected in cases.items():
        assert loaded(name) == expected, name
        # The run's own checkpoint in checkpoint.save (a restart) decides the same way.
        own = load_config(path, [f"checkpoint.save={tmp_path / name}"], world_size=1)
        assert own.model.architecture == expected, name
    assert loaded("hybrid", "model.architecture=gpt") == "gpt"
    assert loaded("gpt", "model.architecture=hybrid") == "hybrid" or recommended == "gpt"


def test_vision_section_nests_and_is_checked_by_key(tmp_path):
    """model.vision: a mapping of VisionConfig's keys in the YAML, section.key.subkey=value on
    the command line; unknown keys, wrong types, VisionConfig's own checks and a tower TP cannot
    split are errors naming the key; config.yaml holds it and reads back."""
    from mcore_ext.vision import VisionConfig

    path = write(tmp_path, MOCK + "model:\n  vision:\n    hidden_size: 32\n"
                           "    num_attention_heads: 2\n")
    cfg = load_config(path, ["model.vision.freeze=false", "model.vision.ffn_hidden_size=64"],
                      world_size=1)
    assert cfg.model.vision == VisionConfig(hidden_size=32, num_attention_heads=2,
                                            ffn_hidden_size=64, freeze=False)
    assert load_config(write(tmp_path, cfg.to_yaml()), world_size=1).to_dict() == cfg.to_dict()
    assert load_config(write(tmp_path, MOCK), ["model.vision.freeze=true"],
                       world_size=1).model.vision == VisionConfig()
    assert load_config(write(tmp_path, MOCK), world_size=1).model.vision is None
    for override, said in (
            ("model.vision.freez=false", "unknown config key model.vision.'freez'; did you mean "
                                         "'model.vision.freeze'"),
            ("model.vision.num_layers=two", "model.vision.num_layers='two' has type str"),
            ("model.vision=3", "model.vision=3 has type int, expected a mapping of keys"),
            ("model.vision.num_attention_heads=5", "model.vision: VisionConfig.hidden_size=1536 "
                                                   "is not divisible by num_attention_heads=5"),
            ("model.vision.image_size=100", "not a multiple of patch_size=14")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            load_config(write(tmp_path, MOCK), [override], world_size=1)
    with pytest.raises(ConfigError, match=re.escape(
            "model.vision.num_attention_heads=6 is not divisible by "
            "parallelism.tensor_model_parallel_size=4")):
        load_config(write(tmp_path, MOCK), [
            "model.vision.num_attention_heads=6", "model.vision.hidden_size=48",
            "parallelism.tensor_model_parallel_size=4", "model.num_attention_heads=4"],
            world_size=4)


def test_attention_probe_needs_an_interval_and_a_validation_split(tmp_path):
    with pytest.raises(ConfigError, match=r"logging.attention_probe=0 must be at least 1 \(or null\)"):
        load_config(write(tmp_path, MOCK), ["logging.attention_probe=0"], world_size=1)
    text = f"data:\n  source: stdlib\n  prefix: {tmp_path / 'stdlib'}\n  split: 100,0,0\n"
    with pytest.raises(ConfigError, match=r"logging.attention_probe=100 measures the validation "
                                          r"split's first micro-batch, but data.split='100,0,0'"):
        load_config(write(tmp_path, text), ["training.eval_interval=null",
                                            "logging.attention_probe=100"], world_size=1)
    cfg = load_config(write(tmp_path, text.replace("100,0,0", "98,2,0")),
                      ["training.eval_interval=null", "logging.attention_probe=100"], world_size=1)
    assert cfg.logging.attention_probe == 100


# A Hugging Face tokenizer needs transformers, an optional package: with it missing, the ranks
# raised ImportError (a chat run at validation, any other run when it loaded the tokenizer).
@pytest.mark.parametrize("overrides", [
    [f"--config={CONFIGS / 'step35_sft_tiny_cpu.yaml'}"],
    [f"--config={CONFIGS / 'tiny_cpu.yaml'}", "data.source=mock",
     f"data.tokenizer={CONFIGS / 'sft_tiny' / 'tokenizer'}"],
], ids=["chat", "mock"])
def test_a_tokenizer_without_transformers_is_one_error_naming_what_to_install(
        tmp_path, capsys, monkeypatch, overrides):
    """Before: an ImportError traceback, exit 1 (the chat run at --check, the mock run only
    once its ranks loaded the tokenizer). Now: one error line naming the package, exit 2."""
    import sys

    from mcore_ext.training import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    code = main(["--check", "--world-size", "2", *overrides,
                 f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.load=null",
                 f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: data.tokenizer: "), err
    assert "needs the transformers package (pip install transformers)" in err, err


def test_the_te_backend_without_transformer_engine_is_one_error_at_validation(tmp_path):
    """Before: validated, then an ImportError in every rank as it built the model."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ConfigError, match=r"model.attention_backend=te: .*pip install "
                                          r"'mcore_ext\[te\]'"):
        load_config(str(CONFIGS / "tiny_cpu.yaml"), ["model.attention_backend=te"], world_size=2)
