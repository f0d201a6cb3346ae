"""``python -m hybrid_jax.train --config configs/X.py [--config.train.steps=N --config.train.workdir=DIR ...]``.

The config is locked: an unknown key or a value of the wrong type is an error before anything runs. The
resolved config is printed and saved as ``WORKDIR/config.json``; a rerun in the same workdir resumes from
its newest complete checkpoint. An empty ``train.workdir`` means ``runs/<model.name>``.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "a config file (configs/*.py)", lock_config=True)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors for unknown config keys and unparsable values."""
    try:
        return flags.FLAGS(argv)
    except (KeyError, AttributeError) as e:
        while isinstance(e, BaseException) and e.args:  # ml_collections wraps the KeyError in an AttributeError
            e = e.args[0]
        name = str(e).split()[0].strip("\"'")
        culprit = [a for a in argv if a.startswith("--config.") and name in a.split("=")[0].split(".")]
        sys.exit(f"error: unknown config key '{name}' in {culprit[0] if culprit else argv[1:]}; "
                 "the keys are those of hybrid_jax/config.py")
    except flags.Error as e:
        sys.exit(f"error: {e}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides look like --config.train.steps=100")
    logging.set_verbosity(logging.WARNING)  # keep Orbax's and JAX's INFO lines out of the progress output
    from hybrid_jax.train.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()  # before anything touches the devices

    from hybrid_jax.train.loop import TooManySkippedSteps, train
    from hybrid_jax.train.resume import RUN_ERRORS
    from hybrid_jax.train.validate import ConfigError

    config = _CONFIG.value
    if not config.train.workdir:
        config.train.workdir = f"runs/{config.model.name or 'run'}"
    try:
        train(config)
    except (ConfigError, TooManySkippedSteps, *RUN_ERRORS) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=parse_flags)
