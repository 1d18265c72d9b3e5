"""Run the benchmarks and gather what they report into one table and one results file each.

A benchmark is a script here that calls ``report_ratio`` (common.py), which prints a line
``RATIO <name> <value> [<target>]``, or ``write_results``. This runner starts each as a
subprocess, echoes its output, and prints one table of the ratios, each marked ``ok`` or
``MISS`` against its target; a script's ``--quick`` run is a smoke run (a step or two), so its
ratios are shown but not judged ("smoke").

``--json DIR`` also writes ``DIR/<script>.json`` for each benchmark that finished, in the one
schema of common.py (environment, command, figures, ratios with their targets): a script that
takes ``--json`` writes it itself, with its figures; for the others this runner writes their
ratios. docs/gen.py builds the docs' tables from docs/results/ (``--json docs/results/``); a
benchmark that failed keeps its last file.

It is a tool of this repository, not of the installed package: the scripts compare hpf
with FSDP2 and hand-written loops, and live next to this file.

    python benchmarks/run.py [--quick] [--only NAME ...] [--json docs/results/]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RATIO_LINE = re.compile(r"^RATIO\s+(\S+)\s+(\S+)(?:\s+(\S+))?\s*$")


def parse_ratio_line(line: str) -> tuple[str, float, str] | None:
    """``RATIO <name> <value> [<target>]`` -> (name, value, target); None for other lines."""
    m = RATIO_LINE.match(line.strip())
    if not m:
        return None
    try:
        return m[1], float(m[2]), m[3] or ""
    except ValueError:
        return None


def meets(value: float, target: str) -> str:
    """"ok" or "MISS" against a target like "<=0.70" or ">=3"; "" without one."""
    m = re.fullmatch(r"(<=|>=)(\S+)", target)
    if not m:
        return ""
    bound = float(m[2])
    return "ok" if (value <= bound if m[1] == "<=" else value >= bound) else "MISS"


def shown(value: float, target: str) -> str:
    """The value one decimal finer than its target (0.9999996 vs >=0.999999), else 4 digits."""
    m = re.fullmatch(r"(<=|>=)\d*\.?(\d*)", target)
    return f"{value:.{len(m[2]) + 1}f}" if m else f"{value:.4g}"


def verdict(row: dict) -> str:
    """meets(), except for a --quick run's ratio: too few steps to hold a target ("smoke")."""
    return "smoke" if row.get("quick") and row["target"] else meets(row["value"], row["target"])


def ratio_table(rows: list[dict]) -> str:
    head = ("benchmark", "ratio", "value", "target", "")
    body = [(r["script"], r["name"], shown(r["value"], r["target"]), r["target"] or "-", verdict(r)) for r in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "-" * max(map(len, lines)))
    if not body:
        lines.append("(no RATIO lines were printed)")
    return "\n".join(lines)


def benchmarks(folder: Path, only: list[str] | None) -> list[Path]:
    """The scripts in ``folder`` that report ratios, by name; ``only`` keeps names containing any of its words."""
    scripts = sorted(p for p in folder.glob("*.py") if p.name not in ("common.py", "run.py")
                     and ("report_ratio(" in p.read_text() or "write_results(" in p.read_text()))
    return [p for p in scripts if any(s in p.name for s in only)] if only else scripts


def run(script: Path, quick: bool, timeout: float, out: Path | None = None) -> tuple[list[dict], int, float]:
    """Run one script (echoing its output): its ratios, exit code and seconds. ``out``: the
    folder of results files (the module doc)."""
    quick = quick and "--quick" in script.read_text()
    argv = [str(script)] + (["--quick"] if quick else [])
    target = None if out is None else (out / script.name).with_suffix(".json").resolve()
    if target is not None and '"--json"' in script.read_text():
        argv += ["--json", str(target)]
    print(f"== {script.name}{' --quick' if quick else ''}", flush=True)
    started = time.perf_counter()
    before = target.stat().st_mtime if target is not None and target.exists() else None
    load = os.getloadavg()
    proc = subprocess.Popen([sys.executable] + argv, cwd=script.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    rows = []
    for line in proc.stdout:
        print("   " + line, end="", flush=True)
        ratio = parse_ratio_line(line)
        if ratio:
            rows.append(dict(zip(("name", "value", "target"), ratio), script=script.name, quick=quick))
    rc = proc.wait()
    timer.cancel()
    seconds = time.perf_counter() - started
    print(f"   ({seconds:.0f} s, exit code {rc})")
    wrote = target is not None and target.exists() and target.stat().st_mtime != before
    if target is not None and rc == 0 and not wrote:  # a script that only prints ratios: its file from them
        from common import results

        ratios = [{k: r[k] for k in ("name", "value", "target")} for r in rows]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(results({}, quick=quick, argv=argv, ratios=ratios, load_at_start=load), indent=1)
                          + "\n")
    return rows, rc, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to the scripts that accept it (short runs)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only scripts whose file name contains NAME (repeatable)")
    ap.add_argument("--dir", type=Path, default=HERE, help="the benchmarks folder (default: this script's)")
    ap.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="per-script limit (default: 1800)")
    ap.add_argument("--json", type=Path, metavar="DIR", help="also write each benchmark's results file here")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        ap.error(f"--dir {args.dir} is not a folder")
    if args.json is not None and args.json.suffix:
        ap.error(f"--json {args.json}: give a folder (one results file per benchmark), e.g. docs/results/")
    scripts = benchmarks(args.dir, args.only)
    if not scripts:
        ap.error(f"no benchmark scripts in {args.dir}" + (f" matching {args.only}" if args.only else ""))
    rows, failed, seconds = [], [], {}
    for script in scripts:
        found, rc, seconds[script.name] = run(script, args.quick, args.timeout, args.json)
        rows += found
        if rc:
            failed.append(script.name)
    if args.json:
        print(f"results in {args.json}/ (" + ", ".join(f"{s}: {t:.0f} s" for s, t in seconds.items()) + ")")
    print(ratio_table(rows))
    if failed:
        print(f"run.py: error: {len(failed)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
