"""A real one-node Slurm cluster for the tests: munge, MariaDB, slurmdbd, slurmctld and slurmd on
127.0.0.1, with its state in a private folder, started once per test session and stopped by PID.

Needs root and Debian's packages (`apt-get install slurm-wlm munge slurmdbd mariadb-server`, as
.ci/run does); where either is missing the fixture skips its tests with one line saying which.

Why each setting (measured on a 2-CPU sandbox, Slurm 22.05):
- accounting (slurmdbd + MariaDB): submitit polls `sacct`; without it a cancelled job stays UNKNOWN
  to the submitter and a sweep waits forever;
- `AuthInfo=cred_expire=10`: a requeued job may start again 11 s after its requeue (default 120 s);
  `sched_interval=5,bf_interval=5`: the scheduler looks every 5 s (default 60/30 s);
- proctrack/linuxproc and task/affinity need no cgroups (a sandboxed kernel may have none);
- partitions: `debug` (the default) is preempted by `urgent` with a grace period; `nograce` is
  preempted without one (Slurm's SIGTERM, SIGCONT, SIGTERM, then SIGKILL after KillWait);
- no `preempt_send_user_signal`: preemption sends Slurm's default SIGTERM, as on most clusters;
- a munged of its own on its own socket (`AuthInfo=socket=`, and `AccountingStoragePass` for the
  clients' connections to slurmdbd, which do not read AuthInfo): the machine's munged is never
  touched, and clusters of two pytest-xdist workers (pytest 9 ignores xdist_group) run side by side.
"""

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from mlflow_server import free_port

GRACE_S = 20  # the debug partition's GraceTime: how long a preempted job has before SIGKILL
KILL_WAIT_S = 15  # SIGTERM to SIGKILL on scancel, a time limit, or preemption without grace
NEEDED = ("munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld", "slurmd", "sacctmgr",
          "sbatch", "scontrol", "sinfo", "squeue", "sacct", "scancel")


def why_not_here() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    missing = [p for p in NEEDED if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return (f"Slurm not installed (no {', '.join(missing)}): "
                "apt-get install slurm-wlm munge slurmdbd mariadb-server")
    if os.geteuid() != 0:
        return "the Slurm tests start slurmctld, slurmd and slurmdbd, which need root"
    return None


def program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """The daemons this object started (by PID), the config they read, and commands against them."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.started: list[tuple[str, subprocess.Popen]] = []  # (name, process), in start order
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1  # the node's CPUs
        self.munge_dir: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing here, for the Slurm commands and a test's submitter."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """A Slurm command against this cluster; its stdout."""
        r = subprocess.run([program(cmd[0]), *cmd[1:]], env=self.env, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}\n{self.logs()}")
        return r.stdout

    def answers(self, *cmd: str) -> bool:
        """Whether a Slurm command against this cluster succeeds."""
        return subprocess.run([program(cmd[0]), *cmd[1:]], env=self.env, capture_output=True, timeout=30,
                              stdin=subprocess.DEVNULL).returncode == 0

    def job_state(self, job_id: str) -> str:
        """JobState of `job_id` as slurmctld has it now ('' once it left slurmctld's memory)."""
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False)
        return out.strip()

    def wait(self, what: str, ready, timeout: float = 60, every: float = 0.5):
        """Poll `ready()` until it returns something true; fail naming `what` with the daemons' logs."""
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            dead = [name for name, p in self.started if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:.0f} s"
                raise RuntimeError(f"Slurm test cluster: {what}: {why}\n{self.logs()}")
            time.sleep(every)

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for log in sorted(self.root.glob("log/*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def _daemon(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start a daemon in the foreground (so its PID is the one we hold), in a session of its own
        (a test's signal to its process group never reaches it), output into log/NAME.out.log."""
        out = open(self.root / "log" / f"{name}.out.log", "ab")  # noqa: SIM115 (the daemon holds it)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=self.env, **kwargs)
        out.close()
        self.started.append((name, proc))
        return proc

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        for sub in ("state", "spool", "log", "mysql"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        ports = {k: free_port() for k in ("mysql", "dbd", "ctld", "slurmd")}
        self._munge()
        self._mariadb(ports["mysql"])
        self._write_confs(ports)
        self._daemon("slurmdbd", [program("slurmdbd"), "-D"])
        # the cluster must exist in the accounting database before slurmctld registers with it
        self.wait("slurmdbd answering", lambda: self.answers("sacctmgr", "-n", "list", "cluster"))
        self.run("sacctmgr", "-i", "add", "cluster", "dlpipe")
        self._daemon("slurmctld", [program("slurmctld"), "-D", "-f", str(self.conf)])
        self._daemon("slurmd", [program("slurmd"), "-D", "-f", str(self.conf)])
        self.wait("the node idle in sinfo", lambda: "idle" in self.run("sinfo", "-h", "-o", "%t", check=False))

    def _munge(self) -> None:
        """A munged of this cluster's own, as the munge user (it refuses root), on a socket of its own:
        a munged the machine already runs is never touched, and each pytest-xdist worker's cluster
        has its own. Its folder is outside pytest's tmp, which only root may enter."""
        munge = pwd.getpwnam("munge")
        self.munge_dir = Path(tempfile.mkdtemp(prefix="dlpipe-munge-"))
        self.munge_dir.chmod(0o755)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        d = self.munge_dir
        self._daemon("munged", [program("munged"), "--foreground", f"--socket={d}/munge.socket",
                                f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                                f"--seed-file={d}/munged.seed"], user=munge.pw_uid, group=munge.pw_gid)
        check = f"munge -S {d}/munge.socket -n | unmunge -S {d}/munge.socket"
        self.wait("munged answering", lambda: subprocess.run(["sh", "-c", check], capture_output=True).returncode == 0)

    def _mariadb(self, port: int) -> None:
        """A private MariaDB: its own datadir and socket, TCP on 127.0.0.1 only (slurmdbd's way in)."""
        db = self.root / "mysql"
        (db / "my.cnf").write_text(f"""[mariadbd]
datadir={db}/data
socket={db}/mysqld.sock
port={port}
bind-address=127.0.0.1
pid-file={db}/mysqld.pid
log-error={self.root}/log/mariadb.log
user=root
innodb_buffer_pool_size=32M
""")
        self._setup_step(program("mariadb-install-db"), "--no-defaults", "--user=root", f"--datadir={db}/data",
                         "--auth-root-authentication-method=normal")
        self._daemon("mariadbd", [program("mariadbd"), f"--defaults-file={db}/my.cnf"])
        self.wait("MariaDB listening", lambda: (db / "mysqld.sock").exists())
        self._setup_step(program("mariadb"), f"--socket={db}/mysqld.sock", "-uroot", "-e",
                         "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';"
                         " GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")

    def _setup_step(self, *cmd: str) -> None:
        """A command that prepares the cluster; when it fails, the error says why (its output and the
        daemons' logs): a bare CalledProcessError hid why mariadb-install-db failed once on a loaded
        machine."""
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}\n"
                               f"{self.logs()}")

    def _write_confs(self, ports: dict[str, int]) -> None:
        r, cpus = self.root, self.cpus
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 8 // 10
        dbd = r / "slurmdbd.conf"
        dbd.write_text(f"""AuthType=auth/munge
AuthInfo=socket={self.munge_dir}/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports['dbd']}
SlurmUser=root
LogFile={r}/log/slurmdbd.log
PidFile={r}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mysql']}
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it holds the password)
        self.conf.write_text(f"""ClusterName=dlpipe
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmdPort={ports['slurmd']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
AuthInfo=cred_expire=10,socket={self.munge_dir}/munge.socket
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports['dbd']}
AccountingStoragePass={self.munge_dir}/munge.socket
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait={KILL_WAIT_S}
MinJobAge=300
InactiveLimit=0
Waittime=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_S}
PartitionName=nograce Nodes={self.host} MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=0
PartitionName=urgent Nodes={self.host} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel what still runs, then stop every daemon this object started, newest first, by PID."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self.started):
            self.run("scancel", "--user", "root", check=False)
            # KillWait bounds a step's exit; the daemons' own shutdown ends what is left after it
            deadline = time.monotonic() + KILL_WAIT_S + 15
            while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for _name, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.started.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)  # munged ran as munge: its files are its own


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster for the session: yields it (its `conf` is the SLURM_CONF path)."""
    why = why_not_here()
    if why is not None:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
