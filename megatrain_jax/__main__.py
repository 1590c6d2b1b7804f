"""``python -m megatrain_jax`` (and the ``megatrain-jax`` script): with no arguments, the demo."""

import sys

from megatrain_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
