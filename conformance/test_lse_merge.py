"""lse: results over any split of the keys, merged with the reference's rule, equal the whole."""
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import reference
from verify.cases import make_inputs
from verify.criterion import judge
from verify.calling import call, to_impl, unpack

from .strategies import cases, seeds


def test_merge_of_any_split_equals_whole(impl, limits):
    s = impl.supports
    if not (s.lse and s.mask):
        pytest.skip(f"{impl.name} must claim lse and masks (the split is a mask)")

    @given(data=st.data(), seed=seeds())
    def prop(data, seed):
        case = data.draw(cases(impl, limits, mask=st.none(), values="normal",
                               nk=st.integers(2, limits["max_n"])), label="case")
        cut = data.draw(st.integers(1, case.Nk - 1), label="split at key")
        q, k, v, options = make_inputs(case, seed)
        parts = []
        for keep in (np.arange(case.Nk) < cut, np.arange(case.Nk) >= cut):
            opts = dict(options, mask=np.broadcast_to(keep, (case.Nq, case.Nk)).copy())
            args, kwargs = to_impl(impl, case, (q, k, v, opts))
            out, lse = unpack(impl, case, call(impl, args, kwargs))
            parts.append((out, lse))
        out, lse = reference.merge(*parts)
        note(f"{case} split at {cut}")
        for c in judge(q, k, v, out.astype(np.float32), lse, **options):
            assert c.passed, f"merged parts differ from the whole:\n{c.message()}"

    prop()
