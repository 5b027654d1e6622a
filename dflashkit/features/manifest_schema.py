"""What a capture's manifest.json must hold before anything reads a shard it names: types, ranges, plain shard names.

    why = manifest_problem(raw)   # 'shards[1].file = "../tokens.jsonl": expected a file name in the capture dir …'

`Manifest.load` reads the file `dflashkit capture` wrote; a damaged or hand-edited one must not send `capture` to
rewrite a file outside its directory (a shard named `../tokens.jsonl` would overwrite the input), nor end in a
traceback from inside the reader. Checked: each field's type (pydantic, strict), a shard's file is a plain
`*.safetensors` name inside the directory, and the shards tile the samples in order (shard j starts where j − 1
ends, every sample names a shard that exists). Fields no reader uses may hold anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from dflashkit.validation import JsonFields, json_problem, safetensors_name

Count = Annotated[int, Field(ge=0)]


class _Target(JsonFields):
    hidden_size: Annotated[int, Field(ge=1)]
    num_layers: Annotated[int, Field(ge=1)] | None = None
    fingerprint: str | None = None


class _Shard(JsonFields):
    first: Count
    count: Annotated[int, Field(ge=1)]
    tokens: Count
    file: safetensors_name("the capture directory", "shard-NNNNN.safetensors")
    done: bool
    bytes: Count
    sha256: str | None = None


class _Sample(JsonFields):
    id: str
    shard: Count
    length: Annotated[int, Field(ge=1)]
    supervised: Count


class _Manifest(JsonFields):
    target: _Target
    layer_ids: Annotated[list[Count], Field(min_length=1)]
    dtype: Literal["bf16", "fp16", "fp32"]
    store_target_tokens: bool
    shard_max_tokens: Annotated[int, Field(ge=1)]
    samples_sha256: str
    tokens_file: str | None
    shards: Annotated[list[_Shard], Field(min_length=1)]
    samples: list[_Sample]
    store_topk: Count = 0
    store_target_lse: bool = False
    precision: Literal["fp32", "bf16", "bf16-weights", "fp16-weights"] | None = None
    data: dict[str, Any] | None = None


def manifest_problem(raw: Any) -> str | None:
    """Why a parsed manifest.json cannot be used (the first wrong field by its path, or shards that do not tile the
    samples), or None when it can."""
    why = json_problem(_Manifest, raw)
    if why:
        return why
    shards, samples = raw["shards"], raw["samples"]
    start = 0
    for j, sh in enumerate(shards):
        if sh["first"] != start:
            return f"shards[{j}].first = {sh['first']}: expected {start} (where shard {j - 1} ends)"
        start += sh["count"]
    if start != len(samples):
        return f"the shards hold {start} samples but 'samples' lists {len(samples)}"
    for i, s in enumerate(samples):
        j = s["shard"]
        if j >= len(shards) or not shards[j]["first"] <= i < shards[j]["first"] + shards[j]["count"]:
            return f"samples[{i}].shard = {j}: expected the shard that holds sample {i}"
    return None


__all__ = ["manifest_problem"]
