"""Evaluation during training (trainer.eval): held-out prompts scored with pass@k and mean@k, on every node's own
server. `scores` holds the arithmetic (pure), `evaluator` the collective run on the ranks."""
