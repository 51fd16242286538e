"""`python -m tiledmlp.bench.suite`: the measurement suite's command (bench/suite/run.py)."""

import sys

from tiledmlp.bench.suite.run import main

sys.exit(main())
