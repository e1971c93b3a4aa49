"""Model-quality experiments (what a model learns, not how fast an op runs), run as modules
from the repository root: ``python -m bench.experiments.lm --data FILE`` (bench/README.md)."""
