"""`dflashkit convert`: a drafter checkpoint into another format (z-lab, speculators, vLLM's serving layout,
DeepSpec, GGUF for llama.cpp), or a checkpoint of another trainer into dflashkit's.

    dflashkit convert SRC OUT [--to zlab|speculators|vllm|deepspec] [--target T] [--dtype bf16] [--num-target-layers N]
    dflashkit convert SRC OUT.gguf --to gguf --target TARGET.gguf [--outtype f32|f16|bf16|q8_0]   # llama.cpp
    dflashkit convert SRC OUT --to vllm --target T --eval runs/eval      # τ measured by `eval` into the model card

Every export writes a model card beside the weights (export/model_card.py).
"""

from __future__ import annotations

import argparse

from dflashkit.cli import command
from dflashkit.validation import PositiveInt, Text, flag


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=flag(Text), help="source checkpoint (speculators, z-lab or dflashkit format; detected)")
    p.add_argument("out", type=flag(Text), help="output directory (new or empty; --to gguf: a new .gguf file)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty output directory (its config.json / model.safetensors and the model card "
        "dflashkit wrote there are replaced, other files stay) or over an existing .gguf file",
    )
    p.add_argument(
        "--to",
        choices=("zlab", "speculators", "vllm", "deepspec", "gguf"),
        default="zlab",
        help="output format (default zlab: z-lab's layout; vllm: the serving layout vLLM method=dflash loads as it "
        "is — reduced vocabularies and learned masks included; deepspec: a DSpark drafter as DeepSpec's "
        "Qwen3DSparkModel loads it (needs --target); gguf: a file for llama.cpp --spec-type draft-dflash)",
    )
    p.add_argument(
        "--target",
        type=flag(Text),
        default=None,
        help="--to gguf: the target's GGUF file (the one llama.cpp runs; 'default' = the embedded SmolLM2); its "
        "tokenizer and, when needed, tables are copied. --to vllm: the HF target (a reduced vocabulary ships its "
        "LM-head rows; a learned mask gets a mask token id no chat produces); --to speculators: the HF target (a "
        "reduced vocabulary ships its LM-head rows); --to deepspec: the HF target whose tables are written with the "
        "drafter; and for any --to, the HF target a DeepSpec checkpoint's copies of the target's tables are checked "
        "against",
    )
    p.add_argument(
        "--outtype",
        default=None,
        choices=("f32", "f16", "bf16", "q8_0"),
        help="--to gguf: drafter matrices as f32, f16, bf16 or q8_0 (default f16)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=("bf16", "bfloat16", "fp16", "float16", "fp32", "float32"),
        help="cast floating tensors",
    )
    p.add_argument(
        "--eval",
        type=flag(Text),
        action="append",
        default=None,
        metavar="DIR",
        help="an `eval` or `simulate` output directory (or its results.json) that measured this drafter: its τ goes "
        "into the model card written beside the export; repeatable",
    )
    p.add_argument(
        "--num-target-layers",
        type=flag(PositiveInt),
        default=None,
        help="the target's decoder-layer count (speculators configs do not record it)",
    )


@command(
    "convert",
    "convert drafter checkpoints: → vLLM's serving layout, z-lab, speculators, GGUF (llama.cpp); --dtype",
    _convert_args,
)
def _convert(args: argparse.Namespace) -> int:
    from dflashkit.errors import ConfigError
    from dflashkit.export.convert import convert

    if args.outtype is not None and args.to != "gguf":
        raise ConfigError(f"--outtype {args.outtype} applies to --to gguf; --to is {args.to} (use --dtype)")
    if args.to == "gguf":
        from dflashkit.export.gguf_export import export_gguf

        if args.target is None:
            raise ConfigError("--to gguf needs --target: the target's GGUF file (or 'default')")
        print(
            export_gguf(
                args.src,
                args.out,
                target=args.target,
                outtype=args.outtype or "f16",
                num_target_layers=args.num_target_layers,
                overwrite=args.overwrite,
                evals=args.eval or (),
            ).render()
        )
        return 0
    target = None
    if args.target is not None:
        from dflashkit.target.model import Target

        target = Target.load(args.target)
    report = convert(
        args.src,
        args.out,
        to=args.to,
        dtype=args.dtype,
        num_target_layers=args.num_target_layers,
        target=target,
        overwrite=args.overwrite,
        evals=args.eval or (),
    )
    print(report.render())
    return 0
