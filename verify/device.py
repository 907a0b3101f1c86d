"""Where kernels run: a real GPU when one is present, else Numba's CUDA simulator."""
import os


def gpu_present():
    """True when an NVIDIA driver is loaded (checked without importing numba or torch)."""
    return os.path.exists("/dev/nvidiactl")


def gpu_count():
    """The NVIDIA GPUs present (their device nodes, /dev/nvidia0, 1, ...), without starting
    CUDA."""
    import glob

    return len([p for p in glob.glob("/dev/nvidia[0-9]*") if p[len("/dev/nvidia"):].isdigit()])


def use_simulator_if_no_gpu():
    """Without a GPU, run Numba kernels in the CUDA simulator. Must run before numba.cuda is
    imported; returns True when the simulator is (or already was) chosen."""
    if not gpu_present():
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
