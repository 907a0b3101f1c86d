"""Hypothesis profiles and the shape limits that go with each."""
from hypothesis import HealthCheck, settings

LIMITS = {  # largest drawn sizes per profile
    "ci": dict(max_n=40, max_d=32, max_bh=6, long_n=80),
    "gpu": dict(max_n=4096, max_d=256, max_bh=64, long_n=16384),
    "thorough": dict(max_n=4096, max_d=256, max_bh=128, long_n=32768),
}
_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=4, derandomize=True, **_common)
settings.register_profile("gpu", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=400, **_common)
