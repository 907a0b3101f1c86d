"""Run pytest with the given arguments, then list each kernel variant this process launched:
the seconds its first launches took (compiling or loading) and Numba's disk-cache hits and
misses, with the argument layouts it was built for.

    FLASH_KERNEL_CACHE=DIR python scripts/dev/cache_report.py conformance -x ...
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402


def main():
    rc = pytest.main(sys.argv[1:])
    from numba_kernels import compile_cache, launch

    from numba_kernels.specs import build_kernel, shipped_specs, signature

    expected = {build_kernel(s): signature(s) for s in shipped_specs()}
    for kernel, folder in list(compile_cache._FOLDERS.items()):
        print(f"{os.path.basename(folder)} hits {sum(kernel._cache_hits.values())} misses "
              f"{sum(kernel._cache_misses.values())}")
        for sig in kernel._cache_misses:
            want = expected.get(kernel)
            diff = [(i, str(a), str(b)) for i, (a, b) in enumerate(zip(sig, want or sig))
                    if a != b]
            print(f"   missed {len(sig)} types; differs from signature(spec) at {diff}")
    for key, seconds in sorted(launch.COMPILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        print(f"{seconds:6.2f} s {key}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
