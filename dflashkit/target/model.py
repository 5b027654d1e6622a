"""The target LLM: load any HF causal LM, find its decoder layers, capture features, compute verifier logits.

`Target.load(spec)` accepts a local model directory, a `.gguf` file, or the embedded default ("default" /
None → SmolLM2-135M-Instruct). Decoder layers are found for dense models (Llama, Qwen2, Qwen3), hybrid ones
(Qwen3.5 / Qwen3-Next: GatedDeltaNet + full attention) and the VL wrapper layout of Qwen3.5/3.6 checkpoints
(`model.model.language_model.layers`).

`Target.forward(ids, layer_ids=...)` runs the text model once with forward hooks on the requested decoder
layers — the feature of layer i is the *output of decoder layer i* (HF `output_hidden_states[i + 1]`) — and on
the last layer, whose pre-norm output gives the verifier logits through the final norm and LM head (HF's
`output_hidden_states[-1]` is already normed). No copy of every layer's output is ever made.

Hybrid targets use flash-linear-attention kernels when the package is installed (the optional `gpu` extra);
transformers falls back to its torch implementation otherwise (CPU).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflashkit.cpu_products import linear_product, route_linears, stock_active, stock_products
from dflashkit.cpu_products import mode as products_mode
from dflashkit.cpu_products.products import LAYERS, close_pass, open_pass
from dflashkit.errors import TargetError
from dflashkit.target.attention import route_attention
from dflashkit.target.files import check_gguf, check_model_dir
from dflashkit.target.kv_buffer import growing_cache
from dflashkit.target.layer_ids import layer_ids_problem
from dflashkit.target.native_layers import LayerPlan

LINEAR_ATTENTION = "linear_attention"


@dataclass
class TargetOutput:
    """What one target forward returns. Shapes: B batch, T tokens, K layers, H hidden, V vocabulary."""

    features: Tensor | None  # (B, T, K·H) concatenated outputs of the requested layers, on feature_device
    final_hidden: Tensor  # (B, T, H) pre-norm output of the last decoder layer
    logits: Tensor | None  # (B, T, V) verifier logits = lm_head(norm(final_hidden)), or None
    cache: Any = None  # the target's KV cache after this pass (when use_cache)


def _layer_output(output: Any) -> Tensor:
    # transformers 5.x decoder layers return a Tensor; 4.x and some custom models return a tuple.
    return output[0] if isinstance(output, (tuple, list)) else output


def find_text_model(model: nn.Module) -> nn.Module:
    """The module that owns `layers`, `norm` and `embed_tokens` (dense, hybrid, or VL wrapper layouts)."""
    candidates = []
    inner = getattr(model, "model", None)
    if inner is not None:
        candidates += [getattr(inner, "language_model", None), inner]
    candidates += [getattr(model, "language_model", None), model]
    for c in candidates:
        if c is not None and isinstance(getattr(c, "layers", None), nn.ModuleList) and hasattr(c, "norm"):
            return c
    raise TargetError(
        f"cannot find the decoder layers of {type(model).__name__}: expected `model.layers`, "
        f"`model.model.layers` or `model.model.language_model.layers`"
    )


def _resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in table:
        raise TargetError(f"unknown dtype {dtype!r}; expected one of {sorted(table)}")
    return table[dtype]


class Target:
    """A frozen HF causal LM with feature capture. The model is in eval mode with grads off."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, source: str = "") -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.source = source
        self.text_model = find_text_model(model)
        self.layers: nn.ModuleList = self.text_model.layers
        self.final_norm: nn.Module = self.text_model.norm
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            head = getattr(model, "lm_head", None)
        if head is None:
            raise TargetError(f"{type(model).__name__} has no LM head (expected a causal LM)")
        self.lm_head: nn.Module = head
        self.embed_tokens: nn.Module = self.text_model.embed_tokens
        # a decoding pass of a Llama-family float32 CPU target may run as compiled whole layers (native_layers.py)
        self.native_layers = LayerPlan.of(self.text_model)
        self.layers_compiled = False  # inside compiled_layers: the layers run through torch.compile, never native
        # decoding steps' few rows: the measured products (products.py), whole compiled layers one more candidate
        route_linears(self.layers, fuse=True, whole_layers=self.native_layers is not None)
        self._pass_group = next((m._pass_group for m in self.layers.modules() if type(m) is nn.Linear), None)
        route_linears(self.lm_head, lone=True)  # HF `generate` (regeneration) calls the head module itself
        route_attention(self.model)  # a verify pass's GQA attention on CPU without copies of K/V (attention.py)
        cfg = self.text_config
        self.layer_types: list[str] = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(self.layers))

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        spec: str | Path | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
    ) -> Target:
        """Load from a local directory, a .gguf file, or the embedded default (None / "default" / "smollm2")."""
        from transformers import AutoModelForCausalLM

        device = torch.device(device)
        torch_dtype = _resolve_dtype(dtype, device)
        path, gguf = _resolve_path(spec, bytes_per_parameter=torch.empty((), dtype=torch_dtype).element_size())
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
        if gguf:
            kwargs["gguf_file"] = gguf
        tokenizer = _load_tokenizer(path, gguf, kwargs)  # first: a broken tokenizer fails before a long model load
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
        except ValueError as first:
            try:  # Qwen3.5/3.6 checkpoints are VL wrappers: the text stack sits inside the image-text model
                from transformers import AutoModelForImageTextToText

                model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype, **kwargs)
            except Exception:
                raise TargetError(f"{path}: cannot load as a causal LM ({first})") from None
        except OSError as e:
            raise TargetError(f"{path}: cannot load model files ({e})") from None
        return cls(model.to(device), tokenizer, source=str(Path(path) / gguf if gguf else path))

    # ------------------------------------------------------------------ facts
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def text_config(self) -> Any:
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding table (may exceed the tokenizer's vocabulary: padded rows)."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def embed_weight(self) -> Tensor:
        return self.embed_tokens.weight

    @property
    def lm_head_weight(self) -> Tensor:
        return self.lm_head.weight

    @property
    def architecture(self) -> str:
        archs = getattr(self.config, "architectures", None)
        return archs[0] if archs else type(self.model).__name__

    def spare_mask_token_id(self) -> int | None:
        """An embedding row the tokenizer never produces (z-lab's mask token), or None when every row is used."""
        if self.tokenizer is None:
            return None
        used = len(self.tokenizer)
        return used if used < self.vocab_size else None

    def linear_attention_backend(self) -> str | None:
        if not self.is_hybrid:
            return None
        return "flash-linear-attention" if importlib.util.find_spec("fla") else "torch fallback"

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        problem = layer_ids_problem(list(layer_ids), self.num_layers) if layer_ids else None  # [] = no features
        if problem:
            raise TargetError(problem)

    # ------------------------------------------------------------------ forward
    @contextmanager
    def _hooks(self, layer_ids: list[int]) -> Iterator[dict[int, Tensor]]:
        captured: dict[int, Tensor] = {}
        wanted = set(int(i) for i in layer_ids) | {self.num_layers - 1}
        handles = []
        for idx in sorted(wanted):

            def hook(_module: nn.Module, _inputs: Any, output: Any, idx: int = idx) -> None:
                captured[idx] = _layer_output(output)

            handles.append(self.layers[idx].register_forward_hook(hook))
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    @property
    def plain_head(self) -> bool:
        """Whether the logits are exactly final_norm(h) · Wᵀ (an `nn.Linear` without bias), so the logits of a subset
        of the vocabulary are the products with a subset of W's rows."""
        return type(self.lm_head) is nn.Linear and self.lm_head.bias is None

    def verifier_logits(self, final_hidden: Tensor) -> Tensor:
        """Final norm + LM head over the last layer's pre-norm output: (B, T, H) → (B, T, V)."""
        h = self.final_norm(final_hidden.to(self.device))
        if self.plain_head:  # a decoding step's rows: the product this machine does fastest
            return linear_product(h, self.lm_head.weight)
        return self.lm_head(h)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        *,
        layer_ids: list[int] | tuple[int, ...] = (),
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits: bool = True,
        logits_to_keep: int = 0,
        feature_device: torch.device | str | None = None,
        feature_dtype: torch.dtype | None = None,
    ) -> TargetOutput:
        """One target pass. input_ids (B, T); features of `layer_ids` concatenated in the given order.

        `logits_to_keep=n` computes verifier logits for the last n positions only (0 = all): a long prefill
        then costs one LM-head row instead of T.

        Without a cache the pass is a one-off over whole sequences (capture, features, checks), not a decoding
        step: under the measured choice (`auto`) it takes stock products, so a short sample met twice is never
        timed as a decoding width; products forced by DFLASHKIT_CHOICES hold here as in every other pass.
        A decoding pass the compiled layers take (native_layers.py) is opened here: when its measured candidate
        is `native_layers` it runs compiled, else through transformers' layers.
        """
        layer_ids = [int(i) for i in layer_ids]
        self.check_layer_ids(layer_ids)
        plan = self.native_layers
        opened = (
            plan is not None
            and cache is not None
            and use_cache
            and not stock_active()
            and not self.layers_compiled
            and plan.takes(input_ids, attention_mask, cache)
        )
        one_off = cache is None and products_mode() == "auto"
        with stock_products() if one_off else nullcontext():
            try:
                if opened and open_pass(self._pass_group, tuple(input_ids.shape), self.dtype) == LAYERS:
                    wanted = set(layer_ids) | {self.num_layers - 1}
                    captured, final_hidden = plan.run(input_ids, position_ids, attention_mask, cache, wanted)
                    out_cache = cache
                else:
                    with self._hooks(layer_ids) as captured:
                        out = self.text_model(
                            input_ids=input_ids.to(self.device),
                            position_ids=None if position_ids is None else position_ids.to(self.device),
                            attention_mask=attention_mask,
                            cache=cache,
                            use_cache=use_cache,
                        )
                    final_hidden = captured[self.num_layers - 1]
                    out_cache = getattr(out, "cache", None)
            finally:
                if opened:
                    close_pass(self._pass_group)
            head_in = final_hidden[:, -logits_to_keep:] if logits_to_keep > 0 else final_hidden
            logits_out = self.verifier_logits(head_in) if logits else None  # (B, T or n, V)
        features = None
        if layer_ids:
            features = torch.cat([captured[i] for i in layer_ids], dim=-1)  # (B, T, K·H)
            if feature_device is not None or feature_dtype is not None:
                features = features.to(device=feature_device or features.device, dtype=feature_dtype or features.dtype)
        return TargetOutput(
            features=features,
            final_hidden=final_hidden,
            logits=logits_out,
            cache=out_cache,
        )

    def new_cache(self) -> Any:
        """An empty KV cache for decoding: a `DynamicCache` whose attention layers append in place (kv_buffer.py)."""
        return growing_cache(self.model.config)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def chat_template_info(self) -> dict[str, Any]:
        return chat_template_info(self.tokenizer)


def _resolve_path(spec: str | Path | None, *, bytes_per_parameter: int | None) -> tuple[Path, str | None]:
    """(model directory, GGUF file name or None) of a target spec; the directory checked against the memory its
    weights need when `bytes_per_parameter` is given."""
    from dflashkit.target.default import DEFAULT_ALIASES, ensure_default_target

    if spec is None or str(spec).lower() in DEFAULT_ALIASES:
        return ensure_default_target(), None
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(
            f"target path {path} does not exist (expected a model directory, a .gguf file, "
            f"or 'default' for the embedded SmolLM2-135M-Instruct)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise TargetError(f"target file {path} is not a .gguf file; pass a model directory instead")
        check_gguf(path)
        return path.parent, path.name
    if not (path / "config.json").is_file():
        raise TargetError(f"{path}: no config.json (expected a Hugging Face model directory)")
    if bytes_per_parameter is not None:
        check_model_dir(path, bytes_per_parameter=bytes_per_parameter)
    return path, None


def _load_tokenizer(path: Path, gguf: str | None, kwargs: dict[str, Any]) -> Any:
    """The target's tokenizer, or None when it ships none. Only when tokenizer files exist: otherwise transformers
    builds an empty stand-in whose length would make real embedding rows look "spare"."""
    from transformers import AutoTokenizer

    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    present = [f for f in tokenizer_files if (Path(path) / f).is_file()]
    if not (gguf or present):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        if present:  # the directory ships a tokenizer and it is broken: say so instead of going on
            raise TargetError(
                f"{path}: the tokenizer files {present} exist but cannot be loaded ({why}); "
                f"repair or remove them (without a tokenizer, give pre-tokenised prompts)"
            ) from None
        warnings.warn(
            f"{Path(path) / gguf}: no usable tokenizer in the GGUF file ({why}); continuing "
            f"without one (pre-tokenised prompts only)",
            stacklevel=3,
        )
        return None


@dataclass
class TargetText:
    """A target's text side without its weights — tokenizer, source, end-of-sequence ids — for work that never runs
    the model here (regeneration through a server on another machine)."""

    tokenizer: Any
    source: str
    eos_token_id: Any = None

    @classmethod
    def load(cls, spec: str | Path | None = None, *, trust_remote_code: bool = False) -> TargetText:
        from transformers import GenerationConfig

        path, gguf = _resolve_path(spec, bytes_per_parameter=None)
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
        if gguf:
            kwargs["gguf_file"] = gguf
        tokenizer = _load_tokenizer(path, gguf, kwargs)
        eos = None
        if (path / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        return cls(tokenizer, str(path / gguf if gguf else path), eos)

    def chat_template_info(self) -> dict[str, Any]:
        return chat_template_info(self.tokenizer)


def chat_template_info(tok: Any) -> dict[str, Any]:
    """Whether a tokenizer has a chat template, and whether the template has a thinking switch."""
    template = getattr(tok, "chat_template", None) if tok is not None else None
    return {"present": bool(template), "thinking_switch": bool(template and "enable_thinking" in template)}


def check_drafter_fits(cfg: Any, target: Target, *, source: str = "drafter") -> None:
    """Raise before any work when a drafter config cannot run on `target` (hidden size, vocabulary, layers, mask)."""
    if cfg.hidden_size != target.hidden_size:
        raise TargetError(
            f"{source}: hidden_size {cfg.hidden_size} ≠ the target's hidden size {target.hidden_size} "
            f"({target.source}); a drafter only runs on the target it was built for"
        )
    if cfg.vocab_size != target.vocab_size:
        raise TargetError(f"{source}: vocab_size {cfg.vocab_size} ≠ the target's embedding rows {target.vocab_size}")
    if cfg.num_target_layers != target.num_layers:
        raise TargetError(
            f"{source}: num_target_layers {cfg.num_target_layers} ≠ the target's {target.num_layers} decoder layers"
        )
    try:
        target.check_layer_ids(cfg.target_layer_ids)
    except TargetError as e:
        raise TargetError(f"{source}: {e}") from None
    if not cfg.learned_mask_embedding and not 0 <= cfg.mask_token_id < target.vocab_size:
        raise TargetError(
            f"{source}: mask_token_id {cfg.mask_token_id} is outside the target's embedding table "
            f"(0 ≤ id < {target.vocab_size})"
        )
