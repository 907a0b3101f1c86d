"""The pytest plugin of the conformance suite: its command-line options.

Registered through the `pytest11` entry point (pyproject.toml), as Hypothesis registers its
own, so that `pytest --pyargs conformance --impl mypkg.attn:fn` works from any directory once
the project is installed: pytest reads options before it finds conformance/conftest.py,
which does everything else (and only when the suite itself is collected: other test runs
see the options and nothing more).
"""
ENV_IMPL = "FLASH_CONFORMANCE_IMPL"


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "flash-conformance property suite")
    group.addoption("--impl", default=None,
                    help=f"implementation under test: a verify adapter name (numba, "
                         f"torch-efficient, ...) or MODULE:CALLABLE; default ${ENV_IMPL} or numba")
    group.addoption("--profile", default=None, choices=["ci", "gpu", "thorough"],
                    help="Hypothesis profile; default gpu on a GPU, else ci")
    group.addoption("--max-examples", type=int, default=None,
                    help="examples per property, overriding the profile's")
    group.addoption("--backward", action="store_true",
                    help="also test the gradients (dq, dk, dv): the implementation's own "
                         "(Implementation.grad), or through autograd or jax.vjp for torch "
                         "and JAX implementations")
    group.addoption("--world-size", type=int, default=None,
                    help="run the implementation on N ranks (verify/distributed.py's per-rank "
                         "protocol: gloo processes on a CPU, one GPU a rank): every property "
                         "holds of the whole result, and the sharding properties run")
    group.addoption("--shard-layout", default="zigzag",
                    help="how the ranks' rows are taken, with --world-size: contiguous, "
                         "zigzag (the default) or MODULE:FUNCTION (function(n, world_size) -> "
                         "each rank's (start, stop) ranges)")
    group.addoption("--no-shrink", action="store_true",
                    help="report the first failing example as drawn, without shrinking it "
                         "(for surveys of kernels that fail often: shrinking large inputs "
                         "takes many calls)")
