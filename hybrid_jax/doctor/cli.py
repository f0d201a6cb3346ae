"""The command: what this machine runs on, every kernel problem checked under a line of progress each, one training
step per given config, a table on the console and the same as JSON; the exit status says whether all is well."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from hybrid_jax.doctor.checks import check
from hybrid_jax.kernels import tuning, tuning_file
from hybrid_jax.kernels.registry import OPS
from hybrid_jax.kernels.tooling.errors import AT_MODEL_SHAPES
from hybrid_jax.kernels.tooling.problems import Problem
from hybrid_jax.model.kernel_calls import problems_of, published_configs

PROG = "python -m hybrid_jax.doctor"
FALLBACK = "if a kernel fails, train with the XLA forms: --config.model.kernel_impl=xla (slower, same math)"


class DoctorError(ValueError):
    """Bad input, said in one line before anything is compiled."""


def versions() -> dict[str, str | None]:
    """jax, jaxlib, the jax GPU plugins installed (jax-cuda* / jax-rocm*) and Triton."""
    out = {name: None for name in ("jax", "jaxlib")}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ("jax", "jaxlib", "triton") or re.match(r"jax-(cuda|rocm)", name):
            out[name] = dist.version
    out.setdefault("triton", None)
    return out


def environment(tuning_source: str) -> dict:
    """Platform, device kind and count, the built-in table key, the tuning source in use, versions, memory."""
    dev = jax.devices()[0]
    arch = tuning.current_arch()
    stats = dev.memory_stats() or {}
    gib = lambda key: round(stats[key] / 2**30, 2) if key in stats else None  # noqa: E731
    return dict(platform=dev.platform, device_kind=dev.device_kind, devices=jax.device_count(),
                table=arch if arch != "fallback" else "no table: fallback",
                tuning=tuning_file.use(tuning_source), versions=versions(),
                driver=getattr(dev.client, "platform_version", None),
                memory_gib=dict(limit=gib("bytes_limit"), in_use=gib("bytes_in_use"), peak=gib("peak_bytes_in_use")))


def _parse(argv):
    ap = argparse.ArgumentParser(prog=PROG, description="Check that every kernel a config uses lowers, runs, "
                                 "matches its references and is fast on this device; time one training step.")
    ap.add_argument("--config", action="append", help="a run config (configs/X.py; repeatable); default: every "
                    "configs/zebra_*.py (kernels only)")
    ap.add_argument("--json", help="also write the report as JSON here")
    ap.add_argument("--tuning", help="auto | builtin | a tuning file (default: the config's model.tuning)")
    ap.add_argument("--kernels", help=f"only these kernels (comma-separated: {', '.join(OPS)})")
    ap.add_argument("--speed", action="store_true", help="time the kernels and the step on CPU too")
    ap.add_argument("--no-speed", action="store_true", help="skip the kernel timings")
    ap.add_argument("--no-train-step", action="store_true", help="skip the training step")
    ap.add_argument("--batch", type=int, help="kernel batch cap (default 2; interpret mode 1)")
    ap.add_argument("--seq-len", type=int, help="kernel sequence length cap (default 2048; interpret mode 37)")
    ap.add_argument("--repeats", type=int, default=10, help="timing samples per measurement")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode at tiny shapes (implied on CPU)")
    return ap.parse_args(argv)


def plan(args):
    """Check the arguments -> (configs by name, the kernel problems with the config names that have them,
    interpret mode)."""
    from hybrid_jax.config import load_config_file

    for flag in ("batch", "seq_len", "repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise DoctorError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    only = set(args.kernels.split(",")) if args.kernels else set(OPS)
    if only - set(OPS):
        raise DoctorError(f"--kernels: unknown {sorted(only - set(OPS))} (known: {', '.join(OPS)})")
    paths = [Path(c) for c in args.config] if args.config else published_configs()
    if not paths:
        raise DoctorError("no configs/zebra_*.py here: pass --config configs/X.py")
    interpret = args.interpret or jax.default_backend() == "cpu"
    configs, problems = {}, {}
    for path in paths:
        if not path.is_file():
            raise DoctorError(f"--config {path}: no such file")
        try:
            cfg = load_config_file(path)
            found = problems_of(cfg, batch=args.batch or (1 if interpret else 2),
                                seq_len=args.seq_len or (37 if interpret else 2048), max_heads=2 if interpret else None)
        except Exception as e:  # noqa: BLE001 - said in one line
            raise DoctorError(f"--config {path}: cannot be loaded ({type(e).__name__}: {e})") from None
        configs[path.stem] = cfg
        for p in (c for c in found if c.op in only):
            problems.setdefault(p, []).append(path.stem)
    return configs, problems, interpret


def _impls(p: Problem, interpret: bool) -> list[str]:
    """``pallas`` (``pallas_interpret``), plus ``auto`` for attention where ``auto`` picks another kernel (cuDNN)."""
    if interpret:
        return ["pallas_interpret"]
    if p.op == "attention":
        from hybrid_jax.kernels.cudnn_attention import auto_impl

        q = jnp.zeros((1, 1, p.H, p.K), p.dtype)
        if auto_impl(q, jnp.zeros((1, 1, p.H, p.V), p.dtype)) != "pallas":
            return ["pallas", "auto"]
    return ["pallas"]


def _ms(speed: dict | None, impl: str, what: str) -> str:
    if not speed:
        return "-"
    return f"{speed[f'{impl}_{what}_ms']:.3f} / {speed[f'xla_{what}_ms']:.3f} ({speed[f'{what}_speedup']:.2f}x)"


def _print_table(console, table) -> None:
    """A table at its natural width when the output is not a terminal (a pipe or a log is never cut to 80
    columns); in a terminal, cells fold rather than being cut."""
    for column in table.columns:
        column.overflow = "fold"
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    width, natural = console.width, Measurement.get(console, console.options.update_width(100_000), table).maximum
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


def _report(console, env: dict, results: list[dict], steps: list[dict]) -> None:
    from rich.table import Table

    info = Table("environment", "", show_header=False)
    for key in ("platform", "device_kind", "devices", "table", "tuning", "driver"):
        info.add_row(key, str(env[key]))
    info.add_row("versions", ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    info.add_row("memory GiB", ", ".join(f"{k} {v}" for k, v in env["memory_gib"].items()))
    _print_table(console, info)
    table = Table("kernel", "impl", "shape", "configs", "lowers", "vs XLA (worst)", "vs naive (worst)",
                  "fwd ms ours / XLA", "fwd+bwd ms ours / XLA", "ok")
    for r in results:
        worst = lambda e: "-" if not e else "{} {:.1e}".format(*max(e.items(), key=lambda kv: kv[1]))  # noqa: E731
        table.add_row(r["kernel"], r["impl"], r["shape"], ", ".join(r["configs"]), "yes" if r["lowers"] else "NO",
                      worst(r.get("errors_xla")), worst(r.get("errors_naive")), _ms(r.get("speed"), r["impl"], "fwd"),
                      _ms(r.get("speed"), r["impl"], "fwd_bwd"), "ok" if r["ok"] else "[bold red]FAIL")
    _print_table(console, table)
    if steps:
        st = Table("train step", "impl", "micro batch x seq", "step s", "tokens/s", "MFU", "peak GiB", "ok")
        for s in steps:
            st.add_row(s["config"], s.get("kernel_impl", "-"), f"{s['micro_batch_size']} x {s.get('seq_len', '-')}",
                       str(s.get("step_s", "-")), f"{s['tokens_per_s']:,.0f}" if "tokens_per_s" in s else "-",
                       f"{s['mfu']:.1%}" if s.get("mfu") else "-", str(s.get("peak_memory_gib") or "-"),
                       "ok" if s["ok"] else "[bold red]FAIL")
        _print_table(console, st)


def main(argv: list[str] | None = None) -> int:
    """Run the doctor; returns the exit status (0: every check passed)."""
    from rich.console import Console

    args = _parse(argv)
    console, t0 = Console(), time.perf_counter()
    try:
        configs, problems, interpret = plan(args)
        source = args.tuning or (next(iter(configs.values())).model.tuning if len(configs) == 1 else "auto")
        env = environment(source)
    except (DoctorError, tuning_file.TuningFileError) as e:
        console.print(f"{PROG}: error: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2
    speed = not args.no_speed and (args.speed or not interpret)
    console.print(f"{env['device_kind']} ({env['platform']}, table {env['table']}); launch configs: {env['tuning']}"
                  f"{'; Pallas interpret mode at tiny shapes' if interpret else ''}", markup=False, highlight=False,
                  soft_wrap=True)
    results = []
    for p, names in problems.items():
        for impl in _impls(p, interpret):
            start = time.perf_counter()
            with console.status(f"{p.name} ({impl}) at {p.shape}"):
                r = dict(check(p, impl, speed=speed, repeats=args.repeats), configs=names)
            r["seconds"] = round(time.perf_counter() - start, 2)
            results.append(r)
            console.print(f"  {r['kernel']} ({impl}): {'ok' if r['ok'] else 'FAIL'} ({r['seconds']:.1f} s)",
                          markup=False, highlight=False, soft_wrap=True)
    steps = []
    if args.no_train_step or not args.config or (interpret and not args.speed):
        why = ("--no-train-step" if args.no_train_step else "no --config" if not args.config
               else "CPU: --speed times it")
        console.print(f"  training step skipped ({why})", markup=False, highlight=False, soft_wrap=True)
    else:
        from hybrid_jax.doctor.train_step import train_step

        for name, cfg in configs.items():
            with console.status(f"one training step of {name}"):
                steps.append(train_step(cfg))
    _report(console, env, results, steps)
    failures = [f"{r['kernel']} ({r['impl']}, {', '.join(r['configs'])}): {f}" for r in results for f in r["failures"]]
    failures += [f"training step of {s['config']}: {s['error']}" for s in steps if not s["ok"]]
    tolerance = {dtype: dataclasses.asdict(t) for dtype, t in AT_MODEL_SHAPES.items()}
    report = dict(ok=not failures, environment=env, tolerance=tolerance, kernels=results, train_steps=steps,
                  failures=failures, problems=[dict(dataclasses.asdict(c), configs=n) for c, n in problems.items()],
                  seconds=round(time.perf_counter() - t0, 1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    for f in failures:
        console.print(f"FAILED {f}", markup=False, highlight=False, soft_wrap=True)
    if failures:
        console.print(FALLBACK, markup=False, highlight=False, soft_wrap=True)
        return 1
    console.print(f"all {len(results)} kernel checks passed in {report['seconds']:.0f} s", markup=False,
                  highlight=False, soft_wrap=True)
    return 0
