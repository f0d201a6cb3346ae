"""Coordinate descent over one kernel's launch search space: stages compiled and timed alone, every would-be winner
checked against the float32 chunked XLA form, a candidate that does not compile skipped with a note."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.kernels import reference
from hybrid_jax.kernels.recurrent import Static, chunk_recurrence
from hybrid_jax.kernels.recurrent.search import STAGES, Axis, stage_inputs
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tuning import RecurrentConfig
from hybrid_jax.model.kernel_calls import Case
from hybrid_jax.tune.shapes import inputs

# rel RMS against a float32 reference, (forward, gradients), by the kernels' input dtype; the doctor's too. bf16:
# the kernels multiply bf16 operands on the tensor cores as FLA's do (rounding the output alone costs 1.1e-3); at the
# published shapes GDN's and KDA's forward error is 4.7e-3 to 5.2e-3 on the H200, with FLA's on the same inputs
# beside it in benchmarks/RESULTS.md (Accuracy); 1e-2 leaves room for other GPUs, not for a wrong launch (an error
# of order 1). float32: interpret mode and the XLA forms.
TOLERANCE = {"bfloat16": (1e-2, 2e-2), "float32": (1e-4, 1e-3)}


def median_ms(fn, *args, repeats: int, warmup: int = 1, sample_ms: float = 10.0) -> float:
    """Median ms of one ``fn(*args)`` over ``repeats`` samples after ``warmup`` calls; a sample is as many
    back-to-back calls as take about ``sample_ms`` (short kernels timed with the device kept busy)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, round(sample_ms / max(1e3 * (time.perf_counter() - t0), 1e-3)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return 1e3 * statistics.median(samples)


def stage_ms(name: str, args: tuple, cfg: RecurrentConfig, interpret: bool, repeats: int) -> float:
    """One launch stage (``search.STAGES[name]``) compiled under ``cfg`` and timed alone."""
    static = Static(1.0, cfg.chunk, cfg, interpret)
    compiled = jax.jit(functools.partial(STAGES[name], static)).lower(*args).compile()
    return median_ms(compiled, *args, repeats=repeats)


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _fwd_bwd(p: Case, config: RecurrentConfig | None, interpret: bool):
    """jitted ``(x, do) -> (o, grads of every input)`` of the Pallas op (``config``) or the chunked XLA form (None)."""
    def fwd(x):
        if config is None:
            return reference.chunked_recurrence(x["q"], x["k"], x["v"], x["g"], x.get("beta"),
                                                use_qk_l2norm=p.delta)[0]
        return chunk_recurrence(x["q"], x["k"], x["v"], x["g"], x.get("beta"), use_qk_l2norm=p.delta,
                                interpret=interpret, config=config)[0]

    def fwd_bwd(x, do):
        o, vjp = jax.vjp(fwd, x)
        return o, vjp(do.astype(o.dtype))[0]

    return jax.jit(fwd_bwd)


class Kernel:
    """The problems of one tuning-file key ``(op, K, V)``: their inputs, float32 references, stage arguments, and
    every config's check and whole-op time (cached)."""

    def __init__(self, problems: list[Case], start: RecurrentConfig, dtype, interpret: bool, repeats: int):
        self.problems, self.start, self.dtype, self.interpret, self.repeats = problems, start, dtype, interpret, repeats
        self.key = problems[0].key
        self.x = [inputs(p, dtype) for p in problems]
        self.do = [jax.random.normal(jax.random.PRNGKey(1), x["v"].shape, dtype) for x in self.x]
        self._ref, self._fns, self.checks = None, {}, {}
        self.stage_args = []
        for p, x, do in zip(problems, self.x, self.do, strict=True):
            static = Static(p.K**-0.5, start.chunk, start, interpret)
            q = reference.l2_normalize(x["q"]).astype(dtype) if p.delta else x["q"]
            h0 = jnp.zeros((p.B, p.HV, p.K, p.V), jnp.float32)
            build = jax.jit(functools.partial(stage_inputs, static))
            self.stage_args.append(build(q, x["k"], x["v"], x["g"], x.get("beta"), h0, do))

    def axes(self) -> list[Axis]:
        """The search space at these problems, less the axes whose stages these problems do not launch."""
        launched = set().union(*self.stage_args)
        return [a for a in OPS[self.key[0]].search_space(self.start, self.problems) if set(a.stages) & launched]

    def score(self, cfg: RecurrentConfig, stages: tuple[str, ...]) -> float:
        """Sum over the problems of the ms of ``stages`` under ``cfg`` (a failure propagates)."""
        return sum(stage_ms(n, a[n], cfg, self.interpret, self.repeats) for a in self.stage_args for n in stages
                   if n in a)

    def check(self, cfg: RecurrentConfig) -> str | None:
        """Why ``cfg``'s outputs or gradients are off the float32 chunked XLA form (worst problem), or None."""
        if cfg not in self.checks:
            if self._ref is None:
                f32 = [jax.tree.map(lambda a: a.astype(jnp.float32), (x, do)) for x, do in zip(self.x, self.do,
                                                                                             strict=True)]
                self._ref = [_fwd_bwd(p, None, False)(*a) for p, a in zip(self.problems, f32, strict=True)]
            tol_o, tol_g = TOLERANCE[jnp.dtype(self.dtype).name]
            worst = []
            for i in range(len(self.problems)):
                o, grads = self.fn(cfg, i)(self.x[i], self.do[i])
                o_ref, g_ref = self._ref[i]
                errs = {"o": rel_rms(o, o_ref), **{f"d{n}": rel_rms(grads[n], g_ref[n]) for n in grads}}
                bad = {n: e for n, e in errs.items() if e > (tol_o if n == "o" else tol_g) or not math.isfinite(e)}
                worst += [f"{n} {e:.1e}" for n, e in bad.items()]
            self.checks[cfg] = f"rel RMS {', '.join(worst)} over {tol_o:g} / {tol_g:g}" if worst else None
        return self.checks[cfg]

    def fn(self, cfg: RecurrentConfig, i: int):
        if (cfg, i) not in self._fns:
            self._fns[cfg, i] = _fwd_bwd(self.problems[i], cfg, self.interpret)
        return self._fns[cfg, i]

    def op_ms(self, cfg: RecurrentConfig) -> float:
        """Sum over the problems of the whole op's forward + backward ms under ``cfg``."""
        return sum(median_ms(self.fn(cfg, i), self.x[i], self.do[i], repeats=self.repeats)
                   for i in range(len(self.problems)))


def failure_note(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    kind = "out of shared memory" if any(s in text.lower() for s in ("shared memory", "out of resources", "lds")) \
        else "does not compile"
    return f"{kind} ({' '.join(text.split())[:160]})"


def sweep(kernel: Kernel, deadline: float, note, advance=lambda n=1: None,
          axes: list[Axis] | None = None) -> RecurrentConfig:
    """Coordinate descent over ``axes`` (default the kernel's) from ``kernel.start`` until ``deadline``
    (``time.perf_counter()``); ``note(text)`` says each skipped or rejected candidate; ``advance(n)``: candidates
    done (or given up at the deadline). -> the best config whose numerics check."""
    best, axes = kernel.start, axes or kernel.axes()
    for a_i, axis in enumerate(axes):
        if time.perf_counter() > deadline:
            advance(sum(len(a.values) - 1 for a in axes[a_i:]))
            break
        left = [v for v in axis.values if v != getattr(best, axis.field)]
        try:
            best_ms = kernel.score(best, axis.stages)
        except Exception as e:  # noqa: BLE001 - the start fails here: any candidate that compiles and checks wins
            note(f"{axis.field}={getattr(best, axis.field)} (start): {failure_note(e)}")
            best_ms = math.inf
        for j, value in enumerate(left):
            if time.perf_counter() > deadline:
                advance(len(left) - j)
                break
            cand = dataclasses.replace(best, **{axis.field: value})
            try:
                ms = kernel.score(cand, axis.stages)
                why = kernel.check(cand) if ms < best_ms else None
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped, never a crash
                note(f"{axis.field}={value}: skipped, {failure_note(e)}")
                ms, why = math.inf, None
            if why:
                note(f"{axis.field}={value}: {ms:.3f} ms but rejected, {why}")
            elif ms < best_ms:
                best, best_ms = cand, ms
            advance()
    return best
