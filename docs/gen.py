"""The docs' generated parts: tables and figures made at build time from the code and from the
results JSON the benchmarks write, so no figure in the docs is typed by hand.

conf.py calls ``write_all(docs/_generated)``; the pages include the files it writes. Each
function returns Markdown, so the tests can check a table without building the site.
"""
from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
VALIDATION = DOCS / "simulate" / "validation"
RESULTS = DOCS / "results"  # one file per benchmark, in benchmarks/common.py's schema (``benchmarks/run.py --json``)
REAL_RUN = DOCS / "results" / "real_run.json"
MEMORY_MODEL = DOCS / "results" / "memory_model.json"
SEARCH_CHOICE = DOCS / "results" / "search_choice.json"
LOWBIT = DOCS / "results" / "lowbit.json"
LOWBIT_QUALITY = DOCS / "results" / "lowbit_quality.json"
# The paper's headline figures for the dense 1B GPT at 768 ranks (arXiv 2609.21594), as the issue states them.
PAPER_1B = {"exposed": "2.9%", "fsdp2": "-29.7%", "ddp": "-25.5%"}
PAPER_505B_TOKENS_S = 421e3


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# -- the command line ---------------------------------------------------------------------------

def options(command: str) -> str:
    """Every option of ``hpf <command>``, from its parser: what --help says, as a table."""
    from hpf.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    rows = []
    for action in sub._actions:
        if action.dest == "help":
            continue
        flag = ", ".join(action.option_strings) or action.metavar or action.dest  # a positional: its name
        if action.option_strings and action.choices:
            flag += " {" + ",".join(map(str, action.choices)) + "}"
        elif action.option_strings and action.nargs != 0:
            flag += f" {action.metavar or action.dest.upper()}"
        rows.append([f"`{flag}`", _literal(action.help or "")])
    return f"`hpf {command}`: {_literal(sub.description)}\n\n" + table(["option", "meaning"], rows)


def _literal(text: str) -> str:
    """--help text as Markdown that renders as typed: ``<out>`` is text, not an HTML tag."""
    return " ".join(text.split()).replace("<", "\\<")


def errors() -> str:
    """hpf.misuse.CATALOGUE: what the step refuses, and what it accepts and handles instead."""
    import hpf
    from hpf.misuse import CATALOGUE

    def named(kind: str) -> str:  # hpf's own error classes with their subclasses, which the same rows cover
        subclasses = getattr(getattr(hpf, kind, None), "__subclasses__", lambda: [])()
        return f"`{kind}`" + (f" (and {', '.join(f'`{c.__name__}`' for c in subclasses)})" if subclasses else "")

    refused = [[named(kind), when, fix] for kind, when, fix in CATALOGUE if kind != "accepted"]
    accepted = [when for kind, when, _ in CATALOGUE if kind == "accepted"]
    return (table(["error", "when", "what the message tells you to do"], refused)
            + "\nAccepted and handled instead: " + "; ".join(accepted) + ".\n")


# -- hpf simulate ----------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x:+.1%}"


def simulate_1b() -> str:
    """The dense 1B GPT on CloudMatrix384, from the model itself (bf16, weak scaling)."""
    from hpf import sim

    rows = []
    for batch, ranks in ((1, 16), (1, 128), (1, 768), (4, 768)):
        res = sim.compare("1b", sim.sweep_mesh(ranks, sim.hardware("cloudmatrix384")), "cloudmatrix384",
                          local_batch=batch, mixed_precision="bf16")
        hpf_ = res["hpf"]
        rows.append([f"{batch} x 2048", ranks, f"{hpf_.step_s * 1e3:.1f} ms", f"{hpf_.exposed_share:.1%}",
                     _pct(hpf_.step_s / res["fsdp2"].step_s - 1), _pct(hpf_.step_s / res["ddp"].step_s - 1)])
    rows.append(["the paper", 768, "", PAPER_1B["exposed"], PAPER_1B["fsdp2"], PAPER_1B["ddp"]])
    return table(["local batch", "ranks", "hpf step", "hpf exposed", "hpf vs FSDP2", "hpf vs Megatron DDP"], rows)


def simulate_505b() -> str:
    """The 505B MoE at 768 ranks, experts over the node's 16 dies."""
    from hpf import sim

    res = sim.compare("505b", {"node": 48, "local": 16}, "cloudmatrix384", ("hpf", "fsdp2"), model="moe",
                      ep_axis="local", local_batch=1, mixed_precision="bf16")
    rows = [[name, f"{r.step_s:.2f} s", f"{r.tokens_per_s / 1e3:,.0f}k", f"{r.exposed_share:.1%}"]
            for name, r in res.items()]
    rows.append(["the paper", "", f"{PAPER_505B_TOKENS_S / 1e3:,.0f}k", ""])
    return table(["strategy", "step", "tokens/s", "exposed"], rows)


def simulate_plots(out: Path) -> str:
    """The scaling curves of the dense 1B GPT (16 to 768 ranks), drawn by hpf simulate --plot's code."""
    from hpf import sim
    from hpf.cli.simulate import save_simulate_plots

    rows = sim.sweep("1b", [16, 32, 64, 128, 256, 512, 768], "cloudmatrix384", local_batch=1, mixed_precision="bf16")
    files = save_simulate_plots(rows, out)
    return "\n".join(f"![{f.stem.replace('_', ' ')}](/_generated/{f.name})" for f in files) + "\n"  # from docs/


def _runs() -> list[tuple[str, list[dict]]]:
    """The committed validation runs: (name, results), full runs first."""
    found = [("full run", VALIDATION / "results.json"), ("tiny run", VALIDATION / "tiny_runs" / "1" / "results.json")]
    return [(name, json.loads(p.read_text())) for name, p in found]


def _ms(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def validation() -> str:
    """Predicted against measured, per case and run, from the results JSON of
    benchmarks/simulate_vs_measured.py (each case: the medians over its rounds)."""
    runs = _runs()
    cases = list(dict.fromkeys(r["case"] for _, rs in runs for r in rs))
    rows = []
    for case in cases:
        row = [case]
        for _, rs in runs[:2]:
            r = next((r for r in rs if r["case"] == case), None)
            if r is None:
                row += ["", ""]
                continue
            exposed = "-" if r["meas_exposed"] is None else f"{r['pred_exposed']:.1%} / {r['meas_exposed']:.1%}"
            row += [f"{_ms(r['pred_s'])} / {_ms(r['meas_s'])} ({r['pred_s'] / r['meas_s']:.2f})", exposed]
        rows.append(row)
    head = ["case"] + [h for name, _ in runs[:2] for h in (f"{name}: step pred / meas (ratio)", f"{name}: exposed pred / meas")]
    return table(head, rows)


def validation_counts() -> str:
    """Per run: step times within 0.8-1.25 of measured and exposed shares within 5 points."""
    rows = []
    for name, rs in _runs():
        steps = [0.8 <= r["pred_s"] / r["meas_s"] <= 1.25 for r in rs]
        shares = [abs(r["pred_exposed"] - r["meas_exposed"]) <= 0.05 for r in rs if r["meas_exposed"] is not None]
        configs = sorted({r["case"].split("/")[0] for r in rs})
        rows.append([name, ", ".join(configs), f"{sum(steps)} of {len(steps)}", f"{sum(shares)} of {len(shares)}"])
    return table(["run", "configs", "step time within 0.8-1.25", "exposed share within 5 points"], rows)


# -- benchmarks and the real run -------------------------------------------------------------------

def results(path: Path) -> dict:
    """A benchmark's results file (benchmarks/common.py's one schema), checked."""
    data = json.loads(path.read_text())
    if data.get("schema") != "hpf-benchmark/1":
        raise ValueError(f"{path}: not a benchmark results file of schema hpf-benchmark/1; rerun "
                         f"`python benchmarks/run.py --only {path.stem} --json docs/results/`")
    return data


def _run_of(data: dict) -> str:
    """How a results file's run went: full or --quick, when, and the load it started at."""
    env = data["environment"]
    how = "--quick (a smoke run)" if env["quick"] else "full"
    if env.get("converted"):  # a file of the format before the one schema, not rerun since
        return f"{how}, recorded before the results schema (not rerun)"
    return f"{how}, {env['finished'][:10]}, load {env['load_average_at_start'][0]:.1f} at its start"


def benchmarks() -> str:
    """Every benchmark's ratios and targets, from its results file in docs/results/ (``python
    benchmarks/run.py --json docs/results/``): a --quick run's ratios are shown, not judged."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        data = results(path)
        for r in data["ratios"]:
            judged = _verdict(r["value"], r["target"]) if r["target"] else ""
            verdict = "smoke" if judged and data["environment"]["quick"] else judged
            rows.append([f"`{data['benchmark']}`", f"`{r['name']}`", f"{r['value']:.4g}", r["target"] or "-", verdict,
                         _run_of(data)])
    return table(["script", "ratio", "value", "target", "", "run"], rows)


def real_run() -> str:
    """The figures of benchmarks/real_run.py: the README's text run, measured."""
    data = results(REAL_RUN)
    r, cores = data["figures"], data["environment"]["cores"]
    evals = r["eval_losses"]
    rows = [["train loss", f"{r['losses'][0]:.4f} (step 1)", f"{r['losses'][-1]:.4f} (step {len(r['losses'])})"],
            ["held-out loss", f"{evals[0][1]:.4f} (step {evals[0][0]})", f"{evals[-1][1]:.4f} (step {evals[-1][0]})"],
            ["wall time", "", f"{r['wall_s']:.0f} s on {cores} cores, {r['ranks']} ranks"
             + (f" ({data['environment']['cpu']})" if "cpu" in data["environment"] else "")]]
    return ("```bash\n" + "\n".join(r["commands"]) + "\n```\n\n" + table(["", "first", "last"], rows))


# -- the plan search ---------------------------------------------------------------------------------

def search_example() -> str:
    """What ``hpf plan --search`` prints for the dense 1B GPT at 768 ranks (computed at build time)."""
    from hpf import search

    result = search.search("gpt", "1b", {"node": 48, "local": 16}, "cloudmatrix384", memory_per_rank=64 * 2**30)
    return ("```text\n$ hpf plan --search --config 1b --mesh node=48,local=16 --hardware cloudmatrix384\n"
            + result.format() + "\n```\n")


def search_paper() -> str:
    """The paper's setups: today's hand-written options against the search's pick, predicted."""
    from hpf import memory, search

    rows = []
    for model, config, hand in (("gpt", "1b", search.Candidate(mixed_precision="bf16")),
                                ("moe", "505b", search.Candidate(ep_axis="local", mixed_precision="bf16"))):
        mesh = {"node": 48, "local": 16}
        priced = {r.candidate: r for r in search.candidates(model, config, mesh, "cloudmatrix384")}
        mine = search.simulate(hand, model, config, mesh, "cloudmatrix384", 768)
        setup = f"{model} {config}, 768 dies, 1 sequence each"
        rows.append([setup, "hand-written: " + hand.label(), memory.size(priced[hand].memory.total),
                     f"{mine.tokens_per_s / 1e3:,.0f}k"])
        for cap in (64 * 2**30, None):  # the die's memory; without a cap only where nothing fits it
            try:
                best = search.search(model, config, mesh, "cloudmatrix384", memory_per_rank=cap).best
            except search.NoFeasiblePlan:
                small = min(priced.values(), key=lambda r: r.memory.total)
                rows.append([setup, f"search, {memory.size(cap)} cap: none fits (smallest: {small.candidate.label()})",
                             memory.size(small.memory.total), "-"])
                continue
            rows.append([setup, f"search, {memory.size(cap) + ' cap' if cap else 'no cap'}: {best.candidate.label()}",
                         memory.size(best.memory.total), f"{best.sim.tokens_per_s / 1e3:,.0f}k"])
            break
    return table(["setup", "plan", "predicted memory per die", "predicted tokens/s"], rows)


def memory_validation() -> str:
    """hpf.memory's predicted peak per rank against the measured one (benchmarks/memory_model.py)."""
    data = results(MEMORY_MODEL)["figures"]
    rows = [[r["case"], _mib(r["predicted"]), _mib(r["landed"]), _mib(r["measured"]),
             f"{r['predicted'] / r['measured']:.3f}", r["when"]] for r in data["cases"]]
    return table(["case (config/ranks/sequences per rank/recompute)", "predicted", "if each reduction landed at once",
                  "measured", "ratio", "predicted peak at"], rows)


def search_choice() -> str:
    """The searched plan's measured step against the best measured candidate (benchmarks/search_choice.py)."""
    done = results(SEARCH_CHOICE)
    data, env = done["figures"], done["environment"]
    head = ("Settings: " + ("--quick (one round of two steps, the pick and four others: a check of the script, "
                            "not the measurement)" if env["quick"] else f"{data['rounds']} rounds of "
                            f"{data['steps']} steps per candidate") + f", torch {env['torch']}.\n\n")
    rows = [[j["job"], j["candidates"], j["measured"], f"{j['search_s']:.2f} s", f"{j['exhaustive_s'] / 60:.1f} min",
             f"{j['picked']} ({_ms(j['picked_s'])})", f"{j['best']} ({_ms(j['best_s'])})",
             f"{j['picked_s'] / j['best_s']:.3f}"] for j in data["jobs"]]
    return head + table(["job", "candidates", "measured", "search", "exhaustive run", "searched plan",
                         "best measured", "ratio (target <= 1.10)"], rows)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"
def _verdict(value: float, target: str) -> str:
    bound = float(target[2:])
    return "ok" if (value <= bound if target.startswith("<=") else value >= bound) else "MISS"


def lowbit() -> str:
    """Slow-tier bytes and the emulated-link step of benchmarks/lowbit.py (docs/results/lowbit.json)."""
    done = results(LOWBIT)
    r, env = done["figures"], done["environment"]
    s = r["settings"]
    rows = [[f"`{v['name']}`", f"{v['value']:.3f}", v["target"] or "-", _verdict(v["value"], v["target"]) if v["target"] else ""]
            for v in done["ratios"]]
    runs = "--quick (2 steps each: a smoke run, not a measurement)" if env["quick"] else f"{s['rounds']} rounds"
    head = (f"GPT {s['config']}, 2 x 2 mesh, {runs}, emulated link {s['latency_ms']:g} ms + bytes / {s['bandwidth_mbs']:g} MB/s, {env['cores']} cores, torch "
            f"{env['torch']}; step medians {', '.join(f'{k} {v:.1f} ms' for k, v in r['step_ms'].items())}.\n\n")
    return head + table(["ratio", "value", "target", ""], rows)


def lowbit_quality() -> str:
    """Final held-out losses of benchmarks/lowbit_quality.py (docs/results/lowbit_quality.json)."""
    done = results(LOWBIT_QUALITY)
    r, env = done["figures"], done["environment"]
    s = r["settings"]
    rows = []
    for name, seeds in r["runs"].items():
        finals = [run["eval_losses"][-1][1] for run in seeds]
        ratio = next((v for v in done["ratios"] if r["ratio_runs"].get(v["name"]) == name), None)
        versus = "-" if ratio is None else f"{ratio['value']:.4f}" + (
            f" (target {ratio['target']}, {_verdict(ratio['value'], ratio['target'])})" if ratio["target"] else "")
        rows.append([name, f"{sum(finals) / len(finals):.4f}", ", ".join(f"{f:.4f}" for f in finals), versus])
    command = r["runs"]["full precision"][0]["command"]
    head = (f"Llama {s['config']}, {s['steps']} steps" + (" (--quick: a smoke run)" if env["quick"] else "")
            + f", held-out loss at the last step, seeds {', '.join(map(str, s['seeds']))}, {env['cores']} cores; "
            f"each run is `{command}` (seed and `--slow-precision` varied).\n\n")
    return head + table(["slow tier", "mean held-out loss", "per seed", "mean vs full precision"], rows)


GENERATED = {
    "train_options.md": lambda out: options("train"),
    "prepare_options.md": lambda out: options("prepare"),
    "plan_options.md": lambda out: options("plan"),
    "simulate_options.md": lambda out: options("simulate"),
    "calibrate_options.md": lambda out: options("calibrate"),
    "eval_options.md": lambda out: options("eval"),
    "export_options.md": lambda out: options("export"),
    "generate_options.md": lambda out: options("generate"),
    "errors.md": lambda out: errors(),
    "simulate_1b.md": lambda out: simulate_1b(),
    "simulate_505b.md": lambda out: simulate_505b(),
    "simulate_plots.md": simulate_plots,
    "validation.md": lambda out: validation(),
    "validation_counts.md": lambda out: validation_counts(),
    "benchmarks.md": lambda out: benchmarks(),
    "real_run.md": lambda out: real_run(),
    "search_example.md": lambda out: search_example(),
    "search_paper.md": lambda out: search_paper(),
    "memory_validation.md": lambda out: memory_validation(),
    "search_choice.md": lambda out: search_choice(),
    "lowbit.md": lambda out: lowbit(),
    "lowbit_quality.md": lambda out: lowbit_quality(),
}


def write_all(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, make in GENERATED.items():
        (out / name).write_text(make(out))

