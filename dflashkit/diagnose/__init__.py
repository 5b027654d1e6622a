"""Stage `diagnose`: what a drafter, a run or a target really is, and what is wrong with it — the top stage;
it may read every stage below.

Reads: checkpoints, capture directories, `metrics.jsonl`, targets (a plan: only their config.json). Writes: text
or JSON on stdout, PNG plots (`logs --out`), a plan's plan.json, plan.md and train.yaml.

Modules and their public functions:
  info.py                `gather_info(target)`, `render_info`: the target, its default drafter, cache paths
  inspect_checkpoint.py  `inspect_checkpoint(path)`, `render_report`: facts read from the tensors
  diff.py                `diff_checkpoints(a, b)`, `render_diff`
  doctor.py              `run_doctor(target, drafter, …)` and its checks, one function each (`config_fit`, …)
  logs.py                `read_run`, `analyze`, `compare`, `plot`: training health from metrics.jsonl
  plan.py                `make_plan(PlanRequest)` → `Plan`: a recipe and a budget for a target and hardware
  plan_files.py          `write_plan`, `plan_yaml`, `plan_commands`, `render_markdown`: what a plan hands the user
"""
