"""A Program that travels (SPEC §9): ``Program.to_json()`` / ``Program.from_json()`` round-trip exactly.

* Every packaged example strategy (the paper's Table 9 and 11 plans, Megatron's baselines, the tiny hetero
  example) on its cluster, and both model families under TP, PP, ZeRO-1, GPipe and recompute: the Program read
  back equals the one written (``==``), and so do every rank's executable graph and schedule, every
  communication plan and the training state's layouts; writing it again gives the same text.
* The text names nothing executable: a class outside ``hspmd_sdk.core``, a function, another format or a damaged
  text is refused with :class:`ProgramJSONError`.
* A Program written by this process trains in another one (a fresh interpreter reads the file and launches it),
  with the single-device model's losses.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize
from hspmd_sdk.core.program_json import ProgramJSONError
from hspmd_sdk.core.specialize import Program
from hspmd_sdk.core.strategy_plan import plan_from_strategy

EXAMPLES = Path(__file__).resolve().parents[1] / "hspmd_sdk" / "examples"
INDEX = json.loads((EXAMPLES / "index.json").read_text())["strategies"]


def _pipe(stages, mbs: int, n: int) -> dict:
    return {"stages": [{"devices": d, "layers": l, **({"recompute": True} if rc else {})} for d, l, rc in stages],
            "micro_batch_size": mbs, "num_micro_batches": n}


TINY = {
    "hetero_zero1": {"pipelines": [_pipe([([0, 1], [0, 1], False), ([2], [2, 3], True)], 2, 3),
                                   _pipe([([3], [0, 3], False)], 2, 1)], "zero1": True},
    "pp2_gpipe": {"pipelines": [_pipe([([2], [0, 1], False), ([3], [2, 3], False)], 2, 4)], "schedule": "gpipe"},
    "tp4": {"pipelines": [_pipe([([0, 1, 2, 3], [0, 3], False)], 4, 2)]},
}


def _same(a: Program, b: Program) -> None:
    assert b == a
    assert b.pipelines == a.pipelines and b.bindings == a.bindings and b.recompute == a.recompute
    assert dict(b.comm_plans) == dict(a.comm_plans) and dict(b.grad_sync_plans) == dict(a.grad_sync_plans)
    assert b.state_layouts() == a.state_layouts()
    for r in a.ranks:
        assert b.executable_graph(r) == a.executable_graph(r), r
        assert b.schedule(r) == a.schedule(r), r


#: the default run round-trips one example of each kind (the tiny one, a table 11 plan, a table 9 plan, a Megatron
#: baseline); the other twelve, ~10 s each on 2 cores, run with -m slow
QUICK_EXAMPLES = {"example_hetero_tiny.json", "table11_c1.json", "table9_32b_16h800_16h20.json",
                  "megatron_32b_16h800_16h20.json"}


@pytest.mark.parametrize("name", [n if n in QUICK_EXAMPLES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(INDEX)])
def test_every_packaged_example_round_trips(name: str) -> None:
    info = INDEX[name]
    model = LlamaConfig.preset(info["model"])
    cluster = Cluster.load(EXAMPLES / info["cluster"])
    strategy = Strategy.load(EXAMPLES / name)
    program = specialize(model, plan_from_strategy(model, strategy, cluster), cluster,
                         bindings={"B": info["global_batch"], "S": 4096})
    text = program.to_json()
    back = Program.from_json(text)
    _same(program, back)
    assert back.to_json() == text
    assert back.cluster == cluster and back.model == model


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("shape", sorted(TINY))
def test_both_families_round_trip(family: str, shape: str) -> None:
    model = (LlamaConfig if family == "llama" else GPTConfig).preset("tiny")
    cluster = Cluster.local(4)
    program = specialize(model, plan_from_strategy(model, Strategy.load(TINY[shape]), cluster), cluster,
                         bindings={"B": 8, "S": 16})
    back = Program.from_json(program.to_json())
    _same(program, back)
    # what a reader rebuilds on demand (caches) is rebuilt the same: concrete plans at other shapes
    name = next(iter(program.comm_plans))
    assert back.concrete_plan(name, {"B": 4, "S": 32}) == program.concrete_plan(name, {"B": 4, "S": 32})


def _tiny_program() -> Program:
    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(4)
    return specialize(model, plan_from_strategy(model, Strategy.load(TINY["hetero_zero1"]), cluster), cluster,
                      bindings={"B": 8, "S": 16})


def test_the_text_names_nothing_executable() -> None:
    data = json.loads(_tiny_program().to_json())
    objects = data["objects"]
    # a class outside hspmd_sdk.core (here: one whose construction would run a command) is refused
    victim = next(i for i, o in enumerate(objects) if "$c" in o)
    for path in ("subprocess:Popen", "os:system", "hspmd_sdk.runtime.control.job:Job", "builtins:eval"):
        bad = json.loads(json.dumps(data))
        bad["objects"][victim]["$c"] = path
        with pytest.raises(ProgramJSONError, match="may only name classes of hspmd_sdk.core"):
            Program.from_json(json.dumps(bad))
    # a core name that is a function, not a class
    bad = json.loads(json.dumps(data))
    bad["objects"][victim]["$c"] = "hspmd_sdk.core.specialize:specialize"
    with pytest.raises(ProgramJSONError, match="not a class"):
        Program.from_json(json.dumps(bad))
    with pytest.raises(ProgramJSONError, match="format"):
        Program.from_json(json.dumps({**data, "format": "hspmd-program/0"}))
    with pytest.raises(ProgramJSONError, match="not a Program's JSON"):
        Program.from_json("{" + json.dumps(data)[:100])
    with pytest.raises(ProgramJSONError, match="unknown tag"):
        Program.from_json(json.dumps({**data, "root": {"$exec": "print(1)"}}))


def test_a_program_with_a_custom_resolver_cannot_travel() -> None:
    from hspmd_sdk.core.resolve import resolve

    model, cluster = LlamaConfig.preset("tiny"), Cluster.local(2)
    plan = plan_from_strategy(model, Strategy.load({"pipelines": [_pipe([([0, 1], [0, 3], False)], 2, 1)]}), cluster)
    program = specialize(model, plan, cluster, resolver=lambda *a: resolve(*a))
    with pytest.raises(ProgramJSONError, match="custom resolver"):
        program.to_json()


@pytest.mark.timeout(120)
def test_a_program_written_here_trains_in_another_process(tmp_path: Path) -> None:
    from hspmd_sdk.runtime.control.train import reference_training

    path = tmp_path / "program.json"
    path.write_text(_tiny_program().to_json())
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from hspmd_sdk import Cluster
        from hspmd_sdk.core.specialize import Program
        from hspmd_sdk.runtime.control.train import launch

        program = Program.from_json(Path({str(path)!r}).read_text())
        job = launch(program, Cluster.local(4), steps=3, seed=5, seq_len=16, timeout_s=60)
        print(json.dumps(job.wait(timeout=100).losses))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])
    ref = reference_training(LlamaConfig.preset("tiny"), steps=3, seed=5, global_batch=8, seq_len=16)
    assert len(losses) == 3
    assert max(abs(a - b) / b for a, b in zip(losses, ref.losses)) <= 1e-5, (losses, ref.losses)
