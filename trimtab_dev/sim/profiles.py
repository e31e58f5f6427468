"""Hardware and model parameters for the simulated model servers, each with its source.

Every number here is either a datasheet value, a value read from vLLM's source, or an
efficiency factor fitted to a published measurement; the comment next to it says which.
docs/simulator.md has the same table with the derivations. Nothing here was tuned to make
any load-balancing policy look better: change a value only with a citation.

GPU datasheets:
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB): 3.35 TB/s HBM3, 989 TFLOPS dense
          BF16 (1,979 with sparsity).
  [A100]  NVIDIA A100 Tensor Core GPU datasheet (SXM4 40 GB): 1,555 GB/s HBM2, 312 TFLOPS
          dense BF16 (624 with sparsity).
  [L4]    NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6 at 300 GB/s, 121 TFLOPS dense
          BF16 (242 with sparsity).
  Total framebuffer in MiB is what nvidia-smi / DCGM report for each board: 81559 (H100 80GB
  HBM3), 40960 (A100-SXM4-40GB), 23034 (L4).
vLLM scheduler defaults:
  [VLLM-DEFAULTS] vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: for the OpenAI API
          server, GPUs with >= 70 GiB that are not A100 get max_num_batched_tokens=8192 and
          max_num_seqs=1024; every other GPU gets 2048 and 256. block_size 16,
          gpu_memory_utilization 0.9.
Model:
  [LLAMA] meta-llama/Llama-3.1-8B config.json: 32 layers, hidden 4096, 8 KV heads of dim 128,
          8.03 B parameters, 128k context. KV per token = 2 (K,V) x 32 x 8 x 128 x 2 bytes
          = 131072 bytes = 128 KiB. BF16 weights = 16.06 GB = 14.96 GiB (vLLM logs report
          "model weights take 14.99GiB").
Efficiency (fitted, see docs/simulator.md):
  [A100-SWEEP] J. Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" (vLLM 0.23,
          Llama-3.1-8B BF16, A100 40GB): ~75 tok/s at concurrency 1 = 13.3 ms/token,
          "roughly 77% of the GPU's memory-bandwidth ceiling".
  [H100-BENCH] InferenceBench concurrency-sweep recipe (vLLM 0.21, Llama-3.1-8B fp16, one
          H100-80GB-HBM3): concurrency 1 gives TPOT p50 6.48 ms, TTFT p50 13.98 ms.
  [FA2]   T. Dao, "FlashAttention-2" (2023): 50-73% of peak FLOPs on A100 for the attention
          kernel; [FA3] Shah et al., "FlashAttention-3" (2024): up to 75% of H100 BF16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class ModelProfile:
    """The served model's size and shape ([LLAMA])."""

    name: str
    params: float  # parameters
    weight_bytes: float  # resident weights
    n_layers: int
    hidden: int  # model width; the query projection width in attention FLOPs
    kv_bytes_per_token: int  # K and V for every layer, one token
    max_context: int  # the model's native context length


LLAMA_3_1_8B = ModelProfile(
    name="llama-3.1-8b",
    params=8.03e9,  # [LLAMA]
    weight_bytes=14.99 * GIB,  # [LLAMA] vLLM's own log line for this model
    n_layers=32,  # [LLAMA]
    hidden=4096,  # [LLAMA]
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # [LLAMA] = 131072 B = 128 KiB
    max_context=131072,  # [LLAMA]
)

# [QWEN2-VL] Qwen/Qwen2-VL-7B-Instruct config.json: 28 layers, hidden 3584, 28 attention heads
# (head dim 128), 4 KV heads, 32k positions; the model card gives 8.29 B parameters (the
# 7.6 B language model plus a 675 M vision encoder). KV per token = 2 x 28 x 4 x 128 x 2
# bytes = 57344 B = 56 KiB; BF16 weights = 8.29e9 x 2 B = 15.44 GiB. The simulator counts an
# image as the prompt tokens it becomes (a 448x448 image: 256 tokens, one per 28x28 patch);
# the vision encoder's own compute is not modelled.
QWEN2_VL_7B = ModelProfile(
    name="qwen2-vl-7b",
    params=8.29e9,  # [QWEN2-VL]
    weight_bytes=8.29e9 * 2,  # [QWEN2-VL] BF16
    n_layers=28,  # [QWEN2-VL]
    hidden=3584,  # [QWEN2-VL]
    kv_bytes_per_token=2 * 28 * 4 * 128 * 2,  # [QWEN2-VL] = 57344 B = 56 KiB
    max_context=32768,  # [QWEN2-VL]
)

MODELS: dict[str, ModelProfile] = {m.name: m for m in (LLAMA_3_1_8B, QWEN2_VL_7B)}


@dataclass(frozen=True)
class Efficiency:
    """How much of the datasheet roofline vLLM achieves, and fixed software overheads.

    ``mbu`` (model bandwidth utilisation) and ``step_overhead_s`` are fitted jointly to two
    independent measurements: 0.5 ms + 16.06 GB / (3.35 TB/s x 0.8) = 6.5 ms on H100 against
    6.48 ms measured [H100-BENCH]; 0.5 ms + 16.06 GB / (1.555 TB/s x 0.8) = 13.4 ms on A100
    against 13.3 ms measured [A100-SWEEP].
    ``mfu`` (model FLOPs utilisation in prefill) is an assumption inside the range the attention
    kernels reach on their own [FA2][FA3]; end-to-end prefill includes non-GEMM work, so we
    take the low end, 0.5. It is the least-sourced number here.
    ``api_overhead_s`` (HTTP parsing, tokenisation, detokenisation per request) is the gap
    between measured TTFT at concurrency 1 (13.98 ms [H100-BENCH]) and our modelled prefill
    of a short chat prompt (~7.5 ms), rounded to 5 ms.
    """

    mbu: float = 0.8
    mfu: float = 0.5
    step_overhead_s: float = 0.0005
    api_overhead_s: float = 0.005


@dataclass(frozen=True)
class GpuProfile:
    """One GPU board serving one model replica under vLLM's defaults for that board."""

    name: str
    dcgm_model_name: str  # DCGM's modelName label
    memory_mib: int  # total framebuffer as DCGM reports it
    mem_bandwidth: float  # bytes/s, datasheet
    peak_flops: float  # dense BF16 FLOP/s, datasheet
    max_num_seqs: int  # [VLLM-DEFAULTS]
    max_num_batched_tokens: int  # [VLLM-DEFAULTS]
    # Peak activation + non-torch memory that vLLM's profiling run subtracts before sizing
    # the KV cache. It grows with max_num_batched_tokens (the profiling batch). vLLM's startup
    # log for Llama-3.1-8B on an 80 GB GPU with an 8192-token budget shows ~1.2 GiB activation
    # peak + ~0.1 GiB non-torch; for a 2048-token budget we scale the activation part down to
    # ~0.5 GiB. An estimate, documented in docs/simulator.md.
    non_kv_overhead_bytes: float
    gpu_memory_utilization: float = 0.9  # [VLLM-DEFAULTS]
    block_size: int = 16  # [VLLM-DEFAULTS]


H100_80G = GpuProfile(
    name="H100-80G",
    dcgm_model_name="NVIDIA H100 80GB HBM3",
    memory_mib=81559,
    mem_bandwidth=3.35e12,  # [H100]
    peak_flops=989.4e12,  # [H100]
    max_num_seqs=1024,  # [VLLM-DEFAULTS] >= 70 GiB, not A100
    max_num_batched_tokens=8192,  # [VLLM-DEFAULTS]
    non_kv_overhead_bytes=1.3 * GIB,
)

A100_40G = GpuProfile(
    name="A100-40G",
    dcgm_model_name="NVIDIA A100-SXM4-40GB",
    memory_mib=40960,
    mem_bandwidth=1.555e12,  # [A100]
    peak_flops=312e12,  # [A100]
    max_num_seqs=256,  # [VLLM-DEFAULTS]
    max_num_batched_tokens=2048,  # [VLLM-DEFAULTS]
    non_kv_overhead_bytes=0.6 * GIB,
)

L4_24G = GpuProfile(
    name="L4-24G",
    dcgm_model_name="NVIDIA L4",
    memory_mib=23034,
    mem_bandwidth=300e9,  # [L4]
    peak_flops=121e12,  # [L4]
    max_num_seqs=256,  # [VLLM-DEFAULTS]
    max_num_batched_tokens=2048,  # [VLLM-DEFAULTS]
    non_kv_overhead_bytes=0.6 * GIB,
)

GPUS: dict[str, GpuProfile] = {g.name: g for g in (H100_80G, A100_40G, L4_24G)}


def kv_capacity_tokens(gpu: GpuProfile, model: ModelProfile) -> int:
    """KV-cache size in tokens, rounded down to whole blocks, as vLLM sizes it at startup.

    budget = total x gpu_memory_utilization - weights - activation/non-torch peak.
    """
    budget = gpu.memory_mib * MIB * gpu.gpu_memory_utilization
    kv_bytes = budget - model.weight_bytes - gpu.non_kv_overhead_bytes
    if kv_bytes <= 0:
        raise ValueError(f"{model.name} does not fit on {gpu.name}")
    blocks = int(kv_bytes // (model.kv_bytes_per_token * gpu.block_size))
    return blocks * gpu.block_size


def with_overrides(gpu: GpuProfile, *, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None,
                   gpu_memory_utilization: float | None = None) -> GpuProfile:
    """A copy of ``gpu`` with the given scheduler/memory settings (``None`` keeps a field)."""
    return replace(
        gpu,
        max_num_seqs=max_num_seqs or gpu.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or gpu.max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization or gpu.gpu_memory_utilization,
    )
