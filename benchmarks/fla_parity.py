"""FLA-side parity on a GPU with ``flash-linear-attention`` installed (pure GDN and pure KDA, bf16).

    python benchmarks/fla_parity.py [--kinds gdn,kda] [--out results.json]

For each kind, on a small model (hidden 512, 4 FLA layers = 8 of our sublayers, Llama-2 vocabulary size):

1. **Export -> FLA.** Our random-init model is exported with ``--format fla`` and loaded by FLA's own class
   (``GatedDeltaNetForCausalLM`` / ``KDAForCausalLM``) in bf16 on the GPU; its logits are compared with ours (bf16
   compute, Pallas kernels) on the same tokens. Pass: relative RMS error <= 2e-2.
2. **FLA init -> ours.** FLA's randomly initialised model (``tie_word_embeddings=True``) is saved and imported with
   ``import_fla`` into a fresh workdir; one step of our real trainer runs from it. Its logged step-1 loss (the loss
   of the imported weights on the first mock batch) is compared with FLA's loss on that same batch, and the imported
   model's logits with FLA's. Pass: loss relative difference <= 2e-3 and logits relative RMS error <= 2e-2.

Prints one JSON object per kind and writes them all to ``--out`` (or ``$OUT/fla_parity.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx

from hybrid_jax.config import base_config
from hybrid_jax.data import make_train_iterator
from hybrid_jax.export import export_model, import_fla
from hybrid_jax.export.fla import ARCHITECTURES
from hybrid_jax.model import HybridLM

LOGITS_TOL, LOSS_TOL = 2e-2, 2e-3  # random-init losses sit near ln(vocab): the logits check is the sharper one


def small_config(kind: str, workdir: str = ""):
    c = base_config()
    c.model.update(dict(name=f"fla_parity_{kind}", vocab_size=32000, hidden_size=512, num_layers=8, mixer=kind,
                        ffn_size=1536, dtype="bfloat16"))
    if kind == "gdn":
        c.model.gdn.update(dict(num_key_heads=4, num_value_heads=8, key_head_dim=64, value_head_dim=64))
    else:  # FLA's KDA has one gate per key head: no grouped value heads
        c.model.kda.update(dict(num_key_heads=8, num_value_heads=8, key_head_dim=64, value_head_dim=64))
    c.train.update(dict(steps=1, global_batch_size=8, micro_batch_size=8, seq_len=512, warmup_steps=0, log_every=1,
                        save_every=1, workdir=workdir))
    c.mesh.data = 1
    return c


def fla_class(kind: str):
    import fla  # noqa: F401  (registers FLA's model types with transformers)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM, ARCHITECTURES[kind][0]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def export_to_fla(kind: str, tmp: Path) -> dict:
    cfg = small_config(kind)
    model = HybridLM(cfg.model, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 256), dtype=np.int32)
    ours = np.asarray(jax.jit(lambda t: model(t))(tokens), np.float32)
    export_model(model, cfg, tmp / "export", fmt="fla", dtype="bf16")
    auto, _ = fla_class(kind)
    theirs_model = auto.from_pretrained(tmp / "export", dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        theirs = theirs_model(input_ids=torch.from_numpy(tokens).long().cuda()).logits.float().cpu().numpy()
    err = rel_err(theirs, ours)
    return dict(check="export_to_fla", kind=kind, rel_rms_err=err, max_abs_err=float(np.abs(theirs - ours).max()),
                tol=LOGITS_TOL, ok=err <= LOGITS_TOL)


def fla_init_first_loss(kind: str, tmp: Path) -> dict:
    from transformers import AutoConfig

    from hybrid_jax.export.fla import fla_config
    from hybrid_jax.train.load import load
    from hybrid_jax.train.loop import train

    cfg = small_config(kind, workdir=str(tmp / "run"))
    auto, model_type = fla_class(kind)
    fla_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in fla_config(cfg.model).items()
                                                  if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    fla_model = auto.from_config(fla_cfg).cuda()
    fla_model.save_pretrained(tmp / "fla_init", safe_serialization=True)
    cfg = import_fla(tmp / "fla_init", tmp / "run", cfg)
    batch = next(make_train_iterator(cfg))  # the trainer's first batch: [B, T+1]
    imported, _ = load(tmp / "run", step=0)
    ours_logits = np.asarray(jax.jit(lambda t: imported(t))(batch[:2, :-1]), np.float32)
    record = train(cfg, log=lambda *a: None)  # resumes from the imported step-0 checkpoint, runs step 1
    fla_model = fla_model.to(torch.bfloat16).eval()
    with torch.no_grad():
        inputs = torch.from_numpy(batch[:, :-1]).long().cuda()
        logits = fla_model(input_ids=inputs).logits.float()
        fla_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   torch.from_numpy(batch[:, 1:]).long().cuda().reshape(-1)).item()
    ours = record["loss"]
    diff = abs(ours - fla_loss) / fla_loss
    logits_err = rel_err(ours_logits, logits[:2].cpu().numpy())
    return dict(check="fla_init_first_loss", kind=kind, ours=ours, fla=fla_loss, rel_diff=diff, tol=LOSS_TOL,
                logits_rel_rms_err=logits_err, ok=diff <= LOSS_TOL and logits_err <= LOGITS_TOL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="gdn,kda")
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "fla_parity.json"))
    args = p.parse_args()
    results = []
    for kind in args.kinds.split(","):
        for check in (export_to_fla, fla_init_first_loss):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    result = check(kind, Path(tmp))
                except Exception as e:  # report and go on with the other checks
                    result = dict(check=check.__name__, kind=kind, ok=False, error=f"{type(e).__name__}: {e}")
            print(json.dumps(result), flush=True)
            results.append(result)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
