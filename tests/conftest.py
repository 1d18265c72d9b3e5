"""Test-wide settings: one compute thread, no hpf thread left behind, and the fast tier
(``pytest -m "not slow"``) starts no process."""
import contextlib
import gc
import multiprocessing.process
import subprocess
import threading

import pytest
import torch
from cli_helpers import Zygote

from hpf_kernels.backends import native

native._load()  # the C draws are built (or found cached) here, once: building starts the compiler, which no fast test may


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on 2 shared cores run far faster single-threaded (oversubscription made some
    steps ~60x slower when another process held a core); launched ranks set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hpf_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("hpf-")}


@pytest.fixture(autouse=True)
def no_threads_left_behind():
    """A test must close what it opens: hpf threads left running in the test process outlive it,
    and every later ``launch`` forks a process that holds them (a two-tier step's workers once
    stayed for the rest of the suite)."""
    before = _hpf_threads()
    yield
    left = _hpf_threads() - before
    for t in left:
        t.join(timeout=2.0)  # (a closed comm's workers finish their last job and return)
    left = sorted(t.name for t in left if t.is_alive())
    assert not left, f"the test left hpf threads running: {left}; close the step (step.close(), or `with hpf.shard_step(...) as step:`)"


def pytest_sessionstart(session):
    """matplotlib builds its font cache on first use, running ``fc-list``: build it here, before
    the fast tier's guard below forbids processes, so a machine where nothing was cached passes
    (matplotlib is a test extra; its cache is its own, nothing hpf starts)."""
    try:
        import matplotlib.font_manager  # noqa: F401  (the import builds the cache when missing)
    except ImportError:
        pass


def pytest_collection_finish(session):
    """Freeze what collection made (every test module, torch, hpf): a full garbage collection, as
    each ``step.close()`` runs, then scans only what the tests made since (0.6 s a collection
    with the whole suite imported, about 0.001 s frozen). Frozen objects stay alive only if
    they would have been garbage cycles made at import; nothing a test creates is frozen."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _heap_frozen_per_file():
    """Freeze, before each test file, what the files before it left alive, for the same reason: a
    file late in a worker (the optimizer fuzzer's 80 steps, each closed) paid 1 s a collection
    for the heap the earlier files had grown, 450 s instead of 2 s."""
    gc.collect()
    gc.freeze()
    yield


# The files that take longest under two workers, longest first (--durations summed per file, one
# run on this 2-core machine): they start first, so no long file is left running alone at the end.
LONGEST = ("test_docs.py", "test_cli_train.py", "test_tensor_parallel.py", "test_cli.py", "test_tolerance.py", "test_checkpoint.py",
           "test_init_fuzz.py", "test_cli_plan_and_simulate.py", "test_schedule_replay.py", "test_topology.py", "test_sharded_init.py",
           "test_compile.py", "test_moe.py", "test_spmd.py")


def pytest_collection_modifyitems(items):
    """The longest files first, longest first, then the other files with slow tests, then the fast
    ones, each file's tests kept together: the two workers (pyproject's ``-n 2 --dist loadfile
    --no-loadscope-reorder``) take files in this order, so the fast files fill the end instead of
    one long file running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(LONGEST)), item.path not in slow_files))  # stable


# -- the fast tier starts no process -------------------------------------------------------------------
_STARTS = [(multiprocessing.process.BaseProcess, "start"), (subprocess.Popen, "__init__"), (Zygote, "command")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _refused_unless_slow(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _refused_unless_slow(item):
        yield


@contextlib.contextmanager
def _refused_unless_slow(item):
    """A test that starts a process (``hpf.launch``'s ranks, ``hpf`` as a command) must be marked
    ``slow``: ``pytest -m "not slow"`` is the newcomer's minutes-long run, and this keeps the
    marks true. The same test fails here, before it starts anything, when its mark is missing."""
    if item.get_closest_marker("slow"):
        yield
        return
    saved = [getattr(owner, name) for owner, name in _STARTS]

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} starts a process, so it must be marked @pytest.mark.slow "
                             "(the fast tier, pytest -m 'not slow', starts none)")
    for owner, name in _STARTS:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for (owner, name), original in zip(_STARTS, saved):
            setattr(owner, name, original)
