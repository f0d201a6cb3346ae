"""Lowering the kernels for a GPU that is not there: the StableHLO text and each Pallas launch's Triton IR, as the
device would compile them with its arch's table (``tests/kernels/test_lowering.py``, ``benchmarks/kernel_resources.py``
and the IR-hash check of a refactor use it; no GPU needed)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from hybrid_jax.kernels.flash_attention import flash_attention
from hybrid_jax.kernels.recurrent import chunk_recurrence
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tuning import attention_config, override, recurrent_config

# arch (a table key of kernels/tuning.py) -> (device kind, JAX platform) of a device of that arch
TARGETS = {"sm90": ("NVIDIA H200", "cuda"), "gfx942": ("gfx942", "rocm"), "gfx950": ("gfx950", "rocm")}
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas launch in the lowered text


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Pallas launch as lowered for a target: its Triton IR (text) and launch parameters."""

    name: str
    ir: str
    num_warps: int
    num_stages: int


def lower(fn: Callable, args: tuple, arch: str) -> str:
    """The StableHLO text of ``jax.jit(fn)`` on ``args`` (``ShapeDtypeStruct``) lowered for a device of ``arch``."""
    kind, platform = TARGETS[arch]
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(kind, 1, platform))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@contextlib.contextmanager
def captured_triton_ir() -> Iterator[list[str]]:
    """The Triton IR text of every Pallas kernel lowered inside the block. Pallas keeps the module only as bytecode
    in the custom call, which another Triton version cannot read, so the lowering function is wrapped."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    texts: list[str] = []
    lower_module = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield texts
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower_module


def lowered_kernels(fn: Callable, args: tuple, arch: str) -> list[Kernel]:
    """The Pallas launches of ``fn(*args)`` lowered for ``arch``, in order, each kernel once (by name: two different
    kernels under one name are an error, since a report by name could not tell them apart)."""
    with captured_triton_ir() as texts:
        text = lower(fn, args, arch)
    # name -> (num_warps, num_stages): the Triton custom calls' backend configs list their keys in this order
    launches = {name: (int(warps), int(stages)) for name, stages, warps in re.findall(
        r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)}
    kernels: dict[str, Kernel] = {}
    for ir in dict.fromkeys(texts):
        name = re.search(r"tt\.func (?:public )?@(\w+)", ir).group(1)
        if name in kernels:
            raise ValueError(f"two different Pallas kernels are named {name!r}: give each launch its own name")
        kernels[name] = Kernel(name, ir, *launches[name])
    return list(kernels.values())


def kernel_case(p: Problem, arch: str, variant: str = "", *, initial_state: bool = False, segments: bool = False
                ) -> tuple[Callable, tuple]:
    """``(fn, args)`` to lower: the forward + backward of ``p``'s Pallas op (the recurrent kernels at its chunk, 0:
    the table's; flash attention, causal) with ``arch``'s table entry, a recurrent one changed by ``variant``
    (``tuning.override``'s ``FIELD=VALUE,...``): the value and the gradient of every float input of ``o.sum()``, plus
    ``final_state.sum()`` with an initial state (under the gradient alone XLA drops the output launch); it lowers
    every forward launch too. Args: :meth:`Problem.specs`."""
    specs = p.specs(initial_state=initial_state, segments=segments)
    names = list(specs)
    if p.recurrent:
        config = recurrent_config(arch, per_key=p.per_key, op=p.op, dims=p.key[1:])
        config = override(config, variant) if variant else config

        def fwd(*xs):
            x = dict(zip(names, xs, strict=True))
            return chunk_recurrence(x["q"], x["k"], x["v"], x["g"], x.get("beta"), scale=p.scale,
                                    initial_state=x.get("initial_state"), use_qk_l2norm=True, config=config,
                                    chunk_size=p.chunk or None, segment_ids=x.get("segment_ids"))
    else:
        config = attention_config(arch, max(p.K, p.V))

        def fwd(*xs):
            x = dict(zip(names, xs, strict=True))
            return flash_attention(x["q"], x["k"], x["v"], scale=p.scale, config=config,
                                   segment_ids=x.get("segment_ids")), None

    def loss(*xs):
        o, final = fwd(*xs)
        return o.astype(jnp.float32).sum() + (final.sum() if initial_state else 0.0)

    floats = tuple(i for i, n in enumerate(names) if n != "segment_ids")
    return jax.value_and_grad(loss, argnums=floats), tuple(specs.values())
