"""Measuring a running job: the resource sampler (CPU, memory, GPU, workers) and the profilers."""
