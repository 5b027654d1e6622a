"""Stage `decode`: speculative generation with a drafter — chain and DDTree verification, lossless sampling.
Imports: `target`, `drafter`.

Reads: a loaded target and drafter, a prompt's token ids. Writes nothing: `generate` returns the tokens, the
acceptance length of every round and the time spent per stage.

Modules and their public functions:
  generate.py     `generate(target, ids, drafter=…, settings=DecodeSettings(method="chain", …))` → `GenerationResult`
  tree.py         `build_tree` (DDTree best-first over per-depth marginals), `follow_tree`,
                  `tree_attention_bias`, `chain_tree`
  hybrid_tree.py  `verify_tree`: exact DDTree verification on hybrid (Gated DeltaNet) targets, `resolve_mode`
  sampling.py     `SamplingParams`, `probs`, `accept_argmax_drafts`, `accept_sampled_drafts`
  dspark_draft.py `draft_dspark` (a DSpark round: backbone + Markov head left to right), `dspark_conditional`
"""
