"""Lab 06's ranks: torchrun under `utils.base.processes.Owned`, on 127.0.0.1, NVLink multicast off, errors shown.

    run = launch.torchrun("utils.multigpu.collectives", ["--sizes", "1024"], nproc=2, timeout=120, name="collectives")
    run.result()          # what rank 0 wrote to run.out_dir/result.json

`torchrun()` starts `python -m torch.distributed.run` (one agent per "node"; two agents on this machine
for `nnodes=2`) with the c10d rendezvous on a free port of 127.0.0.1, in a process group the course owns:
the group ends when the call returns, when it times out, or when the notebook's kernel dies. A rank that
raises ends the whole group (torchrun stops the others) and `RankFailed` shows that rank's own traceback,
read from the error file torchrun's `@record` wrote, not the launcher's. Every rank's environment turns
NVLink multicast (NVLS) off.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from utils.base import processes
from utils.base.paths import LOOPBACK, build_dir, free_port

# NVLink SHARP / multicast (NVLS): on NVSwitch systems, NCCL, PyTorch's symmetric memory and NVSHMEM can
# let the switch itself combine and replicate data. It reserves switch and driver resources shared by every
# GPU of the host; the course keeps it off in every process it starts.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOOPBACK_IFNAME = "lo"   # Linux's loopback interface: gloo binds its connections to it (GLOO_SOCKET_IFNAME)


def port_listening(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def rank_env(base: dict | None = None) -> dict[str, str]:
    """The environment of every rank: the caller's, plus NVLS off, gloo's and NCCL's sockets on the loopback
    interface (unless the caller names another), unbuffered output and no model hub."""
    env = dict(os.environ if base is None else base)
    env.update(NVLS_OFF)
    env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)   # one machine: the ranks' own connections stay
    env.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)   # on the loopback interface (NCCL: its bootstrap)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY=env.get("TRANSFORMERS_VERBOSITY", "error"))
    return env


def torchrun_command(target: str, args=(), *, nproc: int, nnodes: int = 1, endpoint: str, rdzv_id: str,
                     log_dir: str | Path | None = None, is_host: bool | None = None, python: str | None = None,
                     module: bool = True) -> list[str]:
    """The torchrun command line for one agent (one "node"): c10d rendezvous at `endpoint`, no restarts,
    every rank's output teed to `log_dir/<run>/attempt_0/<rank>/`."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", rdzv_id, "--max-restarts", "0", "--monitor-interval", "0.5"]
    if is_host is not None:      # which agent hosts the rendezvous store when all run on one machine
        cmd += ["--rdzv-conf", f"is_host={int(is_host)}"]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir), "--tee", "3"]
    return cmd + (["-m"] if module else []) + [target, *map(str, args)]


class RankFailed(RuntimeError):
    """A rank raised (or died): the first rank that failed, its error and its own traceback."""

    def __init__(self, summary: str, *, rank: int | None = None, error: str = "", traceback: str = "",
                 log: str | Path | None = None):
        super().__init__(summary)
        self.rank, self.error, self.traceback, self.log = rank, error, traceback, log
        self.run: Run | None = None       # the run that failed (its processes are gone: run.gone())

    def _render_traceback_(self):   # IPython shows the rank's traceback, not the launcher's
        lines = [f"{type(self).__name__}: {self}"]
        if self.traceback:
            lines += [f"--- traceback of rank {self.rank} ---", *self.traceback.rstrip().splitlines()]
        if self.log:
            lines.append(f"(every rank's output: {self.log})")
        return lines


class RankTimeout(RankFailed):
    """The ranks did not finish in time; the whole group was ended."""


@dataclass
class Run:
    name: str
    command: list[list[str]]
    log: Path                      # the agents' output (with every rank's, teed)
    log_dir: Path                  # torchrun's per-rank logs and error files
    out_dir: Path                  # where the ranks write their results (--out)
    port: int
    pgids: list[int] = field(default_factory=list)
    nonces: list[str] = field(default_factory=list)   # in every process's environment (utils.base.processes)
    seconds: float = 0.0
    returncodes: list[int | None] = field(default_factory=list)

    def result(self, name: str = "result.json") -> dict:
        return json.loads((self.out_dir / name).read_text())

    def gone(self) -> bool:
        """Whether every process of the run has ended (its process groups, and any process that carries
        its nonce) and its rendezvous port is closed."""
        return (not any(processes.group_alive(g) for g in self.pgids) and not processes_with_nonce(self.nonces)
                and not port_listening(self.port))

    def command_line(self, i: int = 0) -> str:
        return shlex.join(self.command[i])


def processes_with_nonce(nonces: list[str]) -> list[int]:
    """Pids of the running processes (readable by this user) whose environment carries one of `nonces`:
    whatever a run started, even a process that left its process group."""
    return [pid for pid in psutil.pids()
            if pid != os.getpid() and processes.environ(pid).get(processes.NONCE_VAR) in nonces and processes.alive(pid)]


def _error_files(log_dir: Path) -> list[dict]:
    """The error files torchrun's @record wrote (one per failed rank), oldest first."""
    found = []
    for path in log_dir.rglob("error.json"):
        try:
            data = json.loads(path.read_text())
            message = data["message"]
            if isinstance(message, str):
                message = {"message": message, "extraInfo": {}}
            extra = message.get("extraInfo", {})
            node = next((p.name[4:] for p in path.parents if p.name.startswith("node")), "0")
            found.append({"local_rank": int(path.parent.name), "node": int(node),
                          "message": message.get("message", ""), "traceback": extra.get("py_callstack", ""),
                          "when": (float(extra.get("timestamp", 0) or 0), path.stat().st_mtime)})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(found, key=lambda e: e["when"])


def _secondary(message: str) -> bool:
    """Errors that are usually the consequence of another rank's failure (its connection went away)."""
    words = ("closed by peer", "connection reset", "connection refused", "aborted", "broken pipe",
             "sigterm", "socket timeout", "timed out", "failed to recv")
    return any(w in message.lower() for w in words)


def failure(run: Run, code: int | None) -> RankFailed:
    """The exception that explains a failed run: the first failing rank's error file (a rank whose
    error is only that a peer went away comes last), else the end of the log."""
    errors = _error_files(run.log_dir)
    firsts = [e for e in errors if not _secondary(e["message"])] or errors
    if firsts:
        e = firsts[0]
        who = f"rank {e['local_rank']}" if len(run.command) == 1 else f"node {e['node']}, local rank {e['local_rank']}"
        return RankFailed(f"{who} of the run '{run.name}' failed: {e['message']}", rank=e["local_rank"],
                          error=e["message"], traceback=e["traceback"], log=run.log)
    return RankFailed(f"the run '{run.name}' failed (exit code {code}) and no rank left an error file; "
                      f"the end of its log:\n{processes_log_tail(run.log)}", log=run.log)


def processes_log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def build_root() -> Path:
    return build_dir() / "lab06"


def torchrun(target: str, args=(), *, nproc: int, timeout: float, name: str, nnodes: int = 1,
             env: dict | None = None, python: str | None = None) -> Run:
    """Run `python -m target args... --out DIR` on `nnodes` x `nproc` ranks and wait for it.

    Raises `RankFailed` (with the first failing rank's traceback) or `RankTimeout`; either way, and on
    success, no process of the run is left. The ranks' results are in `run.out_dir`."""
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"nnodes={nnodes} and nproc={nproc} must be at least 1")
    stamp = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    root = build_root()
    out_dir, log_dir = root / "runs" / stamp, root / "logs" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"{LOOPBACK}:{port}"
    rank_environment = rank_env(env)
    cmds = [torchrun_command(target, [*args, "--out", out_dir], nproc=nproc, nnodes=nnodes, endpoint=endpoint,
                             rdzv_id=stamp, log_dir=log_dir / f"node{i}",
                             is_host=(i == 0) if nnodes > 1 else None, python=python)
            for i in range(nnodes)]
    run = Run(name=name, command=cmds, log=root / "logs" / f"{stamp}.log", log_dir=log_dir, out_dir=out_dir,
              port=port)
    agents = [processes.Owned(cmd, log_path=run.log.with_suffix(f".node{i}.log") if nnodes > 1 else run.log,
                              env=rank_environment, label=f"torchrun {name} node {i}", stop_timeout=10)
              for i, cmd in enumerate(cmds)]
    start = time.monotonic()
    try:
        for i, agent in enumerate(agents):
            agent.start()
            run.pgids.append(agent.pgid)
            run.nonces.append(agent.nonce)
            if i == 0 and nnodes > 1:
                time.sleep(0.5)     # the hosting agent first: the others connect to its store
        while True:
            codes = [a.poll() for a in agents]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() - start > timeout:
                for a in agents:
                    a.stop()
                run.seconds = time.monotonic() - start
                timed_out = RankTimeout(f"the run '{name}' did not finish in {timeout:.0f} s; every rank was "
                                        f"ended. The end of its log:\n{processes_log_tail(agents[0].log_path)}",
                                        log=run.log)
                timed_out.run = run
                raise timed_out
            time.sleep(0.1)
    finally:
        for a in agents:
            a.stop()
        run.returncodes = [a.returncode for a in agents]
        run.seconds = time.monotonic() - start
        if nnodes > 1:   # one log for the run: the nodes' logs one after the other
            with open(run.log, "w") as out:
                for a in agents:
                    out.write(Path(a.log_path).read_text(errors="replace") if Path(a.log_path).exists() else "")
    bad = [c for c in run.returncodes if c != 0]
    if bad:
        failed = failure(run, bad[0])
        failed.run = run
        raise failed
    return run


def slurm_script(target: str, args=(), *, nodes: int, gpus_per_node: int, job_name: str = "lab06",
                 port: int = 29500, hours: int = 1) -> str:
    """An sbatch script that runs `python -m target args...` on `nodes` x `gpus_per_node` GPUs: one
    torchrun agent per node (srun), the c10d rendezvous on the first node of the allocation."""
    command = shlex.join(["python", "-m", target, *map(str, args)])
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1            # one torchrun agent per node; it starts the ranks",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --time={hours:02d}:00:00",
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export " + " ".join(f"{k}={v}" for k, v in NVLS_OFF.items()),
        "# between nodes NCCL/RCCL use the network: name its interface if the default is wrong, e.g.",
        "# export NCCL_SOCKET_IFNAME=ib0   (RCCL reads the same NCCL_* variables)",
        f"srun torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} \\",
        f"  --rdzv-backend c10d --rdzv-endpoint \"$head:{port}\" --rdzv-id \"$SLURM_JOB_ID\" \\",
        f"  --max-restarts 0 -m {command[len('python -m '):]}",
    ]
    return "\n".join(lines) + "\n"
