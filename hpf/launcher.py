"""Local multi-process launch, and process-group setup that also works under torchrun.

`launch(fn, world_size, *args)` forks `world_size` processes (fork, so functions defined in
a notebook or REPL `__main__` work without pickling), gives each the environment torchrun
would, initializes the default process group, runs `fn(rank, *args)` and returns the
results in rank order. The first failure anywhere ends every rank and is re-raised here
as `RankError` with the child's traceback, so a broken rank never leaves the others
hanging in a collective.

Code written for `launch` runs unchanged under torchrun: call `init_distributed()`
(a no-op when the group already exists) at the top of the script, and `shutdown()` at its
end (`launch` calls it when `fn` returns).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import math
import multiprocessing as mp
import multiprocessing.connection
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

from .comm import schedule
from .comm.world import COLLECTIVE_TIMEOUT_S
from .errors import RankError, Terminated

__all__ = ["RankError", "Terminated", "launch", "init_distributed", "shutdown", "at_shutdown", "is_launched", "rank", "world_size",
           "COLLECTIVE_TIMEOUT_S", "reform", "at_reform", "base_store", "generation_prefix", "elastic_member",
           "serve_store"]

_TERMINATE_GRACE_S = 2.0  # SIGTERM first, SIGKILL after this
_DEATH_ECHO_S = 1.0  # after a rank's error, how long to watch for a peer's death that caused it


def _on_sigterm(signum, frame):
    raise Terminated()


_TYPED: dict[type, type] = {}  # the rank's exception class -> RankError and it, made once


def _rank_error(message: str, rank_: int, tb: str, cause: BaseException | None) -> RankError:
    """The RankError of a rank that raised ``cause``: of its class too, where one can be made
    (not for a class whose instances are laid out otherwise, e.g. OSError, or whose __init__
    takes other arguments). Its text is the message with the rank's traceback, whatever the class's
    own ``__str__`` does (KeyError's would show it as one escaped line)."""
    if isinstance(cause, Exception) and not isinstance(cause, RankError):
        try:
            cls = _TYPED.get(type(cause)) or _TYPED.setdefault(
                type(cause), type(type(cause).__name__, (RankError, type(cause)), {"__module__": type(cause).__module__,
                                                                                   "__qualname__": f"RankError[{type(cause).__qualname__}]",
                                                                                   "__str__": BaseException.__str__}))
            return cls(message, rank_, tb, cause)
        except TypeError:
            pass
    return RankError(message, rank_, tb, cause)


def is_launched() -> bool:
    """True inside `launch` or torchrun (the rendezvous environment is set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rank() -> int:
    """This process's global rank (0 outside any launch)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks (1 outside any launch)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)


def init_distributed(timeout: float | datetime.timedelta = COLLECTIVE_TIMEOUT_S, backend: str | None = None) -> None:
    """Initialize the default process group from torchrun-style env vars; no-op if it exists.

    backend=None picks by device: gloo on CPU; with an accelerator, gloo for CPU tensors plus
    the device's own backend (nccl, hccl, ...) for device tensors, and the device is set
    from LOCAL_RANK. ``timeout`` bounds each collective's wait for its peers, so a lost peer
    raises instead of hanging forever.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the script "
            "with torchrun, or run the function through hpf.launch(fn, world_size)")
    backend = backend or _device_backend()
    _ELASTIC["backend"] = backend
    if os.environ.get("HPF_ELASTIC_STORE"):  # an elastic job: generation 0 under the job's store
        me, size, joining = elastic_member()
        if not joining:  # (a replacement's group starts when the job admits it)
            dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), rank=me, world_size=size,
                                    store=dist.PrefixStore(generation_prefix(0), base_store()))
        return
    rendezvous = os.environ.get("HPF_RENDEZVOUS_FILE")  # set by launch: no port to race for
    init = {"init_method": f"file://{rendezvous}", "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])} if rendezvous else {}
    dist.init_process_group(backend=backend, timeout=_as_timedelta(timeout), **init)


# -- elastic jobs: generations of the process group over one base store (hpf.elastic) ------------------------
_ELASTIC: dict[str, Any] = {"base": None, "retired": [], "backend": None, "timeout": None}
_AT_REFORM: list[Callable[[], None]] = []


def generation_prefix(generation: int) -> str:
    """Where generation ``generation`` of an elastic job's process group keeps its keys in the base store."""
    return f"hpf/elastic/gen{generation}"


def base_store() -> dist.Store:
    """The store that outlives every generation of an elastic job's process group, at
    ``HPF_ELASTIC_STORE`` (host:port): an elastic ``hpf.launch``'s, or ``hpf store``'s under torchrun."""
    if _ELASTIC["base"] is None:
        address = os.environ.get("HPF_ELASTIC_STORE")
        if not address:
            raise RuntimeError("hpf.elastic: no elastic job's store; start the job with hpf.launch(fn, n, elastic=True), "
                               "or under torchrun with HPF_ELASTIC_STORE=host:port of `hpf store` (docs/elastic.md)")
        host, _, port = address.rpartition(":")
        _ELASTIC["base"] = dist.TCPStore(host or "127.0.0.1", int(port), is_master=False,
                                         timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return _ELASTIC["base"]


def elastic_member() -> tuple[int, int, bool]:
    """This process's place in an elastic job: (its rank id, the job's first world size, whether it
    joins a running job). Under hpf.launch: RANK and WORLD_SIZE, and HPF_ELASTIC_JOIN on a replacement.
    Under torchrun, which runs one member each (docs/elastic.md): HPF_ELASTIC_MEMBER ``r`` of
    HPF_ELASTIC_WORLD_SIZE ``n``; a worker torchrun restarted (TORCHELASTIC_RESTART_COUNT ``c`` > 0)
    joins as id ``r + n * c``, which no earlier worker had."""
    member = os.environ.get("HPF_ELASTIC_MEMBER")
    if member is None:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                bool(os.environ.get("HPF_ELASTIC_JOIN")))
    size = os.environ.get("HPF_ELASTIC_WORLD_SIZE", "")
    if not (member.isdigit() and size.isdigit() and int(member) < int(size)):
        raise ValueError(f"hpf.elastic: HPF_ELASTIC_MEMBER={member!r} of HPF_ELASTIC_WORLD_SIZE={size!r}; set them to "
                         "the member's number 0..n-1 and the job's first world size n")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return int(member) + int(size) * restart, int(size), restart > 0


def serve_store(host: str, port: int, on_ready: Callable[[int], None], until: Callable[[dist.Store], bool]) -> None:
    """Host an elastic job's store (a TCP store server) until ``until(store)``; ``on_ready(port)`` once it listens."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    on_ready(store.port)
    while not until(store):
        time.sleep(0.2)


JOB_DONE_KEY = "hpf/elastic/done"  # set once the last generation has finished


def at_reform(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`reform` call ``fn()`` once the new group runs (a module forgets the groups it made)."""
    if fn not in _AT_REFORM:
        _AT_REFORM.append(fn)
    return fn


def reform(generation: int, rank_: int, world_size_: int, backend: str | None = None) -> None:
    """Replace the default process group by generation ``generation``: ``world_size_`` ranks, this one
    ``rank_``, meeting under the generation's prefix of the base store. The groups of the generation
    before are kept, never destroyed: one of their gloo threads may still wait on a lost peer, and a
    destructor would join it; they end at their timeout, and their keys never meet the new ones."""
    base = base_store()
    if dist.is_initialized():
        _ELASTIC["retired"] += list(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()
    dist.init_process_group(backend=backend or _ELASTIC["backend"] or _device_backend(), store=dist.PrefixStore(generation_prefix(generation), base),
                            rank=rank_, world_size=world_size_, timeout=_as_timedelta(COLLECTIVE_TIMEOUT_S))
    schedule.LOG.__init__()  # a new world: a fresh log (the broken one was the lost generation's)
    for fn in _AT_REFORM:
        fn()


def _device_backend() -> str:
    """gloo on CPU; with an accelerator, gloo for CPU tensors plus the device's own backend (the
    device set from LOCAL_RANK)."""
    if not torch.accelerator.is_available():
        return "gloo"
    device = torch.accelerator.current_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"init_distributed: LOCAL_RANK={local_rank} but only {count} {device.type} "
            "device(s); start at most one rank per device, or pass backend='gloo'")
    torch.accelerator.set_device_index(local_rank)
    return f"cpu:gloo,{device.type}:{dist.get_default_backend_for_device(device)}"


_AT_SHUTDOWN: list[Callable[[], None]] = []


def at_shutdown(fn: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`shutdown` call ``fn()`` while the process group still runs (hpf.checkpoint
    registers finishing its async saves); returns ``fn``."""
    if fn not in _AT_SHUTDOWN:
        _AT_SHUTDOWN.append(fn)
    return fn


def shutdown() -> None:
    """End this rank's part of the job: finish what needs the process group (async checkpoint
    saves), meet the other ranks, then destroy the group. A no-op without one.

    ``launch`` calls it when ``fn`` returns. Under torchrun, end the script with it instead of
    ``torch.distributed.destroy_process_group()``, which cuts an async save short. The meeting
    is a recorded rendezvous, so a peer still inside a collective call this rank skipped (rank
    0 alone in ``step.save``) ends in ScheduleMismatchError on both, within seconds. After
    such an error it does nothing: collectives no longer pair up, and the exit frees all."""
    if not dist.is_initialized():
        return
    if schedule.LOG.broken is not None:  # collectives no longer pair up: only let the peers read the report
        schedule.linger()
        return
    for fn in _AT_SHUTDOWN:
        fn()
    schedule.rendezvous("hpf.launch.shutdown", "at the end of the program")
    # Free garbage cycles that hold collectives' objects now: freed at interpreter exit instead,
    # a gloo thread may need the GIL then and abort the process (seen: 1 torchrun exit in 8).
    gc.collect()
    dist.destroy_process_group()


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
        message = ("error", traceback.format_exc(), time.monotonic(), _missing_ranks(e), _pickled(e))
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


def _missing_ranks(error: BaseException) -> tuple[int, ...]:
    """The ranks a timed-out wait found absent (hpf.comm.schedule.PeerTimeoutError, maybe as the
    cause of another error): the parent blames them, not the rank that waited."""
    return next((tuple(e.missing) for e in schedule.causes(error) if hasattr(e, "missing")), ())


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: list) -> None:
    """End every child still running (SIGTERM, then SIGKILL) and reap all of them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


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
            return _collect(ranks.procs, ranks.conns, timeout, workdir, ranks.lost if elastic else None)
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
    _stop(procs)
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


def _collect(procs: list, conns: list, timeout: float | None, workdir: str, lost: Callable[[int], None] | None = None) -> list[Any]:
    """Every rank's result, in rank order. ``lost`` (an elastic launch): a rank that dies silently is
    told to it, and its result is None; ``procs`` and ``conns`` may grow by the replacements it starts."""
    missing = object()
    results = [missing] * len(procs)
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    while any(v is missing for v in results):
        pending = [r for r, v in enumerate(results) if v is missing]
        remaining = None if timeout is None else max(0.0, deadline - time.monotonic())
        ready = set(mp.connection.wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending],
                                       timeout=remaining))
        if not ready:
            raise RankError(f"hpf.launch: timed out after {timeout:g} s; ranks {pending} had not "
                            f"finished and were ended. Where they were:\n{_stacks(procs, pending, workdir)}")
        errors, deaths = [], []
        for r in pending:
            if conns[r] not in ready and procs[r].sentinel not in ready:
                continue
            message = _message(conns[r], r)
            if message is None:
                procs[r].join(_TERMINATE_GRACE_S)  # pipe closed: the process is exiting
                deaths.append(r)
            elif message[0] == "error":
                errors.append(_error_of(message, r))
            else:
                results[r] = message[1]
        if errors and not deaths:  # a peer's error may be the echo of a death not yet seen: look once more
            others = [r for r in pending if results[r] is missing and r not in {e[1] for e in errors}]
            for sentinel in mp.connection.wait([procs[r].sentinel for r in others], timeout=_DEATH_ECHO_S):
                r = next(r for r in others if procs[r].sentinel == sentinel)
                message = _message(conns[r], r)
                if message is None:  # gone without a word: the root cause
                    procs[r].join(_TERMINATE_GRACE_S)
                    deaths.append(r)
                elif message[0] == "error":
                    errors.append(_error_of(message, r))
                else:
                    results[r] = message[1]
        if deaths and lost is not None and not errors:  # elastic: the others go on without it
            for r in deaths:
                results[r] = None
                lost(r)
            results += [missing] * (len(procs) - len(results))
            continue
        if deaths:  # a silent death is a root cause; peers' errors are its consequences
            r = deaths[0]
            raise RankError(f"hpf.launch: rank {r} {_exit_description(procs[r].exitcode)} without "
                            "reporting a result or an exception; the other ranks were ended", rank=r)
        if errors:
            _, r, tb, _, pickled = min(errors, key=lambda e: e[:2])
            hung = sorted(set.intersection(*(set(e[3]) for e in errors)) - {e[1] for e in errors})
            if hung:  # every error is a wait that timed out for these ranks, alive and silent
                raise RankError(f"hpf.launch: rank {hung[0]} hung (it neither finished nor raised); rank {r} timed out "
                                f"waiting for it (the other ranks were ended):\n{tb}", rank=hung[0], child_traceback=tb)
            raise _rank_error(f"hpf.launch: rank {r} raised (the other ranks were ended):\n{tb}", r, tb,
                              _unpickled(pickled))
    for p in procs:  # ranks are past fn; give them a moment to tear the process group down
        p.join(min(10.0, max(0.0, deadline - time.monotonic())))
    return results


def _message(conn, r: int):
    """Rank ``r``'s message, or None when its pipe closed without one (it died). A closed pipe
    also polls as readable, so only a read tells the two apart."""
    try:
        return pickle.loads(conn.recv_bytes()) if conn.poll() else None
    except EOFError:
        return None
    except Exception as e:  # noqa: BLE001 -- e.g. a class the parent cannot import
        raise RankError(f"hpf.launch: could not unpickle the result of rank {r}: {e!r}", rank=r) from e


def _error_of(message: tuple, r: int) -> tuple:
    """(time, rank, traceback, ranks it waited for, the pickled exception) of an error message."""
    return message[2], r, message[1], message[3] if len(message) > 3 else (), message[4] if len(message) > 4 else None


def _stacks(procs: list, ranks: list[int], workdir: str, lines: int = 80) -> str:
    """Each rank's threads' stacks (at most ``lines``), asked for by SIGUSR1: a hang names itself."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (OSError, TypeError):
            pass
    time.sleep(_TERMINATE_GRACE_S / 4)
    said = []
    for r in ranks:
        try:
            with open(os.path.join(workdir, f"rank{r}")) as f:
                text = f.read().strip().splitlines()
        except OSError:
            text = []
        said.append(f"rank {r}:\n" + "\n".join(text[:lines] or ["(no stacks: the rank did not answer)"]))
    return "\n".join(said)


def _pickled(error: BaseException) -> bytes | None:
    """A rank's exception for the parent, where it pickles (the parent raises its type)."""
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 -- e.g. an attribute that does not pickle
        return None


def _unpickled(payload: bytes | None) -> BaseException | None:
    """A rank's exception, if it travelled and its class imports here."""
    try:
        return None if payload is None else pickle.loads(payload)
    except Exception:  # noqa: BLE001 -- e.g. a class defined in the rank only
        return None


def _remove_shm_leftovers(pids: list[int]) -> None:
    """Unlink shared-memory segments a killed rank created but had not yet unlinked."""
    from hpf.comm.shm import remove_leftovers

    remove_leftovers(pids)


# `hpf.launch` is this module's `launch` function once hpf/__init__.py exports it; keep
# `hpf.launch.RankError`, `hpf.launch.init_distributed`, ... reachable through it too.
for _name in ("RankError", "init_distributed", "shutdown", "is_launched", "rank", "world_size"):
    setattr(launch, _name, globals()[_name])
del _name
