"""How a sweep's launcher ends the sweep when it cannot go on: one line for the CLI to print, the exit
status, and (through the sweep's callback) the parent run's end reason.

A light module of its own: the CLI catches SweepEnded without importing a launcher (submitit's
Hydra plugin) for every command. (The CLI runs Hydra with HYDRA_FULL_ERROR=1, so Hydra passes any
exception on as it is.)
"""


class SweepEnded(Exception):
    """The sweep ended early, as `line` says; the CLI prints it and exits `exit_code`."""

    def __init__(self, line: str, exit_code: int = 1):
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code
