"""Up-front checks of the files a run reads, before the model is built and before the workdir is created.

:func:`check_inputs` looks at the training data (manifest, vocabulary, enough tokens for a batch), the tokenizer
(fills ``data.tokenizer`` from the manifest when it is empty), the validation data, the kernels' tuning file and,
when the workdir already holds checkpoints, the saved parameter shapes (from the checkpoint's metadata, against the
model's abstract shapes). Every problem is a :class:`~hybrid_jax.train.validate.ConfigError` with one line that says
what to change; what is fine comes back as notes for the trainer to print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from hybrid_jax.data.run_tokenizer import NoTokenizer, tokenizer_from_manifest
from hybrid_jax.data.shards import read_manifest
from hybrid_jax.data.tokenizer import check_vocab, file_sha256, resolve_path
from hybrid_jax.train.validate import ConfigError


@dataclass
class Inputs:
    """What the checks found: notes to print, the validation windows (or None), the newest checkpoint step."""

    notes: list[str] = field(default_factory=list)
    windows: np.ndarray | None = None
    resume_step: int | None = None


def check_inputs(config: ConfigDict, batch_shards: int) -> Inputs:
    """Check every file ``config`` reads (module docstring); may fill ``config.data.tokenizer``."""
    out = Inputs()
    out.notes += _check_tokenizer_and_data(config)
    if config.data.validation_path and config.train.eval_every:
        from hybrid_jax.train.evaluate import load_windows

        out.windows, note = load_windows(config, batch_shards)
        out.notes.append(note)
    out.notes.append(_check_tuning(config))
    out.resume_step = _check_checkpoint(config)
    return out


def _check_tokenizer_and_data(config: ConfigDict) -> list[str]:
    d, notes = config.data, []
    if d.tokenizer:
        try:
            resolve_path(d.tokenizer)
        except FileNotFoundError as e:
            raise ConfigError(f"data.tokenizer: {e}") from None
    if d.source != "tokens":
        return notes + ([] if d.tokenizer else ["data: mock (a random Markov chain); the run has no tokenizer"])
    try:
        manifest = read_manifest(d.path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.path: {e}") from None
    try:
        check_vocab(config.model.vocab_size, manifest["vocab_size"], what=f"the tokenizer of {d.path}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = config.train
    windows = manifest["num_tokens"] // (t.seq_len + 1)
    if windows < t.global_batch_size:
        raise ConfigError(f"data.path={d.path} holds {manifest['num_tokens']:,} tokens: {windows} windows of "
                          f"train.seq_len + 1 = {t.seq_len + 1}, fewer than one batch (train.global_batch_size="
                          f"{t.global_batch_size}); prepare more documents or lower the batch or seq_len")
    recorded = manifest["tokenizer"]
    if d.tokenizer:
        if file_sha256(d.tokenizer) != recorded["sha256"]:
            raise ConfigError(f"data.tokenizer={d.tokenizer} is not the tokenizer {d.path} was prepared with "
                              f"({recorded['path']}, sha256 {recorded['sha256'][:12]}...)")
        return notes + [f"data: {d.path} ({manifest['num_tokens']:,} tokens), tokenizer {d.tokenizer}"]
    try:
        d.tokenizer = tokenizer_from_manifest(d.path)
    except NoTokenizer as e:
        return notes + [f"warning: {e}; until then the run records no tokenizer"]
    return notes + [f"data: {d.path} ({manifest['num_tokens']:,} tokens), tokenizer {d.tokenizer} (from its manifest)"]


def _check_tuning(config: ConfigDict) -> str:
    from hybrid_jax.kernels import tuning_file

    try:
        return f"kernel launch configs: {tuning_file.use(config.model.tuning)}"
    except tuning_file.TuningFileError as e:
        raise ConfigError(f"model.tuning: {e}") from None


def _check_checkpoint(config: ConfigDict) -> int | None:
    """The newest checkpoint step of the workdir (None if none), after comparing its saved parameter shapes with the
    model's (read from the checkpoint's metadata; nothing is restored or allocated)."""
    from hybrid_jax.checkpoints import CHECKPOINTS, CheckpointReader, check_shapes

    if not (Path(config.train.workdir) / CHECKPOINTS).is_dir():
        return None
    with CheckpointReader(config.train.workdir) as reader:
        step = reader.latest_step()
        if step is None:
            return None
        saved = reader.manager.item_metadata(step)["state"]
    saved = getattr(saved, "tree", saved)
    try:
        check_shapes(_abstract_params(config.model), saved.get("params", {}), prefix="params/")
    except ValueError as e:
        raise ConfigError(f"{config.train.workdir} step {step}: {e}; or use a new train.workdir") from None
    return step


def _abstract_params(model_cfg: ConfigDict) -> dict:
    from flax import nnx

    from hybrid_jax.model import HybridLM

    _, params = nnx.split(nnx.eval_shape(lambda: HybridLM(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return nnx.to_pure_dict(params)
