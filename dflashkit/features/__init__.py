"""Stage `features`: the target's hidden states for every training token. Imports: `target`, `data`.

Reads: `tokens.jsonl` samples and a target. Writes a capture directory: `manifest.json` (target fingerprint,
layer ids, storage dtype, the precision the target computed in, shard plan, per-sample index; resumable shard
by shard) and `shard-NNNNN.safetensors`
(per sample: features (T, K·H), input_ids, loss_mask, optionally the target's argmax tokens and top-k
log-probs). Online features compute the same thing in memory, nothing written.

Modules and their public functions:
  capture.py   `capture(target, samples, out_dir, settings=CaptureSettings(layer_ids=…))`: a capture dir, resumable
  capture_precision.py `capture_precision(target, lengths)` (fp32 or bf16 autocast, timed on this machine under
               "auto"), `capture_forward(target, ids, precision, …)`: one capture forward in that precision
  capture_compile.py `CaptureForwards.start(target, precision, "auto", tokens_left=…)`: a capture's forwards, eager
               or through compiled layers as measured in its first batches (`--compile auto`)
  captured.py  `CapturedFeatures(dir)[i]`: read it back (checked against the target and the drafter's layers)
  online.py    `OnlineFeatures(target, samples, layer_ids=…)[i]`, `topk_logprobs(logits, k)`
  manifest.py  `Manifest.load(dir)`, `target_fingerprint`, `bytes_per_token`, `plan_shards`, `format_bytes`
  manifest_schema.py `manifest_problem(raw)`: a manifest's fields, plain shard names inside the directory, and
               shards that tile the samples, checked before any shard is read or written
  shards.py    `shard_problem(path, entry)`: a shard on disk checked against its manifest entry
  rank_shards.py  capture over torchrun ranks: `owned_by`, `record_finished`, `fold_rank_records` (one manifest)
  footprint.py what capture stores per token and holds in memory, from shapes alone: `token_bytes`, `capture_disk`
               (shards' data + headers + manifest), `capture_memory` (weights, shard buffer, each moment of a
               batch), `forward_transient` (one target forward above its weights)
"""
