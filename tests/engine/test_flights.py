import pytest

from kvtier.engine.flights import FlightCoordinator


def test_identical_inputs_wait_behind_one_leader():
    flights = FlightCoordinator("after-prefill")
    assert flights.join(1, b"A") is False
    assert flights.join(2, b"A") is True and flights.join(3, b"A") is True
    assert flights.join(4, b"B") is False
    assert flights.waiting() == 2


def test_after_prefill_releases_followers_and_removes_the_flight():
    flights = FlightCoordinator("after-prefill")
    flights.join(1, b"A")
    flights.join(2, b"A")
    assert flights.prefilled(1) == [2]
    assert flights.join(3, b"A") is False, "a released flight is gone: a new identical request leads"
    assert flights.terminate(2) == [] and flights.terminate(1) == []


def test_at_completion_releases_when_the_leader_finishes():
    flights = FlightCoordinator("at-completion")
    flights.join(1, b"A")
    flights.join(2, b"A")
    assert flights.prefilled(1) == []
    assert flights.terminate(1) == [2]
    assert flights.terminate(2) == []


def test_terminating_an_unknown_or_finished_id_is_an_error():
    flights = FlightCoordinator("after-prefill")
    flights.join(1, b"A")
    flights.join(2, b"A")
    flights.prefilled(1)
    flights.terminate(2)
    with pytest.raises(KeyError):
        flights.terminate(2)
    with pytest.raises(KeyError):
        flights.terminate(99)


def test_a_waiting_follower_cannot_terminate_before_release():
    flights = FlightCoordinator("at-completion")
    flights.join(1, b"A")
    flights.join(2, b"A")
    with pytest.raises(KeyError):
        flights.terminate(2)


def test_off_coordinates_nothing():
    flights = FlightCoordinator("off")
    assert flights.join(1, b"A") is False and flights.join(2, b"A") is False
    assert flights.terminate(1) == []


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        FlightCoordinator("sometimes")


def test_a_withdrawn_leader_hands_its_flight_to_its_first_follower():
    flights = FlightCoordinator("after-prefill")
    flights.join(1, b"A")
    flights.join(2, b"A")
    flights.join(3, b"A")
    assert flights.withdraw(1) == [2], "the first follower is released to lead"
    assert flights.is_leader(2) and not flights.is_leader(1)
    assert flights.prefilled(2) == [3]
    assert flights.terminate(3) == [] and flights.terminate(2) == []
    view = flights.view()
    assert not (view.flights or view.key_of_leader or view.released)


@pytest.mark.parametrize("policy", ["after-prefill", "at-completion"])
def test_withdrawing_in_every_state_leaves_nothing(policy):
    flights = FlightCoordinator(policy)
    flights.join(1, b"A")
    flights.join(2, b"A")
    flights.join(3, b"A")
    assert flights.withdraw(3) == []  # a held follower leaves
    assert flights.waiting() == 1
    released = flights.prefilled(1) or flights.terminate(1)  # the leader prefilled or finished
    assert released == [2]
    assert flights.withdraw(2) == []  # a released follower is forgotten
    if policy == "after-prefill":
        assert flights.withdraw(1) == []  # a released leader too
    flights.join(4, b"B")
    assert flights.withdraw(4) == []  # a leader without followers: its flight is gone
    view = flights.view()
    assert not (view.flights or view.key_of_leader or view.released)
    with pytest.raises(KeyError):
        flights.withdraw(4)
