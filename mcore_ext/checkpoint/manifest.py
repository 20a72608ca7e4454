"""What a save wrote, so that a load can check it: every file's size and CRC32.

    <iter_N>/mcore_ext_manifest.json   {"format": 1, "checksum": "crc32",
                                        "files": {name: {"size": bytes, "crc32": "8 hex digits"}}}

Who computes what: each rank checksums the files it wrote itself, in parallel, right after writing
them (they are still in the page cache): megatron's torch_dist writer names a rank's data files
``__<global rank>_<n>.distcp``; rank 0 takes the shared ones (``.metadata``, ``metadata.json``).
Rank 0 gathers the entries and writes the manifest inside the ``.saving.`` directory before that
is renamed into place (``saving.publish``), so no published checkpoint lacks it and no rank reads
another rank's files. What megatron wrote is covered; the launcher's ``config.yaml`` and
``hf_config.json`` beside it are not: they are for people to read, and edit. Verification splits
the files over the ranks (round robin) and gathers the findings, so every file is read once
whatever the world size; a rank's data file in the folder that the manifest does not list fails
it too (a save published without that rank's entries).

CRC32 (zlib, about 3 GB/s per core) catches every single-bit flip and every burst of up to 32
bits, other random damage but for a 2^-32 chance; sizes catch truncation first. It is no defence
against deliberate tampering; a signing key (``signing``: SHA-256 per file, an HMAC over the
manifest) is. Checkpoints without a manifest (saved before it existed, or by
Megatron-LM) load unverified.
"""

import hashlib
import json
import os
import re
import zlib

import torch.distributed as dist

from mcore_ext.checkpoint import signing
from mcore_ext.checkpoint.directory import Checkpoint, iteration_dir, iterations_in

MANIFEST = "mcore_ext_manifest.json"
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_CHUNK = 16 * 2**20


def files_of_rank(directory: str, rank: int) -> list[str]:
    """The files of ``directory`` (relative paths) that ``rank`` wrote: its ``__<rank>_*.distcp``,
    and on rank 0 every file no rank's name claims."""
    mine = []
    for parent, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(parent, name), directory)
            if relative == MANIFEST:
                continue
            owner = _RANK_FILE.search(name)
            if (int(owner.group(1)) if owner else 0) == rank:
                mine.append(relative)
    return sorted(mine)


def describe(directory: str, names) -> dict:
    """{name: {"size", "crc32"}} of the files ``names`` under ``directory``; with a signing key
    (``signing``) also "sha256"."""
    entries = {}
    digest = signing.key() is not None
    for name in names:
        size, crc, sha = _checksum(os.path.join(directory, name), digest)
        entries[name] = {"size": size, "crc32": f"{crc:08x}", **({"sha256": sha} if sha else {})}
    return entries


def write(directory: str, entries: dict) -> None:
    """Write the manifest of ``entries`` (a rename: never half a manifest)."""
    path = os.path.join(directory, MANIFEST)
    document = {"format": 1, "checksum": "crc32", "files": dict(sorted(entries.items()))}
    if (secret := signing.key()) is not None:
        document[signing.FIELD] = signing.signature(document["files"], secret)
    with open(path + ".tmp", "w") as f:
        json.dump(document, f, indent=1)
    os.replace(path + ".tmp", path)


def read(directory: str) -> dict | None:
    """{name: entry} of the manifest, or None when the checkpoint has none."""
    document = _read_document(directory)
    return None if document is None else document["files"]


def _read_document(directory: str) -> dict | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def verify(directory: str, entries: dict) -> list[tuple[str, str]]:
    """What differs from ``entries`` ({name: entry}): (name, problem) pairs."""
    problems = []
    for name, entry in sorted(entries.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append((name, "missing"))
            continue
        size = os.path.getsize(path)
        if size < entry["size"]:
            problems.append((name, f"truncated ({size} of {entry['size']} bytes)"))
        elif size > entry["size"]:
            problems.append((name, f"has {size} bytes, {entry['size']} recorded"))
        else:
            _, crc, sha = _checksum(path, "sha256" in entry)
            if f"{crc:08x}" != entry["crc32"]:
                problems.append((name, "checksum mismatch (its CRC32 is not the one recorded)"))
            elif sha is not None and sha != entry["sha256"]:
                problems.append((name, "digest mismatch (its SHA-256 is not the one signed)"))
    return problems


def summary(problems: list[tuple[str, str]]) -> str:
    """The first problem, and how many more: "<name> <problem> (and N more files)"."""
    name, what = problems[0]
    more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
    return f"{name} {what}{more}"


def verify_checkpoint(directory: str, collective: bool = True) -> list[tuple[str, str]] | None:
    """The problems of ``directory`` against its manifest ([] when intact); None without a
    manifest. ``collective`` (and torch.distributed initialized): every rank calls it, each
    reads a share of the files, every rank returns all findings. With a signing key
    (``signing``), a manifest that is missing, unsigned or not signed with it is a problem."""
    try:
        document = _read_document(directory)
        entries = None if document is None else document["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [(MANIFEST, f"unreadable ({type(err).__name__}: {err})")]
    if (unsigned := signing.problem(document)) is not None:
        return [(MANIFEST, unsigned)]
    if entries is None:
        return None
    unlisted = unlisted_rank_files(directory, entries)
    if not (collective and dist.is_initialized()):
        return sorted(verify(directory, entries) + unlisted)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(entries)[rank::world]
    found = [None] * world
    dist.all_gather_object(found, verify(directory, {n: entries[n] for n in names}))
    return sorted([problem for problems in found for problem in problems] + unlisted)


def unlisted_rank_files(directory: str, entries: dict) -> list[tuple[str, str]]:
    """The ranks' data files (``__<rank>_<n>.distcp``) in ``directory`` that ``entries`` does
    not list, as problems: a save published without a rank's entries is not intact."""
    return [(name, "not in the manifest (the save did not record it)")
            for name in sorted(os.listdir(directory))
            if _RANK_FILE.fullmatch(name) and name not in entries]


def newest_verified(root: str, before: int):
    """The newest ``iter_*`` checkpoint under ``root`` older than ``before`` whose files match its
    manifest (a ``directory.Checkpoint``), or None; ones without a manifest are skipped.
    Collective like ``verify_checkpoint``."""
    for iteration in reversed([i for i in iterations_in(root) if i < before]):
        directory = iteration_dir(root, iteration)
        if verify_checkpoint(directory) == []:
            return Checkpoint(directory, iteration, root=root)
    return None


def _checksum(path: str, digest: bool = False) -> tuple[int, int, str | None]:
    """(size, CRC32, SHA-256 hex when ``digest`` else None) of the file, in one read."""
    crc, size, sha = 0, 0, hashlib.sha256() if digest else None
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            if sha is not None:
                sha.update(chunk)
            size += len(chunk)
    return size, crc, None if sha is None else sha.hexdigest()
