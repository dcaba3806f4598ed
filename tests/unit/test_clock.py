from tests.clock import T0, FakeClock


def test_fake_clock_moves_only_when_told() -> None:
    c = FakeClock()
    assert c() == T0 == c.now
    c.advance(1.5)
    c.sleep(2.0)
    c.sleep(-1.0)  # like time.sleep, never backwards
    assert c() == T0 + 3.5
    c.now = 5.0
    assert c.t == 5.0
