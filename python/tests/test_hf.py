"""transformers integration on the CPU: a tiny randomly initialised Llama
(GQA, RoPE) generating with a KvccCache, and the codes attention on BERT."""

import pytest
import torch
import transformers

import kvcc
import kvcc.hf
from kvcc.hf import KvccCache, KvccOptions
from kvcc.specs import restate

kvcc.hf.register()


def tiny_llama(attn):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=512,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def generate(model, prompt, cache=None, new=24):
    with torch.no_grad():
        return model.generate(
            prompt,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **({kvcc.hf.cache_argument(model): cache} if cache is not None else {}),
        )


def prompt(batch=2, tokens=150):
    return torch.randint(1, 256, (batch, tokens), generator=torch.Generator().manual_seed(1))


def test_dense_kvcc_cache_generates_the_default_tokens():
    ids = prompt()
    reference = generate(tiny_llama("sdpa"), ids)
    model = tiny_llama("kvcc")
    cache = KvccCache(model.config, KvccOptions(spec="dense_f16", window=16), batch=2, max_tokens=256)
    out = generate(model, ids, cache)
    assert torch.equal(out, reference)
    # The prompt's older whole pages were compressed into the format's tier.
    layer = cache.layers[0]
    assert layer.live.lengths() == [150 + 23, 150 + 23]
    assert cache.get_seq_length() == 173


def test_options_choose_a_compressed_spec():
    model = tiny_llama("kvcc")
    options = KvccOptions(spec="kivi", tier="int4", window=32)
    cache = KvccCache(model.config, options, batch=2, max_tokens=256)
    out = generate(model, prompt(), cache, new=8)
    assert out.shape == (2, 158)
    live = cache.layers[1].live
    assert live.policy["tier"] == 1 and live.format.name == "kivi"


def test_several_new_tokens_in_one_step_stay_causal():
    """Appending a chunk attends token by token: the same as single steps."""
    model = tiny_llama("kvcc")
    ids = prompt(batch=1, tokens=100)
    extra = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    arg = kvcc.hf.cache_argument(model)
    with torch.no_grad():
        a = KvccCache(model.config, KvccOptions(spec="dense_f16", window=16))
        model(ids, **{arg: a})
        chunk = model(extra, **{arg: a}).logits
        b = KvccCache(model.config, KvccOptions(spec="dense_f16", window=16))
        model(ids, **{arg: b})
        steps = torch.cat([model(extra[:, i : i + 1], **{arg: b}).logits for i in range(5)], 1)
    torch.testing.assert_close(chunk, steps, rtol=1e-4, atol=1e-4)


def test_codes_attention_on_a_tiny_bert():
    """Every token on the codes: dense_f16 re-stated at the head width gives
    the exact embeddings; a 4-bit tier stays close."""
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1, 100, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = model(ids).last_hidden_state
        model.config._attn_implementation = "kvcc_codes"
        capture = kvcc.hf.CodesContext(capture={})
        model(ids, kvcc_codes=capture)
        for name, tier, bound in [("dense_f16", "f16", 1e-3), ("kivi", "int4", 0.2)]:
            fmt = kvcc.Format.parse(restate(kvcc.Format.bundled()[name], 32))
            assert fmt.head_dim == 32
            tables = {
                layer: fmt.train(torch.cat([k for k, _ in kv], 1), torch.cat([v for _, v in kv], 1))
                for layer, kv in capture.capture.items()
            }
            codes = kvcc.hf.CodesContext(format=fmt, tier=tier, tables=tables)
            approx = model(ids, kvcc_codes=codes).last_hidden_state
            err = ((approx - exact).norm() / exact.norm()).item()
            assert err < bound, (name, err)


def test_every_bundled_spec_restates_at_head_dim_32():
    for name, source in kvcc.Format.bundled().items():
        fmt = kvcc.Format.parse(restate(source, 32), name)
        assert fmt.head_dim == 32 and fmt.tiers == kvcc.Format.load(name).tiers


def test_a_kvcc_cache_without_the_kvcc_attention_is_refused():
    model = tiny_llama("sdpa")
    cache = KvccCache(model.config)
    arg = kvcc.hf.cache_argument(model)
    ids = prompt(batch=1, tokens=20)
    with torch.no_grad():
        model(ids, **{arg: cache})
        model(ids[:, :1], **{arg: cache})
        try:
            model(ids[:, :1], **{arg: cache})
        except kvcc.KvccError as e:
            assert 'attn_implementation="kvcc"' in str(e)
        else:
            raise AssertionError("a second step without the kvcc attention must fail")


def test_padded_batches_are_refused():
    model = tiny_llama("kvcc")
    ids = prompt(batch=2, tokens=40)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding of the second sequence
    cache = KvccCache(model.config, batch=2)
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           pad_token_id=0, **{kvcc.hf.cache_argument(model): cache})
    except kvcc.KvccError as e:
        assert "padded batches" in str(e)
    else:
        raise AssertionError("a padded batch must be refused")


def test_a_step_checks_its_mask_once_for_every_layer(monkeypatch):
    """The layers of one forward pass share its mask: checking it (a wait for
    the GPU on CUDA) once is enough; each new pass checks its own."""
    calls = []
    check = kvcc.hf._hides_cached

    def counted(mask, queries, tokens):
        calls.append(tokens)
        return check(mask, queries, tokens)

    monkeypatch.setattr(kvcc.hf, "_hides_cached", counted)
    model = tiny_llama("kvcc")
    assert model.config.num_hidden_layers == 2
    ids = prompt(batch=1, tokens=40)
    arg = kvcc.hf.cache_argument(model)
    cache = KvccCache(model.config, KvccOptions(spec="dense_f16", window=16))
    with torch.no_grad():
        model(ids, **{arg: cache})
        model(ids[:, :3], **{arg: cache})  # 3 new tokens: a causal mask is passed
        model(ids[:, :3], **{arg: cache})
    assert calls == [43, 46]


def test_a_mask_hiding_cached_tokens_is_refused():
    cache = KvccCache(tiny_llama("kvcc").config)
    mask = torch.ones(1, 1, 2, 10, dtype=torch.bool)
    mask[..., 8:] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    kvcc.hf._check_no_padding(cache, mask, 2, 10)  # causal over the new tokens
    for query, token in [(0, 3), (1, 8)]:  # a cached token; the first new one
        bad = mask.clone()
        bad[0, 0, query, token] = False
        try:
            kvcc.hf._check_no_padding(cache, bad, 2, 10)
        except kvcc.KvccError as e:
            assert "padded batches" in str(e)
        else:
            raise AssertionError(f"a mask hiding token {token} must be refused")
    # An additive float mask with the same hole, changed in place after a check.
    additive = torch.zeros(1, 1, 2, 10)
    kvcc.hf._check_no_padding(cache, additive, 2, 10)
    additive[0, 0, 1, 2] = torch.finfo(additive.dtype).min
    try:
        kvcc.hf._check_no_padding(cache, additive, 2, 10)
    except kvcc.KvccError:
        pass
    else:
        raise AssertionError("a mask changed in place after its check must be checked again")


def test_given_tables_are_used_and_checked():
    """Tables trained apart (one per layer) open every layer's cache in place
    of tables trained on the prompt; a list for another number of layers is
    refused."""
    model = tiny_llama("kvcc")
    ids = prompt(batch=1, tokens=100)
    fmt = kvcc.Format.load("subspace")
    noise = torch.randn(1, 256, 128, generator=torch.Generator().manual_seed(5))
    tables = [fmt.train(noise, noise) for _ in range(2)]
    arg = kvcc.hf.cache_argument(model)

    def step_logits(cache):
        with torch.no_grad():
            model(ids, **{arg: cache})
            return model(ids[:, :1], **{arg: cache}).logits

    options = KvccOptions(spec=fmt, window=0)
    given = step_logits(KvccCache(model.config, options, tables=tables))
    again = step_logits(KvccCache(model.config, options, tables=tables))
    trained = step_logits(KvccCache(model.config, options))
    assert torch.equal(given, again)
    assert not torch.allclose(given, trained, rtol=1e-4, atol=1e-4)
    try:
        KvccCache(model.config, options, tables=tables[:1])
    except kvcc.KvccError as e:
        assert "tables for 1 layers" in str(e)
    else:
        raise AssertionError("tables for the wrong number of layers must be refused")


def test_sliding_window_layers_keep_the_default_window():
    """A Gemma 3 model with local (sliding-window) and global layers: the
    sliding layers keep transformers' exact window, the global one is a kvcc
    live cache, and dense_f16 generates the default cache's tokens."""
    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
    )

    def model(attn):
        torch.manual_seed(0)
        config._attn_implementation = attn
        return transformers.Gemma3ForCausalLM(config).eval()

    ids = prompt(batch=1, tokens=100)
    reference = generate(model("sdpa"), ids)
    gemma = model("kvcc")
    cache = KvccCache(gemma.config, KvccOptions(spec="dense_f16", window=16))
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "KvccLayer"]
    assert torch.equal(generate(gemma, ids, cache), reference)
    assert cache.kvcc_layers[0].live.lengths() == [100 + 23]
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.kvcc_layers[0].live.lengths() == []


def test_selection_applies_from_the_layer_the_options_say():
    """Layers before `select_from_layer` read every page: with it at the
    model's depth the selecting spec generates what the spec without its
    `[cache.select]` generates."""
    source = kvcc.Format.bundled()["dense_f16"] + '\n[cache]\nsinks = 4\nwindow = 16\n\n[cache.select]\nmethod = "quest"\npages = 1\n'
    fmt = kvcc.Format.parse(source, "select.toml")
    plain = fmt.without_select()
    assert fmt.bytes_per_token(None, 4096) > plain.bytes_per_token(None, 4096)
    model = tiny_llama("kvcc")
    ids = prompt(batch=1, tokens=300)
    outs = {}
    for name, spec, first in [("plain", plain, 0), ("dense layers", fmt, 2), ("layer 1 selects", fmt, 1)]:
        cache = KvccCache(model.config, KvccOptions(spec=spec, select_from_layer=first), max_tokens=400)
        outs[name] = generate(model, ids, cache, new=8)
        reads = [layer.live.format.bytes_per_token(None, 4096) for layer in cache.layers]
        assert reads == [fmt.bytes_per_token(None, 4096) if i >= first and spec is fmt
                         else plain.bytes_per_token(None, 4096) for i in range(2)], name
    assert torch.equal(outs["dense layers"], outs["plain"])


def _budgeted_kivi(bytes_per_token, refresh=64):
    """KIVI with a 16-token exact window and a `[cache.budget]` table."""
    kivi = kvcc.Format.bundled()["kivi"]
    head, tiers = kivi.split("\n[[tier]]", 1)
    head = "\n".join(l for l in head.splitlines() if not l.startswith(("[cache]", "window")))
    budget = (f"\n[cache]\nsinks = 4\nwindow = 16\n\n[cache.budget]\nbytes_per_token = {bytes_per_token}\n"
              f"refresh = {refresh}\nobserve = 8\n")
    return kvcc.Format.parse(head + budget + "\n[[tier]]" + tiers, "budget.toml")


def test_a_budget_cache_weighs_the_prompt_by_the_queries_its_attention_sees():
    """The prompt of a `[cache.budget]` layer waits for the attention
    function's queries; handing the same queries through `cache_kwargs`
    (as the quality harness does) builds the same cache and generates the
    same tokens; a prompt whose queries never come is an error."""
    fmt = _budgeted_kivi(100.0)
    assert fmt.budget()["bytes_per_token"] == 100.0 and fmt.budget()["score"] == "rd"
    model = tiny_llama("kvcc")
    ids = prompt(batch=1, tokens=300)
    cache = KvccCache(model.config, KvccOptions(spec=fmt), max_tokens=400)
    through_attention = generate(model, ids, cache, new=80)
    # The same prompt's queries captured, then given to the cache's update.
    from transformers import DynamicCache
    from kvcc.quality.measure import PROMPT_QUERY_ROWS

    dense = DynamicCache()
    with torch.no_grad(), kvcc.hf.capture_queries(PROMPT_QUERY_ROWS) as queries:
        logits = model(ids, **{kvcc.hf.cache_argument(model): dense}).logits[:, -1]
    given = KvccCache(model.config, KvccOptions(spec=fmt), max_tokens=400)
    for i, layer in enumerate(dense.layers):
        given.update(layer.keys, layer.values, i, {"kvcc_queries": queries[i]})
    tokens = [int(logits.argmax())]
    with torch.no_grad():
        for _ in range(79):
            step = torch.tensor([[tokens[-1]]])
            out = model(step, **{kvcc.hf.cache_argument(model): given})
            tokens.append(int(out.logits[0, -1].argmax()))
    assert tokens == through_attention[0, 300:].tolist()
    # Keys and values without their queries, and no attention to bring them.
    lost = KvccCache(model.config, KvccOptions(spec=fmt), max_tokens=400)
    lost.update(dense.layers[0].keys, dense.layers[0].values, 0)
    with pytest.raises(kvcc.KvccError, match="queries did not reach"):
        lost.update(dense.layers[0].keys[..., :1, :], dense.layers[0].values[..., :1, :], 0)
