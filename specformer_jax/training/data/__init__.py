"""Training data: built-in and self-written prompts (prompts.py, self_prompts.py), self-distilled answers written
(distill.py) and read (dataset.py), packed for keeping (packed.py), batched for the step (batches.py), and the draft
vocabulary counted from them (draft_vocab.py)."""
