"""Inference after training: data-parallel generation (`ft generate`) and evaluation (`ft eval`).

prompts.py   prompt files and config datasets -> Prompt records (id, fields, messages or text, reference)
source.py    run folder, merged model, or base + adapter -> model and tokenizer
batches.py   length-sorted batches formed once, then dealt to processes
engines.py   transformers generate, or vLLM where installed
store.py     per-process part files, resume, and the merge into one output in input order
generate.py  the launcher and the per-process worker of `ft generate`
scoring.py   task metrics: exact_match, contains, regex, user functions
evaluation.py `ft eval`: task metrics, loss and perplexity, lm-eval-harness tasks
"""
