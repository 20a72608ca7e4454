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

from tests.functional.inprocess import TINY_MOCK, launch
from tests.functional.test_pretrain import GATED_QKV

PAYLOAD_TYPE = "builtins.eval"
# The gated QKV layers' byte objects (GPTModel's stacked layers, a shard per layer, or
# HybridModel's attention layers, one each): the last layer's is crafted.
SHARDED_OBJECT = re.compile(GATED_QKV + r"\._extra_state/shard_\d+_\d+")


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


CRAFTS = {
    "metadata": lambda d, m: craft_metadata(d, m),
    "common_args": lambda d, m: craft_object(d, "common_state/shard_0_1", m, _in_args),
    "sharded_object": lambda d, m: craft_object(d, SHARDED_OBJECT, m, Payload),
}


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
def test_inspect_verify_refuses_a_crafted_checkpoint(crafted, name):
    save, marker = crafted[name]
    code, out, err = _inspect(save)
    (line,) = err.splitlines()
    assert code == 2 and line.startswith(f"error: checkpoint file {save}/iter_0000002/"), err
    assert f"holds a pickled {PAYLOAD_TYPE}" in line, line
    assert "verified: all" in out  # the CRC32 manifest matches: it is no defence against this
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

    out = {}
    for name, save in world_dirs.items():  # saved at TP 2: at 1 rank the load reshards
        common = [*TINY_MOCK, "training.train_iters=3",
                  f"parallelism.tensor_model_parallel_size={dist.get_world_size()}"]
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
    dirs = {name: str(save) for name, (save, _) in crafted.items() if name != "base"}
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


def _resume(save, iters):
    return launch(*TINY_MOCK, f"training.train_iters={iters}", "checkpoint.save_interval=1",
                  f"checkpoint.save={save}", f"checkpoint.load={save}")


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(data)


def _tamper(directory, how):
    """``flip``: a byte flipped; ``recrc``: and the manifest's CRC32 re-computed, the old
    signature kept; ``unsigned``: re-computed and written without a signature (no key)."""
    import json

    from mcore_ext.checkpoint import manifest

    _flip(directory / "__1_0.distcp")
    path = directory / manifest.MANIFEST
    document = json.loads(path.read_text())
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
    for how in ("flip", "recrc", "unsigned"):
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
    code, out, _ = _inspect(signed["base"])
    assert code == 1 and "mcore_ext_manifest.json: signature does not verify" in out, out


@pytest.mark.parametrize("how, problem", [
    ("flip", "__1_0.distcp: checksum mismatch"),
    ("recrc", "mcore_ext_manifest.json: signature does not verify"),
    ("unsigned", "mcore_ext_manifest.json: not signed"),
])
def test_signed_checkpoint_tampered_is_refused_with_the_key(signed, monkeypatch, how, problem):
    monkeypatch.setenv(KEY, "k3y")
    code, out, _ = _inspect(signed[how])
    assert code == 1 and f"CORRUPT: {signed[how] / 'iter_0000002'}/{problem}" in out, out
    if how == "unsigned":  # without the key, a manifest re-computed in full hides the flip
        monkeypatch.delenv(KEY)
        code, out, _ = _inspect(signed[how])
        assert code == 0, out


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
    ("flip", None, "__1_0.distcp checksum mismatch"),
    pytest.param("recrc", "k3y", "mcore_ext_manifest.json signature does not verify",
                 marks=pytest.mark.slow),
])
def test_megatron_lm_entry_verifies_a_launcher_checkpoint_before_loading(
        signed, tmp_path, monkeypatch, how, key, problem):
    """The Megatron-LM entry resumes the launcher's checkpoints (test_megatron_lm_checkpoints):
    one whose file differs from its manifest is refused as the launcher refuses it, and with the
    key set one re-CRC'd without it; one line, exit code 2, nothing saved."""
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
