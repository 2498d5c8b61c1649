"""attn_implementation="flexmask" in Hugging Face transformers (skipped when transformers is not
installed): a tiny Llama from a config (random weights, no download) whose logits and parameter
gradients through flexmask match "sdpa" given the same batch. The float64 SDPA model is the
truth and the float32 SDPA model the same math in the input dtype (the DESIGN.md section 4 rule,
applied to the whole model), on CPU under the interpreter and in bf16 on the GPU. Models with
score terms (Gemma 2's softcap, gpt-oss's sinks, both with alternating sliding-window layers)
are checked the same way against transformers' own "eager" attention, which applies the terms
(SDPA does not).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
fm_transformers = pytest.importorskip("flexmask.integrations.transformers")

from conftest import assert_close_to_reference, default_floor  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16


def tiny_llama_config(**overrides):
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
               initializer_range=0.2)  # weights large enough that attention is far from uniform
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def models(cfg, dtype, device, oracle_dtype=torch.float64, reference="sdpa", init=None):
    """(oracle `reference`, `reference` in dtype, flexmask in dtype): one set of weights, `init(model)`
    applied to them first when given. Each model gets its own copy of the config: from_config
    writes the attention implementation into the config."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=reference)
    if init is not None:
        init(base)
    out = []
    for impl, dt in ((reference, oracle_dtype), (reference, dtype), ("flexmask", dtype)):
        m = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
        m.load_state_dict(base.state_dict())
        out.append(m.to(device=device, dtype=dt))
    assert out[2].config._attn_implementation == "flexmask"
    return out


def logits_and_grads(model, batch, valid, targets):
    model.zero_grad()
    logits = model(**batch, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[valid].double(), targets[valid], reduction="sum")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach()[valid], grads


def check_parity(cfg, batch, valid, dtype=FP32, device="cpu", reference="sdpa", init=None):
    """flexmask's logits (at the real tokens) and every parameter gradient against the oracle."""
    oracle, sdpa, flex = models(cfg, dtype, device, reference=reference, init=init)
    gen = torch.Generator().manual_seed(1)
    targets = torch.randint(0, cfg.vocab_size, valid.shape, generator=gen).to(device)
    ref64 = logits_and_grads(oracle, batch, valid, targets)
    lowp = logits_and_grads(sdpa, batch, valid, targets)
    got = logits_and_grads(flex, batch, valid, targets)
    floor = default_floor(dtype)
    assert_close_to_reference(got[0], ref64[0], lowp[0], floor, name="logits")
    for name in ref64[1]:
        assert_close_to_reference(got[1][name], ref64[1][name], lowp[1][name], floor, name=f"grad {name}")
    return oracle, ref64


def packed_position_ids(rows):
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])


def test_packed_batch_matches_sdpa(monkeypatch):
    """Packed documents found from position_ids resets (two rows with their own documents,
    including a 1-token one), as transformers' SDPA path reads them; the tile tables are built
    once per forward and shared by every layer (and by the backward)."""
    monkeypatch.setattr(fm_transformers, "_PLANS", fm_transformers.PlanCache(size=8))
    builds = []
    real = fm_transformers.compile_intervals
    monkeypatch.setattr(fm_transformers, "compile_intervals", lambda *a: builds.append(a[1:]) or real(*a))

    cfg = tiny_llama_config()
    rows = [[1, 30, 33], [50, 14]]
    position_ids = packed_position_ids(rows)
    ids = torch.randint(0, cfg.vocab_size, position_ids.shape, generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    oracle, ref64 = check_parity(cfg, {"input_ids": ids, "position_ids": position_ids}, valid)
    assert builds == [(64, 64)], f"expected one table build for {cfg.num_hidden_layers} layers, got {builds}"

    # the test can fail: without the document mask the logits are far from the oracle's
    unpacked = oracle(input_ids=ids, use_cache=False).logits[valid]
    assert (unpacked - ref64[0]).abs().max() > 1e-2


def test_padded_batch_matches_sdpa():
    """Ordinary padded batches (a 2-D attention_mask): left padding in one row, right padding in
    the other; logits compared at the real tokens, the loss taken over them."""
    cfg = tiny_llama_config(num_hidden_layers=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones(2, 64, dtype=torch.long)
    attention_mask[0, :10] = 0
    attention_mask[1, 50:] = 0
    check_parity(cfg, {"input_ids": ids, "attention_mask": attention_mask}, attention_mask.bool())


def test_kv_cache_decode_and_4d_mask():
    """Decoding with a KV cache (queries bottom-right aligned against the cached keys) and a
    custom 4-D boolean mask handed to the model; flexmask's logits against float64 SDPA."""
    cfg = tiny_llama_config(num_hidden_layers=1)
    oracle, sdpa, flex = models(cfg, FP32, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :6] = 0  # left padding, as batched generation pads

    def decode(model):
        prefill = model(input_ids=ids[:, :37], attention_mask=attention_mask[:, :37], use_cache=True)
        return model(input_ids=ids[:, 37:], attention_mask=attention_mask, past_key_values=prefill.past_key_values,
                     use_cache=True).logits

    ref64, lowp, got = (decode(m).detach() for m in (oracle, sdpa, flex))
    assert_close_to_reference(got, ref64, lowp, default_floor(FP32), name="decode logits")

    # prefix-LM over a 2-document batch: a mask no position_ids can express
    s = 40
    doc = torch.arange(s) >= 15
    allowed = (doc[:, None] == doc[None, :]) & ((torch.arange(s)[None, :] <= torch.arange(s)[:, None])
                                                | (torch.arange(s)[None, :] < 5))
    mask4d = allowed.view(1, 1, s, s)

    def forward(model, mask):
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.detach()

    ids = ids[:1]
    ref64, lowp, got = forward(oracle, mask4d), forward(sdpa, mask4d), forward(flex, mask4d)
    assert_close_to_reference(got, ref64, lowp, default_floor(FP32), name="4-D mask logits")


ALTERNATING = ["sliding_attention", "full_attention"]  # Gemma 2's and gpt-oss's layer pattern


def tiny_gemma2_config(**overrides):
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=128,
               max_position_embeddings=512, initializer_range=0.2, sliding_window=16, layer_types=ALTERNATING,
               attn_logit_softcapping=5.0, final_logit_softcapping=None)
    cfg.update(overrides)
    return transformers.Gemma2Config(**cfg)


def tiny_gpt_oss_config(**overrides):
    cfg = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
               max_position_embeddings=512, initializer_range=0.2, sliding_window=16, layer_types=ALTERNATING,
               experts_implementation="eager")  # the grouped-matmul experts take no float64
    cfg.update(overrides)
    return transformers.GptOssConfig(**cfg)


@torch.no_grad()
def large_sinks(model):
    """Sinks of a few units, per head (gpt-oss initialises them near 0, where they barely matter)."""
    gen = torch.Generator().manual_seed(6)
    for layer in model.model.layers:
        sinks = layer.self_attn.sinks
        sinks.copy_(torch.randn(sinks.shape, generator=gen) * 2 + 1)


def padded_batch(cfg, seed=3, s=64):
    """Right padding, of different lengths per row. (Not left padding: transformers' float64 eager
    attention turns the padded rows' fully masked scores into NaN, which reach the real rows.)"""
    ids = torch.randint(0, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(seed))
    attention_mask = torch.ones(2, s, dtype=torch.long)
    attention_mask[0, 58:] = 0
    attention_mask[1, 50:] = 0
    return {"input_ids": ids, "attention_mask": attention_mask}, attention_mask.bool()


def eager_logits(cfg, batch, valid, init=None):
    oracle = models(cfg, FP32, "cpu", reference="eager", init=init)[0]
    return oracle(**batch, use_cache=False).logits.detach()[valid]


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_gemma2_softcap_and_windows_match_eager(kind):
    """Gemma 2: logit soft-capping (transformers passes config.attn_logit_softcapping as softcap=)
    on alternating 16-token sliding-window and full layers; logits and every gradient against
    transformers' eager attention."""
    cfg = tiny_gemma2_config()
    if kind == "padded":
        batch, valid = padded_batch(cfg)
    else:
        position_ids = packed_position_ids([[20, 44], [64]])
        ids = torch.randint(0, cfg.vocab_size, position_ids.shape, generator=torch.Generator().manual_seed(7))
        batch, valid = {"input_ids": ids, "position_ids": position_ids}, torch.ones_like(ids, dtype=torch.bool)
    _, ref64 = check_parity(cfg, batch, valid, reference="eager")
    # the test can fail: the cap and the window each change the logits well beyond the tolerance
    for change in ({"attn_logit_softcapping": None}, {"layer_types": ["full_attention"] * 2}):
        assert (eager_logits(tiny_gemma2_config(**change), batch, valid) - ref64[0].float()).abs().max() > 1e-2, change


def per_document(model, ids, rows, targets):
    """What packing means: the logits and summed-loss gradients of a packed batch computed one
    document at a time (batch 1, positions from 0), in the packed batch's token order."""
    model.zero_grad()
    logits, start = [], 0
    for b, lens in enumerate(rows):
        start = 0
        for n in lens:
            part = model(input_ids=ids[b:b + 1, start:start + n], use_cache=False).logits[0]
            torch.nn.functional.cross_entropy(part.double(), targets[b, start:start + n], reduction="sum").backward()
            logits.append(part.detach())
            start += n
    return torch.cat(logits), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_gpt_oss_sinks_and_windows_match_eager():
    """gpt-oss: a learnable sink per head (the attention module's `sinks`, passed as s_aux=) on
    alternating 16-token sliding-window and full layers, in a padded batch; logits and every
    gradient, the sinks' included, against transformers' eager attention."""
    cfg = tiny_gpt_oss_config()
    batch, valid = padded_batch(cfg)
    oracle, ref64 = check_parity(cfg, batch, valid, reference="eager", init=large_sinks)
    sink_grads = [g for n, g in ref64[1].items() if n.endswith("sinks")]
    assert len(sink_grads) == cfg.num_hidden_layers and all(float(g.abs().max()) > 0 for g in sink_grads)
    # the test can fail: without the sinks (all -inf: they take no mass) the logits move
    with torch.no_grad():
        for layer in oracle.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
    no_sinks = oracle(**batch, use_cache=False).logits.detach()[valid]
    assert (no_sinks - ref64[0]).abs().max() > 1e-2


def test_gpt_oss_packed_matches_documents_alone():
    """gpt-oss on packed documents (position_ids resets, as FlashAttention's path reads them),
    sinks and windows included, against eager attention run on each document alone. (transformers'
    gpt-oss hands its eager/SDPA mask code no position_ids, so eager on the packed batch would
    attend across documents: the documents alone are the truth.)"""
    cfg = tiny_gpt_oss_config()
    rows = [[1, 30, 33], [64]]
    position_ids = packed_position_ids(rows)
    ids = torch.randint(0, cfg.vocab_size, position_ids.shape, generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=torch.Generator().manual_seed(1))
    oracle, low, flex = models(cfg, FP32, "cpu", reference="eager", init=large_sinks)
    ref64, lowp = per_document(oracle, ids, rows, targets), per_document(low, ids, rows, targets)
    valid = torch.ones_like(ids, dtype=torch.bool)
    got = logits_and_grads(flex, {"input_ids": ids, "position_ids": position_ids}, valid, targets)
    floor = default_floor(FP32)
    assert_close_to_reference(got[0], ref64[0], lowp[0], floor, name="logits")
    for name in ref64[1]:
        assert_close_to_reference(got[1][name], ref64[1][name], lowp[1][name], floor, name=f"grad {name}")


def test_gpt_oss_decode_with_sinks_matches_eager():
    """Decoding with a KV cache through gpt-oss's sliding and full layers, sinks included."""
    cfg = tiny_gpt_oss_config(num_hidden_layers=2)
    oracle, low, flex = models(cfg, FP32, "cpu", reference="eager", init=large_sinks)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(9))

    def decode(model):
        prefill = model(input_ids=ids[:, :37], use_cache=True)
        return model(input_ids=ids[:, 37:], past_key_values=prefill.past_key_values, use_cache=True).logits.detach()

    ref64, lowp, got = (decode(m) for m in (oracle, low, flex))
    assert_close_to_reference(got, ref64, lowp, default_floor(FP32), name="decode logits")


def test_unsupported_options_raise():
    module = torch.nn.Module()
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="no dropout; got dropout=0.1"):
        fm_transformers.flexmask_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"s_aux \(attention sinks\) must be a floating tensor of shape \(Hq=2,\)"):
        fm_transformers.flexmask_attention_forward(module, q, q, q, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        fm_transformers.flexmask_attention_forward(module, q, q, q, None, softcap=-1.0)
    for name in ("position_bias", "sinks", "head_mask"):  # terms flexmask cannot apply: never dropped silently
        with pytest.raises(ValueError, match=f"cannot apply {name}="):
            fm_transformers.flexmask_attention_forward(module, q, q, q, None, **{name: torch.zeros(1, 2, 4, 4)})
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D \(B, kv_len\) or 4-D"):
        fm_transformers.flexmask_attention_forward(module, q, q, q, torch.ones(1, 1, 4, dtype=torch.bool))
    allowed = torch.ones(1, 1, 7, 2, dtype=torch.bool)
    allowed[0, 0, [0, 2, 4], 1] = False  # column 1: rows 0, 2 and 4 masked, three runs
    with pytest.raises(ValueError, match=r"key column 1 \(batch 0, head 0\) masks 3 separate runs"):
        fm_transformers.dense_to_intervals(allowed)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_llama_bf16_gpu(kind):
    """bf16 on the GPU, longer sequences: flexmask against bf16 SDPA and the float64 oracle."""
    cfg = tiny_llama_config(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                            vocab_size=1024)
    gen = torch.Generator().manual_seed(5)
    if kind == "packed":
        rows = [[1, 63, 197, 1000, 787], [2048]]
        position_ids = packed_position_ids(rows)
        ids = torch.randint(0, cfg.vocab_size, position_ids.shape, generator=gen)
        batch, valid = {"input_ids": ids, "position_ids": position_ids}, torch.ones_like(ids, dtype=torch.bool)
    else:
        ids = torch.randint(0, cfg.vocab_size, (2, 2048), generator=gen)
        attention_mask = torch.ones_like(ids)
        attention_mask[0, :300] = 0
        attention_mask[1, 1500:] = 0
        batch, valid = {"input_ids": ids, "attention_mask": attention_mask}, attention_mask.bool()
    batch = {k: v.cuda() for k, v in batch.items()}
    check_parity(cfg, batch, valid.cuda(), dtype=BF16, device="cuda")
