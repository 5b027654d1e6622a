"""Stage `export`: drafters in the formats serving engines load, and checks that the engines run them as dflashkit
measured. Imports: `target`, `drafter`, `train` (a run's recorded settings), `decode`, `evaluate`.

Reads: a drafter checkpoint directory (dflashkit / z-lab, serving layout, DeepSpec, or speculators format). Writes: the
serving layout (what vLLM `method: dflash` loads as it is), a z-lab or speculators directory, or a GGUF file for
llama.cpp's `dflash` architecture, each with a model card (README.md); runs a local llama.cpp build and vLLM (in its
own environment).

Modules and their public functions:
  convert.py      `convert(src, out, to="zlab"|"speculators"|"vllm"|"deepspec")`, `load_any(path)`, `detect_format`,
                  `export_checkpoint` (the quickstart's export); DeepSpec DSpark checkpoints import here
  speculators_format.py  the speculators layout (DFlash and DSpark) ↔ DrafterConfig and dflashkit's tensor names
  deepspec.py     DeepSpec's own DSpark layout both ways: `deepspec_tensors`, `deepspec_config`, `import_tables`
  serving.py      `write_serving`, `serving_config`, `serving_tensors`, `safe_learned_mask_id`, `vllm_model_problems`
  engines.py      `engine_verdicts`, `verdicts_for_dir`: which engine loads a directory, and why not;
                  `export_problems`: why llama.cpp's dflash graph cannot run a drafter
  model_card.py   `write_model_card(ModelCard(...))`: the README.md every export writes beside the weights
                  (front matter, drafter, training record, τ from `eval` results, serve and serve-check commands)
  serve_check.py  `serve_check(target, drafter_dir, prompts=…)`: the drafter in vLLM vs dflashkit, per position
  served.py       `check_server(target, drafter, url, prompts)`: a running server's own counters vs dflashkit's
  served_diagnosis.py  `diagnose(evidence)`: the cause of a gap (template, sampling, window, numerics, config)
  concurrency.py  `load_curve(url, prompts, LoadSettings(levels=…), baseline=…)`: throughput, latency and τ per level
  vllm_runner.py  the script serve_check runs with the vLLM environment's Python (imports nothing of dflashkit)
  llamacpp_check.py  `llamacpp_side`, `reference_drafts`: serve-check's llama.cpp side, round by round
  gguf_export.py  `export_gguf(ckpt, out, target_gguf=…)`
  llamacpp.py     `built()`, `run_speculative`, `run_plain`, `f32_target_gguf`
  llama_server.py `LlamaServer(gguf, slots=…)`: a llama-server on 127.0.0.1 for a block (regeneration, tests)
"""
