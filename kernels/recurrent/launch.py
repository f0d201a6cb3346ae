"""Launch helpers of the recurrent kernels: BlockSpecs over the ``[B, T, heads, D]`` layout, named refs, and the
launch forms a chunk-parallel kernel can take (several chunks per program; one-reference diagonal blocks with a
levels launch that redoes the rows they get wrong).

A kernel here takes every ref by keyword (``kernel(q_ref=..., o_ref=...)``): :func:`call` maps the pallas_call's
positional refs to the names of its ``inputs`` and ``outputs`` (ordered dicts ``name -> (array or
ShapeDtypeStruct, BlockSpec)``), so optional operands are plain ``None`` defaults in the kernel's signature.
Grids: chunk-parallel ``[B, HV, N]`` (``N`` chunks), sequential ``[B, HV, NV]`` (``NV`` value tiles).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrid_jax.kernels.recurrent.block_math import F32, SUB, blocks, far_blocks, wide_exponent
from hybrid_jax.kernels.recurrent.refs import ChunkOf, FarRowsOnly, HeadOf, ReverseSummedGrad, SummedGate, TileSum
from hybrid_jax.kernels.tuning import Launch, RecurrentConfig

Operands = dict[str, tuple]  # ref name -> (array or ShapeDtypeStruct, BlockSpec), in launch order


@dataclasses.dataclass(frozen=True)
class Static:
    """The non-differentiable, hashable arguments of the op: ``scale``, ``chunk`` (rows per chunk), the launch
    config and whether the kernels run in interpret mode."""

    scale: float
    chunk: int
    cfg: RecurrentConfig
    interpret: bool


def call(kernel: Callable, name: str, launch: Launch, static: Static, grid: tuple, inputs: Operands,
         outputs: Operands, aliases: dict[int, int] | None = None) -> list[jax.Array]:
    """One ``pallas_call`` of ``kernel(**refs)`` (refs named as the keys of ``inputs``, then ``outputs``) on the
    arrays of ``inputs``; -> the outputs, in order."""
    names = [*inputs, *outputs]

    def by_name(*refs):
        kernel(**dict(zip(names, refs, strict=True)))

    return pl.pallas_call(
        by_name,
        grid=grid,
        in_specs=[spec for _, spec in inputs.values()],
        out_specs=[spec for _, spec in outputs.values()],
        out_shape=[shape for shape, _ in outputs.values()],
        input_output_aliases=aliases or {},
        compiler_params=pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        interpret=static.interpret,
        name=name,
    )(*[x for x, _ in inputs.values()])


class Specs:
    """BlockSpecs over the ``[B, T, heads, D]`` layout. q/k blocks read head ``hv // group``; the cumulated gate is
    ``[B, T, HV]`` or, per key (``gate_k`` = K), ``[B, T, HV, K]``."""

    def __init__(self, T: int, C: int, group: int, BV: int, gate_k: int | None):
        self.T, self.C, self.G, self.BV, self.gate_k = T, C, group, BV, gate_k

    # chunk-parallel, grid [B, HV, N]: one chunk of C rows
    def qk(self, D: int) -> pl.BlockSpec:
        """``[C, D]`` of q or k (head ``hv // group``)."""
        return pl.BlockSpec((None, self.C, None, D), lambda b, h, c: (b, c, h // self.G, 0))

    def rows(self, D: int) -> pl.BlockSpec:
        """``[C, D]`` of a per-value-head tensor."""
        return pl.BlockSpec((None, self.C, None, D), lambda b, h, c: (b, c, h, 0))

    def vec(self) -> pl.BlockSpec:
        """``[C]`` of a ``[B, T, HV]`` tensor."""
        return pl.BlockSpec((None, self.C, None), lambda b, h, c: (b, c, h))

    def gate(self) -> pl.BlockSpec:
        """The gate: ``[C]`` or, per key, ``[C, K]``."""
        return self.vec() if self.gate_k is None else self.rows(self.gate_k)

    def seg(self) -> pl.BlockSpec:
        """``[C]`` of a ``[B, T]`` tensor (packed documents: one value per token, shared by all heads)."""
        return pl.BlockSpec((None, self.C), lambda b, h, c: (b, c))

    def snapshot(self, K: int, V: int) -> pl.BlockSpec:
        """``[K, V]``: chunk ``c``'s entry of ``[B, N, HV, K, V]`` state snapshots."""
        return pl.BlockSpec((None, None, None, K, V), lambda b, h, c: (b, c, h, 0, 0))

    def chunk_keys(self, K: int) -> pl.BlockSpec:
        """``[K]``: chunk ``c``'s entry of ``[B, N, HV, K]``."""
        return pl.BlockSpec((None, None, None, K), lambda b, h, c: (b, c, h, 0))

    # sequential over chunks, grid [B, HV, NV]: all T rows, tiled over V
    def qk_seq(self, D: int) -> pl.BlockSpec:
        """``[T, D]`` of q or k."""
        return pl.BlockSpec((None, self.T, None, D), lambda b, h, v: (b, 0, h // self.G, 0))

    def rows_seq(self, D: int) -> pl.BlockSpec:
        """``[T, D]`` of a per-value-head tensor."""
        return pl.BlockSpec((None, self.T, None, D), lambda b, h, v: (b, 0, h, 0))

    def vtile_seq(self, tiles: int | None = None) -> pl.BlockSpec:
        """``[T, BV]``: this V tile of a ``[B, T, HV, V]`` tensor; of one of ``tiles`` V tiles (the grid's past them
        read its last)."""
        return pl.BlockSpec((None, self.T, None, self.BV),
                            lambda b, h, v: (b, 0, h, v if tiles is None else jnp.minimum(v, tiles - 1)))

    def gate_seq(self) -> pl.BlockSpec:
        """The gate: ``[T]`` or, per key, ``[T, K]``."""
        if self.gate_k is None:
            return pl.BlockSpec((None, self.T, None), lambda b, h, v: (b, 0, h))
        return self.rows_seq(self.gate_k)

    def words_seq(self, W: int) -> pl.BlockSpec:
        """``[W]`` of a ``[B, W]`` tensor (shared by all heads)."""
        return pl.BlockSpec((None, W), lambda b, h, v: (b, 0))

    def tokens_seq(self) -> pl.BlockSpec:
        """``[T]`` of a ``[B, T]`` tensor (packed documents: one value per token, shared by all heads)."""
        return pl.BlockSpec((None, self.T), lambda b, h, v: (b, 0))

    def state_seq(self, K: int) -> pl.BlockSpec:
        """``[K, BV]``: this V tile of a ``[B, HV, K, V]`` state."""
        return pl.BlockSpec((None, None, K, self.BV), lambda b, h, v: (b, h, 0, v))

    def snapshots_seq(self, N: int, K: int) -> pl.BlockSpec:
        """``[N, K, BV]``: this V tile of every chunk's ``[B, N, HV, K, V]`` snapshot."""
        return pl.BlockSpec((None, N, None, K, self.BV), lambda b, h, v: (b, 0, h, 0, v))

    def keys_per_vtile_seq(self, N: int, K: int) -> pl.BlockSpec:
        """``[N, K]``: every chunk's ``[K]`` vector of this V tile in ``[B, N, HV, V // BV, K]``."""
        return pl.BlockSpec((None, N, None, None, K), lambda b, h, v: (b, 0, h, v, 0))


@dataclasses.dataclass(frozen=True)
class Dims:
    """Shapes of one launch: ``N`` chunks, ``BV`` the V tile (clipped to V), and its :class:`Specs`."""

    B: int
    T: int
    HV: int
    K: int
    V: int
    N: int
    BV: int
    specs: Specs


def dims(static: Static, q: jax.Array, v: jax.Array, gamma: jax.Array, block_v: int | None = None) -> Dims:
    """:class:`Dims` of ``q [B,T,H,K]``, ``v [B,T,HV,V]`` and the gate (``block_v``: default the config's)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BV = min(block_v or static.cfg.block_v, V)
    specs = Specs(T, static.chunk, HV // H, BV, K if gamma.ndim == 4 else None)
    return Dims(B, T, HV, K, V, T // static.chunk, BV, specs)


def gate_bytes(gamma: jax.Array) -> int:
    """Bytes of one token's cumulated gate (float32): one per value head, or one per key channel."""
    return 4 * (gamma.shape[3] if gamma.ndim == 4 else 1)


def gate_span(static: Static, gamma: jax.Array, dtype) -> float:
    """``cfg.one_reference_span`` where one-reference diagonal blocks apply: a per-key gate and bf16 or float32
    inputs (factors up to ``exp(span)``); else 0 (the levels alone)."""
    span = float(static.cfg.one_reference_span)
    return span if gamma.ndim == 4 and span > 0 and wide_exponent(dtype) else 0.0


def summing_gate(kernel: Callable, static: Static, gamma: jax.Array, gate: str, dgate: str | None = None):
    """``kernel``, where the kernels sum the gate (``RecurrentConfig.sums_gate``) with its ref ``gate`` read through
    :class:`SummedGate` and, ``dgate`` given, its ref ``dgate`` stored through :class:`ReverseSummedGrad`; else
    ``kernel`` itself."""
    if not static.cfg.sums_gate(gamma.ndim == 4, static.chunk):
        return kernel

    def summing(**refs):
        refs[gate] = SummedGate(refs[gate])
        if dgate is not None:
            refs[dgate] = ReverseSummedGrad(refs[dgate])
        return kernel(**refs)

    return summing


def over_value_heads(spec: pl.BlockSpec, G: int) -> tuple[pl.BlockSpec, int]:
    """A chunk-parallel BlockSpec of a per-value-head tensor (heads on axis 2, one per program) -> ``(spec, axis)``:
    the spec over ``G`` consecutive value heads, the heads of one q/k head on a grid ``[B, H, N]``, and the axis of
    the heads in the kernel's ref (for :class:`refs.HeadOf`)."""
    shape = list(spec.block_shape)
    if shape[2] is not None:
        raise ValueError(f"a per-value-head BlockSpec must take one head on axis 2: {spec}")
    shape[2] = G
    return pl.BlockSpec(tuple(shape), spec.index_map), sum(x is not None for x in spec.block_shape[:2])


def summing_over_value_heads(kernel: Callable, G: int, axes: dict[str, int], summed: tuple[str, ...]) -> Callable:
    """``kernel`` run on each of a q/k head's ``G`` value heads in a loop: the refs named in ``axes`` (name -> head
    axis, :func:`over_value_heads`) as that head's (:class:`refs.HeadOf`), the output refs ``summed`` (each stored
    as one whole tile: :class:`refs.TileSum`) summed over the heads in float32 and stored once after the loop; the
    other refs as they are. A loop, not G copies of the kernel: the copies' live values spill registers."""

    def each_value_head(**refs):
        def one_head(g, sums):
            tiles = {name: TileSum(refs[name]) for name in summed}
            kernel(**{name: HeadOf(ref, g, axes[name]) if name in axes else tiles.get(name, ref)
                      for name, ref in refs.items()})
            return tuple(total + tiles[name].value for total, name in zip(sums, summed, strict=True))

        zeros = tuple(jnp.zeros(refs[name].shape, F32) for name in summed)
        for name, total in zip(summed, lax.fori_loop(0, G, one_head, zeros), strict=True):
            refs[name][...] = total.astype(refs[name].dtype)

    return each_value_head


def over_chunks(spec: pl.BlockSpec, R: int) -> pl.BlockSpec:
    """A chunk-parallel BlockSpec (chunk ``c`` on axis 1: ``C`` rows, or one squeezed entry) over ``R`` consecutive
    chunks: grid index ``p`` of that axis covers chunks ``p R ... p R + R - 1``."""
    shape = list(spec.block_shape)
    moves = [x != y for x, y in zip(spec.index_map(0, 0, 1), spec.index_map(0, 0, 0), strict=True)]
    if moves != [axis == 1 for axis in range(len(shape))]:
        raise ValueError(f"a chunk-parallel BlockSpec must follow the chunk on axis 1 only: {spec}")
    shape[1] = R if shape[1] is None else shape[1] * R
    return pl.BlockSpec(tuple(shape), spec.index_map)


def _over(operands: Operands, R: int) -> Operands:
    return {name: (x, over_chunks(spec, R)) for name, (x, spec) in operands.items()}


def chunk_by_chunk(*, kernel: Callable, chunk: int, rows: dict[str, bool], n_chunks: int, when=None, **refs):
    """``kernel`` run on each of a program's ``n_chunks`` consecutive chunks in turn; ``refs`` span those chunks
    (:class:`ChunkOf`, ``rows`` per ref). ``when``: ``r -> bool``, run on chunk ``r`` only where it holds (default:
    on every chunk)."""

    def one_chunk(r, carry):
        def run():
            kernel(**{name: ChunkOf(ref, r, chunk, rows[name]) for name, ref in refs.items()})

        if when is None:
            run()
        else:
            pl.when(when(r))(run)
        return carry

    lax.fori_loop(0, n_chunks, one_chunk, 0)


def _chunks(*, kernel: Callable, chunk: int, rows: dict[str, bool], n_chunks: int, rel_ref=None, flag_ref=None,
            **refs):
    """A first launch's program: ``kernel`` on its ``n_chunks`` consecutive chunks (one: on the refs as they are).
    Packed documents: ``kernel`` takes ``rel_ref`` (``[n_chunks C]``) too; with ``flag_ref`` (``[n_chunks]``: 1 on
    the chunks where a new document starts) only on the flagged chunks, the others run ``kernel`` without it."""

    def run(r, **chunk_refs):
        if rel_ref is None:
            kernel(**chunk_refs)
            return
        rel = rel_ref if r is None else ChunkOf(rel_ref, r, chunk, True)
        if flag_ref is None:
            kernel(**chunk_refs, rel_ref=rel)
            return
        flag = jnp.max(flag_ref[...] if r is None else flag_ref[pl.ds(r, 1)])
        pl.when(flag == 0)(lambda: kernel(**chunk_refs))
        pl.when(flag > 0)(lambda: kernel(**chunk_refs, rel_ref=rel))

    if n_chunks == 1:
        run(None, **refs)
        return

    def one_chunk(r, carry):
        run(r, **{name: ChunkOf(ref, r, chunk, rows[name]) for name, ref in refs.items()})
        return carry

    lax.fori_loop(0, n_chunks, one_chunk, 0)


def _on_flagged(*, kernel: Callable, names: list[str], chunk: int, rows: dict[str, bool], flag_ref, **refs):
    """A redo launch's program (:func:`_redo`): ``kernel`` on the chunks that ``flag_ref`` (``[R]``: the program's
    chunks' flags) marks, on the refs ``names``; the aliased earlier outputs (``refs[NAME_first]``) are unused."""
    pl.when(jnp.max(flag_ref[...]) > 0)(functools.partial(
        chunk_by_chunk, kernel=kernel, chunk=chunk, rows=rows, n_chunks=flag_ref.shape[0],
        when=lambda r: jnp.max(flag_ref[pl.ds(r, 1)]) > 0, **{n: refs[n] for n in names}))


def _redo(kernel: Callable, name: str, launch: Launch, static: Static, grid: tuple, inputs: Operands,
          outputs: Operands, previous: list[jax.Array], flags: jax.Array, R: int) -> list[jax.Array]:
    """A launch that runs ``kernel`` again, in place, on the chunks that ``flags`` (``[B, HV or 1, 1, N]``) marks,
    ``R`` consecutive chunks per program (a power of two dividing N); the other programs exit after one load. The
    earlier launch's outputs ``previous`` are aliased to this one's."""
    rows = {n: spec.block_shape[1] is not None for n, (_, spec) in (inputs | outputs).items()}
    per_head = flags.shape[1] > 1
    spec = pl.BlockSpec((None, None, None, R), lambda b, h, p: (b, h if per_head else 0, 0, p))
    spans = _over(outputs, R)
    earlier = {f"{n}_first": (x, spans[n][1]) for n, x in zip(outputs, previous, strict=True)}
    program = functools.partial(_on_flagged, kernel=kernel, names=[*inputs, *outputs], chunk=static.chunk, rows=rows)
    return call(program, name, launch, static, grid[:2] + (grid[2] // R,),
                _over(inputs, R) | {"flag_ref": (flags, spec)} | earlier, spans,
                {len(inputs) + 1 + i: i for i in range(len(outputs))})


def _far_rows_only(kernel: Callable, inputs: Operands, outputs: Operands, gate: str, span: float, causal: bool,
                   summed: bool) -> Callable:
    """``kernel`` (with the levels) on one chunk, storing only the rows that one-reference diagonal blocks get wrong
    (:func:`block_math.far_blocks`): the levels launch's chunk."""

    def redo_far_rows(**chunk_refs):
        gamma_ref = SummedGate(chunk_refs[gate]) if summed else chunk_refs[gate]
        far = far_blocks(blocks(gamma_ref, per_key=True), span, causal)
        kernel(**{name: chunk_refs[name] for name in inputs},
               **{name: FarRowsOnly(chunk_refs[name], far) for name in outputs})

    return redo_far_rows


def document_chunks(rel: jax.Array, C: int) -> jax.Array:
    """XLA: ``[B, 1, 1, N]`` float32, 1 where a chunk (of ``C`` rows) has a row of a new document (``rel [B, T]``
    of ``reference.chunk_segments`` above 0)."""
    B, T = rel.shape
    return jnp.any(rel.reshape(B, T // C, C) > 0, axis=2)[:, None, None, :].astype(F32)


def far_chunks(gamma: jax.Array, span: float, C: int, cumulated: bool = True) -> jax.Array:
    """XLA: ``[B, HV, 1, N]`` float32, 1 where a chunk (of ``C`` rows) has a row whose per-key gate has moved by
    about ``span`` or more from its ``SUB``-row block's first row (the rows :func:`block_math.far_blocks` marks; the
    threshold is a little lower, so that no such chunk is missed by rounding). ``cumulated=False``: ``gamma`` is the
    raw gate (``RecurrentConfig.sums_gate``); a block is then flagged where the sum of ``|g|`` over its rows after
    the first reaches the threshold, a bound on how far any row moves (the same blocks for a gate <= 0, some more
    for a gate of either sign)."""
    B, T, HV, K = gamma.shape
    g = gamma.reshape(B, T // SUB, SUB, HV, K)
    if cumulated:
        moved = jnp.abs(g - g[:, :, :1]) >= span * (1 - 2.0**-10)
    else:
        moved = jnp.sum(jnp.abs(g[:, :, 1:]), axis=2, keepdims=True) >= span * (1 - 2.0**-10)
    far = jnp.any(moved.reshape(B, T // C, -1, HV, 1, K), axis=(2, 5))  # [B, N, HV, 1]
    return far.transpose(0, 2, 3, 1).astype(F32)


def diagonal_launches(kernel: Callable, name: str, launch: Launch, static: Static, grid: tuple, inputs: Operands,
                      outputs: Operands, *, gate: str, causal: bool, redo_far: bool, dgate: str | None = None,
                      per_program: int = 1) -> list[jax.Array]:
    """The launches of a chunk-parallel kernel with diagonal row blocks (``kernel(**refs, span=...)``,
    :func:`block_math.block_gram`; ``inputs[gate]`` is the gate) -> its outputs.

    With a per-key gate (:func:`gate_span`) two: one around one reference row per block (``name``), then one with
    the levels (``name_levels``) which redoes, in place, the rows the first gets wrong (its outputs are aliased to
    the first's). Each program of the second takes ``cfg.levels_chunks`` consecutive chunks (the largest power of
    two up to that which divides N) and, unless XLA flagged one of them (:func:`far_chunks`), exits after one load:
    with a gate that moves by less than the span within every 16 rows (the usual case) that is all it does, and no
    host round trip decides whether it runs. ``redo_far=False``: the first launch alone (its far rows wrong; for
    tests). Otherwise one launch with the levels. Where the kernels sum the gate, the kernel reads ``inputs[gate]``
    as sums and, ``dgate`` given, stores its output ``dgate`` reverse-summed (:func:`summing_gate`).
    ``per_program``: chunks per program of the first launch (``RecurrentConfig.chunks_per_program_at``; the greatest
    common divisor of it and N), looped over in turn.

    Packed documents (``inputs["rel_ref"]``): the first launch runs the kernel with them, as
    ``cfg.documents_branch`` says either on every chunk, or only on the chunks where a new document starts
    (:func:`document_chunks`, a flag per chunk) and the kernel as without documents on the others. The levels
    launch takes ``rel_ref`` too."""
    gamma = inputs[gate][0]
    span = gate_span(static, gamma, next(iter(inputs.values()))[0].dtype)
    summed = static.cfg.sums_gate(gamma.ndim == 4, static.chunk)
    kernel = summing_gate(kernel, static, gamma, gate, dgate)
    N = grid[2]
    plain = {n: x for n, x in inputs.items() if n != "rel_ref"}
    rows = {n: spec.block_shape[1] is not None for n, (_, spec) in (plain | outputs).items()}
    P = math.gcd(N, per_program)
    first_inputs = dict(plain) if P == 1 else _over(plain, P)
    if "rel_ref" in inputs:
        rel, spec = inputs["rel_ref"]
        first_inputs["rel_ref"] = (rel, spec if P == 1 else over_chunks(spec, P))
        if static.cfg.documents_branch:
            flags = pl.BlockSpec((None, None, None, P), lambda b, h, p: (b, 0, 0, p))
            first_inputs["flag_ref"] = (document_chunks(rel, static.chunk), flags)
    outs = call(functools.partial(_chunks, kernel=functools.partial(kernel, span=span), chunk=static.chunk,
                                  rows=rows, n_chunks=P),
                name, launch, static, grid[:2] + (N // P,), first_inputs, outputs if P == 1 else _over(outputs, P))
    if not (span and redo_far):
        return outs
    R = math.gcd(N, 1 << (max(1, static.cfg.levels_chunks).bit_length() - 1))  # a power of two dividing N
    levels = _far_rows_only(functools.partial(kernel, span=0.0), inputs, outputs, gate, span, causal, summed)
    far = far_chunks(gamma, span, static.chunk, cumulated=not summed)
    return _redo(levels, f"{name}_levels", launch, static, grid, inputs, outputs, outs, far, R)
