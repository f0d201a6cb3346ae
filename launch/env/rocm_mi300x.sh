# Environment for AMD Instinct MI300X (gfx942, 192 GB HBM3). Source it before training:
#   source launch/env/rocm_mi300x.sh
# Every value can be overridden by exporting it first.

# Memory: JAX preallocates this fraction of each GPU (default 0.75). Leave a little for RCCL and the runtime;
# lower it (e.g. 0.85) if RCCL fails to allocate its buffers at start-up.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-true}"

# XLA: overlap collectives with compute (latency-hiding scheduler), combine small gradient all-reduces and ZeRO-1
# reduce-scatters / all-gathers into 128 MiB messages, and run without command buffers (HIP graphs): the step is one
# large program already, and graph capture around Triton custom calls is a known source of ROCm trouble.
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_command_buffer= \
--xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 \
--xla_gpu_all_gather_combine_threshold_bytes=134217728}"

# ROCm runtime: kernel arguments in device memory (lower launch latency), two hardware queues per device (less
# contention between compute and RCCL streams), no scratch reclaim between kernels (avoids stalls in long runs).
export HIP_FORCE_DEV_KERNARG="${HIP_FORCE_DEV_KERNARG:-1}"
export GPU_MAX_HW_QUEUES="${GPU_MAX_HW_QUEUES:-2}"
export HSA_NO_SCRATCH_RECLAIM="${HSA_NO_SCRATCH_RECLAIM:-1}"

# RCCL across nodes: name your InfiniBand/RoCE devices and socket interface (site specific), e.g.
#   export NCCL_IB_HCA=rdma0,rdma1,rdma2,rdma3,rdma4,rdma5,rdma6,rdma7  NCCL_SOCKET_IFNAME=ens51f0
export NCCL_IB_GID_INDEX="${NCCL_IB_GID_INDEX:-3}"  # RoCE v2

# Compiled programs are cached across runs (the first step of a resumed run then starts in seconds).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/hybrid_jax/xla}"
