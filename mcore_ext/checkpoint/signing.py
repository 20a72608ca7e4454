"""Signed manifests: tampering, beyond damage, when a key is set.

The manifest's CRC32s say a checkpoint is intact, not that it is the one that was saved: anyone
who can write the files can write a matching manifest. With a key (the launcher's
``checkpoint.key_file``, else ``MCORE_EXT_CHECKPOINT_KEY`` in the environment of every rank), at
save and at load:

- each rank records the SHA-256 of its files beside their CRC32 (``manifest.describe``), and
  rank 0 signs the manifest: ``"hmac_sha256"``, HMAC-SHA256 with the key over the manifest's
  file entries, the checkpoint's iteration and the run it belongs to (``BOUND``), in canonical
  JSON;
- verification (every load, ``inspect --verify``) refuses a checkpoint whose manifest is missing,
  unsigned, or signed with another key, or whose files' SHA-256 differ.

Without a key nothing changes: no SHA-256, no signature, and signed checkpoints load as before
(their CRC32s are checked).
"""

import hashlib
import hmac
import json
import os

KEY_ENV = "MCORE_EXT_CHECKPOINT_KEY"
FIELD = "hmac_sha256"
# What the signature binds besides the files: the folder's iteration and its run's id (so a
# folder copied over another iteration's, or from another run, does not verify there).
BOUND = ("iteration", "run")


_key_from_file: bytes | None = None


def use_key_file(path: str | None) -> None:
    """Sign and verify with the key in the file ``path`` (its bytes, trailing newline dropped)
    from now on in this process; None: back to ``MCORE_EXT_CHECKPOINT_KEY``."""
    global _key_from_file
    if path is None:
        _key_from_file = None
        return
    with open(path, "rb") as f:
        _key_from_file = f.read().rstrip(b"\r\n")


def key() -> bytes | None:
    """The signing key: the key file's (``use_key_file``), else ``MCORE_EXT_CHECKPOINT_KEY``
    (UTF-8), else None."""
    if _key_from_file:
        return _key_from_file
    value = os.environ.get(KEY_ENV)
    return value.encode() if value else None


def signature(entries: dict, secret: bytes, bound: dict | None = None) -> str:
    """HMAC-SHA256 of the file entries ({name: {"size", "crc32", "sha256"}}) and ``bound``
    ({"iteration", "run"}), hex. Without ``bound``: of the entries alone (manifests signed
    before the binding, which only verify to be refused as unbound)."""
    signed = entries if bound is None else {"files": entries, **bound}
    canonical = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, canonical, hashlib.sha256).hexdigest()


def bound_fields(document: dict) -> dict | None:
    """The ``BOUND`` fields of a manifest document, or None when it has none (older saves)."""
    if not any(name in document for name in BOUND):
        return None
    return {name: document.get(name) for name in BOUND}


def problem(document: dict | None) -> str | None:
    """Why the manifest ``document`` (the parsed JSON, None when there is none) does not verify
    with the key, or None (also without a key)."""
    secret = key()
    if secret is None:
        return None
    if document is None:
        return f"missing: {KEY_ENV} is set and only a signed checkpoint loads"
    recorded = document.get(FIELD)
    if recorded is None:
        return f"not signed ({KEY_ENV} is set and only a signed checkpoint loads)"
    entries = document.get("files", {})
    bound = bound_fields(document)
    # compare_digest takes ASCII strings only: anything else in the field (a number, a
    # non-ASCII string) is simply a signature that does not verify.
    if not (isinstance(recorded, str) and recorded.isascii()
            and hmac.compare_digest(recorded, signature(entries, secret, bound))):
        return f"signature does not verify with {KEY_ENV}: tampered with, or signed with another key"
    if any("sha256" not in entry for entry in entries.values()):
        return "signed without SHA-256 digests"
    if bound is None:
        return ("signed without the iteration and the run it belongs to (saved before they were "
                "signed): load it without the key and save it again with it")
    return None
