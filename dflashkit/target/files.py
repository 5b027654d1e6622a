"""A target's files, checked before transformers loads them: `config.json` (valid JSON, sizes that are positive
integers, weights that fit this machine's memory) and `.gguf` files (a header the `gguf` reader can parse).

    check_model_dir(Path("models/Qwen3-8B"), bytes_per_parameter=2)   # → TargetError naming the file and field
    check_gguf(Path("model.Q4_1.gguf"))

Without these, a hand-edited `"hidden_size": 10000000` surfaces as `DefaultCPUAllocator: can't allocate memory`
deep inside a model constructor, and an empty `.gguf` as a struct error inside the reader.
"""

from __future__ import annotations

from pathlib import Path

from dflashkit.errors import TargetError
from dflashkit.target.shape import knows_architecture, read_config_json, read_target_shape
from dflashkit.validation import memory_available


def check_model_dir(path: Path, *, bytes_per_parameter: int) -> None:
    """config.json of a model directory: readable JSON, the decoder sizes positive integers, and weights that fit
    the memory this machine can allocate (at `bytes_per_parameter`; parameters counted exactly by `shape.py`).
    A model_type transformers does not know is left to the loader: only the directory's own code can build it."""
    file = path / "config.json"
    if not knows_architecture(read_config_json(file)):
        return
    shape = read_target_shape(file)
    need = shape.num_parameters * bytes_per_parameter
    available = memory_available()
    if need > available:
        raise TargetError(
            f"{file}: this model (hidden_size {shape.hidden_size}, {shape.num_layers} layers, vocab_size "
            f"{shape.vocab_size}) needs about {need / 1e9:,.1f} GB for its weights; this machine can allocate "
            f"{available / 1e9:,.1f} GB"
        )


def check_gguf(path: Path) -> None:
    """A `.gguf` file the `gguf` reader can parse (magic, version, metadata, tensor table)."""
    if path.stat().st_size == 0:
        raise TargetError(f"{path}: empty file; expected a GGUF model")
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct / numpy errors for damaged headers
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise TargetError(f"{path}: not a readable GGUF file ({why}); expected an intact .gguf model") from None


__all__ = ["check_gguf", "check_model_dir"]
