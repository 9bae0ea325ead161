"""The two test tiers. `make test` runs what is not marked `full`: every behaviour once (each
dtype, backend path and bad input, the oracle comparisons on ragged shapes). `make test-full`
adds the grids: the same checks over every shape, schedule and split. In a parametrize list,
`few` keeps the named values in both tiers and marks the others `full`; over several parametrize
lists the quick tier runs the product of what each keeps."""

import pytest

FULL = pytest.mark.full


def _full(value, unpack: bool):
    if isinstance(value, type(pytest.param(None))):  # already a pytest.param: add the mark
        return pytest.param(*value.values, marks=(*value.marks, FULL), id=value.id)
    return pytest.param(*value, marks=FULL) if unpack else pytest.param(value, marks=FULL)


def few(values, *kept):
    """One parametrize name's values: those equal to one of `kept` run in both tiers."""
    return [v if any(v is k or v == k for k in kept) else _full(v, False) for v in values]


def few_rows(rows, *kept):
    """Rows of several parametrize names (tuples): those in `kept` run in both tiers."""
    return [r if r in kept else _full(r, True) for r in rows]
