"""The default hardware of every command that predicts (``hpf simulate``, ``hpf plan --search``,
``hpf train --plan auto``): one rule, stated in each output.

- ``--hardware NAME|FILE`` when given;
- a job this machine runs (``hpf train``'s, or one of up to ``LOCAL_RANKS`` ranks whose model has a
  block that fits here): this machine's calibration, kept in the user's cache and extended, the
  first time a job needs it, by a quick calibration of that job's shape (model, config, sequences
  per rank, ranks) in fp32. One taken while other processes kept the cores busy is measured
  again, then refused: it would predict every step slower than a quiet run;
- any other job: ``PROFILE``, the paper's machine.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from hpf import sim
from hpf.cli.common import CliError, write_atomic
from hpf.sim.hardware import compute_key

__all__ = ["LOCAL_RANKS", "PROFILE", "QUICK_REPS", "LOADED", "HELP", "calibration_cache", "hardware_of"]

LOCAL_RANKS = 8  # the most ranks a job of this machine runs, as many as one node's accelerators
PROFILE = "cloudmatrix384"  # the default for a job this machine cannot run
QUICK_REPS = 3  # a quick calibration: 3 reps, 1 launch, this job's world and shape
LOADED = 0.15  # other processes' CPU over the calibration's own above this: taken under load
HELP = (f"a published profile (cloudmatrix384, ascend910c-roce, h100, h200) or a calibration JSON from hpf calibrate "
        f"(default: for a job this machine runs, up to {LOCAL_RANKS} ranks of a model whose block fits here, this "
        "machine's calibration, cached in ~/.cache/hpf and measured quickly the first time a job's shape needs it, "
        f"refused if other processes load the cores; for any other job, {PROFILE})")


def calibration_cache() -> Path:
    """Where this machine's calibration is kept: the user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "hpf" / f"calibration-{socket.gethostname()}.json"


def hardware_of(args, ranks: int, local_batch: int, *, runs_here: bool = False):
    """The rule above for a job of ``ranks`` ranks and ``local_batch`` sequences per rank
    (``args``: --hardware, --model, --config; ``runs_here``: hpf train). Returns (the Hardware, a
    line that says which and why)."""
    if args.hardware is not None:
        try:
            return sim.hardware(args.hardware), f"hardware {args.hardware} (--hardware)"
        except ValueError as e:
            raise CliError(f"--hardware: {e}") from None
    elsewhere = None if runs_here else _not_here(args.model, args.config, ranks)
    if elsewhere:
        return sim.hardware(PROFILE), (f"hardware {PROFILE}, the default for a job this machine does not run "
                                       f"({elsewhere}); --hardware NAME|FILE for another")
    cache = calibration_cache()
    world = min(ranks, LOCAL_RANKS)
    calib = _cached(cache)
    if not _covers(calib, args.model, args.config, local_batch, world):
        calib = _extend(calib, (args.model, args.config, local_batch), world, cache)
    try:
        hw = sim.load_calibration(cache)
    except ValueError as e:
        raise CliError(f"the cached calibration {cache}: {e}; delete it (it is made again) or pass --hardware") from None
    return hw, (f"this machine's calibration ({cache}), the default for a job this machine runs; --hardware "
                "NAME|FILE for other hardware")


def _not_here(model: str, config: str, ranks: int) -> str | None:
    """Why this machine does not run the job, or None when it does."""
    if ranks > LOCAL_RANKS:
        return f"{ranks} ranks, more than the {LOCAL_RANKS} of one machine"
    from hpf.sim import calibrate as cal
    try:
        cal.check_layers_fit([(model, config, 1)])
    except ValueError:
        return f"one block of {model} {config!r} needs more memory than this machine has free"
    return None


def _cached(cache: Path) -> dict | None:
    """The cached calibration, or None when there is none (a file that is not one is made again)."""
    try:
        calib = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(calib, dict) and all(isinstance(calib.get(k), dict) for k in ("links", "compute"))
    return calib if ok else None


def _covers(calib: dict | None, model: str, config: str, local_batch: int, world: int) -> bool:
    """Whether ``calib`` measured this shape's compute and this world's links."""
    return calib is not None and str(world) in calib["links"].get("gloo", {}) and \
        compute_key(model, config, local_batch, world) in calib["compute"]


def _extend(calib: dict | None, shape: tuple, world: int, cache: Path) -> dict:
    """A quick calibration of ``shape`` on ``world`` ranks merged into ``calib`` and cached; measured
    again once if other processes loaded the cores, then refused."""
    from hpf.sim import calibrate as cal

    model, config, batch = shape
    started = time.perf_counter()
    print(f"calibrate  this machine's calibration lacks {model} {config} at {batch} sequences per rank on {world} "
          f"ranks: a quick one (once; cached at {cache}; --hardware NAME|FILE skips it)", flush=True)

    def stage(what: str) -> None:
        print(f"calibrate  {what}  ({time.perf_counter() - started:.0f} s so far)", flush=True)
    for attempt in (1, 2):
        quick, load = cal.with_load(lambda: cal.calibrate((world,), (shape,), reps=QUICK_REPS, launches=1,
                                                          stage=stage, quick=True, precisions=(None,)))
        share = load["others_cores"] / max(load["own_cores"], 1e-9)
        print(f"calibrate  other processes used {load['others_cores']:.2f} of {load['cores']} cores while it ran "
              f"({share:.0%} of its own CPU time)", flush=True)
        if share <= LOADED:
            break
        if attempt == 1:
            print("calibrate  taken under load, which slows every figure: measuring again", flush=True)
    else:
        raise CliError(f"this machine was busy while it was calibrated, twice (other processes used "
                       f"{load['others_cores']:.2f} of its {load['cores']} cores): its figures would predict every "
                       f"step slower than a quiet run, so none is cached. Run again when it is quiet, or pass "
                       "--hardware NAME|FILE (hpf calibrate --out FILE measures at length and records the load)")
    quick["load"] = {compute_key(*shape, world): load}
    merged = _merge(calib, quick)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps(merged, indent=1) + "\n")
    return merged


def _merge(calib: dict | None, quick: dict) -> dict:
    """``quick``'s links and compute added to ``calib`` (whose other figures stay)."""
    if calib is None:
        return quick
    out = {**quick, **calib, "links": {t: {**quick["links"].get(t, {}), **calib["links"].get(t, {})}
                                       for t in quick["links"]}}
    out["compute"] = {**calib["compute"], **quick["compute"]}
    out["load"] = {**calib.get("load", {}), **quick["load"]}
    return out
