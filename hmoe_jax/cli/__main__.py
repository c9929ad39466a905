"""`python -m hmoe_jax.cli ...`: the same as the `hmoe` console script."""

import sys

from hmoe_jax.cli.app import main

sys.exit(main())
