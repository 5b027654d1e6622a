"""Stage `drafter`: the DFlash drafter network, its config and its checkpoints. Imports: `target`.

Reads and Writes a z-lab-format checkpoint directory: `config.json` (Qwen3 fields + `architectures:
["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `layer_types`, `dflash_config: {mask_token_id,
target_layer_ids, …}`) and `model.safetensors` (keys without prefix: `fc`, `hidden_norm`, `layers.N.…`, `norm`;
`mask_embedding` and `draft_to_target` when used; DSpark drafters: `architectures: ["Qwen3DSparkModel"]` + their
`markov_head.*` / `confidence_head.*`). No embedding table and no LM head: those are the target's.

Modules and their public functions:
  config.py         `DrafterConfig` (`for_target`, `to_zlab_dict` / `from_zlab_dict`, `load` / `save`),
                    `default_target_layer_ids`, `default_geometry`
  config_fields.py  types of the config.json fields, checked before any value is used
  capture_needs.py  `capture_layer_ids`, `capture_target_lse`: what a capture stores for training a drafter
  model.py          `DFlashDrafter` (forward over [context K/V | block K/V]), `DrafterCache`, `to_additive`
  qwen3_blocks.py   `RMSNorm`, `GatedMLP`, `DefaultRope`, `rotate_half`: Qwen3's blocks, bit-identical to
                    transformers', without importing its modeling code
  tiled_attention.py  `tile_mask`, `tiled_attention`, `compile_ready`: exact attention under a training mask,
                    only the keys each query tile sees (CPU training)
  heads/            the drafter heads on the backbone (DFlash's, DSpark's, DFlash2's) and their registry
  checkpoint.py     `save_drafter`, `load_drafter`, `read_tensors`, `check_tensors`
  defaults.py       `default_drafter_config(target, **overrides)`, `parse_overrides`, `describe_mask`
  mask_choice.py    `unused_special_token(tokenizer)`: the mask row for targets without a spare row
  warm_start.py     `warm_start(drafter, target)`: initialise from the target's own top layers
  context_reach.py  `context_warnings(cfg, context_tokens)`: sliding window / longest training context vs a context
"""
