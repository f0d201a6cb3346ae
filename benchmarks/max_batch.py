"""The largest micro-batch whose train step fits one device, and the step's compile time, per config and remat mode.

    python -m benchmarks max_batch --config configs/zebra_300m_gdn.py,configs/zebra_1b_gdn.py \
        [--remat none,full] [--memory-gib 125] [--jobs 4] [--out DIR]
    python -m benchmarks max_batch --steps 3 --sizes 96,112,128 --config configs/zebra_300m_gdn.py [--remat none]
    python -m benchmarks max_batch --smoke        # configs/demo.py on CPU, seq 32, a 0.04 GiB budget

**By real steps** (``--steps N``): per config and remat mode, ``python -m benchmarks train`` at each micro-batch of
``--sizes`` in turn (N timed steps after one untimed, a process each, with 95% of the GPU's memory for JAX), up to
the first size that fails (out of memory); the record ``max_batch_steps`` holds each size's tokens/s, MFU and peak
memory, and the largest size that ran. This is what the README's "largest micro-batch" cites: the compiler's peak
below is an estimate.

**By compiles** (the default):

Compile-only: nothing is allocated and no step runs. The real train step of ``benchmarks/train_throughput.py``
(``init_state``, ``make_train_step``, a one-device mesh, accumulation 1, so the global batch is the micro-batch
``m``) is lowered with ``ShapeDtypeStruct`` arguments carrying the state's shardings (``jax.eval_shape`` of
``init_state``) and a ``[m, seq_len + 1]`` int32 batch, compiled, and measured by the compiler's
``memory_analysis()``: peak = arguments + outputs - aliased (the donated state) + temporaries.

Per (config, remat): the first compile (m = 8) is timed alone, lowering + compilation, with the persistent
compilation cache off (the issue's "compile time"). Peak memory is about linear in m, so ``peak(m) = a + b m`` is
fitted through m = 8 and 16 and solved for the largest m on the grid (multiples of 8 from 16, of 4 from 4 to 12,
then 3, 2, 1) whose peak fits the budget (``--memory-gib``; default the device's ``memory_stats()["bytes_limit"]``,
i.e. what ``XLA_PYTHON_CLIENT_MEM_FRACTION`` leaves to JAX, else 139). That m is compiled to confirm it; when it
fits, the next grid sizes are tried until one does not, when it does not, the smaller ones until one fits (at most
``--extra-compiles`` more). After the timed first compiles, the other compiles of different (config, remat) pairs
run in ``--jobs`` threads. Prints a table and saves the record ``max_batch``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
from ml_collections import ConfigDict

from benchmarks import record
from hybrid_jax.config import load_config_file
from hybrid_jax.model import count_params
from hybrid_jax.train.trainer import build_trainer

GIB = 2**30
FIT_AT = (8, 16)  # micro-batches of the linear fit; the first is the timed compile
DEFAULT_GIB = 139.0  # an H200's memory when the device does not report its limit
SMOKE_GIB = 0.04
SMOKE_SEQ_LEN = 32


def load_config(path: str, *, remat: str, seq_len: int | None) -> ConfigDict:
    """``get_config()`` of ``path`` with ``model.remat = remat`` (and ``train.seq_len`` when given)."""
    config = load_config_file(path)
    config.model.remat = remat
    if seq_len is not None:
        config.train.seq_len = seq_len
    return config


def step_size(m: int) -> int:
    """Spacing of the micro-batch grid at ``m``: 8 from 16, 4 from 4, else 1."""
    return 8 if m >= 16 else 4 if m >= 4 else 1


def round_down(m: float) -> int:
    """The largest grid size <= ``m`` (0 when ``m < 1``)."""
    m = int(m)
    return m - m % step_size(m) if m >= 1 else 0


@dataclasses.dataclass
class Compile:
    """One compile at micro-batch ``m``: the compiler's byte counts and the lowering / compilation seconds."""

    m: int
    argument: int
    output: int
    alias: int
    temp: int
    lower_s: float
    compile_s: float

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


class StepProbe:
    """The train step of one config, lowered on abstract arguments at any micro-batch; results cached by ``m``."""

    def __init__(self, config: ConfigDict):
        self.config = config
        config.train.micro_batch_size = config.train.global_batch_size = FIT_AT[0]
        self.trainer = build_trainer(config, jax.devices()[:1], abstract=True)  # nothing is allocated
        self.compiles: dict[int, Compile] = {}

    def compile(self, m: int) -> Compile:
        """Lower and compile the step for a ``[m, seq_len + 1]`` batch (cached)."""
        if m not in self.compiles:
            batch = self.trainer.abstract_batch(self.config.train.seq_len, m, self.config.data.document_mask)
            t0 = time.perf_counter()
            lowered = self.trainer.step.lower(self.trainer.abstract_state, batch)
            t1 = time.perf_counter()
            stats = lowered.compile().memory_analysis()
            t2 = time.perf_counter()
            self.compiles[m] = Compile(
                m,
                stats.argument_size_in_bytes,
                stats.output_size_in_bytes,
                stats.alias_size_in_bytes,
                stats.temp_size_in_bytes,
                t1 - t0,
                t2 - t1,
            )
        return self.compiles[m]


def search(probe: StepProbe, limit: int, extra_compiles: int) -> dict:
    """Fit ``peak = a + b m`` at :data:`FIT_AT`, predict the largest fitting m, confirm it by compiling.

    Returns the fit, the prediction, ``confirmed_max_m`` (None when no compiled size fits) with its peak, and
    ``bounded``: whether the next grid size above it was compiled and does not fit.
    """
    (m0, p0), (m1, p1) = ((m, probe.compile(m).peak) for m in FIT_AT)
    slope = (p1 - p0) / (m1 - m0)
    if slope <= 0:
        raise RuntimeError(f"{probe.config.model.name}: peak does not grow with the micro-batch ({p0} -> {p1} bytes)")
    intercept = p0 - slope * m0
    predicted = round_down((limit - intercept) / slope)
    budget = extra_compiles + 1  # the confirming compile and the extra ones; sizes compiled already are free

    def fits(m: int) -> bool | None:
        """Whether ``m`` fits; None when it is not compiled and the budget is spent."""
        nonlocal budget
        if m not in probe.compiles:
            if budget == 0:
                return None
            budget -= 1
        return probe.compile(m).peak <= limit

    m = max(predicted, 1)
    best, bounded = None, False
    if fits(m):
        best = m
        while (ok := fits(best + step_size(best))) is not None:
            if not ok:
                bounded = True
                break
            best += step_size(best)
    else:
        while best is None and m > 1 and (ok := fits(m - step_size(m - 1))) is not None:
            m -= step_size(m - 1)
            best, bounded = (m, True) if ok else (None, False)
    return dict(
        fixed_gib=intercept / GIB,
        gib_per_sequence=slope / GIB,
        predicted_max_m=predicted,
        confirmed_max_m=best,
        confirmed_peak_gib=probe.compiles[best].peak / GIB if best is not None else None,
        bounded=bounded,
    )


def memory_limit(memory_gib: float | None) -> tuple[int, str]:
    """The budget in bytes and where it came from."""
    if memory_gib is not None:
        return int(memory_gib * GIB), "--memory-gib"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "memory_stats()['bytes_limit']"
    return int(DEFAULT_GIB * GIB), "default"


def row(probe: StepProbe, found: dict) -> dict:
    c = probe.config
    first = probe.compiles[FIT_AT[0]]
    return dict(
        config=c.model.name,
        remat=c.model.remat,
        params=count_params(c.model),
        seq_len=c.train.seq_len,
        zero1=c.train.zero1,
        compile_s=first.lower_s + first.compile_s,
        lower_s=first.lower_s,
        peak_gib_at={m: probe.compiles[m].peak / GIB for m in FIT_AT},
        **found,
        compiles=[
            dataclasses.asdict(x) | dict(peak_gib=x.peak / GIB)
            for x in sorted(probe.compiles.values(), key=lambda x: x.m)
        ],
    )


def table(rows: list[dict]) -> str:
    head = f"{'config':<26} {'remat':<5} {'compile s':>9} {'GiB@8':>7} {'GiB@16':>7} {'GiB/seq':>8} {'pred m':>6} "
    head += f"{'max m':>6} {'GiB@max':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        g8, g16 = (r["peak_gib_at"][m] for m in FIT_AT)
        best = "-" if r["confirmed_max_m"] is None else f"{r['confirmed_max_m']}{'' if r['bounded'] else '+'}"
        at_best = "-" if r["confirmed_peak_gib"] is None else f"{r['confirmed_peak_gib']:.2f}"
        lines.append(
            f"{r['config']:<26} {r['remat']:<5} {r['compile_s']:>9.1f} {g8:>7.2f} {g16:>7.2f} "
            f"{r['gib_per_sequence']:>8.3f} {r['predicted_max_m']!s:>6} {best:>6} {at_best:>8}"
        )
    return "\n".join(lines + ["(max m with '+': the next size up was not compiled, so it is a lower bound)"])


def by_steps(configs: list[str], remats: list[str], sizes: list[int], steps: int, out: Path) -> dict:
    """Real train steps at growing micro-batches, per (config, remat) up to the first size that fails."""
    rows = []
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    for path in configs:
        for remat in remats:
            runs, largest = [], None
            for m in sizes:
                name = f"fits_{Path(path).stem}_remat_{remat}_m{m}"
                cmd = [sys.executable, "-m", "benchmarks", "train", "--config", path, "--steps", str(steps),
                       "--warmup", "1", f"--config.train.micro_batch_size={m}", f"--config.model.remat={remat}",
                       "--name", name, "--out", str(out)]
                print(f"--- {Path(path).stem} remat {remat} micro-batch {m} {time.strftime('%H:%M:%S')}", flush=True)
                ok = subprocess.run(cmd, env=env).returncode == 0 and (out / f"{name}.json").is_file()
                if not ok:
                    runs.append(dict(micro_batch_size=m, ok=False))
                    break
                r = record.load(out / f"{name}.json")["figures"]
                runs.append(dict(micro_batch_size=m, ok=True, tokens_per_s=r["tokens_per_s"], mfu=r["mfu"],
                                 peak_memory_gib=r["peak_memory_gib"]))
                largest = m
            rows.append(dict(config=Path(path).stem, remat=remat, runs=runs, largest_that_ran=largest,
                             bounded=not runs[-1]["ok"]))
            print(json.dumps(rows[-1]), flush=True)
    return dict(steps=steps, rows=rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks max_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="config file(s); repeat or comma-separate")
    parser.add_argument("--remat", default=None, help="comma list of model.remat modes (default none,full)")
    parser.add_argument("--steps", type=int, default=0, help="real steps at each of --sizes instead of compiles")
    parser.add_argument("--sizes", default="", help="with --steps: comma list of micro-batches, tried in order")
    parser.add_argument("--memory-gib", type=float, default=None, help="budget (default: the device's limit)")
    parser.add_argument("--extra-compiles", type=int, default=2, help="compiles after the confirming one")
    parser.add_argument("--jobs", type=int, default=1, help="threads for the compiles after the timed first ones")
    parser.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    parser.add_argument("--smoke", action="store_true", help="configs/demo.py on CPU, seq 32, 0.04 GiB budget")
    args = parser.parse_args(argv)
    configs = [p for arg in args.config for p in arg.split(",") if p]
    if args.steps:
        if not configs or not args.sizes:
            parser.error("--steps needs --config and --sizes")
        remats = (args.remat or "none").split(",")
        result = by_steps(configs, remats, [int(m) for m in args.sizes.split(",")], args.steps,
                          record.out_dir(args.out))
        record.save("max_batch_steps", result, out=args.out)
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # before the backend starts
    jax.config.update("jax_enable_compilation_cache", False)  # time real compiles, not cache hits
    seq_len = None
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        configs = configs or [str(Path(__file__).resolve().parents[1] / "configs" / "demo.py")]
        seq_len, args.remat = SMOKE_SEQ_LEN, args.remat or "none"
        args.memory_gib = SMOKE_GIB if args.memory_gib is None else args.memory_gib
    if not configs:
        parser.error("--config is required (or --smoke)")
    limit, limit_source = memory_limit(args.memory_gib)
    probes = [
        StepProbe(load_config(path, remat=remat, seq_len=seq_len))
        for path in configs
        for remat in (args.remat or "none,full").split(",")
    ]
    for probe in probes:  # the timed first compiles, one at a time
        first = probe.compile(FIT_AT[0])
        print(
            f"{probe.config.model.name} remat={probe.config.model.remat}: first compile "
            f"{first.lower_s + first.compile_s:.1f} s, peak {first.peak / GIB:.2f} GiB at m={first.m}",
            flush=True,
        )
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(lambda p: search(p, limit, args.extra_compiles), probes))
    rows = [row(p, f) for p, f in zip(probes, found, strict=True)]
    result = dict(
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        memory_limit_gib=limit / GIB,
        memory_limit_source=limit_source,
        rows=rows,
    )
    print(table(rows), flush=True)
    record.save("max_batch", result, out=args.out)


if __name__ == "__main__":
    main()
