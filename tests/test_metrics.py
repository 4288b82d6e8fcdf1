"""Console helpers: the heartbeat prints the status when it is due, never crashes on a status
read; ETA and clock formatting; standard errors."""

import io

import numpy as np

from gyre.metrics import Heartbeat, clock, eta, standard_error


def test_heartbeat_prints_the_status_only_when_due():
    out = io.StringIO()
    hb = Heartbeat(every=9.0, status=lambda: "RL step 2/10", stream=out)
    hb.tick(hb._last + 5.0)
    assert out.getvalue() == ""
    hb.tick(hb._last + 9.0)
    assert out.getvalue().rstrip().endswith("RL step 2/10") and out.getvalue().startswith("[")
    hb.say("step 2/10 | reward 0.5")  # any line restarts the interval
    n = len(out.getvalue().splitlines())
    hb.tick(hb._last + 8.9)
    assert len(out.getvalue().splitlines()) == n


def test_a_failing_status_is_reported_not_raised():
    out = io.StringIO()

    def broken():
        raise KeyError("roles")

    hb = Heartbeat(every=1.0, status=broken, stream=out)
    hb.tick(hb._last + 2.0)
    assert "status unavailable" in out.getvalue()


def test_eta_clock_and_standard_error():
    assert clock(0) == "0:00" and clock(75.4) == "1:15" and clock(3725) == "1:02:05"
    assert (
        eta(10.0, 0, 5) == "ETA ?" and eta(10.0, 2, 6) == "ETA 0:20" and eta(5, 3, 3) == "ETA 0:00"
    )
    x = np.array([0.0, 1.0, 1.0, 0.0])
    assert abs(standard_error(x) - x.std(ddof=1) / 2) < 1e-12 and standard_error([1.0]) == 0.0
