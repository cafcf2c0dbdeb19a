"""HAP's mixed-kind TP groups in the planner, in the simulator (issue 28, performance part 2).

``plan_hetero`` with and without mixed-kind groups (``mixed_groups=``), each plan's simulated step time, which
kind of plan won and the planning seconds:

* **the paper's cluster** (16 H800 + 32 H20, Llama 32B, global batch 64, 4K; Table 9's setting): every node holds
  one kind, so no mixed group exists and both runs must return the same plan;
* **the same kinds in mixed boxes**: 4 hosts of 4 H800 + 4 H20 each (16 + 16 devices; a cluster of mixed-generation
  nodes), Llama 32B, global batch 64, 4K; then with the kinds of a box linked by PCIe (``host_bandwidth_gbs=64``)
  instead of the inter-node network, at global batches 64 and 16;
* **one box of an H800 and an H20** (Llama 7B, 4K) at global batches 1, 2 and 8, as in tutorial 04.

Run: ``python benchmarks/bench_hap_planner.py`` (about a minute).  Figures: ``benchmarks/results/hap_planner.json``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hspmd_sdk import Cluster, LlamaConfig  # noqa: E402
from hspmd_sdk.planner import plan_hetero, simulate  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SEQ = 4096


def _case(name: str, model: LlamaConfig, cluster: Cluster, batch: int) -> dict:
    out: dict = {"case": name, "model": model.name, "devices": cluster.num_ranks, "global_batch": batch}
    for mixed in (False, True):
        t0 = time.perf_counter()
        s = plan_hetero(model, cluster, global_batch=batch, seq_len=SEQ, mixed_groups=mixed)
        plan_s = time.perf_counter() - t0
        r = simulate(model, s, cluster, global_batch=batch, seq_len=SEQ)
        uneven = sorted({":".join(map(str, st.ratios)) for p in s.pipelines for st in p.stages if st.ratios})
        out["with" if mixed else "without"] = {"step_s": r.step_time, "oom": r.oom, "plan_s": plan_s,
                                              "pipelines": len(s.pipelines), "ratios": uneven, "name": s.name}
    out["gain"] = out["without"]["step_s"] / out["with"]["step_s"]
    print(f"{name:<44} without {out['without']['step_s']:7.3f} s   with {out['with']['step_s']:7.3f} s   "
          f"x{out['gain']:.3f}   ratios {out['with']['ratios'] or '-'}   "
          f"(planned in {out['without']['plan_s']:.1f} / {out['with']['plan_s']:.1f} s)")
    return out


def main() -> None:
    b32 = LlamaConfig.preset("llama-32b")
    b7 = LlamaConfig.preset("llama-7b")
    paper = Cluster.mixed({"H800": 16, "H20": 32})
    boxes = Cluster.load({"nodes": [{"host": f"box{h}", "kind": kind, "ranks": list(range(8 * h + o, 8 * h + o + 4))}
                                    for h in range(4) for kind, o in (("H800", 0), ("H20", 4))]})
    pair = Cluster.load({"nodes": [{"host": "box", "kind": "H800", "ranks": [0]},
                                   {"host": "box", "kind": "H20", "ranks": [1]}], "inter_bandwidth_gbs": 64})
    pcie = boxes.model_copy(update={"host_bandwidth_gbs": 64.0})  # the kinds of a box linked by PCIe, not the network
    cases = [_case("paper: 16 H800 + 32 H20, 32B, batch 64", b32, paper, 64),
             _case("4 boxes of 4 H800 + 4 H20, 32B, batch 64", b32, boxes, 64),
             _case("the same boxes, PCIe 64 GB/s inside a box", b32, pcie, 64),
             _case("the same boxes, PCIe inside, batch 16", b32, pcie, 16)]
    cases += [_case(f"1 box of H800 + H20, 7B, batch {b}", b7, pair, b) for b in (1, 2, 8)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hap_planner.json").write_text(json.dumps({"load": os.getloadavg(), "cases": cases}, indent=2))


if __name__ == "__main__":
    main()
