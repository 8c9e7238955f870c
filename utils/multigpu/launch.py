"""Lab 06's ranks: started by the course under `utils.base.processes.Owned`, NVLink multicast off, errors shown.

    run = launch.torchrun("utils.multigpu.collectives", ["--sizes", "1024"], nproc=2, timeout=120, name="collectives")
    run.result()          # what rank 0 wrote to run.out_dir/result.json

On one machine (`nnodes=1`, every run of the lab but one) `torchrun()` starts the ranks itself
(`run_ranks`): one process per rank, each in a process group the course owns, with the environment
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, ...) and a file store for the rendezvous, in a
private (0700) folder of the build directory, removed when the run ends. No rank listens on a network
address: torch's TCP store (which torchrun's c10d rendezvous and `init_method="env://"` use) listens on
every interface of the machine, whatever address it is given (`ss -ltn` shows `*:PORT`), where any other
machine of the network could reach it; the ranks' own connections (gloo, NCCL's bootstrap) use the
loopback interface.

For several "nodes" (`nnodes=2`: two agents on this machine, the course's demonstration of a cluster)
`torchrun()` runs torchrun once per node (`torchrun_agents`), with the c10d rendezvous on a free port of
127.0.0.1 and `--local-addr 127.0.0.1` (the ranks' MASTER_ADDR). Each agent is
`python -m utils.multigpu.netns torchrun`: torchrun itself, whose TCP stores (the rendezvous store, the store
the agent shares with its ranks) listen on a socket bound to 127.0.0.1, not on every interface as torch's own
would. The agents also run in a network namespace of their own whose only interface is its loopback
(`utils.multigpu.netns`); where the machine refuses one, the run prints a NOTE saying so and runs on the
machine's loopback interface: every agent and rank listens on and connects to 127.0.0.1 only.

Either way the processes end when the call returns, when it times out, or when the notebook's kernel
dies. A rank that raises ends the whole run (the others are stopped) and `RankFailed` shows that rank's
own traceback, read from the error file torchrun's `@record` wrote (TORCHELASTIC_ERROR_FILE), not the
launcher's. Every rank's environment turns NVLink multicast (NVLS) off.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from utils.base import processes
from utils.base.paths import LOOPBACK, build_dir, free_port, private_dir
from utils.multigpu.collectives import RENDEZVOUS_FILE_VAR
from utils.multigpu.netns import Namespace

# NVLink SHARP / multicast (NVLS): on NVSwitch systems, NCCL, PyTorch's symmetric memory and NVSHMEM can
# let the switch itself combine and replicate data. It reserves switch and driver resources shared by every
# GPU of the host; the course keeps it off in every process it starts.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOOPBACK_IFNAME = "lo"   # Linux's loopback interface: gloo binds its connections to it (GLOO_SOCKET_IFNAME)
LOOPBACK_TORCHRUN = ("utils.multigpu.netns", "torchrun")   # torchrun, its TCP stores listening on 127.0.0.1 only


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
                     module: bool = True, local_addr: str | None = None,
                     launcher: tuple[str, ...] = ("torch.distributed.run",)) -> list[str]:
    """The torchrun command line for one agent (one "node"): c10d rendezvous at `endpoint`, no restarts,
    every rank's output teed to `log_dir/<run>/attempt_0/<rank>/`. `local_addr`: this node's address (torchrun's
    `--local-addr`: where node 0's agent serves its ranks' store, their MASTER_ADDR); `launcher`: the module run
    and its arguments (LOOPBACK_TORCHRUN in the course's demonstration: torchrun, its stores on 127.0.0.1 only)."""
    cmd = [python or sys.executable, "-m", *launcher, "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", rdzv_id, "--max-restarts", "0", "--monitor-interval", "0.5"]
    if local_addr is not None:
        cmd += ["--local-addr", local_addr]
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
    command: list[list[str]]       # one command per rank (one machine) or per torchrun agent (several nodes)
    log: Path                      # every rank's output, each line prefixed [rankN]: (or the agents' output)
    log_dir: Path                  # the per-rank logs and error files (<log_dir>/attempt_0/<rank>/, as torchrun)
    out_dir: Path                  # where the ranks write their results (--out)
    port: int | None = None        # torchrun's c10d rendezvous port (several nodes); None on one machine
    store: Path | None = None      # the file store of a one-machine run, in a private folder removed at its end
    nodes: int = 1
    pgids: list[int] = field(default_factory=list)
    nonces: list[str] = field(default_factory=list)   # in every process's environment (utils.base.processes)
    seconds: float = 0.0
    returncodes: list[int | None] = field(default_factory=list)

    def result(self, name: str = "result.json") -> dict:
        return json.loads((self.out_dir / name).read_text())

    def gone(self) -> bool:
        """Whether every process of the run has ended (its process groups, and any process that carries
        its nonce), its rendezvous port is closed and its file store's folder removed."""
        return (not any(processes.group_alive(g) for g in self.pgids) and not processes_with_nonce(self.nonces)
                and (self.port is None or not port_listening(self.port))
                and (self.store is None or not self.store.parent.exists()))

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
        who = f"rank {e['local_rank']}" if run.nodes == 1 else f"node {e['node']}, local rank {e['local_rank']}"
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


def _stamp(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def torchrun(target: str, args=(), *, nproc: int, timeout: float, name: str, nnodes: int = 1,
             env: dict | None = None, python: str | None = None) -> Run:
    """Run `python -m target args... --out DIR` on `nnodes` x `nproc` ranks and wait for it.

    One machine (`nnodes=1`): the course starts the ranks itself, with a file-store rendezvous
    (`run_ranks`: no TCP listener). Several "nodes": real torchrun agents with the c10d rendezvous
    (`torchrun_agents`: their stores on 127.0.0.1, in a network namespace of their own where the machine allows
    one).
    Raises `RankFailed` (with the first failing rank's traceback) or `RankTimeout`; either way, and on
    success, no process of the run is left. The ranks' results are in `run.out_dir`."""
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"nnodes={nnodes} and nproc={nproc} must be at least 1")
    if nnodes == 1:
        return run_ranks(target, args, nproc=nproc, timeout=timeout, name=name, env=env, python=python)
    return torchrun_agents(target, args, nproc=nproc, nnodes=nnodes, timeout=timeout, name=name, env=env,
                           python=python)


def run_ranks(target: str, args=(), *, nproc: int, timeout: float, name: str, env: dict | None = None,
              python: str | None = None) -> Run:
    """`python -m target args... --out DIR` on `nproc` ranks of this machine, started by the course (no
    torchrun, no TCP store); waits for them. Raises as `torchrun()` does."""
    return start_ranks(target, args, nproc=nproc, name=name, env=env, python=python).wait(timeout)


def start_ranks(target: str, args=(), *, nproc: int, name: str, env: dict | None = None,
                python: str | None = None) -> "Ranks":
    """Start `nproc` ranks of `python -m target args... --out DIR` on this machine and return at once
    (`.wait(timeout)` waits for them and returns the `Run`; leaving a `with` block ends them).

    Each rank is a process of its own under `utils.base.processes.Owned`, with the environment torchrun
    would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, GROUP_WORLD_SIZE=1, the
    error file of `@record` at <log_dir>/attempt_0/<rank>/error.json) plus `rank_env()`'s, and the path
    of a file store in a private (0700) folder in RENDEZVOUS_FILE_VAR: `collectives.init` joins the group
    through it, so the rendezvous opens no socket at all."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    stamp = _stamp(name)
    root = build_root()
    out_dir, log_dir = root / "runs" / stamp, root / "logs" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    store = private_dir(private_dir(root / "rendezvous") / stamp) / "store"
    cmd = [python or sys.executable, "-m", target, *map(str, args), "--out", str(out_dir)]
    run = Run(name=name, command=[list(cmd) for _ in range(nproc)], log=root / "logs" / f"{stamp}.log",
              log_dir=log_dir, out_dir=out_dir, store=store)
    base = rank_env(env)
    for inherited in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        base.pop(inherited, None)        # nothing here may fall back to a TCP store
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")     # as torchrun does: the ranks share the machine's cores
    owned = []
    for rank in range(nproc):
        rank_dir = log_dir / "attempt_0" / str(rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        rank_environment = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                                ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                                TORCHELASTIC_ERROR_FILE=str(rank_dir / "error.json"))
        rank_environment[RENDEZVOUS_FILE_VAR] = str(store)
        owned.append(processes.Owned(cmd, log_path=rank_dir / "output.log", env=rank_environment,
                                     label=f"rank {rank} of {name}", stop_timeout=10))
    return Ranks(run, owned).start()


def _how_it_ended(code: int | None) -> str:
    """An exit code in words (the guard exits with 128 + N when its command was killed by signal N)."""
    if code is not None and code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name}, Signal {code - 128})"
        except ValueError:
            pass
    return f"exit code {code}"


class Ranks:
    """The ranks of one run on this machine, started by `start_ranks`. `wait(timeout)` returns the `Run`
    once every rank has ended with 0, or ends them all and raises `RankFailed` / `RankTimeout`."""

    def __init__(self, run: Run, owned: list[processes.Owned]):
        self.run, self.owned = run, owned
        self._offsets, self._partial = [0] * len(owned), [b""] * len(owned)
        self._started = time.monotonic()
        self._stopped = False

    def start(self) -> "Ranks":
        self.run.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.run.log, "w") as log:
            log.write(f"[launch]: {len(self.owned)} rank(s) of the run '{self.run.name}' on this machine, "
                      f"rendezvous through the file store {self.run.store}\n")
        self._started = time.monotonic()
        try:
            for rank in self.owned:
                rank.start()
                self.run.pgids.append(rank.pgid)
                self.run.nonces.append(rank.nonce)
        except BaseException:
            self.stop()
            raise
        return self

    def _note(self, line: str) -> None:
        with open(self.run.log, "a") as log:
            log.write(f"[launch]: {line}\n")

    def _merge(self, final: bool = False) -> None:
        """Append what each rank wrote since the last call to the run's log, each line prefixed [rankN]:
        once (torch.distributed already prefixes the lines of a rank's traceback so)."""
        out = []
        for i, rank in enumerate(self.owned):
            try:
                with open(rank.log_path, "rb") as f:
                    f.seek(self._offsets[i])
                    data = f.read()
            except OSError:
                continue
            self._offsets[i] += len(data)
            lines = (self._partial[i] + data).split(b"\n")
            self._partial[i] = lines.pop()
            if final and self._partial[i]:
                lines.append(self._partial[i])
                self._partial[i] = b""
            prefix = f"[rank{i}]:"
            out += [(text if text.startswith(prefix) else f"{prefix} {text}") + "\n"
                    for text in (line.decode(errors="replace") for line in lines)]
        if out:
            with open(self.run.log, "a") as log:
                log.writelines(out)

    def poll(self) -> list[int | None]:
        """Each rank's exit code, None while it runs."""
        return [rank.poll() for rank in self.owned]

    def stop(self) -> None:
        """End every rank (SIGTERM to all their groups at once, then each in turn), merge their output
        into the run's log and remove the file store's folder; safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        for rank in self.owned:
            if rank.pgid is not None and rank.poll() is None:
                try:
                    os.killpg(rank.pgid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for rank in self.owned:
            rank.stop()
        self.run.returncodes = [rank.returncode for rank in self.owned]
        self.run.seconds = time.monotonic() - self._started
        self._merge(final=True)
        if self.run.store is not None:
            shutil.rmtree(self.run.store.parent, ignore_errors=True)

    def wait(self, timeout: float) -> Run:
        """Wait until every rank has ended (at most `timeout` s from the start); see the class."""
        first = None                        # (rank, exit code) of the first rank that failed
        try:
            while True:
                self._merge()
                codes = self.poll()
                first = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
                if first is not None:
                    self._note(f"rank {first[0]} ended with {_how_it_ended(first[1])}; ending the other ranks")
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() - self._started > timeout:
                    self._note(f"not finished in {timeout:.0f} s; ending every rank")
                    self.stop()
                    timed_out = RankTimeout(f"the run '{self.run.name}' did not finish in {timeout:.0f} s; every "
                                            f"rank was ended. The end of its log:\n{processes_log_tail(self.run.log)}",
                                            log=self.run.log)
                    timed_out.run = self.run
                    raise timed_out
                time.sleep(0.1)
        finally:
            self.stop()
        if first is not None:
            failed = failure(self.run, first[1])
            failed.run = self.run
            raise failed
        return self.run

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def torchrun_agents(target: str, args=(), *, nproc: int, timeout: float, name: str, nnodes: int,
                    env: dict | None = None, python: str | None = None) -> Run:
    """`python -m target args... --out DIR` on `nnodes` x `nproc` ranks under real torchrun agents (one per
    "node", all on this machine, the first hosting the rendezvous) with the c10d rendezvous on 127.0.0.1.

    Only for the demonstration of several nodes. torch's TCP store, which the c10d rendezvous runs in the first
    agent (and node 0's agent for its ranks, MASTER_ADDR:MASTER_PORT), listens on every interface whatever address
    it is given (`ss -ltn` shows `*:PORT`); the agents are `python -m utils.multigpu.netns torchrun` (torchrun,
    its stores listening on 127.0.0.1 only), with `--local-addr 127.0.0.1`, and the ranks' gloo/NCCL sockets are on
    the loopback interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: lo, whatever the caller's environment says). The agents also run in a network namespace of their own
    (`utils.multigpu.netns`: only its loopback); where the machine refuses one, the NOTE printed says why, and the
    run is on this machine's loopback interface: no listener on another address (other users of this machine can
    reach 127.0.0.1, the network cannot). One machine's runs go through `run_ranks` (a file store, no listener).
    Raises as `torchrun()` does."""
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"nnodes={nnodes} and nproc={nproc} must be at least 1")
    stamp = _stamp(name)
    root = build_root()
    out_dir, log_dir = root / "runs" / stamp, root / "logs" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"{LOOPBACK}:{port}"
    rank_environment = rank_env(env)
    for listener in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",   # "1": rank 0 would serve its own store, on every
                     "TORCHELASTIC_HEALTH_CHECK_PORT"):      # interface; a port: the agent's health-check server
        rank_environment.pop(listener, None)
    rank_environment.update(GLOO_SOCKET_IFNAME=LOOPBACK_IFNAME, NCCL_SOCKET_IFNAME=LOOPBACK_IFNAME)   # one machine
    # the agents in a network namespace of their own, which has only its own loopback (utils/multigpu/netns.py);
    # where the machine refuses one, on this machine's loopback: either way their stores listen on 127.0.0.1 only
    # (netns.loopback_store_class) and the ranks' sockets are on the loopback interface (rank_env)
    network = Namespace(log_dir, label=f"torchrun {name} network")
    log_dir.mkdir(parents=True, exist_ok=True)
    refused = network.start()
    if refused:
        print(f"NOTE: {name}: no network namespace for the agents ({refused}), so they run on this machine's "
              f"loopback interface: the rendezvous store, the agents and the ranks listen on and connect to "
              f"{LOOPBACK} only (unreachable from the network; other users of this machine can reach {LOOPBACK})")
    inside = [] if refused else network.prefix()
    cmds = [inside + torchrun_command(target, [*args, "--out", out_dir], nproc=nproc, nnodes=nnodes, endpoint=endpoint,
                                      rdzv_id=stamp, log_dir=log_dir / f"node{i}",
                                      is_host=(i == 0) if nnodes > 1 else None, python=python,
                                      local_addr=LOOPBACK, launcher=LOOPBACK_TORCHRUN)
            for i in range(nnodes)]
    run = Run(name=name, command=cmds, log=root / "logs" / f"{stamp}.log", log_dir=log_dir, out_dir=out_dir,
              port=port, nodes=nnodes)
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
        network.stop()
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
