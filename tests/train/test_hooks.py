"""The loop's contract with its hooks (`loop.train`), on stand-in steps: what each hook sees, and
when. Step n's metrics are read only after step n+1 is dispatched, or when a hook must see the
state checked first (a checkpoint); evaluations skip the last step and a stop."""

from __future__ import annotations

import pytest

from nvfp4_jax.train import hooks
from nvfp4_jax.train.loop import train


class _Log(hooks.Hook):
    def __init__(self, events):
        self.events = events

    def before_step(self, step):
        self.events.append(("dispatch", step + 1))

    def on_metrics(self, step, metrics):
        assert metrics == {"loss": step}
        self.events.append(("read", step))


def _run(hook_list, events, *, start=0, steps=6, stop_at=None):
    def step_fn(step):
        return lambda state, batch: (state + 1, {"loss": state + 1})

    return train(start, step_fn, lambda step: step, hook_list, start=start, steps=steps,
                 stop_agreed=lambda step: step == stop_at)


def test_metrics_of_a_step_are_read_after_the_next_is_dispatched():
    events = []
    state, reached, stopped = _run([_Log(events)], events, start=2, steps=5)
    assert (state, reached, stopped) == (5, 5, False)
    assert events == [("dispatch", 3), ("dispatch", 4), ("read", 3), ("dispatch", 5), ("read", 4), ("read", 5)]


def test_a_checkpoint_sees_its_step_read_first_and_a_stop_saves_and_skips_the_evaluation():
    events = []
    save = hooks.Checkpoint(2, lambda step, state: events.append(("save", step, state)))
    evaluate = hooks.Evaluate(1, lambda step, state: events.append(("eval", step, state)))
    state, reached, stopped = _run([_Log(events), save, evaluate], events, steps=6, stop_at=3)
    assert (state, reached, stopped) == (3, 3, True)
    assert events == [
        ("dispatch", 1), ("eval", 1, 1),
        ("dispatch", 2), ("read", 1), ("read", 2), ("save", 2, 2), ("eval", 2, 2),
        ("dispatch", 3), ("read", 3), ("save", 3, 3),  # the stop: saved, not evaluated
    ]


def test_the_last_step_is_saved_but_left_to_the_final_evaluation():
    events = []
    save = hooks.Checkpoint(100, lambda step, state: events.append(("save", step)))
    evaluate = hooks.Evaluate(2, lambda step, state: events.append(("eval", step)))
    _run([_Log(events), save, evaluate], events, steps=4)
    assert [e for e in events if e[0] in ("save", "eval")] == [("eval", 2), ("save", 4)]


def test_a_non_finite_step_stops_before_its_state_is_saved():
    saved = []

    class Finite(hooks.Hook):
        def on_metrics(self, step, metrics):
            if step == 2:
                raise hooks.NonFiniteError(f"step {step}")

    with pytest.raises(hooks.NonFiniteError, match="step 2"):
        _run([Finite(), hooks.Checkpoint(2, lambda step, state: saved.append(step))], [], steps=4)
    assert saved == []


def test_a_profile_traces_exactly_its_steps(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(hooks.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(hooks.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    monkeypatch.setattr(hooks.jax, "block_until_ready", lambda state: calls.append(("ready", state)))
    events = []

    class Dispatch(hooks.Hook):
        def before_step(self, step):
            calls.append(("step", step))

    profile = hooks.Profile(str(tmp_path), first=1, count=2)
    _run([profile, Dispatch()], events, steps=5)
    profile.close()  # the segment closes every hook; the trace has already stopped
    assert calls == [("step", 0), ("start", str(tmp_path / "profile")), ("step", 1), ("step", 2),
                     ("ready", 3), ("stop",), ("step", 3), ("step", 4)]
