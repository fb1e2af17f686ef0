"""Where a host's CPU time goes during a benchmark run: every thread's CPU time from /proc,
read before and after, grouped by process role (the HTTP proxy, the ingress, the
model-server replicas, Ray's own processes, the client, the PEFT server, the kernel's
threads) and by thread (the
engine loop, XLA's compute threads, a process's main thread...). Linux only.

On a host without an accelerator every one of these shares the cores that compute the
model's steps; the table says how much of the machine each took. The kernel counts a
thread's time in ticks (10 ms): over a window of a second or two, the threads' shares can
add up to a few percent more than the whole machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# (pattern on the process's command line, role), first match wins. Ray names a worker
# process after the actor it runs: `ray::ServeReplica:<app>:<deployment>`, `ray::ProxyActor`.
ROLES = (
    (re.compile(r"ray::ServeReplica:[^:\s]*:LoRAModelServer"), "model server"),
    (re.compile(r"ray::ServeReplica:[^:\s]*:OpenAIIngress"), "ingress"),
    (re.compile(r"ray::ProxyActor"), "HTTP proxy"),
    (re.compile(r"ray::ServeController"), "Serve controller"),
    (re.compile(r"ray::|raylet|gcs_server|ray/dashboard|log_monitor|monitor\.py|runtime_env"), "Ray (other)"),
    (re.compile(r"benchmarks\.peft_server"), "PEFT server"),
)


@dataclasses.dataclass(frozen=True)
class ThreadKey:
    pid: int
    tid: int
    role: str
    thread: str  # the thread's name, numbered suffixes dropped (a pool's threads count as one)


def thread_kind(name: str) -> str:
    """A thread name without the numbers that tell a pool's threads apart."""
    kind = re.sub(r"[\s_\-:.#/]*\d+$", "", name.strip())
    return kind or name.strip() or "?"


def role_of(cmdline: str, pid: int, client_pid: int) -> str:
    if pid == client_pid:
        return "client"
    if not cmdline.strip():
        return "kernel"  # kernel threads have no command line
    for pattern, role in ROLES:
        if pattern.search(cmdline):
            return role
    return "other"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process or thread ended between listing and reading
        return None


def _cpu_seconds(stat: str) -> float:
    # Fields after the command name (which may hold spaces and parentheses): utime and
    # stime are the 14th and 15th fields of the line, the 12th and 13th after ") ".
    rest = stat[stat.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / _TICKS


def command_line(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" once it has ended)."""
    return (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()


def pids_of_role(role: str, client_pid: int | None = None) -> list[int]:
    """The host's processes of `role` (ROLES), by their command lines."""
    client_pid = os.getpid() if client_pid is None else client_pid
    out = []
    for entry in os.listdir("/proc"):
        cmdline = _read(f"/proc/{entry}/cmdline") if entry.isdigit() else None
        if cmdline is not None and role_of(cmdline.replace("\0", " "), int(entry), client_pid) == role:
            out.append(int(entry))
    return sorted(out)


def pin(pid: int, cpus: set[int], threads: str | None = None) -> int:
    """Runs the threads of process `pid` on `cpus` only: every thread, or those whose kind
    (thread_kind of the name) is `threads`. A thread started later inherits its starter's
    cores. Returns how many threads were pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if threads is not None:
            comm = _read(f"/proc/{pid}/task/{tid}/comm")
            if comm is None or thread_kind(comm) != threads:
                continue
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:  # the thread ended between listing and pinning
            continue
    return pinned


# XLA's CPU compute pool: the threads that run a step's program on a host without an accelerator.
XLA_COMPUTE_THREADS = "tf_XLAEigen"


def split_process(pid: int, compute: set[int], host: set[int]) -> int:
    """Splits process `pid` as an accelerator host splits an engine's work: XLA's compute
    threads on `compute` (standing for the device), every other thread on `host`. Returns how
    many compute threads there were."""
    pin(pid, host)
    return pin(pid, compute, XLA_COMPUTE_THREADS)


def split_cores() -> tuple[set[int], set[int]]:
    """This process's cores in two halves: (compute, host). The first half stands for an
    accelerator (XLA's compute threads), the second for the host's cores (everything else)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"splitting the cores needs at least 2, this process may use {cores}")
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def snapshot(client_pid: int | None = None) -> dict[ThreadKey, float]:
    """CPU seconds (user + system) of every thread on the host, by thread."""
    client_pid = os.getpid() if client_pid is None else client_pid
    out: dict[ThreadKey, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        cmdline = _read(f"/proc/{pid}/cmdline")
        if cmdline is None:
            continue
        role = role_of(cmdline.replace("\0", " "), pid, client_pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat, comm = _read(f"/proc/{pid}/task/{tid}/stat"), _read(f"/proc/{pid}/task/{tid}/comm")
            if stat is None or comm is None:
                continue
            out[ThreadKey(pid, int(tid), role, thread_kind(comm))] = _cpu_seconds(stat)
    return out


@dataclasses.dataclass(frozen=True)
class CpuShares:
    """CPU seconds spent between two snapshots, by (role, thread), over `wall_s` seconds on
    `cores` cores."""

    seconds: dict[tuple[str, str], float]
    wall_s: float
    cores: int

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def by_role(self) -> dict[str, float]:
        out: Counter = Counter()
        for (role, _), s in self.seconds.items():
            out[role] += s
        return dict(out)

    def share(self, seconds: float) -> float:
        """`seconds` as a fraction of the machine's CPU time in the window."""
        return seconds / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0

    def rows(self, top: int = 12) -> list[tuple[str, str, float, str]]:
        """(role, thread, CPU seconds, share of the machine) for each role's total and its
        busiest threads, busiest first; threads under 1 % of the machine are left out."""
        rows = []
        roles = sorted(self.by_role().items(), key=lambda kv: -kv[1])
        for role, total in roles:
            rows.append((role, "(all)", total, f"{100 * self.share(total):.1f}%"))
            threads = sorted(((t, s) for (r, t), s in self.seconds.items() if r == role), key=lambda kv: -kv[1])
            for thread, s in threads[:top]:
                if self.share(s) >= 0.01:
                    rows.append(("", thread, s, f"{100 * self.share(s):.1f}%"))
        idle = self.wall_s * self.cores - self.total_s
        rows.append(("idle", "", max(0.0, idle), f"{100 * max(0.0, self.share(idle)):.1f}%"))
        return rows


def delta(before: dict[ThreadKey, float], after: dict[ThreadKey, float], wall_s: float,
          cores: int | None = None) -> CpuShares:
    """What each (role, thread) spent from `before` to `after` (threads started in between
    count from zero; threads that ended in between are lost)."""
    out: Counter = Counter()
    for key, s in after.items():
        spent = s - before.get(key, 0.0)
        if spent > 0:
            out[(key.role, key.thread)] += spent
    return CpuShares(dict(out), wall_s, cores or os.cpu_count() or 1)
