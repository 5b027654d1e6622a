"""Stage `export`: drafters in the formats serving engines load. Imports: `target`, `drafter`.

Reads: a drafter checkpoint directory (dflashkit / z-lab, or speculators format). Writes: a z-lab directory
(vLLM `method: dflash`, SGLang DFLASH), a speculators directory, or a GGUF file for llama.cpp's `dflash`
architecture; and runs a local llama.cpp build.

Modules and their public functions:
  convert.py      `convert(src, out, to="zlab"|"speculators")`, `load_any(path)`, `detect_format`
  gguf_export.py  `export_gguf(ckpt, out, target_gguf=…)`
  llamacpp.py     `built()`, `run_speculative`, `run_plain`, `f32_target_gguf`
"""
