"""A user's tuning file (kernels/tuning_file.py): its entries change the launches the kernels are lowered with; a
stale, malformed or missing file is reported or refused with a message that says what is wrong."""

import json

import jax
import jax.numpy as jnp
import pytest

from hybrid_jax.kernels import tuning, tuning_file
from hybrid_jax.kernels.recurrent import chunk_recurrence
from tests.conftest import jaxpr_equations


@pytest.fixture(autouse=True)
def builtin_after():
    yield
    tuning_file.use("auto")  # the test cache is empty: the built-in table again


def launches(K: int = 16, V: int = 32) -> dict[str, tuple[int, int]]:
    """(num_warps, num_stages) of every pallas_call of a GDN forward + backward, by kernel name."""
    args = [jnp.ones((1, 32, 1, K)), jnp.ones((1, 32, 1, K)), jnp.ones((1, 32, 2, V)), -jnp.ones((1, 32, 2)),
            jnp.ones((1, 32, 2))]
    loss = lambda *xs: chunk_recurrence(*xs, chunk_size=16, interpret=True)[0].sum()
    eqns = jaxpr_equations(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr)
    return {str(e.params["name"]): (e.params["compiler_params"].num_warps,
                                    e.params["compiler_params"].num_stages)
            for e in eqns if e.primitive.name == "pallas_call"}


def tuned(tmp_path, **fields):
    cfg = tuning.override(tuning.recurrent_config(tuning.current_arch()), "wy.num_warps=2,wy.num_stages=3,"
                          "grad.num_warps=8,grad.num_stages=2")
    entry = {"op": "gdn", "K": 16, "V": 32, "config": cfg, "tuned_ms": 1.0, "builtin_ms": 1.5}
    path = tuning_file.write(tmp_path / "t.json", recurrent=[entry])
    if fields:
        data = json.loads(path.read_text())
        data.update(fields)
        path.write_text(json.dumps(data))
    return path


def test_a_tuning_file_changes_the_launches_the_kernels_are_lowered_with(tmp_path):
    builtin = launches()
    path = tuned(tmp_path)
    assert tuning_file.use(str(path)) == f"tuning file {path}"
    got = launches()
    assert got["wy_fwd"] == (2, 3) and got["grad_bwd"] == (8, 2)
    assert builtin["wy_fwd"] != (2, 3) and set(got) == set(builtin)
    assert got["state_fwd"] == builtin["state_fwd"]  # what the file leaves alone stays the table's
    assert launches(K=32)["wy_fwd"] == builtin["wy_fwd"]  # a shape the file has no entry for: the table
    assert tuning_file.missing([("gdn", 16, 32), ("kda", 32, 64)]) == [("kda", 32, 64)]
    assert tuning_file.use("builtin") == ("built-in fallback (on cpu, kernel_impl=auto runs the kernels' XLA form: "
                                         "nothing to tune)")  # issue 49 item 3: no tune hint where tuning is moot
    assert launches()["wy_fwd"] == builtin["wy_fwd"]


@pytest.mark.parametrize("fields, reason", [
    ({"versions": {"jax": "0.0.1", "jaxlib": "0.0.1", "triton": None}}, "other versions (jax 0.0.1 ->"),
    ({"device_kind": "AMD Instinct MI300X"}, "made on 'AMD Instinct MI300X'"),
])
def test_a_stale_file_is_reported_and_ignored_whole(tmp_path, fields, reason):
    builtin = launches()
    line = tuning_file.use(str(tuned(tmp_path, **fields)))
    assert "is stale" in line and reason in line and "python -m hybrid_jax.tune" in line
    assert tuning_file.active() is None and launches() == builtin


def test_auto_takes_this_gpus_cached_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_JAX_TUNING_DIR", str(tmp_path / "cache"))
    path = tuning_file.cache_path()
    assert path.parent == tmp_path / "cache" and path.name == f"{jax.devices()[0].device_kind}.json"
    assert not tuning_file.use("auto").startswith("tuning file")
    path.parent.mkdir(parents=True)
    tuned(tmp_path).replace(path)
    assert tuning_file.use("auto") == f"tuning file {path}" and launches()["wy_fwd"] == (2, 3)
    path.write_text("{not json")  # a broken cached file: said, and the table used
    assert "cannot be read as JSON" in tuning_file.use("auto") and tuning_file.active() is None


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("format"), "not a hybrid_jax.tuning/1 file"),
    (lambda d: d["recurrent"][0]["config"].update(block_k=64), "unknown fields ['block_k']"),
    (lambda d: d["recurrent"][0]["config"]["wy"].update(num_warps="4"), "recurrent[0].config.wy.num_warps"),
    (lambda d: d["recurrent"][0].update(op="mamba"), "needs 'op'"),
])
def test_a_malformed_file_is_refused_with_what_is_wrong(tmp_path, edit, message):
    path = tuned(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(tuning_file.TuningFileError, match=str(path)) as e:
        tuning_file.use(str(path))
    assert message in str(e.value)
    with pytest.raises(tuning_file.TuningFileError, match="no such file"):
        tuning_file.use(str(tmp_path / "missing.json"))


def test_training_names_its_table_and_refuses_a_missing_file_before_building_anything(tmp_path):
    from hybrid_jax.train.config_checks import ConfigError
    from hybrid_jax.train.loop import train
    from tests.conftest import load_config

    config = load_config("demo")
    config.train.workdir = str(tmp_path / "run")
    config.train.micro_batch_size = config.train.global_batch_size // jax.device_count()
    config.model.tuning = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="model.tuning: tuning file .*missing.json: no such file"):
        train(config, log=lambda *_: None)
    assert not (tmp_path / "run" / "checkpoints").exists()
