"""Parts of benchmarks/goodput.py."""
