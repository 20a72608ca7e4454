"""A real Slurm on this one machine for the tests: munged, slurmctld and one slurmd, each started
from files in a folder of its own and stopped by its pid.

Everything lives in that folder (config, state, spool, logs, munge's key and socket) and the ports
are free ones, so several of these can run beside each other and beside a system Slurm. One slurmd
is one node (Debian's build has no multiple-slurmd): a "two-node" job is two tasks on this node.
Needs root (slurmd runs jobs as their users) and Debian's ``slurm-wlm`` and ``munge``.

    python -m tests.functional.slurm_cluster DIR   # start one, print SLURM_CONF=..., Ctrl-C stops it
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.unit.test_faults import _alive  # a pid that runs (not gone, not a zombie)

DAEMONS = ("munged", "slurmctld", "slurmd", "mungekey")


def why_not_available() -> str | None:
    """None where a cluster can be started here, else the reason in a few words."""
    missing = [name for name in DAEMONS + ("sbatch", "scontrol") if not _which(name)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found; Debian: apt-get install "
                f"slurm-wlm munge)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (not root here)"
    return None


def _which(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_ports(count):
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    """Start with ``start()``, stop with ``stop()``; ``env`` is the environment for sbatch,
    scontrol and the jobs (SLURM_CONF)."""

    def __init__(self, folder, cpus: int = 2):
        self.dir = Path(folder).resolve()
        self.cpus = cpus
        self.pids: dict[str, int] = {}
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        # A job's environment is the submitter's: the test's own Slurm variables stay out.
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                del self.env[key]

    def start(self, timeout_s: float = 30.0) -> "Cluster":
        for sub in ("state", "spool", "munge"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)  # munged refuses a socket folder others can write
        key, sock = self.dir / "munge" / "munge.key", self.dir / "munge" / "munge.socket"
        subprocess.run([_which("mungekey"), "--create", "--force", f"--keyfile={key}"],
                       check=True, capture_output=True)
        os.chmod(key, 0o600)
        subprocess.run(
            [_which("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
             f"--log-file={self.dir / 'munge' / 'munged.log'}",
             f"--seed-file={self.dir / 'munge' / 'munged.seed'}"],
            check=True, capture_output=True)
        self.pids["munged"] = self._pid(self.dir / "munge" / "munged.pid", timeout_s)
        host = socket.gethostname()
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text("\n".join([
            "ClusterName=mcoreext",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job waits this long to start again (default 120 s)
            f"AuthInfo=socket={sock},cred_expire=20",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'slurmd.log'}",
            "SlurmUser=root",
            "JobRequeue=1",
            "MpiDefault=none",
            "KillWait=30",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for the checks
            "SchedulerParameters=sched_interval=1",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=8000 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_which(daemon), "-f", str(self.conf)], env=self.env, check=True,
                           capture_output=True)
            self.pids[daemon] = self._pid(self.dir / f"{daemon}.pid", timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.scontrol("show", "node", host, check=False)
            if "State=IDLE" in state:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"slurm node not idle after {timeout_s}s: {state}\n"
                           f"{self.log('slurmctld')[-2000:]}\n{self.log('slurmd')[-2000:]}")

    def _pid(self, path, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(0.1)
        raise RuntimeError(f"no pid in {path} after {timeout_s}s")

    def log(self, daemon) -> str:
        path = self.dir / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def scontrol(self, *args, check=True) -> str:
        done = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)
        if check and done.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr}")
        return done.stdout + done.stderr

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM each daemon this started (slurmd, slurmctld, munged), by pid, then SIGKILL."""
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)




if __name__ == "__main__":
    import sys

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stopped by timeout or kill: the daemons too
    cluster = Cluster(sys.argv[1])
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
