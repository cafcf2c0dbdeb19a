"""Both model families against Hugging Face ``transformers`` (an independent implementation), and the weights'
way in and out (SPEC §4): ``to_hf`` / ``from_hf``, ``launch(..., init=...)`` with every rank reading only its own
safetensors slices.  No download: the configs are built here, with random weights."""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hspmd_sdk import Cluster, GPTConfig, LlamaConfig, Strategy, specialize  # noqa: E402
from hspmd_sdk.core.strategy_plan import plan_from_strategy  # noqa: E402
from hspmd_sdk.models import from_hf, to_hf  # noqa: E402
from hspmd_sdk.models.hf import HFError, shard_reader  # noqa: E402
from hspmd_sdk.runtime.workers.params import load_local_parameters, shard_box  # noqa: E402
from hspmd_sdk.runtime.control.train import launch, reference_training  # noqa: E402

CONFIGS = {
    "llama-gqa": LlamaConfig(name="gqa", vocab_size=97, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                             ffn_hidden_size=80, max_seq_len=32, rope_theta=500.0),
    "llama-mqa": LlamaConfig(name="mqa", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=1,
                             ffn_hidden_size=48, max_seq_len=24, rms_eps=1e-6),
    "gpt2-tied": GPTConfig(name="g", vocab_size=97, hidden_size=48, num_layers=2, num_heads=4, ffn_hidden_size=80,
                           max_seq_len=32),
    "gpt2-wide": GPTConfig(name="w", vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, ffn_hidden_size=128,
                           max_seq_len=24, layer_norm_eps=1e-6),
}


def _randomised(config, seed: int = 3):
    """The reference with every parameter (biases and norms too) moved off its init, so each one matters."""
    ref = config.build_reference(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return ref


def _hf_grad_as_ours(config, hf_model, name: str) -> torch.Tensor:
    """The gradient of SDK parameter ``name`` read from Hugging Face's parameters, by the published layouts:
    Llama's nn.Linear is [out, in]; GPT-2's Conv1D is [in, out], Q|K|V fused along the output in c_attn."""
    g = dict(hf_model.named_parameters())
    h = config.hidden_size
    if config.family == "llama":
        table = {"embed.weight": ("model.embed_tokens.weight", False), "final_norm.weight": ("model.norm.weight", False),
                 "lm_head.weight": ("lm_head.weight", True)}
        if name in table:
            hf, t = table[name]
        else:
            i, rest = name.split(".", 2)[1:]
            hf, t = {"attn_norm.weight": ("input_layernorm.weight", False), "attn.wq": ("self_attn.q_proj.weight", True),
                     "attn.wk": ("self_attn.k_proj.weight", True), "attn.wv": ("self_attn.v_proj.weight", True),
                     "attn.wo": ("self_attn.o_proj.weight", True),
                     "mlp_norm.weight": ("post_attention_layernorm.weight", False),
                     "mlp.w1": ("mlp.gate_proj.weight", True), "mlp.w3": ("mlp.up_proj.weight", True),
                     "mlp.w2": ("mlp.down_proj.weight", True)}[rest]
            hf = f"model.layers.{i}.{hf}"
        grad = g[hf].grad
        return grad.t() if t else grad
    if not name.startswith("layers."):
        return g["transformer." + name].grad
    i, rest = name.split(".", 2)[1:]
    pre = f"transformer.h.{i}."
    fused = {"attn.wq": 0, "attn.wk": 1, "attn.wv": 2, "attn.bq": 0, "attn.bk": 1, "attn.bv": 2}
    if rest in fused:
        k = fused[rest]
        if rest.startswith("attn.w"):
            return g[pre + "attn.c_attn.weight"].grad[:, k * h:(k + 1) * h]
        return g[pre + "attn.c_attn.bias"].grad[k * h:(k + 1) * h]
    plain = {"attn.wo": "attn.c_proj.weight", "attn.bo": "attn.c_proj.bias", "mlp.w_fc": "mlp.c_fc.weight",
             "mlp.b_fc": "mlp.c_fc.bias", "mlp.w_proj": "mlp.c_proj.weight", "mlp.b_proj": "mlp.c_proj.bias"}
    return g[pre + plain.get(rest, rest)].grad


@pytest.mark.parametrize("key", list(CONFIGS))
def test_reference_equals_transformers_logits_loss_and_gradients(key: str, tmp_path) -> None:
    config = CONFIGS[key]
    ref = _randomised(config)
    to_hf(config, ref.state_dict(), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    hf.train()  # dropout is 0 in the written config; train mode proves it
    seq = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    tokens, targets = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        ours = ref(tokens)
        theirs = hf(input_ids=tokens).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    loss = ref.loss(tokens, targets)
    hf_loss = hf(input_ids=seq, labels=seq).loss   # Hugging Face shifts the labels itself: the same convention
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())
    loss.backward()
    torch.nn.functional.cross_entropy(hf(input_ids=tokens).logits.reshape(-1, config.vocab_size),
                                      targets.reshape(-1)).backward()
    assert list(dict(ref.named_parameters())) == list(config.param_shapes())
    wants = {name: _hf_grad_as_ours(config, hf, name) for name, _ in ref.named_parameters()}
    largest = max(float(w.abs().max()) for w in wants.values())
    for name, p in ref.named_parameters():
        want = wants[name]
        if float(want.abs().max()) < 1e-6 * largest:
            # GPT-2's key bias: no gradient in exact arithmetic (softmax ignores a constant added to a row's
            # scores); both sides hold rounding noise only
            assert float(p.grad.abs().max()) < 1e-6 * largest, name
            continue
        err = float((p.grad - want).abs().max() / want.abs().max())
        assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_from_hf_of_to_hf_is_the_identity(key: str, tmp_path) -> None:
    config = CONFIGS[key]
    state = _randomised(config, 5).state_dict()
    to_hf(config, state, tmp_path)
    model, back = from_hf(tmp_path)
    assert model == config
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["model_type"] == ("gpt2" if config.family == "gpt" else "llama")


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch) -> None:
    """A TP2 x PP2 plan: every rank's shards come from ``get_slice`` reads of exactly their boxes; nothing reads
    a whole tensor."""
    import safetensors

    config = CONFIGS["gpt2-tied"]
    state = _randomised(config).state_dict()
    to_hf(config, state, tmp_path)
    reads: list[int] = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):  # pragma: no cover - must not happen
            raise AssertionError(f"whole tensor {name} read")

        def get_slice(self, name):
            sl = self.inner.get_slice(name)

            class Slice:
                def __getitem__(self, idx):
                    out = sl[idx]
                    reads.append(out.numel())
                    return out
            return Slice()

    real = safetensors.safe_open
    import hspmd_sdk.models.hf as hfmod

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Counting(real(*a, **k)))
    cluster = Cluster.local(4)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0, 1], "layers": [0, 0]},
                                                        {"devices": [2, 3], "layers": [1, 1]}],
                                             "micro_batch_size": 2, "num_micro_batches": 2}]})
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    for rank in range(4):
        reads.clear()
        got = load_local_parameters(program, rank, hfmod.shard_reader(tmp_path, config))
        want = 0
        for name, t in got.items():
            box = shard_box(program, name, rank)
            assert torch.equal(t, state[name][tuple(slice(a, b) for a, b in box)]), (rank, name)
            want += math.prod(b - a for a, b in box)
        assert sum(reads) == want, rank                       # the bytes of its boxes, not the file
        assert want < sum(v.numel() for v in state.values()) / 2


def test_launch_from_hf_weights_trains_like_the_reference_from_them(tmp_path) -> None:
    config = GPTConfig.preset("tiny")
    state = _randomised(config).state_dict()
    to_hf(config, state, tmp_path)
    cluster = Cluster.local(2)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]},
                                                        {"devices": [1], "layers": [2, 3]}],
                                             "micro_batch_size": 2, "num_micro_batches": 2}]})
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    ref = reference_training(config, steps=2, seed=0, global_batch=4, seq_len=16, init=state)
    for init in (tmp_path, state):   # a directory, and a state dict in memory
        result = launch(program, cluster, steps=2, seq_len=16, init=init).wait()
        assert max(abs(a - b) / b for a, b in zip(result.losses, ref.losses)) <= 1e-5


def test_a_checkpoint_of_another_model_or_a_broken_file_is_refused_before_launch(tmp_path) -> None:
    config = GPTConfig.preset("tiny")
    to_hf(config, _randomised(config).state_dict(), tmp_path)
    cluster = Cluster.local(1)
    strategy = Strategy.load({"pipelines": [{"stages": [{"devices": [0], "layers": [0, 3]}],
                                             "micro_batch_size": 2, "num_micro_batches": 1}]})
    other = config.model_copy(update={"hidden_size": 32, "ffn_hidden_size": 128})
    program = specialize(other, plan_from_strategy(other, strategy, cluster), cluster)
    with pytest.raises(HFError, match=r"config.json: the checkpoint's model differs.*hidden_size 64"):
        launch(program, cluster, steps=1, init=tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.bias"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    program = specialize(config, plan_from_strategy(config, strategy, cluster), cluster)
    with pytest.raises(HFError, match=r"model.safetensors: tensor 'transformer.h.1.mlp.c_fc.bias' is missing"):
        launch(program, cluster, steps=1, init=tmp_path)
    with pytest.raises(HFError, match="no safetensors weights"):
        shard_reader(tmp_path / "nowhere", config)
