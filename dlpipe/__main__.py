"""`python -m dlpipe` (and `torchrun -m dlpipe`) run the same entry point as the `dlpipe` script."""

from dlpipe.cli import main

main()
