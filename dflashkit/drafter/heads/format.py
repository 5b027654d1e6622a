"""What a drafter kind *is* to the formats and engines around it: one frozen record per head (`Head.format`), read by
the config round trips, export, inspect, serve-check, the quickstart and the docs — never by training or decoding.

    fmt = head_of(cfg).format
    fmt.title, fmt.architectures             the kind as users read it; the `architectures` of its z-lab config.json
    fmt.zlab_field_types                     its own config.json fields → (their type's words, null allowed)
    fmt.recognises(raw)                      whether a z-lab config.json describes this kind
    fmt.fields_from_zlab(raw, src)           its `DrafterConfig` fields read back (refusing variants it cannot run);
    fmt.zlab_fields(cfg), zlab_dflash_fields(cfg)   what it writes at the top level / inside `dflash_config`
    fmt.speculators_architecture, speculators_fields(cfg), fields_from_speculators(raw, src)   speculators' layout
    fmt.key_aliases                          checkpoint keys another writer of this kind uses → dflashkit's
    fmt.carries_target_tables                its trainer (DeepSpec's) saves copies of the target's embeddings / LM head
    fmt.llamacpp_spec_type, gguf_keys(cfg), gguf_tensors(cfg, t), gguf_problems(cfg)   llama.cpp's dflash GGUF
    fmt.vllm_problem, vllm_cpu_problem, vllm_gpu_layout, vllm_drops_learned_mask, serving_note(cfg)   vLLM
    fmt.zlab_problem, deepspec_problem       why z-lab's classes / DeepSpec's Qwen3DSparkModel cannot run it
    fmt.inspect_facts(tensors, cfg), describe(facts, bs)   what `inspect` reports of its own tensors, in words
    fmt.quickstart_drafter, quickstart_train   the quickstart's preset for this kind

`HeadFormat` holds DFlash's facts as its defaults; a head whose layouts differ subclasses it for the functions and
gives its data as the record's fields (`DSparkFormat(title="DSpark", …)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class HeadFormat:
    """The DFlash kind's facts for formats and engines (z-lab's DFlashDraftModel layout)."""

    title: str = "DFlash"  # the kind as users read it
    architectures: tuple[str, ...] = ("DFlashDraftModel",)  # its z-lab config.json's `architectures`
    zlab_field_types: dict[str, tuple[str, bool]] = field(default_factory=dict)  # field → (type words, null ok)
    speculators_architecture: str = "DFlashSpeculator"
    key_aliases: dict[str, str] = field(default_factory=dict)  # checkpoint key another writer uses → dflashkit's
    carries_target_tables: bool = False  # its trainer saves copies of the target's embeddings / LM head
    llamacpp_spec_type: str = "draft-dflash"  # llama.cpp's --spec-type for this kind
    vllm_problem: str | None = None  # why no vLLM build can run this kind (None: one can)
    vllm_cpu_problem: str | None = None  # why vLLM's CPU build cannot run this kind (None: it can)
    vllm_gpu_layout: str | None = None  # a GPU-only kind: vLLM's model for it, as `serve-check` names it
    vllm_drops_learned_mask: bool = False  # vLLM's model for it feeds a token row at masked slots
    zlab_problem: str | None = None  # why z-lab's drafter classes cannot run this kind (None: they can)
    # why DeepSpec's Qwen3DSparkModel cannot run this kind (None: it can)
    deepspec_problem: str | None = (
        "a DFlash drafter (slot 0 is the anchor): DeepSpec's Qwen3DSparkModel drafts from every slot — export it "
        "with --to vllm or --to zlab"
    )
    quickstart_drafter: dict[str, Any] = field(default_factory=dict)  # drafter fields the quickstart's budget takes
    quickstart_train: dict[str, Any] = field(default_factory=dict)  # training options likewise

    # ------------------------------------------------------------------ z-lab config.json
    def recognises(self, raw: dict[str, Any]) -> bool:
        """Whether a config.json (z-lab layout) describes a drafter of this kind."""
        return any(a in self.architectures for a in raw.get("architectures") or [])

    def fields_from_zlab(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """This head's `DrafterConfig` fields from a config.json of its kind (refusing variants it cannot run)."""
        return {}

    def zlab_fields(self, cfg: Any) -> dict[str, Any]:
        """Top-level config.json fields this head writes (as the engines that run it read them)."""
        return {}

    def zlab_dflash_fields(self, cfg: Any) -> dict[str, Any]:
        """Fields this head writes inside the z-lab config's `dflash_config`."""
        return {}

    # ------------------------------------------------------------------ speculators config.json
    def speculators_fields(self, cfg: Any) -> dict[str, Any]:
        """Top-level fields of its speculators config.json beyond the backbone's."""
        return {}

    def fields_from_speculators(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """This head's `DrafterConfig` fields from a speculators config.json of its kind."""
        return {}

    # ------------------------------------------------------------------ GGUF (llama.cpp's dflash architecture)
    def gguf_keys(self, cfg: Any) -> dict[str, bool | int | float]:
        """GGUF keys (`dflash.NAME`: bool, u32 or f32 by the value's type) llama.cpp reads for this kind."""
        return {}

    def gguf_tensors(self, cfg: Any, tensors: dict[str, Tensor]) -> dict[str, tuple[str, Tensor, bool]]:
        """This head's own checkpoint keys → (llama.cpp tensor name, the tensor to write, kept F32)."""
        return {}

    def gguf_problems(self, cfg: Any) -> list[str]:
        """Why llama.cpp's graph cannot run this head's geometry (empty when it can)."""
        return []

    # ------------------------------------------------------------------ vLLM serving layout
    def serving_note(self, cfg: Any) -> str | None:
        """What a user must know about vLLM running this drafter's serving layout (None: nothing)."""
        return None

    # ------------------------------------------------------------------ inspect
    def inspect_facts(self, tensors: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
        """What `inspect` reports of this head's own tensors (None: nothing)."""
        return None

    def describe(self, facts: dict[str, Any], block_size: Any) -> str:
        """`inspect`'s words for this kind: how many drafts a round, and its own parts."""
        return f" ({self.title}: {block_size - 1} drafts a round)" if isinstance(block_size, int) else ""


__all__ = ["HeadFormat"]
