"""dflashkit: train, evaluate, diagnose and export DFlash speculative-decoding drafters for any Hugging Face causal LM
(the package map: docs/architecture.md)."""
