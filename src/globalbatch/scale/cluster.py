"""The step time of a training step on a cluster: compute, exposed communication, pipeline bubble.

* Compute: ``FLOPs/token × tokens / (GPUs × peak × MFU(micro-batch))`` — FLOPs per token 6N
  (Kaplan et al. 2020, arXiv 2001.08361, §2.1) unless given; the MFU curve measured by
  ``globalbatch probe`` (``--throughput probe.json``) or a labelled default.
* Data-parallel gradient all-reduce, α–β, as NCCL's tuning model (``src/graph/tuning.cc``,
  Simple protocol): ring ``2(n−1)/n·S/busbw`` plus ``base + (2(n−1) − 2(N−1))·α_intra +
  2(N−1)·α_net`` (Thakur et al. 2005 for the ring's α–β form; nccl-tests ``doc/PERFORMANCE.md``
  for the bus bandwidth), tree ``2S/(0.9·busbw)`` plus ``2((n/N − 1)·α_tree,intra +
  log2(N)·α_tree,net)``; the faster one is taken, as NCCL selects per size. Reduce-scatter and
  all-gather (ZeRO / FSDP): ring, ``(n−1)/n·S/busbw``. Inside a node the NVLink bus bandwidth,
  across nodes the network's.
* Overlap: the gradient communication hides behind the last micro-batch's backward (≈ 2/3 of its
  compute) times ``overlap`` (0…1), never below the last bucket's transfer (PyTorch DDP's 25 MB
  buckets).
* Pipeline bubble (GPipe/1F1B; Narayanan et al. 2021, arXiv 2104.04473 §2.2): ``(p − 1)/(v·m)`` of
  the ideal compute with m micro-batches per replica and step, v interleaved chunks.
* Per-step overhead: the optimizer step and the step's bookkeeping (gradient scaling, the clipping norm,
  zero_grad, the one host sync), outside forward and backward: measured (a throughput file's
  ``step_overhead_s`` at ``overhead_params`` parameters, scaled by the parameters the rank updates) or a
  labelled default, ``OPTIMIZER_BYTES_PER_PARAM`` bytes per updated parameter over the GPU's memory
  bandwidth (AdamW is memory-bound); with DP > 1 also StepDriver's two small all-reduces per step.
  DDP's gradient buckets (25 MB) are one all-reduce each: each pays the collective's latency.
* Data-parallel bookkeeping (DP > 1): what a data-parallel step costs beyond its collectives' α–β — the cluster's
  ``dp_call_overhead_s`` per collective of the step (each DDP bucket, each ZeRO/FSDP collective, StepDriver's small
  all-reduces: the wake-up of a rank that waits at a collective), ``dp_step_overhead_s`` once per step and
  ``dp_micro_overhead_s`` per micro-batch (DDP's reducer and hooks), ``dp_tensor_overhead_s`` per parameter tensor
  of the rank's model (``ModelSpec.param_tensors``; DDP's per-parameter autograd hook and bucket copy); measured
  for a cluster (zero-loss windows of
  modules without compute, DDP against no DP, ``benchmarks/scale_validation.py --measure-cluster``), 0 in the presets.
* TP is given: its communication is inside the MFU the curve states (not modelled separately).
* Memory bounds the micro-batch with the project's memory model (:mod:`globalbatch.plan.memory`).

Pure arithmetic; no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np

from globalbatch._util import SettingError
from globalbatch.plan.config import yaml_load_unique
from globalbatch.plan.memory import Activations, MemoryConfig, largest_micro_batch
from globalbatch.validate import whole

__all__ = ["Cluster", "PRESETS", "load_cluster", "cluster_from_mapping", "ThroughputCurve", "default_mfu_curve",
           "mfu_curve_from_probe", "ModelSpec", "allreduce_time", "ring_collective_time", "tree_allreduce_time", "dp_comm_time",
           "StepTime", "step_time", "largest_micro", "NCCL_BASE_LAT_S", "DDP_BUCKET_BYTES", "step_overhead_time",
           "dp_bookkeeping_time", "OPTIMIZER_BYTES_PER_PARAM", "DRIVER_STEP_COLLECTIVES"]

NCCL_BASE_LAT_S = 8.4e-6
"""NCCL tuning.cc ``baseLat`` of Ring/Simple (µs → s)."""
DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""PyTorch DDP's default ``bucket_cap_mb`` (25 MB): the last bucket is reduced after the backward ends."""
OPTIMIZER_BYTES_PER_PARAM = 32.0
"""Labelled default of the per-step overhead on a GPU (an assumption, not measured): AdamW with fp32 master
weights reads parameter, gradient and both moments (16 B) and writes parameter and moments (12 B) per
parameter, and the clipping norm reads the gradient once more (4 B): memory-bound, over the memory bandwidth."""
DRIVER_STEP_COLLECTIVES = 2
"""Small all-reduces StepDriver issues per step with DP > 1 (the window's counts and loss; the non-finite flag)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """One kind of GPU in nodes joined by a network. Bandwidths are NCCL *bus* bandwidths per GPU (bytes/s)."""

    name: str
    gpus_per_node: int
    """GPUs joined by NVLink (or shared memory) in one node."""
    peak_flops_per_s: float
    """Dense BF16 (or the precision trained in) peak FLOP/s of one GPU."""
    memory_bytes: float
    """Device memory of one GPU."""
    intra_busbw_bytes_per_s: float
    """All-reduce bus bandwidth inside a node (NVLink)."""
    inter_busbw_bytes_per_s: float
    """All-reduce bus bandwidth across nodes (the node's NICs; rail-optimised rings)."""
    base_latency_s: float = NCCL_BASE_LAT_S
    """Fixed latency of one collective (NCCL Ring/Simple baseLat 8.4 µs)."""
    intra_hop_latency_s: float = 3.4e-6
    """Latency per ring step inside a node (NCCL hwLat NVLink Ring/Simple 3.4 µs)."""
    inter_hop_latency_s: float = 9.6e-6
    """Latency per ring step across nodes (NCCL hwLat NET Ring/Simple 9.6 µs)."""
    tree_intra_latency_s: float = 28e-6
    """Tree latency per intra-node level (NCCL hwLat NVLink Tree/Simple 28 µs: a 256 kB chunk)."""
    tree_inter_latency_s: float = 50e-6
    """Tree latency per network level (NCCL hwLat NET Tree/Simple 50 µs)."""
    gpu_hour_price: Optional[float] = None
    """Price of one GPU-hour (any currency), when cost should be shown in money."""
    memory_bandwidth_bytes_per_s: Optional[float] = None
    """Device memory bandwidth: the default per-step optimizer overhead (None: no default overhead)."""
    dp_step_overhead_s: float = 0.0
    """Seconds a data-parallel optimizer step (DP > 1) costs beyond its collectives' α–β, once per step: DDP's
    reducer (armed in the forward, its autograd hooks, the bucket copies, the finalize) and the wake-ups of ranks
    that wait for each other at a collective inside a step, which an all-reduce timed after a barrier does not see.
    Measured as a zero-loss window of a one-parameter module under DDP minus the same window without DP, minus the
    window's collectives as this cluster models them (``benchmarks/scale_validation.py --measure-cluster``).
    0 in the presets: not measured on them; on a GPU the reducer's host work is issued ahead of the kernels."""
    dp_micro_overhead_s: float = 0.0
    """The same per micro-batch (DDP's forward hooks, ``no_sync``): measured from the windows with 4 and 1
    micro-batches; 0 in the presets."""
    dp_tensor_overhead_s: float = 0.0
    """The same per parameter tensor of a rank's model, once per step (DDP's per-parameter autograd hook, its copy
    into the bucket and back): measured from windows with 64 and 1 one-element parameters; charged for the
    model's ``param_tensors`` (per pipeline stage); 0 in the presets."""
    dp_call_overhead_s: float = 0.0
    """Seconds each collective of a data-parallel step costs beyond its α–β: a rank that reaches a collective first
    waits, and its wake-up is not in an all-reduce timed right after a barrier (α). Charged to every DDP gradient
    bucket, every ZeRO/FSDP collective and StepDriver's small all-reduces. Measured from zero-loss DDP windows of
    eight one-element parameters in eight buckets against one bucket; 0 in the presets (NCCL's α is its in-step
    latency)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        check_cluster(self)


_CLUSTER_ALLOWED = {
    "gpus_per_node": "a whole number ≥ 1",
    "peak_flops_per_s": "FLOP/s > 0, e.g. 989e12",
    "memory_bytes": "bytes > 0, e.g. 80e9",
    "intra_busbw_bytes_per_s": "bytes/s > 0, e.g. 370e9",
    "inter_busbw_bytes_per_s": "bytes/s > 0, e.g. 46e9",
    "base_latency_s": "seconds ≥ 0",
    "intra_hop_latency_s": "seconds ≥ 0",
    "inter_hop_latency_s": "seconds ≥ 0",
    "tree_intra_latency_s": "seconds ≥ 0",
    "tree_inter_latency_s": "seconds ≥ 0",
    "gpu_hour_price": "a price ≥ 0 or null",
    "memory_bandwidth_bytes_per_s": "bytes/s > 0 or null, e.g. 3.35e12",
    "dp_step_overhead_s": "seconds ≥ 0",
    "dp_micro_overhead_s": "seconds ≥ 0",
    "dp_call_overhead_s": "seconds ≥ 0",
    "dp_tensor_overhead_s": "seconds ≥ 0",
}


def _num_ok(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_cluster(c: Cluster) -> None:
    """Raise SettingError naming the first bad key."""
    if not isinstance(c.name, str) or not c.name:
        raise SettingError("name", c.name, "a non-empty name")
    g = c.gpus_per_node
    whole(g, "gpus_per_node", allowed=_CLUSTER_ALLOWED["gpus_per_node"])
    for key in ("peak_flops_per_s", "memory_bytes", "intra_busbw_bytes_per_s", "inter_busbw_bytes_per_s"):
        v = getattr(c, key)
        if not (_num_ok(v) and v > 0):
            raise SettingError(key, v, _CLUSTER_ALLOWED[key])
    for key in ("base_latency_s", "intra_hop_latency_s", "inter_hop_latency_s", "tree_intra_latency_s",
                "tree_inter_latency_s", "dp_step_overhead_s", "dp_micro_overhead_s",
                "dp_call_overhead_s", "dp_tensor_overhead_s"):
        v = getattr(c, key)
        if not (_num_ok(v) and v >= 0):
            raise SettingError(key, v, _CLUSTER_ALLOWED[key])
    if c.gpu_hour_price is not None and not (_num_ok(c.gpu_hour_price) and c.gpu_hour_price >= 0):
        raise SettingError("gpu_hour_price", c.gpu_hour_price, _CLUSTER_ALLOWED["gpu_hour_price"])
    bw = c.memory_bandwidth_bytes_per_s
    if bw is not None and not (_num_ok(bw) and bw > 0):
        raise SettingError("memory_bandwidth_bytes_per_s", bw, _CLUSTER_ALLOWED["memory_bandwidth_bytes_per_s"])


_H100_SRC = ("NVIDIA H100 datasheet (SXM: 989 TFLOPS dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s); NCCL all-reduce "
             "bus bandwidth ≈ 370 GB/s on 8 NVLink GPUs (without NVLink SHARP); InfiniBand NDR 400 Gb/s per GPU, "
             "≈ 46 GB/s per NIC measured with nccl-tests, 8 NICs per node (DGX SuperPOD rail-optimised): ring bus "
             "bandwidth across nodes min(NVLink, 8 × 46 GB/s); latencies from NCCL src/graph/tuning.cc (Simple)")
PRESETS: dict[str, Cluster] = {
    "h100-ib": Cluster(name="h100-ib", gpus_per_node=8, peak_flops_per_s=989e12, memory_bytes=80e9,
                       intra_busbw_bytes_per_s=370e9, inter_busbw_bytes_per_s=min(370e9, 8 * 46e9),
                       memory_bandwidth_bytes_per_s=3.35e12, source=_H100_SRC),
    "a100-ib": Cluster(name="a100-ib", gpus_per_node=8, peak_flops_per_s=312e12, memory_bytes=80e9,
                       intra_busbw_bytes_per_s=230e9, inter_busbw_bytes_per_s=min(230e9, 8 * 23e9),
                       memory_bandwidth_bytes_per_s=2.039e12,
                       source="NVIDIA A100 datasheet (SXM 80 GB: 312 TFLOPS dense BF16, 2.039 TB/s, NVLink 600 GB/s); "
                              "NCCL caps A100 bus bandwidth at 235 GB/s (tuning.cc compCap80); HDR InfiniBand "
                              "200 Gb/s per GPU ≈ 23 GB/s per NIC, 8 NICs per node; latencies from NCCL tuning.cc"),
    "h200-ib": Cluster(name="h200-ib", gpus_per_node=8, peak_flops_per_s=989e12, memory_bytes=141e9,
                       intra_busbw_bytes_per_s=370e9, inter_busbw_bytes_per_s=min(370e9, 8 * 46e9),
                       memory_bandwidth_bytes_per_s=4.8e12, source="NVIDIA H200 datasheet: the H100's compute (989 TFLOPS dense BF16) with 141 GB HBM3e at "
                              "4.8 TB/s; same NVLink and NDR network as h100-ib"),
}
"""Cluster presets (vendor figures; NCCL's own model values where no measurement is stated)."""


def cluster_from_mapping(data: Any, source: str) -> Cluster:
    """A Cluster from a mapping (a YAML file's content), validated key by key."""
    if not isinstance(data, dict):
        raise SettingError("cluster", source, "a YAML mapping of cluster keys (name, gpus_per_node, ...)")
    known = {f.name for f in fields(Cluster)}
    for key in data:
        if key not in known:
            raise SettingError(str(key), data[key], "one of " + ", ".join(sorted(known)),
                               why=f"unknown key in {source}")
    base: dict[str, Any] = {}
    required = ("gpus_per_node", "peak_flops_per_s", "memory_bytes", "intra_busbw_bytes_per_s",
                "inter_busbw_bytes_per_s")
    for key in required:
        if key not in data:
            raise SettingError(key, None, _CLUSTER_ALLOWED[key], why=f"missing in {source}")
    for key, v in data.items():
        if key in _CLUSTER_ALLOWED and key != "gpu_hour_price" and key != "gpus_per_node":
            if isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    raise SettingError(key, v, _CLUSTER_ALLOWED[key]) from None
        base[key] = v
    base.setdefault("name", Path(source).stem if source else "cluster")
    base.setdefault("source", f"file {source}")
    return Cluster(**base)


def load_cluster(spec: str) -> Cluster:
    """A preset name or a YAML file (safe loading that refuses duplicate keys and aliases, as ``plan --config``
    does; every key checked); errors name the key."""
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec)
    if not (spec.endswith((".yaml", ".yml")) and p.is_file()):
        raise SettingError("cluster", spec, "a preset (" + ", ".join(PRESETS) + ") or an existing FILE.yaml")
    import yaml

    try:
        text = p.read_text(encoding="utf-8")
        data = yaml_load_unique(text)  # a duplicate key would silently take its last value
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SettingError("cluster", spec, "a readable YAML file", why=" ".join(str(exc).split())[:160]) from None
    return cluster_from_mapping(data, spec)


# ---------------------------------------------------------------------------
# MFU as a function of the micro-batch
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ThroughputCurve:
    """MFU against tokens per micro-batch (per GPU), interpolated in log tokens and held flat beyond the ends."""

    tokens: tuple[float, ...]
    mfu: tuple[float, ...]
    source: str
    peak_flops_per_s: Optional[float] = None
    """The peak the MFU was measured against (a probe's), when known."""
    step_overhead_s: Optional[float] = None
    """Measured seconds per optimizer step outside forward and backward on one rank that updates all
    ``overhead_params`` parameters (optimizer step, gradient scaling, clipping norm, zero_grad, host sync);
    None: the cluster's labelled default."""
    overhead_params: Optional[float] = None
    """The parameter count ``step_overhead_s`` was measured at (it is scaled by the parameters a rank updates)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.mfu) or not self.tokens:
            raise SettingError("throughput", self.source, "at least one (tokens, MFU) point")
        if (self.step_overhead_s is None) != (self.overhead_params is None):
            raise SettingError("throughput", self.source, "step_overhead_s and overhead_params together")
        so, op = self.step_overhead_s, self.overhead_params
        if so is not None and not (_num_ok(so) and so >= 0 and op is not None and _num_ok(op) and op >= 1):
            raise SettingError("throughput", self.source, "step_overhead_s ≥ 0 seconds and overhead_params ≥ 1",
                               why=f"{self.step_overhead_s!r} s at {self.overhead_params!r} parameters")
        for t, m in zip(self.tokens, self.mfu):
            if not (_num_ok(t) and t > 0 and _num_ok(m) and 0 < m <= 1):
                raise SettingError("throughput", self.source, "points with tokens > 0 and 0 < MFU ≤ 1",
                                   why=f"point ({t}, {m})")

    def at(self, tokens_per_micro: np.ndarray | float) -> np.ndarray:
        x = np.log(np.asarray(tokens_per_micro, dtype=float))
        xs = np.log(np.asarray(self.tokens, dtype=float))
        order = np.argsort(xs)
        return np.interp(x, xs[order], np.asarray(self.mfu, dtype=float)[order])


def default_mfu_curve(mfu_max: float = 0.45, half_tokens: float = 1024.0) -> ThroughputCurve:
    """A labelled default, not a measurement: ``MFU = mfu_max·t/(t + half_tokens)`` at t tokens per micro-batch
    (saturating; 45 % is near the 38–43 % BF16 MFU Llama 3 405B reports, arXiv 2407.21783 Table 4)."""
    ts = np.geomspace(64, 2 ** 20, 15)
    return ThroughputCurve(tokens=tuple(float(t) for t in ts), mfu=tuple(float(mfu_max * t / (t + half_tokens)) for t in ts),
                           source=f"default: MFU = {mfu_max:g}·t/(t + {half_tokens:g}) (labelled assumption, not measured)")


def mfu_curve_from_probe(path: str) -> ThroughputCurve:
    """The MFU per micro-batch of a ``globalbatch probe --json`` output (its trials with a timing and an MFU).

    The curve is of forward and backward alone (the per-step overhead is its own term): a trial's
    ``forward_backward_s`` (the probe's timed steps split after the backward, in place) gives
    ``mfu × step_time_s / forward_backward_s``. For a probe file without it, the optional top-level
    ``optimizer_step_s`` (the optimizer's ``step(); zero_grad()``, measured separately) is removed from every
    trial's time instead (``mfu × t/(t − optimizer_step_s)``); without either, the whole step is the compute.
    ``step_overhead_s`` with ``overhead_params``: the per-step overhead (see :class:`ThroughputCurve`);
    ``benchmarks/scale_validation.py`` writes these top-level keys. Without them, a probe file with the split
    and the model's ``params`` gives the overhead itself: the median over its trials of the rest of a step
    (``step_time_s − forward_backward_s``: the optimizer's ``step(); zero_grad()`` timed in place) at ``params``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SettingError("throughput", path, "a readable probe --json file", why=" ".join(str(exc).split())[:120]) from None
    trials = data.get("trials") if isinstance(data, dict) else None
    if not isinstance(trials, list):
        raise SettingError("throughput", path, "a probe --json file (with 'trials')")
    extra: dict[str, Any] = {}
    for key in ("optimizer_step_s", "step_overhead_s", "overhead_params"):
        v = data.get(key)
        if v is not None and not (_num_ok(v) and v >= 0):
            raise SettingError("throughput", path, "a probe --json file", why=f"{key} is {v!r}, not a number ≥ 0")
        extra[key] = None if v is None else float(v)
    opt_s = extra["optimizer_step_s"] or 0.0
    pts: dict[float, float] = {}
    in_place: list[float] = []  # the rest of each split trial's step: its optimizer step, timed in place
    for i, t in enumerate(trials):
        # every entry checked, not skipped: a damaged file is refused, never read as if fine
        if not isinstance(t, dict):
            raise SettingError("throughput", path, "a probe --json file", why=f"trials[{i}] is not a JSON object")
        for key in ("tokens_per_step", "mfu"):
            v = t.get(key)
            if v is not None and not (_num_ok(v) and v >= 0):
                raise SettingError("throughput", path, "a probe --json file", why=f"trials[{i}].{key} is {v!r}, not a number ≥ 0")
        if t.get("oom"):
            continue
        tok: Any = t.get("tokens_per_step")
        mfu: Any = t.get("mfu")
        fb_s: Any = t.get("forward_backward_s")
        step_s: Any = t.get("step_time_s")
        if fb_s is not None and mfu is not None:
            if not (_num_ok(fb_s) and _num_ok(step_s) and 0 < fb_s <= step_s):
                raise SettingError("throughput", path, "a probe --json file",
                                   why=f"trials[{i}].forward_backward_s is {fb_s!r}, not in (0, step_time_s {step_s!r}]")
            mfu = mfu * step_s / fb_s
            in_place.append(step_s - fb_s)
        elif opt_s and mfu is not None:
            if not (_num_ok(step_s) and step_s > opt_s):
                raise SettingError("throughput", path, "trials timed longer than optimizer_step_s",
                                   why=f"trials[{i}].step_time_s is {step_s!r}, optimizer_step_s {opt_s!r}")
            mfu = mfu * step_s / (step_s - opt_s)
        if mfu is not None and not tok:
            raise SettingError("throughput", path, "a probe --json file",
                               why=f"trials[{i}] has an MFU but tokens_per_step {tok!r} (the curve is in tokens)")
        if tok is not None and mfu is not None and tok > 0 and 0 < mfu <= 1:
            pts[float(tok)] = float(mfu)
    if not pts:
        raise SettingError("throughput", path, "a probe output with timed trials and an MFU (a known peak)")
    ks = sorted(pts)
    peak = data.get("peak_flops_per_s")
    source = f"probe {path}"
    params = data.get("params")
    if params is not None and not (_num_ok(params) and params >= 1):
        raise SettingError("throughput", path, "a probe --json file", why=f"params is {params!r}, not a number ≥ 1")
    if extra["step_overhead_s"] is None and in_place and params is not None:
        opt_in_place = float(np.median(in_place))
        extra["step_overhead_s"], extra["overhead_params"] = opt_in_place, float(params)
        source += (f" (per-step overhead: its optimizer step timed in place, median {opt_in_place * 1e3:.3g} ms "
                   f"at {params:,} parameters)")
    return ThroughputCurve(tokens=tuple(ks), mfu=tuple(pts[k] for k in ks), source=source,
                           peak_flops_per_s=float(peak) if _num_ok(peak) and peak > 0 else None,
                           step_overhead_s=extra["step_overhead_s"], overhead_params=extra["overhead_params"])


# ---------------------------------------------------------------------------
# The model being trained
# ---------------------------------------------------------------------------

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What the step time and the memory depend on."""

    params: float
    """Trainable parameters N."""
    seq_len: int
    """Token slots per sequence."""
    tokens_per_sequence: Optional[float] = None
    """Loss-bearing tokens per sequence (the convergence fit's unit); default ``seq_len``."""
    flops_per_token: Optional[float] = None
    """Training FLOPs per token; default 6N (Kaplan et al. 2020 §2.1)."""
    grad_bytes_per_param: float = 2.0
    """Bytes of one gradient element on the wire (2: bf16)."""
    precision: str = "bf16-mixed"
    """The memory model's precision (fp32 or bf16-mixed)."""
    optimizer: str = "adamw"
    sharding: str = "none"
    """none (DDP all-reduce), zero1, zero2, zero3 or fsdp (reduce-scatter + all-gather)."""
    reshard_after_forward: bool = True
    """zero3/fsdp: gather the weights again in the backward (two all-gathers per step)."""
    activation_bytes_per_token: Optional[float] = None
    """Activation bytes per token of the whole model at TP 1 (None: only the static memory is checked)."""
    virtual_stages: int = 1
    """Interleaved chunks per pipeline stage (v)."""
    layers: Optional[int] = None
    """Transformer layers: PP ≤ layers (None: not checked)."""
    param_tensors: Optional[int] = None
    """Parameter tensors of the whole model (weights and biases counted apart), for the cluster's
    ``dp_tensor_overhead_s`` (None: not charged)."""

    def __post_init__(self) -> None:
        if not (_num_ok(self.params) and self.params >= 1):
            raise SettingError("params", self.params, "a number of parameters ≥ 1")
        whole(self.seq_len, "seq_len")
        if self.tokens_per_sequence is not None and not (_num_ok(self.tokens_per_sequence)
                                                         and 0 < self.tokens_per_sequence <= self.seq_len):
            raise SettingError("tokens_per_sequence", self.tokens_per_sequence, f"a number in (0, {self.seq_len}]")
        if self.flops_per_token is not None and not (_num_ok(self.flops_per_token) and self.flops_per_token > 0):
            raise SettingError("flops_per_token", self.flops_per_token, "FLOPs > 0")
        if self.sharding not in SHARDINGS:
            raise SettingError("sharding", self.sharding, ", ".join(SHARDINGS))
        if self.activation_bytes_per_token is not None and not (_num_ok(self.activation_bytes_per_token)
                                                                and self.activation_bytes_per_token > 0):
            raise SettingError("activation_bytes_per_token", self.activation_bytes_per_token, "bytes > 0")
        whole(self.virtual_stages, "virtual_stages")
        if self.layers is not None:
            whole(self.layers, "layers")
        if self.param_tensors is not None:
            whole(self.param_tensors, "param_tensors")

    @property
    def tokens_per_seq(self) -> float:
        return float(self.tokens_per_sequence if self.tokens_per_sequence is not None else self.seq_len)

    @property
    def train_flops_per_token(self) -> float:
        return float(self.flops_per_token if self.flops_per_token is not None else 6.0 * self.params)


# ---------------------------------------------------------------------------
# Collectives (α–β, NCCL's model)
# ---------------------------------------------------------------------------


def _busbw(c: Cluster, nodes: int) -> float:
    return c.intra_busbw_bytes_per_s if nodes <= 1 else min(c.intra_busbw_bytes_per_s, c.inter_busbw_bytes_per_s)


def ring_collective_time(size_bytes: float, ranks: int, nodes: int, c: Cluster, *, kind: str = "allreduce") -> float:
    """Ring all-reduce (``kind="allreduce"``: 2(n−1) steps) or reduce-scatter / all-gather (n−1 steps) of
    ``size_bytes`` over ``ranks`` GPUs on ``nodes`` nodes."""
    n, N = int(ranks), max(int(nodes), 1)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    f = 2 if kind == "allreduce" else 1
    steps, inter = f * (n - 1), f * (N - 1)
    lat = c.base_latency_s + (steps - inter) * c.intra_hop_latency_s + inter * c.inter_hop_latency_s
    return lat + f * (n - 1) / n * size_bytes / _busbw(c, N)


def tree_allreduce_time(size_bytes: float, ranks: int, nodes: int, c: Cluster) -> float:
    """NCCL's double binary tree: ``2((n/N − 1)·α_intra + log2(N)·α_net)`` + ``2S/(0.9·busbw)``."""
    n, N = int(ranks), max(int(nodes), 1)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    per_node = max(n // N, 1)
    lat = 2 * ((per_node - 1) * c.tree_intra_latency_s + math.log2(N) * c.tree_inter_latency_s)
    return lat + 2 * size_bytes / (0.9 * _busbw(c, N))


def allreduce_time(size_bytes: float, ranks: int, nodes: int, c: Cluster) -> tuple[float, str]:
    """The faster of ring and tree (NCCL picks per size), with its name."""
    ring = ring_collective_time(size_bytes, ranks, nodes, c)
    tree = tree_allreduce_time(size_bytes, ranks, nodes, c)
    return (ring, "ring") if ring <= tree else (tree, "tree")


def dp_comm_time(model: ModelSpec, c: Cluster, *, dp: int, tp: int, pp: int) -> tuple[float, str]:
    """Seconds of data-parallel gradient communication per optimizer step (one sync per step: no_sync during
    accumulation), and how it was done. TP ranks sit inside a node and the DP group next to them (Megatron's
    order), so a DP group spans ``ceil(dp / (gpus_per_node / tp))`` nodes."""
    if dp <= 1:
        return 0.0, "none"
    shard = model.params / (tp * pp) * model.grad_bytes_per_param
    per_node = max(c.gpus_per_node // tp, 1)
    nodes = math.ceil(dp / per_node)
    if model.sharding == "none":  # DDP: one all-reduce per 25 MB bucket, each paying the collective's latency
        buckets = max(math.ceil(shard / DDP_BUCKET_BYTES), 1)
        t, how = allreduce_time(shard / buckets, dp, nodes, c)
        return buckets * (t + c.dp_call_overhead_s), f"all-reduce ({how}, {buckets} bucket{'s' if buckets > 1 else ''})"
    rs = ring_collective_time(shard, dp, nodes, c, kind="reducescatter")
    ag = ring_collective_time(shard, dp, nodes, c, kind="allgather")
    n_ag = 2 if model.sharding in ("zero3", "fsdp") and model.reshard_after_forward else 1
    return rs + n_ag * ag + (1 + n_ag) * c.dp_call_overhead_s, f"reduce-scatter + {n_ag} all-gather (ring)"


def dp_bookkeeping_time(c: Cluster, *, dp: int, grad_accum_steps: Any = 1, param_tensors: float = 0.0) -> Any:
    """What a data-parallel step costs beyond its collectives' α–β: ``dp_step_overhead_s + grad_accum_steps ·
    dp_micro_overhead_s + param_tensors · dp_tensor_overhead_s`` of the cluster with DP > 1, else 0
    (``grad_accum_steps`` may be an array; ``param_tensors``: the parameter tensors of one rank's model)."""
    if dp <= 1:
        return 0.0 * grad_accum_steps
    return c.dp_step_overhead_s + c.dp_micro_overhead_s * grad_accum_steps + c.dp_tensor_overhead_s * param_tensors


def rank_param_tensors(model: "ModelSpec", pp: int) -> float:
    """Parameter tensors of one rank's model: the model's ``param_tensors`` over the pipeline stages (TP shards each
    tensor, it does not remove any); 0 when not given."""
    return math.ceil(model.param_tensors / pp) if model.param_tensors else 0.0


def step_overhead_time(model: ModelSpec, c: Cluster, curve: ThroughputCurve, *, dp: int, tp: int, pp: int) -> float:
    """Seconds per optimizer step outside forward, backward and the gradient communication: the optimizer step and
    its bookkeeping on the parameters this rank updates (``N/(tp·pp)``; ``/dp`` more with ZeRO / FSDP, whose ranks
    update their shard), measured (``curve.step_overhead_s`` scaled from ``curve.overhead_params``) or the labelled
    default ``OPTIMIZER_BYTES_PER_PARAM`` / memory bandwidth (0 when the cluster states none); with DP > 1 plus
    StepDriver's ``DRIVER_STEP_COLLECTIVES`` small all-reduces (the collective's latency and the cluster's
    ``dp_call_overhead_s``). The data-parallel bookkeeping per step and micro-batch is :func:`dp_bookkeeping_time`."""
    updated = model.params / (tp * pp) / (dp if model.sharding != "none" else 1)
    if curve.step_overhead_s is not None and curve.overhead_params:
        t = curve.step_overhead_s * updated / curve.overhead_params
    elif c.memory_bandwidth_bytes_per_s:
        t = OPTIMIZER_BYTES_PER_PARAM * updated / c.memory_bandwidth_bytes_per_s
    else:
        t = 0.0
    if dp > 1:
        nodes = math.ceil(dp / max(c.gpus_per_node // tp, 1))
        t += DRIVER_STEP_COLLECTIVES * (allreduce_time(8.0 * 5, dp, nodes, c)[0] + c.dp_call_overhead_s)  # 5 float64
    return t


# ---------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------


def largest_micro(model: ModelSpec, c: Cluster, *, dp: int, tp: int, pp: int) -> int:
    """The largest micro-batch (sequences) that fits one GPU (project memory model); 0: none fits; a large
    number when no activation size is given and the static bytes fit."""
    cfg = MemoryConfig(params=max(int(round(model.params / (tp * pp))), 1), optimizer=model.optimizer,
                       precision=model.precision, sharding=model.sharding, dp_world_size=max(dp, 1))
    if model.activation_bytes_per_token is None:
        acts = Activations(bytes_per_sample=1.0, source="not given")
        m = largest_micro_batch(cfg, acts, c.memory_bytes)
        return 0 if m == 0 else 1 << 30
    acts = Activations(bytes_per_sample=model.activation_bytes_per_token * model.seq_len / tp, source="given")
    return largest_micro_batch(cfg, acts, c.memory_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """One optimizer step of one geometry."""

    gpus: int
    global_batch: int
    """Sequences per step."""
    micro_batch: int
    grad_accum_steps: int
    dp: int
    tp: int
    pp: int
    compute_s: float
    comm_exposed_s: float
    bubble_s: float
    comm_total_s: float
    comm_how: str
    mfu_kernel: float
    """MFU of the micro-batch's kernels (the curve)."""
    overhead_s: float = 0.0
    """Per-step overhead outside forward and backward (:func:`step_overhead_time` + :func:`dp_bookkeeping_time`)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s + self.overhead_s

    def mfu(self) -> float:
        """Achieved MFU: the kernel MFU × compute share of the step."""
        return self.mfu_kernel * self.compute_s / self.total_s if self.total_s > 0 else 0.0

    def geometry(self) -> str:
        return (f"{self.global_batch:,} seq = {self.micro_batch} micro × {self.grad_accum_steps} accum × "
                f"DP {self.dp} (TP {self.tp}, PP {self.pp})")

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "grad_accum_steps": self.grad_accum_steps, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "compute_s": self.compute_s, "comm_exposed_s": self.comm_exposed_s, "bubble_s": self.bubble_s,
                "comm_total_s": self.comm_total_s, "comm": self.comm_how, "overhead_s": self.overhead_s,
                "step_s": self.total_s,
                "mfu": self.mfu(), "mfu_kernel": self.mfu_kernel}


def step_time(model: ModelSpec, c: Cluster, curve: ThroughputCurve, *, micro_batch: int, grad_accum_steps: int,
              dp: int, tp: int = 1, pp: int = 1, overlap: float = 1.0, peak_flops_per_s: Optional[float] = None) -> StepTime:
    """The step time of one geometry (``global = micro × accum × dp`` sequences on ``dp·tp·pp`` GPUs)."""
    gpus = dp * tp * pp
    gb = micro_batch * grad_accum_steps * dp
    peak = peak_flops_per_s if peak_flops_per_s is not None else c.peak_flops_per_s
    mfu_k = float(curve.at(micro_batch * model.seq_len))
    flops = model.train_flops_per_token * gb * model.seq_len
    compute = flops / (gpus * peak * mfu_k)
    bubble = compute * (pp - 1) / (model.virtual_stages * grad_accum_steps) if pp > 1 else 0.0
    comm, how = dp_comm_time(model, c, dp=dp, tp=tp, pp=pp)
    exposed = _exposed(comm, compute, grad_accum_steps, model, overlap, tp * pp)
    return StepTime(gpus=gpus, global_batch=gb, micro_batch=micro_batch, grad_accum_steps=grad_accum_steps, dp=dp,
                    tp=tp, pp=pp, compute_s=compute, comm_exposed_s=exposed, bubble_s=bubble, comm_total_s=comm,
                    comm_how=how, mfu_kernel=mfu_k,
                    overhead_s=step_overhead_time(model, c, curve, dp=dp, tp=tp, pp=pp)
                    + dp_bookkeeping_time(c, dp=dp, grad_accum_steps=grad_accum_steps,
                                          param_tensors=rank_param_tensors(model, pp)))


def _exposed(comm: float, compute: float, accum: int, model: ModelSpec, overlap: float, model_parallel: int) -> float:
    """Communication left after the overlap window: the last micro-batch's backward (2/3 of its compute; its whole
    compute for zero3/fsdp, whose all-gathers prefetch in the forward too), never less than the last bucket."""
    if comm <= 0:
        return 0.0
    per_micro = compute / accum
    window = per_micro * (1.0 if model.sharding in ("zero3", "fsdp") else 2.0 / 3.0) * overlap
    shard_bytes = model.params / model_parallel * model.grad_bytes_per_param
    last_bucket = comm * min(1.0, DDP_BUCKET_BYTES / shard_bytes) if overlap > 0 else comm
    return max(comm - window, last_bucket)


def step_times_grid(model: ModelSpec, c: Cluster, curve: ThroughputCurve, *, dp: int, tp: int, pp: int,
                    micro: np.ndarray, accum: np.ndarray, overlap: float, comm: tuple[float, str],
                    peak_flops_per_s: Optional[float] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised :func:`step_time` over arrays of (micro, accum) at one (dp, tp, pp): compute, bubble, exposed, mfu_k."""
    gpus = dp * tp * pp
    peak = peak_flops_per_s if peak_flops_per_s is not None else c.peak_flops_per_s
    mfu_k = curve.at(micro * model.seq_len)
    gb = micro * accum * dp
    compute = model.train_flops_per_token * gb * model.seq_len / (gpus * peak * mfu_k)
    bubble = compute * (pp - 1) / (model.virtual_stages * accum) if pp > 1 else np.zeros_like(compute)
    t_comm = comm[0]
    if t_comm <= 0:
        exposed = np.zeros_like(compute)
    else:
        per_micro = compute / accum
        window = per_micro * (1.0 if model.sharding in ("zero3", "fsdp") else 2.0 / 3.0) * overlap
        shard_bytes = model.params / (tp * pp) * model.grad_bytes_per_param
        last = t_comm * min(1.0, DDP_BUCKET_BYTES / shard_bytes) if overlap > 0 else t_comm
        exposed = np.maximum(t_comm - window, last)
    return compute, bubble, exposed, mfu_k

