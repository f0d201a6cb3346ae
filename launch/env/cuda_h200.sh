# Environment for NVIDIA H200 (sm90, 141 GB HBM3E). Source it before training:
#   source launch/env/cuda_h200.sh
# Every value can be overridden by exporting it first.

# Memory: JAX preallocates this fraction of each GPU (default 0.75); NCCL and cuDNN need the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-true}"

# XLA: overlap collectives with compute, combine small gradient all-reduces and ZeRO-1 reduce-scatters /
# all-gathers into 128 MiB messages. Attention uses cuDNN through hybrid_jax.kernels (no flag needed).
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 \
--xla_gpu_all_gather_combine_threshold_bytes=134217728}"

# One CUDA hardware queue keeps the scheduler's order of compute and collectives (what latency hiding assumes).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# NVLink SHARP (multicast) buffers cost GPU memory and need fabric support; off unless you know it helps.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"

# Compiled programs are cached across runs.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/hybrid_jax/xla}"
