"""`python -m specformer_jax.cli`: the `specformer` command."""

import sys

from specformer_jax.cli import main

sys.exit(main())
