"""The checkpoint's plans and files, without workers.

* the write plan (a BSR to storage) tiles every tensor of random strategies exactly once, each piece written by a
  rank that holds it, and balances the bytes among replicas;
* read plans between random pairs of strategies read exactly each rank's boxes, from pieces that hold them;
* a checkpoint saved and read back through the two plans, on random annotations (DS of up to three keys in random
  order, HDim and ratios): each rank ends up with exactly its shards;
  every expected box and shard here comes from the independent layout oracle (``layout_oracle``), never from the
  SDK's ``local_view``;
* :func:`~hspmd_sdk.runtime.checkpoints.checkpoint_io.byte_runs` against numpy's flat indices of a sub-box;
* a shard file is a safetensors file (read back by the ``safetensors`` library), with the CRC-32 of every piece;
* :class:`~hspmd_sdk.runtime.checkpoints.checkpoint_io.PieceReader` returns any sub-box of a piece reading exactly its bytes
  (counted by the kernel, ``/proc/thread-self/io``);
* the write is atomic: a crash point leaves only the temporary file.
"""
from __future__ import annotations

import math
import random
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from checkpoint_strategies import random_strategy  # noqa: E402
from hspmd_sdk import GPTConfig, LlamaConfig  # noqa: E402
import layout_oracle as oracle  # noqa: E402
from hspmd_sdk.core.slices import box_contains, box_numel  # noqa: E402
from hspmd_sdk.runtime.checkpoints.checkpoint_io import (PieceReader, StoredPiece, ThreadReadCounter, byte_runs,  # noqa: E402
                                             read_header, write_shard)
from hspmd_sdk.runtime.checkpoints.checkpoint_plan import Layout, layouts_of, read_plan, tiling_problems, write_plan  # noqa: E402
from resolve_reference import annotation_of, fitting_shape, plain  # noqa: E402

MODELS = (LlamaConfig.preset("tiny"), GPTConfig.preset("tiny"))


def _held(lay: Layout) -> dict:
    """rank -> the box the oracle says it holds of ``lay``'s tensor."""
    return {r: h.box for r, h in oracle.layout(plain(lay.annotation), lay.shape).items()}


def _programs(seed: int, n: int, world: int) -> list:
    rng = random.Random(seed)
    return [random_strategy(rng, MODELS[i % 2], world)[1] for i in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_the_write_plan_writes_every_element_once_by_a_rank_holding_it(seed: int) -> None:
    for program in _programs(seed, 6, 6):
        layouts = layouts_of(program)
        plan = write_plan(layouts)
        assert list(plan) == list(layouts) and len(layouts) == 3 * len(program.parameters)
        written: dict[int, int] = {}
        for name, pieces in plan.items():
            lay = layouts[name]
            assert tiling_problems(name, lay.shape, [b for _, b in pieces]) == []   # each element exactly once
            held_by = _held(lay)
            for rank, box in pieces:
                held = held_by.get(rank)
                assert held is not None and box_contains(held, box), (name, rank, box)
                written[rank] = written.get(rank, 0) + 4 * box_numel(box)
        assert set(written) <= set(program.ranks)
        assert write_plan(layouts) == plan  # a pure function: every rank computes the same


def test_replicas_share_the_writing() -> None:
    from hspmd_sdk.core.cluster import Cluster
    from hspmd_sdk.core.specialize import specialize
    from hspmd_sdk.core.strategy import Strategy
    from hspmd_sdk.core.strategy_plan import plan_from_strategy

    model, cluster = MODELS[0], Cluster.local(4)
    dp4 = Strategy.load({"pipelines": [{"stages": [{"devices": [r], "layers": [0, 3]}], "micro_batch_size": 2,
                                        "num_micro_batches": 1} for r in range(4)]})
    plan = write_plan(layouts_of(specialize(model, plan_from_strategy(model, dp4, cluster), cluster)))
    written = [0] * 4
    for pieces in plan.values():
        for rank, box in pieces:
            written[rank] += 4 * box_numel(box)
    largest = 4 * max(math.prod(s) for s in model.param_shapes().values())
    assert max(written) - min(written) <= largest, written  # greedy balance: within one tensor


@pytest.mark.parametrize("seed", range(3))
def test_read_plans_read_exactly_each_ranks_boxes(seed: int) -> None:
    saved, new = _programs(seed, 4, 4), _programs(seed + 100, 4, 3)
    for a, b in zip(saved, new):  # the same family at the same index
        assert a.model == b.model
        stored = {n: [box for _, box in ps] for n, ps in write_plan(layouts_of(a)).items()}
        layouts = layouts_of(b)
        held_by = {n: _held(lay) for n, lay in layouts.items()}
        for rank in b.ranks:
            plan = read_plan(layouts, stored, rank)
            for name, (box, items) in plan.items():
                assert box == held_by[name][rank]
                assert sum(it.nbytes for it in items) == 4 * box_numel(box)
                for it in items:
                    assert box_contains(box, it.box) and box_contains(stored[name][it.piece], it.box)
            held = {n for n in layouts if rank in held_by[n]}
            assert set(plan) == held


def random_layouts(rng: random.Random, world: int = 8) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """Two random layouts (saved, loaded) of 1-3 tensors: annotations from the resolution generators without
    Partial (training state is never Partial), each tensor's shape fitting both.  Valid by construction."""
    def whole(ranks: range):  # -> Annotation
        while True:
            a = annotation_of(rng, ranks, ndim)
            if a.hdim != -2 and all(ds.partial == 1 for ds in a.ds_union):
                return a

    saved, loaded = {}, {}
    for i in range(rng.randint(1, 3)):
        ndim = rng.randint(1, 3)
        a, b = whole(range(rng.randint(1, world))), whole(range(rng.randint(1, world)))
        shape = fitting_shape([a, b], ndim, [rng.choice([1, 2]) for _ in range(ndim)])
        saved[f"t{i}"], loaded[f"t{i}"] = Layout(f"t{i}", a, shape, "float64"), Layout(f"t{i}", b, shape, "float64")
    return saved, loaded


def check_save_and_load(saved: dict[str, Layout], loaded: dict[str, Layout], seed: int) -> None:
    """Save by the write plan from the oracle's shards (a writer copies its piece out of its own local array), read
    back by every rank's read plan, and compare with the oracle's shards of the new layout, exactly."""
    rng = np.random.default_rng(seed)
    values = {n: rng.standard_normal(lay.shape) for n, lay in saved.items()}
    pieces = write_plan(saved)
    stored: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    data: dict[str, list[np.ndarray]] = {}
    for name, lay in saved.items():
        held = oracle.layout(plain(lay.annotation), lay.shape)
        local = oracle.materialize(plain(lay.annotation), lay.shape, values[name])
        stored[name], data[name] = [], []
        for rank, box in pieces[name]:
            h = held.get(rank)
            assert h is not None and box_contains(h.box, box), (name, rank, box, h)
            stored[name].append(box)
            data[name].append(local[rank][tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(box, h.box))])
        assert tiling_problems(name, lay.shape, stored[name]) == []
    for name, lay in loaded.items():
        want = oracle.materialize(plain(lay.annotation), lay.shape, values[name])
        got: dict[int, np.ndarray] = {}
        for rank in want:
            box, items = read_plan({name: lay}, stored, rank)[name]
            out = np.full(tuple(b - a for a, b in box), np.nan)
            for it in items:
                piece_box = stored[name][it.piece]
                src = data[name][it.piece][tuple(slice(a - p0, b - p0) for (a, b), (p0, _) in zip(it.box, piece_box))]
                out[tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(it.box, box))] = src
            got[rank] = out
        oracle.check_local_arrays(plain(lay.annotation), lay.shape, values[name], got, exact=True)


@pytest.mark.parametrize("seed", range(3))
def test_a_checkpoint_reads_back_the_oracles_shards_under_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(25):
        saved, loaded = random_layouts(rng)
        try:
            check_save_and_load(saved, loaded, seed=i)
        except AssertionError as e:  # pragma: no cover - the message names the case
            raise AssertionError(f"draw {i}: {saved} -> {loaded}: {e}") from None


def test_a_read_plan_names_a_tensor_the_pieces_do_not_cover() -> None:
    program = _programs(0, 1, 2)[0]
    layouts = layouts_of(program)
    stored = {n: [box for _, box in ps] for n, ps in write_plan(layouts).items()}
    name = next(iter(stored))
    stored[name] = stored[name][1:] if len(stored[name]) > 1 else []
    with pytest.raises(ValueError, match=rf"tensor '{name}': the stored pieces cover"):
        for rank in program.ranks:
            read_plan(layouts, stored, rank)


@pytest.mark.parametrize("seed", range(5))
def test_byte_runs_are_the_sub_box_elements_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        shape = tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 4))))
        inner = []
        for d in shape:
            a = int(rng.integers(0, d))
            inner.append((a, int(rng.integers(a + 1, d + 1))))
        idx = np.indices([b - a for a, b in inner]).reshape(len(shape), -1).T + np.array([a for a, _ in inner])
        want = np.ravel_multi_index(idx.T, shape)  # row-major flat indices of the sub-box, in order
        got = np.concatenate([np.arange(off // 4, (off + n) // 4) for off, n in byte_runs(shape, tuple(inner), 4)])
        assert np.array_equal(got, want), (shape, inner)


def test_a_shard_file_is_safetensors_with_a_checksum_per_piece(tmp_path: Path) -> None:
    from safetensors import safe_open

    items = [("a@0", torch.randn(5, 7)), ("b@1", torch.arange(12, dtype=torch.int64).reshape(3, 4)),
             ("c@0", torch.randn(3).to(torch.bfloat16)), ("__rng__/0", torch.get_rng_state())]
    size, written = write_shard(tmp_path / "rank00000.safetensors", items)
    path = tmp_path / "rank00000.safetensors"
    assert path.stat().st_size == size and not (tmp_path / "rank00000.safetensors.tmp").exists()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(k for k, _ in items)
        for key, t in items:
            assert torch.equal(f.get_tensor(key), t), key
    start, header = read_header(path)
    raw = path.read_bytes()
    for w, (key, t) in zip(written, items):
        assert w.offset == start + header[key]["data_offsets"][0] and w.nbytes == t.numel() * t.element_size()
        assert w.crc32 == zlib.crc32(raw[w.offset:w.offset + w.nbytes])


def test_the_reader_reads_exactly_the_bytes_of_any_sub_box(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    full = torch.randn(24, 16, 6)
    piece_box = ((4, 20), (2, 14), (0, 6))
    local = full[4:20, 2:14, :].contiguous()
    _, (w,) = write_shard(tmp_path / "f.safetensors", [("x@0", local)])
    piece = StoredPiece("f.safetensors", w.offset, piece_box, "float32", w.nbytes)
    with PieceReader(tmp_path, count_os=True) as reader:
        total = 0
        for _ in range(30):
            box = []
            for a, b in piece_box:
                lo = int(rng.integers(a, b))
                box.append((lo, int(rng.integers(lo + 1, b + 1))))
            box = tuple(box)
            got = reader.read(piece, box, tensor="x")
            assert torch.equal(got, full[tuple(slice(a, b) for a, b in box)])
            total += 4 * box_numel(box)
            assert reader.bytes_read == total
        with ThreadReadCounter() as probe:
            pass
        if probe.bytes is not None:  # Linux: the kernel counted exactly these bytes
            assert reader.os_bytes_read == total


def test_a_crash_point_leaves_only_the_temporary_file(tmp_path: Path) -> None:
    class Crash(Exception):
        pass

    def point(name: str) -> None:
        if name == "shard-partial":
            raise Crash

    items = [("a@0", torch.randn(64, 64))]
    with pytest.raises(Crash):
        write_shard(tmp_path / "r.safetensors", items, point=point)
    assert not (tmp_path / "r.safetensors").exists()
    tmp = tmp_path / "r.safetensors.tmp"
    start, _ = read_header(tmp)
    assert tmp.stat().st_size == start + 64 * 64 * 4 // 2  # exactly half of the data


def test_a_ranks_rng_state_is_restored(tmp_path: Path) -> None:
    from hspmd_sdk.runtime.workers.checkpoint_worker import restore_rng

    torch.manual_seed(1234)
    saved = torch.get_rng_state()
    _, (w,) = write_shard(tmp_path / "rank00002.safetensors", [("__rng__/2", saved)])
    want = torch.rand(5)                                  # what the saved state draws next
    torch.manual_seed(0)                                  # another state
    resume = {"dir": str(tmp_path), "rng": {"2": ["rank00002.safetensors", w.offset, w.nbytes]}}
    assert not restore_rng(resume, 1)                     # rank 1 was not in the saved job: left alone
    assert restore_rng(resume, 2)
    assert torch.equal(torch.get_rng_state(), saved) and torch.equal(torch.rand(5), want)
