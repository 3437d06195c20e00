"""The random-program generator's second half: :func:`test_programs.check_random_program` on other
draws (hypothesis derives them from this test's own name), in a file of its own so that
pytest-xdist, which runs one file on one worker, runs the two halves side by side."""

import strategies as S
from hypothesis import given, settings
from hypothesis import strategies as st
from test_programs import EXAMPLES, assert_programs_were_checked, check_random_program


@settings(max_examples=S.examples(EXAMPLES))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_more_random_programs(data, seed):
    check_random_program(data, seed)


def test_more_programs_were_checked():
    assert_programs_were_checked("test_more_random_programs")
