"""Drafter training: the objective (loss.py) and its self-distillation data (prompts.py, distill.py)."""
