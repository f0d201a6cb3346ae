"""The one launch search (``python -m hybrid_jax.tune``, ``python -m benchmarks autotune``, ``python -m benchmarks
attention --sweep``): coordinate descent over an op's search space (``kernels/registry.py``: the recurrent kernels'
beside them in ``kernels/recurrent/search.py``, flash attention's tiles), each candidate scored by what its axis
changes (a recurrent launch stage compiled and timed alone; attention's forward, or forward + backward), a would-be
winner kept only once its values and gradients match the float32 reference, a candidate that does not compile
skipped with a note.

Recurrent timings run on FLA-law inputs (comparable with the tables' evidence and FLA's times), the numerics check on
model-law inputs with an initial state (they reach KDA's fallback path; ``tooling/inputs.py``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax

from hybrid_jax.kernels.recurrent.search import Axis
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.calls import call, errors_against, fwd_bwd, reference_run
from hybrid_jax.kernels.tooling.errors import AT_MODEL_SHAPES, errors, over
from hybrid_jax.kernels.tooling.inputs import cotangents, inputs
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.kernels.tooling.stages import stage_args, stage_ms
from hybrid_jax.kernels.tooling.timing import median_ms
from hybrid_jax.kernels.tuning import AttentionConfig, RecurrentConfig


class Search:
    """The problems one launch config is tuned for (one op, one dtype): their timing inputs and stage arguments, their
    check inputs and float32 references (built when first needed), and every config's check and whole-op time."""

    def __init__(self, problems: list[Problem], start: RecurrentConfig, *, interpret: bool, repeats: int):
        if len({(p.op, p.dtype) for p in problems}) != 1 or not problems[0].recurrent:
            raise ValueError(f"Search: the problems must share one recurrent op and one dtype, got "
                             f"{sorted({(p.op, p.dtype) for p in problems})}")
        self.problems, self.start, self.interpret, self.repeats = problems, start, interpret, repeats
        self.impl = "pallas_interpret" if interpret else "pallas"
        self.key = problems[0].key
        self.x = [inputs(p, law="fla", initial_state=False) for p in problems]
        self.do = [cotangents(p)[0] for p in problems]
        self.stage_args = [stage_args(p, start, x, do, interpret=interpret)
                           for p, x, do in zip(problems, self.x, self.do, strict=True)]
        self.checks: dict[RecurrentConfig, str | None] = {}
        self.tried: list[dict] = []  # every candidate: field, value, ms, outcome
        self._check_inputs: list | None = None
        self._fns: dict = {}

    def axes(self) -> list[Axis]:
        """The search space at these problems, less the axes whose stages these problems do not launch."""
        launched = set().union(*self.stage_args)
        return [a for a in OPS[self.key[0]].search_space(self.start, self.problems) if set(a.stages) & launched]

    def score(self, cfg: RecurrentConfig, stages: tuple[str, ...]) -> float:
        """Sum over the problems of the ms of ``stages`` under ``cfg`` (a failure to compile raises)."""
        return sum(stage_ms(n, a[n], cfg, self.repeats, self.interpret) for a in self.stage_args for n in stages
                   if n in a)

    def check(self, cfg: RecurrentConfig) -> str | None:
        """Why ``cfg``'s values or gradients are off the float32 chunked XLA form (``errors.AT_MODEL_SHAPES``, every
        problem's errors over it), or None."""
        if cfg not in self.checks:
            if self._check_inputs is None:
                self._check_inputs = []
                for p in self.problems:
                    x, ct = inputs(p), cotangents(p)
                    self._check_inputs.append((x, ct, reference_run(p, "xla", x, ct)))
            tol = AT_MODEL_SHAPES[self.problems[0].dtype]
            bad = []
            for p, (x, ct, (ref_out, ref_grads)) in zip(self.problems, self._check_inputs, strict=True):
                out, grads = jax.jit(fwd_bwd(p, self.impl, config=cfg))(x, ct)
                bad += over(errors(out, grads, ref_out, ref_grads), tol)
            self.checks[cfg] = f"rel RMS {', '.join(bad)}" if bad else None
        return self.checks[cfg]

    def op_ms(self, cfg: RecurrentConfig) -> float:
        """Sum over the problems of the whole op's forward + backward ms under ``cfg`` (timing inputs)."""
        total = 0.0
        for i, p in enumerate(self.problems):
            if (cfg, i) not in self._fns:
                self._fns[cfg, i] = jax.jit(fwd_bwd(p, self.impl, config=cfg))
            total += median_ms(self._fns[cfg, i], self.x[i], (self.do[i], None), repeats=self.repeats)
        return total


class AttentionSearch:
    """Flash attention's tiles at some problems (one dtype): one axis per kernel (``fwd``, ``dkdv``, ``dq``), the
    forward timed for the forward's tiles, the forward + backward for the others', checked against the float32
    softmax. The same interface as :class:`Search` for :func:`sweep`."""

    def __init__(self, problems: list[Problem], start: AttentionConfig, *, interpret: bool, repeats: int):
        if len({p.dtype for p in problems}) != 1 or any(p.recurrent for p in problems):
            raise ValueError("AttentionSearch: attention problems of one dtype")
        self.problems, self.start, self.repeats = problems, start, repeats
        self.impl = "pallas_interpret" if interpret else "pallas"
        self.x = [inputs(p) for p in problems]
        self.ct = [cotangents(p) for p in problems]
        self.checks: dict[AttentionConfig, str | None] = {}
        self.tried: list[dict] = []

    def axes(self) -> list[Axis]:
        """Each kernel's candidate tiles (``registry.ATTENTION_CANDIDATES``), in the order fwd, dkdv, dq."""
        candidates = OPS["attention"].search_space(self.start, self.problems)
        return [Axis(k, tuple(candidates[k]), ("fwd",) if k == "fwd" else ("fwd_bwd",)) for k in ("fwd", "dkdv", "dq")]

    def score(self, cfg: AttentionConfig, stages: tuple[str, ...]) -> float:
        """Sum over the problems of the forward's ms (``stages`` ``("fwd",)``) or the forward + backward's."""
        total = 0.0
        for p, x, ct in zip(self.problems, self.x, self.ct, strict=True):
            if stages == ("fwd",):
                total += median_ms(jax.jit(lambda x, p=p: call(p, x, self.impl, config=cfg)[0]), x,
                                   repeats=self.repeats)
            else:
                total += median_ms(jax.jit(fwd_bwd(p, self.impl, config=cfg)), x, ct, repeats=self.repeats)
        return total

    def check(self, cfg: AttentionConfig) -> str | None:
        """Why ``cfg``'s values or gradients are off the float32 softmax (``errors.AT_MODEL_SHAPES``), or None."""
        if cfg not in self.checks:
            tol = AT_MODEL_SHAPES[self.problems[0].dtype]
            bad = [b for p, x, ct in zip(self.problems, self.x, self.ct, strict=True)
                   for b in over(errors_against(p, self.impl, "xla", x, ct, config=cfg), tol)]
            self.checks[cfg] = f"rel RMS {', '.join(bad)}" if bad else None
        return self.checks[cfg]


def failure_note(e: Exception) -> str:
    """One line on why a candidate failed: out of shared memory, or does not compile."""
    text = f"{type(e).__name__}: {e}"
    kind = "out of shared memory" if any(s in text.lower() for s in ("shared memory", "out of resources", "lds")) \
        else "does not compile"
    return f"{kind} ({' '.join(text.split())[:160]})"


def sweep(search: Search | AttentionSearch, deadline: float, note: Callable[[str], None] = lambda text: None,
          advance: Callable[..., None] = lambda n=1: None, axes: list[Axis] | None = None
          ) -> RecurrentConfig | AttentionConfig:
    """Coordinate descent over ``axes`` (default the search's) from ``search.start`` until ``deadline``
    (``time.perf_counter()``): per axis, each value in turn from the best so far; a faster candidate wins once its
    numerics check. ``note(text)`` says each skipped or rejected candidate; ``advance(n)``: candidates done (or given
    up at the deadline); ``search.tried`` records them all. -> the best config."""
    best, axes = search.start, axes or search.axes()
    for a_i, axis in enumerate(axes):
        if time.perf_counter() > deadline:
            advance(sum(len(a.values) - 1 for a in axes[a_i:]))
            break
        left = [v for v in axis.values if v != getattr(best, axis.field)]
        try:
            best_ms = search.score(best, axis.stages)
        except Exception as e:  # noqa: BLE001 - the start fails here: any candidate that compiles and checks wins
            note(f"{axis.field}={getattr(best, axis.field)} (start): {failure_note(e)}")
            best_ms = math.inf
        for j, value in enumerate(left):
            if time.perf_counter() > deadline:
                advance(len(left) - j)
                break
            cand = dataclasses.replace(best, **{axis.field: value})
            try:
                ms = search.score(cand, axis.stages)
                why = search.check(cand) if ms < best_ms else None
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped, never a crash
                note(f"{axis.field}={value}: skipped, {failure_note(e)}")
                ms, why = math.inf, failure_note(e)
                outcome = "skipped"
            else:
                outcome = "rejected" if why else "won" if ms < best_ms else "slower"
                if why:
                    note(f"{axis.field}={value}: {ms:.3f} ms but rejected, {why}")
                elif ms < best_ms:
                    best, best_ms = cand, ms
            search.tried.append(dict(field=axis.field, value=repr(value), ms=ms, outcome=outcome,
                                     **({"why": why} if why else {})))
            advance()
    return best
