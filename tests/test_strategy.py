"""Strategies: the paper's fixtures load with their model and cluster, JSON round trips, schema, exact errors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hspmd_sdk.core.cluster import Cluster
from hspmd_sdk import LlamaConfig
from hspmd_sdk.core.plan import AnnotationPlan
from hspmd_sdk.core.strategy import Pipeline, Stage, Strategy, memory_estimate
from hspmd_sdk.errors import PlanValidationError

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
INDEX = json.loads((EXAMPLES / "index.json").read_text())
STRATEGY_FILES = sorted(INDEX["strategies"])


def context(name: str) -> dict[str, Any]:
    e = INDEX["strategies"][name]
    return dict(model=LlamaConfig.preset(e["model"]), cluster=Cluster.load(EXAMPLES / e["cluster"]),
                global_batch=e["global_batch"])


def problems(data: Any, **ctx: Any) -> list[tuple[str, str]]:
    with pytest.raises(PlanValidationError) as info:
        Strategy.load(data, **ctx)
    assert all(p for p, _ in info.value.problems)
    return info.value.problems


def c2_dict() -> dict[str, Any]:
    return json.loads((EXAMPLES / "table11_c2.json").read_text())


# ---- fixtures ------------------------------------------------------------------------------------------------
def test_every_strategy_fixture_is_indexed() -> None:
    on_disk = {p.name for p in EXAMPLES.glob("*.json")
               if "pipelines" in json.loads(p.read_text())}
    assert on_disk == set(STRATEGY_FILES)
    assert len([n for n in STRATEGY_FILES if n.startswith("table9_")]) == 6


@pytest.mark.parametrize("name", STRATEGY_FILES)
def test_fixture_loads_with_its_context_and_round_trips(name: str, tmp_path: Path) -> None:
    path = EXAMPLES / name
    s = Strategy.load(path, **context(name))
    assert Strategy.load(str(path)) == s and Strategy.load(path.read_text()) == s
    assert Strategy.load(json.loads(path.read_text())) == s and Strategy.load(s) is s
    assert Strategy.model_validate_json(s.model_dump_json()) == s
    assert Strategy.model_validate_json(s.to_json()) == s
    assert json.loads(s.model_dump_json()) == json.loads(path.read_text())  # the file is exactly the model
    assert s.global_batch == INDEX["strategies"][name]["global_batch"]
    assert "pipeline 0" in s.summary(context(name)["model"], context(name)["cluster"])


@pytest.mark.parametrize("name", STRATEGY_FILES)
def test_json_schema_validates_fixture(name: str) -> None:
    import jsonschema
    jsonschema.validate(json.loads((EXAMPLES / name).read_text()), Strategy.json_schema())


def test_json_schema_rejects_what_the_loader_rejects() -> None:
    import jsonschema
    bad = c2_dict()
    bad["pipelines"][0]["micro_batch_size"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, Strategy.json_schema())
    bad = c2_dict()
    bad["pipelines"][0]["stages"][0]["unknown"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, Strategy.json_schema())


def test_table9_and_table11_read_like_the_paper() -> None:
    # Table 9, 32B on 16 H800 + 16 H20: H20 ranks 16-23 take layers 0-13, H800 ranks 0-7 layers 14-59.
    s = Strategy.load(EXAMPLES / "table9_32b_16h800_16h20.json")
    assert s.zero1 and s.dp_degree == 2 and s.schedule == "1f1b"
    assert [st.layers for st in s.pipelines[0].stages] == [[0, 6], [7, 13], [14, 36], [37, 59]]
    assert s.pipelines[1].stages[2].devices == [8, 9, 10, 11]
    # Table 11 C2 on 31 H20: 33 x bs1 over 4 stages and 31 x bs1 over 5 stages, the last a single GPU.
    c2 = Strategy.load(EXAMPLES / "table11_c2.json")
    assert not c2.zero1 and [p.num_micro_batches for p in c2.pipelines] == [33, 31]
    assert c2.tp_degrees() == [[4, 4, 4, 4], [4, 4, 4, 2, 1]]
    assert c2.stage_of(30) == (1, 4) and c2.tp_degree(29) == 2 and c2.ranks == list(range(31))
    assert c2.num_ranks == 31 and c2.global_batch == 64
    with pytest.raises(KeyError, match="rank 31 is not used"):
        c2.stage_of(31)


def test_megatron_fixture_uses_megatron_rank_order() -> None:
    # DP2TP4PP4: rank = pp * 8 + dp * 4 + tp; 60 layers / 4 stages = 15 each; 64 / (2 x bs2) = 16 micro-batches.
    s = Strategy.load(EXAMPLES / "megatron_32b_16h800_16h20.json")
    assert [st.devices[0] for st in s.pipelines[1].stages] == [4, 12, 20, 28]
    assert all(st.num_layers == 15 for p in s.pipelines for st in p.stages)
    assert [(p.micro_batch_size, p.num_micro_batches) for p in s.pipelines] == [(2, 16), (2, 16)]


# ---- context-free errors -------------------------------------------------------------------------------------
def test_rank_in_two_stages() -> None:
    d = c2_dict()
    d["pipelines"][1]["stages"][2]["devices"] = [24, 25, 26, 5]
    assert problems(d) == [("pipelines[1].stages[2].devices", "rank 5 is already in pipelines[0].stages[1]")]


def test_layers_must_be_ordered_and_contiguous() -> None:
    d = c2_dict()
    d["pipelines"][0]["stages"][1]["layers"] = [20, 29]
    (path, reason), = problems(d)
    assert path == "pipelines[0].stages[1].layers"
    assert reason.startswith("starts at layer 20 but stages[0] ends at layer 14, so this stage must start at 15")
    d = c2_dict()
    d["pipelines"][1]["stages"][0]["layers"] = [1, 15]
    assert problems(d)[0][0] == "pipelines[1].stages[0].layers"
    d = c2_dict()
    d["pipelines"][0]["stages"][3]["layers"] = [45, 44]
    assert problems(d) == [("pipelines[0].stages[3].layers",
                            "[45, 44] is empty; give [first, last] with first <= last")]
    d["pipelines"][0]["stages"][3]["layers"] = [45]
    assert problems(d)[0][0] == "pipelines[0].stages[3].layers"


def test_structural_field_errors() -> None:
    d = c2_dict()
    d["pipelines"][1]["num_micro_batches"] = 0
    d["schedule"] = "interleaved"
    got = dict(problems(d))
    assert "greater than or equal to 1" in got["pipelines[1].num_micro_batches"]
    assert "gpipe" in got["schedule"]
    d = c2_dict()
    d["pipelines"][0]["stages"][0]["devices"] = [0, 0, 1, 2]
    assert problems(d) == [("pipelines[0].stages[0].devices", "rank 0 is listed twice")]
    assert problems({"pipelines": []})[0][0] == "pipelines"
    assert problems([1, 2])[0][0] == "<root>"


def test_missing_file_is_a_validation_error(tmp_path: Path) -> None:
    (path, reason), = problems(tmp_path / "nope.json")
    assert path.endswith("nope.json") and "no such file" in reason


# ---- context-dependent errors --------------------------------------------------------------------------------
def test_layers_must_cover_the_model() -> None:
    d = c2_dict()
    d["pipelines"][0]["stages"][3]["layers"] = [45, 58]
    m = LlamaConfig.preset("llama-32b")
    assert problems(d, model=m) == [("pipelines[0]", "layers cover 0..58 but the model has 60 layers (0..59)")]


def test_tp_degree_must_divide_the_model() -> None:
    d = c2_dict()
    d["pipelines"][1]["stages"][3]["devices"] = [28, 29, 30]
    d["pipelines"][1]["stages"][4]["devices"] = [31]
    m = LlamaConfig.preset("llama-32b")
    assert problems(d, model=m) == [("pipelines[1].stages[3].devices", "TP degree 3 does not divide num_heads=64")]
    # 70B: 64 heads but 8 kv heads; TP 16 divides the heads, not the kv heads.
    s = {"pipelines": [{"stages": [{"devices": list(range(16)), "layers": [0, 79]}], "micro_batch_size": 1,
                        "num_micro_batches": 1}]}
    assert problems(s, model=LlamaConfig.preset("llama-70b")) == [
        ("pipelines[0].stages[0].devices", "TP degree 16 does not divide num_kv_heads=8")]


def test_ranks_must_exist_in_the_cluster() -> None:
    c1 = json.loads((EXAMPLES / "table11_c1.json").read_text())  # uses ranks 0..31
    got = problems(c1, cluster=Cluster.load(EXAMPLES / "h20_31.json"))
    assert got == [("pipelines[1].stages[3].devices", "rank 31 is not in the cluster (31 ranks: 0..30)")]


def test_global_batch_must_match() -> None:
    (path, reason), = problems(EXAMPLES / "table11_c2.json", global_batch=60)
    assert path == "pipelines"
    assert reason.startswith("micro-batches sum to 64 samples (pipeline 0: 33 x bs1, pipeline 1: 31 x bs1) but "
                             "the global batch is 60")


def test_all_context_problems_are_reported_together() -> None:
    d = c2_dict()
    d["pipelines"][0]["stages"][3]["layers"] = [45, 58]
    found = problems(d, model=LlamaConfig.preset("llama-32b"), cluster=Cluster.homogeneous("H20", 16),
                     global_batch=8)
    # one problem a stage with ranks outside the 16-rank cluster (its ranks in one line), not one a rank
    outside = [(i, j) for i, p in enumerate(d["pipelines"]) for j, st in enumerate(p["stages"])
               if any(r >= 16 for r in st["devices"])]
    assert [p for p, _ in found][:1] == ["pipelines[0]"] and len(found) == 1 + len(outside) + 1
    assert [p for p, _ in found][1:-1] == [f"pipelines[{i}].stages[{j}].devices" for i, j in outside]
    assert Strategy.load(EXAMPLES / "table11_c2.json").problems() == []


# ---- construction in Python, memory estimate -----------------------------------------------------------------
def test_python_construction_and_helpers() -> None:
    s = Strategy(pipelines=[Pipeline(stages=[Stage(devices=[0, 1], layers=[0, 1]), Stage(devices=[2], layers=[2, 3])],
                                     micro_batch_size=2, num_micro_batches=3),
                            Pipeline(stages=[Stage(devices=[3], layers=[0, 3])], micro_batch_size=2,
                                     num_micro_batches=1)])
    assert s == Strategy.load(EXAMPLES / "example_hetero_tiny.json").model_copy(update={"name": None})
    assert s.dp_degree == 2 and s.global_batch == 8 and s.num_ranks == 4 and s.stage_of(2) == (0, 1)
    text = s.summary(LlamaConfig.preset("tiny"), Cluster.local(4))
    assert "ranks 0,1" in text and "TP2" in text and "layers 2-3" in text and "estimate" in text


def test_memory_estimate_by_hand() -> None:
    # One pipeline, one TP2 stage, tiny model, bs1, seq 64, GPipe with 2 micro-batches, no ZeRO:
    # params = 197184 (all layers + embedding + head) / 2 ranks x 16 bytes;
    # activations = 4 layers x 64 tokens x 896 values x 2 bytes / 2 x 2 in flight, plus the head's input
    # (64 tokens x 64 hidden x 2 bytes, whole on each rank) x 2 in flight, plus the largest transient buffer:
    # the fp32 logits and their gradient, 2 x 64 tokens x 256 vocab x 4 bytes / 2.
    m = LlamaConfig.preset("tiny")
    s = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 3]}], "micro_batch_size": 1,
                                      "num_micro_batches": 2}], "schedule": "gpipe"})
    expected = 197184 / 2 * 16 + 4 * 64 * 896 * 2 / 2 * 2 + 64 * 64 * 2 * 2 + 2 * 64 * 256 * 4 / 2
    assert memory_estimate(s, m) == {0: pytest.approx(expected), 1: pytest.approx(expected)}
    # ZeRO-1 over 2 pipelines divides the 12 optimizer bytes by 2.
    z = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 1,
                                      "num_micro_batches": 1} for r in (0, 1)], "zero1": True})
    assert memory_estimate(z, m)[0] == pytest.approx(197184 * (4 + 6) + 4 * 64 * 896 * 2 + 64 * 64 * 2
                                                     + 2 * 64 * 256 * 4)


# ---- the annotation plan container ---------------------------------------------------------------------------
def test_annotation_plan_round_trip_and_errors(tmp_path: Path) -> None:
    plan = AnnotationPlan.load({"annotations": {
        "wte": "[0,1] S0x2 | [2] R",
        "layers.0.wq": {"dg_union": [[0, 3], [5, 6]], "ds_union": [{"states": {"1": 2}}, {"states": {"1": 2}}]},
    }, "meta": {"strategy": "example"}})
    assert plan.ranks == [0, 1, 2, 3, 5, 6] and plan["wte"].hsize == 2
    assert AnnotationPlan.model_validate_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert AnnotationPlan.load(path) == plan and "layers.0.wq" in plan.summary()
    with pytest.raises(PlanValidationError) as info:
        AnnotationPlan.load({"annotations": {"w": {"dg_union": [[0, 1]], "ds_union": [{"states": {"0": 3}}]}}})
    (p, r), = info.value.problems
    assert p == "annotations.w" and "dg_union[0] has 2 devices" in r
    with pytest.raises(PlanValidationError) as info:
        AnnotationPlan.load({"format_version": 2, "annotations": {}})
    assert info.value.problems[0][0] == "format_version"
    import jsonschema
    jsonschema.validate(json.loads(plan.to_json()), AnnotationPlan.json_schema())
