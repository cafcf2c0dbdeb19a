"""Every ``launch`` option is validated by type and range before any worker starts (SPEC §9; issue 24, item 5).

* Each bad option (``seed=-1``, ``steps=2.5``, ``steps="3"``, ``steps=True``, ``lr=nan``, a GPT-2 ``seq_len`` past
  its learned position table, ...) raises :class:`PlanValidationError` naming the option and the value, for one
  Program and for a list of candidates (mixed-length data), in well under a second, while the launcher's worker
  start and the local transport's process spawn are stubs that record any call and no child process appears
  (``/proc``).  A valid launch through the same stubs reaches them: the stubs are on the path.
* ``job.switch(strategy)`` specializes the Strategy for the running job and trains on; the losses equal the
  single-device reference that never switched.  ``job.switch(42)`` raises ``SwitchError`` naming ``int``; every
  event's strategy has a name, also for a Strategy built without one.
"""
from __future__ import annotations

import math
import multiprocessing
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import hspmd_sdk.runtime.control.controller  # noqa: E402,F401 - imported up front: the timing below measures checks only
import hspmd_sdk.runtime.workers.executor  # noqa: E402,F401
import hspmd_sdk.planner.cost  # noqa: E402,F401
from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, launch, specialize  # noqa: E402
from hspmd_sdk.core.strategy import Pipeline, Stage  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.errors import PlanValidationError  # noqa: E402
from hspmd_sdk.runtime.control.controller import SwitchError  # noqa: E402
from hspmd_sdk.runtime.control.mixed import launch_mixed  # noqa: E402
from hspmd_sdk.runtime.control.run_config import RunConfig, check_run_options, position_limit  # noqa: E402
from hspmd_sdk.runtime.control.train import reference_training, training_run  # noqa: E402
from test_switching import LR, SEED, SEQ, TOL, _close, _pipe, _program, _wait  # noqa: E402

DP2 = {"pipelines": [_pipe([([0], [0, 3])], 4, 1), _pipe([([1], [0, 3])], 4, 1)]}


# ---- the guard: nothing may start a worker ---------------------------------------------------------------------
def _children() -> set[int]:
    """Pids of this process's children, from /proc (every thread's list)."""
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            out |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            continue
    return out


class _Refused(RuntimeError):
    pass


@pytest.fixture()
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list:
    """The launcher's worker start (``launch_spec``) and the local transport's process spawn replaced by stubs
    that record the call and refuse: a check that lets a bad option through shows up as a call."""
    import hspmd_sdk.runtime.control.start as launcher  # where every worker start goes (launch_spec)
    from hspmd_sdk.runtime.transports.transport import LocalTransport

    calls: list = []

    def refuse(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Refused("a worker would have started")

    monkeypatch.setattr(launcher, "launch_spec", refuse)
    monkeypatch.setattr(LocalTransport, "_popen", refuse)
    return calls


def _refused_in_time(fn, *args, **kwargs) -> PlanValidationError:
    """``fn(*args, **kwargs)`` raises PlanValidationError in well under a second, no child process appeared."""
    before = _children()
    t0 = time.perf_counter()
    with pytest.raises(PlanValidationError) as info:
        fn(*args, **kwargs)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"the check took {elapsed:.3f} s"
    assert _children() <= before and multiprocessing.active_children() == []
    return info.value


@pytest.fixture(scope="module")
def llama_program():
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    return _program(model, DP2, cluster), cluster


@pytest.fixture(scope="module")
def gpt_program():
    model, cluster = GPTConfig.preset("tiny"), Cluster.local(2)
    return specialize(model, plan_from_strategy(model, Strategy.load(DP2), cluster), cluster), cluster


# ---- one bad option at a time ----------------------------------------------------------------------------------
BAD = [
    ({"seed": -1}, "seed", "-1"),
    ({"seed": 2 ** 40}, "seed", str(2 ** 40)),
    ({"steps": 2.5}, "steps", "2.5"),
    ({"steps": "3"}, "steps", "'3'"),
    ({"steps": True}, "steps", "True"),
    ({"steps": 0}, "steps", "0"),
    ({"lr": float("nan")}, "lr", "nan"),
    ({"lr": "1e-3"}, "lr", "'1e-3'"),
    ({"betas": (0.9, 1.0)}, "betas", "1.0"),
    ({"keep": -1}, "keep", "-1"),
    ({"checkpoint_every": 0}, "checkpoint_every", "0"),
    ({"precision": "fp16"}, "precision", "'fp16'"),
    ({"elastic": "yes"}, "elastic", "'yes'"),
    ({"seq_len": 1.5}, "seq_len", "1.5"),
    ({"recompute": [0, "1"]}, "recompute[1]", "'1'"),
    ({"timeout_s": -5}, "timeout_s", "-5"),
    ({"straggler": "often"}, "straggler", "'often'"),
    ({"setps": 3}, "setps", "'steps'"),                       # a misspelt option: its near name is suggested
    ({"tokens_per_step": 64}, "tokens_per_step", "64"),      # mixed-length only
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("options", "field", "shown"), BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_a_bad_option_is_refused_naming_it_before_any_worker(options: dict, field: str, shown: str,
                                                            llama_program, no_workers: list) -> None:
    program, cluster = llama_program
    kwargs = {"steps": 2, **options}
    err = _refused_in_time(launch, program, cluster, **kwargs)
    assert [p for p, _ in err.problems] == [field], err.problems
    text = str(err)
    assert text.startswith(f"invalid training run: {field}: ") and shown in text, text
    assert no_workers == []


@pytest.mark.timeout(60)
def test_the_stubs_are_on_the_path_a_good_launch_reaches_them(llama_program, no_workers: list) -> None:
    program, cluster = llama_program
    with pytest.raises(_Refused):
        launch(program, cluster, steps=2, seed=2 ** 32 - 1, seq_len=SEQ, keep=1, lr=1)  # edges of the ranges
    assert len(no_workers) == 1


@pytest.mark.timeout(60)
def test_each_launch_checks_its_options_once(llama_program, no_workers: list, monkeypatch) -> None:
    """One check of the options per launch (issue 23): ``launch`` checks them first, and neither the run it
    builds nor the mixed-length path checks them again -- a valid launch reaches the worker start after one."""
    import hspmd_sdk.runtime.control.run_config as run_config

    calls: list = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("what", "training run"))
        return check_run_options(*args, **kwargs)

    monkeypatch.setattr(run_config, "check_run_options", counted)
    program, cluster = llama_program
    with pytest.raises(_Refused):
        launch(program, cluster, steps=2, seq_len=SEQ)
    assert calls == ["training run"] and len(no_workers) == 1
    calls.clear()
    with pytest.raises(_Refused):  # two candidates: each specialized and checked against the cluster, options once
        launch([program, program], cluster, steps=2, tokens_per_step=256, context=SEQ)
    assert calls == ["mixed-length training run"] and len(no_workers) == 2
    calls.clear()
    with pytest.raises(_Refused):  # launch_mixed called directly checks them itself
        launch_mixed([program], cluster, steps=2, tokens_per_step=256, context=SEQ)
    assert calls == ["mixed-length training run"] and len(no_workers) == 3


@pytest.mark.timeout(60)
def test_every_bad_option_is_named_at_once(llama_program, no_workers: list) -> None:
    program, cluster = llama_program
    err = _refused_in_time(launch, program, cluster, steps=2.5, seed=-1, lr="x", precision="fp16",
                           elastic="yes", keep=0, weight_decay=-1.0, checkpoint_async=1)
    assert {p for p, _ in err.problems} == {"steps", "seed", "lr", "precision", "elastic", "keep", "weight_decay",
                                            "checkpoint_async"}, err.problems
    assert no_workers == []


@pytest.mark.timeout(60)
def test_training_run_never_rounds_or_parses_a_value(llama_program) -> None:
    program, cluster = llama_program
    for steps in (2.5, "3", True):
        with pytest.raises(PlanValidationError, match=r"steps: must be a whole number of steps >= 1"):
            training_run(program, steps=steps, cluster=cluster)
    assert training_run(program, steps=2, cluster=cluster, seq_len=SEQ)["steps"] == 2


# ---- the model's position limit ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_gpt2_seq_len_past_its_position_table_is_refused_with_the_limit(gpt_program, no_workers: list) -> None:
    program, cluster = gpt_program
    err = _refused_in_time(launch, program, cluster, steps=1, seq_len=65)
    assert [p for p, _ in err.problems] == ["seq_len"] and "at most 64" in str(err) and "65" in str(err), err
    # the 124M preset: its 1024 positions (only its graph is built, no weights)
    gpt2 = GPTConfig.preset("gpt2")
    assert position_limit(gpt2) == gpt2.max_seq_len == 1024
    with pytest.raises(PlanValidationError, match=r"seq_len: must be at most 1024 .*not 1025"):
        check_run_options(gpt2, steps=1, seq_len=1025)
    with pytest.raises(_Refused):
        launch(program, cluster, steps=1, seq_len=64)  # the limit itself is fine
    assert len(no_workers) == 1


def test_llama_with_rope_takes_sequences_past_its_max_seq_len() -> None:
    llama = LlamaConfig.preset("tiny")
    assert position_limit(llama) is None
    assert check_run_options(llama, steps=1, seq_len=2 * llama.max_seq_len).seq_len == 2 * llama.max_seq_len
    ref = reference_training(llama, steps=1, global_batch=2, seq_len=llama.max_seq_len + 16)  # RoPE: no table
    assert math.isfinite(ref.losses[0])


# ---- the mixed-length path: the same model ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_list_of_programs_validates_the_same_options(gpt_program, no_workers: list) -> None:
    program, cluster = gpt_program
    err = _refused_in_time(launch, [program], cluster, steps="3", seed=-1, tokens_per_step=0, lr=float("inf"))
    assert str(err).startswith("invalid mixed-length training run")
    assert {p for p, _ in err.problems} == {"steps", "seed", "tokens_per_step", "lr"}, err.problems
    err = _refused_in_time(launch_mixed, [program], cluster, steps=2.5, tokens_per_step=64, context=65,
                           lookahead=-1)
    assert {p for p, _ in err.problems} == {"steps", "context", "lookahead"} and "at most 64" in str(err), err
    assert no_workers == []


def test_run_config_is_a_typed_model() -> None:
    config = RunConfig.model_validate({"steps": 3, "seed": 7, "betas": [0.8, 0.9]})
    assert config.steps == 3 and config.betas == (0.8, 0.9) and config.precision == "fp32"
    with pytest.raises(Exception):
        config.steps = 4  # frozen


# ---- Job.switch with a Strategy ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_switching_to_a_strategy_trains_on_with_the_losses_of_the_run_that_never_switched() -> None:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    steps = 6
    # held at the start of step 2 until the switch, asked for there, is heard by both ranks
    job = launch(_program(model, DP2, cluster), cluster, steps=steps, seed=SEED, seq_len=SEQ, lr=LR,
                 timeout_s=60, hold_at=[2])
    try:
        with pytest.raises(SwitchError, match=r"Program or a Strategy, not int"):
            job.switch(42)
        with pytest.raises(SwitchError, match=r"not dict"):
            job.switch(DP2)
        # built in Python, without a name: the event still names it
        tp2 = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 3])], micro_batch_size=4,
                                           num_micro_batches=2)])
        assert tp2.name is None
        assert job.wait_held(2) == [0, 1]
        event = job.switch(tp2)
        job.wait_held(2, heard=event)
        job.release(2)
        _wait(lambda: event.done or job.status.value != "running", timeout=60)
        assert event.step == 3, str(event)
        result = job.wait(timeout=60)
    finally:
        job.cancel()
    ref = reference_training(model, steps=steps, seed=SEED, global_batch=8, seq_len=SEQ, lr=LR)
    assert [e.reason for e in result.events] == ["user"] and event.done
    assert event.strategy.name == "tp2" and event.strategy.model_dump(exclude={"name"}) == \
        tp2.model_dump(exclude={"name"})
    assert job.program.pipelines != _program(model, DP2, cluster).pipelines  # it runs the TP2 program now
    assert len(result.losses) == steps and _close(result.losses, ref.losses) <= TOL, (result.losses, ref.losses)


def test_a_switch_the_job_ends_before_is_marked_superseded() -> None:
    """Asked for in the job's last step (no step boundary left), the switch is never applied: once the job ended
    its event says so (``superseded``, not ``done``) instead of staying open."""
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    job = launch(_program(model, DP2, cluster), cluster, steps=3, seed=SEED, seq_len=SEQ, lr=LR,
                 timeout_s=60, hold_at=[2])
    assert job.wait_held(2) == [0, 1]  # held at the start of the last step: no boundary is left after it
    event = job.switch(Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 3])],
                                                    micro_batch_size=4, num_micro_batches=2)]))
    job.release(2)
    result = job.wait(timeout=60)
    assert len(result.losses) == 3 and event.superseded and not event.done, event


def test_every_strategy_the_sdk_reports_has_a_name() -> None:
    from hspmd_sdk.core.strategy_plan import strategy_of

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    bare = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0], layers=[0, 1]), Stage(devices=[1], layers=[2, 3])],
                                        micro_batch_size=2, num_micro_batches=4)], schedule="gpipe")
    program = specialize(model, plan_from_strategy(model, bare, cluster), cluster)
    assert strategy_of(program).name == "pp2-gpipe" == program.plan.meta["strategy_name"]
    assert Strategy.load(DP2).name == "dp2" and Strategy.load({**DP2, "name": "mine"}).name == "mine"
    assert Strategy.load(DP2).model_dump(exclude={"name"}) == Strategy.model_validate(DP2).model_dump(exclude={"name"})
