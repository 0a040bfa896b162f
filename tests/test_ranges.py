"""Which ranges of a file one GET reads together (rayflux.cache.ranges.plan_spans): a pure rule, checked here."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.cache import ranges


def test_neighbours_merge_a_far_range_does_not_and_an_empty_one_costs_nothing():
    asks = {"a": [(1000, 4000), (0, 900), (5050, 1000), (8000, 500), (9000, 0)]}
    spans = ranges.plan_spans(asks)["a"]
    # Holes of 100 and 50 bytes fit 5% of the 6,400 asked; the 1,950 before 8,000 does not.
    assert [(s.start, s.end, s.members) for s in spans] == [(0, 6050, [1, 0, 2]), (8000, 8500, [3])]


def test_the_smallest_holes_are_merged_first_over_all_files_of_a_read():
    # 2,000 bytes asked: a budget of 100. Holes: 90 (a), 30 and 60 (b). 30 and 60 fit; then 90 does not.
    asks = {"a": [(0, 500), (590, 500)], "b": [(0, 300), (330, 300), (690, 400)]}
    spans = ranges.plan_spans(asks)
    assert [(s.start, s.end) for s in spans["a"]] == [(0, 500), (590, 1090)]
    assert [(s.start, s.end) for s in spans["b"]] == [(0, 1090)]


def test_a_hole_over_the_cap_is_never_read_through():
    big = 10 * ranges.HOLE
    spans = ranges.plan_spans({"a": [(0, big), (big + ranges.HOLE + 1, big)]})["a"]
    assert len(spans) == 2
    assert len(ranges.plan_spans({"a": [(0, big), (big + ranges.HOLE, big)]})["a"]) == 1


@settings(max_examples=100, deadline=None)
@given(
    files=st.lists(
        st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), max_size=12), min_size=1, max_size=3
    ),
    waste=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_spans_cover_every_range_and_waste_at_most_their_share(files, waste):
    asks = {f"f{i}": r for i, r in enumerate(files)}
    spans = ranges.plan_spans(asks, waste)
    asked = sum(n for r in files for _, n in r)
    fetched = 0
    for path, r in asks.items():
        members = sorted(i for s in spans[path] for i in s.members)
        assert members == sorted(i for i, (_, n) in enumerate(r) if n > 0)  # each non-empty range in one span
        for s in spans[path]:
            assert all(s.start <= r[i][0] and r[i][0] + r[i][1] <= s.end for i in s.members)
        ends = [(s.start, s.end) for s in spans[path]]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # spans in order, never overlapping
        fetched += sum(e - b for b, e in ends)
    # Overlapping asks can make the union smaller than their sum; holes read never exceed the budget.
    assert fetched <= asked * (1 + waste) + 1e-9
