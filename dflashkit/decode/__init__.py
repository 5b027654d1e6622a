"""Stage `decode`: speculative generation with a drafter — chain and DDTree verification, lossless sampling.
Imports: `target`, `drafter` (a round's drafts come from the drafter's head) and the shared `sampling` rules.

Reads: a loaded target and drafter, a prompt's token ids. Writes nothing: `generate` returns the tokens, the
acceptance length of every round and the time spent per stage.

Modules and their public functions:
  generate.py     `generate(target, ids, drafter=…, settings=DecodeSettings(method="chain", …))` → `GenerationResult`
  tree.py         `build_tree` (DDTree best-first over per-depth marginals), `follow_tree`,
                  `tree_attention_bias`, `chain_tree`
  hybrid_tree.py  `verify_tree`: exact DDTree verification on hybrid (Gated DeltaNet) targets, `resolve_mode`
"""
