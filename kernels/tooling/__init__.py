"""The kernel tooling that the doctor, the tuner, the benchmarks and the kernel tests share (tokamax's arg_specs +
bench shape), one file per concept:

    problems.py   Problem: the shapes of one kernel call (op, B, T, H, HV, K, V, dtype, chunk, scale, name)
    inputs.py     inputs(problem) with the models' gate law (or FLA's, for timings), cotangents(problem)
    calls.py      call / fwd_bwd of a problem's kernel with an impl (or a launch config), the value-and-gradient check
    errors.py     rel_rms, the one error measure, and the tolerances (TOLERANCE, AT_MODEL_SHAPES)
    timing.py     median_ms / back_to_back_ms, the one timer
    stages.py     each recurrent launch stage's arguments and time alone
    sweep.py      Search and sweep: the one coordinate-descent launch search, with a numerics check
    lowering.py   lowering for a GPU that is not there: StableHLO text and each launch's Triton IR

Nothing is imported here, so that ``benchmarks/fla_reference.py`` can import the problems alone.
"""
