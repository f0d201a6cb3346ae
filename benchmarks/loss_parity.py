"""Loss parity with FLA over a short training run: same initial weights, same batches, same optimizer.

    python3 -m benchmarks.loss_parity [--config configs/zebra_300m_gdn.py] [--steps 200] [--batch 8] \
        [--seq-len 2048] [--tol 0.01]

Needs a GPU with ``flash-linear-attention`` and PyTorch; both frameworks share the GPU, so run it with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX otherwise takes 75% of the memory up front). FLA's model of the
config (``GatedDeltaNetForCausalLM`` or ``KDAForCausalLM``, built from our export's ``config.json`` fields) is
initialised by FLA (seed 0), saved and imported into a fresh workdir with :func:`hybrid_jax.export.import_fla`. Then
both train ``--steps`` steps on the same mock batches (our trainer's iterator) with the recipe's optimizer: AdamW
(``b1, b2, eps``, weight decay on tensors of 2+ dims except ``A_log`` / ``dt_bias`` / ``D``), global-norm clip,
linear warmup (10% of the steps) then cosine to ``min_lr``, float32 master weights and bf16 compute (ours: the
config's dtype; FLA: autocast). Ours is the real trainer (``hybrid_jax.train.loop.train``, a loss per step from
``metrics.jsonl``); FLA's is a plain PyTorch loop whose learning rate is read from our schedule at each step and
whose loss is the float32 cross-entropy of its logits.

FLA 0.6 refuses its gated backward on Hopper GPUs under Triton < 3.7.1 (a correctness guard); there the script
stops with FLA's message (no parity run is possible without a newer Triton or tilelang).

Pass: every step's relative loss difference <= ``--tol``. Writes ``$OUT/loss_parity.json`` (both curves) and
``$OUT/loss_parity.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
NO_DECAY = ("A_log", "dt_bias", "D")


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("parity_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def parity_config(path: str, *, steps: int, batch: int, seq_len: int, workdir: str):
    cfg = load_config(path)
    cfg.train.update(dict(steps=steps, global_batch_size=batch, micro_batch_size=batch, seq_len=seq_len,
                          warmup_steps=max(1, steps // 10), log_every=1, save_every=steps, workdir=workdir))
    return cfg


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


def train_fla(model, cfg, batches: list[np.ndarray], lr_at) -> list[float]:
    """PyTorch training of ``model`` on ``batches`` ([B, T+1] token arrays); the loss before each update."""
    import torch
    import torch.nn.functional as F

    t = cfg.train
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith(NO_DECAY)]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and not n.endswith(NO_DECAY))]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=t.weight_decay), dict(params=rest, weight_decay=0.0)],
                            lr=0.0, betas=(t.b1, t.b2), eps=t.eps, fused=True)
    losses = []
    for step, batch in enumerate(batches):
        x = torch.from_numpy(batch).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0:
            print(f"fla step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    return losses


def train_ours(cfg) -> list[float]:
    from hybrid_jax.train.loop import train

    train(cfg, log=lambda *a: None)
    records = [json.loads(line) for line in (Path(cfg.train.workdir) / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    return [by_step[s] for s in range(1, cfg.train.steps + 1)]


def plot(ours: list[float], theirs: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(ours) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    top.plot(steps, theirs, label="FLA (PyTorch)", lw=1.5)
    top.plot(steps, ours, label="hybrid_jax", lw=1.0, ls="--")
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    bottom.plot(steps, 100 * (np.asarray(ours) - np.asarray(theirs)) / np.asarray(theirs))
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("ours - FLA (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG_DIR / "zebra_300m_gdn.py"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false":
        raise SystemExit("set XLA_PYTHON_CLIENT_PREALLOCATE=false: JAX and PyTorch share the GPU in this script")

    import jax

    from hybrid_jax.data import make_train_iterator
    from hybrid_jax.export import import_fla
    from hybrid_jax.train.optim import learning_rate_schedule

    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = parity_config(args.config, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                            workdir=str(tmp / "run"))
        model = fla_model(cfg, tmp)
        cfg = import_fla(tmp / "fla_init", tmp / "run", cfg)
        data = make_train_iterator(cfg)
        batches = [np.asarray(next(data)) for _ in range(args.steps)]
        schedule = learning_rate_schedule(cfg.train)
        t0 = time.perf_counter()
        try:
            theirs = train_fla(model, cfg, batches, lambda step: float(schedule(step)))
        except RuntimeError as e:  # e.g. FLA refusing its gated backward on Hopper under Triton < 3.7.1
            (out / "loss_parity.json").write_text(json.dumps(dict(ok=False, error=str(e)), indent=1))
            raise SystemExit(f"FLA's training step failed, no parity run: {e}") from None
        fla_s = time.perf_counter() - t0
        del model
        import torch

        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        ours = train_ours(cfg)
        ours_s = time.perf_counter() - t0
    diff = np.abs(np.asarray(ours) - np.asarray(theirs)) / np.asarray(theirs)
    result = dict(config=cfg.model.name, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
                  device=jax.devices()[0].device_kind, tol=args.tol, max_rel_diff=float(diff.max()),
                  max_rel_diff_step=int(diff.argmax()) + 1, mean_rel_diff=float(diff.mean()),
                  ok=bool(diff.max() <= args.tol), first=(ours[0], theirs[0]), last=(ours[-1], theirs[-1]),
                  fla_wall_s=fla_s, ours_wall_s=ours_s, ours=ours, fla=theirs)
    print(json.dumps({k: v for k, v in result.items() if k not in ("ours", "fla")}), flush=True)
    (out / "loss_parity.json").write_text(json.dumps(result, indent=1))
    plot(ours, theirs, out / "loss_parity.png",
         f"{cfg.model.name}: FLA init, same batches, {args.batch} x {args.seq_len} tokens/step")


if __name__ == "__main__":
    main()
