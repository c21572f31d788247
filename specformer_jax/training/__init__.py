"""Drafter training: the data below (data/: prompts, self-distilled answers written and read, packed data, batches,
draft vocabularies), and above it the objective (loss.py), the run (train_config.py, trainer.py), cached target
states (state_cache.py), evaluation (evaluate.py), weight averages (averaging.py) and training curves (plots.py)."""
