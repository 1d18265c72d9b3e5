"""Hardware profiles for ``hpf simulate``: compute peak, links per tier, memory bandwidth.

Every published figure carries its source and a confidence note. The published profiles
are inputs, not measurements: change them (``Hardware.replace``) when better figures exist.
The ``local-cpu`` profile is filled by calibration (``hpf calibrate``) and loaded from
its JSON file; nothing here measures anything.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

__all__ = ["Link", "Hardware", "PROFILES", "hardware", "load_calibration", "compute_key", "parse_compute_key",
           "model_prefix"]

GB = 1e9


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: a collective over p ranks of an n-byte buffer takes
    ``latency + (p-1)*alpha + (p-1)/p * n / beta`` (ring). ``rs_alpha``/``rs_beta`` give a
    reduce-scatter its own figures where it differs (gloo builds it on all-reduce)."""

    alpha: float  # seconds per ring step
    beta: float  # bytes per second per rank, one direction
    latency: float = 0.0  # seconds per collective (an emulated SlowLink's latency)
    rs_alpha: float | None = None
    rs_beta: float | None = None
    # torch.distributed's own reduce_scatter_tensor where hpf's differs (gloo: an all-reduce of a
    # copy; hpf's is an all-to-all plus a local sum): what FSDP2 pays. None: as reduce_scatter.
    native_rs_alpha: float | None = None
    native_rs_beta: float | None = None
    # On a shared host (CPU ranks) a collective's copies run on the cores that compute:
    # compute runs ``cpu_slowdown`` x slower while this link is busy, and a stage takes
    # ``busy_slowdown`` x its alone time plus ``busy_latency`` (a descheduled peer's wait)
    # (calibrated together, hpf calibrate). 1.0 and 0: no contention.
    cpu_slowdown: float = 1.0
    busy_slowdown: float = 1.0
    busy_latency: float = 0.0
    # compute-thread seconds per collective hpf issues (its issue and wait calls, its comm threads'
    # GIL and core time): a fixed cost per bucket that small models' steps are made of (calibrated)
    issue_s: float = 0.0
    # op -> (alpha, beta) of a framework's own collective path where calibrated (``fsdp2_all_gather``,
    # ``fsdp2_reduce_scatter``: FSDP2's copy-in, fresh buffers, collective and copy-out together)
    ops: dict = field(default_factory=dict)
    # two collectives issued together on gloo's ProcessGroup (2 worker threads) take the longer plus
    # ``overlap`` x the shorter: 1 runs them one after another, 0 side by side (calibrated)
    overlap: float = 1.0
    source: str = ""

    def figures(self, op: str) -> tuple[float, float]:
        if op in self.ops:
            return tuple(self.ops[op])
        if op.startswith("fsdp2_"):  # uncalibrated: torch's own collective (FSDP2 calls it)
            op = {"fsdp2_reduce_scatter": "native_reduce_scatter"}.get(op, op.removeprefix("fsdp2_"))
        if op == "native_reduce_scatter" and self.native_rs_beta is not None:
            return self.native_rs_alpha or 0.0, self.native_rs_beta
        if op in ("reduce_scatter", "native_reduce_scatter") and self.rs_beta is not None:
            return self.rs_alpha if self.rs_alpha is not None else self.alpha, self.rs_beta
        return self.alpha, self.beta

    def sliced(self, factor: float) -> "Link":
        """This link ``factor`` x slower: on a shared host a CPU transport's handoffs wait for peers
        to get a core and its copies share the cores, so a group measured among fewer ranks than
        the job's runs ``factor`` = (the job's ranks per core) / (the measurement's) slower."""
        div = lambda x: None if x is None else x / factor  # noqa: E731
        mul = lambda x: None if x is None else x * factor  # noqa: E731
        return dataclasses.replace(self, alpha=self.alpha * factor, beta=self.beta / factor,
                                   rs_alpha=mul(self.rs_alpha), rs_beta=div(self.rs_beta),
                                   native_rs_alpha=mul(self.native_rs_alpha), native_rs_beta=div(self.native_rs_beta),
                                   ops={k: (a * factor, b / factor) for k, (a, b) in self.ops.items()},
                                   issue_s=self.issue_s * factor, latency=self.latency * factor, busy_latency=self.busy_latency * factor)


@dataclass(frozen=True)
class Hardware:
    """One rank's compute and the links of the two tiers.

    ``fast_domain``: ranks that share the fast link (the mesh's last axis by default);
    ``scale_out``: the link between ``slow_domain``-rank groups (beyond a supernode), used for
    the slow tier when the mesh has more ranks than ``slow_domain``.
    ``shared_links``: True when both tiers' bytes pass through one host's memory system
    (local CPU ranks), so a flat collective's tier times add; False for separate networks,
    where the slowest tier bounds a flat ring.
    """

    name: str
    peak_flops: float  # per rank, compute dtype
    efficiency: float  # achieved / peak for the model's matmuls (MFU-like)
    mem_bw: float  # bytes/s per rank (copies, optimizer)
    fast: Link | dict  # a Link, or {group size or (group size, world): Link} as calibration fits them
    slow: Link | dict
    fast_domain: int
    slow_domain: int = 0  # 0: no scale-out tier
    scale_out: Link | None = None
    shared_links: bool = False
    kernel_overhead_s: float = 0.0  # per unit and pass (launch / Python); CPU calibration fills it
    fsdp2_unit_overhead_s: float = 0.0  # per unit and pass: FSDP2's hooks and DTensor wrapping
    cores: int = 0  # a shared host's cores: per-rank Python overheads slow by ranks/cores beyond it (0: never)
    compute: dict = field(default_factory=dict)  # calibrated: compute_key(...) -> unit seconds
    notes: tuple[str, ...] = ()
    memory_bytes: int = 0  # one rank's device memory (the notes give the source); 0: unknown (a CPU host)

    def replace(self, **kw) -> "Hardware":
        return dataclasses.replace(self, **kw)

    def link(self, tier: str, group: int, world: int) -> Link:
        """The link of ``tier`` ("fast"/"slow") for a collective over ``group`` ranks of a ``world``-rank job."""
        if tier == "slow" and self.scale_out is not None and self.slow_domain and world > self.slow_domain:
            return self.scale_out
        links = self.fast if tier == "fast" else self.slow
        if isinstance(links, Link):
            return links
        # the nearest (group, world) measured; a group measured in a smaller world (a 2-rank group of a
        # 4-rank job on 2 cores) has its latencies stretched by the extra ranks per core
        g, w = min((k if isinstance(k, tuple) else (k, k) for k in links),
                   key=lambda gw: (abs(gw[0] - group), abs(gw[1] - world), gw))
        near = links[(g, w) if (g, w) in links else g]
        slices = self.overhead(1.0, world) / self.overhead(1.0, w)
        return near.sliced(slices) if slices != 1.0 else near

    def overhead(self, seconds: float, world: int) -> float:
        """A per-rank CPU overhead measured on one rank, with ``world`` ranks sharing ``cores``."""
        return seconds * max(1.0, world / self.cores) if self.cores else seconds


def compute_key(model: str, config: str, local_batch: int, ranks: int, precision: str | None = None) -> str:
    """The key of one calibrated compute shape: ``[model:]config/local_batch/ranks[/precision]``
    (a GPT and fp32 carry no prefix and no suffix). Each model and each compute precision is
    measured on its own: on a CPU, bf16 runs a GPT block 1.5x faster than fp32 and a tiny MoE's
    2x slower (casts and small matmuls), which no FLOP count predicts."""
    return f"{model_prefix(model)}{config}/{local_batch}/{ranks}" + (f"/{precision}" if precision else "")


def model_prefix(model: str) -> str:
    """How a calibrated shape names its model: nothing for a GPT, else ``model:``."""
    return "" if model == "gpt" else f"{model}:"


def parse_compute_key(key: str) -> tuple[str, str, int, int, str | None]:
    """(model, config, local batch, ranks, precision) of a :func:`compute_key`."""
    model, _, rest = key.rpartition(":")
    config, batch, ranks, *precision = rest.split("/")
    return model or "gpt", config, int(batch), int(ranks), precision[0] if precision else None


# -- published profiles ------------------------------------------------------------------------
_CM_SRC = ("arXiv 2506.12708 (Zuo et al. 2025, 'Serving Large Language Models on Huawei CloudMatrix384': a "
           "DeepSeek-R1 serving paper; its hardware section) via secondary summaries "
           "(emergentmind.com topic page; besthub.dev / Architects' Tech Alliance article; "
           "chinaresearchcollective substack), not the PDF itself")
_ASSUMED = "assumption of this profile, not a published figure"

_UB = Link(alpha=1.0e-6, beta=196 * GB,
           source=f"UB plane: >392 GB/s unidirectional per 910C, i.e. 196 GB/s per die; {_CM_SRC}. Checked: the "
                  "besthub summary gives 392 GB/s per NPU but attributes it to 'fourteen 400 Gbps' links (that "
                  "would be 700 GB/s: a garbled link count or rate); the substack gives '196 GB/s / NPU' "
                  "(per-die figure read as per-NPU). 392/NPU kept. alpha 1 us: summaries say sub-microsecond "
                  "inter-node latency, so 1 us per ring step is an upper bound. Confidence: medium")
_UB_INTER = dataclasses.replace(_UB, alpha=2.0e-6, beta=0.97 * 196 * GB,
                                source="UB between nodes of one supernode: near-uniform bandwidth and latency "
                                       "per the summaries (two-tier non-blocking Clos, L1 switches in the node, "
                                       "L2 rack switches); -3% bandwidth and +1 us per step are "
                                       f"{_ASSUMED} (no summary read gives a number). Confidence: low-medium")
_ROCE = Link(alpha=5.0e-6, beta=25 * GB,
             source=f"RDMA plane: up to 400 Gbps unidirectional RoCE per NPU (50 GB/s per card, 25 GB/s per die, "
                    f"the two dies sharing it); {_CM_SRC}; agrees across the summaries read. alpha 5 us is "
                    f"{_ASSUMED}. Confidence: medium")

ASCEND_910C = dict(
    peak_flops=376e12,  # 752 TFLOPS bf16 per package, 2 dies
    mem_bw=1.6e12,  # 3.2 TB/s per package
    memory_bytes=64 * 2**30,  # 128 GB HBM per package
    notes=("Ascend 910C: 2 dies per card, 752 TFLOPS bf16 and 128 GB / 3.2 TB/s HBM per package, so "
           f"~376 TFLOPS, 64 GB, 1.6 TB/s per die (one rank = one die); {_CM_SRC}. Press figures differ a "
           "little (TechPowerUp: 780 TFLOPS bf16; others ~800 TFLOPS fp16; 8 HBM2E stacks, 3.2 TB/s): "
           "the paper's 752 kept. Confidence: medium",
           f"efficiency 0.45 (MFU of a dense 1B GPT's matmuls on the die) is {_ASSUMED}",),
)

PROFILES: dict[str, Hardware] = {
    "cloudmatrix384": Hardware(
        name="cloudmatrix384", efficiency=0.45, fast=_UB, slow=_UB_INTER, fast_domain=16,
        slow_domain=768, scale_out=_ROCE,
        notes=ASCEND_910C["notes"] + (
            "CloudMatrix384: 384 cards = 768 dies in 48 nodes of 8 cards; fast tier = one node (16 dies), "
            "slow tier = UB between nodes, RoCE beyond 768 dies. " + _CM_SRC,),
        **{k: v for k, v in ASCEND_910C.items() if k != "notes"}),
    # The same machine if the tier between nodes were RoCE (a cluster of 8-card nodes without the
    # UB supernode): the two-tier topology's case.
    "ascend910c-roce": Hardware(
        name="ascend910c-roce", efficiency=0.45, fast=_UB, slow=_ROCE, fast_domain=16,
        notes=ASCEND_910C["notes"] + ("8-card nodes joined by RoCE only (what-if, not a product figure)",),
        **{k: v for k, v in ASCEND_910C.items() if k != "notes"}),
    "h100": Hardware(
        name="h100", peak_flops=989e12, efficiency=0.45, mem_bw=3.35e12,
        fast=Link(alpha=2e-6, beta=450 * GB, source="NVLink4: 900 GB/s bidirectional = 450 GB/s per direction per "
                  "GPU (NVIDIA H100 SXM datasheet); alpha 2 us is an assumption. Confidence: high (bandwidth)"),
        slow=Link(alpha=5e-6, beta=50 * GB, source="NDR InfiniBand 400 Gb/s = 50 GB/s per GPU (one ConnectX-7 per "
                  "GPU, DGX H100); alpha 5 us is an assumption. Confidence: high (bandwidth)"),
        fast_domain=8, memory_bytes=80 * 2**30,
        notes=("H100 SXM: 989 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s (NVIDIA datasheet; the 1,979 TFLOPS "
               "some pages call dense is the 2:4-sparsity figure). Confidence: high",
               f"efficiency 0.45 is {_ASSUMED}")),
    "h200": Hardware(
        name="h200", peak_flops=989e12, efficiency=0.45, mem_bw=4.8e12,
        fast=Link(alpha=2e-6, beta=450 * GB, source="NVLink4 as H100"),
        slow=Link(alpha=5e-6, beta=50 * GB, source="NDR InfiniBand as H100"),
        fast_domain=8, memory_bytes=141 * 10**9,
        notes=("H200 SXM: H100 compute (989 TFLOPS dense bf16; 1,979 is with sparsity), 141 GB HBM3e at "
               "4.8 TB/s, NVLink4 900 GB/s bidirectional (NVIDIA datasheet, checked against spec pages). "
               "Confidence: high", f"efficiency 0.45 is {_ASSUMED}")),
}


def hardware(name_or_path: str) -> Hardware:
    """A published profile by name, or the ``local-cpu`` profile from a calibration JSON file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if name_or_path == "local-cpu":
        raise ValueError("--hardware local-cpu needs a calibration: run `hpf calibrate --out calib.json` once, "
                         "then pass --hardware calib.json")
    if os.path.isfile(name_or_path):
        return load_calibration(name_or_path)
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {sorted(PROFILES)} or a calibration "
                     "JSON file written by hpf calibrate")


def _link(d: dict | None) -> Link | None:
    return None if d is None else Link(**d)


def load_calibration(path: str | os.PathLike, transport: str = "shm") -> Hardware:
    """The ``local-cpu`` Hardware of a calibration file. The fast tier is shared memory
    (``transport="shm"``, what hpf's two-tier collectives use on one host) or gloo ("gloo")."""
    try:
        with open(path) as f:
            c = json.load(f)
        links = {k: {int(w): _link(v) for w, v in per.items()} for k, per in c["links"].items()}
        return Hardware(
            name="local-cpu", peak_flops=c["peak_flops"], efficiency=c["efficiency"], mem_bw=c["mem_bw"],
            fast=links[transport], slow=links["gloo"], fast_domain=0, shared_links=True,
            kernel_overhead_s=c.get("kernel_overhead_s", 0.0), fsdp2_unit_overhead_s=c.get("fsdp2_unit_overhead_s", 0.0),
            cores=c.get("cores", 0), compute=c.get("compute", {}),
            notes=(f"calibrated on {c.get('host', '?')} at {c.get('when', '?')}",))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not a calibration's fields
        raise ValueError(f"{path} is not a calibration written by hpf calibrate ({type(e).__name__}: {e}); "
                         "make one with `hpf calibrate --out calib.json`") from e
