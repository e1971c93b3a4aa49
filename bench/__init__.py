"""The benchmarks, run as modules from the repository root: ``python -m bench.ops --device
cpu`` (bench/README.md: which script answers which question)."""
