"""Stage `evaluate`: how many tokens a target accepts per round (τ) and how fast decoding really is.
Imports: `target`, `drafter`, `data`, `features`, `decode`.

Reads: drafters, a target, prompts (bundled datasets or JSONL). Writes an evaluation directory: `progress.jsonl`
(one record per finished prompt; a rerun resumes), `results.json` (schema `dflashkit.eval/1`, the source of truth),
`report.md` and PNG plots (per category and, with length buckets, per context length); `simulate` also writes a
transcript cache (`pNNNNN.safetensors` per prompt).

Modules and their public functions:
  evaluate.py     `evaluate(target, drafters, prompts, out_dir=…, settings=EvalSettings(…))`: real decoding vs AR
  warm_up.py      `settle(run, max_new_tokens, device)`: untimed runs until the CPU's product choices settle
  decode_compile.py `start_choice`, `DecodeCompile`: whether decoding runs the target's layers through torch.compile
                  (`eval --compile auto`: timed in the warm-up where the planned work repays the compile)
  budget_choice.py `choose_tree_budget`: the DDTree budget of `ddtree:auto` (replayed τ × measured round time)
  triage.py       `triage_divergence`: where an output departs from AR, and whether it is a near-tie or a bug
  aggregate.py    `run_record`, `ar_stats`, `method_stats`: run records → the statistics of results.json
  transcripts.py  `build_transcripts`, `TranscriptCache`: the target's greedy transcripts and their features
  simulate.py     `simulate_many`, `replay`: teacher-forced τ from those transcripts, no target forward
  stats.py        `load_prompts`, `parse_methods`, `acceptance_stats` (τ micro/macro, histogram, survival,
                  accepted / drafted), `context_notes`
  groups.py       `PromptGroups`, `with_groups`: the same statistics per prompt category and per length bucket
  report.py       `render(results.json)`, `compare([...])`
  file_schemas.py `check_results`, `progress_problem`, `budget_choice_problem`, `transcripts_problem`: every
                  field a reader uses of results.json, progress records, budget_choice.json and a transcript
                  cache's manifest, with its type (one-line errors naming the field's path)
"""
