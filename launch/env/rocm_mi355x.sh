# Environment for AMD Instinct MI355X (gfx950, 288 GB HBM3E). Source it before training:
#   source launch/env/rocm_mi355x.sh
# Same runtime, RCCL and XLA settings as MI300X; the Pallas kernels pick their gfx950 block sizes by themselves
# (160 KiB LDS per CU instead of 64 KiB). Every value can be overridden by exporting it first.
_hybrid_jax_fraction="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.93}"  # 288 GB: 7% is plenty for RCCL and the runtime
source "$(dirname "${BASH_SOURCE[0]}")/rocm_mi300x.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION="$_hybrid_jax_fraction"
unset _hybrid_jax_fraction
