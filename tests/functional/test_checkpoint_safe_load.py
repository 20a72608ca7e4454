"""Loading a checkpoint never runs code from it (issue 37), tried as an attacker would.

One tiny launcher run (2 ranks, a checkpoint at steps 1 and 2) is copied and each copy crafted:
a pickle whose ``__reduce__`` runs ``touch MARKER`` (``os.system`` through ``eval``) and still
returns the real value, put into ``.metadata``, into the common state's Megatron-LM ``args``, or
into a sharded object (a layer's extra state), with the file's entry in the offset table and the
manifest updated (a CRC32 is no signature). Each is refused by ``inspect --verify``, the launcher's
resume and fine-tune (at 1 and 2 ranks), the ``on_corrupt=previous`` fallback and ``hf export``: one
``error:`` line naming the file and the type, exit code 2, and the marker is never created.
The opt-in ``MCORE_EXT_TRUST_CHECKPOINT`` shows the payload is real: there it runs.
"""

import contextlib
import dataclasses
import io
import os
import pickle
import re
import shutil

import pytest
import torch

from tests.functional.inprocess import ROOT, TINY_MOCK, launch
from tests.functional.test_pretrain import GATED_QKV

PAYLOAD_TYPE = "builtins.eval"
# The gated QKV layers' byte objects (GPTModel's stacked layers, a shard per layer, or
# HybridModel's attention layers, one each): the last layer's is crafted.
SHARDED_OBJECT = re.compile(GATED_QKV + r"\._extra_state/shard_\d+_\d+")
# A layer's linear_proj extra state, which a Transformer Engine module decodes with pickle.loads.
LINEAR_PROJ_EXTRA_STATE = re.compile(
    r"decoder\.layers\.(\d+\.)?self_attention\.linear_proj\._extra_state/shard_\d+_\d+")


class Payload:
    """Unpickled, runs ``touch marker`` and returns ``value`` (what an attacker writes)."""

    def __init__(self, marker, value):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        code = (f"__import__('os').system('touch {self.marker}') or "
                f"__import__('pickle').loads({pickle.dumps(self.value)!r})")
        return eval, (code,)


def _rewrite_manifest(directory):
    """Record the crafted files' new sizes and CRC32s, as an attacker can."""
    from mcore_ext.checkpoint import manifest

    manifest.write(str(directory), manifest.describe(str(directory), manifest.read(str(directory))))


def craft_metadata(directory, marker):
    path = os.path.join(directory, ".metadata")
    real = pickle.load(open(path, "rb"))  # our own file: plain pickle is fine here
    with open(path, "wb") as f:
        pickle.dump(Payload(marker, real), f)
    _rewrite_manifest(directory)


def craft_object(directory, fqn, marker, wrap):
    """Replace the byte object ``fqn`` by ``wrap(its value, marker)``: appended to its file, the
    offset table in ``.metadata`` pointed at it."""
    path = os.path.join(directory, ".metadata")
    metadata = pickle.load(open(path, "rb"))
    match = fqn.fullmatch if isinstance(fqn, re.Pattern) else fqn.__eq__
    index = max((i for i in metadata.storage_data if match(i.fqn)), key=lambda i: i.fqn)
    info = metadata.storage_data[index]
    data_file = os.path.join(directory, info.relative_path)
    with open(data_file, "rb") as f:
        f.seek(info.offset)
        value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    buffer = io.BytesIO()
    torch.save(wrap(value, marker), buffer)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset,
                                                       length=len(buffer.getvalue()))
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_manifest(directory)


def _in_args(value, marker):  # the common state (a one-item list): its Megatron-LM args
    value[0]["args"] = Payload(marker, value[0]["args"])
    return value


def _as_te_extra_state(value, marker):
    """The payload as a Transformer Engine extra state: a uint8 tensor of ``pickle.dumps``,
    whose module decodes it with ``pickle.loads`` (the restricted read returns the tensor)."""
    from tests.unit.test_checkpoint_extra_state import as_extra_state

    return as_extra_state(Payload(marker, None))


def write_common_pt(directory, change=None):
    """Write the checkpoint's own common state back as a legacy ``common.pt`` beside it (which
    megatron's ``load_common_state_dict`` prefers), ``change``d; the manifest is left alone."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(directory))
    torch.save(change(common) if change else common, os.path.join(directory, "common.pt"))


def _payload_in_args(common, marker):
    common["args"] = Payload(marker, common["args"])
    return common


CRAFTS = {
    "metadata": lambda d, m: craft_metadata(d, m),
    "common_args": lambda d, m: craft_object(d, "common_state/shard_0_1", m, _in_args),
    "sharded_object": lambda d, m: craft_object(d, SHARDED_OBJECT, m, Payload),
    # Issue 54.1: a nested pickle, inside an object the restricted read admits (a uint8 tensor).
    "te_extra_state": lambda d, m: craft_object(d, LINEAR_PROJ_EXTRA_STATE, m, _as_te_extra_state),
    # A legacy common.pt added (megatron's load_common: torch.load with torch's defaults).
    "common_pt": lambda d, m: write_common_pt(d, lambda c: _payload_in_args(c, m)),
}
# torch's documented switch back to plain pickle for torch.load calls that do not say
# weights_only: set for every crafted load below, which must be refused all the same.
NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _train(base, *overrides):
    return launch(*TINY_MOCK, "training.train_iters=2", "checkpoint.save_interval=1",
                  f"checkpoint.save={base}", "checkpoint.load=null", *overrides)


@pytest.fixture(scope="module")
def crafted(run_distributed_shared, tmp_path_factory):
    """{name: (save directory, marker)}: copies of one run, iteration 2 crafted."""
    tmp = tmp_path_factory.mktemp("safe_load")
    base = tmp / "base"
    # Signed with the launcher's key file (for the signing tests below; a crafted copy's manifest
    # is re-written without the key, and loads without a key do not ask for a signature).
    (tmp / "key").write_text("k3y\n")
    results = run_distributed_shared(_train, base, f"checkpoint.key_file={tmp / 'key'}",
                                     world_size=2)
    assert [r["code"] for r in results] == [0, 0], results
    out = {"base": (base, None)}
    for name, craft in CRAFTS.items():
        shutil.copytree(base, tmp / name)
        craft(tmp / name / "iter_0000002", tmp / f"marker_{name}")
        out[name] = (tmp / name, tmp / f"marker_{name}")
    # The fallback: iteration 2 damaged, iteration 1 (what on_corrupt=previous probes) crafted.
    shutil.copytree(base, tmp / "previous")
    with open(tmp / "previous" / "iter_0000002" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    craft_metadata(tmp / "previous" / "iter_0000001", tmp / "marker_previous")
    out["previous"] = (tmp / "previous", tmp / "marker_previous")
    return out


def _inspect(directory) -> tuple[int, str, str]:
    from mcore_ext.checkpoint.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["inspect", str(directory), "--verify"])
    return code, out.getvalue(), err.getvalue()


def _check_refused(results, directory, marker, name):
    codes = [r["code"] for r in results]
    assert codes == [2] * len(results), (name, results)
    *warnings, line = results[0]["stderr"].splitlines()  # on_corrupt=previous warns first
    assert all(w.startswith("warning: checkpoint ") for w in warnings), (name, warnings)
    assert line.startswith(f"error: checkpoint file {directory}"), (name, line)
    assert f"holds a pickled {PAYLOAD_TYPE}" in line and "nothing of it was run" in line, line
    assert all(r["stderr"] == "" for r in results[1:]), (name, results)  # said once, by rank 0
    assert not os.path.exists(marker), name


@pytest.mark.parametrize("name", list(CRAFTS))
def test_inspect_verify_refuses_a_crafted_checkpoint(crafted, name, monkeypatch):
    save, marker = crafted[name]
    monkeypatch.setenv(NO_WEIGHTS_ONLY, "1")
    code, out, err = _inspect(save)
    *warnings, line = err.splitlines()
    assert all(w.startswith("warning: checkpoint ") for w in warnings), err  # common.pt named
    assert code == 2 and line.startswith(f"error: checkpoint file {save}/iter_0000002/"), err
    assert f"holds a pickled {PAYLOAD_TYPE}" in line, line
    if name == "te_extra_state":  # old code: exit 0, "the metadata and all 14 pickled objects
        # hold only checkpoint types"
        assert re.search(r"in decoder\.layers\.\S*linear_proj\._extra_state/shard_\S+ \(a "
                         "Transformer Engine extra state", line), line
    assert "verified: all" in out  # the CRC32 manifest matches: it is no defence against this
    assert not os.path.exists(marker)


def test_a_te_extra_state_is_refused_by_the_read_before_its_module_decodes_it(crafted):
    """Issue 54.1: the DCP read every load makes (megatron's torch_dist load, the launcher's,
    hf export's) of a linear_proj extra state holding a pickle: old code returned the tensor and
    a Transformer Engine module (``TEStandIn``: TE's decoding) ran the payload; now the read
    refuses it, naming the key and the type. ``inspect --verify`` says the same
    (test_inspect_verify_refuses_a_crafted_checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    from mcore_ext.checkpoint import safe_pickle
    from mcore_ext.checkpoint.errors import CheckpointUnsafeError
    from tests.unit.test_checkpoint_extra_state import TEStandIn

    save, marker = crafted["te_extra_state"]
    directory = str(save / "iter_0000002")
    storage = FileSystemReader(directory).read_metadata().storage_data
    key = max(i.fqn for i in storage if LINEAR_PROJ_EXTRA_STATE.fullmatch(i.fqn))
    state = {key: io.BytesIO()}
    with pytest.raises(CheckpointUnsafeError) as refused, safe_pickle.refusals():
        load(state, storage_reader=FileSystemReader(directory), no_dist=True)
        TEStandIn().set_extra_state(state[key])  # what the module does with what the read gave
    assert str(refused.value).startswith(f"checkpoint file {directory}/") and (
        f"holds a pickled {PAYLOAD_TYPE} in {key} (a Transformer Engine extra state"
        in str(refused.value)), refused.value
    assert not os.path.exists(marker)


def test_inspect_verify_reads_every_pickle_of_an_intact_checkpoint(crafted):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    code, out, err = _inspect(crafted["base"][0])
    assert code == 0 and err == "", err
    # Every byte object's shard, counted from the metadata (our own file: plain pickle).
    metadata = pickle.load(open(crafted["base"][0] / "iter_0000002" / ".metadata", "rb"))
    objects = sum(isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
                  for index in metadata.storage_data)
    assert objects > 10
    assert (f"verified: the metadata and all {objects} pickled objects hold only checkpoint "
            "types") in out


def test_the_explicit_opt_in_runs_the_payload_of_that_checkpoint_only(crafted, monkeypatch):
    """The payload is real: with MCORE_EXT_TRUST_CHECKPOINT naming it, it runs (and says so)."""
    save, marker = crafted["metadata"]
    other, other_marker = crafted["sharded_object"]
    monkeypatch.setenv("MCORE_EXT_TRUST_CHECKPOINT", str(save))
    code, _, err = _inspect(other)
    assert code == 2 and not os.path.exists(other_marker), err  # another path: still refused
    code, _, err = _inspect(save)
    assert code == 0 and os.path.exists(marker), err
    assert f"warning: reading {save}/iter_0000002/.metadata with plain pickle" in err
    os.remove(marker)


def _launch_crafted(world_dirs, ft_root):
    """Per crafted save directory: the fine-tune and the resume launch, on this rank."""
    import torch.distributed as dist

    os.environ[NO_WEIGHTS_ONLY] = "1"
    try:
        return _launch_each(world_dirs, ft_root, dist.get_world_size())
    finally:
        del os.environ[NO_WEIGHTS_ONLY]


def _launch_each(world_dirs, ft_root, world):
    out = {}
    for name, save in world_dirs.items():  # saved at TP 2: at 1 rank the load reshards
        common = [*TINY_MOCK, "training.train_iters=3",
                  f"parallelism.tensor_model_parallel_size={world}"]
        if name == "previous":
            common.append("checkpoint.on_corrupt=previous")
        out[name, "finetune"] = launch(*common, f"checkpoint.load={save}",
                                       "checkpoint.finetune=true",
                                       f"checkpoint.save={ft_root}/{name}")
        out[name, "resume"] = launch(*common, f"checkpoint.load={save}",
                                     f"checkpoint.save={save}")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_launcher_resume_and_finetune_refuse_a_crafted_checkpoint(run_distributed, crafted,
                                                                  tmp_path, world):
    # The TE extra state at 1 rank only: the same read as sharded_object's, refused alike at 2.
    left_out = {"base"} | ({"te_extra_state"} if world == 2 else set())
    dirs = {name: str(save) for name, (save, _) in crafted.items() if name not in left_out}
    results = run_distributed(_launch_crafted, dirs, str(tmp_path), world_size=world)
    for (name, how) in results[0]:
        save, marker = crafted[name]
        iteration = "iter_0000001" if name == "previous" else "iter_0000002"
        _check_refused([r[name, how] for r in results], save / iteration, marker, (name, how))
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
        assert not (tmp_path / name / "iter_0000003").exists()


def _import_hf(hf, ckpt):
    import mcore_ext
    from mcore_ext.hf import import_checkpoint

    mcore_ext.init_parallel()
    try:
        return import_checkpoint(hf, ckpt)
    finally:
        mcore_ext.destroy_parallel()


def _hf_export(ckpt, out) -> dict:
    """``python -m mcore_ext.hf export CKPT OUT`` on this rank, its output captured."""
    from mcore_ext.hf.__main__ import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["export", str(ckpt), str(out)])
    return {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


@pytest.fixture(scope="module")
def crafted_imports(run_distributed_shared, tmp_path_factory):
    """An ``hf import`` of the tiny Step-3.5 model, crafted: {name: (directory, marker)}."""
    from tests.hf import models

    tmp = tmp_path_factory.mktemp("safe_export")
    hf = models.write_released(str(tmp / "hf"))
    run_distributed_shared(_import_hf, hf, str(tmp / "base"), world_size=1)
    directory = tmp / "base" / "iter_0000000"
    objects = [index.fqn for index in pickle.load(open(directory / ".metadata", "rb")).storage_data
               if "_extra_state" in index.fqn]
    out = {}
    for name, craft in {"metadata": craft_metadata,
                        "sharded_object": lambda d, m: craft_object(d, objects[-1], m,
                                                                    Payload)}.items():
        shutil.copytree(tmp / "base", tmp / name)
        craft(tmp / name / "iter_0000000", tmp / f"marker_{name}")
        out[name] = (tmp / name, tmp / f"marker_{name}")
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["metadata", "sharded_object"])
def test_hf_export_refuses_a_crafted_checkpoint(run_distributed, crafted_imports, tmp_path,
                                                name, world):
    ckpt, marker = crafted_imports[name]
    results = run_distributed(_hf_export, ckpt, tmp_path / "out", world_size=world)
    _check_refused(results, ckpt / "iter_0000000", marker, name)
    assert not (tmp_path / "out").exists()


# The restricted read of the common state's byte object under DCP (safe_pickle.install, every
# entry's): test_launcher_resume_and_finetune_refuse_a_crafted_checkpoint's common_args; the
# Megatron-LM entry's one line for a refused pickle (main's refusal_in, as the launcher's):
# test_megatron_lm_entry_reads_a_legacy_torch_checkpoint_restricted.
@pytest.mark.slow
def test_megatron_lm_entry_refuses_a_crafted_checkpoint(crafted, tmp_path, name="common_args"):
    """The payload in the Megatron-LM ``args`` of the common state (its .metadata is read the
    same way as by the other paths; one torchrun of Megatron-LM costs minutes here)."""
    pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")
    from tests.functional.test_megatron_lm_checkpoints import MLM
    from tests.functional.test_megatron_lm_pretrain import MEGATRON_LM
    from tests.functional.test_pretrain import torchrun

    save, marker = crafted[name]
    result = torchrun(*MLM, "--train-iters", "3", "--load", str(save), "--save",
                      str(tmp_path / "mlm"), "--save-interval", "1000", program=MEGATRON_LM)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint file {save / 'iter_0000002'}"), errors
    assert f"holds a pickled {PAYLOAD_TYPE}" in errors[0], errors
    # No rank's traceback (torchrun's agent prints its own report after the ranks' line).
    assert "PickleRefused" not in result.stderr and "CheckpointException" not in result.stderr
    assert not marker.exists() and not (tmp_path / "mlm").exists()


def test_megatron_lm_entry_reads_a_legacy_torch_checkpoint_restricted(tmp_path):
    """Megatron-LM's ``--ckpt-format torch`` reads ``model_optim_rng.pt`` with torch's defaults:
    with torch's documented ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` a payload in its ``args`` ran
    and the run resumed (old code: the marker file made, exit 0). Now it is read as every other
    checkpoint pickle: one line naming the file and the type, exit 2, nothing run; the intact
    checkpoint resumes."""
    pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")
    from tests.functional.test_megatron_lm_checkpoints import MLM
    from tests.functional.test_megatron_lm_pretrain import MEGATRON_LM
    from tests.functional.test_pretrain import torchrun

    flags = [*MLM[:MLM.index("--ckpt-format")], "--ckpt-format", "torch", "--save-interval",
             "1000", "--override-opt_param-scheduler"]  # the resumes run to another length
    save, marker = tmp_path / "legacy", tmp_path / "PWNED"
    made = torchrun(*flags, "--train-iters", "2", "--save", str(save), program=MEGATRON_LM)
    assert made.returncode == 0, made.stderr[-3000:]
    (rank0,) = save.glob("iter_0000002/mp_rank_00/model_optim_rng.pt")
    # The intact one resumes through the restricted reader (its args, RNG and optimizer states).
    resumed = torchrun(*flags, "--train-iters", "3", "--load", str(save), "--save",
                       str(tmp_path / "resumed"), program=MEGATRON_LM)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loading checkpoint from {save} at iteration 2" in resumed.stdout, resumed.stdout[-3000:]
    assert (tmp_path / "resumed" / "iter_0000003").is_dir()
    state = torch.load(rank0, weights_only=False)  # our own file
    state["args"] = Payload(marker, state["args"])
    torch.save(state, rank0)
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        result = torchrun(*flags, "--train-iters", "3", "--load", str(save), "--save",
                          str(tmp_path / "next"), program=MEGATRON_LM)
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert not marker.exists(), "the payload ran"
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint file {rank0} holds a pickled "
                                f"{PAYLOAD_TYPE}"), errors
    assert not (tmp_path / "next").exists()


KEY = "MCORE_EXT_CHECKPOINT_KEY"


def _with_key(key, fn, *args):
    """``fn(*args)`` on this rank with the signing key ``MCORE_EXT_CHECKPOINT_KEY`` set (None:
    unset)."""
    previous = os.environ.pop(KEY, None)
    if key is not None:
        os.environ[KEY] = key
    try:
        return fn(*args)
    finally:
        os.environ.pop(KEY, None)
        if previous is not None:
            os.environ[KEY] = previous


def _resume(save, iters, *overrides):
    return launch(*TINY_MOCK, f"training.train_iters={iters}", "checkpoint.save_interval=1",
                  f"checkpoint.save={save}", f"checkpoint.load={save}", *overrides)


ONE_RANK = "parallelism.tensor_model_parallel_size=1"  # the checkpoints are TP 2: resharded


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(data)


SIGNATURES = {"signature_number": 12345, "signature_not_ascii": "\u00e9" * 64}


def _tamper(directory, how):
    """``flip``: a byte flipped; ``recrc``: and the manifest's CRC32 re-computed, the old
    signature kept; ``unsigned``: re-computed and written without a signature (no key);
    ``common_pt``: a ``common.pt`` added (``write_common_pt``: iteration 1, 123456 samples);
    ``signature_*``: the manifest's signature replaced by one of ``SIGNATURES``."""
    import json

    from mcore_ext.checkpoint import manifest

    path = directory / manifest.MANIFEST
    document = json.loads(path.read_text())
    if how in SIGNATURES:  # a signature that is not a hex string
        document["hmac_sha256"] = SIGNATURES[how]
        path.write_text(json.dumps(document))
        return
    if how == "common_pt":  # the issue's: its own common state, another iteration and position
        write_common_pt(directory, lambda c: dict(c, iteration=1, consumed_samples=123456))
        return
    _flip(directory / "__1_0.distcp")
    if how == "recrc":
        size, crc, _ = manifest._checksum(str(directory / "__1_0.distcp"))
        document["files"]["__1_0.distcp"]["crc32"] = f"{crc:08x}"
        path.write_text(json.dumps(document))
    elif how == "unsigned":
        _with_key(None, _rewrite_manifest, directory)


@pytest.fixture(scope="module")
def signed(crafted, tmp_path_factory):
    """{how: save directory}: the base run (signed with its key file "k3y"), and copies of it
    tampered ``how``; the tests give the key in the environment."""
    tmp = tmp_path_factory.mktemp("signed")
    shutil.copytree(crafted["base"][0], tmp / "base")
    out = {"base": tmp / "base"}
    for how in ("flip", "recrc", "unsigned", "common_pt", *SIGNATURES):
        shutil.copytree(tmp / "base", tmp / how)
        _tamper(tmp / how / "iter_0000002", how)
        out[how] = tmp / how
    return out


def test_signed_manifest_verifies_only_with_its_key(signed, monkeypatch):
    import json

    document = json.loads((signed["base"] / "iter_0000002" / "mcore_ext_manifest.json").read_text())
    assert len(document["hmac_sha256"]) == 64
    assert all(len(entry["sha256"]) == 64 for entry in document["files"].values())
    code, out, _ = _inspect(signed["base"])  # no key: the CRC32s, as before
    assert code == 0 and "verified: all" in out
    monkeypatch.setenv(KEY, "k3y")
    code, out, _ = _inspect(signed["base"])
    assert code == 0 and "verified: all" in out
    monkeypatch.setenv(KEY, "another")
    code, out, err = _inspect(signed["base"])
    assert code == 2 and "mcore_ext_manifest.json: signature does not verify" in out, out
    assert err.startswith(f"error: checkpoint {signed['base'] / 'iter_0000002'} is corrupt: "
                          "mcore_ext_manifest.json signature does not verify") and (
        err.count("\n") == 1), err
    assert "tensors in" not in out  # refused as a load is: nothing more read


@pytest.mark.parametrize("how, problem", [
    ("flip", "__1_0.distcp: checksum mismatch"),
    ("recrc", "mcore_ext_manifest.json: signature does not verify"),
    ("unsigned", "mcore_ext_manifest.json: not signed"),
])
def test_signed_checkpoint_tampered_is_refused_with_the_key(signed, monkeypatch, how, problem):
    monkeypatch.setenv(KEY, "k3y")
    code, out, err = _inspect(signed[how])
    assert code == 2 and f"CORRUPT: {signed[how] / 'iter_0000002'}/{problem}" in out, out
    assert err.startswith(f"error: checkpoint {signed[how] / 'iter_0000002'} is corrupt: "
                          f"{problem.replace(':', '', 1)}") and err.count("\n") == 1, err
    if how == "unsigned":  # without the key, a manifest re-computed in full hides the flip
        monkeypatch.delenv(KEY)
        code, out, _ = _inspect(signed[how])
        assert code == 0, out


def _resume_with_and_without_key(save):
    """The resume of ``save`` with the key, then without (stdout, stderr, code)."""
    keyed = _with_key("k3y", _resume, save, 3, ONE_RANK)
    keyed["saved"] = os.path.exists(os.path.join(save, "iter_0000003"))
    return {"key": keyed, "no_key": _with_key(None, _resume, save, 3, ONE_RANK)}


def test_a_file_the_signed_manifest_does_not_list_refuses_every_load(run_distributed, signed,
                                                                     tmp_path, monkeypatch):
    """Issue 44.1: a ``common.pt`` added to a signed checkpoint (megatron prefers it to the common
    state the save wrote) is refused with the key by ``inspect --verify`` and the launcher's
    resume, naming it, before anything is read; without the key the resume is told about it."""
    directory = signed["common_pt"] / "iter_0000002"
    monkeypatch.setenv(KEY, "k3y")
    code, out, err = _inspect(signed["common_pt"])  # exit 1 on the old code, and read on
    assert code == 2 and f"CORRUPT: {directory}/common.pt: not in the manifest" in out, out
    assert err.startswith(f"error: checkpoint {directory} is corrupt: common.pt not in the "
                          "manifest") and err.count("\n") == 1, err
    monkeypatch.delenv(KEY)
    shutil.copytree(signed["common_pt"], tmp_path / "copy")
    (result,) = run_distributed(_resume_with_and_without_key, tmp_path / "copy", world_size=1)
    keyed = result["key"]
    assert keyed["code"] == 2, keyed
    (line,) = keyed["stderr"].splitlines()
    assert line.startswith(f"error: checkpoint {tmp_path / 'copy' / 'iter_0000002'} is corrupt: "
                           "common.pt not in the manifest"), line
    assert not keyed["saved"]
    plain = result["no_key"]  # a legacy common.pt, read restricted; named, as megatron reads it
    warned = [w for w in plain["stderr"].splitlines() if "common.pt" in w]
    assert len(warned) == 1 and warned[0].startswith("warning: checkpoint ") and (
        "not in its manifest" in warned[0]), plain["stderr"]


@pytest.mark.parametrize("how", list(SIGNATURES))
def test_a_signature_that_is_not_a_string_of_hex_digits_does_not_verify(run_distributed, signed,
                                                                        monkeypatch, how):
    """Issue 44.3: ``"hmac_sha256": 12345`` or a non-ASCII string raised TypeError (a traceback)."""
    monkeypatch.setenv(KEY, "k3y")
    code, out, _ = _inspect(signed[how])
    assert code == 2 and "mcore_ext_manifest.json: signature does not verify" in out, out
    monkeypatch.delenv(KEY)
    (result,) = run_distributed(_with_key, "k3y", _resume, signed[how], 3, ONE_RANK,
                                world_size=1)
    assert result["code"] == 2, result
    (line,) = result["stderr"].splitlines()
    assert line.startswith(f"error: checkpoint {signed[how] / 'iter_0000002'} is corrupt: "
                           "mcore_ext_manifest.json signature does not verify"), line


def _from_another_run(directory):
    """What another run signed with the same key saved as this iteration: the folder's own
    files under a manifest naming another run id, signed with the key "k3y"."""
    from mcore_ext.checkpoint import manifest

    entries = manifest.read(str(directory))
    _with_key("k3y", manifest.write, str(directory), entries, 2, "another-run-of-the-same-key")


def _copy_over(save, source, target):
    """``cp -r save/source save/target`` after removing the target (what the issue did)."""
    shutil.rmtree(save / target)
    shutil.copytree(save / source, save / target)


@pytest.mark.parametrize("how, problem", [
    ("another_iteration", "mcore_ext_manifest.json: signed for iteration 1, but the folder is "
                          "iter_0000002: a checkpoint copied over another iteration's"),
    ("another_run", "mcore_ext_manifest.json: belongs to run another-run-of-the-same-key, but its "
                    "save directory {save} is run "),
])
def test_a_signed_folder_is_refused_under_another_iterations_name_or_in_another_run(
        run_distributed, signed, tmp_path, monkeypatch, how, problem):
    """Issue 54.5: with the key, iteration 1's folder copied over iteration 2's (which the tracker
    names) passed ``inspect --verify``, and a resume reported iteration 2's folder while training
    on from iteration 1's state; a folder another run signed with the same key is refused there
    too. Both: inspect --verify and the launcher's resume refuse it, one line, exit code 2."""
    save = tmp_path / "save"
    shutil.copytree(signed["base"], save)
    if how == "another_iteration":
        _copy_over(save, "iter_0000001", "iter_0000002")
    else:
        _from_another_run(save / "iter_0000002")
    problem = problem.format(save=save)
    monkeypatch.setenv(KEY, "k3y")
    code, out, err = _inspect(save)
    assert code == 2 and f"CORRUPT: {save / 'iter_0000002'}/{problem}" in out, out
    monkeypatch.delenv(KEY)
    (result,) = run_distributed(_with_key, "k3y", _resume, save, 3, ONE_RANK, world_size=1)
    assert result["code"] == 2, result
    (line,) = result["stderr"].splitlines()
    assert line.startswith(f"error: checkpoint {save / 'iter_0000002'} is corrupt: "
                           f"{problem.replace(':', '', 1)}"), line
    assert not (save / "iter_0000003").exists()


def test_launcher_with_the_key_resumes_a_signed_checkpoint_and_refuses_a_re_crc_ed_one(
        run_distributed, signed, tmp_path):
    shutil.copytree(signed["base"], tmp_path / "good")
    results = run_distributed(_with_key, "k3y", _resume, tmp_path / "good", 3, world_size=2)
    assert [r["code"] for r in results] == [0, 0], results
    results = run_distributed(_with_key, "k3y", _resume, signed["recrc"], 3, world_size=2)
    assert [r["code"] for r in results] == [2, 2], results
    (line,) = results[0]["stderr"].splitlines()
    assert line.startswith(f"error: checkpoint {signed['recrc'] / 'iter_0000002'} is corrupt: "
                           "mcore_ext_manifest.json signature does not verify"), line
    assert not (signed["recrc"] / "iter_0000003").exists()


@pytest.mark.parametrize("how, key, problem", [
    # The same verification as common_pt (verified_loads), without a key: slow for CI's time.
    pytest.param("flip", None, "__1_0.distcp checksum mismatch", marks=pytest.mark.slow),
    pytest.param("recrc", "k3y", "mcore_ext_manifest.json signature does not verify",
                 marks=pytest.mark.slow),
    # Issue 44.1 on this load path. Slow since issue 54.3: megatron's own chooser of the folder
    # is run verified in-process (tests/unit/test_megatron_lm_verified_loads.py), and the entry's
    # verified_loads is active under torchrun in
    # test_megatron_lm_entry_reads_a_legacy_torch_checkpoint_restricted.
    pytest.param("common_pt", "k3y", "common.pt not in the manifest", marks=pytest.mark.slow),
])
def test_megatron_lm_entry_verifies_a_launcher_checkpoint_before_loading(
        signed, tmp_path, monkeypatch, how, key, problem):
    """The Megatron-LM entry resumes the launcher's checkpoints (test_megatron_lm_checkpoints):
    one whose file differs from its manifest is refused as the launcher refuses it, and with the
    key set one re-CRC'd without it, or with a file the signed manifest does not list (megatron
    would take the iteration from an added ``common.pt``); one line, exit code 2, nothing saved."""
    pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")
    from tests.functional.test_megatron_lm_checkpoints import MLM
    from tests.functional.test_megatron_lm_pretrain import MEGATRON_LM
    from tests.functional.test_pretrain import torchrun

    monkeypatch.delenv(KEY, raising=False)
    if key is not None:
        monkeypatch.setenv(KEY, key)
    result = torchrun(*MLM, "--train-iters", "3", "--load", str(signed[how]), "--save",
                      str(tmp_path / "mlm"), "--save-interval", "1000", program=MEGATRON_LM)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint {signed[how] / 'iter_0000002'} is corrupt: "
                                f"{problem}"), errors
    assert "Traceback" not in result.stderr.split(errors[0])[0], result.stderr[-3000:]
    assert not (tmp_path / "mlm").exists()


@pytest.mark.slow  # the same check as tests/unit/test_megatron_lm_verified_loads.py, by torchrun
def test_megatron_lm_entry_with_the_key_refuses_an_untracked_torch_checkpoint_named_by_step(
        tmp_path, monkeypatch):
    """Issue 54.3 as reported: a ``--ckpt-format torch`` save, its tracker removed, ``--load DIR
    --ckpt-step 2`` with the key: the old code loaded it ("successfully loaded checkpoint ... at
    iteration 2", exit 0); now one line, refused before megatron reads it."""
    pytest.importorskip("megatron.training.models.gpt", reason="megatron.training >= 0.19")
    from tests.functional.test_megatron_lm_checkpoints import MLM
    from tests.functional.test_megatron_lm_pretrain import MEGATRON_LM
    from tests.functional.test_pretrain import torchrun

    flags = [*MLM[:MLM.index("--ckpt-format")], "--ckpt-format", "torch", "--save-interval",
             "1000", "--override-opt_param-scheduler"]
    save = tmp_path / "legacy"
    monkeypatch.delenv(KEY, raising=False)
    made = torchrun(*flags, "--train-iters", "2", "--save", str(save), program=MEGATRON_LM)
    assert made.returncode == 0, made.stderr[-3000:]
    (save / "latest_checkpointed_iteration.txt").unlink()
    monkeypatch.setenv(KEY, "k3y")
    result = torchrun(*flags, "--train-iters", "3", "--load", str(save), "--ckpt-step", "2",
                      "--save", str(tmp_path / "next"), program=MEGATRON_LM)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: checkpoint {save / 'iter_0000002'} is corrupt: "
                                "mcore_ext_manifest.json missing"), errors
    assert "successfully loaded" not in result.stdout
    assert not (tmp_path / "next").exists()


def test_a_key_file_that_cannot_be_read_is_one_config_error(tmp_path):
    from tests.functional.test_pretrain import launcher

    (tmp_path / "empty").write_text("\n")
    for path, what in ((tmp_path / "missing", "cannot read it"), (tmp_path / "empty", "is empty")):
        result = launcher("--config", TINY_MOCK[1], f"checkpoint.key_file={path}",
                          "parallelism.tensor_model_parallel_size=1", "--check")
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(
            f"error: checkpoint.key_file={path}"), result.stderr
        assert what in result.stderr


def _import_signed(hf, ckpt):
    return _with_key("k3y", _import_hf, hf, ckpt)


def _edit(path, key, value):
    import json

    import yaml

    if path.suffix == ".json":
        document = json.loads(path.read_text())
        old = document[key]  # the released config: one rope_theta per layer
        document[key] = [value] * len(old) if isinstance(old, list) else value
        path.write_text(json.dumps(document))
    else:
        document = yaml.safe_load(path.read_text())
        document["model"][key] = value
        path.write_text(yaml.safe_dump(document))


@pytest.fixture(scope="module")
def signed_import(run_distributed_shared, tmp_path_factory):
    """A signed ``hf import`` of the tiny Step-3.5 model and copies of it, each with one file
    changed after the save: {name: (save directory, the file)}."""
    from tests.hf import models

    tmp = tmp_path_factory.mktemp("signed_import")
    hf = models.write_released(str(tmp / "hf"))
    run_distributed_shared(_import_signed, hf, str(tmp / "base"), world_size=1)
    out = {"base": (tmp / "base", None)}
    for name, file, key in (("hf_config", "hf_config.json", "rope_theta"),
                            ("config_yaml", "config.yaml", "rotary_base"),
                            ("added", "common.pt", None)):
        shutil.copytree(tmp / "base", tmp / name)
        path = tmp / name / "iter_0000000" / file
        if key is None:
            write_common_pt(path.parent)
        else:
            _edit(path, key, 777)
        out[name] = (tmp / name, file)
    return out


def _export_with_key(ckpt, out):
    return _with_key("k3y", _hf_export, ckpt, out)


@pytest.mark.parametrize("name", ["hf_config", "config_yaml", "added"])
def test_export_of_a_signed_checkpoint_refuses_a_changed_or_added_sidecar(
        run_distributed, signed_import, tmp_path, monkeypatch, name):
    """Issue 44.4 (and 44.1 for ``hf export``): what an export builds its model from (the HF
    config, config.yaml's model section, LoRA's rank and alpha there) is signed; rope_theta or
    rotary_base changed to 777 after the save, or a file added, is refused with the key by
    ``inspect --verify`` and by the export, naming the file; nothing is written."""
    ckpt, file = signed_import[name]
    directory = ckpt / "iter_0000000"
    problem = "not in the manifest" if name == "added" else ""  # its size or checksum
    monkeypatch.setenv(KEY, "k3y")
    code, out, _ = _inspect(ckpt)
    assert code == 2 and f"CORRUPT: {directory}/{file}: {problem}" in out, out
    monkeypatch.delenv(KEY)
    (result,) = run_distributed(_export_with_key, ckpt, tmp_path / "out", world_size=1)
    assert result["code"] == 2, result
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint {directory} is corrupt: {file} {problem}"), result["stderr"]
    assert "Traceback" not in result["stderr"]
    assert not (tmp_path / "out").exists()


def test_export_of_a_signed_checkpoint_with_the_key_writes_the_signed_config(
        run_distributed, signed_import, tmp_path):
    """The unchanged signed import exports with the key (its config.yaml and hf_config.json
    verify as signed)."""
    (result,) = run_distributed(_export_with_key, signed_import["base"][0], tmp_path / "out",
                                world_size=1)
    assert result["code"] == 0, result
    assert "777" not in (tmp_path / "out" / "config.json").read_text()


SFT_TOKENIZER = ROOT / "configs" / "sft_tiny" / "tokenizer"
SFT_CHAT = ROOT / "configs" / "sft_tiny" / "chat.jsonl"


def _import_and_fine_tune(hf, ckpt, run):
    """With the key: ``hf import HF CKPT``, then 2 steps of the launcher on chat data from the
    config the import wrote (its tokenizer/ and its chat template), saved in RUN."""
    def steps():
        directory = _import_hf(hf, ckpt)
        return launch("--config", f"{directory}/config.yaml", "data.source=chat",
                      f"data.path={SFT_CHAT}", f"checkpoint.load={ckpt}",
                      "checkpoint.finetune=true", f"checkpoint.save={run}",
                      "training.micro_batch_size=2", "training.global_batch_size=2",
                      "training.train_iters=2", "training.eval_interval=null",
                      "optimizer.lr_warmup_iters=0",
                      "logging.log_interval=1", "logging.metrics_file=null")

    return _with_key("k3y", steps)


@pytest.fixture(scope="module")
def signed_sft(run_distributed_shared, tmp_path_factory):
    """The issue's chain, signed: a tiny Step-3.5 folder with a ChatML tokenizer (259 tokens,
    the model's 257 rows) imported, fine-tuned 2 steps on chat data. (import root, run root)."""
    from tests.hf import models

    tmp = tmp_path_factory.mktemp("signed_sft")
    hf = models.write_released(str(tmp / "hf"))
    for name in os.listdir(SFT_TOKENIZER):
        shutil.copyfile(SFT_TOKENIZER / name, os.path.join(hf, name))
    (result,) = run_distributed_shared(_import_and_fine_tune, hf, str(tmp / "ckpt"),
                                       str(tmp / "run"), world_size=1)
    assert result["code"] == 0, result
    return tmp / "ckpt", tmp / "run"


@pytest.mark.parametrize("tamper, problem", [
    (None, None),
    # The issue's: both; the hf_config.json is what the export reads first.
    ("template+hf_config", "iter_0000000 is corrupt: hf_config.json missing"),
    ("template", "iter_0000000 is corrupt: tokenizer/chat_template.jinja digest mismatch"),
])
def test_export_with_the_key_refuses_a_signed_file_changed_or_deleted_up_the_chain(
        run_distributed, signed_sft, tmp_path, tamper, problem):
    """Issue 54.2: in the import a fine-tuned run came from, the chat template overwritten and
    hf_config.json deleted: the old code exported (exit 0) the changed template and a config.json
    of the tokenizer's 259 tokens instead of 257, without bos / eos; find_provenance passed over
    the missing signed file and the tokenizer folder was copied unchecked. Now one line, exit 2,
    nothing written; the untouched chain exports its signed config and template."""
    import json

    ckpt, run = signed_sft  # changed in place (the run's signed config.yaml names them), restored
    imported = ckpt / "iter_0000000"
    template = imported / "tokenizer" / "chat_template.jinja"
    hf_config = imported / "hf_config.json"
    signed_template, signed_config = template.read_bytes(), hf_config.read_bytes()
    try:
        if tamper is not None:  # another template of the same size: its bytes tell
            other = b"{% for m in messages %}{{ m['content'] }}{% endfor %}"
            template.write_bytes(other.ljust(len(signed_template)))
        if tamper == "template+hf_config":
            hf_config.unlink()
        (result,) = run_distributed(_export_with_key, run, tmp_path / "out", world_size=1)
    finally:
        template.write_bytes(signed_template)
        hf_config.write_bytes(signed_config)
    if problem is None:
        assert result["code"] == 0, result
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["vocab_size"] == 257 and config["eos_token_id"] == 256, config
        assert (tmp_path / "out" / "chat_template.jinja").read_bytes() == signed_template
        return
    assert result["code"] == 2, result
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint {ckpt}/{problem}"), (
        result["stderr"])
    assert not (tmp_path / "out").exists()


def test_resuming_with_the_key_refuses_a_changed_chat_template_of_the_import(
        run_distributed, signed_sft, tmp_path):
    """The same files feed training: a chat run with the key whose data.tokenizer is the import's
    tokenizer/ reads it only as signed. Resuming the fine-tuned run (its own checkpoint: the
    import is not what it loads, and was not verified) with the import's template changed: the
    old code resumed and trained on conversations rendered by the changed template (exit 0); now
    one line, exit 2, nothing saved."""
    ckpt, run = signed_sft
    shutil.copytree(run, tmp_path / "run")
    template = ckpt / "iter_0000000" / "tokenizer" / "chat_template.jinja"
    signed_template = template.read_bytes()
    try:
        template.write_bytes(b"{{ messages }}".ljust(len(signed_template)))
        (result,) = run_distributed(
            _with_key, "k3y", launch, "--config", ckpt / "iter_0000000" / "config.yaml",
            "data.source=chat", f"data.path={SFT_CHAT}", f"checkpoint.load={ckpt}",
            "checkpoint.finetune=true", f"checkpoint.save={tmp_path / 'run'}",
            "training.micro_batch_size=2", "training.global_batch_size=2",
            "training.train_iters=3", "optimizer.lr_warmup_iters=0",
            "training.eval_interval=null", "logging.metrics_file=null", world_size=1)
    finally:
        template.write_bytes(signed_template)
    assert result["code"] == 2, result
    (line,) = [x for x in result["stderr"].splitlines() if x.startswith("error: ")]
    assert "tokenizer/chat_template.jinja digest mismatch" in line and (
        f"checkpoint {ckpt / 'iter_0000000'} is corrupt" in line), line
    assert not (tmp_path / "run" / "iter_0000003").exists()
