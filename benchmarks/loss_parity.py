"""Loss parity with FLA (or our PyTorch export) over a short training run: same weights, batches and optimizer.

    python -m benchmarks loss_parity [--reference fla|hf] [--config configs/zebra_300m_gdn.py] [--steps 200] \
        [--batch 8] [--seq-len 2048] [--tol 0.01] [--data TOKENS_DIR] [--lift-fla-guard] [--reference-losses JSON] \
        [--out DIR]

Needs a GPU with ``flash-linear-attention`` and PyTorch; both frameworks share the GPU, so JAX is started without
preallocating its memory (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, set here; it otherwise takes 75% up front).
FLA's model of the config (``GatedDeltaNetForCausalLM`` or ``KDAForCausalLM``, built from our export's
``config.json`` fields) is initialised by FLA (seed 0), saved and imported into a fresh workdir with
:func:`hybrid_jax.export.import_fla`.
Then both train ``--steps`` steps on the same batches (our trainer's iterator: mock, or ``--data``) with the
recipe's optimizer (linear warmup over 10% of the steps, then cosine to ``min_lr``), float32 master weights and bf16
compute (ours: the config's dtype; the reference: autocast). Ours is the real trainer
(``hybrid_jax.train.loop.train``, a loss per step from ``metrics.jsonl``); the reference's is
``benchmarks/torch_parity.py``'s ``train_torch``, our optimizer in PyTorch.

FLA 0.6 refuses its gated backward on Hopper GPUs under Triton < 3.7.1 (a guard against a miscompile, FLA #640);
there the script stops with FLA's message, unless ``--lift-fla-guard``: then FLA's chunk kernel of the model's
mixer, at the model's head shapes and sequence length, is first checked with the guard lifted against our float32
PyTorch chunked recurrence (output and every input's gradient, :func:`check_fla_kernel`), and the guard is lifted
for the run only when that check passes (the check's errors are in the JSON).

``--data DIR``: token shards from ``python -m hybrid_jax.prepare`` (e.g. FineWeb with the config's tokenizer) instead
of the mock batches, so the curves are real learning curves (the mock batches follow a random Markov chain over the
whole vocabulary, which a 300M model barely learns in 200 steps: 11.97 -> 11.94).

``--reference hf`` trains our own init exported to HF format (``modeling_hybrid.py``: pure PyTorch, no Triton) with
the same loop instead: an independent implementation of the same model, which runs where FLA's guard refuses.
(On CPU, ``tests/export/test_train_parity.py`` checks that loop against our trainer in float32 to 2e-6.)

The reference's curve is written as soon as it is done (``OUT/loss_parity_REFERENCE_reference.json``, with a
digest of the initial weights), so a run cut off during our side keeps it; ``--reference-losses FILE`` then reuses
it instead of training the reference again. The initial weights are made again (FLA's init is seeded, ours is the
trainer's), and the run stops unless their digest and the run's settings equal the file's.

Pass: every step's relative loss difference <= ``--tol``. Saves the record ``loss_parity_REFERENCE`` (both curves)
and writes the plot ``loss_parity_REFERENCE.png`` beside it (``--out``, default ``$OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import record

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


GUARD_TOL = dict(out=1e-2, grad=5e-2)  # relative RMS, bf16 kernel vs float32; a miscompile is off by O(1)


def parity_config(path: str, *, steps: int, batch: int, seq_len: int, workdir: str, data: str | None = None):
    from hybrid_jax.config import load_config_file

    cfg = load_config_file(path)
    cfg.train.update(dict(steps=steps, global_batch_size=batch, micro_batch_size=batch, seq_len=seq_len,
                          warmup_steps=max(1, steps // 10), log_every=1, save_every=steps, workdir=workdir))
    if data:
        cfg.data.update(dict(source="tokens", path=data))
    return cfg


def check_fla_kernel(cfg, *, batch: int = 2) -> dict:
    """FLA's chunk kernel of ``cfg``'s mixer with its Hopper guard lifted, called as :mod:`benchmarks.fla_reference`
    times it (its inputs at the model's head shapes and ``train.seq_len``), against
    :func:`hybrid_jax.export.modeling_hybrid.chunked_recurrence` in float32 (tested against the token loop and our
    JAX kernels) on the same inputs: the relative RMS error of the output and of every input's gradient, and ``ok``
    when they are within :data:`GUARD_TOL`. Leaves the guard lifted."""
    import torch
    import torch.nn.functional as F

    from benchmarks.fla_reference import lift_hopper_guard, recurrent_case
    from hybrid_jax.export.fla import fla_kind
    from hybrid_jax.export.modeling_hybrid import chunked_recurrence
    from hybrid_jax.kernels.registry import OPS
    from hybrid_jax.kernels.tooling.errors import rel_rms
    from hybrid_jax.kernels.tooling.problems import Problem

    kind = fla_kind(cfg.model)
    c = cfg.model[kind]
    shape = Problem(kind, batch, cfg.train.seq_len, c.num_key_heads, c.num_value_heads, c.key_head_dim,
                    c.value_head_dim, name=f"{kind}_check")
    lift_hopper_guard()
    call, inputs, do = recurrent_case(shape)
    out = call(*inputs)[0]
    grads = torch.autograd.grad(out, inputs, do)

    def heads(x: torch.Tensor) -> torch.Tensor:  # value head i reads q/k head i // (HV // H), as FLA's layers do
        return x.repeat_interleave(shape.HV // shape.H, dim=2)

    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    q, k, v, g, beta = ref_inputs
    ref = chunked_recurrence(F.normalize(heads(q), dim=-1), F.normalize(heads(k), dim=-1), v, g, beta,
                             shape.K**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_inputs, do.float())

    def err(x: torch.Tensor, r: torch.Tensor) -> float:
        return rel_rms(x.detach().float().cpu().numpy(), r.detach().float().cpu().numpy())

    errors = dict(out=err(out, ref), **{f"d{n}": err(a, b) for n, a, b in zip(
        ("q", "k", "v", "g", "beta"), grads, ref_grads, strict=True)})
    ok = errors["out"] <= GUARD_TOL["out"] and all(e <= GUARD_TOL["grad"] for n, e in errors.items() if n != "out")
    return dict(kernel=OPS[shape.op].function, shape=dataclasses.asdict(shape),
                errors=errors, tol=GUARD_TOL, ok=ok, triton=__import__("triton").__version__,
                device=torch.cuda.get_device_name())


def fla_model(cfg, tmp: Path):
    """FLA's randomly initialised model of ``cfg`` (float32, on the GPU), saved under ``tmp/fla_init``."""
    import fla  # noqa: F401  (registers FLA's model types with transformers)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_jax.export.fla import ARCHITECTURES, fla_config, fla_kind

    fields = {k: v for k, v in fla_config(cfg.model).items() if k not in ("model_type", "architectures")}
    fla_cfg = AutoConfig.for_model(ARCHITECTURES[fla_kind(cfg.model)][0], **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(fla_cfg).cuda()
    model.save_pretrained(tmp / "fla_init", safe_serialization=True)
    return model


def hf_model(cfg, tmp: Path):
    """Our model of ``cfg`` as the trainer initialises it, exported to HF format (pure PyTorch, float32; on the GPU
    when there is one, so the script can also be tried on CPU with a tiny config)."""
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from hybrid_jax.export.writer import export_model
    from hybrid_jax.model import HybridLM

    export_model(HybridLM(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), cfg, tmp / "hf", fmt="hf")
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", trust_remote_code=True, dtype=torch.float32)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def weights_digest(folder: Path) -> str:
    """SHA-256 of the ``*.safetensors`` files in ``folder`` (in name order): the same digest means the same weights."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def saved_reference(saved: dict, settings: dict, name: str) -> tuple[list[float], float]:
    """The reference's losses and wall time from an earlier run's ``loss_parity_REFERENCE_reference.json``
    (``saved``), named ``name`` in errors; SystemExit unless every field of ``settings`` (the run's settings and
    initial weights' digest) equals the file's and the file has a loss for every step."""
    differ = {k: dict(this_run=v, file=saved.get(k)) for k, v in settings.items() if saved.get(k) != v}
    if differ:
        raise SystemExit(f"--reference-losses {name} comes from another run: {differ}")
    losses = saved.get("reference_losses") or []
    if len(losses) != settings["steps"]:
        raise SystemExit(f"--reference-losses {name} has {len(losses)} losses for {settings['steps']} steps")
    return losses, saved["reference_wall_s"]


def train_ours(cfg) -> list[float]:
    from hybrid_jax.train.loop import train

    train(cfg, log=lambda message: print(message, flush=True) if isinstance(message, str) else None)
    records = [json.loads(line) for line in (Path(cfg.train.workdir) / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    return [by_step[s] for s in range(1, cfg.train.steps + 1)]


def plot(ours: list[float], theirs: list[float], path: Path, name: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(ours) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    top.plot(steps, theirs, label=name, lw=1.5)
    top.plot(steps, ours, label="hybrid_jax", lw=1.0, ls="--")
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.plot(steps, 100 * (np.asarray(ours) - np.asarray(theirs)) / np.asarray(theirs))
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel(f"hybrid_jax - {'FLA' if name == 'FLA' else 'export'} (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks loss_parity", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG_DIR / "zebra_300m_gdn.py"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--reference", choices=("fla", "hf"), default="fla",
                    help="fla: FLA's model and init; hf: our exported pure-PyTorch model (no Triton), our init")
    ap.add_argument("--data", default=None, help="token shards (python -m hybrid_jax.prepare) instead of mock batches")
    ap.add_argument("--lift-fla-guard", action="store_true",
                    help="fla: lift FLA's Hopper guard on its gated backward if its kernel passes check_fla_kernel")
    ap.add_argument("--reference-losses", default=None, metavar="JSON",
                    help="the reference's curve from an earlier run's loss_parity_REFERENCE_reference.json "
                         "(same settings and initial weights) instead of training the reference again")
    ap.add_argument("--out", default=None, help="the record's folder (default $OUT)")
    args = ap.parse_args(argv)
    if os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false") != "false":
        raise SystemExit("JAX must start without preallocating (XLA_PYTHON_CLIENT_PREALLOCATE=false): JAX and "
                         "PyTorch share the GPU in this script")

    import jax

    from benchmarks.torch_parity import train_torch
    from hybrid_jax.data import DataStream
    from hybrid_jax.export import import_fla
    from hybrid_jax.train.step.optim import learning_rate_schedule

    out = record.out_dir(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = parity_config(args.config, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                            workdir=str(tmp / "run"), data=args.data)
        saved = json.loads(Path(args.reference_losses).read_text()) if args.reference_losses else None
        guard = saved.get("guard_check") if saved else None
        if args.reference == "fla" and args.lift_fla_guard and not saved:
            guard = check_fla_kernel(cfg)
            print(f"FLA kernel check with the guard lifted: {json.dumps(guard)}", flush=True)
            if not guard["ok"]:
                record.save("loss_parity_fla", dict(ok=False, guard_check=guard), out=out)
                raise SystemExit("FLA's kernel fails the check with its guard lifted: no parity run")
        if args.reference == "fla":
            model, init = fla_model(cfg, tmp), tmp / "fla_init"
            cfg = import_fla(init, tmp / "run", cfg)  # ours starts from FLA's weights
        else:
            model, init = hf_model(cfg, tmp), tmp / "hf"  # ours starts from its own init (same seed), exported
        import torch

        settings = dict(config=cfg.model.name, reference=args.reference, steps=args.steps, batch=args.batch,
                        seq_len=args.seq_len, data=args.data or "mock", init_digest=weights_digest(init))
        if saved:
            theirs, ref_s = saved_reference(saved, settings, args.reference_losses)
            print(f"reference curve from {args.reference_losses} ({len(theirs)} steps)", flush=True)
        else:
            data = DataStream.open(cfg)
            batches = [np.asarray(next(data).tokens) for _ in range(args.steps)]
            schedule = learning_rate_schedule(cfg.train)
            t0 = time.perf_counter()
            try:
                theirs = train_torch(model, batches, cfg.train, lambda step: float(schedule(step)),
                                     autocast_dtype=torch.bfloat16,
                                     log=lambda s: print(f"{args.reference} {s} ({time.perf_counter() - t0:.1f} s)"))
            except RuntimeError as e:  # e.g. FLA refusing its gated backward on Hopper under Triton < 3.7.1
                failure = dict(ok=False, error=str(e), guard_check=guard)
                record.save(f"loss_parity_{args.reference}", failure, out=out)
                raise SystemExit(f"the reference's training step failed, no parity run: {e}") from None
            ref_s = time.perf_counter() - t0
            (out / f"loss_parity_{args.reference}_reference.json").write_text(json.dumps(
                dict(settings, guard_check=guard, reference_wall_s=ref_s, reference_losses=theirs), indent=1))
        del model
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        ours = train_ours(cfg)
        ours_s = time.perf_counter() - t0
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)) / np.asarray(theirs)
    result = dict(settings, guard_check=guard, device=jax.devices()[0].device_kind, tol=args.tol,
                  max_rel_diff=float(diff.max()), max_rel_diff_step=int(diff.argmax()) + 1,
                  mean_rel_diff=float(diff.mean()), ok=bool(diff.max() <= args.tol),
                  first=(ours[0], theirs[0]), last=(ours[-1], theirs[-1]),
                  reference_wall_s=ref_s, ours_wall_s=ours_s, ours=ours, reference_losses=theirs)
    print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "reference_losses")}), flush=True)
    record.save(f"loss_parity_{args.reference}", result, out=out)
    name = "FLA" if args.reference == "fla" else "our HF export (PyTorch)"
    plot(ours, theirs, out / f"loss_parity_{args.reference}.png", name,
         f"{cfg.model.name}: same init, same batches, {args.batch} x {args.seq_len} tokens/step")


if __name__ == "__main__":
    main()
