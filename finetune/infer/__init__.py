"""Inference after training: data-parallel generation (`ft generate`) and evaluation (`ft eval`).

prompts.py   prompt files and config datasets -> Prompt records (id, fields, messages or text, reference)
batches.py   length-sorted batches formed once, then dealt to processes
engines.py   transformers generate, or vLLM where installed; the dtype to generate in
store.py     per-process part files, resume, and the merge into one output in input order
job.py       GenerateJob: what one `ft generate` produces (OUT.parts/job.json)
generate.py  the launcher of `ft generate`
worker.py    one process of `ft generate`: its share of the batches
nodes.py     `ft generate` / `ft eval` across nodes: each node's torchrun command, the ranks' attempt and final barrier
scoring.py   task metrics: exact_match, contains, regex, user functions
evaluation.py `ft eval`: task metrics, loss and perplexity, lm-eval-harness tasks; the task metric in training
lmeval.py    lm-eval-harness tasks on the loaded model
commands.py  the verbs: options -> job -> run -> report

What a SOURCE argument names (run folder, model, adapter on its base) and how it loads: finetune.artifacts.
"""
