"""Parts of benchmarks/no_regret.py."""
