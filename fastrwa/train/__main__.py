import sys

import torch

from .cli import main

# Subnormal floats flushed to zero for the whole process (every thread started from here
# on inherits it): training on CPU makes them, and x86 matrix products with subnormal
# operands run several times slower (docs/training.md).
torch.set_flush_denormal(True)
sys.exit(main())
