"""The machine's facts: the CPU budget (affinity, cgroup quota, Slurm, ranks per node, jobs sharing
the CPUs), memory and shared memory, GPUs through NVML, and writing files atomically on its disks."""
