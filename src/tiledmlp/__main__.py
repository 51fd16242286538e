"""`python -m tiledmlp` runs the command-line interface."""

from tiledmlp.cli import console

console()
