"""dflashkit: train, evaluate, diagnose and export DFlash speculative-decoding drafters for any Hugging Face causal LM
(the package map: docs/architecture.md).

The public names, each imported when first used (`import dflashkit` alone loads neither torch nor transformers):

    from dflashkit import Target, load_drafter, encode_prompt, generate, DecodeSettings, SamplingParams
    from dflashkit import TrainConfig, train_drafter, evaluate_drafters, EvalSettings, load_prompts, convert
    from dflashkit import make_plan, PlanRequest

    target, drafter = Target.load("default"), load_drafter("runs/quickstart/drafter")
    ids = encode_prompt(target.tokenizer, [{"role": "user", "content": "Hi"}])
    generate(target, ids, drafter=drafter, settings=DecodeSettings(method="tree", tree_budget=8)).tau
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name → (the module that defines it, its name there); `train` and `evaluate` are the stages' package names,
# so their entry points are public as train_drafter and evaluate_drafters
_PUBLIC = {
    "Target": ("dflashkit.target.model", "Target"),
    "load_drafter": ("dflashkit.drafter.checkpoint", "load_drafter"),
    "encode_prompt": ("dflashkit.data.conversations", "encode_prompt"),
    "generate": ("dflashkit.decode.generate", "generate"),
    "DecodeSettings": ("dflashkit.decode.generate", "DecodeSettings"),
    "SamplingParams": ("dflashkit.sampling", "SamplingParams"),
    "TrainConfig": ("dflashkit.train.config", "TrainConfig"),
    "train_drafter": ("dflashkit.train.loop", "train"),
    "evaluate_drafters": ("dflashkit.evaluate.evaluate", "evaluate"),
    "EvalSettings": ("dflashkit.evaluate.evaluate", "EvalSettings"),
    "load_prompts": ("dflashkit.evaluate.stats", "load_prompts"),
    "convert": ("dflashkit.export.convert", "convert"),
    "make_plan": ("dflashkit.diagnose.plan", "make_plan"),
    "PlanRequest": ("dflashkit.diagnose.plan", "PlanRequest"),
}
__all__ = [
    "DecodeSettings", "EvalSettings", "PlanRequest", "SamplingParams", "Target", "TrainConfig", "convert",
    "encode_prompt", "evaluate_drafters", "generate", "load_drafter", "load_prompts", "make_plan", "train_drafter",
]  # fmt: skip

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from dflashkit.data.conversations import encode_prompt
    from dflashkit.decode.generate import DecodeSettings, generate
    from dflashkit.diagnose.plan import PlanRequest, make_plan
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.evaluate.evaluate import EvalSettings
    from dflashkit.evaluate.evaluate import evaluate as evaluate_drafters
    from dflashkit.evaluate.stats import load_prompts
    from dflashkit.export.convert import convert
    from dflashkit.sampling import SamplingParams
    from dflashkit.target.model import Target
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train as train_drafter


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'dflashkit' has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
