"""Evaluation on benchmarks: rollouts, metrics, the paper's table (entry: evaluation.run)."""
