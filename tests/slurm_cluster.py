"""A real Slurm cluster on this machine for the tests: Debian's slurm-wlm and
munge, one slurmctld and two slurmd "nodes" (n1, n2) on 127.0.0.1 with ports
of their own (Slurm's multiple-slurmd mode: ``slurmd -N NAME``), all in a
temp dir with a munge socket of its own. Needs root (slurmd starts job steps
as the submitting user; root here) or the Slurm binaries are useless.

Started and stopped by the test fixture itself, so ``python -m pytest``
works without .ci/run; without the binaries the tests skip with the reason,
unless RANKWATCH_REQUIRE_SLURM is set (.ci/run sets it): then they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
NODES = ("n1", "n2")
KILL_WAIT_S = 10  # scancel/time limit: SIGTERM, then SIGKILL this much later (Slurm's default is 30)

CONF = """\
ClusterName=rankwatch
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={first_node_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
KillWait={kill_wait}
MinJobAge=600
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None]


def version() -> str:
    done = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True, timeout=10)
    return done.stdout.strip()


TORCH_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                    "GROUP_RANK", "TORCHELASTIC_RUN_ID")


class SlurmCluster:
    def __init__(self, root: Path, ports: list[int]):
        self.dir = root
        self.ports = ports
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        for name in list(self.env):
            if name.startswith("SLURM_") and name != "SLURM_CONF":
                del self.env[name]  # a test run inside a Slurm job must not leak its own job into these
            elif name in TORCH_RENDEZVOUS:
                del self.env[name]  # nor a rendezvous of the test process's own (sbatch exports it to the job)

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        for node in NODES:
            (self.dir / "spool" / node).mkdir(parents=True, exist_ok=True)
        ctld_port, node_ports = self.ports[0], self.ports[1:]
        nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=4 "
                          f"RealMemory=4000 State=UNKNOWN" for name, port in zip(NODES, node_ports))
        (self.dir / "slurm.conf").write_text(CONF.format(
            ctld_port=ctld_port, first_node_port=node_ports[0], dir=self.dir, kill_wait=KILL_WAIT_S,
            nodes=nodes, node_names=",".join(NODES)))
        self._daemon(["munged", "-F", "-f", f"--socket={self.dir}/munge.sock", f"--pid-file={self.dir}/munged.pid",
                      f"--log-file={self.dir}/munged.log", f"--seed-file={self.dir}/munged.seed"], "munged")
        self._wait(lambda: (self.dir / "munge.sock").exists(), 20, "munged's socket")
        self._daemon(["slurmctld", "-D", "-i"], "slurmctld")
        for node in NODES:
            self._daemon(["slurmd", "-D", "-N", node], f"slurmd-{node}")
        self._wait(self._nodes_idle, timeout, "both slurmd nodes idle in sinfo")
        return self

    def _daemon(self, cmd: list[str], name: str) -> None:
        log = open(self.dir / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def _nodes_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}: {self.logs()}")
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True,
                              timeout=10)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in NODES)

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd-n1.log", "slurmd-n2.log", "munged.out", "slurmctld.out"):
            path = self.dir / name
            if path.exists():
                out.append(f"--- {name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    @staticmethod
    def _wait(predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")

    # -- jobs ----------------------------------------------------------------------------
    def sbatch(self, script: Path, args: list[str], options: list[str], cwd: Path,
               env: Optional[dict] = None) -> str:
        done = subprocess.run(["sbatch", "--parsable", f"--chdir={cwd}", f"--output={cwd}/job-%j.out", *options,
                               str(script), *args], env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}\n{self.logs()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True,
                              text=True, timeout=10)
        fields: dict[str, str] = {}
        for token in done.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def wait_done(self, job_id: str, timeout: float) -> dict[str, str]:
        """The job's fields once it has left RUNNING/PENDING/COMPLETING."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            fields = self.job(job_id)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return fields
            time.sleep(0.3)
        self.scancel(job_id)
        raise AssertionError(f"job {job_id} not done after {timeout:.0f} s: {self.job(job_id)}")

    def scancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=10)

    def stop(self) -> None:
        subprocess.run(["scancel", "--user=root"], env=self.env, capture_output=True, timeout=10)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
