"""Write an export directory: weights (safetensors), config.json, modeling file (hf), tokenizer files, model card.

``export(workdir, out, step=None, fmt="hf", dtype="fp32")`` is what ``python -m hybrid_jax.export`` runs;
``export_model(model, config, out, ...)`` does the same for a model in memory (tests, notebooks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flax import nnx
from ml_collections import ConfigDict

from hybrid_jax import checkpoints
from hybrid_jax.config import to_json
from hybrid_jax.export import fla, hf
from hybrid_jax.export.tensors import DTYPES, ExportError, check_tensors, flat_params, save_safetensors
from hybrid_jax.model import count_params, layer_plan

FORMATS = ("hf", "fla")


def export_model(model: nnx.Module, config: ConfigDict, out: str | Path, *, fmt: str = "hf", dtype: str = "fp32",
                 step: int | None = None, metrics: list[dict] | None = None) -> Path:
    """Export ``model`` (built from ``config``) into ``out``; returns ``out``. Raises :class:`ExportError` (naming the
    offending key or option) before anything is written when a name or shape check fails."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown --format {fmt!r}; use one of {FORMATS}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown --dtype {dtype!r}; use one of {sorted(DTYPES)}")
    params = flat_params(model)
    torch_dtype = "float32" if dtype == "fp32" else "bfloat16"
    tokenizer = _tokenizer(config)
    bos, eos = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer else (None, None)
    if fmt == "fla":
        cfg = fla.fla_config(config.model, max_position_embeddings=hf.position_limit(config.model))
        cfg.update(torch_dtype=torch_dtype, bos_token_id=bos, eos_token_id=eos)
        tensors = fla.to_fla(params, config.model)
        check_tensors(tensors, fla.fla_shapes(cfg), "FLA export")
    else:
        cfg = hf.hf_config(config, torch_dtype=torch_dtype, bos_id=bos, eos_id=eos)
        tensors = hf.to_hf(params)
        check_tensors(tensors, hf.hf_shapes(cfg), "HF export")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors", dtype)
    hf.write_config(cfg, out)
    if fmt == "hf":
        hf.write_modeling_file(out)
    if tokenizer:
        write_tokenizer(config.data.tokenizer, out)
    (out / "README.md").write_text(model_card(config, fmt=fmt, dtype=dtype, step=step, metrics=metrics or []))
    return out


def export(workdir: str | Path, out: str | Path, *, step: int | None = None, fmt: str = "hf",
           dtype: str = "fp32") -> Path:
    """Export the checkpoint of ``workdir`` at ``step`` (default: the newest) into ``out``."""
    workdir = Path(workdir)
    step = checkpoints.latest_step(workdir) if step is None else step
    model, config = checkpoints.load(workdir, step)
    return export_model(model, config, out, fmt=fmt, dtype=dtype, step=step, metrics=read_metrics(workdir))


def read_metrics(workdir: Path) -> list[dict]:
    """The records of ``workdir/metrics.jsonl`` (empty if there is none)."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tokenizer(config: ConfigDict):
    """The run's tokenizer (``data.tokenizer`` or its data's manifest's; None for mock data), recorded in
    ``config.data.tokenizer`` so that the export's files and model card name it."""
    from hybrid_jax.data.run_tokenizer import run_tokenizer_path
    from hybrid_jax.data.tokenizer import load_tokenizer

    path = run_tokenizer_path(config)
    if path is None:
        return None
    config.data.tokenizer = path
    return load_tokenizer(path)


def write_tokenizer(path: str, out: Path) -> None:
    """Tokenizer files that ``AutoTokenizer.from_pretrained(out)`` reads, encoding as ``hybrid_jax`` does (no bos).

    SentencePiece ``.model``: the file plus a Llama tokenizer config; HF ``tokenizer.json``: copied (with its
    ``tokenizer_config.json``); tiktoken BPE: converted to a ``tokenizer.json`` by transformers' converter.
    """
    from hybrid_jax.data.tokenizer import detect_kind, llama3_special_tokens, resolve_path

    file = resolve_path(path)
    kind = detect_kind(file)
    if kind == "hf":
        shutil.copyfile(file, out / "tokenizer.json")
        if (file.parent / "tokenizer_config.json").is_file():
            shutil.copyfile(file.parent / "tokenizer_config.json", out / "tokenizer_config.json")
        return
    if kind == "sentencepiece":
        shutil.copyfile(file, out / "tokenizer.model")
        config = dict(tokenizer_class="LlamaTokenizer", add_bos_token=False, add_eos_token=False, legacy=True)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from hybrid_jax.data.tokenizer import LLAMA3_PATTERN

    specials = llama3_special_tokens()
    converted = TikTokenConverter(vocab_file=str(file), pattern=LLAMA3_PATTERN,
                                  extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token=specials[0], eos_token=specials[1])
    tok.save_pretrained(str(out))


def model_card(config: ConfigDict, *, fmt: str, dtype: str, step: int | None, metrics: list[dict]) -> str:
    """README.md of an export: what it is, how to load it, the config, the data, the steps and the final loss."""
    m, t, d = config.model, config.train, config.data
    losses = [r for r in metrics if r.get("loss") is not None]
    final = f"{losses[-1]['loss']:.4f} (step {losses[-1]['step']})" if losses else "not recorded (no metrics.jsonl)"
    load = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # runs DIR/modeling_hybrid.py\n"
            "# with hybrid_jax installed, without running the directory's code:\n"
            "# from hybrid_jax.export.hf_load import load_export; model = load_export(DIR)"
            + ("\ntokenizer = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)  # else transformers asks"
               if d.tokenizer else "")
            if fmt == "hf" else
            "import fla  # registers FLA's model types\nfrom transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(DIR)")
    data = f"{d.source}" + (f" from `{d.path}`" if d.path else "") + (f", tokenizer `{d.tokenizer}`" if d.tokenizer
                                                                     else ", no tokenizer")
    return "\n".join([
        f"# {m.name or 'hybrid_jax model'}",
        "",
        f"A hybrid recurrent-attention language model trained with hybrid_jax, exported in **{fmt}** format "
        f"({dtype} weights, safetensors).",
        "",
        f"- Parameters: {count_params(m) / 1e6:.2f}M; layer plan `{layer_plan(m)}` (`*` MLA, `-` MLP, "
        "`M`/`G`/`K`/`S` recurrent mixers)",
        f"- Data: {data}",
        f"- Steps: {step if step is not None else 'unknown'} of {t.steps} (global batch {t.global_batch_size} x "
        f"{t.seq_len} tokens)",
        f"- Final training loss: {final}",
        *([f"- Final validation loss: {vals[-1]['val_loss']:.4f} (step {vals[-1]['step']}, `{d.validation_path}`)"]
          if (vals := [r for r in metrics if r.get("val_loss") is not None]) else []),
        "",
        "## Load",
        "```python",
        load,
        "```",
        "",
        "## Training config",
        "```json",
        to_json(config),
        "```",
        "",
    ])
