"""A training run as one typed value (SPEC §13, ``hspmd_sdk.runtime.train_config``): defaults everywhere, exact TOML
and JSON round trips, unknown keys and bad values named by dotted path, the flat keywords of ``launch`` both ways,
keyword/config conflicts, and ``hspmd train --dry-run`` / ``--template`` through the CLI."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hspmd_sdk.cli import main
from hspmd_sdk.cli.train import data_parallel_strategy
from hspmd_sdk.errors import PlanValidationError
from hspmd_sdk.runtime.lr_schedule import Schedule
from hspmd_sdk.runtime.train_config import FLAT_KEYWORDS, SECTIONS, TrainConfig, template_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Every field's default, written out here (SPEC §13 and the launch defaults they carry over).
DEFAULTS = {
    "run": {"steps": 100, "seed": 0, "seq_len": None, "global_batch": None, "precision": "fp32", "device": None,
            "recompute": None, "init": None},
    "data": {"path": "stdlib", "tokens_per_step": None, "context": None, "lookahead": 2, "packing": None},
    "optimizer": {"kind": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                  "decay": "matrices"},
    "schedule": {"kind": "constant", "warmup_steps": 0, "decay_steps": None, "stable_steps": None,
                 "min_lr_factor": 0.0},
    "clip": {"max_norm": None},
    "eval": {"every": None, "batches": 4},
    "checkpoint": {"dir": None, "every": None, "keep": 3, "async": True, "resume_from": None},
    "reconfigure": {"elastic": False, "straggler": None, "grow_back": None},
    "launcher": {"timeout_s": 120.0, "heartbeat_s": 1.0, "stall_s": 30.0, "log_dir": None, "tensorboard": None,
                 "progress": None, "profile": [], "echo": False, "resource_check": True},
    "plan": {"model": "llama:tiny", "strategy": None, "cluster": "local:1"},
}

#: The flat keywords of ``launch`` (today's, and the new ones of SPEC §13) and the field each fills.
FLAT = {
    "steps": "run.steps", "seed": "run.seed", "seq_len": "run.seq_len", "recompute": "run.recompute",
    "init": "run.init", "precision": "run.precision", "device": "run.device", "data": "data.path",
    "tokens_per_step": "data.tokens_per_step", "context": "data.context", "lookahead": "data.lookahead",
    "packing": "data.packing", "lr": "optimizer.lr", "betas": "optimizer.betas", "eps": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay", "decay": "optimizer.decay", "optimizer": "optimizer.kind",
    "schedule": "schedule",
    "max_norm": "clip.max_norm", "eval_every": "eval.every", "eval_batches": "eval.batches",
    "checkpoint_dir": "checkpoint.dir", "checkpoint_every": "checkpoint.every", "keep": "checkpoint.keep",
    "checkpoint_async": "checkpoint.async", "resume_from": "checkpoint.resume_from",
    "elastic": "reconfigure.elastic", "straggler": "reconfigure.straggler", "grow_back": "reconfigure.grow_back",
    "timeout_s": "launcher.timeout_s", "heartbeat_s": "launcher.heartbeat_s", "stall_s": "launcher.stall_s",
    "log_dir": "launcher.log_dir", "tensorboard": "launcher.tensorboard", "progress": "launcher.progress",
    "echo": "launcher.echo", "resource_check": "launcher.resource_check", "profile": "launcher.profile",
}


# ---- defaults --------------------------------------------------------------------------------------------------------
def test_every_field_has_its_default() -> None:
    assert json.loads(TrainConfig().to_json()) == DEFAULTS
    for section in SECTIONS.values():
        assert not [name for name, f in section.model_fields.items() if f.is_required()]
    assert TrainConfig.from_toml("") == TrainConfig.from_json("{}") == TrainConfig.from_dict({}) == TrainConfig()


def test_the_template_is_every_default_and_documents_every_field() -> None:
    text = template_toml()
    assert TrainConfig.from_toml(text) == TrainConfig()
    for section, fields in DEFAULTS.items():
        assert f"[{section}]" in text
        for key in fields:
            assert f"\n{key} =" in text or f"\n# {key} =" in text, key


# ---- round trips -------------------------------------------------------------------------------------------------
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
POSITIVE = st.floats(min_value=1e-12, max_value=1e12, allow_nan=False, allow_infinity=False)
OPT_INT = st.none() | st.integers(1, 10 ** 9)


@st.composite
def configs(draw: st.DrawFn, *, plan: bool = True) -> TrainConfig:
    steps = draw(st.integers(1, 10 ** 6))
    kind = draw(st.sampled_from(["constant", "linear", "cosine", "wsd"]))
    schedule = {"kind": kind, "warmup_steps": draw(st.integers(0, 10 ** 4))}
    if kind != "constant":
        schedule |= {"decay_steps": draw(OPT_INT), "min_lr_factor": draw(st.floats(0, 1))}
    if kind == "wsd":
        schedule["stable_steps"] = draw(st.none() | st.integers(0, 10 ** 4))
    elastic = draw(st.booleans())
    data = {
        "run": {"steps": steps, "seed": draw(st.integers(0, 2 ** 32 - 1)), "seq_len": draw(OPT_INT),
                "global_batch": draw(OPT_INT) if plan else None, "precision": draw(st.sampled_from(["fp32", "bf16"])),
                "device": draw(st.sampled_from([None, "cpu", "cuda"])),
                "recompute": draw(st.none() | st.lists(st.integers(0, 10 ** 5), max_size=4)),
                "init": draw(st.none() | TEXT)},
        "data": {"path": draw(TEXT), "tokens_per_step": draw(OPT_INT), "context": draw(OPT_INT),
                 "lookahead": draw(st.integers(0, 100)), "packing": draw(st.sampled_from([None, True, False]))},
        "optimizer": {"lr": draw(POSITIVE), "betas": draw(st.tuples(*[st.floats(0, 1, exclude_max=True)] * 2)),
                      "eps": draw(POSITIVE), "weight_decay": draw(st.just(0.0) | POSITIVE),
                      "decay": draw(st.sampled_from(["matrices", "all"])),
                      "kind": draw(st.sampled_from(["adam", "adamw"]))},
        "schedule": schedule,
        "clip": {"max_norm": draw(st.none() | POSITIVE)},
        "eval": {"every": draw(OPT_INT), "batches": draw(st.integers(1, 1000))},
        "checkpoint": {"dir": draw(st.none() | TEXT), "every": draw(OPT_INT), "keep": draw(st.integers(1, 50)),
                       "async": draw(st.booleans()), "resume_from": draw(st.none() | TEXT)},
        "reconfigure": {"elastic": elastic, "straggler": draw(st.sampled_from([None, True, False])),
                        "grow_back": draw(st.sampled_from([None, True, False] if elastic else [None, False]))},
        "launcher": {"timeout_s": draw(POSITIVE), "heartbeat_s": draw(st.floats(1e-3, 60)),
                     "stall_s": draw(st.none() | POSITIVE), "log_dir": draw(st.none() | TEXT),
                     "tensorboard": draw(st.none() | TEXT), "progress": draw(st.sampled_from([None, True, False])),
                     "profile": draw(st.lists(st.integers(0, steps - 1), max_size=4)),
                     "echo": draw(st.booleans()), "resource_check": draw(st.booleans())},
    }
    if plan:
        data["plan"] = {"model": draw(TEXT), "strategy": draw(st.none() | TEXT),
                        "cluster": draw(st.integers(1, 64).map(lambda n: f"local:{n}")
                                        | TEXT.filter(lambda t: not t.startswith("local:")))}
    return TrainConfig.from_dict(data)


@settings(max_examples=200, deadline=None)
@given(cfg=configs())
def test_toml_and_json_round_trip_exactly(cfg: TrainConfig) -> None:
    text = cfg.to_toml()
    tomllib.loads(text)  # valid TOML for any reader, not only ours
    assert TrainConfig.from_toml(text) == cfg
    assert TrainConfig.from_toml(text).to_toml() == text
    assert TrainConfig.from_json(cfg.to_json()) == cfg


def test_files_round_trip_by_suffix(tmp_path: Path) -> None:
    cfg = TrainConfig.from_launch_kwargs(steps=7, lr=3e-3, schedule={"kind": "cosine", "warmup_steps": 2},
                                         checkpoint_dir=tmp_path / "ckpt", stall_s=None, profile=[1, 3])
    (tmp_path / "run.toml").write_text(cfg.to_toml(), encoding="utf-8")
    (tmp_path / "run.json").write_text(cfg.to_json(), encoding="utf-8")
    assert TrainConfig.from_file(tmp_path / "run.toml") == TrainConfig.from_file(str(tmp_path / "run.json")) == cfg
    assert cfg.checkpoint.dir == str(tmp_path / "ckpt") and cfg.launcher.stall_s is None
    (tmp_path / "run.yaml").write_text("", encoding="utf-8")
    with pytest.raises(PlanValidationError, match="toml or .json"):
        TrainConfig.from_file(tmp_path / "run.yaml")
    with pytest.raises(PlanValidationError, match="cannot be read"):
        TrainConfig.from_file(tmp_path / "missing.toml")
    with pytest.raises(PlanValidationError, match="not valid TOML"):
        TrainConfig.from_toml("[run\nsteps = 3")


# ---- problems named by dotted path -------------------------------------------------------------------------------
@pytest.mark.parametrize("toml,path,hint", [
    ("[optimizer]\nlrr = 1e-3", "optimizer.lrr", "did you mean 'lr'"),
    ("[optimiser]\nlr = 1e-3", "optimiser", "did you mean 'optimizer'"),
    ("steps = 3", "steps", "not a section"),
    ("[schedule]\nkind = 'cosine'\nwarmup = 3", "schedule.warmup", "did you mean 'warmup_steps'"),
    ("[checkpoint]\nasynchronous = true", "checkpoint.asynchronous", "its fields: dir, every, keep, async"),
    ("[run.extra]\nx = 1", "run.extra", "not a field of [run]"),
])
def test_an_unknown_key_is_named_by_its_dotted_path(toml: str, path: str, hint: str) -> None:
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_toml(toml)
    assert [p for p, _ in err.value.problems] == [path]
    assert hint in err.value.problems[0][1]


@pytest.mark.parametrize("data,path,words", [
    ({"run": {"steps": 2.5}}, "run.steps", "whole number"),
    ({"run": {"steps": True}}, "run.steps", "whole number"),
    ({"run": {"steps": "3"}}, "run.steps", "whole number"),
    ({"run": {"steps": 0}}, "run.steps", ">= 1"),
    ({"run": {"seed": 2 ** 32}}, "run.seed", "2**32"),
    ({"run": {"precision": "fp16"}}, "run.precision", "'bf16'"),
    ({"run": {"recompute": [0, -1]}}, "run.recompute[1]", "ranks"),
    ({"run": {"init": ""}}, "run.init", "non-empty"),
    ({"data": {"path": 3}}, "data.path", "corpus directory"),
    ({"data": {"source": "stdlib"}}, "data.source", "renamed: write 'path'"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr", "> 0"),
    ({"optimizer": {"lr": math.inf}}, "optimizer.lr", "finite"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]", "[0, 1)"),
    ({"optimizer": {"betas": [0.9, 0.9, 0.9]}}, "optimizer.betas", "two finite numbers"),
    ({"optimizer": {"decay": "norms"}}, "optimizer.decay", "'matrices' or 'all'"),
    ({"clip": {"max_norm": -1.0}}, "clip.max_norm", "> 0"),
    ({"eval": {"every": 0}}, "eval.every", ">= 1"),
    ({"checkpoint": {"async": "yes"}}, "checkpoint.async", "True or False"),
    ({"reconfigure": {"grow_back": True}}, "reconfigure.grow_back", "elastic"),
    ({"launcher": {"heartbeat_s": 61.0}}, "launcher.heartbeat_s", "(0, 60]"),
    ({"launcher": {"profile": [3]}, "run": {"steps": 3}}, "launcher.profile[0]", "not a step of this run"),
    ({"plan": {"cluster": "local:0"}}, "plan.cluster", "local:N"),
    ({"optimizer": 3}, "optimizer", "table of fields"),
])
def test_a_bad_value_is_named_with_what_is_allowed(data: dict, path: str, words: str) -> None:
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_dict(data)
    assert err.value.problems[0][0] == path
    assert words in err.value.problems[0][1]


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_toml("[run]\nsteps = 0\nseed = -1\n[optimizer]\nlr = -1\nlrr = 2\n[eval]\nbatches = 0")
    assert sorted(p for p, _ in err.value.problems) == ["eval.batches", "optimizer.lr", "optimizer.lrr", "run.seed",
                                                        "run.steps"]


# ---- the flat keywords of launch -----------------------------------------------------------------------------------
def test_the_flat_keywords_fill_their_fields() -> None:
    assert dict(FLAT_KEYWORDS) == FLAT
    cfg = TrainConfig.from_launch_kwargs(steps=12, lr=3e-3, betas=[0.8, 0.9], checkpoint_dir=Path("ck"),
                                         checkpoint_async=False, schedule="cosine", profile=4, max_norm=1.0,
                                         eval_every=5, eval_batches=2, decay="all", data="synthetic", stall_s=None)
    assert (cfg.run.steps, cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.decay) == (12, 3e-3, (0.8, 0.9), "all")
    assert (cfg.checkpoint.dir, cfg.checkpoint.async_, cfg.schedule, cfg.launcher.profile) == \
        ("ck", False, Schedule(kind="cosine"), [4])
    assert (cfg.clip.max_norm, cfg.eval.every, cfg.eval.batches, cfg.data.path) == (1.0, 5, 2, "synthetic")
    assert cfg.launcher.stall_s is None
    schedule = Schedule(kind="wsd", warmup_steps=2, decay_steps=3)
    assert TrainConfig.from_launch_kwargs(schedule=schedule).schedule == schedule
    assert TrainConfig.from_launch_kwargs(schedule={"kind": "linear"}).schedule == Schedule(kind="linear")


@settings(max_examples=150, deadline=None)
@given(cfg=configs(plan=False))
def test_launch_kwargs_and_from_launch_kwargs_are_inverse(cfg: TrainConfig) -> None:
    every = cfg.launch_kwargs()
    assert set(every) == set(FLAT)
    assert TrainConfig.from_launch_kwargs(**every) == cfg
    changed = cfg.launch_kwargs(changed_only=True)
    assert TrainConfig.from_launch_kwargs(**changed) == cfg
    default = TrainConfig().launch_kwargs()
    assert {k for k in every if every[k] != default[k]} | {"steps"} == set(changed)
    assert isinstance(every["schedule"], Schedule) and isinstance(every["betas"], tuple)


def test_keywords_that_are_not_config_fields_are_named() -> None:
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_launch_kwargs(lrr=1e-3, transport=object(), lr=-1.0)
    problems = dict(err.value.problems)
    assert set(problems) == {"lrr", "transport", "lr"}
    assert "did you mean 'lr'" in problems["lrr"] and "keywords of launch" in problems["transport"]
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_launch_kwargs(data=[1, 2, 3], init={"w": 0}, straggler=object(), profile=[0, 9], steps=5)
    assert [p for p, _ in err.value.problems] == ["init", "data", "straggler"]
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_launch_kwargs(profile=[0, 9], steps=5)
    assert [p for p, _ in err.value.problems] == ["profile[1]"]


def test_merged_lays_keywords_over_a_config_and_refuses_a_conflict() -> None:
    cfg = TrainConfig.from_toml("[optimizer]\nlr = 0.01\n[run]\nsteps = 50\n[schedule]\nkind = 'cosine'")
    over = cfg.merged({"seed": 3, "lr": 0.01, "max_norm": 1.0})  # lr: the same value twice is no conflict
    assert (over.run.seed, over.optimizer.lr, over.clip.max_norm, over.run.steps) == (3, 0.01, 1.0, 50)
    with pytest.raises(PlanValidationError) as err:
        cfg.merged({"lr": 3e-3, "steps": 10, "schedule": "linear", "seed": 1, "keep": 0})
    problems = dict(err.value.problems)
    assert set(problems) == {"lr", "steps", "schedule", "keep"}
    assert "optimizer.lr = 0.01" in problems["lr"] and "given twice" in problems["steps"]
    assert cfg.merged({"schedule": Schedule(kind="cosine")}) == cfg
    # a field at its default takes the keyword, even the default's own value
    assert TrainConfig().merged({"lr": 1e-3}) == TrainConfig()


def test_updated_replaces_fields_by_dotted_path() -> None:
    cfg = TrainConfig().updated({"run.steps": 9, "checkpoint.async": False, "schedule": {"kind": "linear"}})
    assert (cfg.run.steps, cfg.checkpoint.async_, cfg.schedule.kind) == (9, False, "linear")
    with pytest.raises(PlanValidationError) as err:
        TrainConfig().updated({"run.stepz": 9})
    assert err.value.problems[0][0] == "run.stepz"
    with pytest.raises(PlanValidationError) as err:
        TrainConfig.from_toml("[launcher]\nprofile = [7]").updated({"run.steps": 5})
    assert err.value.problems[0][0] == "launcher.profile[0]"


# ---- hspmd train -------------------------------------------------------------------------------------------------
def test_cli_template_prints_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--template"]) == 0
    assert TrainConfig.from_toml(capsys.readouterr().out) == TrainConfig()


def test_cli_dry_run_prints_the_plan_and_the_resolved_config(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[run]\nsteps = 30\nglobal_batch = 5\n[schedule]\nkind = 'cosine'\nwarmup_steps = 3\n"
                    "[plan]\nmodel = 'gpt:tiny'\ncluster = 'local:3'\n", encoding="utf-8")
    assert main(["train", str(path), "--dry-run", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "dp3" in out and "global batch 5" in out and "cosine: warmup 3, decay 9 steps" in out
    resolved = out.split("# the resolved config\n", 1)[1].rsplit("dry run", 1)[0]
    assert TrainConfig.from_toml(resolved) == TrainConfig.from_file(path).updated({"run.steps": 12})


def test_cli_dry_run_of_a_strategy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"plan": {"strategy": "example_hetero_tiny", "cluster": "local:4"}}), encoding="utf-8")
    assert main(["train", str(path), "--dry-run"]) == 0
    assert "global batch 8" in capsys.readouterr().out


@pytest.mark.parametrize("toml,named", [
    ("[optimizer]\nlrr = 1", "optimizer.lrr"),
    ("[plan]\nmodel = 'gpt:huge'", "plan.model"),
    ("[plan]\nstrategy = 'example_hetero_tiny'\ncluster = 'local:2'", "plan.strategy"),
    ("[run]\nglobal_batch = 2\n[plan]\ncluster = 'local:3'", "run.global_batch"),
])
def test_cli_errors_name_the_config_field(tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str,
                                          named: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(toml, encoding="utf-8")
    assert main(["train", str(path), "--dry-run"]) == 1
    assert f"  {named}" in capsys.readouterr().err


def test_the_default_strategy_shares_the_batch_over_every_rank() -> None:
    s = data_parallel_strategy(4, 3, 5)
    assert [(p.micro_batch_size, p.num_micro_batches, p.ranks, p.num_layers) for p in s.pipelines] == \
        [(2, 1, [0], 4), (2, 1, [1], 4), (1, 1, [2], 4)]
    assert data_parallel_strategy(2, 2).global_batch == 4


def test_cli_launches_the_program_with_the_config_and_prints_each_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The launch itself is ``hspmd_sdk.launch``'s (tested with it); here a stand-in records what it is given."""
    from types import SimpleNamespace

    import hspmd_sdk.runtime.control.train as train

    calls = []

    def fake_launch(program: object, cluster: object, *, config: TrainConfig) -> object:
        calls.append((program, cluster, config))
        result = SimpleNamespace(losses=[5.5, 5.25, 5.0], lrs=[1e-3, 5e-4, 2.5e-4], grad_norms=[2.0, 1.5, 1.25],
                                 val_losses={2: 4.75}, events=[])
        return SimpleNamespace(log_dir=str(tmp_path), wait=lambda: result)

    monkeypatch.setattr(train, "launch", fake_launch)
    path = tmp_path / "run.toml"
    path.write_text("[plan]\ncluster = 'local:2'\n[eval]\nevery = 2\n", encoding="utf-8")
    assert main(["train", str(path), "--steps", "4"]) == 0
    (program, cluster, config), = calls
    assert config == TrainConfig.from_file(path).updated({"run.steps": 4})
    assert cluster.num_ranks == 2 and sorted(program.ranks) == [0, 1]
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    # a resumed run (3 of 4 steps) starts at its checkpoint's step 1
    assert rows[-3:] == [["1", "5.500000", "1.000e-03", "2.0000"], ["2", "5.250000", "5.000e-04", "1.5000", "4.750000"],
                         ["3", "5.000000", "2.500e-04", "1.2500"]]
