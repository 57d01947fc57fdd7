"""The pure parts of packed-row attention: finding a row's sequences and grouping them."""

from pipelinerl_trainer.packed_attention import length_groups, padded_length, segments


def test_segments_restart_where_positions_do_not_follow():
    assert segments([0, 1, 2, 0, 1, 0, 0, 1, 2, 3]) == [(0, 3), (3, 2), (5, 1), (6, 4)]
    assert segments([5, 6, 7]) == [(0, 3)]  # a row that starts mid-sequence is one sequence
    assert segments([0, 1, 2, 3, 1, 2]) == [(0, 4), (4, 2)]  # any break starts a new one
    assert segments([]) == []


def test_padded_length_pads_at_most_a_quarter():
    assert [padded_length(n) for n in range(1, 9)] == list(range(1, 9))  # short: exact
    assert padded_length(13) == 14 and padded_length(1000) == 1024 and padded_length(1024) == 1024
    for n in range(1, 5000):
        assert n <= padded_length(n) <= n * 1.25


def test_length_groups_collect_sequences_of_a_padded_length():
    segs = [(0, 13), (13, 14), (27, 12), (39, 3)]
    assert length_groups(segs) == {14: [(0, 13), (13, 14)], 12: [(27, 12)], 3: [(39, 3)]}
