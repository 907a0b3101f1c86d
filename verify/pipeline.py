"""The steps of a case after its inputs are drawn: one call with the checks that hold for every
call (call_and_check), the values against the float64 truth after naming what fully masked
rows give (judge_result), and the verdict. runner.py, checks.py and backward.py share them.
"""
import numpy as np

from .calling import Fail, bits, call, to_impl, unpack
from .cases import sample_rows, visibility
from .criterion import judge
from .report import CaseResult


def call_and_check(impl, case, seed, inputs):
    """One call (two with case.repeat) on inputs converted for impl, with the checks that
    hold for every call: inputs unchanged, output not aliasing an input, determinism."""
    args, kwargs = to_impl(impl, case, inputs)
    if case.sampled:  # billions of elements: values only, on the sampled rows
        result = call(impl, args, kwargs)
        return (inputs, *unpack(impl, case, result, args, rows=sample_rows(case)), [])
    before = [bits(x) for x in args]
    result = call(impl, args, kwargs)
    out, lse = unpack(impl, case, result, args)
    if not all(np.array_equal(b, bits(x)) for b, x in zip(before, args)):
        raise Fail("the call wrote into its inputs")
    if case.repeat:
        out2, lse2 = unpack(impl, case, call(impl, args, kwargs), args)
        if not (np.array_equal(bits(out), bits(out2))
                and (lse is None or np.array_equal(bits(lse), bits(lse2)))):
            raise Fail("two runs on the same inputs differ")
    return inputs, out, lse, []


def judge_result(impl, case, seed, inputs, out, lse, notes, seconds):
    """The values against the float64 truth, after naming what fully masked rows give."""
    q, k, v, options = inputs
    if case.sampled:
        comparisons = judge(q, k, v, out, lse, dtype=case.dtype, rows=sample_rows(case),
                            **options)
        return verdict(case, seed, comparisons, notes, seconds)
    empty = empty_rows(q, k, v, options)
    if empty.any():
        convention = fully_masked_convention(out, q, k, v, empty, options)
        notes = notes + [f"fully masked rows give {convention}"]
        if convention != "zeros" and convention == impl.supports.fully_masked:
            out = np.where(empty[..., None], 0.0, out)  # the declared convention: judge the rest
            if lse is not None:
                lse = np.where(empty, -np.inf, lse)
    *truth_qkv, truth_options = _for_truth(q, k, v, options)
    comparisons = judge(*truth_qkv, out, lse, dtype=case.dtype, **truth_options)
    return verdict(case, seed, comparisons, notes, seconds)


def verdict(case, seed, comparisons, notes, seconds):
    failed = [c for c in comparisons if not c.passed]
    detail = "\n".join([c.message() for c in failed] + notes)
    return CaseResult(case, seed, "fail" if failed else "pass", detail, comparisons, seconds)


def _for_truth(q, k, v, options):
    """(q, k, v, **options) for the float64 truth: on the GPU through CuPy when there is one
    (bfloat16 as float32 holding the same values), else the NumPy arrays as they are."""
    from .device import gpu_present

    if not gpu_present():
        return q, k, v, options
    try:
        import cupy
    except ImportError:
        return q, k, v, options

    def wide(x):
        return x.astype(np.float32) if str(x.dtype) == "bfloat16" else x

    on_gpu = {n: cupy.asarray(wide(a)) if n in ("mask", "bias") else a
              for n, a in options.items()}
    return (*(cupy.asarray(wide(x)) for x in (q, k, v)), on_gpu)


def empty_rows(q, k, v, options):
    """(B, Hq, Nq) True where a row sees no key (mask, bias -inf, causal, window, lengths)."""
    return ~visibility(None, options, q, k, v).any(axis=-1)


def fully_masked_convention(out, q, k, v, empty, options):
    """What a kernel gives for rows that see no key: zeros (the contract), nan, mean (of V),
    unmasked (the row as if nothing were masked), or other."""
    rows = out[empty]
    if np.isnan(rows).all():
        return "nan"
    if (rows == 0).all():
        return "zeros"
    group = out.shape[1] // v.shape[1]
    mean = np.repeat(v.astype(np.float64).mean(axis=2), group, axis=1)  # (B, Hq, Dv)
    if np.allclose(rows, np.broadcast_to(mean[:, :, None], out.shape)[empty], rtol=1e-2,
                   atol=1e-2):
        return "mean"
    import reference

    unmasked = reference.attention(q, k, v, scale=options.get("scale"))
    if np.allclose(rows, unmasked[empty], rtol=1e-2, atol=1e-2):
        return "unmasked"
    return "other"
