"""Stage `train`: drafter training (every kind: its head adds its own terms), one process or torchrun (DDP / FSDP2).
Imports: `target`, `drafter`, `data`, `features`.

Reads: a capture directory (offline features) or `tokens.jsonl` with a target (online features), a training YAML
plus `key=value` overrides. Writes a run directory: `checkpoints/step-N/` (drafter + `train_state.pt` +
`train_config.yaml`), `latest`, `final/` and `best/` (z-lab drafters), `metrics.jsonl` and TensorBoard `tb/`.

Modules and their public functions:
  config.py        `TrainConfig.load(yaml, overrides)`, `check_resume_compatible`
  loop.py          `train(cfg)` → `TrainResult`; `TrainingDiverged`
  run.py           `setup_run(cfg)` → `Run` (target, drafter, rows, wrapper, optimizer, logger)
  step.py          `prepare_inputs` (anchors, blocks, labels, masks; drawn as a `StepDraw`), `step_loss`,
                   `micro_batches`
  validation.py    `validate(run)`, `keep_if_best(run, val)`
  state.py         `save_checkpoint`, `save_final`, `latest_checkpoint`, `TrainState`
  schedule.py      `cosine_with_warmup`, `cosine_at`
  packing.py       `plan_rows`, `PackedRows`, `collate_rows`, `step_rows`, `split_indices`
  blocks.py        `sample_anchors`, `build_blocks`, `masks_for_layer_types`, `attention_masks`, `reference_mask`
  losses.py        `block_loss(hidden, head, labels, spec, target)` with `LossSpec`, `LossTarget`, `LMHead`;
                   `decay_weights`, `dpace_weights`, `estimated_tau`
  objective_reference.py  every objective of `block_loss` in float64 loops: the definitions, and its test reference
  target_lse.py    `RowLogSumExp` (the target's log-sum-exp per row, once per run: DSpark with a draft vocabulary,
                   unless the features carry it: `dflashkit capture --target-lse`)
  optimizer_choice.py  `choose_adamw_impl` (fused or foreach AdamW, timed on this machine), `make_adamw`
  precision_choice.py  `choose_precision` (fp32 or bf16 autocast for a CPU run's `dtype: auto`, timed at its
                   geometry and kept in the user cache)
  compile_choice.py  `start_trial` (whether a run's step runs through torch.compile under `compile: auto`: a stored
                   trial, or one timed in the run's first steps when the run is long enough to risk a compile)
  slot_targets.py  `block_labels`, `every_slot_labels`, `topk_targets`, `kl_target_logits`, `draft_vocab_head`
  metrics.py       `MetricsLogger`, `RollingStats`, `read_metrics`
  distributed.py   `DistContext.from_env()`
  options_table.py `options_table()`: the training-options table of docs/pipeline.md, generated from `TrainConfig`
  memory.py        `step_memory` → `MemoryParts`: a step's peak memory from shapes alone (`LiveBytes` on fake
                   tensors at small shapes, scaled: any size in seconds); the one model `plan`, `doctor` and `train`
                   read
  memory_check.py  `run_memory(cfg)`, `fit_problem(cfg)`: will a training config's step fit its device
  step_cost.py     `step_cost` (a step's FLOPs), `gpu_rate`, `calibrate` (this CPU's rates from real steps)
"""
