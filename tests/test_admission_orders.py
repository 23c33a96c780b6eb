"""The learned policy's admission orders (``siblings``, ``sessions``, ``returning``, ``progress``, vLLM's
``queue``) and how `kvpilot train` chooses its order: by simulating the logged workloads, on the logs' own engine
(a server's: the preset fitted to it), keeping another order only where it beats shortest-first by ``min_gain``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from policy.interface import Event, EventKind, RequestStatus
from policy.learned.policy import LearnedPolicy
from policy.session_progress import SessionProgress
from tests.test_learned import FixedLengths, _cand, _state, _state_dict


def _turn(i: int, session: str, turn: int):
    c = _cand(i)
    c.meta = dataclasses.replace(c.meta, session_id=session, turn=turn)
    return c


def _finish(pol, c, tokens: int) -> None:
    pol.on_event(Event(EventKind.FINISHED, 1.0, c.request_id, c.meta, num_output_tokens=tokens,
                       finish_reason="tool_call"))


def test_returning_turns_go_before_first_turns_and_the_queue_order_holds_among_equals() -> None:
    """``returning``: a session's later turn before any first turn, whatever the predicted lengths; among first
    turns the queue's order, so a long first turn is not held back behind shorter ones (shortest-first would)."""
    lengths = {"r0": 3000.0, "r1": 50.0, "r2": 400.0, "r3": 60.0}
    waiting = [_turn(0, "a", 0), _turn(1, "b", 0), _turn(2, "c", 1)]
    pol = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="returning")
    assert list(pol.admit(waiting, _state()).order) == ["r2", "r0", "r1"]
    shortest = LearnedPolicy(_state_dict(), FixedLengths(lengths))
    assert list(shortest.admit(waiting, _state()).order) == ["r1", "r2", "r0"]
    # session d finishes a turn, and its next one arrives: it returns, though the framework sends no turn number
    _finish(pol, _turn(9, "d", 0), 100)
    waiting.append(_turn(3, "d", 0))
    assert list(pol.admit(waiting, _state(2, 1.0)).order) == ["r2", "r3", "r0", "r1"]
    # a preempted request still goes back first (vLLM's precedence)
    waiting[1].status, waiting[1].num_preemptions = RequestStatus.PREEMPTED, 1
    pol.on_event(Event(EventKind.PREEMPTED, 2.0, "r1", waiting[1].meta))
    assert list(pol.admit(waiting, _state(3, 2.0)).order)[0] == "r1"


def test_siblings_admits_a_request_whose_group_is_running_first_and_follows_the_group_as_it_changes() -> None:
    """``siblings``: a request whose GRPO group has a request running (their shared prompt is in KV: it adds only
    its own blocks) before the others, whatever the predicted lengths; the queue's order among equals; it follows
    the hook's events (a sibling scheduled, then finished), and the preempted still go first."""
    lengths = {"r0": 50.0, "r1": 3000.0, "r2": 400.0, "r3": 60.0}
    waiting = [_turn(i, s, 1) for i, s in enumerate("abcd")]
    for c, group in zip(waiting, ("g1", "g2", "g2", "g3")):
        c.meta = dataclasses.replace(c.meta, group_id=group)
    pol = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="siblings")
    assert list(pol.admit(waiting, _state()).order) == ["r0", "r1", "r2", "r3"]  # no group running: the queue
    # a request of g2 is scheduled: its two waiting siblings go first, the long one too, in the queue's order
    sib = _turn(9, "e", 1)
    sib.meta = dataclasses.replace(sib.meta, group_id="g2")
    pol.on_event(Event(EventKind.SCHEDULED, 1.0, sib.request_id, sib.meta))
    waiting[1].group_running = waiting[2].group_running = 1
    assert list(pol.admit(waiting, _state(2, 1.0)).order) == ["r1", "r2", "r0", "r3"]
    # it finishes: the queue's order again
    _finish(pol, sib, 10)
    waiting[1].group_running = waiting[2].group_running = 0
    assert list(pol.admit(waiting, _state(3, 2.0)).order) == ["r0", "r1", "r2", "r3"]
    # a preempted request goes back first (vLLM's precedence)
    waiting[3].status, waiting[3].num_preemptions = RequestStatus.PREEMPTED, 1
    pol.on_event(Event(EventKind.PREEMPTED, 3.0, "r3", waiting[3].meta))
    assert list(pol.admit(waiting, _state(4, 3.0)).order)[0] == "r3"


def test_sessions_serves_in_program_order_a_returning_turn_keeping_its_place_across_a_hot_swap() -> None:
    """``sessions``: continuum's program order (policy.session_order): by the session's first arrival, sessions
    stamped at one instant in the order first seen, a returning turn in its session's place whatever the lengths;
    the preempted still go first, and the sessions' arrivals move to a successor at a hot swap."""
    lengths = {f"r{i}": 100.0 * (5 - i) for i in range(5)}  # shortest-first would serve them backwards
    waiting = [_turn(i, s, 0) for i, s in enumerate("abc")]  # one step's first turns, released at one instant
    pol = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="sessions")
    assert list(pol.admit(waiting, _state()).order) == ["r0", "r1", "r2"]
    # c's first turn still waits when a's and b's second turns arrive (later): a and b keep their places before c
    later = [waiting[2], dataclasses.replace(_turn(3, "b", 1), arrival_s=3.0),
             dataclasses.replace(_turn(4, "a", 1), arrival_s=4.0)]
    assert list(pol.admit(later, _state(2, 4.0)).order) == ["r4", "r3", "r2"]
    successor = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="sessions")
    successor.import_state(pol.export_state())
    assert list(successor.admit(later, _state(3, 5.0)).order) == ["r4", "r3", "r2"]
    # a preempted request goes back first (vLLM's precedence)
    later[0].status, later[0].num_preemptions = RequestStatus.PREEMPTED, 1
    successor.on_event(Event(EventKind.PREEMPTED, 6.0, "r2", later[0].meta))
    assert list(successor.admit(later, _state(4, 6.0)).order) == ["r2", "r4", "r3"]


def test_progress_ranks_by_turns_and_tokens_of_the_session_and_survives_a_hot_swap() -> None:
    """``progress``: heddle's score, turns x 512 + the session's output tokens so far; the tracker's state moves to
    a successor policy at a hot swap."""
    lengths = {f"r{i}": 100.0 for i in range(4)}
    waiting = [_turn(0, "a", 1), _turn(2, "c", 2), _turn(3, "d", 0)]
    pol = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="progress")
    assert list(pol.admit(waiting, _state()).order) == ["r2", "r0", "r3"]  # turn 2, turn 1, turn 0
    _finish(pol, _turn(8, "b", 0), 300)  # b's first turn wrote 300 tokens; its second arrives: ahead of a's
    assert pol.progress.get("b") == (1, 300)
    waiting.insert(1, _turn(1, "b", 1))
    assert list(pol.admit(waiting, _state(2, 1.0)).order) == ["r2", "r1", "r0", "r3"]
    successor = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="progress")
    successor.import_state(pol.export_state())
    assert list(successor.admit(waiting, _state(3, 2.0)).order) == ["r2", "r1", "r0", "r3"]


def test_queue_keeps_vllms_order_whatever_the_lengths_with_the_preempted_first() -> None:
    """``queue``: vLLM's own order (first come first served, the preempted first: it leaves the queue as it is),
    for engines where shortest-first runs behind it; under asynchronous RL the oldest group still goes first."""
    lengths = {"r0": 3000.0, "r1": 50.0, "r2": 400.0, "r3": 60.0}
    waiting = [_turn(0, "a", 0), _turn(1, "b", 0), _turn(2, "c", 1), _turn(3, "d", 0)]
    pol = LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="queue")
    dec = pol.admit(waiting, _state())
    assert dec is not None and dec.order is None and not dec.hold  # vLLM's order, whatever the lengths
    shortest = LearnedPolicy(_state_dict(), FixedLengths(lengths))
    assert list(shortest.admit(waiting, _state()).order) == ["r1", "r3", "r2", "r0"]
    # weight versions (asynchronous RL): a younger group's requests wait behind the group started first, the queue's
    # order otherwise
    aged = [_turn(i, s, 0) for i, s in enumerate(("x", "y", "z"))]
    for c, (group, version) in zip(aged, (("g-new", 5), ("g-old", 3), ("g-new", 5))):
        c.meta = dataclasses.replace(c.meta, group_id=group, weight_version=version)
    pol = LearnedPolicy(_state_dict(), FixedLengths({"r0": 10.0, "r1": 900.0, "r2": 10.0}), admission="queue")
    assert list(pol.admit(aged[1:2], _state()).order) == ["r1"]  # g-old starts first
    assert list(pol.admit(aged, _state(2, 1.0)).order) == ["r1", "r0", "r2"]
    with pytest.raises(ValueError, match="admission must be one of"):
        LearnedPolicy(_state_dict(), FixedLengths(lengths), admission="fifo")


def test_session_progress_forgets_the_least_recently_updated_and_ignores_aborts() -> None:
    tracker = SessionProgress(max_sessions=2)
    for sid, tokens in (("a", 10), ("b", 20), ("a", 5), ("c", 30)):  # c evicts b, the least recently updated
        c = _turn(0, sid, 0)
        tracker.observe(Event(EventKind.FINISHED, 0.0, c.request_id, c.meta, num_output_tokens=tokens,
                              finish_reason="stop"))
    assert tracker.get("a") == (1, 15) and tracker.get("b") == (0, 0) and tracker.get("c") == (1, 30)
    c = _turn(1, "a", 1)
    tracker.observe(Event(EventKind.FINISHED, 0.0, c.request_id, c.meta, num_output_tokens=99, finish_reason="abort"))
    assert tracker.get("a") == (1, 15)
    assert tracker.score(_turn(2, "a", 1)) == 512.0 + 15
    with pytest.raises(ValueError, match="max_sessions"):
        SessionProgress(max_sessions=0)


@pytest.fixture()
def replayable_log(tmp_path: Path) -> Path:
    """A log folder the search accepts (its workload and engine); the simulations are stubbed in these tests."""
    log = tmp_path / "log"
    log.mkdir()
    (log / "workload.parquet").write_bytes(b"")
    (log / "summary.json").write_text(json.dumps({"preset": "H200-7B", "kv_blocks": 100, "decode_stride": 32}))
    return log


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    return LearnedPolicy(_state_dict(), None, offload=True).save(tmp_path / "policy")


@pytest.mark.parametrize("times, kept", [  # shortest, siblings, sessions, returning, progress, queue
    ((100.0, 99.0, 98.5, 98.0, 99.0, 103.0), "returning"),
    ((100.0, 101.0, 98.0, 101.0, 97.0, 99.0), "progress"),
    ((100.0, 99.7, 99.9, 99.8, 104.0, 100.0), "shortest"),  # 0.3%
    ((160.0, 130.0, 110.0, 120.0, 130.0, 100.0), "queue"),
    ((100.0, 80.0, 85.0, 98.0, 99.0, 103.0), "siblings"),
    ((100.0, 90.0, 85.0, 98.0, 99.0, 103.0), "sessions"),
])
def test_train_keeps_another_order_only_where_the_logged_workloads_run_it_faster(
        monkeypatch, replayable_log: Path, bundle: Path, times: tuple, kept: str) -> None:
    from training import policy_search as ps

    made = dict(zip(("shortest", "siblings", "sessions", "returning", "progress", "queue"), times))

    ran: list[dict] = []

    def simulate(policy_dir, runtime, workload, options):
        ran.append(runtime)
        return made[runtime["admission"]] * (0.5 if runtime.get("offload") is False else 1.0)

    monkeypatch.setattr(ps, "_simulate", simulate)
    every = ("siblings", "sessions", "returning", "progress", "queue")
    found = ps.search_admission(bundle, [replayable_log],
                                ps.SearchConfig(jobs=1, orders=every, levers_off=False, width=False))
    # the six orders, and (--no-levers-off) not the tier turned off
    assert [r["admission"] for r in ran] == ["shortest", *every] and not any("offload" in r for r in ran)
    assert found.levers == {"admission": kept} and found.residual == {}
    assert found.ratio == pytest.approx(made[kept] / made["shortest"])
    assert found.metrics()[f"search.admission.{kept}"] == 1.0
    assert found.runtime() == {"admission": kept, "admission_residual": {}}
    # train's default tries the running groups' requests first, program order, the returning turns first and vLLM's
    # queue order,
    # then the lever the bundle trained (here the tier, which wins by half) off with the order kept
    ran.clear()
    default = ps.search_admission(bundle, [replayable_log], ps.SearchConfig(jobs=1, width=False))
    best = min(("siblings", "sessions", "returning", "queue"), key=made.get)
    order = best if made[best] < 0.995 * made["shortest"] else "shortest"
    assert [(r["admission"], r.get("offload")) for r in ran] == [("shortest", None), ("siblings", None),
                                                                  ("sessions", None), ("returning", None),
                                                                  ("queue", None), (order, False)]
    assert default.levers == {"admission": order, "offload": False}
    assert default.ratio == pytest.approx(0.5 * made[order] / made["shortest"])
    assert default.metrics()["search.lever.offload"] == 0.0
    with pytest.raises(ps.SearchError, match="admission orders must be among"):
        ps.SearchConfig(orders=("lpt",))


@pytest.mark.parametrize("off_factor, kept", [
    ({"offload": 1.1, "preempt": 0.9}, {"admission": "shortest", "preempt": False}),  # the head loses: off
    ({"offload": 0.8, "preempt": 1.003}, {"admission": "shortest", "offload": False, "preempt": False}),  # 0.3%
    ({"offload": 1.01, "preempt": 1.2}, {"admission": "shortest"}),  # both win by more than 0.5%: as trained
])
def test_train_serves_a_trained_lever_only_where_the_logged_workloads_run_faster_with_it(
        monkeypatch, replayable_log: Path, tmp_path: Path, off_factor: dict, kept: dict) -> None:
    """Each lever the bundle trained is simulated off in turn, on the choice so far, and stays on only where it is
    0.5% faster than off: the preemption head is served only where the logs' engine runs its victims faster."""
    from training import policy_search as ps

    bundle = LearnedPolicy(_state_dict(), None, offload=True, preempt=True).save(tmp_path / "both")
    ran: list[dict] = []

    def simulate(policy_dir, runtime, workload, options):
        ran.append(runtime)
        made = {"shortest": 100.0, "siblings": 102.0, "sessions": 101.0, "returning": 104.0,
                "queue": 103.0}[runtime["admission"]]
        for lever, factor in off_factor.items():
            made *= factor if runtime.get(lever) is False else 1.0
        return made

    monkeypatch.setattr(ps, "_simulate", simulate)
    found = ps.search_admission(bundle, [replayable_log], ps.SearchConfig(jobs=1, width=False))
    offload_kept = kept.get("offload", True)
    assert [{k: r[k] for k in ("offload", "preempt") if k in r} for r in ran[5:]] == [
        {"offload": False}, {**({} if offload_kept else {"offload": False}), "preempt": False}]
    assert found.levers == kept and found.runtime() == {**kept, "admission_residual": {}}
    assert found.metrics().get("search.lever.preempt", 1.0) == float(kept.get("preempt", True))


@pytest.mark.parametrize("order_made, width_factor, kept", [
    ({"shortest": 100.0, "returning": 101.0}, 0.8, {"admission": "shortest", "width": True}),
    ({"shortest": 100.0, "returning": 90.0}, 0.99, {"admission": "returning", "width": True}),  # on the kept order
    ({"shortest": 100.0, "returning": 90.0}, 0.997, {"admission": "returning"}),  # 0.3%: under min_gain
    ({"shortest": 100.0, "returning": 101.0}, 1.2, {"admission": "shortest"}),
])
def test_train_turns_the_width_on_only_where_the_logged_workloads_run_it_faster_with_the_order_kept(
        monkeypatch, replayable_log: Path, bundle: Path, order_made: dict, width_factor: float, kept: dict) -> None:
    from training import policy_search as ps

    ran: list[dict] = []

    def simulate(policy_dir, runtime, workload, options):
        ran.append(runtime)
        return order_made[runtime["admission"]] * (width_factor if runtime.get("width") else 1.0)

    monkeypatch.setattr(ps, "_simulate", simulate)
    order_made = {**order_made, "siblings": 106.0, "sessions": 107.0, "queue": 105.0}
    # train's default but the trained levers (the test above)
    found = ps.search_admission(bundle, [replayable_log], ps.SearchConfig(jobs=1, levers_off=False))
    order = "returning" if order_made["returning"] < 0.995 * order_made["shortest"] else "shortest"
    assert [(r["admission"], r.get("width", False)) for r in ran] == [("shortest", False), ("siblings", False),
                                                                       ("sessions", False), ("returning", False),
                                                                       ("queue", False), (order, True)]
    assert found.levers == kept
    assert found.ratio == pytest.approx(order_made[order] * (width_factor if kept.get("width") else 1.0) / 100.0)
    assert found.metrics().get("search.lever.width", 0.0) == float(kept.get("width", False))
    # --no-width never tries it
    ran.clear()
    ps.search_admission(bundle, [replayable_log], ps.SearchConfig(jobs=1, width=False))
    assert not any(r.get("width") for r in ran)


def test_a_servers_logs_are_replayed_on_the_preset_fitted_to_that_server(monkeypatch, tmp_path: Path,
                                                                          bundle: Path) -> None:
    """A server's telemetry has no simulator summary: the search replays it on ``--engine-preset`` (a preset
    ``kvpilot calibrate`` wrote), and says how to give one where it is missing; a bad preset is a named error."""
    from data.io import write_workload
    from simulator.fitted_cost import write_preset_file
    from simulator.simulation import run_simulation
    from tests.test_calibrate import KNOWN, small_workload
    from training import policy_search as ps

    log = tmp_path / "server-telemetry"
    log.mkdir()
    write_workload(small_workload(), log / "workload.parquet")
    preset = tmp_path / "server.toml"
    write_preset_file(KNOWN, preset)
    with pytest.raises(ps.SearchError, match="--engine-preset"):
        ps.replays([log])
    (play,) = ps.replays([log], preset)
    assert play.options == {"preset": str(preset.resolve()), "decode_stride": 1}
    # the options run the real simulator on that engine: its KV capacity in tokens, no host tier
    res = run_simulation(small_workload(), "vllm-default", progress=False, **play.options)
    assert res.summary.metrics.makespan_s > 0 and res.summary.kv_blocks == KNOWN.max_kv_blocks(16)
    ran: list[dict] = []
    monkeypatch.setattr(ps, "_simulate", lambda policy_dir, runtime, workload, options: ran.append(options) or 1.0)
    ps.search_admission(bundle, [log], ps.SearchConfig(jobs=1, engine_preset=str(preset)))
    assert ran and all(o["preset"] == str(preset.resolve()) for o in ran)
    bad = tmp_path / "bad.toml"
    bad.write_text(preset.read_text().replace("decode_token_s", "decode_tokens_s"))
    with pytest.raises(ps.SearchError, match=r"bad\.toml.*decode_token_s"):
        ps.SearchConfig(engine_preset=str(bad))
    from typer.testing import CliRunner

    from training.cli import app

    res = CliRunner().invoke(app, ["train", "--logs", str(log), "--engine-preset", str(bad), "-o",
                                   str(tmp_path / "t"), "--no-progress"])
    assert res.exit_code == 2 and "decode_token_s" in " ".join(res.output.split()), res.output
