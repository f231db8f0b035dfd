"""Probes (kvq_lab/probes): metrics against hand-computed cases, capture against the model's own attention,
exact zero error at 16 bits, GQA, direction of the axis ablation on synthetic data, and task=probe end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvq_lab.cache.config import CacheConfig
from kvq_lab.probes import ERROR_QUANTITIES, ProbeSettings, capture_qkv, kivi_ratio, probe_model, rel_fro, sqnr_db
from kvq_lab.probes.capture import LayerCapture
from kvq_lab.probes.errors import attention, layer_errors, quantize_kv, reference_output
from kvq_lab.probes.metrics import sparsity, topk_mass
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.records.record import read_table

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def tiny_llama(attn: str = "eager", seed: int = 0, vocab: int = 101) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, attn_implementation=attn,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def cache(kb=2, ka="channel", vb=2, va="token", g=32, **kw) -> CacheConfig:
    return CacheConfig(QuantSpec(kb, g, ka), QuantSpec(vb, g, va), **kw)


# --- metrics against hand-computed cases ---------------------------------------------------------------------


def test_rel_fro_and_sqnr_hand_computed():
    x, xq = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])
    assert rel_fro(x, xq, dims=-1).item() == pytest.approx(4 / 5)  # ||(0, 4)|| / ||(3, 4)||
    assert sqnr_db(x, xq, dims=-1).item() == pytest.approx(10 * math.log10(25 / 16))
    # -20 log10(rel_fro) == sqnr_db
    assert sqnr_db(x, xq, dims=-1).item() == pytest.approx(-20 * math.log10(0.8))


def test_kivi_ratio_hand_computed_with_guard():
    # max |x| = 4, eps = 0.01 -> entries with |x| < 0.04 are left out: the 0.001 entry (ratio 4999) is dropped
    x = torch.tensor([1.0, 2.0, 0.001, -4.0])
    xq = torch.tensor([1.5, 2.0, 5.0, -3.0])
    expect = math.sqrt(((-0.5) ** 2 + 0.0**2 + 0.25**2) / 3)
    assert kivi_ratio(x, xq, dims=-1).item() == pytest.approx(expect)
    # without the guard the near-zero entry dominates
    assert kivi_ratio(x, xq, dims=-1, eps=0.0).item() == pytest.approx(math.sqrt((0.25 + 4999**2 + 0.0625) / 4))


def test_metrics_edge_cases_and_reduction_shape():
    z = torch.zeros(3, 5, 4)
    assert rel_fro(z, z).tolist() == [0.0, 0.0, 0.0]
    assert sqnr_db(z, z).tolist() == [math.inf] * 3
    assert kivi_ratio(z, z).tolist() == [0.0] * 3
    assert rel_fro(z, z + 1).tolist() == [math.inf] * 3
    x = torch.randn(3, 5, 4)
    assert rel_fro(x, x).tolist() == [0.0] * 3 and sqnr_db(x, x).tolist() == [math.inf] * 3
    # per-head reduction: only head 1 perturbed
    xq = x.clone()
    xq[1] *= 1.1
    r = rel_fro(x, xq)
    assert r.shape == (3,) and r[0] == 0 and r[2] == 0 and r[1].item() == pytest.approx(0.1, rel=1e-5)
    assert kivi_ratio(x, xq)[1].item() == pytest.approx(0.1, rel=1e-5)


def test_all_errors_equals_each_definition():
    from kvq_lab.probes.metrics import ERRORS, all_errors

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 5, generator=g)
    xq = x + 0.1 * torch.randn(3, 7, 5, generator=g)
    for dims in ((-2, -1), -1):
        fused = all_errors(x, xq, dims=dims, eps=0.05)
        assert set(fused) == set(ERRORS)
        for name, m in ERRORS.items():
            torch.testing.assert_close(fused[name], m.compute(x, xq, dims, 0.05))


def test_sparsity_and_topk_hand_computed():
    a = torch.tensor([[0.5, 0.496, 0.004], [0.2, 0.3, 0.5]])
    # row 0: 0.004 < 0.01 * 0.5 -> 1/3 sparse; row 1: none
    assert sparsity(a).item() == pytest.approx((1 / 3 + 0) / 2)
    # causal visibility: masked entries do not count (row 0 sees one key: 0/1 sparse)
    c = torch.tensor([[1.0, 0.0], [0.999, 0.001]])
    vis = torch.tensor([[True, False], [True, True]])
    assert sparsity(c, vis).item() == pytest.approx((0 + 1 / 2) / 2)
    assert topk_mass(a, 1).item() == pytest.approx((0.5 + 0.5) / 2)
    assert topk_mass(a, 2).item() == pytest.approx((0.996 + 0.8) / 2)
    assert topk_mass(a, 10).item() == pytest.approx(1.0)


# --- capture: the probe sees exactly what the model computes --------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_capture_reproduces_model_attention(attn):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_llama(attn)
    ids = torch.randint(0, 101, (1, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits = model(ids, use_cache=False).logits
    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    caps = capture_qkv(model, ids)
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == before  # override removed
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, ref_logits)  # capture changed nothing
    assert [c.layer for c in caps] == [0, 1]
    for c in caps:
        assert c.query.shape == (4, 45, 32) and c.key.shape == (2, 45, 32) and c.value.shape == (2, 45, 32)
        assert c.groups == 2 and c.scaling == pytest.approx(32**-0.5)
        recon = reference_output(c)
        if attn == "eager":  # same ops in the same order: bit-identical
            assert torch.equal(recon, c.output)
        else:
            torch.testing.assert_close(recon, c.output, rtol=1e-5, atol=1e-6)


def test_capture_of_layer_input_matches_projection_and_rope():
    """The captured key is the post-RoPE key: recompute it from the layer's input by hand."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama()
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(2))
    seen = {}
    h = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(x=kwargs["hidden_states"], pe=kwargs["position_embeddings"]),
        with_kwargs=True,
    )
    try:
        caps = capture_qkv(model, ids)
    finally:
        h.remove()
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        q = attn.q_proj(seen["x"]).view(1, 20, -1, 32).transpose(1, 2)
        k = attn.k_proj(seen["x"]).view(1, 20, -1, 32).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *seen["pe"])
    assert torch.equal(caps[1].key, k[0]) and torch.equal(caps[1].query, q[0])


def test_16bit_gives_zero_error_everywhere():
    model = tiny_llama("sdpa")
    ids = [torch.randint(0, 101, (1, n), generator=torch.Generator().manual_seed(n)) for n in (33, 50)]
    for rope in ("post", "pre"):
        res = probe_model(model, ids, cache(16, "channel", 16, "token", rope=rope))
        for q in ERROR_QUANTITIES:
            assert (res.tables[q]["rel_fro"] == 0).all(), q
            assert (res.tables[q]["kivi_ratio"] == 0).all(), q
            assert torch.isinf(res.tables[q]["sqnr_db"]).all(), q
    # and the 2-bit run is not zero (the test can fail)
    res = probe_model(model, ids, cache())
    assert (res.tables["attn_out"]["rel_fro"] > 0).all()


# --- GQA ------------------------------------------------------------------------------------------------------


def test_gqa_query_head_reads_its_kv_head():
    from transformers.models.llama.modeling_llama import repeat_kv

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 10, 8, generator=g), torch.randn(2, 10, 8, generator=g)
    a = attention(q, k, 8**-0.5, groups=3)
    # transformers' own expansion: query head h reads KV head h // 3
    kx = repeat_kv(k[None], 3)[0]
    s = (q @ kx.transpose(-1, -2)) * 8**-0.5 + torch.full((10, 10), -torch.inf).triu(1)
    torch.testing.assert_close(a, torch.softmax(s, -1))
    # perturb KV head 1 only: errors appear in query heads 3..5 only, and in KV head 1's reconstruction only
    v = torch.randn(2, 10, 8, generator=g)
    cap = LayerCapture(0, q, k, v, torch.zeros(6, 10, 8), 8**-0.5, 3)
    k2 = k.clone()
    k2[1] += 0.5 * torch.randn(10, 8, generator=g)
    errs = layer_errors(cap, cache(16, "channel", 16, "token"), ProbeSettings())
    assert (errs["attn_score"]["rel_fro"] == 0).all()

    def fake_quantize_kv(key, value, c, rope=None):
        return k2, value

    import kvq_lab.probes.errors as E

    orig = E.quantize_kv
    E.quantize_kv = fake_quantize_kv
    try:
        errs = layer_errors(cap, cache(), ProbeSettings())
    finally:
        E.quantize_kv = orig
    assert errs["key"]["rel_fro"].shape == (2,) and errs["key"]["rel_fro"][0] == 0 and errs["key"]["rel_fro"][1] > 0
    score = errs["attn_score"]["rel_fro"]
    assert score.shape == (6,) and (score[:3] == 0).all() and (score[3:] > 0).all()


def test_quantize_kv_sinks_partial_groups_and_pre_rope():
    model = tiny_llama()
    from kvq_lab.cache.routing.rope import RopeHelper

    rope = RopeHelper(model.model.rotary_emb)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 45, 32, generator=g), torch.randn(2, 45, 32, generator=g)
    kq, vq = quantize_kv(k, v, cache(sink_tokens=4))
    assert torch.equal(kq[:, :4], k[:, :4]) and torch.equal(vq[:, :4], v[:, :4])
    assert not torch.equal(kq[:, 4:], k[:, 4:]) and not torch.equal(vq[:, 4:], v[:, 4:])
    kp, _ = quantize_kv(k, v, cache(rope="pre"), rope)
    kpost, _ = quantize_kv(k, v, cache())
    assert kp.shape == k.shape and not torch.allclose(kp, kpost)
    assert rel_fro(k, kp, dims=None) < 0.5  # still a quantization of k, not garbage
    with pytest.raises(ValueError, match="rope=pre"):
        quantize_kv(k, v, cache(rope="pre"))


# --- direction: the geometry the probes exist to show ---------------------------------------------------------


def _synthetic_layer(seed=0, T=96, D=32, H=4, Hkv=2):
    """Keys with two huge outlier channels (as LLM keys have); values with two huge outlier tokens (30, 70)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(Hkv, T, D, generator=g)
    k[:, :, [3, 17]] *= 20
    v = torch.randn(Hkv, T, D, generator=g)
    v[:, [30, 70], :] *= 30
    q = torch.randn(H, T, D, generator=g)
    return LayerCapture(0, q, k, v, torch.zeros(H, T, D), D**-0.5, H // Hkv)


def test_direction_per_channel_keys_beat_per_token_keys_on_outlier_channels():
    cap = _synthetic_layer()
    s = ProbeSettings()
    kc = layer_errors(cap, cache(ka="channel"), s)
    kt = layer_errors(cap, cache(ka="token"), s)
    for q in ("key", "attn_score", "attn_out_k"):
        for d in ("rel_fro", "kivi_ratio"):
            assert kc[q][d].mean() < kt[q][d].mean(), (q, d)
        assert kc[q]["sqnr_db"].mean() > kt[q]["sqnr_db"].mean(), q


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_direction_value_inversion_on_outlier_tokens(seed):
    """KIVI's inversion in miniature: per-channel values reconstruct V as well or better (the outlier tokens'
    energy dominates ||V||), yet every ordinary token shares a channel group with an outlier token and gets its
    huge step, so the attention output, which mostly reads ordinary tokens, is far worse than per-token."""
    cap = _synthetic_layer(seed)
    s = ProbeSettings()
    vt = layer_errors(cap, cache(va="token"), s)
    vc = layer_errors(cap, cache(va="channel"), s)
    assert vc["value"]["rel_fro"].mean() < vt["value"]["rel_fro"].mean()
    for q in ("attn_out_v", "attn_out_v_decode"):
        assert vc[q]["rel_fro"].mean() > 1.5 * vt[q]["rel_fro"].mean(), q
        assert vc[q]["sqnr_db"].mean() < vt[q]["sqnr_db"].mean(), q
    # the key axis does not move value errors, and the V-only output error ignores the key quantizer
    vt2 = layer_errors(cap, cache(ka="token", va="token"), s)
    assert torch.equal(vt["attn_out_v"]["rel_fro"], vt2["attn_out_v"]["rel_fro"])
    assert torch.equal(vt["value"]["rel_fro"], vt2["value"]["rel_fro"])


# --- task=probe end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved with the SmolLM2 tokenizer, loadable by model.path=<folder>."""
    from transformers import AutoTokenizer

    from kvq_lab.models.loading import cache_dir

    tok_dir = cache_dir() / "smollm2-135m"
    if not (tok_dir / "tokenizer.json").exists():
        pytest.skip("SmolLM2 tokenizer not cached (run scripts/setup.sh or load smollm2-135m once)")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    out = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama("sdpa", vocab=len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _compose(*overrides):
    from helpers_models import compose

    return compose(list(overrides))


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_task_probe_end_to_end(tiny_model_dir, tmp_path):
    from kvq_lab.run.runner import run

    data = REPO.parent / "shared" / "data"
    if not (data / "coqa" / "coqa-validation.first20.lm_eval.jsonl").exists():
        pytest.skip("local CoQA data not found")
    cfg = _compose(
        "task=probe", "logger=none", f"model.path={tiny_model_dir}", f"results_dir={tmp_path}", f"data_dir={data}",
        "task.n_prompts=2", "task.max_tokens=40", "key_axis=token", "value_axis=channel",
    )  # fmt: skip
    metrics = run(cfg)
    assert metrics["probe/n_prompts"] == 2 and metrics["probe/mean_tokens"] == 40
    assert metrics["probe/attn_out/rel_fro/mean"] > 0 and "probe/attn_out_v_decode/sqnr_db/mean" in metrics
    assert 0 <= metrics["probe/sparsity/mean"] <= 1
    (run_dir,) = (tmp_path / "runs").iterdir()
    rec = json.loads((run_dir / "record.json").read_text())
    assert rec["status"] == "ok"
    rec["_path"] = str(run_dir)
    t = read_table(rec, "probe_tables", "per_head")
    assert len(t["rows"]) == 2 * 4 and t["columns"][:3] == ["layer", "head", "kv_head"]
    layers = read_table(rec, "probe_tables", "per_layer")
    assert layers["columns"][:2] == ["layer", "attention"] and layers["rows"][1][:2] == [1, "global"]
    for name in rec["artifacts"]["probe_figures"]:
        assert (run_dir / name).stat().st_size > 1000


def test_probe_on_long_gsm8k_text(tiny_model_dir, tmp_path):
    """task.source=gsm8k: prompts as long as max_tokens, cut from GSM8K's test text; the record names that file; a data
    folder without it is refused before any model loads."""
    from kvq_lab.run.config import ConfigError, validate
    from kvq_lab.run.runner import run

    data = REPO.parent / "shared" / "data"
    if not (data / "gsm8k").exists():
        pytest.skip("local GSM8K data not found")
    args = ["task=probe", "task.source=gsm8k", "logger=none", f"model.path={tiny_model_dir}", "task.figures=false"]
    metrics = run(
        _compose(*args, f"results_dir={tmp_path}", f"data_dir={data}", "task.n_prompts=2", "task.max_tokens=96")
    )
    assert metrics["probe/n_prompts"] == 2 and metrics["probe/mean_tokens"] == 96
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list(json.loads((run_dir / "record.json").read_text())["inputs"]["data"]["files"]) == ["gsm8k/test.jsonl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="gsm8k"):
        validate(_compose(*args, f"data_dir={empty}"))


def test_probe_task_rejects_unknown_setting():
    from kvq_lab.run.config import ConfigError, validate

    with pytest.raises(ConfigError, match="n_promtps"):
        validate(_compose("task=probe", "+task.n_promtps=3", "data_dir=null"))


def test_probes_beside_a_task(tiny_model_dir, tmp_path):
    """probe=true: run_probes_for_task measures the task's own prompts and fills metrics and artifacts."""
    from kvq_lab.models.loading import load_model
    from kvq_lab.run.config import validate
    from kvq_lab.tasks import TaskContext
    from kvq_lab.tasks.probe import run_probes_for_task

    data = REPO.parent / "shared" / "data"
    if not (data / "coqa" / "coqa-validation.first20.lm_eval.jsonl").exists():
        pytest.skip("local CoQA data not found")
    cfg = _compose(
        "task=coqa_turns", "probe=true", "logger=none", f"model.path={tiny_model_dir}", f"data_dir={data}",
        "probes.n_prompts=2", "probes.max_tokens=48", "probes.figures=false",
    )  # fmt: skip
    plan = validate(cfg)
    model, tok = load_model(str(tiny_model_dir))
    ctx = TaskContext(model, tok, lambda: None, cfg, tmp_path, plan.data_dir, None, cache_config=plan.cache)
    with torch.inference_mode():
        m = run_probes_for_task(ctx)
    assert m["probe/n_prompts"] == 2 and m["probe/mean_tokens"] == 48
    assert ctx.artifacts["probe_prompt_source"] == "coqa_turns"
    assert "probe_tables" in ctx.artifacts and "wandb_images" not in ctx.artifacts


# --- the real model ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_capture_is_exact_and_16bit_is_zero():
    from kvq_lab.models.loading import load_model

    model, tok = load_model("smollm2-135m")
    ids = tok("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt").input_ids
    caps = capture_qkv(model, ids)
    assert len(caps) == 30 and caps[0].query.shape[0] == 9 and caps[0].key.shape[0] == 3
    for c in caps:
        torch.testing.assert_close(reference_output(c), c.output, rtol=1e-4, atol=1e-5)
    res = probe_model(model, [ids], cache(16, "channel", 16, "token"))
    assert all((res.tables[q]["rel_fro"] == 0).all() for q in ERROR_QUANTITIES)


def test_table2_puts_each_axis_in_its_column():
    from kvq_lab.report.error_geometry import table2

    def rec(ka, va, key, value):
        m = {"probe/key/kivi_ratio/mean": key, "probe/value/kivi_ratio/mean": value}
        return {"config": {"key_axis": ka, "value_axis": va}, "metrics": m}

    md = table2(
        [rec("token", "token", 2.0, 5.0), rec("channel", "token", 1.0, 5.0), rec("channel", "channel", 1.0, 3.0)]
    )
    row = {line.split("|")[1].strip() + "/" + line.split("|")[2].strip(): line for line in md.splitlines()[2:]}
    assert "| 2 | 1 | 13.67 | 4.55 |" in row["key reconstruction/kivi_ratio"]
    assert "| 5 | 3 | 4.57 | 3.73 |" in row["value reconstruction/kivi_ratio"]
    assert "| - | - |" in row["value reconstruction/rel_fro"]


def test_runner_hook_probe_true_adds_probe_metrics_to_a_task_run(tiny_model_dir, tmp_path):
    """probe=true through run(cfg): the task's metric and the probe aggregates land in the same record."""
    from kvq_lab.plugins import TASKS
    from kvq_lab.run.runner import run
    from kvq_lab.tasks import Task, register_task

    class Dummy(Task):
        name = "dummy_for_probe_test"

        def run(self, ctx):
            return {"dummy/acc": 1.0}

    data = REPO.parent / "shared" / "data"
    if not (data / "coqa" / "coqa-validation.first20.lm_eval.jsonl").exists():
        pytest.skip("local CoQA data not found")
    register_task(Dummy())
    try:
        cfg = _compose(
            "task=coqa_turns", "task.name=dummy_for_probe_test", "probe=true", "logger=none",
            f"model.path={tiny_model_dir}", f"results_dir={tmp_path}", f"data_dir={data}",
            "probes.n_prompts=1", "probes.max_tokens=32", "probes.figures=false",
        )  # fmt: skip
        metrics = run(cfg)
    finally:
        TASKS.unregister("dummy_for_probe_test")
    assert metrics["dummy/acc"] == 1.0 and metrics["probe/n_prompts"] == 1
    (run_dir,) = (tmp_path / "runs").iterdir()
    rec = json.loads((run_dir / "record.json").read_text())
    assert rec["metrics"]["probe/attn_out/rel_fro/mean"] > 0
    assert rec["artifacts"]["probe_prompt_source"] == "coqa"  # no prompt source for this task: CoQA stories


def test_task_registry_import_stays_torch_free():
    """Config validation imports every task plugin (kvq_lab.plugins): that must not import torch."""
    import subprocess
    import sys

    code = "import sys, kvq_lab.plugins as p; assert 'probe' in p.TASKS; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
