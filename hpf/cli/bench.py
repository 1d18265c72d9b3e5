"""``hpf bench``: run benchmarks/*.py and gather the RATIO lines they print into one table."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpf.cli.common import CliError, positive

RATIO_LINE = re.compile(r"^RATIO\s+(\S+)\s+(\S+)(?:\s+(\S+))?\s*$")
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent.parent / "benchmarks"


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


def _shown(value: float, target: str) -> str:
    """The value one decimal finer than its target (0.9999996 vs >=0.999999), else 4 digits."""
    m = re.fullmatch(r"(<=|>=)\d*\.?(\d*)", target)
    return f"{value:.{len(m[2]) + 1}f}" if m else f"{value:.4g}"


def cmd_bench(args) -> int:
    if not args.dir.is_dir():
        raise CliError(f"--dir {args.dir} is not a folder; point it at the repository's benchmarks/")
    scripts = sorted(p for p in args.dir.glob("*.py") if p.name != "common.py" and not p.name.startswith("_"))
    if args.only:
        scripts = [p for p in scripts if any(s in p.name for s in args.only)]
    if not scripts:
        raise CliError(f"no benchmark scripts in {args.dir}" + (f" matching {args.only}" if args.only else ""))
    rows, failed = [], []
    for script in scripts:
        quick = args.quick and "--quick" in script.read_text()
        print(f"== {script.name}{' --quick' if quick else ''}", flush=True)
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(script)] + (["--quick"] if quick else []), cwd=args.dir,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
        for line in proc.stdout:
            print("   " + line, end="", flush=True)
            ratio = parse_ratio_line(line)
            if ratio:
                rows.append((script.name, *ratio))
        rc = proc.wait()
        timer.cancel()
        print(f"   ({time.perf_counter() - started:.0f} s, exit code {rc})")
        if rc:
            failed.append(script.name)
    print(ratio_table(rows))
    if failed:
        print(f"hpf: error: {len(failed)} benchmark(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def ratio_table(rows: list[tuple[str, str, float, str]]) -> str:
    head = ("benchmark", "ratio", "value", "target", "")
    body = [(b, n, _shown(v, t), t or "-", meets(v, t)) for b, n, v, t in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "-" * max(map(len, lines)))
    if not body:
        lines.append("(no RATIO lines were printed)")
    return "\n".join(lines)


def add_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="run benchmarks/*.py and print one table of their ratios",
        description="Run each script in benchmarks/ as a subprocess and collect the lines "
                    "'RATIO <name> <value> <target>' they print into one table.")
    bench.add_argument("--quick", action="store_true", help="pass --quick to scripts that accept it")
    bench.add_argument("--only", action="append", metavar="NAME",
                       help="run only scripts whose file name contains NAME (repeatable)")
    bench.add_argument("--dir", type=Path, default=BENCHMARKS_DIR, help="benchmarks folder (default: %(default)s)")
    bench.add_argument("--timeout", type=positive(float), default=1800.0, metavar="S",
                       help="per-script limit in seconds (default: 1800)")
    bench.set_defaults(run=cmd_bench)
