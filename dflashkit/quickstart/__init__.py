"""`dflashkit quickstart`: the whole job on the embedded default target within a time budget, resumable — the
stages strung together, measured on the machine at hand.

  run.py         the stages in order (target → prepare → capture → train → export → evaluate), `QuickstartSettings`
  rates.py       what this machine does per second, measured at the start: the yardstick for the budget's split
  server.py      regeneration through llama.cpp's `llama-server` when it is built and measured faster
  evaluation.py  the DDTree budget chosen by measurement, then held-out MT-Bench and HumanEval
  screen.py      the last screen: τ and speed per dataset and method, the data and training it got
"""
