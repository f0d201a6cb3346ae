"""1B KDA + MLA hybrid at seq 65536 (issue 51, long context): ``zebra_1b_kda_hybrid``'s model and schedule with each
sequence split over 8 GPUs.

Mesh on 8 GPUs: ``data 1 x fsdp 1 x context 8`` (``mesh.context=8``, ``mesh.data=-1`` fills): each GPU holds 8192
tokens of one sequence (micro batch 1); KDA's state and short convs pass between the shards, MLA gathers its
compressed latent and runs the flash kernel on its queries at their offset (docs/usage.md, "Long sequences:
mesh.context"). 8 sequences per step through 8 accumulation micro-batches: 524,288 tokens, the 8k recipe's 64 x 8192.
On 16 GPUs ``mesh.data=-1`` gives data 2 x context 8 (raise ``train.global_batch_size`` to keep the accumulation).
Every sublayer is rematerialised (``model.remat="full"``).

RoPE stays the 8k recipe's (theta 5e5, no YaRN: ``model.mla.rope_scaling_factor`` would stretch it when extending an
8k checkpoint). The per-device memory plan comes from ``python -m benchmarks plan_memory --config
configs/zebra_1b_kda_hybrid_64k.py`` on the 8 GPUs (``--cpu`` compiles it for 8 host CPU devices instead: an
indication only; the numbers, with their command, are in benchmarks/NOTES.md).
"""

from pathlib import Path

from hybrid_jax.config import load_config_file


def get_config():
    c = load_config_file(Path(__file__).with_name("zebra_1b_kda_hybrid.py"))
    c.model.update(dict(name="zebra_1b_kda_hybrid_64k", remat="full"))
    c.mesh.context = 8
    c.train.update(dict(seq_len=65536, global_batch_size=8, micro_batch_size=1))
    return c
