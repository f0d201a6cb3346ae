"""A device out-of-memory during training as one line that says which knob to turn.

XLA reports it as ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate ...`` (at run time) or as a
compile that exceeds the device's memory; :func:`out_of_memory_message` turns either into one line naming the
run's micro batch, remat mode and mesh, and the knobs that are not yet turned, in the order to try them.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from hybrid_jax.train import mesh as mesh_lib


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's device out-of-memory (any backend: the text, not the exception type)."""
    text = str(error).lower()
    return "resource_exhausted" in text or "out of memory" in text


def _first_line(error: BaseException, limit: int = 160) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:limit]


def out_of_memory_message(error: BaseException, config: ConfigDict, n_devices: int) -> str | None:
    """The one line for an out-of-memory ``error`` of a run of ``config`` on ``n_devices``; None for another
    error. The knobs, each only when it can still be turned: a smaller ``train.micro_batch_size`` (the global
    batch is kept by accumulation), ``model.remat=full``, ``mesh.fsdp`` over more devices (weights, gradients and
    moments split, ZeRO-3), ``train.zero1`` (moments split over ``data``)."""
    if not is_out_of_memory(error):
        return None
    t = config.train
    try:
        data, fsdp = mesh_lib.mesh_shape(config.mesh, n_devices)
    except ValueError:
        data, fsdp = n_devices, config.mesh.fsdp
    knobs = []
    if t.micro_batch_size > 1:
        knobs.append(f"a smaller train.micro_batch_size (now {t.micro_batch_size}; the global batch is kept by "
                     "accumulation)")
    if config.model.remat != "full":
        knobs.append(f"model.remat=full (now {config.model.remat})")
    if fsdp < n_devices:
        knobs.append(f"mesh.fsdp={min(n_devices, 2 * fsdp)} or more (now {fsdp}: splits weights and moments)")
    else:
        knobs.append(f"more GPUs, with mesh.fsdp over all of them (now {fsdp} of {n_devices})")
    if not t.zero1 and data > 1:
        knobs.append("train.zero1=true")
    return (f"out of device memory ({_first_line(error)}) at micro batch {t.micro_batch_size} x {t.seq_len}, "
            f"remat {config.model.remat}, mesh data {data} x fsdp {fsdp}, zero1 {t.zero1}; try "
            f"{', then '.join(knobs)} "
            "(python -m benchmarks plan_memory --config CONFIG --fsdp N plans the memory per device)")
