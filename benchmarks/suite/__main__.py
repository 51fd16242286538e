"""`python -m benchmarks.suite`: the measurement suite's command (benchmarks/suite/run.py)."""

import sys

from benchmarks.suite.run import main

sys.exit(main())
