"""A LoRA run's checkpoint: the adapters, and a reference to the base checkpoint under them.

    <save>/iter_N/   the adapters' tensors, their optimizer state, scheduler, RNG (torch_dist)
                     common state "lora_base": {"directory": the base's iteration directory,
                                                "iteration": its iteration,
                                                "fingerprint": sha256 of its manifest's entries}

The frozen base weights are not written again (a fine-tuning run of a large model saves
megabytes, not the model): a resume loads them from the base checkpoint and the adapters from
the run's own. The fingerprint is that of the base's manifest (every file's size and CRC32), so
a base rewritten since the adapters were saved (retrained, re-imported, damaged) is found before
anything is loaded; a base without a manifest (Megatron-LM's) is fingerprinted by its files'
checksums, computed here. A base that moved is found by ``checkpoint.load`` naming its new place
(the same fingerprint).
"""

import hashlib
import json
import os

from mcore_ext.checkpoint import manifest
from mcore_ext.checkpoint.directory import find_checkpoint
from mcore_ext.checkpoint.errors import CheckpointCorruptError, CheckpointLoadError

# The common-state key of an adapters-only checkpoint.
BASE_KEY = "lora_base"


def fingerprint(directory: str) -> str:
    """sha256 of the checkpoint's manifest entries (its files' sizes and checksums); without a
    manifest, of the same entries computed from the files."""
    entries = manifest.read(directory)
    if entries is None:
        names = [os.path.relpath(os.path.join(parent, name), directory)
                 for parent, _, files in os.walk(directory) for name in files]
        entries = manifest.describe(directory, sorted(names))
    described = {name: {"size": e["size"], "crc32": e["crc32"]} for name, e in entries.items()}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def base_reference(directory: str, iteration: int | None) -> dict:
    """What an adapters-only checkpoint records of its base checkpoint ``directory``."""
    return {"directory": os.path.abspath(directory), "iteration": iteration,
            "fingerprint": fingerprint(directory)}


def find_base(reference: dict, adapters_dir: str, load: str | None = None) -> str:
    """The base checkpoint directory of the adapters in ``adapters_dir``: the recorded one, else
    (moved) the one ``load`` names; verified against its manifest. CheckpointLoadError, one line,
    when it is missing or is not the checkpoint the adapters were trained on."""
    directory = reference["directory"]
    if not os.path.isdir(directory) and load:
        found = find_checkpoint(load)
        directory = found.directory if found is not None else directory
    where = f"the LoRA adapters in {adapters_dir} were trained on the base checkpoint {directory}"
    if not os.path.isdir(directory):
        raise CheckpointLoadError(
            f"{where}, which does not exist: restore it, or name its new place in checkpoint.load")
    if fingerprint(directory) != reference["fingerprint"]:
        raise CheckpointLoadError(
            f"{where} (iteration {reference['iteration']}), which has changed since they were "
            "saved (its manifest differs): restore that base, or start new adapters on this one "
            "(checkpoint.finetune=true with an empty checkpoint.save)")
    problems = manifest.verify_checkpoint(directory)
    if problems:
        raise CheckpointCorruptError(
            f"{where}, which is corrupt: {manifest.summary(problems)}")
    return directory
