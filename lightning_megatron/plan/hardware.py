"""The machines the planner predicts for: every constant the step-time and memory predictions assume.

A GPU is its dense peak in the training dtype, its memory, its memory bandwidth and the bandwidth of
its links: NVLink inside a node (the tensor-parallel and context-parallel groups, and data-parallel
groups that fit in a node) and the network between nodes (the per-GPU share of the node's InfiniBand
adapters: every GPU of a node talks to other nodes at once). Two efficiencies turn peaks into what
kernels sustain: ``matmul_efficiency`` (the fraction of the dense peak that large transformer GEMMs
reach) and ``memory_efficiency`` (of the memory bandwidth, for element-wise kernels). Link bandwidths
are NCCL *bus* bandwidths (``nccl-tests``' ``busbw``), so that a ring all-reduce of ``n`` bytes over
``k`` ranks takes ``2 (k - 1) / k * n / bandwidth`` and an all-gather or reduce-scatter half that.

=========  ============  ======  =========  =========  ==========  =====================================  ===  ======
preset     bf16 (fp32)   memory  HBM        NVLink     network     node                                   SMs  FP8
           TFLOP/s       GB      GB/s       busbw GB/s per GPU GB/s                                            TFLOP/s
=========  ============  ======  =========  =========  ==========  =====================================  ===  ======
v100       125 (15.7)    32      900        115        6.25        DGX-2H: 16 GPUs, 8 x 100 Gb/s IB       80   -
a100       312 (19.5)    80      2039       230        25          DGX A100: 8 GPUs, 8 x 200 Gb/s IB      108  -
h100       989 (67)      80      3350       370        50          DGX H100: 8 GPUs, 8 x 400 Gb/s IB      132  1979
h200       989 (67)      141     4800       370        50          DGX H200: 8 GPUs, 8 x 400 Gb/s IB      132  1979
a100-40gb  312 (19.5)    40      1555       230        25          DGX A100 320GB: 8 GPUs                 108  -
a10        125 (31.2)    24      600        20         1.56        8 GPUs, PCIe 4.0, 100 Gb/s Ethernet    72   -
l4         121 (30.3)    24      300        20         1.56        8 GPUs, PCIe 4.0, 100 Gb/s Ethernet    58   242
rtx-4090   165 (82.6)    24      1008       20         0.31        workstation: 4 GPUs, 10 Gb/s Ethernet  128  330
a6000      155 (38.7)    48      768        20         0.31        workstation: 4 GPUs, 10 Gb/s Ethernet  84   -
l40s       362 (91.6)    48      864        20         6.25        8 GPUs, PCIe 4.0, 400 Gb/s Ethernet    142  733
=========  ============  ======  =========  =========  ==========  =====================================  ===  ======

Sources: the peaks, memories, bandwidths and SM counts are NVIDIA's data sheets and architecture whitepapers (V100:
125 TFLOP/s fp16 tensor, 900 GB/s, 80 SMs; A100 80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s, 108 SMs; H100 SXM:
989 TFLOP/s bf16 and 1,979 FP8 dense, 3.35 TB/s, 132 SMs; H200 SXM: H100's chip with 141 GB at 4.8 TB/s) and the
DGX system guides for the node networks. The V100 keeps fp16 as its 16-bit dtype (it has no bf16); V100 and A100
have no FP8 tensor cores. NVLink bus bandwidths are below the links' nominal per-direction rates (V100 150, A100
300, H100/H200 450 GB/s), at what NCCL's all-reduce sustains for large messages; the network figures are the
adapters' nominal rates per GPU.

The smaller GPUs, for fine-tuning on one GPU or a few (``--gpu rtx-4090``; ``--gpu-memory`` alone keeps the A100's
rates and says so), from NVIDIA's data sheets, dense (without structured sparsity) 16-bit tensor rates with fp32
accumulation: A100 40GB SXM 312 TFLOP/s, 1,555 GB/s (A100 data sheet); A10 125 TFLOP/s bf16, 31.2 fp32, 600 GB/s,
72 SMs (A10 data sheet: 250 with sparsity); L4 121 bf16 and 242 FP8 (data sheet: 242 and 485 with sparsity), 30.3
fp32, 300 GB/s, 58 SMs; GeForce RTX 4090 165.2 bf16 (fp32 accumulation runs at half the fp16-accumulate rate on
GeForce), 330 FP8 with fp32 accumulation, 82.6 fp32, 1,008 GB/s, 128 SMs (Ada Lovelace architecture whitepaper,
appendix table); RTX A6000 154.8 bf16 (data sheet: 309.7 with sparsity), 38.7 fp32, 768 GB/s, 84 SMs; L40S 362
bf16 and 733 FP8 (data sheet: 733 and 1,466 with sparsity), 91.6 fp32, 864 GB/s, 142 SMs. None has NVLink between
more than two cards (A6000's bridge pairs two), so their ``nvlink`` is GPU-to-GPU over PCIe 4.0 (an assumed 20 GB/s
bus bandwidth, below the x16 link's 25 GB/s one way); their nodes and networks are assumptions (cloud servers of 8
A10 or L4 GPUs on 100 Gb/s Ethernet, of 8 L40S on 400 Gb/s, workstations of 4 GeForce or A6000 cards on 10 Gb/s),
their host RAM and disk defaults are those of such machines (``--host-memory`` and ``--disk`` say yours), and their
efficiencies are uncalibrated: the A100's (``matmul_efficiency`` 0.781, attention 0.5) are assumed, so their step
times are rough. AWS's A10G is not an A10 (its data sheet is not public): it is not in the catalogue.

The efficiencies turn peaks into rates. ``matmul_efficiency`` is what large GEMMs sustain, calibrated on one
published run per GPU (``benchmarks/memory/planner.py``'s ``CALIBRATIONS``, which recomputes each): V100's on the
Megatron-LM paper's single-GPU baseline (the 1.2B GPT at 39 TFLOP/s on one V100 of a DGX-2H; Shoeybi et al.
2019), A100's on the Megatron-LM README's 1.7B GPT on 32 A100s without model parallelism (137 TFLOP/s per GPU,
counting recomputation; Narayanan et al. 2021), H100's on torchtitan's Llama-3.1-8B FSDP run on 8 H100s (5,762
tokens/s/GPU, bf16, eager). Smaller GEMMs reach less of it by their shapes (``plan.gemm``: wave quantization over
the SMs, no constant of its own). The H100 calibration is a whole PyTorch-eager stack's: everything the roofline
does not itemise (kernel launches, unfused element-wise kernels beyond the modelled bytes) is in it, so it is low
(0.424) next to what cuBLAS reaches on one large GEMM; the H200 is H100's chip and takes its calibration.
``fp8_efficiency`` (of the FP8 peak, for the linears under ``Workload.fp8``, their scaling casts included) is an
assumption: FP8 GEMMs reach the same fraction of their doubled peak as 16-bit ones (checked on torchtitan's 70B
FP8 run). ``attention_efficiency`` (flash attention's kernels, forward and backward together) is published: 0.5
on V100/A100, the lower end of FlashAttention-2's 50-73% of peak on A100 (Dao 2023); 0.35 on H100/H200, what
FlashAttention-2 reaches there (Shah et al. 2024, FlashAttention-3). ``overlap_efficiency`` (0.5: a collective
overlapped with compute hides behind half of that compute; NCCL's kernels take SMs and memory bandwidth from it) is
fitted to Narayanan et al. 2021's table 2, GPT-3 175B under ZeRO-3 without model parallelism on 384, 768 and 1536
A100s (144, 88 and 44 TFLOP/s per GPU), the runs whose time is most communication. ``memory_efficiency`` (0.7 of
HBM for element-wise kernels) is an assumption. ``--gpu custom:...`` sets any of them.

**The software stack is part of the calibration.** ``h100`` is the PyTorch-eager stack this package runs (and
torchtitan's). ``h100-te`` is the same GPU under Megatron-Core with Transformer Engine (fused kernels, cuDNN
attention, TE's FP8 GEMMs): for predicting that stack's published runs, and for ``--gpu h100-te`` when asking
what such a stack would reach. Its ``matmul_efficiency`` (and ``fp8_efficiency``, the same fraction of the FP8
peak) is calibrated on Megatron Bridge's Llama-3-8B FP8 run on 8 H100s (744 model TFLOP/s/GPU; ``CALIBRATIONS``);
its ``attention_efficiency`` 0.5 is an assumption: cuDNN's fused attention backward at head dim 128 and sequence
8k runs at 518 TFLOP/s on an H100 SXM (52% of peak; Shah et al. 2024, FlashAttention-3, figure of backward
speeds), its forward faster, causal masking somewhat slower.

**The host, for the offload tiers** (``offload_optimizer``/``offload_parameters`` ``"cpu"``/``"nvme"``): each
GPU's PCIe link (``host_bandwidth``, one direction, what a pinned ``cudaMemcpy`` sustains: about 80% of the
nominal x16 rate, PCIe 3.0 16, 4.0 32, 5.0 64 GB/s: 12, 25 and 50 GB/s; V100 of a DGX-2H: 3.0, A100: 4.0,
H100/H200: 5.0), and per node the CPUs' Adam (``host_optimizer_rate``: 1e9 fp32 elements per second for all
the node's ranks together, Adam's ~36 bytes per element at ~36 GB/s of sustained host-memory bandwidth, a few
DDR channels), its RAM (``host_memory_bytes``) and its NVMe disk (``disk_bytes``; ``disk_read_bandwidth``
6.5 GB/s and ``disk_write_bandwidth`` 5 GB/s: a typical PCIe 4.0 NVMe drive's sequential rates, one drive).
RAM and disk default to the DGX node's (DGX-2H 1.5 TB RAM, 30 TB NVMe; DGX A100 80GB, DGX H100/H200 2 TB RAM,
30 TB NVMe; DGX A100 320GB 1 TB, 15 TB; the PCIe GPUs' assumed servers 1 TB, 4 TB and workstations 128 GB, 2 TB); a
machine says its own with ``--host-memory`` and ``--disk``. All of these are uncalibrated
data-sheet or assumed numbers: ``benchmarks/gpu_check.sh`` (host<->device copies, a CPU Adam step) and a disk
benchmark (``fio`` sequential read and write on the ``offload_path`` disk) should replace them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Optional

GB = 10**9
GIB = 2**30
TFLOPS = 10**12


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the node it sits in (see the module docstring for every number's source)."""

    name: str
    peak_flops: float  # dense, in the 16-bit training dtype
    peak_fp32_flops: float
    memory_bytes: int
    memory_bandwidth: float  # bytes/s of HBM
    intra_node_bandwidth: float  # NCCL bus bandwidth inside a node, bytes/s
    inter_node_bandwidth: float  # per GPU, between nodes, bytes/s
    gpus_per_node: int
    matmul_efficiency: float  # of peak_flops, for large transformer GEMMs
    memory_efficiency: float = 0.7  # of memory_bandwidth, for element-wise kernels
    overlap_efficiency: float = 0.5  # of the compute a collective runs under, the share that hides it
    attention_efficiency: float = 0.5  # of peak_flops, for flash attention's fused kernels (forward + backward)
    streaming_multiprocessors: int = 108  # the waves a GEMM's tiles run in (plan.gemm)
    peak_fp8_flops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 GEMMs (before Hopper)
    fp8_efficiency: float = 0.5  # of peak_fp8_flops, for large FP8 GEMMs with their scaling and casts
    collective_latency: float = 20e-6  # seconds a collective costs besides its bytes
    host_bandwidth: float = 12 * GB  # PCIe per GPU, one direction, bytes/s (the offload tiers)
    host_optimizer_rate: float = 1e9  # fp32 elements per second the node's CPUs step Adam on (all its ranks)
    host_memory_bytes: int = 2000 * GB  # RAM of a node
    disk_bytes: int = 30 * 10**12  # free NVMe of a node (the "nvme" tier's files)
    disk_read_bandwidth: float = 6.5 * GB  # of a node's NVMe, sequential, bytes/s
    disk_write_bandwidth: float = 5 * GB

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in ("name", "peak_fp8_flops") and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"Hardware.{field.name} must be a positive number, got {value!r}.")
        if not isinstance(self.peak_fp8_flops, (int, float)) or self.peak_fp8_flops < 0:
            raise ValueError(f"Hardware.peak_fp8_flops must be >= 0 (0: no FP8), got {self.peak_fp8_flops!r}.")
        for name in ("matmul_efficiency", "memory_efficiency", "overlap_efficiency", "attention_efficiency",
                     "fp8_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"Hardware.{name} is a fraction of the peak (at most 1), got {getattr(self, name)}.")

    def peak(self, sixteen_bit: bool) -> float:
        """The dense peak in the training dtype (fp32 runs at the fp32 peak): what MFU divides by."""
        return self.peak_flops if sixteen_bit else self.peak_fp32_flops

    def flops(self, sixteen_bit: bool) -> float:
        """What large GEMMs sustain in the training dtype."""
        return self.peak(sixteen_bit) * self.matmul_efficiency

    def fp8_flops(self) -> float:
        """What large FP8 GEMMs sustain (their per-tensor scaling and casts included)."""
        if not self.peak_fp8_flops:
            raise ValueError(f"{self.name} has no FP8 tensor cores (peak_fp8_flops=0): plan without fp8, or give "
                             f"the GPU's FP8 peak (--gpu custom:fp8peak=TFLOPS,...).")
        return self.peak_fp8_flops * self.fp8_efficiency


#: Calibrated on torchtitan's Llama-3.1-8B FSDP run (benchmarks/memory/planner.py, ``CALIBRATIONS["h100"]``); FP8
#: GEMMs are assumed to reach the same fraction of their (twice as high) peak.
H100_EFFICIENCY = 0.424
GPUS: dict[str, Hardware] = {
    "v100": Hardware("v100", 125 * TFLOPS, 15.7 * TFLOPS, 32 * GB, 900 * GB, 115 * GB, 6.25 * GB, 16,
                     matmul_efficiency=0.471, host_memory_bytes=1500 * GB, streaming_multiprocessors=80),
    "a100": Hardware("a100", 312 * TFLOPS, 19.5 * TFLOPS, 80 * GB, 2039 * GB, 230 * GB, 25 * GB, 8,
                     matmul_efficiency=0.781, host_bandwidth=25 * GB, streaming_multiprocessors=108),
    "h100": Hardware("h100", 989 * TFLOPS, 67 * TFLOPS, 80 * GB, 3350 * GB, 370 * GB, 50 * GB, 8,
                     matmul_efficiency=H100_EFFICIENCY, attention_efficiency=0.35, host_bandwidth=50 * GB,
                     streaming_multiprocessors=132, peak_fp8_flops=1979 * TFLOPS, fp8_efficiency=H100_EFFICIENCY),
}
GPUS["h200"] = replace(GPUS["h100"], name="h200", memory_bytes=141 * GB, memory_bandwidth=4800 * GB)  # H100's chip
#: H100 under Megatron-Core + Transformer Engine: calibrated on Megatron Bridge's Llama-3-8B FP8 run
#: (benchmarks/memory/planner.py, ``CALIBRATIONS["h100-te"]``); attention: cuDNN's fused kernels (module docstring).
H100_TE_EFFICIENCY = 0.584
GPUS["h100-te"] = replace(GPUS["h100"], name="h100-te", matmul_efficiency=H100_TE_EFFICIENCY,
                          fp8_efficiency=H100_TE_EFFICIENCY, attention_efficiency=0.5)
GPUS["a100-40gb"] = replace(GPUS["a100"], name="a100-40gb", memory_bytes=40 * GB, memory_bandwidth=1555 * GB,
                            host_memory_bytes=1000 * GB, disk_bytes=15 * 10**12)  # DGX A100 320GB: 1 TB RAM, 15 TB NVMe
#: GPUs without an NVLink fabric (module docstring): peer traffic over PCIe 4.0, the A100's uncalibrated efficiencies.
_PCIE_GPU = dict(intra_node_bandwidth=20 * GB, matmul_efficiency=GPUS["a100"].matmul_efficiency, host_bandwidth=25 * GB)
_SERVER = dict(gpus_per_node=8, inter_node_bandwidth=100 / 8 / 8 * GB, host_memory_bytes=1000 * GB,
               disk_bytes=4 * 10**12)
_WORKSTATION = dict(gpus_per_node=4, inter_node_bandwidth=10 / 8 / 4 * GB, host_memory_bytes=128 * GB,
                    disk_bytes=2 * 10**12)
GPUS["a10"] = Hardware("a10", 125 * TFLOPS, 31.2 * TFLOPS, 24 * GB, 600 * GB, streaming_multiprocessors=72,
                       **_PCIE_GPU, **_SERVER)
GPUS["l4"] = Hardware("l4", 121 * TFLOPS, 30.3 * TFLOPS, 24 * GB, 300 * GB, streaming_multiprocessors=58,
                      peak_fp8_flops=242 * TFLOPS, **_PCIE_GPU, **_SERVER)
GPUS["rtx-4090"] = Hardware("rtx-4090", 165.2 * TFLOPS, 82.6 * TFLOPS, 24 * GB, 1008 * GB,
                            streaming_multiprocessors=128,
                            peak_fp8_flops=330.3 * TFLOPS, **_PCIE_GPU, **_WORKSTATION)
GPUS["a6000"] = Hardware("a6000", 154.8 * TFLOPS, 38.7 * TFLOPS, 48 * GB, 768 * GB, streaming_multiprocessors=84,
                         **_PCIE_GPU, **_WORKSTATION)
GPUS["l40s"] = Hardware("l40s", 362 * TFLOPS, 91.6 * TFLOPS, 48 * GB, 864 * GB, streaming_multiprocessors=142,
                        peak_fp8_flops=733 * TFLOPS, **_PCIE_GPU,
                        **{**_SERVER, "inter_node_bandwidth": 400 / 8 / 8 * GB})

#: How CUDA names each preset's GPU (``torch.cuda.get_device_name``, lower case): "NVIDIA A100-SXM4-40GB", "NVIDIA
#: GeForce RTX 4090", "NVIDIA A10", "NVIDIA L40S". A100s of 40 and 80 GB share a name pattern: the memory decides.
_DEVICE_NAMES = {"v100": r"v100", "a100": r"a100", "a100-40gb": r"a100", "h100": r"h100", "h200": r"h200",
                 "a10": r"\ba10\b", "l4": r"\bl4\b", "rtx-4090": r"\b4090\b", "a6000": r"\ba6000\b",
                 "l40s": r"\bl40s\b"}


def preset_for_device(device_name: str, memory_bytes: int) -> Optional[str]:
    """The preset of a CUDA device (its name as ``torch.cuda.get_device_name`` gives it, and its memory): the
    presets whose name pattern it matches, the nearest in memory among them; None for a GPU the catalogue lacks."""
    name = device_name.lower()
    matches = [key for key, pattern in _DEVICE_NAMES.items() if re.search(pattern, name)]
    return min(matches, key=lambda key: abs(GPUS[key].memory_bytes - memory_bytes), default=None)


def presets_with_memory(memory_bytes: int) -> list[str]:
    """The catalogue's GPUs with ``memory_bytes`` of memory (within 5%), for a ``--gpu-memory`` given alone."""
    return [key for key, gpu in GPUS.items() if abs(gpu.memory_bytes - memory_bytes) <= 0.05 * gpu.memory_bytes]

# Units a ``--gpu custom:...`` value may carry, and the fields that take each.
_UNITS = {"tflops": TFLOPS, "gbps": GB, "gb": GB}
_FIELDS = {
    "peak": ("peak_flops", TFLOPS), "fp32": ("peak_fp32_flops", TFLOPS), "memory": ("memory_bytes", GB),
    "hbm": ("memory_bandwidth", GB), "nvlink": ("intra_node_bandwidth", GB), "network": ("inter_node_bandwidth", GB),
    "node": ("gpus_per_node", 1), "matmul": ("matmul_efficiency", 1), "elementwise": ("memory_efficiency", 1),
    "overlap": ("overlap_efficiency", 1), "attention": ("attention_efficiency", 1),
    "pcie": ("host_bandwidth", GB), "host": ("host_memory_bytes", GB), "disk": ("disk_bytes", GB),
    "diskread": ("disk_read_bandwidth", GB), "diskwrite": ("disk_write_bandwidth", GB),
    "adam": ("host_optimizer_rate", 1e9),  # billions of fp32 elements per second
    "sms": ("streaming_multiprocessors", 1), "fp8peak": ("peak_fp8_flops", TFLOPS), "fp8": ("fp8_efficiency", 1),
}

_BYTE_FIELDS = ("memory_bytes", "host_memory_bytes", "disk_bytes")


def parse_gpu(spec: str, *, memory: Optional[str] = None, gpus_per_node: Optional[int] = None,
              host_memory: Optional[str] = None, disk: Optional[str] = None) -> Hardware:
    """A preset name (``"a100"``, ``"rtx-4090"``: ``GPUS``) or ``"custom:peak=400,hbm=3000,nvlink=300,network=25[,base=a100,...]"`` (TFLOP/s
    for ``peak``/``fp32``, GB/s for bandwidths, GB for ``memory``, ``host`` and ``disk``; ``base`` names the preset
    the rest starts from, default ``a100``); ``memory`` (``"80GB"``, ``"40GiB"``: per GPU), ``gpus_per_node``,
    ``host_memory`` and ``disk`` (a node's RAM and free NVMe, ``"256GB"``, ``"2TB"``) override the preset's. A ``memory`` that is not the preset's names the result ``"a100 rates with 24GB"``: the
    preset's rates on a GPU of that memory, not that GPU."""
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name != "custom":
        if rest or name not in GPUS:
            raise ValueError(f"--gpu {spec!r} is not in the catalogue: choose one of {', '.join(GPUS)} (memory and "
                             f"rates in lightning_megatron/plan/hardware.py), or describe it as custom:peak=TFLOPS,"
                             f"hbm=GBPS,nvlink=GBPS,network=GBPS[,memory=GB,node=GPUS,matmul=FRACTION,base=PRESET].")
        hardware = GPUS[name]
    else:
        values = dict(item.split("=", 1) for item in rest.split(",") if "=" in item)
        unknown = sorted(set(values) - set(_FIELDS) - {"base"})
        if unknown or len(values) != len([item for item in rest.split(",") if item.strip()]):
            raise ValueError(f"--gpu {spec!r}: every item is KEY=VALUE with KEY one of {', '.join([*_FIELDS, 'base'])}"
                             f"{f'; unknown: {unknown}' if unknown else ''}.")
        base = values.pop("base", "a100")
        if base not in GPUS:
            raise ValueError(f"--gpu {spec!r}: base={base!r} is not one of {', '.join(GPUS)}.")
        changes = {}
        for key, text in values.items():
            field, unit = _FIELDS[key]
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"--gpu {spec!r}: {key}={text!r} is not a number.") from None
            changes[field] = int(number) if field in ("gpus_per_node", "streaming_multiprocessors") else number * unit
        hardware = replace(GPUS[base], name="custom", **{k: (int(v) if k in _BYTE_FIELDS else v)
                                                          for k, v in changes.items()})
    if memory is not None and parse_bytes(memory) != hardware.memory_bytes:  # another GPU's memory: said in its name
        hardware = replace(hardware, name=f"{hardware.name} rates with {memory.strip()}",
                           memory_bytes=parse_bytes(memory))
    if host_memory is not None:
        hardware = replace(hardware, host_memory_bytes=parse_bytes(host_memory))
    if disk is not None:
        hardware = replace(hardware, disk_bytes=parse_bytes(disk))
    if gpus_per_node is not None:
        hardware = replace(hardware, gpus_per_node=gpus_per_node)
    return hardware


def parse_bytes(text: str) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MB"``, ``"512MiB"`` or a plain number of bytes."""
    units = {"gib": 2**30, "mib": 2**20, "gb": 10**9, "mb": 10**6, "tb": 10**12, "tib": 2**40, "b": 1}
    stripped = text.strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if stripped.endswith(unit):
            number = stripped[: -len(unit)]
            break
    else:
        unit, number = "b", stripped
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"A memory size looks like 80GB, 80GiB or 512MiB; got {text!r}.") from None
    if value <= 0:
        raise ValueError(f"A memory size must be positive; got {text!r}.")
    return int(value * units[unit])
