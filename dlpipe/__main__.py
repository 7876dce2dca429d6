"""`python -m dlpipe` runs the same entry point as the `dlpipe` script."""

from dlpipe.cli import main

main()
