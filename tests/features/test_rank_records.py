"""The ranks' records of finished shards (`capture-rank-NNNNN.json`) folded into the manifest: a record or an entry
that is damaged is named in the log and its shards captured again — never a traceback, never a shard trusted
without its file matching."""

from __future__ import annotations

import json

import torch

from dflashkit.data.samples import Sample
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.manifest import Manifest
from dflashkit.features.rank_shards import RANK_RECORD, fold_rank_records
from dflashkit.target.model import Target


def test_damaged_rank_records_are_named_and_their_shards_captured_again(tiny_llama_dir, tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(id=f"s{j}", input_ids=torch.randint(3, 97, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.bool))
        for j, n in enumerate([6, 5, 9, 4, 7])
    ]
    settings = CaptureSettings(layer_ids=[1], dtype="fp32", shard_max_tokens=8)
    capture(Target.load(tiny_llama_dir), samples, tmp_path, progress=False, log=None, settings=settings)
    m = Manifest.load(tmp_path)
    assert len(m.shards) == 5
    rows = {str(j): {k: m.shards[j][k] for k in ("file", "bytes", "sha256")} for j in range(5)}
    for sh in m.shards:  # as a killed multi-rank run leaves it: finished shards only in the ranks' records
        sh.update(done=False)
    records = {
        0: {"rank": 0, "shards": {"0": rows["0"], "2": dict(rows["2"], bytes="x"), "abc": rows["1"]}},
        1: {"rank": 1, "shards": {"1": rows["1"], "3": "done", "4": dict(rows["4"], sha256=None)}},
        2: {"rank": 2, "shards": [rows["1"]]},
    }
    for rank, rec in records.items():
        (tmp_path / RANK_RECORD.format(rank)).write_text(json.dumps(rec))
    logged: list[str] = []
    assert fold_rank_records(tmp_path, m, verify="full", log=logged.append) == 2  # shards 0 and 1
    assert [sh["done"] for sh in m.shards] == [True, True, False, False, False]
    assert logged == [
        "capture: capture-rank-00000.json has a damaged entry for shard '2'; it is captured again",
        "capture: capture-rank-00000.json has a damaged entry for shard 'abc'; it is captured again",
        "capture: capture-rank-00001.json has a damaged entry for shard '3'; it is captured again",
        "capture: capture-rank-00001.json has a damaged entry for shard '4'; it is captured again",
        "capture: capture-rank-00002.json is damaged; its shards are captured again",
    ]
    assert not list(tmp_path.glob("capture-rank-*"))
