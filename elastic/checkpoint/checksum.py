"""The per-step snapshots' checksum: XXH3-128 (the ``xxhash`` package), not sha256.

Why: a snapshot's checksum guards against accidental damage (a torn upload, memory that changed at
rest, a bug in a copy), not against an adversary; the stores are token-protected and the bytes never
leave the run.  sha256 hashed ~1.8 GB/s on one core of this host, ~1 s of CPU per 2 GB shard every
step; XXH3-128 hashed ~30 GB/s (``benchmarks/snapshot_pipeline.py`` measures both in every run), and
its 128 bits make a missed corruption as unlikely as any other hardware fault.  crc32c would do the
job too, but its 32 bits are thin for multi-GB shards and its Python packages were no faster here.
python-xxhash releases the GIL while it hashes a large buffer, so the push thread's hashing does
not hold up the training thread.

A digest names its algorithm (``xxh3_128:<hex>``); a reader verifies whichever it names, so an
older sha256 digest (a bare hex string, or ``sha256:<hex>``) still checks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import xxhash

Chunk = bytes | bytearray | memoryview

ALGORITHM = "xxh3_128"


class UnknownChecksum(ValueError):
    """A digest names an algorithm this reader does not have."""


def _hasher(algorithm: str):  # noqa: ANN202 -- xxhash and hashlib objects share update/hexdigest
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise UnknownChecksum(f"unknown checksum algorithm {algorithm!r}")


def digest_chunks(chunks: Iterable[Chunk], algorithm: str = ALGORITHM) -> tuple[str, int]:
    """(``algorithm:hex`` digest, total bytes) of the concatenation of ``chunks``."""
    hasher = _hasher(algorithm)
    total = 0
    for chunk in chunks:
        hasher.update(chunk)
        total += memoryview(chunk).nbytes
    return f"{algorithm}:{hasher.hexdigest()}", total


def verify(digest: str, data: Chunk) -> bool:
    """Whether ``data`` matches ``digest`` (``algorithm:hex``; a bare hex string is a sha256)."""
    algorithm, _, hexdigest = digest.rpartition(":")
    hasher = _hasher(algorithm or "sha256")
    hasher.update(data)
    return hasher.hexdigest() == hexdigest
