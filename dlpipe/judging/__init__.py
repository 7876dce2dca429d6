"""Judging the measurements: the per-epoch verdict (what the bottleneck is), the advice and its
expected gain, the journal of measured loader settings, and the evidence measured for it."""
