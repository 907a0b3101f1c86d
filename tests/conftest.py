"""Without a GPU, the Numba kernel runs in the CUDA simulator (set before numba is imported)."""
from verify.device import use_simulator_if_no_gpu

use_simulator_if_no_gpu()
