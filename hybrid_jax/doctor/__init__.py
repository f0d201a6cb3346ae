"""Check the kernels on this device: do they lower, run, match their references, and how fast are they.

    python -m hybrid_jax.doctor [--config configs/X.py] [--json PATH] [--tuning auto|builtin|PATH]
                                [--kernels gdn,kda,gla,attention] [--no-train-step]
                                [--speed | --no-speed] [--batch 2] [--seq-len 2048]

Says what it runs on (platform, device kind, the built-in table key, the tuning source in use, jax / jaxlib /
plugin / Triton versions, device memory), then for each kernel the config uses (GDN, KDA, Mamba2's SSD as ``gla`` and
MLA's attention; without ``--config``, every published config's, deduplicated) at the config's shapes in its compute
dtype at its chunk size: whether the Pallas kernel lowers and runs; its values and the gradients of every input against
the float32 chunked XLA form (batch 2, T up to 2048) and against the token-by-token recurrence at a ragged T = 37, on
inputs with the model's gates (relative RMS, ``kernels/tooling/errors.py``'s ``AT_MODEL_SHAPES``: bf16 forward <=
1e-2, gradients <= 2e-2; float32 1e-4 and 1e-3); forward and forward + backward time against the XLA form on the same
inputs. With ``--config``: one training step (tokens/s, MFU, peak memory) at the config's micro batch or the largest
that fits. A table on the console, the same as JSON with ``--json``. Any failure is said with the fallback
(``--config.model.kernel_impl=xla``) and the exit status is 1.
On CPU (or with ``--interpret``) the kernels run in Pallas interpret mode at tiny shapes (batch 1, T 37, at most 2
heads) and nothing is timed unless ``--speed``: a check that the command works, in seconds.
"""
