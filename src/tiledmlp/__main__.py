"""`python -m tiledmlp` runs the command-line interface."""

import sys

from tiledmlp.cli import main

sys.exit(main())
