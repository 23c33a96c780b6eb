"""kvpilot's rollout width (policy/group_width.py): the logged prior of session contexts, its online refinement,
and the rule that starts a group only while the predicted working set fits."""

from __future__ import annotations

import pyarrow as pa
import pytest

from policy.group_width import PRIOR_WEIGHT, SessionContexts, fit_session_contexts, working_set_admits


def _requests(rows: list[tuple]) -> pa.Table:
    names = ["session_id", "domain", "prompt_tokens", "output_tokens"]
    return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)},
                    schema=pa.schema([("session_id", pa.string()), ("domain", pa.string()),
                                      ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32())]))


def test_fit_takes_each_sessions_peak_context_and_averages_by_domain() -> None:
    t = _requests([("a", "swe", 1000, 200), ("a", "swe", 3000, 500), ("b", "swe", 2000, 0),  # peaks 3500, 2000
                   ("c", "math", 400, 100),  # 500
                   (None, "math", 90_000, 10), ("d", None, 90_000, 10)])  # no session / no domain: left out
    fit = fit_session_contexts(t)
    assert fit == {"swe": {"mean_peak": 2750.0, "sessions": 2.0}, "math": {"mean_peak": 500.0, "sessions": 1.0}}
    assert fit_session_contexts(_requests([(None, "swe", 1, 1)])) == {}


def test_prediction_starts_at_the_prior_and_moves_with_sessions_that_end() -> None:
    c = SessionContexts({"swe": {"mean_peak": 20_000, "sessions": 64}, "search": {"mean_peak": 4_000, "sessions": 64}},
                        fallback=65_536)
    assert c.predict("swe") == 20_000
    assert c.predict("math") == 12_000  # a domain the logs lack: their mean over sessions
    c.observe("swe", 30_000)
    assert c.predict("swe") == pytest.approx((20_000 * PRIOR_WEIGHT + 30_000) / (PRIOR_WEIGHT + 1))
    c.observe("math", 1_000)
    assert c.predict("math") == 1_000  # from then on, what this run saw
    bare = SessionContexts(None, fallback=65_536)
    assert bare.predict("swe") == 65_536  # no prior: the largest request
    bare.observe("swe", 5_000)
    assert bare.predict("swe") == 5_000


def test_a_group_starts_only_while_the_working_set_fits() -> None:
    assert working_set_admits(300, 200, 500, groups_in_flight=2)
    assert not working_set_admits(301, 200, 500, groups_in_flight=2)
    assert working_set_admits(0, 10_000, 500, groups_in_flight=0)  # one group always may
