"""The jitted train step: data parallel (8 host devices), ZeRO-1 and accumulation equal one device; NaN skipping."""

import jax
import numpy as np
import pytest

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.train.stops import TooManySkippedSteps, check_skipped
from hybrid_jax.train.trainer import build_trainer
from tests.train.common import tiny_config


def _setup(n_devices: int, *, zero1: bool = False, micro: int = 2, fsdp: int = 1, context: int = 1):
    # eps 1e-4: Adam divides each gradient by its own magnitude, so a gradient component that is ~0 would become
    # +-lr on either side of a rounding-level difference; a larger eps keeps the comparison about the step itself.
    config = tiny_config(micro_batch_size=micro, zero1=zero1, warmup_steps=0, eps=1e-4, seed=0)
    config.mesh.fsdp = fsdp
    config.mesh.context = context
    trainer = build_trainer(config, jax.devices()[:n_devices])
    return config, trainer, trainer.state, trainer.step, trainer.accum


def _batches(config, n: int) -> list[Batch]:
    rng = np.random.default_rng(0)
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    return [Batch(rng.integers(0, config.model.vocab_size, shape, dtype=np.int32)) for _ in range(n)]


_RUNS: dict = {}


def _run(n_devices: int, *, zero1: bool = False, micro: int = 2, fsdp: int = 1, context: int = 1):
    """Two steps on fixed batches; returns ``(config, trainer, state, step, losses, accum)`` (cached per setting)."""
    key = (n_devices, zero1, micro, fsdp, context)
    if key not in _RUNS:
        config, trainer, state, step, accum = _setup(n_devices, zero1=zero1, micro=micro, fsdp=fsdp, context=context)
        losses = []
        for batch in _batches(config, 2):
            state, metrics = step(state, trainer.put(batch))
            losses.append(float(metrics["loss"]))
        _RUNS[key] = config, trainer, state, step, losses, accum
    return _RUNS[key]


@pytest.mark.parametrize(
    "zero1,micro,fsdp,want_accum",
    # plain data parallel; ZeRO-1 with accumulation over fsdp 2 x data 4; ZeRO-3 fsdp 4 x data 2 with ZeRO-1
    # (test_fsdp.py reuses the last one's run)
    [(False, 2, 1, 1), (True, 1, 2, 2), (True, 2, 4, 1)],
)
def test_data_parallel_step_equals_single_device(zero1, micro, fsdp, want_accum):
    _, _, ref_state, _, ref_losses, ref_accum = _run(1, micro=16)
    assert ref_accum == 1
    ref_params = jax.device_get(ref_state["params"])
    _, _, state, _, losses, accum = _run(8, zero1=zero1, micro=micro, fsdp=fsdp)
    assert accum == want_accum
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_params)
    for (path, want), got in zip(flat_ref, jax.tree.leaves(jax.device_get(state["params"])), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    # parameters replicated (split over fsdp when > 1); with ZeRO-1 the Adam moments are split over all 8 devices
    for p in jax.tree.leaves(state["params"]):
        assert p.sharding.is_fully_replicated or (fsdp > 1 and p.addressable_shards[0].data.size == p.size // fsdp)
    mu = state["opt_state"][1][0].mu
    big = [x for x in jax.tree.leaves(mu) if x.size >= 1024]
    assert big
    for x in big:
        if zero1:
            assert "data" in str(x.sharding.spec), x.sharding
            assert x.addressable_shards[0].data.size == x.size // 8
        else:
            assert x.sharding.is_fully_replicated


def test_non_finite_batch_is_skipped_bit_identically():
    config, trainer, state, step, _, _ = _run(8)
    del _RUNS[(8, False, 2, 1, 1)]  # its state is donated below
    good, bad = _batches(config, 2)
    bad.tokens[3, 5] = config.model.vocab_size  # an out-of-range token id: its embedding lookup is NaN
    put = trainer.put
    before = jax.device_get(dict(params=state["params"], opt_state=state["opt_state"]))
    state, metrics = step(state, put(bad))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    assert int(metrics["skipped"]) == 1 and int(metrics["skipped_in_a_row"]) == 1
    after = jax.device_get(dict(params=state["params"], opt_state=state["opt_state"]))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)
    assert int(state["step"]) == 3
    state, metrics = step(state, put(good))
    assert bool(metrics["finite"]) and int(metrics["skipped"]) == 1 and int(metrics["skipped_in_a_row"]) == 0


def test_run_stops_after_too_many_skips_in_a_row():
    warnings = []
    bad = lambda n: dict(finite=np.bool_(False), skipped_in_a_row=np.int32(n), skipped=np.int32(n))
    check_skipped(4, bad(2), 3, warnings.append)  # below the limit: a warning only
    assert warnings == ["step 4: non-finite loss, gradient or update, update skipped (2 in a row, 2 in total)"]
    with pytest.raises(TooManySkippedSteps, match="3 steps in a row.*max_skipped_in_a_row=3"):
        check_skipped(5, bad(3), 3, warnings.append)


def test_step_lowers_ahead_of_time_from_abstract_state():
    """``step.lower`` compiles for shape-only arguments (what the max-batch benchmark does), with the shardings, and
    the compiled step reports a memory analysis that grows with the batch."""
    config = tiny_config(zero1=True)
    trainer = build_trainer(config, jax.devices()[:2], abstract=True)
    assert trainer.state is None

    def temp_bytes(batch: int) -> int:
        tokens = trainer.abstract_batch(config.train.seq_len, batch)
        compiled = trainer.step.lower(trainer.abstract_state, tokens).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert 0 < temp_bytes(config.train.global_batch_size) < temp_bytes(4 * config.train.global_batch_size)


def test_finite_loss_and_gradient_with_an_overflowing_update_is_skipped():
    """lr 1e30: the step's loss and gradient are finite but the update overflows float32 -> skipped, weights kept."""
    config = tiny_config(lr=1e30, min_lr=0.0, warmup_steps=0, micro_batch_size=16, seed=0)
    trainer = build_trainer(config, jax.devices()[:1])
    state = trainer.state
    before = jax.device_get(state["params"])
    state, metrics = trainer.step(state, trainer.put(_batches(config, 1)[0]))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["lr"]) == pytest.approx(1e30, rel=1e-6)
    assert not bool(metrics["finite"]) and int(metrics["skipped"]) == 1 and int(metrics["skipped_in_a_row"]) == 1
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state["params"])), strict=True):
        np.testing.assert_array_equal(x, y)


def test_step_xla_options_per_architecture_and_the_users_flags_stand(monkeypatch):
    """sm90 compiles the step without XLA's Triton GEMMs; other architectures get no options; a flag the user's
    ``XLA_FLAGS`` sets (with or without a value) is theirs, and a flag of a longer name does not count."""
    from types import SimpleNamespace

    from hybrid_jax.train.step.train_step import step_xla_options

    h200 = SimpleNamespace(device_kind="NVIDIA H200", platform="gpu")
    mi300 = SimpleNamespace(device_kind="AMD Instinct MI300X", platform="rocm")
    assert step_xla_options(jax.devices()[0]) == {}  # first: XLA starts here and reads XLA_FLAGS, which then change
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm_any=true")
    assert step_xla_options(h200) == {"xla_gpu_enable_triton_gemm": False} and step_xla_options(mi300) == {}
    for flags in ("--xla_gpu_enable_triton_gemm=true", "--a=1 --xla_gpu_enable_triton_gemm"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert step_xla_options(h200) == {}
