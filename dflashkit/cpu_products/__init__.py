"""How this CPU computes, chosen by measurement at run time and kept in the user cache: the matrix products of a
decoding step, each shape the way this machine does it fastest (overridable by `DFLASHKIT_CHOICES=products=…`), and
the one mechanism every measured choice uses (`choice.py`: candidates, key, gate, store, override) — the precision of
whole passes, whether a step is compiled (`compile_choice.py`), the optimizer (docs/cpu-performance.md).

Reads: nothing but the tensors it is handed and its stores of choices. Writes: the choices
(`~/.cache/dflashkit/products/<machine>.json`, `…/train_precision/`, `…/capture_precision/`, `…/train_compile/`) and
the compiled kernel (`~/.cache/dflashkit/kernels/`), all in the user cache (`io_utils.cache_root()`).

The one entry point for the stages above (the target's decoder layers, the drafter, the decoding baselines):

    route_linears(model.layers)            # every nn.Linear inside goes through linear_product (CpuSpeed.apply):
                                           # the one call that speeds a plain module up; `Target` makes it for the
                                           # target's layers, `generate` for the drafter's
    logits = linear_product(hidden, w)     # hidden (..., H), w (V, H) → (..., V): a lone product (an LM head)
    with stock_products(): ...             # F.linear everywhere (HF's way: stock baselines, prefills)
    stock_active()                         # inside stock_products()?
    mode()                                 # "auto" (measured) or the candidate DFLASHKIT_CHOICES=products=… forces

Modules:
  products.py     the candidates and the `Chooser` that times them (ABBA-interleaved, kept only when faster);
                  `CpuSpeed` (one instance, `SPEED`): the process's choosers and pass state, and `apply`
  step_trial.py   a pass group's candidates timed inside real decoding steps; `decide`
  siblings.py     a layer's products of one input (q/k/v, gate/up) as one product over stacked weights
  packed_weights.py MKL's packed GEMM, one packed copy per weight and row count, within a memory budget
  native_rows.py  the kernels compiled for this CPU at first use: a few-row product (kernels/rows_linear.cpp) and a
                  whole decoder layer (kernels/decoder_layer.cpp, driven by target/native_layers.py)
  choice.py       a choice made by measurement: `Choice(name, values, default=, gate=)` — its override (one entry of
                  DFLASHKIT_CHOICES), its store in the user cache and for how long it is trusted, the gate a winner
                  must pass (`pick`), one timed trial of every candidate (`measure`: the precision of a whole pass)
  compile_choice.py whether a repeated step runs through torch.compile: `MeasuredCompile(name).start(…)`,
                  timed inside a run's own first steps when the run can repay the compile, kept in the user cache
  report.py       what was chosen so far (`dflashkit info`), and whether a choice is still being timed
  machine.py      the CPU, its vector extensions, BLAS and threads, and a measured memory bandwidth

Training, long prefills and GPUs always run `F.linear`: only CPU tensors of a few rows without autograd take part.
This package imports no stage; `target`, `drafter` and `decode` import it.
"""

from dflashkit.cpu_products.products import linear_product, mode, route_linears, stock_active, stock_products

__all__ = ["linear_product", "mode", "route_linears", "stock_active", "stock_products"]
