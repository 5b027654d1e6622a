"""Feature capture split over torchrun ranks: which shards a rank captures, and how finished shards reach the one
manifest.

    torchrun --nproc_per_node 8 -m dflashkit capture --tokens data/tokens.jsonl --out data/features ...

The shard plan is a pure function of the samples, so every rank computes the same plan; shard j belongs to rank
j mod world. Rank 0 alone writes manifest.json (and holds the directory's lock); a rank records each shard it
finished, with its size and sha256, in its own `capture-rank-NNNNN.json` (written atomically after the shard file
is on disk). When all ranks are done, rank 0 folds those records into the manifest and deletes them; a run killed
before that leaves them behind, and the next run (any world size) folds in every record whose shard still matches
it, so finished shards are kept and the rest captured again. The files written are byte-identical to a
one-process capture of the same samples and settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from dflashkit.features.manifest import Manifest
from dflashkit.features.shards import shard_problem
from dflashkit.io_utils import atomic_write_text
from dflashkit.validation import JsonFields, json_problem

RANK_RECORD = "capture-rank-{:05d}.json"


def owned_by(j: int, rank: int, world_size: int) -> bool:
    """Whether shard j is captured by `rank` (round robin: shards are near-equal in tokens)."""
    return j % world_size == rank


def record_finished(out_dir: Path, rank: int, manifest: Manifest, finished: list[int]) -> None:
    """Write this rank's record of the shards it finished in this run (atomically, after the shard files)."""
    rows = {str(j): {k: manifest.shards[j][k] for k in ("file", "bytes", "sha256")} for j in finished}
    atomic_write_text(out_dir / RANK_RECORD.format(rank), json.dumps({"rank": rank, "shards": rows}, indent=1) + "\n")


def fold_rank_records(out_dir: Path, manifest: Manifest, *, verify: str, log: Callable[[str], None]) -> int:
    """Mark done every shard a rank record lists whose file still matches the record; delete the records.
    Returns how many shards were taken from them."""
    taken = 0
    for path in sorted(out_dir.glob(RANK_RECORD.replace("{:05d}", "*"))):
        try:
            rows: dict[str, Any] = json.loads(path.read_text())["shards"]
            if not isinstance(rows, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            log(f"capture: {path.name} is damaged; its shards are captured again")
            rows = {}
        for key, row in rows.items():
            if not _readable(key, row):
                log(f"capture: {path.name} has a damaged entry for shard {key!r}; it is captured again")
                continue
            j = int(key)
            if not 0 <= j < len(manifest.shards) or manifest.shards[j]["file"] != row.get("file"):
                continue  # another plan (cannot happen after the resume checks; never trusted)
            sh = dict(manifest.shards[j], done=True, bytes=row.get("bytes"), sha256=row.get("sha256"))
            problem = shard_problem(out_dir / sh["file"], sh, checksum=verify == "full")
            if problem:
                log(f"capture: {sh['file']} was finished by a rank but {problem}; capturing it again")
                continue
            if not manifest.shards[j]["done"]:
                taken += 1
            manifest.shards[j].update(done=True, bytes=sh["bytes"], sha256=sh["sha256"])
        path.unlink()
    return taken


class _Finished(JsonFields):
    """A rank record's entry as `record_finished` writes it (keyed by the shard's index)."""

    file: str
    bytes: Annotated[int, Field(ge=0)]
    sha256: str


def _readable(key: str, row: Any) -> bool:
    return key.isdigit() and json_problem(_Finished, row) is None


__all__ = ["RANK_RECORD", "fold_rank_records", "owned_by", "record_finished"]
