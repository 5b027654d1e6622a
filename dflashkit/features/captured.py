"""Reading a finished capture directory: `CapturedFeatures(dir)[i]` → a `Sample` with the target's features.

    ds = CapturedFeatures("feats/", expect_target=target, expect_layer_ids=[1, 8, 14, 20, 27])
    ds[i].features   # (T, K·H) float32 — the expected layers, in the drafter's order (any subset of the captured)

The directory must have been made from the same target (fingerprint) and hold the requested layers; each shard's
size is checked when the dataset opens and its header when a shard is first read; a missing, truncated or damaged
shard is a DataError naming it and telling you to rerun `dflashkit capture` (which redoes just that shard).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open
from torch import Tensor

from dflashkit.data.samples import Sample
from dflashkit.errors import DataError
from dflashkit.features.manifest import Manifest, target_fingerprint
from dflashkit.features.shards import shard_problem, size_problem

if TYPE_CHECKING:
    from dflashkit.target.model import Target


def layer_columns(out_dir: Path, m: Manifest, expect_layer_ids: Sequence[int] | None) -> list[int] | None:
    """Positions of the expected layers among the captured ones (None: all of them, in order): a drafter reads any
    subset of a capture's layers, in its own order. DataError when a layer it needs was not captured."""
    if expect_layer_ids is None or [int(i) for i in expect_layer_ids] == list(m.layer_ids):
        return None
    want = [int(i) for i in expect_layer_ids]
    missing = [i for i in want if i not in m.layer_ids]
    if missing:
        raise DataError(
            f"capture dir {out_dir} was made with target_layer_ids {list(m.layer_ids)} but the drafter "
            f"needs {want} (layers {missing} were not captured); capture again with those layer ids"
        )
    return [list(m.layer_ids).index(i) for i in want]


def _check_expected(out_dir: Path, m: Manifest, expect_target: Target | str | None) -> None:
    if expect_target is None:
        return
    made = f"capture dir {out_dir} was made with target {m.target.get('source')!r}"
    if isinstance(expect_target, str):
        expected = {"fingerprint": expect_target}
    else:
        expected = {
            "num_layers": expect_target.num_layers,
            "hidden_size": expect_target.hidden_size,
            "fingerprint": target_fingerprint(expect_target),
        }
    for key, want in expected.items():
        if m.target.get(key) != want:
            other = "" if isinstance(expect_target, str) else f" ({expect_target.source!r})"
            raise DataError(
                f"{made} with {key} {m.target.get(key)!r} but the expected target{other} has "
                f"{key} {want!r}; features only fit the target they were captured from"
            )


class CapturedFeatures:
    """Map-style dataset over a finished capture dir: `ds[i]` → Sample with float32 CPU features.

    Shards are opened lazily (safetensors `safe_open`), keeping at most `max_open_shards` handles (LRU);
    handles are dropped when the dataset is pickled (DataLoader workers reopen their own).
    require_topk: n > 0 raises DataError unless the capture stored ≥ n top-k log-probs per position (`loss: topk`).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        expect_target: Target | str | None = None,
        expect_layer_ids: Sequence[int] | None = None,
        max_open_shards: int = 4,
        require_topk: int = 0,
    ) -> None:
        self.dir = Path(out_dir)
        self.manifest = Manifest.load(self.dir)
        m = self.manifest
        _check_expected(self.dir, m, expect_target)
        if require_topk > m.store_topk:
            have = (
                "was captured without the target's top-k log-probs"
                if not m.store_topk
                else f"holds only the top-{m.store_topk} log-probs per position, but {require_topk} are asked for"
            )
            raise DataError(
                f"loss: topk needs the target's top-k log-probs in the features, but capture dir "
                f"{self.dir} {have}; capture again with `dflashkit capture --topk "
                f"{max(require_topk, 32)} ...` into a new --out (or train with loss: ce / kl)"
            )
        self._columns = layer_columns(self.dir, m, expect_layer_ids)  # None: every captured layer
        if not m.complete:
            missing = m.num_samples - m.done_samples
            shards = sum(1 for s in m.shards if not s["done"])
            raise DataError(
                f"capture dir {self.dir} is incomplete: {missing} of {m.num_samples} samples "
                f"({shards} of {len(m.shards)} shards) not captured yet; rerun `dflashkit capture` "
                f"with the same arguments to resume it"
            )
        for sh in m.shards:  # sizes now (cheap); each header when the shard is first opened
            problem = size_problem(self.dir / sh["file"], sh)
            if problem:
                raise DataError(
                    f"capture dir {self.dir}: shard file {sh['file']} {problem}; it holds "
                    f"{sh['count']} samples: rerun `dflashkit capture` with the same arguments "
                    f"to recreate it"
                )
        self.max_open_shards = max_open_shards
        self._handles: OrderedDict[str, Any] = OrderedDict()
        self._verified: set[str] = set()  # shards whose sha256 matched the manifest in this run

    @property
    def layer_ids(self) -> list[int]:
        ids = list(self.manifest.layer_ids)
        return ids if self._columns is None else [ids[c] for c in self._columns]

    @property
    def lengths(self) -> list[int]:
        return [s["length"] for s in self.manifest.samples]

    def __len__(self) -> int:
        return self.manifest.num_samples

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": OrderedDict()}

    def loss_mask(self, i: int) -> Tensor:
        """Sample i's loss mask (T,) bool, read without its features."""
        return (
            self._handle(self.manifest.shards[self.manifest.samples[i]["shard"]]["file"])
            .get_tensor(f"{i}.loss_mask")
            .bool()
        )

    def _handle(self, name: str) -> Any:
        if name in self._handles:
            self._handles.move_to_end(name)
            return self._handles[name]
        path = self.dir / name
        if not path.is_file():
            raise DataError(
                f"capture dir {self.dir}: shard file {name} is missing; rerun `dflashkit capture` "
                f"with the same arguments to recreate it"
            )
        if name not in self._verified:  # what the manifest promises, checked once per shard and run (one read)
            entry = next(sh for sh in self.manifest.shards if sh["file"] == name)
            problem = shard_problem(path, entry, checksum=True)
            if problem:
                raise DataError(
                    f"capture dir {self.dir}: shard file {name} {problem}; it holds {entry['count']} samples: "
                    f"rerun `dflashkit capture` with the same arguments to recreate it"
                )
            self._verified.add(name)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:
            raise DataError(
                f"capture dir {self.dir}: shard file {name} is damaged (not a readable safetensors "
                f"file: {' '.join(str(e).split())[:200]}); rerun `dflashkit capture` with the same "
                f"arguments to recreate it"
            ) from None
        self._handles[name] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def __getitem__(self, i: int) -> Sample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} captured samples")
        i %= n
        entry = self.manifest.samples[i]
        name = self.manifest.shards[entry["shard"]]["file"]
        h = self._handle(name)
        try:
            feats = h.get_tensor(f"{i}.features").float()  # (T, K·H)
            ids = h.get_tensor(f"{i}.input_ids").long()  # (T,)
            mask = h.get_tensor(f"{i}.loss_mask").bool()  # (T,)
            tokens = h.get_tensor(f"{i}.target_tokens").long() if self.manifest.store_target_tokens else None
            k = self.manifest.store_topk
            top_ids = h.get_tensor(f"{i}.topk_ids").long() if k else None  # (T, k)
            top_lp = h.get_tensor(f"{i}.topk_logprobs").float() if k else None  # (T, k)
            lse = h.get_tensor(f"{i}.target_lse").float() if self.manifest.store_target_lse else None  # (T,)
        except Exception as e:  # safetensors raises its own error type for a missing key
            raise DataError(
                f"capture dir {self.dir}: shard {name} lacks the tensors of sample {i} ({entry['id']!r}): {e}"
            ) from None
        if feats.shape != (entry["length"], self.manifest.feature_dim):
            raise DataError(
                f"capture dir {self.dir}: {name} '{i}.features' has shape {list(feats.shape)}, "
                f"expected {[entry['length'], self.manifest.feature_dim]}"
            )
        for key, t in (("topk_ids", top_ids), ("topk_logprobs", top_lp)):
            if t is not None and t.shape != (entry["length"], k):
                raise DataError(
                    f"capture dir {self.dir}: {name} '{i}.{key}' has shape {list(t.shape)}, "
                    f"expected {[entry['length'], k]}"
                )
        if lse is not None and lse.shape != (entry["length"],):
            raise DataError(
                f"capture dir {self.dir}: {name} '{i}.target_lse' has shape {list(lse.shape)}, "
                f"expected {[entry['length']]}"
            )
        if self._columns is not None:  # a subset of the captured layers, in the drafter's order
            hidden = int(self.manifest.target["hidden_size"])
            feats = feats.view(feats.shape[0], -1, hidden)[:, self._columns].reshape(feats.shape[0], -1)  # (T, K'·H)
        return Sample(
            id=entry["id"],
            input_ids=ids,
            loss_mask=mask,
            features=feats,
            target_tokens=tokens,
            topk_ids=top_ids,
            topk_logprobs=top_lp,
            target_lse=lse,
        )


__all__ = ["CapturedFeatures"]
