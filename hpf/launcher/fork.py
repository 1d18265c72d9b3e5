"""`hpf.launch`: local ranks forked, each given torchrun's environment and a process group.

`launch(fn, world_size, *args)` forks `world_size` processes (fork, so functions defined in
a notebook or REPL `__main__` work without pickling), gives each the environment torchrun
would, initializes the default process group, runs `fn(rank, *args)` and returns the
results in rank order. The first failure anywhere ends every rank and is re-raised here
as `RankError` with the child's traceback, so a broken rank never leaves the others
hanging in a collective (hpf.launcher.results). Under torchrun it runs `fn` as torchrun's rank.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import schedule
from ..comm.world import COLLECTIVE_TIMEOUT_S
from ..errors import RankError, Terminated
from .group import init_distributed, is_launched, rank, serve_store, shutdown, world_size
from .results import collect, missing_ranks, pickled_error, stop

__all__ = ["launch"]


def _on_sigterm(signum, frame):
    raise Terminated()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_env() -> dict[str, str]:
    """Environment that binds the backends' sockets to the loopback interface: gloo (and nccl's
    bootstrap) otherwise listen on the address the hostname resolves to, which may be a LAN
    address, for a job that is local by construction."""
    names = [n for _, n in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    lo = next((n for n in ("lo", "lo0") if n in names), None) or next((n for n in names if n.startswith("lo")), None)
    if lo is None:
        raise RuntimeError(f"hpf.launch: no loopback network interface among {names}; the ranks' sockets must bind "
                           "to loopback (set GLOO_SOCKET_IFNAME through env= to choose an interface)")
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this child if the launching process dies (kernel restart)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _release_openmp_threads() -> None:
    """Linux: end GNU OpenMP's idle thread pool before forking (the next parallel op restarts it).

    A child forked after this process ran a multi-threaded torch op inherits libgomp's record
    of that pool but not its threads, and hangs in its first multi-threaded op (seen: a
    notebook that built a tensor, then ``launch(fn, 1)``). omp_pause_resource_all(hard)
    (OpenMP 5) is the runtime's own way to let the pool go."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:  # not Linux: LLVM's and Intel's runtimes restart their pools in a forked child
        return
    import ctypes

    for path in libs:
        try:
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        except OSError:  # unloadable by path (moved since): nothing to release through it
            continue
        if pause is not None:
            pause(2)  # omp_pause_hard


def _name_process(name: str) -> None:
    """What ps, top and /proc/<pid>/comm call this process (Linux; elsewhere nothing)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def _child(fn, rank_, world_size_, args, env, timeout, backend, conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (forked with launch's handler) a stop ends a rank at once
    schedule.LOG.__init__()  # a fresh rank: not the launching process's collectives, or the error it caught
    _die_with_parent()
    _name_process(f"hpf-rank{rank_}")
    os.environ.update(env)
    if env.get("HPF_STACKS_DIR"):  # a launch that times out asks for every thread's stack (``_stacks``)
        stacks = open(os.path.join(env["HPF_STACKS_DIR"], f"rank{rank_}"), "w")  # noqa: SIM115 -- lives with the rank
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world_size_))
    try:
        init_distributed(timeout=timeout, backend=backend)
        message = ("ok", fn(rank_, *args))
        shutdown()  # an unfinished async save or a peer stuck in a skipped collective is this rank's error
    except BaseException as e:  # noqa: BLE001 -- everything, incl. SystemExit, is reported to the parent
        message = ("error", traceback.format_exc(), time.monotonic(), missing_ranks(e), pickled_error(e))
    if message[0] == "ok":
        message += (time.monotonic(),)  # system-wide clock: the parent blames the earliest error
    # plain pickle: tensors travel by value (torch's ForkingPickler would send file
    # descriptors that the parent fetches from this process, which is about to exit)
    try:
        payload = pickle.dumps(message)
    except Exception:  # noqa: BLE001 -- e.g. a lambda in the result
        message = ("error", f"could not pickle the result of rank {rank_}:\n{traceback.format_exc()}",
                   time.monotonic())
        payload = pickle.dumps(message)
    conn.send_bytes(payload)
    conn.close()
    if message[0] == "error":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip teardown: peers may be blocked in a collective with us; the parent ends them


def _in_place(fn, world_size_: int, args: tuple, timeout: float, backend: str | None) -> list[Any]:
    """``launch`` under torchrun: this process is one of the ranks; the results of all come back."""
    started = int(os.environ["WORLD_SIZE"])
    if started != world_size_:
        raise RuntimeError(
            f"hpf.launch(fn, world_size={world_size_}) runs under torchrun, which started {started} rank(s): "
            f"hpf.launch does not start a second job, it runs fn as torchrun's ranks. Start torchrun with "
            f"{world_size_} ranks (torchrun --nproc-per-node {world_size_} ...), or run the script with plain "
            "python so that hpf.launch forks the ranks itself")
    init_distributed(timeout=timeout, backend=backend)
    result = fn(rank(), *args)
    results: list[Any] = [None] * world_size_
    dist.all_gather_object(results, result)
    shutdown()
    return results


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
           backend: str | None = None, master_port: int | None = None,
           env: dict[str, str] | None = None, collective_timeout: float = COLLECTIVE_TIMEOUT_S,
           elastic: bool = False, replacements: int = 0) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` forked local processes; return their results by rank.

    Each child gets torchrun's environment variables (plus `env`), a default process group
    (`init_distributed`) and `torch.set_num_threads(cores // world_size)`. Results travel back
    by pickle, tensors with their whole storage (return `.clone()`s of views). The first rank
    that raises or dies ends all others and raises `RankError` here; a hung rank is found by
    its peers (a collective that waits ``collective_timeout`` seconds raises). With an
    accelerator, the calling process must not have initialized it (as with any fork). The ranks
    meet through a file store in a private folder, so concurrent launches never race for a port
    (``master_port``: a TCP store, which listens on every interface; nothing hpf reads from it
    runs as code); their gloo (and nccl bootstrap) sockets bind to the loopback interface only.

    Under torchrun (its environment set) nothing is forked: this process runs ``fn(rank, *args)``
    as torchrun's rank, and every rank's results come back on each (``timeout`` does not apply).

    Args:
        fn, args: each child calls ``fn(rank, *args)``; its result must pickle.
        world_size: the number of ranks (processes) to fork.
        timeout: seconds until every rank is ended and ``RankError`` raised (default: no limit).
        backend: the process-group backend (default: nccl/hccl with an accelerator, else gloo).
        master_port: use a TCP store on this port instead of a file store.
        env: extra environment variables for the children.
        collective_timeout: seconds a collective may wait for its peers, capped at ``timeout``.
        elastic: a rank dying silently (SIGKILL) does not end the job: the others go on (``hpf.elastic``;
            its result is None), meeting through a TCP store this process hosts. An error still ends all.
        replacements: with ``elastic``, up to this many new ranks join (``hpf.elastic``) for lost ones.

    Raises:
        ValueError: ``world_size`` is not a positive int.
        RuntimeError: a process group exists already (outside torchrun); another ``world_size`` than torchrun's.
        RankError: a rank raised or died (its traceback is in the message), or the timeout passed.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if is_launched():  # torchrun started this process as one rank: be that rank, never fork a second job
        return _in_place(fn, world_size, args, min(collective_timeout, timeout or math.inf), backend)
    if dist.is_initialized():
        raise RuntimeError("launch: this process already has a process group; forked ranks would "
                           "inherit it. Call hpf.launch from a driver process without one.")
    if replacements and not elastic:
        raise ValueError(f"launch: replacements={replacements} needs elastic=True (a lost rank ends a plain job)")
    _release_openmp_threads()
    port = str(master_port or _free_port())
    workdir = tempfile.mkdtemp(prefix="hpf-launch-")  # (private: the file store, the ranks' stacks)
    store = _StoreHost() if elastic else None
    shared_env = {**({} if env and "GLOO_SOCKET_IFNAME" in env else _loopback_env()), **_meeting_env(workdir, master_port, timeout),
                  **(env or {}), **({"HPF_ELASTIC_STORE": f"127.0.0.1:{store.port}"} if store else {})}
    ranks = _Ranks(fn, world_size, args, shared_env, port, min(collective_timeout, timeout or math.inf), backend, replacements)
    try:
        with _sigterm_unwinds(), _heap_frozen(), (store or contextlib.nullcontext()):  # (the finally: the ranks stop, ...)
            for r in range(world_size):
                ranks.start(r)
            return collect(ranks.procs, ranks.conns, timeout, workdir, ranks.lost if elastic else None)
    finally:
        _clean_up(ranks.procs, ranks.conns, workdir)


class _StoreHost:
    """The TCP store of an elastic launch, hosted by a process of its own. Hosted by the launching
    process, its server thread would be copied into every rank forked later, maybe holding a lock
    mid-request, and a lock copied held stays held: a rank hung connecting to it (seen under load)."""

    def __init__(self):
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_host_store, args=(send, os.getpid()), name="hpf-store", daemon=True)
        self.proc.start()
        send.close()
        if not recv.poll(60):
            self.proc.kill()
            raise RuntimeError("hpf.launch: the elastic job's store did not start within 60 s")
        self.port = recv.recv()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.join()


def _host_store(send, parent: int) -> None:
    """The store host's life: serve until the launching process ends it, or is gone itself."""
    _name_process("hpf-store")
    serve_store("127.0.0.1", 0, send.send, until=lambda store: os.getppid() != parent)


class _Ranks:
    """The forked ranks of a launch: each a process and the pipe its result comes back by."""

    def __init__(self, fn, world_size: int, args: tuple, env: dict, port: str, timeout: float, backend, replacements: int):
        self.fn, self.world_size, self.args, self.env, self.port = fn, world_size, args, env, port
        self.timeout, self.backend, self.replacements = timeout, backend, replacements
        self.procs: list = []
        self.conns: list = []

    def start(self, r: int, joining: bool = False) -> None:
        ctx = mp.get_context("fork")
        child_env = {**_torchrun_env(r, self.world_size, self.port), **self.env, **({"HPF_ELASTIC_JOIN": "1"} if joining else {})}
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, name=f"hpf-rank{r}", args=(
            self.fn, r, self.world_size, self.args, child_env, self.timeout, self.backend, send))
        p.start()
        send.close()
        self.procs.append(p)
        self.conns.append(recv)

    def lost(self, r: int) -> None:
        """Elastic: rank ``r`` died; a replacement joins in its place while any are left."""
        if self.replacements > 0:
            self.replacements -= 1
            self.start(len(self.procs), joining=True)


@contextlib.contextmanager
def _heap_frozen():
    """The objects this process holds now stay out of the ranks' garbage collections (Python's
    advice for fork without exec, ``gc.freeze``): a rank's full collection, as ``step.close()``
    and ``shutdown`` run, then scans only what the rank made, not the caller's whole heap (0.6 s
    a collection forked from a pytest process that imported the test suite). The caller's
    objects are unfrozen again when the launch ends."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM (what schedulers send) raises inside this block, so cleanup runs; a handler the
    program set stays in charge."""
    ours = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if ours:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _clean_up(procs: list, conns: list, workdir: str) -> None:
    """Stop the ranks still running; remove their pipes, shared memory and rendezvous folder."""
    stop(procs)
    for c in conns:
        c.close()
    _remove_shm_leftovers([p.pid for p in procs if p.pid is not None])
    shutil.rmtree(workdir, ignore_errors=True)


def _meeting_env(workdir: str, master_port: int | None, timeout: float | None) -> dict[str, str]:
    """Where the ranks meet (a file store in the private ``workdir``: no port to race other
    launches for, unless ``master_port``) and leave their stacks on a timeout."""
    return {**({} if master_port else {"HPF_RENDEZVOUS_FILE": os.path.join(workdir, "store")}),
            **({} if timeout is None else {"HPF_STACKS_DIR": workdir})}


def _torchrun_env(rank: int, world_size: int, port: str) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of one local node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "ROLE_WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"hpf-{os.getpid()}-{port}"}


def _remove_shm_leftovers(pids: list[int]) -> None:
    """Unlink shared-memory segments a killed rank created but had not yet unlinked."""
    from hpf.comm.shm import remove_leftovers

    remove_leftovers(pids)


# `hpf.launch` is this module's `launch` function once hpf/__init__.py exports it; keep
# `hpf.launch.RankError`, `hpf.launch.init_distributed`, ... reachable through it too.
for _name in ("RankError", "init_distributed", "shutdown", "is_launched", "rank", "world_size"):
    setattr(launch, _name, globals()[_name])
del _name
