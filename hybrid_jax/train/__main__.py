"""``python -m hybrid_jax.train --config configs/X.py [--config.train.steps=N --config.train.workdir=DIR ...]``.

The config is locked: an unknown key (with the nearest known ones) or a value of the wrong type is an error before
anything runs, and so is every problem the trainer can see before building the model (values, data, tokenizer,
validation data, tuning file, an existing checkpoint's shapes): one line, no traceback, no workdir created. The
resolved config is printed and saved as ``WORKDIR/config.json``; a rerun in the same workdir resumes from its newest
complete checkpoint. An empty ``train.workdir`` means ``runs/<model.name>``. ``--show-config`` lists every key
with its value and meaning and exits.

Exit status: 0 done; 1 an error; 130 / 143 stopped by SIGINT / SIGTERM after saving a checkpoint (rerun to resume).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "a config file (configs/*.py)", lock_config=True)
_FORCE = flags.DEFINE_bool("force", False, "train even when the start-up memory estimate says the step cannot fit")
_SHOW = flags.DEFINE_bool("show_config", False, "list every config key with its value, default and meaning, and "
                          "exit (also --show-config)")


def _unknown_key(argv: list[str], name: str) -> str:
    """The one-line error for an unknown config key ``name``, with the nearest known keys."""
    from hybrid_jax.config_help import nearest_keys

    culprit = [a for a in argv if a.startswith("--config.") and name in a.split("=")[0].split(".")]
    dotted = culprit[0].split("=")[0].removeprefix("--config.") if culprit else name
    near = nearest_keys(dotted)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return (f"error: unknown config key '{name}' in {culprit[0] if culprit else argv[1:]}{hint} "
            "(--show-config lists every key)")


def _config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config X`` or ``--config=X``; the last one, as absl takes it)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.removeprefix("--config=")
    return found


def _flag_error(text: str) -> str:
    """absl's message for a bad flag value, with a wrapped exception's tuple (``('Non-boolean argument to boolean
    flag', 'yes')``) said as words."""
    head, _, detail = text.partition(": ")
    try:
        parts = ast.literal_eval(detail)
    except (ValueError, SyntaxError):
        return text
    if isinstance(parts, tuple) and parts and isinstance(parts[0], str):
        if "boolean" in parts[0]:
            return f"{head}: not a boolean (true or false)"
        return f"{head}: {parts[0]} {parts[1:] or ''}".rstrip()
    return text


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors for a config file that cannot be loaded, unknown config keys and
    unparsable values."""
    argv = ["--show_config" if a == "--show-config" else a for a in argv]
    path = _config_path(argv)
    if path is not None and not Path(path).is_file():
        sys.exit(f"error: --config {path}: no such file (the configs are in configs/, e.g. configs/demo.py)")
    try:
        return flags.FLAGS(argv)
    except SyntaxError as e:
        sys.exit(f"error: --config {path}: line {e.lineno}: {e.msg}")
    except (KeyError, AttributeError) as e:
        if "get_config" in str(e):
            sys.exit(f"error: --config {path} defines no get_config(): a config file is a Python module whose "
                     "get_config() returns the run's ConfigDict (see configs/demo.py)")
        while isinstance(e, BaseException) and e.args:  # ml_collections wraps the KeyError in an AttributeError
            e = e.args[0]
        sys.exit(_unknown_key(argv, str(e).split()[0].strip("\"'")))
    except flags.Error as e:
        sys.exit(f"error: {_flag_error(str(e))}")
    except Exception as e:  # noqa: BLE001 - the config file's own code failed
        sys.exit(f"error: --config {path}: get_config() failed ({type(e).__name__}: {e})")


def main(argv: list[str]) -> None:
    from hybrid_jax.train.stops import watch_signals

    watch_signals()  # Ctrl-C answered from here on, also inside long native calls
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides look like --config.train.steps=100")
    logging.set_verbosity(logging.ERROR)  # keep Orbax's and JAX's INFO and WARNING lines out of the progress output
    try:
        config = _CONFIG.value
    except OSError as e:  # the file was readable when the flags were parsed, then failed to load
        sys.exit(f"error: --config: {e}")
    if _SHOW.value:
        from hybrid_jax.config_help import show_config

        print(show_config(config))
        return
    from hybrid_jax.train.step.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # before anything touches the devices

    import jax

    from hybrid_jax.checkpoints import RUN_ERRORS
    from hybrid_jax.data.shards import DatasetError
    from hybrid_jax.train.config_checks import ConfigError
    from hybrid_jax.train.loop import train
    from hybrid_jax.train.stops import Interrupted, TooManySkippedSteps, out_of_memory_message

    if not config.train.workdir:
        config.train.workdir = f"runs/{config.model.name or 'run'}"
    try:
        train(config, force=_FORCE.value)
    except (ConfigError, DatasetError, TooManySkippedSteps, *RUN_ERRORS) as e:
        sys.exit(f"error: {e}")
    except Interrupted as e:
        print(str(e), file=sys.stderr, flush=True)
        sys.exit(e.exit_status)
    except Exception as e:  # a device out-of-memory: one line naming the knobs to turn; anything else re-raises
        if (line := out_of_memory_message(e, config, jax.device_count())) is None:
            raise
        sys.exit(f"error: {line}")
    except KeyboardInterrupt:  # before the first step: nothing was trained, nothing to save
        print("interrupted before the first step; nothing to save", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags)
