"""The job's problem claims (pure): group ids name their index, settled indices merge into ranges,
and a store made to go on from a checkpoint draws every index claimed then and not settled again,
first, each once."""

import random

import pytest

from pipelinerl.claims import (
    Claims,
    claimed_index,
    gaps,
    group_id,
    indices,
    newest_gaps,
    parse_ranges,
    ranges_text,
    with_indices,
    without_index,
)


@pytest.mark.parametrize("problem", ["gsm8k-17", "a#b@c", "#", "x@1#2"])
def test_a_group_id_names_its_claimed_index_whatever_the_problems_own_id(problem):
    assert claimed_index(group_id(problem, 1234, 3)) == 1234


@pytest.mark.parametrize("other", ["rollout-17", "p@1", "p#@1", "p#x@1", "p#12", "", "#-3@0"])
def test_an_id_that_names_no_index_is_none(other):
    assert claimed_index(other) is None


def test_ranges_merge_and_their_gaps_are_the_rest_below_a_count():
    ranges = with_indices([], [5, 0, 1, 2, 9, 7, 6])
    assert ranges == [(0, 3), (5, 8), (9, 10)]
    assert with_indices(ranges, [3, 4, 8]) == [(0, 10)]
    assert gaps(ranges, 12) == [(3, 5), (8, 9), (10, 12)]
    assert gaps(ranges, 6) == [(3, 5)]
    assert gaps([], 3) == [(0, 3)] and gaps([(0, 3)], 3) == [] and gaps([], 0) == []


def test_an_index_let_go_leaves_the_rest_as_ranges():
    """What a generator holds loses each index as its group is published (`without_index`), in any
    order: the rest, and nothing else, stays."""
    rng = random.Random(7)
    for _ in range(200):
        held = sorted(rng.sample(range(40), rng.randint(0, 20)))
        ranges = with_indices([], held)
        assert indices(ranges) == held
        for index in rng.sample(range(40), 10):
            ranges = without_index(ranges, index)
            held = [i for i in held if i != index]
            assert indices(ranges) == held and ranges == with_indices([], held)
    assert without_index([(0, 5)], 2) == [(0, 2), (3, 5)] and without_index([(3, 4)], 3) == []


def test_only_the_newest_gaps_are_kept_the_older_given_up():
    ranges = [(0, 2), (3, 5), (6, 8), (9, 10)]  # gaps 2, 5, 8
    assert newest_gaps(ranges, 3) == ranges
    assert newest_gaps(ranges, 2) == [(0, 5), (6, 8), (9, 10)]  # 2 given up: taken for settled
    assert newest_gaps(ranges, 0) == [(0, 10)]
    assert gaps(newest_gaps(ranges, 1), 12) == [(8, 9), (10, 12)]


def test_ranges_text_round_trips_and_bad_text_names_its_field():
    ranges = [(0, 3), (5, 6), (9, 12)]
    assert ranges_text(ranges) == "0-2,5,9-11"
    assert parse_ranges("0-2,5,9-11", "f") == ranges
    assert parse_ranges("9,3-4,4", "f") == [(3, 5), (9, 10)]  # any order, overlaps merged
    assert parse_ranges("", "f") == []
    for bad in ["a", "3-", "5-3", "-2", "1,,x", "1.5"]:
        with pytest.raises(ValueError, match="^--redraw: "):
            parse_ranges(bad, "--redraw")


def test_claims_take_the_indices_to_draw_again_first_then_fresh_ones():
    claims = Claims.of(20, "3-5,9")
    taken, after = claims.take(2)
    assert taken == [3, 4] and after == Claims(20, ((5, 6), (9, 10)))
    taken, after = after.take(4)
    assert taken == [5, 9, 20, 21] and after == Claims(22)
    assert Claims().take(3) == ([0, 1, 2], Claims(3))


def test_the_record_text_round_trips_and_a_count_alone_still_reads():
    for claims in [Claims(0), Claims(40), Claims.of(40, "0,3-5,39")]:
        assert Claims.parse(claims.text()) == claims
    assert Claims.parse("40") == Claims(40)  # as stores made before the redraw wrote it
    assert Claims.of(40, "0,3-5,39").text() == "40;0,3-5,39"
    for bad in ["", "x", "-1", "4;a"]:
        with pytest.raises(ValueError, match="problem claims record"):
            Claims.parse(bad)
    with pytest.raises(ValueError, match="reaches past the 5 problems claimed"):
        Claims.of(5, "2-5")


def test_a_checkpoint_draws_again_what_its_steps_did_not_settle_and_an_old_one_nothing():
    state = {"problems_claimed": 10, "problems_settled": [[0, 4], [6, 8]]}
    assert Claims.at_checkpoint(state) == Claims(10, ((4, 6), (8, 10)))
    assert Claims.at_checkpoint({"problems_claimed": 10}) == Claims(10)  # kept before settled indices were
    assert Claims.at_checkpoint({}) == Claims(0)


def test_claimers_after_a_recovery_draw_every_index_once_whatever_their_blocks():
    """Any sequence of claims of any sizes from a recovered store: the indices drawn are exactly
    those to draw again plus fresh ones past the count, none twice, the redrawn ones first."""
    rng = random.Random(7)
    for _ in range(200):
        settled = with_indices([], rng.sample(range(60), rng.randint(0, 60)))
        claims = Claims.unsettled(60, settled)
        redraw = {i for a, b in claims.redraw for i in range(a, b)}
        drawn: list[int] = []
        while len(drawn) < len(redraw) + 10:
            taken, claims = claims.take(rng.randint(1, 7))
            drawn += taken
        assert len(set(drawn)) == len(drawn)
        assert set(drawn[: len(redraw)]) == redraw and set(drawn[len(redraw) :]) == set(
            range(60, len(drawn) + 60 - len(redraw))
        )
        assert not redraw & {i for a, b in settled for i in range(a, b)}


def test_problems_given_back_are_drawn_again_first_by_the_next_claims_each_once():
    """Generators stopping give back what they hold: the next claims take it first, whoever
    claims, and with the indices still to draw again it is each drawn once."""
    rng = random.Random(11)
    for _ in range(200):
        claims, held = Claims.of(30, "2-4"), []
        drawn = [i for i in range(30) if not 2 <= i <= 4]  # (before)
        for _ in range(rng.randint(1, 6)):
            taken, claims = claims.take(rng.randint(1, 5))
            kept = [i for i in taken if rng.random() < 0.5]  # the rest published, or held by another
            drawn += [i for i in taken if i not in kept]
            held.append(with_indices([], kept))
            if rng.random() < 0.5:
                claims = claims.given_back(held.pop())
        for ranges in held:
            claims = claims.given_back(ranges)
        redraw = {i for a, b in claims.redraw for i in range(a, b)}
        assert not redraw & set(drawn) and len(set(drawn)) == len(drawn)
        assert redraw | set(drawn) == set(range(claims.next))  # nothing claimed is lost
        taken, after = claims.take(len(redraw) + 2)
        assert set(taken[: len(redraw)]) == redraw and taken[len(redraw) :] == [claims.next, claims.next + 1]
    assert Claims.of(10, "1").given_back([(1, 3), (5, 6)]) == Claims(10, ((1, 3), (5, 6)))
    with pytest.raises(ValueError, match="given back 8-10 reach past the 10 claimed"):
        Claims(10).given_back([(8, 11)])
