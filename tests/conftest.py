"""Without a GPU, the Numba kernel runs in the CUDA simulator (set before numba is imported)."""
import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
