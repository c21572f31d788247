"""Drafter training: prompts (prompts.py, self_prompts.py), self-distilled data written (distill.py) and read
(dataset.py, batches.py), the objective (loss.py), the run (train_config.py, trainer.py) and evaluation."""
