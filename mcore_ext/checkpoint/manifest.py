"""What a save wrote, so that a load can check it: every file's size and CRC32.

    <iter_N>/mcore_ext_manifest.json   {"format": 1, "checksum": "crc32", "iteration": N,
                                        "run": the save directory's run id (directory.RUN_FILE),
                                        "files": {name: {"size": bytes, "crc32": "8 hex digits"}}}

Who computes what: each rank checksums the files it wrote itself, in parallel, right after writing
them (they are still in the page cache): megatron's torch_dist writer names a rank's data files
``__<global rank>_<n>.distcp``; rank 0 takes the shared ones (``.metadata``, ``metadata.json``).
Rank 0 gathers the entries and writes the manifest inside the ``.saving.`` directory before that
is renamed into place (``saving.publish``), so no published checkpoint lacks it and no rank reads
another rank's files. Every file of the folder is listed: what megatron wrote, and what rank 0
adds (``EDITABLE``: the launcher's ``config.yaml``, ``hf import``'s ``hf_config.json``, from which
a load or an export builds its model; ``hf import``'s ``tokenizer/``). Verification splits the
files over the ranks (round robin) and gathers the findings, so every file is read once whatever
the world size; a rank's data file in the folder that the manifest does not list fails it too (a
save published without that rank's entries).

Without a key the ``EDITABLE`` files are for people to read and edit: recorded, never checked.
With a key (``signing``) they are signed like the rest, with the folder's iteration and run
(a folder copied over another iteration's, or from another run of the same key, is refused where
it lies: ``_binding_problem``), and every file in the folder must be listed: anything added (a
``common.pt``, which megatron's ``load_common_state_dict`` reads in preference to the common
state the save wrote) refuses the load, naming it. Every megatron load
of a directory passes ``check_before_read`` first (``_mcore_compat.guard_checkpoint_loads``), so
no load path (the launcher's, ``hf export``'s, the Megatron-LM entry's, a Megatron-Bridge
process's) reads a checkpoint that does not verify with the key.

CRC32 (zlib, about 3 GB/s per core) catches every single-bit flip and every burst of up to 32
bits, other random damage but for a 2^-32 chance; sizes catch truncation first. It is no defence
against deliberate tampering; a signing key (``signing``: SHA-256 per file, an HMAC over the
manifest) is. Checkpoints without a manifest (saved before it existed, or by
Megatron-LM) load unverified.
"""

import contextlib
import contextvars
import hashlib
import json
import os
import re
import sys
import zlib

import torch.distributed as dist

from mcore_ext.checkpoint import signing
from mcore_ext.checkpoint.directory import (
    RUN_FILE, TRACKER, Checkpoint, iteration_dir, iteration_of_name, iterations_in, read_run)
from mcore_ext.checkpoint.errors import CheckpointCorruptError

MANIFEST = "mcore_ext_manifest.json"
# What rank 0 writes beside megatron's files for people to read, and edit where no key is set.
EDITABLE = ("config.yaml", "hf_config.json")
# megatron's legacy common state, which its load_common_state_dict prefers when present.
COMMON_PT = "common.pt"
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
_CHUNK = 16 * 2**20
# (real path, key, every file's name, inode, size, ctime) of the directories that verified in full
# in this process: megatron's loads of them after an entry point's (collective) verification read
# nothing twice; a file added or rewritten since then is verified anew.
_verified: set = set()
_warned: set = set()
_deferred = contextvars.ContextVar("mcore_ext_manifest_deferred", default=False)


def files_of_rank(directory: str, rank: int | None) -> list[str]:
    """The files of ``directory`` (relative paths) that ``rank`` wrote: its ``__<rank>_*.distcp``,
    and on rank 0 every file no rank's name claims; ``rank=None``: every file."""
    mine = []
    for parent, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(parent, name), directory)
            if relative == MANIFEST:
                continue
            owner = _RANK_FILE.search(name)
            if rank is None or (int(owner.group(1)) if owner else 0) == rank:
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


def write(directory: str, entries: dict, iteration: int | None = None,
          run: str | None = None) -> None:
    """Write the manifest of ``entries`` (a rename: never half a manifest), of the checkpoint of
    ``iteration`` (default: what the folder's name says) of the run ``run`` (its save
    directory's ``RUN_FILE``; default: the one beside ``directory``, if any)."""
    path = os.path.join(directory, MANIFEST)
    if iteration is None:
        iteration = iteration_of_name(directory)
    if run is None:
        run = read_run(os.path.dirname(os.path.abspath(directory)))
    bound = {"iteration": iteration, "run": run}
    document = {"format": 1, "checksum": "crc32", **bound, "files": dict(sorted(entries.items()))}
    if (secret := signing.key()) is not None:
        document[signing.FIELD] = signing.signature(document["files"], secret, bound)
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
        document = json.load(f)
    for name, entry in document["files"].items():  # what verify reads of each entry
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("crc32"), str)):
            raise ValueError(f"the entry of {name!r} is not a size and a CRC32")
    return document


def verify(directory: str, entries: dict) -> list[tuple[str, str]]:
    """What differs from ``entries`` ({name: entry}): (name, problem) pairs. Without a key the
    ``EDITABLE`` files are not compared (people edit them)."""
    problems = []
    signed = signing.key() is not None
    for name, entry in sorted(entries.items()):
        if name in EDITABLE and not signed:
            continue
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
            elif sha is not None and sha != entry.get("sha256"):
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
    collective = collective and dist.is_initialized()
    early, entries = _read_entries(directory)
    if collective:
        # Each rank reads the manifest for itself; what one rank finds (unreadable, unsigned,
        # absent) decides for every rank, so all of them reach the gather below or none does.
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, early)
        decided = [e for e in seen if e != "read"]
        if decided:
            problems = [e for e in decided if e is not None]
            if problems:
                return problems[0]
            if len(decided) < len(seen):  # absent on some ranks, present on others
                return [(MANIFEST, "present on some ranks only (is the directory on every "
                                   "node's file system?)")]
            return None
    elif early != "read":
        return early
    stamp = _stamp(directory)
    unlisted = unlisted_files(directory, entries)
    if not collective:
        problems = sorted(verify(directory, entries) + unlisted)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        names = sorted(entries)[rank::world]
        found = [None] * world
        dist.all_gather_object(found, verify(directory, {n: entries[n] for n in names}))
        problems = sorted([problem for problems in found for problem in problems] + unlisted)
    if not problems and stamp[-1] is not None:
        _verified.add(stamp)
    return problems


def verify_once(directory: str) -> list[tuple[str, str]] | None:
    """``verify_checkpoint`` (collective), or [] without reading anything when every rank has
    verified ``directory`` in full before and nothing in it changed since (``_stamp``): what an
    entry point calls where megatron may read the same directory twice."""
    done = _stamp(directory) in _verified
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, done)
        done = all(everyone)
    return [] if done else verify_checkpoint(directory)


def _read_entries(directory: str):
    """("read", the manifest's entries), or (what verify_checkpoint returns at once, None): a
    problem list when the manifest is unreadable or not signed as required, None when absent."""
    try:
        document = _read_document(directory)
        entries = None if document is None else document["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [(MANIFEST, f"unreadable ({type(err).__name__}: {err})")], None
    if (unsigned := signing.problem(document)) is not None:
        return [(MANIFEST, unsigned)], None
    if entries is None:
        return None, None
    if (elsewhere := _binding_problem(directory, document)) is not None:
        return [(MANIFEST, elsewhere)], None
    return "read", entries


def _binding_problem(directory: str, document: dict) -> str | None:
    """With a key: why the signed manifest ``document`` does not belong where ``directory`` lies
    (the iteration its name says, the run of the save directory it is in), or None. Without a
    key, or a folder whose name says no iteration in a folder that is no save directory: None."""
    if signing.key() is None:
        return None
    expected = iteration_of_name(directory)
    if expected is not None and document.get("iteration") != expected:
        return (f"signed for iteration {document.get('iteration')}, but the folder is "
                f"{os.path.basename(os.path.normpath(directory))}: a checkpoint copied over "
                "another iteration's")
    root = os.path.dirname(os.path.abspath(directory))
    try:
        run = read_run(root)
    except (OSError, ValueError, AttributeError) as err:
        return f"its save directory's {RUN_FILE} is unreadable ({type(err).__name__}: {err})"
    if run is None:
        if os.path.isfile(os.path.join(root, TRACKER)):
            return (f"its save directory {root} has a {TRACKER} but no {RUN_FILE}: the run it "
                    "belongs to is not known (saved before runs were signed)")
        return None
    if document.get("run") != run:
        return (f"belongs to run {document.get('run')}, but its save directory {root} is run "
                f"{run} ({RUN_FILE}): a checkpoint of another run")
    return None


def unlisted_files(directory: str, entries: dict) -> list[tuple[str, str]]:
    """The files in ``directory`` that ``entries`` does not list, as problems: with a signing
    key every one (nothing the signed save did not write is read), without one the ranks' data
    files (``__<rank>_<n>.distcp``: a save published without a rank's entries is not intact)."""
    signed = signing.key() is not None
    return [(name, "not in the manifest (the save did not record it)")
            for name in files_of_rank(directory, None)
            if name not in entries and (signed or _RANK_FILE.fullmatch(name))]


def read_file(directory: str, name: str) -> bytes:
    """The file ``name`` of the checkpoint ``directory``, for building a model from it
    (config.yaml, hf_config.json). With a signing key only as signed: the manifest's signature
    verifies and lists the file with this SHA-256, else CheckpointCorruptError naming it (a
    checkpoint up a ``checkpoint.load`` chain is checked so without hashing all its files)."""
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        data = f.read()
    if signing.key() is None:
        return data
    try:
        document = _read_document(directory)
    except (OSError, ValueError, KeyError, TypeError) as err:
        document, why = None, f"{MANIFEST} unreadable ({type(err).__name__}: {err})"
    else:
        unsigned = signing.problem(document)
        if unsigned is None and document is not None:
            unsigned = _binding_problem(directory, document)
        entry = None if unsigned else document["files"].get(name)
        why = (f"{MANIFEST} {unsigned}" if unsigned else
               f"{name} not in the manifest (the save did not record it)" if entry is None else
               f"{name} digest mismatch (its SHA-256 is not the one signed)"
               if hashlib.sha256(data).hexdigest() != entry["sha256"] else None)
    if why is not None:
        raise CheckpointCorruptError(f"checkpoint {directory} is corrupt: {why}")
    return data


def check_listed(directory: str) -> dict:
    """With a signing key: the signed entries of ``directory``'s manifest, once its signature and
    binding verify and every file it lists is there with its recorded size, else
    CheckpointCorruptError naming the first that is not (a checkpoint up a ``checkpoint.load``
    chain: what an export reads of it, ``read_file`` checks byte for byte as it reads it; a
    signed file deleted or cut anywhere in it refuses the export). Without a key: its entries,
    {} without a manifest."""
    early, entries = _read_entries(directory)
    if early != "read":
        if early is None:
            return {}
        raise CheckpointCorruptError(f"checkpoint {directory} is corrupt: {summary(early)}")
    if signing.key() is None:
        return entries
    problems = []
    for name, entry in sorted(entries.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append((name, "missing"))
        elif (size := os.path.getsize(path)) != entry["size"]:
            problems.append((name, f"has {size} bytes, {entry['size']} recorded"))
    if problems:
        raise CheckpointCorruptError(f"checkpoint {directory} is corrupt: {summary(problems)}")
    return entries


def signed_folder(path: str) -> tuple[str, str] | None:
    """With a signing key: (the checkpoint directory, ``path`` relative to it) when ``path`` lies
    in a checkpoint folder with a manifest (an ``hf import``'s ``tokenizer/``), whose signature
    then covers its files; None otherwise (a folder of the user's), and without a key."""
    if signing.key() is None:
        return None
    real = os.path.realpath(path)
    parent = real
    while True:
        if os.path.isfile(os.path.join(parent, MANIFEST)):
            return parent, os.path.relpath(real, parent)
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


def read_signed_folder(path: str, names) -> dict | None:
    """{name: bytes} of the files of the folder ``path`` that ``names`` keeps (a function of the
    names present or listed) as signed (``read_file``) when ``path`` lies in a signed checkpoint
    folder and a key is set: a listed file that is missing, changed or cut, or one there that the
    manifest does not list, is a CheckpointCorruptError naming it. None when ``path`` lies in no
    checkpoint or no key is set (the caller reads the folder as it is)."""
    found = signed_folder(path)
    if found is None:
        return None
    directory, relative = found
    entries = check_listed(directory)
    prefix = "" if relative == "." else relative + os.sep
    listed = {name[len(prefix):] for name in entries
              if name.startswith(prefix) and os.sep not in name[len(prefix):]}
    present = {name for name in os.listdir(path) if os.path.isfile(os.path.join(path, name))}
    return {name: read_file(directory, prefix + name) for name in sorted(names(listed | present))}


@contextlib.contextmanager
def deferred():
    """megatron's reads in the block skip ``check_before_read``: for a look at a checkpoint that
    decides nothing the load after it does not verify first (the launcher's choice of model
    class from the checkpoint it is about to verify, on every rank, before any process group)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def check_before_read(directory: str) -> None:
    """What every megatron load of ``directory`` passes first (``_mcore_compat``): with a signing
    key, the checkpoint verifies in full (once per process: an entry point's collective
    verification counts), else CheckpointCorruptError naming the file; without one, a
    ``common.pt`` that its manifest does not list (which megatron would read instead of the
    common state the save wrote) is named once, on stderr, by the first rank."""
    if _deferred.get():
        return
    if signing.key() is None:
        _warn_unlisted_common(directory)
        return
    if _stamp(directory) in _verified:
        return
    problems = verify_checkpoint(directory, collective=False)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {directory} is corrupt: {summary(problems)}")


def check_unchanged(*directories: str) -> None:
    """What every read of a checkpoint's files passes after reading (``safe_pickle``'s DCP
    reads and whole-file reads), with a signing key: one of ``directories`` (the folder the
    bytes came from; a whole file's parent or grandparent) verified in full and nothing in it
    changed from the verification to now (``_stamp``: a status-change time moves with every
    write and never back), so the bytes just read are the bytes verified, else
    CheckpointCorruptError. Without a key, and in ``deferred`` looks: nothing."""
    if signing.key() is None or _deferred.get():
        return
    if not any(_stamp(directory) in _verified for directory in directories):
        raise CheckpointCorruptError(
            f"checkpoint {directories[0]} is not the one verified: a file in it was written, "
            "replaced, added or removed after its verification (or it was read without one)")


def _warn_unlisted_common(directory: str) -> None:
    real = os.path.realpath(directory)
    if real in _warned or not os.path.isfile(os.path.join(directory, COMMON_PT)):
        return
    try:
        entries = read(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return  # verification says what is wrong with the manifest
    if entries is None or COMMON_PT in entries:
        return  # Megatron-LM's own, or one a save wrote (older megatron-core releases)
    _warned.add(real)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"warning: checkpoint {directory} holds a {COMMON_PT} that is not in its manifest "
              "(its save did not write it): megatron reads the common state (iteration, "
              "schedule, data position) from it instead of the one saved; set "
              f"{signing.KEY_ENV} to refuse such a checkpoint", file=sys.stderr, flush=True)


def _stamp(directory: str) -> tuple:
    """What identifies one verification of ``directory``: its path, the key, the run of its save
    directory, and every file below it (``tokenizer/`` and Megatron-LM's ``mp_rank_*/`` too) by
    name, inode, size and status-change time (ctime, which a write, a rename or a ``utime``
    moves and nothing can set back): a file added, replaced or rewritten after a verification
    is verified anew."""
    try:
        files = []
        for parent, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(parent, name)
                stat = os.stat(path)
                files.append((os.path.relpath(path, directory), stat.st_ino, stat.st_size,
                              stat.st_ctime_ns))
        files = tuple(sorted(files))
        run = read_run(os.path.dirname(os.path.abspath(directory)))
    except (OSError, ValueError, AttributeError):
        files = run = None
    return os.path.abspath(directory), os.path.realpath(directory), signing.key(), run, files


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
